"""The delta rule's chunkwise-parallel WY/UT form with a hand-written backward, in the
layout of ``rule.py``'s forms: q ``[N, G, T, F]``, k ``[N, T, F]``, v ``[N, T, E]``,
beta ``[N, T]``, memory ``[N, F, E]``."""

from __future__ import annotations

import torch

from ..._checks import check_first_order_backward
from ..common.decay import pad_time


def _forward(q, k, v, beta, memory, chunk_size, scale, *, in_place: bool):
    """``ChunkDeltaRule``'s forward -> ``(out, final memory, the tensors its backward keeps)``. The
    state recurrence writes into chunk-major buffers: ``in_place`` through ``out=`` (no autograd:
    inside the Function), else through ``copy_``, which autograd differentiates (traced as plain ops
    under ``torch.export``)."""
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
    # Chunk-major buffers written by the loop (states[c] is S_c), then put in the [N, n_chunks]
    # order of the batched reads.
    states = q.new_empty(n_chunks + 1, N, Fd, E)
    states[0].copy_(memory)
    corrected = q.new_empty(n_chunks, N, C, E)
    w_chunks, u_chunks = w.view(N, n_chunks, C, Fd), u.view(N, n_chunks, C, E)
    key_chunks = keys.view(N, n_chunks, C, Fd)
    for c in range(n_chunks):
        if in_place:
            torch.baddbmm(u_chunks[:, c], w_chunks[:, c], states[c], alpha=-1.0, out=corrected[c])
            torch.baddbmm(states[c], key_chunks[:, c].transpose(1, 2), corrected[c], out=states[c + 1])
        else:
            corrected[c].copy_(torch.baddbmm(u_chunks[:, c], w_chunks[:, c], states[c], alpha=-1.0))
            states[c + 1].copy_(torch.baddbmm(states[c], key_chunks[:, c].transpose(1, 2), corrected[c]))
    memory = states[n_chunks].clone()
    states = states[:n_chunks].transpose(0, 1).reshape(M, Fd, E)
    corrected = corrected.transpose(0, 1).reshape(M, C, E)
    rows = q.reshape(N, G, n_chunks, C, Fd).transpose(1, 2).reshape(M, G * C, Fd)
    scores = torch.bmm(rows, keys.transpose(1, 2))
    scores.view(-1, G, C, C).tril_()
    out = torch.baddbmm(rows.new_empty(M, G * C, E), rows, states, beta=0.0, alpha=scale)
    out.baddbmm_(scores, corrected, alpha=scale)
    out = out.view(N, n_chunks, G, C, E).transpose(1, 2).reshape(N, G, n_chunks * C, E)
    return out[:, :, :T], memory, (rows, keys, vals, betas, inverse, w, states, corrected, scores, gram)


class ChunkDeltaRule(torch.autograd.Function):
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
        out, memory, saved = _forward(q, k, v, beta, memory, chunk_size, scale, in_place=True)
        ctx.save_for_backward(*saved)
        ctx.shape = (*q.shape, v.shape[-1], chunk_size, -(-q.shape[2] // chunk_size), scale)
        return out, memory

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


def chunk(q, k, v, beta, memory, chunk_size, scale):
    """Chunkwise WY/UT form (``ChunkDeltaRule``): ``(scale * out [N, G, T, E], final memory)``.
    Under ``torch.export`` the forward is traced as plain ops, which autograd differentiates (an
    autograd Function's ``out=`` writes would fail it)."""
    if torch.compiler.is_exporting():
        out, memory, _ = _forward(q, k, v, beta, memory, chunk_size, scale, in_place=False)
        return out, memory
    return ChunkDeltaRule.apply(q, k, v, beta, memory, chunk_size, scale)
