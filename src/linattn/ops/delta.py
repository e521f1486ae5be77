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

With log decays ``g`` (the gated delta rule, ``_gated_delta.py``) the memory decays before
each write: ``S <- diag(exp(g_t)) S``, then the update above.
"""

from __future__ import annotations

import torch

from ..state import DeltaRuleState
from .._checks import (
    check_bool,
    check_first_order_backward,
    check_non_negative_number,
    check_choice,
    check_log_decay,
    check_positive_int,
    check_qkv,
    check_same_dtype_device,
    check_state_setting,
    check_state_tensor,
    check_tensor,
    compute_dtype,
    resolve_scale,
)
from . import _gated_delta
from ._decay import pad_time
from .feature_maps import FeatureMap, get_feature_map, normalized_features

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


class _ChunkDeltaRule(torch.autograd.Function):
    """Chunkwise WY/UT form with a hand-written backward.

    Forward (per chunk, all chunks batched except the state recurrence):
    ``X = (I + A)^-1`` with ``A = tril(diag(beta) K K^T, -1)``; ``T = X diag(beta)``;
    ``W = T K``, ``U = T V``; ``U'_c = U_c - W_c S_c``; ``S_{c+1} = S_c + K_c^T U'_c``;
    ``O_c = scale (Q_c S_c + (Q_c K_c^T * tril) U'_c)``. T is padded to a multiple of C
    with beta = 0 (no writes).

    The backward is first order: under ``create_graph=True`` it raises (use the recurrent form).

    Backward, with ``dS_{c+1}`` the gradient reaching the state after chunk c and
    ``dO`` already multiplied by scale:
    ``dU'_c = P_c^T dO_c + K_c dS_{c+1}`` (P = masked Q K^T), ``dS_c = Q_c^T dO_c + dS_{c+1}
    - W_c^T dU'_c`` (the only sequential part), then, batched over chunks,
    ``dQ = dO S^T + (dO U'^T * tril) K``, ``dW = -dU' S^T``, ``dT = dW K^T + dU' V^T``,
    ``dX = dT diag(beta)``, ``dA = -X^T dX X^T`` (strictly lower part), and the chain rule
    through ``A_ij = beta_i k_i.k_j`` and ``T = X diag(beta)`` for dK, dV and dbeta.
    The masked scores P and the Gram matrices K K^T are kept from the forward pass.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, memory, chunk_size, scale):
        N, G, T, Fd = q.shape
        E = v.shape[-1]
        C = chunk_size
        n_chunks = -(-T // C)
        pad = n_chunks * C - T
        q, k, v, beta = pad_time(q, pad, 2), pad_time(k, pad, 1), pad_time(v, pad, 1), pad_time(beta, pad, 1)
        M = N * n_chunks
        keys = k.reshape(M, C, Fd)
        vals = v.reshape(M, C, E)
        betas = beta.reshape(M, C, 1)
        gram = torch.bmm(keys, keys.transpose(1, 2))
        strict_lower = gram.tril(-1).mul_(betas)
        identity = torch.eye(C, dtype=q.dtype, device=q.device).expand(M, C, C)
        inverse = torch.linalg.solve_triangular(strict_lower, identity, upper=False, unitriangular=True)
        transform = inverse * betas.transpose(1, 2)
        w = torch.bmm(transform, keys)
        u = torch.bmm(transform, vals)
        # Chunk-major buffers written in place by the loop (states[c] is S_c), then put in
        # the [N, n_chunks] order of the batched reads.
        states = q.new_empty(n_chunks + 1, N, Fd, E)
        states[0].copy_(memory)
        corrected = q.new_empty(n_chunks, N, C, E)
        w_chunks, u_chunks = w.view(N, n_chunks, C, Fd), u.view(N, n_chunks, C, E)
        key_chunks = keys.view(N, n_chunks, C, Fd)
        for c in range(n_chunks):
            torch.baddbmm(u_chunks[:, c], w_chunks[:, c], states[c], alpha=-1.0, out=corrected[c])
            torch.baddbmm(states[c], key_chunks[:, c].transpose(1, 2), corrected[c], out=states[c + 1])
        memory = states[n_chunks].clone()
        states = states[:n_chunks].transpose(0, 1).reshape(M, Fd, E)
        corrected = corrected.transpose(0, 1).reshape(M, C, E)
        rows = q.reshape(N, G, n_chunks, C, Fd).transpose(1, 2).reshape(M, G * C, Fd)
        scores = torch.bmm(rows, keys.transpose(1, 2))
        scores.view(-1, G, C, C).tril_()
        out = torch.baddbmm(rows.new_empty(M, G * C, E), rows, states, beta=0.0, alpha=scale)
        out.baddbmm_(scores, corrected, alpha=scale)
        out = out.view(N, n_chunks, G, C, E).transpose(1, 2).reshape(N, G, n_chunks * C, E)
        ctx.save_for_backward(rows, keys, vals, betas, inverse, w, states, corrected, scores, gram)
        ctx.shape = (N, G, T, Fd, E, C, n_chunks, scale)
        return out[:, :, :T], memory

    @staticmethod
    def backward(ctx, grad_out, grad_memory):
        check_first_order_backward("delta_rule(mode='chunk')", "mode='recurrent'")
        rows, keys, vals, betas, inverse, w, states, corrected, scores, gram = ctx.saved_tensors
        N, G, T, Fd, E, C, n_chunks, scale = ctx.shape
        M = N * n_chunks
        if grad_out is None:
            grad_out = rows.new_zeros(N, G, T, E)
        grad_out = pad_time(grad_out * scale, n_chunks * C - T, 2)
        d_rows = grad_out.reshape(N, G, n_chunks, C, E).transpose(1, 2).reshape(M, G * C, E)
        from_reads = torch.bmm(scores.transpose(1, 2), d_rows)  # P^T dO  [M, C, E]
        state_reads = torch.bmm(rows.transpose(1, 2), d_rows)  # Q^T dO  [M, F, E]

        d_state = grad_memory if grad_memory is not None else rows.new_zeros(N, Fd, E)
        # Chunk-major, in place: d_states[c + 1] is dS_{c+1}, d_corrected[c] is dU'_c.
        d_states = rows.new_empty(n_chunks + 1, N, Fd, E)
        d_states[n_chunks].copy_(d_state)
        d_corrected = rows.new_empty(n_chunks, N, C, E)
        key_chunks, w_chunks = keys.view(N, n_chunks, C, Fd), w.view(N, n_chunks, C, Fd)
        read_chunks, state_read_chunks = from_reads.view(N, n_chunks, C, E), state_reads.view(N, n_chunks, Fd, E)
        for c in range(n_chunks - 1, -1, -1):
            torch.baddbmm(read_chunks[:, c], key_chunks[:, c], d_states[c + 1], out=d_corrected[c])
            torch.add(d_states[c + 1], state_read_chunks[:, c], out=d_states[c])
            d_states[c].baddbmm_(w_chunks[:, c].transpose(1, 2), d_corrected[c], alpha=-1.0)
        d_state = d_states[0].clone()
        d_next = d_states[1:].transpose(0, 1).reshape(M, Fd, E)
        d_corrected = d_corrected.transpose(0, 1).reshape(M, C, E)

        causal = torch.ones(C, C, dtype=torch.bool, device=rows.device).tril()
        d_scores = torch.bmm(d_rows, corrected.transpose(1, 2))
        d_scores.view(-1, G, C, C).masked_fill_(~causal, 0.0)
        d_q = torch.bmm(d_rows, states.transpose(1, 2)).baddbmm_(d_scores, keys)
        d_k = torch.bmm(d_scores.transpose(1, 2), rows).baddbmm_(corrected, d_next.transpose(1, 2))
        minus_d_w = torch.bmm(d_corrected, states.transpose(1, 2))  # dW = -dU' S^T
        transform = inverse * betas.transpose(1, 2)
        d_transform = torch.bmm(d_corrected, vals.transpose(1, 2)).baddbmm_(minus_d_w, keys.transpose(1, 2), alpha=-1.0)
        d_k.baddbmm_(transform.transpose(1, 2), minus_d_w, alpha=-1.0)
        d_v = torch.bmm(transform.transpose(1, 2), d_corrected)
        d_beta = (inverse * d_transform).sum(1)  # through T = X diag(beta): column sums
        d_inverse = d_transform.mul_(betas.transpose(1, 2))
        minus_d_lower = torch.bmm(torch.bmm(inverse.transpose(1, 2), d_inverse), inverse.transpose(1, 2)).tril_(-1)
        d_beta.sub_((minus_d_lower * gram).sum(2))
        d_k.baddbmm_(betas * minus_d_lower, keys, alpha=-1.0)
        d_k.baddbmm_(minus_d_lower.transpose(1, 2), betas * keys, alpha=-1.0)

        d_q = d_q.view(N, n_chunks, G, C, Fd).transpose(1, 2).reshape(N, G, n_chunks * C, Fd)[:, :, :T]
        d_k = d_k.reshape(N, n_chunks * C, Fd)[:, :T]
        d_v = d_v.reshape(N, n_chunks * C, E)[:, :T]
        d_beta = d_beta.reshape(N, n_chunks * C)[:, :T]
        return d_q, d_k, d_v, d_beta, d_state, None, None


def _chunk(q, k, v, beta, memory, chunk_size, scale):
    """Chunkwise WY/UT form (``_ChunkDeltaRule``): ``(scale * out [N, G, T, E], final memory)``."""
    return _ChunkDeltaRule.apply(q, k, v, beta, memory, chunk_size, scale)


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
) -> tuple[torch.Tensor, DeltaRuleState | None]:
    """Causal delta-rule attention (DeltaNet / fast weight programmer with the delta rule).

    Args:
        q: ``[B, H, T, Dk]``; k: ``[B, Hkv, T, Dk]``; v: ``[B, Hkv, T, Dv]``, ``H % Hkv == 0``.
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

    Returns:
        ``(out [B, H, T, Dv] in q's dtype, final state or None)``.
    """
    shapes = check_qkv(q, k, v)
    fmap = get_feature_map(feature_map)
    check_choice("normalize", normalize, _NORMALIZE)
    check_choice("mode", mode, (None,) + _MODES)
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
        mode = "recurrent" if T == 1 else "chunk"
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

    if g is not None:
        decay = g.to(dtype).reshape(B * Hkv, *g.shape[2:])
        if mode == "recurrent":
            out, memory = _gated_delta._recurrent(phi_q, phi_k, values, betas, decay, memory)
        else:
            out, memory = _gated_delta._chunk(phi_q, phi_k, values, betas, decay, memory, chunk_size)
        out = out * scale
    elif mode == "recurrent":
        out, memory = _recurrent(phi_q, phi_k, values, betas, memory)
        out = out * scale
    else:
        out, memory = _chunk(phi_q, phi_k, values, betas, memory, chunk_size, scale)
    out = out.reshape(B, H, T, Dv).to(q.dtype)

    state = None
    if output_final_state:
        steps = (initial_state.steps if initial_state is not None else 0) + T
        state = DeltaRuleState(memory=memory.reshape(B, Hkv, Fd, Dv), steps=steps, feature_map=identity,
                               normalize=normalize_name)
    return out, state
