"""The delta rule (fast weight programmers): recurrent reference and chunkwise WY/UT form.

Per key/value head, fast weights ``S [F, Dv]`` and, at each position t,

    v_old_t = S^T k_t                       (what the memory returns for k_t)
    S      <- S + k_t (beta_t (v_t - v_old_t))^T
    out_t   = scale * S^T q_t               (read after the write)

with ``q_t, k_t`` the feature-mapped and normalised queries/keys. Unlike the sum rule
of plain linear attention, writing a value to a key replaces (for beta = 1 and
unit-norm keys) what was stored there.

Chunk form (Yang et al. 2024), per chunk of C positions with incoming state S:
``A = tril(diag(beta) K K^T, -1)``, ``T = (I + A)^-1 diag(beta)`` (a unit triangular
solve), ``W = T K``, ``U = T V``, ``U' = U - W S``, ``O = Q S + (Q K^T * tril) U'``,
``S <- S + K^T U'``. W and U of all chunks are computed at once, only ``U'`` and ``S``
run chunk after chunk, and the reads ``O`` are batched again.

With log decays ``g`` (the gated delta rule, ``gated.py``) the memory decays before
each write: ``S <- diag(exp(g_t)) S``, then the update above.
"""

from __future__ import annotations

import torch

from ...state import DeltaRuleState
from ..._checks import (
    check_bool,
    check_choice,
    check_log_decay,
    check_non_negative_number,
    check_positive_int,
    check_qkv,
    check_same_dtype_device,
    check_state_setting,
    check_state_tensor,
    check_tensor,
    compute_dtype,
    records_gradients,
    resolve_scale,
)
from ..kernel import FeatureMap, get_feature_map, normalized_features
from . import chunk, gated, native_chunk

_MODES = ("chunk", "recurrent")
_NORMALIZE = ("l2", "sum", None)

# Layout shared by both forms: q [N, G, T, F], k [N, T, F], v [N, T, E], beta [N, T],
# memory [N, F, E] (N = B * Hkv, G query heads per key/value head).


def _recurrent(q, k, v, beta, memory):
    """Token by token, exactly the recurrence in the module docstring (without scale)."""
    outs = []
    for q_t, k_t, v_t, b_t in zip(q.unbind(2), k.unbind(1), v.unbind(1), beta.unbind(1)):
        v_old = (k_t.unsqueeze(1) @ memory).squeeze(1)
        update = b_t.unsqueeze(-1) * (v_t - v_old)
        memory = memory + k_t.unsqueeze(-1) * update.unsqueeze(1)
        outs.append(q_t @ memory)
    return torch.stack(outs, dim=2), memory


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    feature_map: str | FeatureMap = "identity",
    normalize: str | None = "l2",
    scale: float | None = None,
    mode: str | None = None,
    chunk_size: int = 64,
    initial_state: DeltaRuleState | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
    check_inputs: bool = True,
    g: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, DeltaRuleState | None]:
    """Causal delta-rule attention (DeltaNet / fast weight programmer with the delta rule).

    Args:
        q: the queries, ``[B, H, T, Dk]``.
        k: the keys, ``[B, Hkv, T, Dk]``, ``H % Hkv == 0``.
        v: the values, ``[B, Hkv, T, Dv]``.
        beta: ``[B, Hkv, T]`` write strengths in [0, 1] (one per key/value head: the
            memory being written belongs to the key/value head).
        feature_map: applied to q and k before normalisation (name or ``FeatureMap``).
        normalize: ``"l2"`` (unit-norm features), ``"sum"`` (``phi / sum(phi)``, the
            FWP paper's choice with DPFP/elu) or ``None`` (then keep keys small: the
            update is only stable for ``beta |k|^2 < 2``).
        scale: output scale; ``None`` means ``F^-1/2`` (F = feature dimension).
        mode: ``"chunk"`` (WY/UT) or ``"recurrent"`` (token by token, the reference and
            the decoding step); ``None`` picks recurrent for T == 1, else chunk. Only the
            recurrent form has second derivatives (``create_graph=True``).
        chunk_size: chunk length of ``mode="chunk"`` (with ``g`` at most 32, per channel at most 16:
            the gated form's cost grows with the chunk).
        initial_state: a ``DeltaRuleState`` to continue from.
        output_final_state: also return the final ``DeltaRuleState``.
        eps: added to the norms of ``normalize="l2"`` and the sums of ``"sum"``.

        check_inputs: also check that beta lies in [0, 1] and g is ``<= 0`` and not NaN,
            which reads their values (a host sync on a GPU, a graph break under
            ``torch.compile``). ``False`` for callers whose beta and g are in range by
            construction (``DeltaNet``: a sigmoid); types and shapes are always checked.
        g: log decays, the gated delta rule: ``[B, Hkv, T]`` (one per key/value head and step:
            Gated DeltaNet) or ``[B, Hkv, T, F]`` (one per feature channel of the keys, F = the
            map's output width, Dk for elementwise maps: KDA); ``g <= 0``, ``-inf`` resets the
            memory. Before step t writes, ``S <- diag(exp(g_t)) S`` (rows of S); then the
            update above reads and writes the decayed memory. Per key/value head, like beta.
            In q's dtype or its accumulation dtype (float32 g with half-precision q).
            ``None``: no decay. With per-channel g the chunk form has no second derivatives.
        impl: ``"auto"`` (the native kernel for the chunk form on CPU tensors in float32 /
            float64 when the call records no gradients: prefill, evaluation; else the torch
            forms), ``"native"`` (the kernel, or a ValueError naming why it does not compute the
            call) or ``"torch"``. See ``native_chunk.py``.

    Returns:
        ``(out [B, H, T, Dv] in q's dtype, final state or None)``.
    """
    shapes = check_qkv(q, k, v)
    fmap = get_feature_map(feature_map)
    check_choice("normalize", normalize, _NORMALIZE)
    check_choice("mode", mode, (None,) + _MODES)
    check_choice("impl", impl, native_chunk.IMPLS)
    check_positive_int("chunk_size", chunk_size)
    B, H, Hkv, T = shapes.batch, shapes.heads, shapes.kv_heads, shapes.length
    G, Dk, Dv = shapes.group_size, shapes.key_dim, shapes.value_dim
    beta = check_tensor("beta", beta, ndim=3, layout="[batch, kv_heads, length]")
    check_same_dtype_device(q=q, beta=beta)
    if tuple(beta.shape) != (B, Hkv, T):
        raise ValueError(
            f"beta has shape {list(beta.shape)}, expected [{B}, {Hkv}, {T}] (one value per key/value head)"
        )
    check_bool("check_inputs", check_inputs)
    if check_inputs:
        low, high = torch.aminmax(beta.detach())
        if not (0 <= low and high <= 1):  # also false for NaN
            raise ValueError(
                f"beta must lie in [0, 1] (write strengths), got values in [{float(low):.4g}, {float(high):.4g}]"
            )
    check_non_negative_number("eps", eps)
    if mode is None:
        mode = "recurrent" if T == 1 and impl != "native" else "chunk"
    Fd = fmap.dim_out(Dk)
    if g is not None:
        check_log_decay("g", g, heads_of=shapes, channels=Fd, like=q, values=check_inputs)
    scale = resolve_scale(scale, Fd)
    dtype = compute_dtype(q.dtype)
    identity, normalize_name = fmap.describe(), "none" if normalize is None else normalize

    if initial_state is None:
        memory = q.new_zeros(B * Hkv, Fd, Dv, dtype=dtype)
    else:
        if not isinstance(initial_state, DeltaRuleState):
            raise TypeError(f"initial_state must be a DeltaRuleState, got {type(initial_state).__name__}")
        check_state_setting("initial_state", "feature_map", initial_state.feature_map, identity)
        check_state_setting("initial_state", "normalize", initial_state.normalize, normalize_name)
        memory = check_state_tensor("initial_state.memory", initial_state.memory, (B, Hkv, Fd, Dv), q)
        memory = memory.to(dtype).reshape(B * Hkv, Fd, Dv)

    phi_q = normalized_features(fmap, q.to(dtype), is_query=True, normalize=normalize, eps=eps)
    phi_k = normalized_features(fmap, k.to(dtype), is_query=False, normalize=normalize, eps=eps)
    phi_q = phi_q.reshape(B * Hkv, G, T, Fd)
    phi_k = phi_k.reshape(B * Hkv, T, Fd)
    values = v.to(dtype).reshape(B * Hkv, T, Dv)
    betas = beta.to(dtype).reshape(B * Hkv, T)

    decay = None if g is None else g.to(dtype).reshape(B * Hkv, *g.shape[2:])
    differentiable = records_gradients(phi_q, phi_k, values, betas, decay, memory)
    if native_chunk.use_native(impl, q, dtype, mode, differentiable):
        out, memory = native_chunk.chunk(phi_q, phi_k, values, betas, decay, memory, chunk_size, scale)
    elif decay is not None:
        if mode == "recurrent":
            out, memory = gated.recurrent(phi_q, phi_k, values, betas, decay, memory)
        else:
            out, memory = gated.chunk(phi_q, phi_k, values, betas, decay, memory, chunk_size)
        out = out * scale
    elif mode == "recurrent":
        out, memory = _recurrent(phi_q, phi_k, values, betas, memory)
        out = out * scale
    else:
        out, memory = chunk.chunk(phi_q, phi_k, values, betas, memory, chunk_size, scale)
    out = out.reshape(B, H, T, Dv).to(q.dtype)

    state = None
    if output_final_state:
        steps = (initial_state.steps if initial_state is not None else 0) + T
        state = DeltaRuleState(memory=memory.reshape(B, Hkv, Fd, Dv), steps=steps, feature_map=identity,
                               normalize=normalize_name)
    return out, state
