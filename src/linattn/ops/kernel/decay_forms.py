"""Kernel attention with decay: parallel (reference), chunk and recurrent forms.

Causal, per key/value head, with log decays ``g_t <= 0`` (one per step, or one per feature
channel f of phi):

    S_t = diag(exp(g_t)) S_{t-1} + phi(k_t) v_t^T        z_t = exp(g_t) * z_{t-1} + phi(k_t)
    out_t = phi(q_t)^T S_t  [/ (phi(q_t).z_t + eps)]

Unrolled, a write at j reaches the read at ``i >= j`` times ``exp(L_ij)``,
``L_ij = sum_{j<m<=i} g_m`` (``common/decay.py``). The forms share ``forms.py``'s layout and its
``features``/``finish`` protocol: q ``[N, G, T, Dk]``, k ``[N, T, Dk]``, v ``[N, T, E]``,
g ``[N, T]`` or ``[N, T, F]``, S ``[N, F, E]`` (None: zero), z ``[N, F]`` or None; each
returns ``(out, S, z)``.
"""

from __future__ import annotations

import torch

from ..common.decay import causal_mask, decayed_scan, decayed_scores, pair_sums, suffix_sums, to_chunks


def _per_channel(g: torch.Tensor) -> torch.Tensor:
    """``g`` with a channel axis: ``[N, T] -> [N, T, 1]``; ``[N, T, F]`` as it is."""
    return g.unsqueeze(-1) if g.dim() == 2 else g


def parallel(q, k, v, S, z, g, features, finish, final_state):
    """Reference: the masked, decayed ``A_ij = sum_f phi(q_i)_f phi(k_j)_f exp(L_ijf)``
    ``[N, G, T, T]``, and the carried state read through ``exp(sum_{m<=i} g_m)``."""
    phi_q, q_shift = features.queries(q)
    phi_k = features.keys(k)
    T = phi_k.shape[1]
    mask = causal_mask(T, False, q.device)
    if g.dim() == 2:
        decay = torch.where(mask, pair_sums(g).exp(), g.new_zeros(()))  # [N, i, j]
        A = phi_q @ phi_k.unsqueeze(1).transpose(-1, -2) * decay.unsqueeze(1)
    else:
        decay = torch.where(mask, pair_sums(g.transpose(1, 2)).exp(), g.new_zeros(()))  # [N, F, i, j]
        A = torch.einsum("ngif,nfij,njf->ngij", phi_q, decay, phi_k)
    num = A @ v.unsqueeze(1)
    den = A.sum(-1, keepdim=True) if z is not None else None
    decays = _per_channel(g)
    if S is not None:
        reads = phi_q * decays.cumsum(1).exp().unsqueeze(1)
        num = num + reads @ S.unsqueeze(1)
        if z is not None:
            den = den + reads @ z[:, None, :, None]
    if not final_state:
        return finish(num, den, q_shift), None, None
    writes = phi_k * suffix_sums(decays, 1).exp()
    carry = decays.sum(1).exp()  # [N, 1 or F]
    S_final = writes.transpose(-1, -2) @ v + (carry.unsqueeze(-1) * S if S is not None else 0)
    z_final = writes.sum(1) + carry * z if z is not None else None
    return finish(num, den, q_shift), S_final, z_final


def recurrent(q, k, v, S, z, g, features, finish):
    """Token by token: ``S <- exp(g_t) S + phi(k_t) v_t^T``, ``z <- exp(g_t) z + phi(k_t)``,
    read with ``phi(q_t)``."""
    phi_q, q_shift = features.queries(q)
    phi_k = features.keys(k)
    N = phi_k.shape[0]
    if S is None:
        S = phi_k.new_zeros(N, phi_k.shape[-1], v.shape[-1])
    nums, dens = [], []
    for q_t, k_t, v_t, a_t in zip(phi_q.unbind(2), phi_k.unbind(1), v.unbind(1), g.exp().unbind(1)):
        a_t = a_t.reshape(N, -1, 1)  # [N, 1 or F, 1]
        S = a_t * S + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        nums.append(q_t @ S)
        if z is not None:
            z = a_t[..., 0] * z + k_t
            dens.append(q_t @ z.unsqueeze(-1))
    num = torch.stack(nums, dim=2)
    den = torch.stack(dens, dim=2) if z is not None else None
    return finish(num, den, q_shift), S, z


def chunk(q, k, v, S, z, g, chunk_size, features, finish):
    """Chunkwise parallel, every chunk at once but the state recurrence. Per chunk of C
    positions, with ``P_i = sum_{m<=i} g_m`` and ``E_j = sum_{m>j} g_m`` inside the chunk:

        out_c = (phi(Q_c) * exp(P)) S_c + A_c V_c     (A_c: ``decayed_scores``)
        S_{c+1} = exp(P_{C-1}) * S_c + (phi(K_c) * exp(E))^T V_c     (``decayed_scan``)

    The normaliser z rides along as one more value column (values 1), so it decays and is
    read exactly like S.
    """
    phi_q, q_shift = features.queries(q)
    phi_k = features.keys(k)
    N, G, T, Fd = phi_q.shape
    E = v.shape[-1]
    values = v if z is None else torch.cat([v, v.new_ones(N, T, 1)], -1)
    state = phi_k.new_zeros(N, Fd, E) if S is None else S
    if z is not None:
        state = torch.cat([state, z.unsqueeze(-1)], -1)
    width = values.shape[-1]
    rows, keys, vals, chunk_g, n, C, _ = to_chunks(phi_q, phi_k, values, g, chunk_size)
    M = N * n
    scores = decayed_scores(rows, keys, chunk_g, strict=False)
    decays = _per_channel(chunk_g)
    writes = torch.bmm((keys * suffix_sums(decays, 1).exp()).transpose(1, 2), vals).view(N, n, Fd, width)
    entering, state = decayed_scan(decays.sum(1).exp().view(N, n, -1, 1), writes, state)
    entering = entering.reshape(M, Fd, width)
    reads = (rows * decays.cumsum(1).exp().unsqueeze(1)).reshape(M, G * C, Fd)
    num = torch.baddbmm(torch.bmm(reads, entering), scores.reshape(M, G * C, C), vals)
    num = num.view(N, n, G, C, width).transpose(1, 2).reshape(N, G, n * C, width)[:, :, :T]
    if z is None:
        return finish(num, None, q_shift), state, None
    return finish(num[..., :E], num[..., E:], q_shift), state[..., :E].contiguous(), state[..., E].contiguous()
