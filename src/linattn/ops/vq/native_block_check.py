"""When ``vq_attention`` runs its block form by the native kernel (``native_block.py``).

The kernel computes the causal block form without gradients for hard codes, without
ReRoPE, on CPU tensors computed in float32 or float64 (bias tables, position keys, query
groups, carried states and any T included). ``impl="native"`` asks for it and a call it
does not compute is a ``ValueError`` naming why; ``impl="auto"`` on a CPU takes it for
every call it computes and the torch forms for the others (with gradients, soft codes,
ReRoPE), as ``LINATTN_VQ_IMPL=native`` or ``torch`` may replace.

**Self-check.** The first time a process would run the kernel in a dtype, it runs two calls
both ways (``_SHAPE``: two kv heads of two queries, a bias table and position keys, T not a
multiple of L,
the second call continuing the first's state) and compares the outputs and the final cache
(``max |native - torch| <= RTOL * max |torch|``: 1e-12 in float64, 1e-5 in float32). A
build or a check that fails is the verdict for the rest of the process: ``impl="auto"``
warns once, naming it, and runs the torch forms from then on; ``impl="native"`` raises
``RuntimeError``.
"""

from __future__ import annotations

import torch

from ...state import VQAttentionState
from . import native
from .native import relative_error
from .block import block_form

DTYPES = (torch.float32, torch.float64)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
_SHAPE = dict(B=2, Hkv=2, G=2, L=4, S=8, D=8, E=6, T=(11, 6))


def reset() -> None:
    """Forget the self-check's verdicts and warnings (tests); the built library stays loaded."""
    _trust.reset()


def unsupported(q: torch.Tensor, dtype: torch.dtype, codes: torch.Tensor, rerope) -> str | None:
    """Why the kernel does not compute a call (None when it does): ``q`` the queries, ``dtype``
    the dtype the call computes in, ``codes`` its codes, ``rerope`` its ReRoPE window (or None)."""
    if q.device.type != "cpu":
        return f"runs on CPU tensors, got {q.device.type}"
    if native.tracing():
        return "does not run under torch.compile or torch.export (it reads the tensors' data)"
    if dtype not in DTYPES:
        return f"computes in float32 or float64, got {dtype}"
    if torch.is_grad_enabled():
        return "computes without gradients (under torch.no_grad() or torch.inference_mode())"
    if codes.is_floating_point():
        return "takes hard codes, not soft ones"
    if rerope is not None:
        return "has no ReRoPE form (rerope=)"
    return None


def use_native(strict: bool, q: torch.Tensor, dtype: torch.dtype, codes: torch.Tensor, rerope) -> bool:
    """Whether the block form of this call runs the kernel; ``strict``: it was asked for
    (``impl="native"`` or ``LINATTN_VQ_IMPL=native``), so a call it cannot compute, or a failed
    self-check, is an error instead of the torch forms."""
    reason = unsupported(q, dtype, codes, rerope)
    if reason is not None:
        if strict:
            raise ValueError(f"impl='native': the native VQ block form {reason}; use impl='torch' or 'auto'")
        return False
    return _trust.trusted(dtype, strict, f"the native VQ block form failed in {dtype}",
                          "Use impl='torch' (or impl='auto' without LINATTN_VQ_IMPL=native)",
                          f"vq_attention uses the torch forms in {dtype} from now on (LINATTN_VQ_IMPL=torch chooses "
                          "them without trying the kernel)")


def verdict(dtype: torch.dtype) -> str | None:
    """None when the kernel builds and agrees with the torch form in ``dtype``, else what
    failed; the check runs at the first ask per dtype."""
    return _trust.verdict(dtype)


def _run_check(dtype: torch.dtype) -> str | None:
    """Two calls (the second continuing the first) by the kernel and by the torch form: None
    when they agree (module docstring), else the first difference."""
    s = _SHAPE
    g = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    codebook = draw(s["Hkv"], s["S"], s["D"])
    table = draw(s["Hkv"], s["G"], s["L"] + 1)
    position_keys = 0.5 * draw(s["Hkv"], s["G"], s["L"] + 1, s["D"])
    calls = []
    for T in s["T"]:
        codes = torch.randint(0, s["S"], (s["B"], s["Hkv"], T), generator=g)
        keys = codebook[torch.arange(s["Hkv"])[None, :, None], codes]
        calls.append((draw(s["B"], s["Hkv"], s["G"], T, s["D"]), keys, draw(s["B"], s["Hkv"], T, s["E"]), codes))
    results = {}
    with torch.no_grad():
        for schedule in ("native", "batched"):
            state, outs, steps = None, [], 0
            for q, k, v, codes in calls:
                scale = 0.5 if schedule == "native" else 1.0  # the native form scales q itself
                out, pieces = block_form(q * (1.0 / scale), k, v, codes, codebook, table, position_keys, s["L"],
                                         "cache", state, dtype, schedule, None, scale)
                outs += [out, *pieces["cache"]]
                steps += q.shape[3]
                state = _state(pieces, steps, s["L"])
            results[schedule] = outs
    for i, (got, want) in enumerate(zip(results["native"], results["batched"])):
        if not bool(torch.isfinite(got).all()):
            return f"result {i}: non-finite values"
        error = relative_error(got, want)
        if not error <= RTOL[dtype]:
            return f"result {i}: differs by {error:.3g} of its largest value (tolerance {RTOL[dtype]:g})"
    return None


def _state(pieces: dict, steps: int, block_size: int) -> VQAttentionState:
    """The state ``block_form``'s pieces make after ``steps`` positions."""
    partial_keys, partial_values, partial_codes = pieces["partial"]
    prev_keys, prev_values, prev_codes = pieces["prev"]
    counts, means = pieces["cache"]
    return VQAttentionState(partial_keys=partial_keys, partial_values=partial_values, partial_codes=partial_codes,
                            cache_counts=counts, cache_means=means, prev_keys=prev_keys, prev_values=prev_values,
                            prev_codes=prev_codes, steps=steps, block_size=block_size, codebook_size=counts.shape[-1])


_trust = native.Trust(lambda dtype: _run_check(dtype))
