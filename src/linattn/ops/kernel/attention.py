"""Kernel ("linear") attention: parallel (reference), chunkwise-parallel and recurrent forms.

Causal kernel attention with feature map phi, per head:

    S_i = S_0 + sum_{j<=i} phi(k_j) v_j^T        z_i = z_0 + sum_{j<=i} phi(k_j)
    out_i = phi(q_i)^T S_i / (phi(q_i).z_i + eps)          (normalize="attention")
    out_i = phi~(q_i)^T S_i   with phi~ = phi / sum(phi)   (normalize="sum", on q and k)
    out_i = phi(q_i)^T S_i                                 (normalize=None)

Non-causal: the sums run over every position (and the carried state).
Keys/values have ``Hkv`` heads; query head ``h`` reads
the state of key/value head ``h // (H / Hkv)``, so the state is per key/value head.

With log decays ``g`` (causal only; ``decay_forms.py``), the sums forget:
``S_i = diag(exp(g_i)) S_{i-1} + phi(k_i) v_i^T`` and ``z_i = exp(g_i) * z_{i-1} + phi(k_i)``.
"""

from __future__ import annotations

import functools
import math

import torch

from ...state import LinearAttentionState
from ..._checks import (
    check_bool,
    check_choice,
    check_log_decay,
    check_non_negative_number,
    check_positive_int,
    check_qkv,
    check_scale,
    check_state_setting,
    check_state_tensor,
    compute_dtype,
    records_gradients,
)
from . import decay_forms, forms, native_scan
from .feature_maps import FeatureMap, get_feature_map

_MODES = ("parallel", "chunk", "recurrent")
_NORMALIZE = ("attention", "sum", None)
# Float32 exponential maps are recomputed in float64 once a row's query and key shifts
# sum past log(eps) + this (see linear_attention's docstring): below it, the shifted eps
# term and the backward's intermediate gradients stay at least 2^24 inside float32's range.
_FLOAT32_SHIFT_LIMIT = -math.log(torch.finfo(torch.float32).tiny) - 17.0


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str | FeatureMap = "elu",
    causal: bool = True,
    normalize: str | None = "attention",
    mode: str | None = None,
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
    g: torch.Tensor | None = None,
    scale: float = 1.0,
    check_inputs: bool = True,
    impl: str = "auto",
) -> tuple[torch.Tensor, LinearAttentionState | None]:
    """Kernel attention ``out_i = phi(q_i)^T S_i / phi(q_i).z_i`` in linear time.

    Args:
        q: the queries, ``[B, H, T, Dk]``.
        k: the keys, ``[B, Hkv, T, Dk]``, ``H % Hkv == 0``. With ``causal=False`` the keys
            may be more or fewer than the queries (``k, v [B, Hkv, T_k, *]``): every query
            reads the sums over all keys.
        v: the values, ``[B, Hkv, T, Dv]``.

        feature_map: a name (``"elu"``, ``"relu"``, ``"identity"``, ``"exp"``, ``"favor"``,
            ``"dpfp"``, ``"taylor"``, ``"favor:M"``, ``"dpfp:NU"``) or a ``FeatureMap``.
        causal: position i sees keys j <= i (and the carried state); else all keys.
        normalize: ``"attention"`` (divide by ``phi(q).z + eps``), ``"sum"``
            (``phi / sum(phi)`` on q and k, no denominator) or ``None``.
        mode: ``"parallel"`` (quadratic reference; also the cheaper order for a few
            non-causal queries over many keys, ``T T_k (F + Dv)`` instead of
            ``T_k F Dv`` work), ``"chunk"``, ``"recurrent"``; ``None`` picks
            ``"recurrent"`` for a causal T == 1 call (decoding) and ``"chunk"`` otherwise.
        chunk_size: chunk length of ``mode="chunk"`` (any T: the sequence is split, the last chunk is shorter;
            with a per-channel ``g`` at most 16, the pairwise work inside a chunk growing with it).
        initial_state: a ``LinearAttentionState`` to continue from (carried across calls).
        output_final_state: also return the final state, the next call's ``initial_state``.
        eps: added to the denominator of ``normalize="attention"`` (and to the sums of
            ``"sum"`` for non-exponential maps).
        g: log decays (causal only), ``[B, Hkv, T]`` (one per key/value head and step: RetNet,
            Mamba-2) or ``[B, Hkv, T, F]`` (one per feature channel, F = the map's output
            width, Dk for elementwise maps: GLA); ``g <= 0``, ``-inf`` resets the sums.
            Before position i writes, ``S`` and ``z`` are multiplied by ``exp(g_i)`` (per
            row f of S for per-channel g). Per key/value head, like the state it decays. In
            q's dtype or its accumulation dtype (float32 g with half-precision q). ``None``:
            no decay (the computation without g). With per-channel g the chunk form has no
            second derivatives (``create_graph=True`` raises; the other forms have them).
        scale: multiplies the queries before the feature map (a temperature for exponential
            maps, as ``softmax_attention``'s scale; with ``"identity"`` and ``normalize=None``
            the output is scaled); a finite positive number, 1 by default.
        check_inputs: also check that g is ``<= 0`` and not NaN, which reads its values (a
            host sync on a GPU, a graph break under ``torch.compile``); ``False`` for callers
            whose g is in range by construction (a ``logsigmoid``). Shapes, dtypes and devices
            are always checked.
        impl: ``"auto"`` (the native kernels for the causal chunk form on CPU tensors in
            float32 or float64: without decay always, with decay when the call records no
            gradients; the torch forms otherwise; ``LINATTN_LINEAR_IMPL=torch`` or ``native``
            replaces the choice), ``"native"`` (those kernels; a call they do not compute is a
            ValueError naming why) or ``"torch"``. See ``native_scan.py``.

    Returns:
        ``(out [B, H, T, Dv] in q's dtype, final state or None)``. Sums and states are
        float32 (float64 for float64 inputs).

    Exponential maps under ``"attention"`` compute ``phi(q).S / (phi(q).z + eps)`` with
    max-subtraction shifts (per query row, and one per (batch, head) for the keys), so the
    eps term becomes ``eps exp(-(q_shift + key_shift))``. In float32 that term and the
    backward's intermediate gradients (up to ``exp(q_shift + key_shift) / eps``) leave
    the float range once the two shifts sum past ``log(eps) + ~70`` (56 for eps = 1e-6):
    rows that see only weak keys then get denormal denominators and NaN gradients. A call
    whose shifts go past that is computed again in float64 (same output dtype, float32
    state); below it, nothing changes. The choice reads one value from the device (a host
    sync on a GPU); under ``torch.compile`` it is a ``torch.cond`` inside the graph.
    """
    check_bool("causal", causal)
    shapes = check_qkv(q, k, v, same_length=causal)
    fmap = get_feature_map(feature_map)
    check_choice("normalize", normalize, _NORMALIZE)
    check_choice("mode", mode, (None,) + _MODES)
    check_positive_int("chunk_size", chunk_size)
    check_non_negative_number("eps", eps)
    check_scale(scale)
    check_bool("check_inputs", check_inputs)
    check_choice("impl", impl, native_scan.IMPLS)
    if mode is None:
        mode = "recurrent" if causal and shapes.length == 1 and impl != "native" else "chunk"

    B, Hkv, Dk, Dv = shapes.batch, shapes.kv_heads, shapes.key_dim, shapes.value_dim
    F = fmap.dim_out(Dk)
    if g is not None:
        if not causal:
            raise ValueError("g (log decays) needs causal=True: a decay orders the positions")
        check_log_decay("g", g, heads_of=shapes, channels=F, like=q, values=check_inputs)
    with_denominator = normalize == "attention"
    tracks_shift = fmap.exponential and with_denominator
    identity = fmap.describe()
    if initial_state is not None:
        _check_state(initial_state, (B, Hkv, F, Dv), q, with_denominator, tracks_shift, identity, normalize)

    form = (fmap, causal, normalize, mode, chunk_size, eps, scale, output_final_state, impl)
    guarded = tracks_shift and compute_dtype(q.dtype) != torch.float64 and eps > 0
    limit = math.log(eps) + _FLOAT32_SHIFT_LIMIT if guarded else math.inf
    if guarded and torch.compiler.is_compiling():
        # The choice stays in the graph (no host read, no graph break), so it is made before
        # either computation, from the same shifts.
        wide = _largest_shift(q, k, fmap, initial_state, scale) > limit
        out, S, z, key_shift = _float64_if(wide, q, k, v, g, initial_state, form)
    else:
        out, S, z, key_shift, peak = _attend(q, k, v, g, initial_state, *form)
        if guarded and peak.item() > limit:
            out, S, z, key_shift = _in_float64(q, k, v, g, initial_state, form)

    if not output_final_state:
        return out, None
    steps = (initial_state.steps if initial_state is not None else 0) + k.shape[2]
    return out, LinearAttentionState(
        kv=S.reshape(B, Hkv, F, Dv),
        normalizer=z.reshape(B, Hkv, F) if with_denominator else None,
        key_shift=key_shift.reshape(B, Hkv) if tracks_shift else None,
        steps=steps,
        feature_map=identity,
        normalize=_normalize_name(normalize),
    )


def _normalize_name(normalize: str | None) -> str:
    """``normalize`` as a state records it (``None`` -> ``"none"``: a state's None means unknown)."""
    return "none" if normalize is None else normalize


def _check_state(state, kv_shape: tuple[int, ...], q: torch.Tensor, with_denominator: bool, tracks_shift: bool,
                 feature_map: str, normalize: str | None):
    """The carried ``LinearAttentionState`` fits these inputs and was made with this feature
    map (``feature_map``: its ``describe()``) and normalisation."""
    if not isinstance(state, LinearAttentionState):
        raise TypeError(f"initial_state must be a LinearAttentionState, got {type(state).__name__}")
    check_state_setting("initial_state", "feature_map", state.feature_map, feature_map)
    check_state_setting("initial_state", "normalize", state.normalize, _normalize_name(normalize))
    check_state_tensor("initial_state.kv", state.kv, kv_shape, q)
    if with_denominator:
        if state.normalizer is None:
            raise ValueError("initial_state.normalizer is None but normalize='attention' needs it")
        check_state_tensor("initial_state.normalizer", state.normalizer, kv_shape[:3], q)
    if tracks_shift and state.key_shift is not None:
        check_state_tensor("initial_state.key_shift", state.key_shift, kv_shape[:2], q)


def _attend(q, k, v, g, initial_state, fmap, causal, normalize, mode, chunk_size, eps, scale, final_state,
            impl="torch"):
    """The computation of ``linear_attention`` on checked arguments, in float32 (float64 for
    float64 inputs) -> ``(out [B, H, T, Dv] in q's dtype, S [B Hkv, F, Dv], z [B Hkv, F],
    key_shift [B Hkv], peak)``; ``impl`` as ``linear_attention``'s, decided here for the dtype
    computed in (``native_scan.use_native``). ``z`` only with a denominator, ``key_shift`` only for
    exponential maps under it, ``S`` and ``z`` after the last position (``S`` may be None
    for the parallel form without ``final_state``), ``peak`` the largest ``q_shift +
    key_shift`` of a row (None without shifts)."""
    B, H, T, Dk = q.shape
    Hkv, T_keys, Dv = k.shape[1], k.shape[2], v.shape[-1]  # T_keys == T when causal
    G, F = H // Hkv, fmap.dim_out(Dk)
    dtype = compute_dtype(q.dtype)
    with_denominator = normalize == "attention"
    tracks_shift = fmap.exponential and with_denominator
    carried = () if initial_state is None else (initial_state.kv, initial_state.normalizer)
    differentiable = records_gradients(q, k, v, g, *carried)
    native = native_scan.use_native(impl, q, dtype, causal, mode, g is not None, differentiable)

    S = z = state_shift = None
    if initial_state is not None:
        S = initial_state.kv.to(dtype).reshape(B * Hkv, F, Dv)
        if with_denominator:
            z = initial_state.normalizer.to(dtype).reshape(B * Hkv, F)
        if tracks_shift:
            # A state without a shift holds unshifted sums (log-scale 0).
            shift = initial_state.key_shift
            state_shift = S.new_zeros(B, Hkv) if shift is None else shift.to(dtype)
    if with_denominator and z is None:
        z = q.new_zeros(B * Hkv, F, dtype=dtype)

    made_map = native_scan.kernel_map(fmap, normalize) if native else None  # a map the kernel makes itself
    qf = q.to(dtype).reshape(B * Hkv, G, T, Dk)
    if scale != 1.0 and made_map is None:
        qf = qf * scale
    kf = k.to(dtype).reshape(B * Hkv, T_keys, Dk)
    values = v.to(dtype).reshape(B * Hkv, T_keys, Dv)
    key_shift = key_logs = None
    if tracks_shift:
        key_logs = fmap.log_features(kf, is_query=False)
        key_shift = key_logs.detach().amax(dim=(-1, -2))  # [N]
        if causal and mode == "chunk" and g is None and not native:
            key_logs = None  # the causal chunk form makes features chunk by chunk
        if state_shift is not None:
            old_shift = state_shift.reshape(B * Hkv)
            key_shift = torch.maximum(key_shift, old_shift)
            # Keys stored under the old shift are rescaled to the new (larger) one.
            rescale = torch.exp(old_shift - key_shift).unsqueeze(-1)
            S, z = S * rescale.unsqueeze(-1), z * rescale
    features = forms.Features(fmap, normalize, eps, key_shift, kf, key_logs)
    shift_peaks = []  # per piece, the largest q_shift + key_shift of a row

    def finish(num, den, q_shift):
        if den is None:
            return num
        if q_shift is not None:
            total_shift = q_shift + key_shift[:, None, None, None]
            shift_peaks.append(total_shift.amax())
            # eps belongs to the unshifted denominator: scale it like the features.
            return num / (den + eps * torch.exp(-total_shift))
        return num / (den + eps)

    # the decayed forms (always causal) take the log decays where the others take `causal`
    family, causal_or_decay = forms, causal
    if g is not None:
        family, causal_or_decay = decay_forms, g.to(dtype).reshape(B * Hkv, *g.shape[2:])
    if native:
        S = values.new_zeros(B * Hkv, F, Dv) if S is None else S
        kernel = native_scan.scan if g is None else functools.partial(native_scan.decayed, g=causal_or_decay)
        if made_map is not None:
            out, _, S, z = kernel(qf, kf, values, S=S, z=z, chunk_size=chunk_size, feature_map=made_map, scale=scale,
                                  eps=eps if with_denominator else None)
        else:
            phi_q, q_shift = features.queries(qf)
            num, den, S, z = kernel(phi_q, features.keys(kf), values, S=S, z=z, chunk_size=chunk_size)
            out = finish(num, den, q_shift)
    elif mode == "parallel":
        out, S, z = family.parallel(qf, kf, values, S, z, causal_or_decay, features, finish, final_state)
    elif mode == "recurrent":
        out, S, z = family.recurrent(qf, kf, values, S, z, causal_or_decay, features, finish)
    else:
        out, S, z = family.chunk(qf, kf, values, S, z, causal_or_decay, chunk_size, features, finish)
    peak = None
    if shift_peaks:
        peak = shift_peaks[0] if len(shift_peaks) == 1 else torch.stack(shift_peaks).amax()
    return out.reshape(B, H, T, Dv).to(q.dtype), S, z, key_shift, peak


def _largest_shift(q, k, fmap: FeatureMap, initial_state, scale: float = 1.0) -> torch.Tensor:
    """The largest ``q_shift + key_shift`` of a row, as ``_attend`` computes it (float32, no
    gradient), from all queries and keys at once."""
    B, H, T, _ = q.shape
    Hkv = k.shape[1]
    with torch.no_grad():
        queries = q.float() if scale == 1.0 else q.float() * scale
        q_shift = fmap.log_features(queries, is_query=True).reshape(B, Hkv, -1).amax(-1)
        key_shift = fmap.log_features(k.float(), is_query=False).reshape(B, Hkv, -1).amax(-1)
        if initial_state is not None:
            old = initial_state.key_shift
            key_shift = torch.maximum(key_shift, key_shift.new_zeros(()) if old is None else old.float())
        return (q_shift + key_shift).amax()


def _float64_if(wide: torch.Tensor, q, k, v, g, initial_state, form: tuple) -> tuple:
    """``torch.cond``: ``_in_float64`` where ``wide``, else ``_attend`` in float32 ->
    ``(out, S, z, key_shift)``. Every tensor crossing the cond gets contiguous gradients:
    the backward of a cond needs the same strides from both branches."""
    crossing = 4 if form[7] else 1  # without a final state only out crosses (S may be None)
    contiguous_grad = _ContiguousGrad.apply

    def branch(compute):
        def run():
            decay = None if g is None else contiguous_grad(g)
            results = compute(*(contiguous_grad(t) for t in (q, k, v)), decay, initial_state, form)
            return tuple(contiguous_grad(t) for t in results[:crossing])
        return run

    in_float32 = lambda q, k, v, g, state, form: _attend(q, k, v, g, state, *form)  # noqa: E731
    chosen = torch.cond(wide, branch(_in_float64), branch(in_float32), ())
    return (*chosen, None, None, None)[:4]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward gives the gradient the strides of a new tensor of its shape
    (see ``_float64_if``): contiguous, and standard on size-1 dimensions too, which cond
    compares and ``.contiguous()`` leaves as they are (a slice of a padded gradient). Always
    a copy: the backward is traced once, before the strides it will see are known."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone(memory_format=torch.contiguous_format)


def _in_float64(q, k, v, g, initial_state, form: tuple) -> tuple:
    """``_attend`` in float64 (which reads the carried state in float64) -> ``(out in q's
    dtype, S, z, key_shift)``, the state tensors in float32."""
    decay = None if g is None else g.double()
    out, S, z, key_shift, _ = _attend(q.double(), k.double(), v.double(), decay, initial_state, *form)
    return out.to(q.dtype), *(None if t is None else t.float() for t in (S, z, key_shift))
