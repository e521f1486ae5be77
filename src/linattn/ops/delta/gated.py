"""The gated delta rule (Gated DeltaNet, KDA): recurrent reference and chunkwise WY form.

Per key/value head, with log decays ``g_t <= 0`` (one per step: Gated DeltaNet; one per key
feature channel: KDA), the memory decays first, then takes the delta-rule write:

    S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   out_t = S_t^T q_t

that is ``S' = diag(exp(g_t)) S_{t-1}``, ``u_t = beta_t (v_t - S'^T k_t)``,
``S_t = S' + k_t u_t^T`` (delta.py's layout; the caller applies the scale).

Chunk form, per chunk of C positions with incoming memory S, ``P_i = sum_{m<=i} g_m`` and
``E_j = sum_{m>j} g_m`` inside the chunk and ``L_ij`` the decay from j to i (``common/decay.py``):
the writes ``U = [u_t]`` solve ``(I + A) U = diag(beta) (V - (K * exp(P)) S)`` with
``A_ts = beta_t k_t.(k_s * exp(L_ts))`` for ``s < t``. With ``T = (I + A)^-1 diag(beta)``,
``W = T (K * exp(P))`` and ``U~ = T V`` (every chunk at once), only

    U_c = U~_c - W_c S_c,     S_{c+1} = exp(P_{C-1}) * S_c + (K_c * exp(E))^T U_c

runs chunk after chunk; then ``O = (Q * exp(P)) S_c + A_qk U`` with
``(A_qk)_ij = q_i.(k_j * exp(L_ij))`` for ``j <= i``, every chunk at once. Gradients by
autograd (the per-channel diagonal blocks by ``_decay``'s own backward): memory
``O(T C + (T / C) F Dv)``.
"""

from __future__ import annotations

import torch

from ..common.decay import decayed_scores, pad_time, suffix_sums, to_chunks

# Layout: q [N, G, T, F], k [N, T, F], v [N, T, E], beta [N, T], g [N, T] or [N, T, F],
# memory [N, F, E] (N = B * Hkv, G query heads per key/value head).


def recurrent(q, k, v, beta, g, memory):
    """Token by token, exactly the recurrence in the module docstring."""
    N = k.shape[0]
    outs = []
    for q_t, k_t, v_t, b_t, a_t in zip(q.unbind(2), k.unbind(1), v.unbind(1), beta.unbind(1), g.exp().unbind(1)):
        memory = a_t.reshape(N, -1, 1) * memory  # [N, 1 or F, 1]: rows of S
        v_old = (k_t.unsqueeze(1) @ memory).squeeze(1)
        update = b_t.unsqueeze(-1) * (v_t - v_old)
        memory = memory + k_t.unsqueeze(-1) * update.unsqueeze(1)
        outs.append(q_t @ memory)
    return torch.stack(outs, dim=2), memory


# Most positions in a chunk of the gated form: its backward is autograd's, whose cost grows
# with the chunk; 32 is the fastest forward + backward of 16, 32 and 64 in
# `tools/decay_chunk_sizes.py` (docs/benchmarks/decay-chunk-sizes/sizes.txt).
GATED_CHUNK = 32


def chunk(q, k, v, beta, g, memory, chunk_size):
    """The chunkwise WY form of the module docstring: ``(out [N, G, T, E], final memory)``,
    in chunks of ``min(chunk_size, GATED_CHUNK)`` positions (``to_chunks`` cuts per-channel
    ones further). T is padded to a multiple of the chunk with k = 0, beta = 0 and g = 0 (no
    writes, no decay)."""
    N, G, T, Fd = q.shape
    E = v.shape[-1]
    rows, keys, vals, chunk_g, n, C, pad = to_chunks(q, k, v, g, min(chunk_size, GATED_CHUNK))
    M = N * n
    betas = pad_time(beta, pad, 1).reshape(M, C, 1)
    decays = chunk_g.unsqueeze(-1) if chunk_g.dim() == 2 else chunk_g  # [M, C, 1 or F]
    entering = decays.cumsum(1).exp()  # exp(P)

    gram = decayed_scores(keys.unsqueeze(1), keys, chunk_g, strict=True).squeeze(1)
    identity = torch.eye(C, dtype=q.dtype, device=q.device).expand(M, C, C)
    inverse = torch.linalg.solve_triangular(gram * betas, identity, upper=False, unitriangular=True)
    transform = inverse * betas.transpose(1, 2)
    w = torch.bmm(transform, keys * entering).view(N, n, C, Fd)
    u = torch.bmm(transform, vals).view(N, n, C, E)
    writes = (keys * suffix_sums(decays, 1).exp()).view(N, n, C, Fd)
    carry = decays.sum(1).exp().view(N, n, -1, 1)

    states, updates = [], []
    # unbind, not [:, c]: the backward of a slice is a zero-filled gradient of the whole tensor
    for u_c, w_c, carry_c, writes_c in zip(u.unbind(1), w.unbind(1), carry.unbind(1), writes.unbind(1)):
        states.append(memory)
        update = torch.baddbmm(u_c, w_c, memory, alpha=-1.0)
        updates.append(update)
        memory = torch.baddbmm(carry_c * memory, writes_c.transpose(1, 2), update)
    states = torch.stack(states, 1).reshape(M, Fd, E)
    updates = torch.stack(updates, 1).reshape(M, C, E)

    scores = decayed_scores(rows, keys, chunk_g, strict=False)
    reads = (rows * entering.unsqueeze(1)).reshape(M, G * C, Fd)
    out = torch.baddbmm(torch.bmm(reads, states), scores.reshape(M, G * C, C), updates)
    return out.view(N, n, G, C, E).transpose(1, 2).reshape(N, G, n * C, E)[:, :, :T], memory
