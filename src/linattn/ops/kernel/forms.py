"""The forms of kernel attention without decay: the parallel reference, the chunkwise-parallel
form and the recurrent form (``attention.py`` chooses one; ``decay_forms.py`` has the decayed ones).
"""

from __future__ import annotations

import torch

from .feature_maps import FeatureMap, normalized_features


# The three forms share one layout: q [N, G, T, Dk], k [N, T, Dk], v [N, T, E]
# (N = B * Hkv, G query heads per key/value head), state S [N, F, E] and z [N, F]
# (z is None without a denominator). `features` maps raw q/k to phi, `finish` turns
# (numerator, denominator, query shift) into the output. Each returns (out, S, z).


class Features:
    """phi of queries and keys for any slice of positions, stabilisers fixed per call.

    Under "attention", exponential maps are stabilised by max-subtraction that cancels
    exactly in the ratio: per query row, and one detached shift per (batch, head) for the
    keys (``key_shift [N]``, merged with the carried state's). Other normalisations are
    per row and need no shift.
    """

    def __init__(self, fmap: FeatureMap, normalize, eps, key_shift, all_keys=None, all_key_logs=None):
        self.fmap, self.eps, self.key_shift = fmap, eps, key_shift
        # log-features of every key, computed once for the shift: reused when the form asks
        # for the features of all keys at once (parallel, recurrent, non-causal).
        self.all_keys, self.all_key_logs = all_keys, all_key_logs
        self.normalize = None if normalize == "attention" else normalize
        self.shifted = key_shift is not None

    def queries(self, q):
        if self.shifted:
            log_q = self.fmap.log_features(q, is_query=True)
            shift = log_q.amax(dim=-1, keepdim=True).detach()
            return (log_q - shift).exp_(), shift
        return normalized_features(self.fmap, q, is_query=True, normalize=self.normalize, eps=self.eps), None

    def keys(self, k):
        if self.shifted:
            if k is self.all_keys and self.all_key_logs is not None:
                log_k = self.all_key_logs
            else:
                log_k = self.fmap.log_features(k, is_query=False)
            return (log_k - self.key_shift[:, None, None]).exp_()  # the shift is detached: no grad
        return normalized_features(self.fmap, k, is_query=False, normalize=self.normalize, eps=self.eps)


def parallel(q, k, v, S, z, causal, features, finish, final_state):
    """Reference: materialised (masked) ``A = phi(Q) phi(K)^T`` [N, G, T, T].

    The final state (``phi(K)^T V``, ``T F E`` work) is formed only if ``final_state``:
    for a few queries over many keys this order is the cheap one.
    """
    phi_q, q_shift = features.queries(q)
    phi_k = features.keys(k)
    A = phi_q @ phi_k.unsqueeze(1).transpose(-1, -2)
    if causal:
        A = A.tril()
    num = A @ v.unsqueeze(1)
    den = A.sum(-1, keepdim=True) if z is not None else None
    if S is not None:
        num = num + phi_q @ S.unsqueeze(1)
        if z is not None:
            den = den + phi_q @ z[:, None, :, None]
    if not final_state:
        return finish(num, den, q_shift), None, None
    S_final = phi_k.transpose(-1, -2) @ v + (S if S is not None else 0)
    z_final = phi_k.sum(1) + z if z is not None else None
    return finish(num, den, q_shift), S_final, z_final


def recurrent(q, k, v, S, z, causal, features, finish):
    """Token by token: ``S <- S + phi(k_t) v_t^T``, ``z <- z + phi(k_t)``, read with phi(q_t)."""
    phi_q, q_shift = features.queries(q)
    phi_k = features.keys(k)
    if S is None:
        S = phi_k.new_zeros(phi_k.shape[0], phi_k.shape[-1], v.shape[-1])
    nums, dens = [], []
    # Non-causal: every key is written before any query reads (query and key counts may differ).
    reads = phi_q.unbind(2) if causal else [None] * phi_k.shape[1]
    for q_t, k_t, v_t in zip(reads, phi_k.unbind(1), v.unbind(1)):
        S = S + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        if z is not None:
            z = z + k_t
        if causal:
            nums.append(q_t @ S)
            if z is not None:
                dens.append(q_t @ z.unsqueeze(-1))
    if not causal:
        num = phi_q @ S.unsqueeze(1)
        den = phi_q @ z[:, None, :, None] if z is not None else None
    else:
        num = torch.stack(nums, dim=2)
        den = torch.stack(dens, dim=2) if z is not None else None
    return finish(num, den, q_shift), S, z


def chunk(q, k, v, S, z, causal, chunk_size, features, finish):
    """Chunkwise parallel: within a chunk of C positions, ``tril(Q_c K_c^T) V_c``; across
    chunks, the carried state: ``out_c = Q_c S + tril(Q_c K_c^T) V_c``, ``S += K_c^T V_c``.

    Features, products and the division all happen chunk by chunk, so no full-length
    temporary is made besides the output; the G query heads of a key/value head are
    stacked as G * C rows of one matmul.
    """
    N, G, T, _ = q.shape
    E = v.shape[-1]
    if not causal:
        phi_k = features.keys(k)
        S_final = phi_k.transpose(-1, -2) @ v + (S if S is not None else 0)
        z_final = phi_k.sum(1) + z if z is not None else None
        phi_q, q_shift = features.queries(q)
        den = phi_q @ z_final[:, None, :, None] if z is not None else None
        return finish(phi_q @ S_final.unsqueeze(1), den, q_shift), S_final, z_final
    outs = []
    for q_c, k_c, v_c in zip(q.split(chunk_size, dim=2), k.split(chunk_size, dim=1), v.split(chunk_size, dim=1)):
        C = k_c.shape[1]
        phi_q, q_shift = features.queries(q_c)
        phi_k = features.keys(k_c)
        F = phi_k.shape[-1]
        if S is None:
            S = phi_k.new_zeros(N, F, E)
        rows = phi_q.reshape(N, G * C, F)
        A = torch.bmm(rows, phi_k.transpose(1, 2))
        A.view(N, G, C, C).tril_()
        num = torch.bmm(rows, S).baddbmm_(A, v_c).view(N, G, C, E)
        den = None
        if z is not None:
            den = torch.baddbmm(A.sum(-1, keepdim=True), rows, z.unsqueeze(-1)).view(N, G, C, 1)
            z = z + phi_k.sum(1)
        outs.append(finish(num, den, q_shift))
        S = torch.baddbmm(S, phi_k.transpose(1, 2), v_c)
    return torch.cat(outs, dim=2), S, z
