"""Causal kernel attention's chunk forms by the native kernels (``_native/linear_scan.cpp`` and
``_native/decayed_scan.cpp``, built by ``common/native.py``), and when ``linear_attention`` runs
them.

``scan(q, k, v, S, z, chunk_size)`` is ``forms.chunk``'s computation: ``num_i = phi(q_i)^T S_i``
and ``den_i = phi(q_i) . z_i`` with ``S_i = S_0 + sum_{j<=i} phi(k_j) v_j^T`` and ``z_i = z_0 +
sum_{j<=i} phi(k_j)``, divided (``out = num / (den + eps)``) when asked. The kernel makes elu + 1,
relu and the identity map itself, chunk by chunk in the core's cache (``kernel_map``); other maps
(and ``normalize="sum"``) are made in torch around it, with their shifts and the division
(``attention._attend``). ``decayed`` is ``decay_forms.chunk``'s computation (log decays per step
or per feature channel), without gradients. A row (one sequence's key/value head) is cut into
segments of chunks (``segment_chunks_for``, a function of the shapes), each one task: results do
not depend on the thread count.

Gradients: the backward kernel gives those of q, k, v and the carried state through the map and
the division. Second derivatives (``create_graph=True``) differentiate the torch chunk form
instead (``forms.chunk`` on the same inputs, recomputed in the backward): the same numbers, at the
torch form's speed.

**When.** ``impl="auto"`` (``linear_attention``'s argument) runs the kernels for every causal call
of the chunk form on CPU tensors computed in float32 or float64, outside ``torch.compile``: without
decay always, with decay (``g=``) when the call records no gradients (under ``torch.no_grad``, or
inputs that require none; the decayed kernel has no backward, so training runs
``decay_forms.chunk``). ``LINATTN_LINEAR_IMPL=torch`` or ``native`` replaces that choice, and
``impl="native"`` (or ``LINATTN_LINEAR_IMPL=native``) for a call the kernels do not compute is a
``ValueError`` naming why.

**Self-check.** The first time a process would run the kernels in a dtype, it runs calls both
ways (``_SHAPE``, ``_CALLS``: two query heads per key/value head, T not a multiple of the chunk,
segments of two chunks; elu + 1 made by the kernel and divided, then given features, the second
call continuing the first's state, with gradients; ``_DECAYED_CALLS``: per-channel and per-step
decays with a reset, without gradients) and compares the outputs, final states and gradients of
every input (``max |native - torch| <= RTOL * max |torch|``). A build or a check that fails is the
verdict for the rest of the process: ``impl="auto"`` warns once, naming it, and runs the torch
forms; ``impl="native"`` raises ``RuntimeError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..common import native
from ..common.decay import CHANNEL_CHUNK
from ..common.native import first_difference
from . import decay_forms, forms
from .feature_maps import EluPlusOne, FeatureMap, Identity, ReLU, get_feature_map

ENV = "LINATTN_LINEAR_IMPL"
IMPLS = ("auto", "torch", "native")
DTYPES = (torch.float32, torch.float64)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
_SHAPE = dict(N=3, G=2, F=5, E=4, chunk=4, segment_chunks=2)
# (T, feature map, scale, eps) of the self-check's calls: a map made by the kernel with the
# division, then given features with the denominator returned
_CALLS = ((11, "elu", 0.7, 1e-3), (6, "given", 1.0, None))
# (T, feature map, scale, eps, per channel) of its decayed calls (without gradients), a reset in each
_DECAYED_CALLS = ((11, "identity", 0.7, None, True), (13, "elu", 1.0, 1e-3, False), (6, "given", 1.0, None, True))


def reset() -> None:
    """Forget the self-check's verdicts and warnings (tests); the built library stays loaded."""
    _trust.reset()


def unsupported(q: torch.Tensor, dtype: torch.dtype, causal: bool, mode: str, decayed: bool,
                differentiable: bool = False) -> str | None:
    """Why the kernels do not compute a ``linear_attention`` call (None when they do): ``q`` its
    queries, ``dtype`` the dtype it computes in, ``mode`` its resolved form, ``decayed`` whether
    it has log decays, ``differentiable`` whether it must record gradients."""
    reason = native.unsupported_tensors(q.device, dtype, DTYPES)
    if reason is not None:
        return reason
    if not causal:
        return "computes the causal form (causal=True)"
    if mode != "chunk":
        return f"computes mode='chunk', got mode={mode!r}"
    if decayed and differentiable:
        return ("computes the decayed form (g=) without gradients: under torch.no_grad, or for inputs that "
                "require none")
    return None


def use_native(impl: str, q: torch.Tensor, dtype: torch.dtype, causal: bool, mode: str, decayed: bool,
               differentiable: bool = False) -> bool:
    """Whether a ``linear_attention(impl=...)`` call runs the kernels (module docstring)."""
    return _trust.choose(impl, ENV, unsupported(q, dtype, causal, mode, decayed, differentiable), dtype,
                         "kernel attention", f"linear_attention uses the torch chunk form in {dtype} from now on "
                         f"({ENV}=torch chooses it without trying the kernel)")


def verdict(dtype: torch.dtype) -> str | None:
    """None when the kernel builds and agrees with the torch form in ``dtype``, else what
    failed; the check runs at the first ask per dtype."""
    return _trust.verdict(dtype)


MAPS = {"given": 0, "elu": 1, "relu": 2, "identity": 3}
"""The feature maps the kernel makes itself, by ``FeatureMap.describe()`` (``"given"``: the
inputs are the features)."""
TASKS = 16
MIN_SEGMENT_CHUNKS = 16


def kernel_map(fmap: FeatureMap, normalize: str | None) -> str | None:
    """The name in ``MAPS`` of a map the kernel makes itself (elu + 1, relu, identity: exactly
    these classes, whose ``__call__`` it mirrors) under ``normalize`` ``"attention"`` or None;
    None when the features must be made in torch (other maps, ``"sum"``)."""
    if normalize == "sum" or type(fmap) not in (EluPlusOne, ReLU, Identity):
        return None
    return fmap.name


def segment_chunks_for(rows: int, chunks: int) -> int:
    """The chunks of a task for ``rows`` key/value rows of ``chunks`` chunks each: enough segments
    for about ``TASKS`` tasks (a segment costs one more product per chunk, to sum its state), none
    shorter than ``MIN_SEGMENT_CHUNKS``. A function of the shapes only, not of the thread count."""
    segments = max(1, min(-(-TASKS // max(rows, 1)), chunks // MIN_SEGMENT_CHUNKS))
    return max(1, -(-chunks // segments))


@dataclass(frozen=True)
class _Options:
    chunk_size: int
    segment_chunks: int
    feature_map: str
    scale: float
    eps: float | None  # None: no division


def scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, z: torch.Tensor | None,
         chunk_size: int, *, feature_map: str = "given", scale: float = 1.0, eps: float | None = None,
         segment_chunks: int | None = None
         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """``(out [N, G, T, E], den [N, G, T, 1] or None, S_final [N, F, E], z_final [N, F] or None)``
    from ``q [N, G, T, Dk]``, ``k [N, T, Dk]``, ``v [N, T, E]``, ``S [N, F, E]`` and ``z [N, F]``
    (None: no denominator), one dtype; differentiable (module docstring). ``feature_map``: one of
    ``MAPS`` (the features of ``scale * q`` and of ``k``; ``"given"``: q and k are the features);
    ``eps``: ``out = num / (den + eps)`` (den then not returned), None: ``out = num``.
    ``segment_chunks``: the chunks of a task (default ``segment_chunks_for``)."""
    _check_options(feature_map, scale, eps, z)
    chunks = -(-q.shape[2] // chunk_size)
    if segment_chunks is None:
        segment_chunks = segment_chunks_for(k.shape[0], chunks)
    options = _Options(chunk_size, segment_chunks, feature_map, float(scale), eps)
    out, den, S_final, z_final = _Scan.apply(q, k, v, S, z, options)
    return out, None if den is None else den.unsqueeze(-1), S_final, z_final


def decayed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, S: torch.Tensor,
            z: torch.Tensor | None, chunk_size: int, *, feature_map: str = "given", scale: float = 1.0,
            eps: float | None = None, segment_chunks: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """``scan``'s computation with log decays ``g [N, T]`` (one per step) or ``[N, T, F]`` (per
    feature channel), without gradients (``decay_forms.chunk`` has them): ``S_t = diag(exp(g_t))
    S_{t-1} + phi(k_t) v_t^T`` and ``z_t = exp(g_t) z_{t-1} + phi(k_t)``. A per-channel decay
    takes chunks of at most ``CHANNEL_CHUNK`` positions (its pairwise scores grow with the chunk)."""
    _check_options(feature_map, scale, eps, z)
    per_channel = g.dim() == 3
    chunk_size = min(chunk_size, CHANNEL_CHUNK) if per_channel else chunk_size
    if segment_chunks is None:
        segment_chunks = segment_chunks_for(k.shape[0], -(-q.shape[2] // chunk_size))
    q, k, v, S, z = _kernel_inputs(q, k, v, S, z)
    g = (g if per_channel else g.unsqueeze(-1)).detach().contiguous()
    out, den, S_final, z_final = _outputs(q, v, S, z)
    native.extension().decayed_scan_forward(q, k, v, g, S, z, chunk_size, segment_chunks, MAPS[feature_map],
                                            float(scale), eps is not None, eps or 0.0, out, den, S_final, z_final)
    den = None if den is None or eps is not None else den.unsqueeze(-1)
    return out, den, S_final, z_final


def _check_options(feature_map: str, scale: float, eps: float | None, z: torch.Tensor | None) -> None:
    """The map, scale and division of a call fit together (``scan``'s docstring)."""
    if feature_map not in MAPS:
        raise ValueError(f"feature_map must be one of {', '.join(map(repr, MAPS))}, got {feature_map!r}")
    if eps is not None and z is None:
        raise ValueError("eps (the division by the denominator) needs the normalizer z")
    if feature_map == "given" and scale != 1.0:
        raise ValueError(f"given features take no scale, got scale={scale}")


def _outputs(q, v, S, z):
    """Empty outputs of a forward kernel: ``(out [N, G, T, E], den [N, G, T] or None, S_final,
    z_final or None)``, den and z_final with a normalizer z."""
    N, G, T, _ = q.shape
    den = q.new_empty(N, G, T) if z is not None else None
    return q.new_empty(N, G, T, v.shape[-1]), den, torch.empty_like(S), None if z is None else torch.empty_like(z)


def _forward(q, k, v, S, z, o: _Options):
    """One call of the forward kernel -> ``(out, den [N, G, T] or None, S_final, z_final or None)``."""
    q, k, v, S, z = _kernel_inputs(q, k, v, S, z)
    out, den, S_final, z_final = _outputs(q, v, S, z)
    native.extension().linear_scan_forward(q, k, v, S, z, o.chunk_size, o.segment_chunks, MAPS[o.feature_map],
                                           o.scale, o.eps is not None, o.eps or 0.0, out, den, S_final, z_final)
    return out, den, S_final, z_final


class _Scan(torch.autograd.Function):
    """``scan``: the forward and backward kernels; ``create_graph`` differentiates the torch form."""

    @staticmethod
    def forward(ctx, q, k, v, S, z, options):
        out, den, S_final, z_final = _forward(q, k, v, S, z, options)
        divide = options.eps is not None
        ctx.save_for_backward(q, k, v, S, z, out if divide else None, den if divide else None)
        ctx.options = options
        if divide:
            ctx.mark_non_differentiable(den)
            den = None
        return out, den, S_final, z_final

    @staticmethod
    def backward(ctx, d_out, d_den, d_S, d_z):
        q, k, v, S, z, out, den = ctx.saved_tensors
        o = ctx.options
        if torch.is_grad_enabled():
            return (*_torch_gradients(q, k, v, S, z, o, d_out, d_den, d_S, d_z), None)
        q, k, v, S, z, out, den, d_out, d_den, d_S, d_z = _kernel_inputs(q, k, v, S, z, out, den, d_out, d_den,
                                                                         d_S, d_z)
        if z is not None and o.eps is None and d_den is None:
            d_den = torch.zeros(q.shape[:3], dtype=q.dtype)
        dq, dk, dv, dS = (torch.empty_like(t) for t in (q, k, v, S))
        dz = torch.empty_like(z) if z is not None else None
        native.extension().linear_scan_backward(q, k, v, S, z, out, den, d_out, d_den, d_S, d_z, o.chunk_size,
                                                o.segment_chunks, MAPS[o.feature_map], o.scale, o.eps is not None,
                                                o.eps or 0.0, dq, dk, dv, dS, dz)
        return dq, dk, dv, dS, dz, None


def _torch_gradients(q, k, v, S, z, o: _Options, d_out, d_den, d_S, d_z):
    """The gradients by differentiating the torch form on the same inputs, keeping their graph."""
    inputs = (q, k, v, S, z)
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    outputs = _torch_scan(q, k, v, S, z, o)
    pairs = [(out, grad) for out, grad in zip(outputs, (d_out, d_den, d_S, d_z))
             if out is not None and grad is not None]
    grads = torch.autograd.grad([out for out, _ in pairs], leaves, [grad for _, grad in pairs], create_graph=True,
                                allow_unused=True)
    by_input = dict(zip(map(id, leaves), grads))
    return tuple(None if t is None else by_input.get(id(t)) for t in inputs)


class _GivenFeatures:
    """``forms.Features``' protocol for features already made."""

    def queries(self, q):
        return q, None

    def keys(self, k):
        return k


def _features(x: torch.Tensor, feature_map: str, scale: float = 1.0) -> torch.Tensor:
    """The map of ``MAPS`` on ``scale * x``, by the library's own map (``"given"``: x itself)."""
    if scale != 1.0:
        x = x * scale
    return x if feature_map == "given" else get_feature_map(feature_map)(x, is_query=True)


def _torch_scan(q, k, v, S, z, o: _Options, g: torch.Tensor | None = None):
    """The kernels' outputs by ``forms.chunk``, or with log decays ``g`` by ``decay_forms.chunk``
    (den ``[N, G, T]``, None with the division)."""
    E = v.shape[-1]
    phi_q, phi_k = _features(q, o.feature_map, o.scale), _features(k, o.feature_map)

    def finish(num, den, _shift):
        if den is None:
            return num
        return num / (den + o.eps) if o.eps is not None else torch.cat([num, den], -1)

    if g is None:
        out, S_final, z_final = forms.chunk(phi_q, phi_k, v, S, z, True, o.chunk_size, _GivenFeatures(), finish)
    else:
        out, S_final, z_final = decay_forms.chunk(phi_q, phi_k, v, S, z, g, o.chunk_size, _GivenFeatures(), finish)
    if z is None or o.eps is not None:
        return out, None, S_final, z_final
    return out[..., :E], out[..., E], S_final, z_final


def _kernel_inputs(*tensors):
    """The tensors as the kernel reads them: detached and contiguous; None stays None."""
    return tuple(None if t is None else t.detach().contiguous() for t in tensors)


def _run_check(dtype: torch.dtype) -> str | None:
    """Two calls (the second continuing the first) by the kernel and by ``forms.chunk``, with
    gradients, and the decayed calls by ``decayed`` and ``decay_forms.chunk``: None when outputs,
    final states and the gradients of every input agree, else the first difference."""
    results = {way: {**_outcomes(dtype, way), **_decayed_outcomes(dtype, way)} for way in ("native", "torch")}
    return first_difference(results["native"], results["torch"], RTOL[dtype])


def _outcomes(dtype: torch.dtype, way: str) -> dict[str, torch.Tensor]:
    """The check's calls by ``way`` (``_CALLS``, each continuing the state of the one before):
    outputs and final states by name, and the gradients of a weighted sum of them w.r.t. every
    input."""
    s = _SHAPE
    g = torch.Generator().manual_seed(0)

    def draw(*shape, positive=False):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        return (x.abs() if positive else x).to(dtype).requires_grad_(True)

    S, z = draw(s["N"], s["F"], s["E"]), draw(s["N"], s["F"], positive=True)
    leaves, results, loss = {"state": S, "normalizer": z}, {}, 0.0
    with torch.enable_grad():
        for call, (T, feature_map, scale, eps) in enumerate(_CALLS):
            given = feature_map == "given"
            q, k = draw(s["N"], s["G"], T, s["F"], positive=given), draw(s["N"], T, s["F"], positive=given)
            v = draw(s["N"], T, s["E"])
            leaves.update({f"q {call}": q, f"k {call}": k, f"v {call}": v})
            options = _Options(s["chunk"], s["segment_chunks"], feature_map, scale, eps)
            compute = _Scan.apply if way == "native" else _torch_scan
            out, den, S, z = compute(q, k, v, S, z, options)
            for name, value in (("output", out), ("denominator", den), ("state", S), ("normalizer", z)):
                if value is not None:
                    weights = torch.randn(value.shape, generator=g, dtype=torch.float64).to(dtype)
                    loss = loss + (value * weights).sum()
                    results[f"{name} {call}"] = value
        grads = torch.autograd.grad(loss, list(leaves.values()))
    results.update({f"gradient of {name}": grad for name, grad in zip(leaves, grads)})
    return {name: value.detach() for name, value in results.items()}


def _decayed_outcomes(dtype: torch.dtype, way: str) -> dict[str, torch.Tensor]:
    """The check's decayed calls by ``way`` (``_DECAYED_CALLS``, each continuing the state of the
    one before): outputs and final states by name."""
    s = _SHAPE
    gen = torch.Generator().manual_seed(1)

    def draw(*shape, positive=False):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return (x.abs() if positive else x).to(dtype)

    S, z = draw(s["N"], s["F"], s["E"]), draw(s["N"], s["F"], positive=True)
    results = {}
    for call, (T, feature_map, scale, eps, channels) in enumerate(_DECAYED_CALLS):
        given = feature_map == "given"
        q, k = draw(s["N"], s["G"], T, s["F"], positive=given), draw(s["N"], T, s["F"], positive=given)
        v = draw(s["N"], T, s["E"])
        g = -draw(s["N"], T, *((s["F"],) if channels else ()), positive=True)
        g[:, T // 2] = -math.inf  # a reset
        if way == "native":
            out, den, S, z = decayed(q, k, v, g, S, z, s["chunk"], feature_map=feature_map, scale=scale, eps=eps,
                                     segment_chunks=s["segment_chunks"])
        else:
            out, den, S, z = _torch_scan(q, k, v, S, z, _Options(s["chunk"], 0, feature_map, scale, eps), g)
            den = None if den is None else den.unsqueeze(-1)
        for name, value in (("output", out), ("denominator", den), ("state", S), ("normalizer", z)):
            if value is not None:
                results[f"decayed {name} {call}"] = value
    return results


_trust = native.Trust(lambda dtype: _run_check(dtype))
