"""The delta rule's and the gated delta rule's chunk form by the native kernel
(``_native/delta_scan.cpp``, built by ``common/native.py``), and when ``delta_rule`` runs it.

``chunk(q, k, v, beta, g, memory, chunk_size, scale)`` is ``chunk.chunk``'s computation (``g``
None) or ``gated.chunk``'s (log decays per step ``[N, T]`` or per key channel ``[N, T, F]``) on
the features ``delta_rule`` made, without gradients: per chunk the writes solve ``(I + A) U =
diag(beta) (V - (K * exp(P)) S)`` by forward substitution, the outputs are ``scale ((Q * exp(P)) S
+ B U)`` and the memory ``exp(P_last) * S + (K * exp(E))^T U`` (the kernel's header comment has
the terms). A row (one sequence's key/value head) is one task, its chunks in order: results do not
depend on the thread count.

**When.** ``impl="auto"`` (``delta_rule``'s argument) runs the kernel for every call of the chunk
form on CPU tensors computed in float32 or float64, outside ``torch.compile``, that records no
gradients (prefill and evaluation: under ``torch.no_grad``, or inputs, feature maps and carried
memories that require none); training runs ``chunk.ChunkDeltaRule`` and ``gated.chunk``, whose
gradients the kernel does not give. ``LINATTN_DELTA_IMPL=torch`` or ``native`` replaces that
choice, and ``impl="native"`` (or ``LINATTN_DELTA_IMPL=native``) for a call the kernel does not
compute is a ``ValueError`` naming why.

**Self-check.** The first time a process would run the kernel in a dtype, it runs ``_CALLS`` both
ways (two query heads per key/value head, T not a multiple of the chunk; without decay, with one
decay per step and with one per channel, each with a reset, each call continuing the memory of
the one before) and compares the outputs and final memories (``max |native - torch| <= RTOL *
max |torch|``). A build or a check that fails is the verdict for the rest of the process:
``impl="auto"`` warns once, naming it, and runs the torch forms; ``impl="native"`` raises
``RuntimeError``.
"""

from __future__ import annotations

import math

import torch

from ..common import native
from ..common.decay import CHANNEL_CHUNK
from ..common.native import first_difference
from . import chunk as chunk_form
from . import gated

ENV = "LINATTN_DELTA_IMPL"
IMPLS = ("auto", "torch", "native")
DTYPES = (torch.float32, torch.float64)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
_SHAPE = dict(N=3, G=2, F=5, E=4, chunk=4)
# (T, decay: None, "step" or "channel", scale) of the self-check's calls, each continuing the memory
# of the one before; a decayed call has a reset halfway
_CALLS = ((11, None, 0.7), (13, "step", 1.0), (6, "channel", 0.5))


def reset() -> None:
    """Forget the self-check's verdicts and warnings (tests); the built library stays loaded."""
    _trust.reset()


def unsupported(q: torch.Tensor, dtype: torch.dtype, mode: str, differentiable: bool) -> str | None:
    """Why the kernel does not compute a ``delta_rule`` call (None when it does): ``q`` its
    queries, ``dtype`` the dtype it computes in, ``mode`` its resolved form, ``differentiable``
    whether it must record gradients."""
    reason = native.unsupported_tensors(q.device, dtype, DTYPES)
    if reason is not None:
        return reason
    if mode != "chunk":
        return f"computes mode='chunk', got mode={mode!r}"
    if differentiable:
        return "computes the chunk form without gradients: under torch.no_grad, or for inputs that require none"
    return None


def use_native(impl: str, q: torch.Tensor, dtype: torch.dtype, mode: str, differentiable: bool) -> bool:
    """Whether a ``delta_rule(impl=...)`` call runs the kernel (module docstring)."""
    return _trust.choose(impl, ENV, unsupported(q, dtype, mode, differentiable), dtype, "delta rule",
                         f"delta_rule uses the torch chunk forms in {dtype} from now on ({ENV}=torch chooses them "
                         "without trying the kernel)")


def verdict(dtype: torch.dtype) -> str | None:
    """None when the kernel builds and agrees with the torch forms in ``dtype``, else what failed;
    the check runs at the first ask per dtype."""
    return _trust.verdict(dtype)


def chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
          memory: torch.Tensor, chunk_size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale * out [N, G, T, E], final memory [N, F, E])`` from the features ``q [N, G, T, F]``,
    ``k [N, T, F]``, values ``v [N, T, E]``, ``beta [N, T]``, log decays ``g`` (None, ``[N, T]`` or
    ``[N, T, F]``) and ``memory [N, F, E]``, one dtype, without gradients. A per-channel decay takes
    chunks of at most ``CHANNEL_CHUNK`` positions (its pairwise scores grow with the chunk)."""
    if g is not None:
        if g.dim() == 3:
            chunk_size = min(chunk_size, CHANNEL_CHUNK)
        else:
            g = g.unsqueeze(-1)
    q, k, v, beta, g, memory = (None if t is None else t.detach().contiguous() for t in (q, k, v, beta, g, memory))
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    final = torch.empty_like(memory)
    native.extension().delta_scan_forward(q, k, v, beta, g, memory, chunk_size, float(scale), out, final)
    return out, final


def _torch_chunk(q, k, v, beta, g, memory, chunk_size, scale):
    """The torch forms of ``chunk``'s computation."""
    if g is None:
        return chunk_form.chunk(q, k, v, beta, memory, chunk_size, scale)
    out, memory = gated.chunk(q, k, v, beta, g, memory, chunk_size)
    return out * scale, memory


def _run_check(dtype: torch.dtype) -> str | None:
    """``_CALLS`` by the kernel and by the torch forms: None when every output and final memory
    agree, else the first difference."""
    results = {way: _outcomes(dtype, way) for way in ("native", "torch")}
    return first_difference(results["native"], results["torch"], RTOL[dtype])


def _outcomes(dtype: torch.dtype, way: str) -> dict[str, torch.Tensor]:
    """The check's calls by ``way``: outputs and final memories by name."""
    s = _SHAPE
    gen = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def unit(x):
        return (x / x.norm(dim=-1, keepdim=True)).to(dtype)

    memory, results = draw(s["N"], s["F"], s["E"]).to(dtype), {}
    compute = chunk if way == "native" else _torch_chunk
    with torch.no_grad():
        for call, (T, decay, scale) in enumerate(_CALLS):
            q, k = unit(draw(s["N"], s["G"], T, s["F"])), unit(draw(s["N"], T, s["F"]))
            v, beta = draw(s["N"], T, s["E"]).to(dtype), torch.rand(s["N"], T, generator=gen, dtype=torch.float64)
            g = None
            if decay is not None:
                g = -draw(s["N"], T, *((s["F"],) if decay == "channel" else ())).abs()
                g[:, T // 2] = -math.inf
                g = g.to(dtype)
            out, memory = compute(q, k, v, beta.to(dtype), g, memory, s["chunk"], scale)
            results[f"output {call}"], results[f"memory {call}"] = out, memory
    return results


_trust = native.Trust(lambda dtype: _run_check(dtype))
