"""Whether ``vq_decode_step`` runs the native C++ step (``native.py``) or the torch form.

**Self-check.** The first time a process would run the native step in a dtype, it runs
a short decoding sequence both ways (``_SHAPE``: two kv heads of two queries, three blocks;
once with bias and position keys, once with ReRoPE of window 3) and compares outputs (``max |native - torch| <= RTOL *
max |torch|``: 1e-12 in float64, 1e-5 in float32) and codes (equal). A build that fails or a
check that fails is the verdict for the rest of the process: ``impl="auto"`` warns once,
naming it, and runs the torch form from then on; ``impl="native"`` raises ``RuntimeError``.

``LINATTN_VQ_STEP_IMPL``: ``torch`` or ``native`` replaces what ``impl="auto"`` chooses (an
explicit ``impl=`` argument wins). ``native`` for tensors that are not on the CPU is a
``ValueError`` naming the variable. Half-precision inputs are computed in float32 (as the
torch form computes them), so they take the native step too.
"""

from __future__ import annotations

import torch

from ..._checks import env_choice, resolve_scale
from ..common import native
from ..common.native import relative_error
from .resident import quantizing_step

ENV = "LINATTN_VQ_STEP_IMPL"
IMPLS = ("auto", "torch", "native")
DTYPES = (torch.float32, torch.float64)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
_SHAPE = dict(B=2, H=4, Hkv=2, L=4, S=8, Dk=8, Dv=6, steps=11)


def forced_impl() -> str | None:
    """``LINATTN_VQ_STEP_IMPL`` (``"torch"`` or ``"native"``), None when unset or empty."""
    return env_choice(ENV, ("torch", "native"))


def reset() -> None:
    """Forget the self-check's verdicts and warnings (tests); the built library stays loaded."""
    _trust.reset()


def unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the native step does not apply to ``device`` and ``dtype`` (None when it does)."""
    if device.type != "cpu":
        return f"runs on CPU tensors, got {device.type}"
    if dtype not in DTYPES:
        return f"computes in float32 or float64, got {dtype}"
    return None


def verdict(dtype: torch.dtype) -> str | None:
    """None when the native step builds and agrees with the torch form in ``dtype``, else
    what failed; the check runs at the first ask per dtype."""
    return _trust.verdict(dtype)


def use_native(impl: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``vq_decode_step(impl=...)`` runs the native step for inputs on ``device``
    computed in ``dtype`` (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    reason = unsupported(device, dtype)
    return _trust.choose(impl, ENV, reason, dtype, "VQ decoding step",
                         f"vq_decode_step uses the torch form in {dtype} from now on ({ENV}=torch chooses it "
                         f"without trying the native step, {ENV}=native makes this an error)")


def choice(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """What ``vq_decode_step(impl="auto")`` runs on ``device`` in ``dtype``, and why (for
    ``linattn doctor``); builds and checks the native step where it would run it."""
    try:
        forced = forced_impl()
    except ValueError as error:
        return "error", str(error)
    if forced == "torch":
        return "torch", f"{ENV}=torch"
    reason = unsupported(device, dtype)
    if reason is not None:
        if forced:
            return "error", f"{ENV}=native, but the native step {reason}"
        return "torch", f"the native step {reason}"
    failure = verdict(dtype)
    if failure is not None:
        return ("error" if forced else "torch"), f"the native step failed: {failure}"
    return "native", (f"{ENV}=native" if forced else "compiled for this CPU and agrees with the torch form") + (
        f" ({native.build_directory()})")


def _run_check(dtype: torch.dtype) -> str | None:
    """One decoding sequence with the native step and with the torch form: None when they
    agree (module docstring), else the first difference."""
    s = _SHAPE
    g = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    codebook = draw(s["Hkv"], s["S"], s["Dk"])
    bias, position_keys = draw(s["H"], s["L"] + 1), 0.5 * draw(s["H"], s["L"] + 1, s["Dk"])
    inputs = [(draw(s["B"], s["H"], 1, s["Dk"]), draw(s["B"], s["Hkv"], 1, s["Dk"]), draw(s["B"], s["Hkv"], 1, s["Dv"]))
              for _ in range(s["steps"])]
    scale = resolve_scale(None, s["Dk"])
    runs = {}
    with torch.no_grad():
        for positions in ((bias, position_keys, None), (None, None, (3, 10000.0))):
            for native in (True, False):
                state, outs = None, []
                for q, k, v in inputs:
                    out, codes, state = quantizing_step(q, k, v, codebook, state, scale, s["L"], *positions[:2],
                                                        native, positions[2])
                    outs.append((out, codes))
                runs.setdefault(native, []).extend(outs)
    for step, ((out, codes), (want, want_codes)) in enumerate(zip(runs[True], runs[False])):
        if not torch.equal(codes, want_codes):
            return f"step {step}: codes {codes.flatten().tolist()}, the torch form's {want_codes.flatten().tolist()}"
        if not bool(torch.isfinite(out).all()):
            return f"step {step}: the output has non-finite values"
        error = relative_error(out, want)
        if not error <= RTOL[dtype]:
            return f"step {step}: the output differs by {error:.3g} of its largest value (tolerance {RTOL[dtype]:g})"
    return None


_trust = native.Trust(lambda dtype: _run_check(dtype))
