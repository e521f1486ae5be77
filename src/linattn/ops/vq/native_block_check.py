"""When ``vq_attention`` runs its block form by the native kernels (``native_block.py``).

The kernels compute the causal block form and its gradients for hard codes, without
ReRoPE, on CPU tensors computed in float32 or float64 (bias tables, position keys, query
groups, carried states and any T included), with gradients for grad_scope ``"cache"`` and
``"state"`` (not ``"none"``, whose cache carries gradients, nor a carried cache that requires
them). ``impl="native"`` asks for them and a call they do not compute is a ``ValueError``
naming why; ``impl="auto"`` on a CPU takes them for every call they compute and the torch
forms for the others (soft codes, ReRoPE, grad_scope ``"none"``), as ``LINATTN_VQ_IMPL=native``
or ``torch`` may replace.

**Self-check.** The first time a process would run the kernels in a dtype, it runs two calls
both ways (``_SHAPE``: two kv heads of two queries, a bias table and position keys, T not a
multiple of L, the second call continuing the first's state), without gradients and with
them, and compares the outputs, the final caches and the gradients of every input
(``max |native - torch| <= RTOL * max |torch|``: 1e-12 in float64, 1e-5 in float32). A
build or a check that fails is the verdict for the rest of the process: ``impl="auto"``
warns once, naming it, and runs the torch forms from then on; ``impl="native"`` raises
``RuntimeError``.
"""

from __future__ import annotations

import torch

from ...state import VQAttentionState
from ..common import native
from ..common.native import first_difference
from .block import block_form

DTYPES = (torch.float32, torch.float64)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
_SHAPE = dict(B=2, Hkv=2, G=2, L=4, S=8, D=8, E=6, T=(11, 6))


def reset() -> None:
    """Forget the self-check's verdicts and warnings (tests); the built library stays loaded."""
    _trust.reset()


def unsupported(q: torch.Tensor, dtype: torch.dtype, codes: torch.Tensor, rerope, scope: str = "cache",
                state: VQAttentionState | None = None) -> str | None:
    """Why the kernels do not compute a call (None when they do): ``q`` the queries, ``dtype``
    the dtype the call computes in, ``codes`` its codes, ``rerope`` its ReRoPE window (or None),
    ``scope`` its grad_scope, ``state`` the state it continues (or None)."""
    reason = native.unsupported_tensors(q.device, dtype, DTYPES)
    if reason is not None:
        return reason
    if codes.is_floating_point():
        return "takes hard codes, not soft ones"
    if rerope is not None:
        return "has no ReRoPE form (rerope=)"
    if torch.is_grad_enabled():
        if scope == "none":
            return "computes gradients for grad_scope 'cache' or 'state', not 'none' (the cache's gradient)"
        if scope == "cache" and state is not None and (
                state.cache_means.requires_grad or state.cache_counts.requires_grad):
            return "sends no gradient into a carried cache, and this state's cache requires gradients"
    return None


def use_native(strict: bool, q: torch.Tensor, dtype: torch.dtype, codes: torch.Tensor, rerope, scope: str = "cache",
               state: VQAttentionState | None = None) -> bool:
    """Whether the block form of this call runs the kernels; ``strict``: they were asked for
    (``impl="native"`` or ``LINATTN_VQ_IMPL=native``), so a call they cannot compute, or a failed
    self-check, is an error instead of the torch forms."""
    reason = unsupported(q, dtype, codes, rerope, scope, state)
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
    """Two calls (the second continuing the first) by the kernels and by the torch form, without
    gradients and then with them: None when the outputs, the final caches and the gradients of
    every input agree (module docstring), else the first difference."""
    for grad in (False, True):
        results = {schedule: _outcomes(dtype, schedule, grad) for schedule in ("native", "batched")}
        failure = first_difference(results["native"], results["batched"], RTOL[dtype],
                                   " (with gradients)" if grad else "")
        if failure is not None:
            return failure
    return None


def _outcomes(dtype: torch.dtype, schedule: str, grad: bool) -> dict[str, torch.Tensor]:
    """The check's two calls by ``schedule``: outputs and final caches by name, with ``grad``
    also the gradients of a weighted sum of the outputs w.r.t. queries, keys, values,
    codebook, bias table and position keys."""
    s = _SHAPE
    g = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)

    codebook = draw(s["Hkv"], s["S"], s["D"])
    table = draw(s["Hkv"], s["G"], s["L"] + 1)
    position_keys = (0.5 * draw(s["Hkv"], s["G"], s["L"] + 1, s["D"])).detach().requires_grad_(grad)
    leaves = {"codebook": codebook, "table": table, "position keys": position_keys}
    results, state, steps, loss = {}, None, 0, 0.0
    scale = 0.5 if schedule == "native" else 1.0  # the native form scales q itself
    with torch.set_grad_enabled(grad):
        for call, T in enumerate(s["T"]):
            codes = torch.randint(0, s["S"], (s["B"], s["Hkv"], T), generator=g)
            keys = codebook.detach()[torch.arange(s["Hkv"])[None, :, None], codes].requires_grad_(grad)
            q, v = draw(s["B"], s["Hkv"], s["G"], T, s["D"]), draw(s["B"], s["Hkv"], T, s["E"])
            leaves.update({f"q {call}": q, f"keys {call}": keys, f"v {call}": v})
            out, pieces = block_form(q * (1.0 / scale), keys, v, codes, codebook, table, position_keys, s["L"],
                                     "cache", state, dtype, schedule, None, scale)
            weights = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
            loss = loss + (out * weights).sum()
            results.update({f"output {call}": out, f"cache counts {call}": pieces["cache"][0],
                            f"cache means {call}": pieces["cache"][1]})
            steps += T
            state = _state(pieces, steps, s["L"])
        if grad:
            grads = torch.autograd.grad(loss, list(leaves.values()))
            results.update({f"gradient of {name}": grad_ for name, grad_ in zip(leaves, grads)})
    return {name: value.detach() for name, value in results.items()}


def _state(pieces: dict, steps: int, block_size: int) -> VQAttentionState:
    """The state ``block_form``'s pieces make after ``steps`` positions."""
    partial_keys, partial_values, partial_codes = pieces["partial"]
    prev_keys, prev_values, prev_codes = pieces["prev"]
    counts, means = pieces["cache"]
    return VQAttentionState(partial_keys=partial_keys, partial_values=partial_values, partial_codes=partial_codes,
                            cache_counts=counts, cache_means=means, prev_keys=prev_keys, prev_values=prev_values,
                            prev_codes=prev_codes, steps=steps, block_size=block_size, codebook_size=counts.shape[-1])


_trust = native.Trust(lambda dtype: _run_check(dtype))
