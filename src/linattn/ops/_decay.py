"""Log decays inside a chunk: range sums of ``g`` and scores decayed by them.

A gated recurrence multiplies its state by ``exp(g_t)`` (``g <= 0``; one value per step, or
one per key channel) before step t writes. A write at step j reaches a read at step
``i >= j`` multiplied by ``exp(L_ij)``, ``L_ij = sum_{j<m<=i} g_m``.

Every factor here is the exponential of a range sum of ``g`` accumulated from its own terms
(a cumulative sum over masked entries), never the difference of two cumulative sums: no
factor exceeds 1 (no ``exp(+x)`` anywhere), and a strong decay (``g = -30``, or ``-inf``, a
reset) next to weak ones costs the weak ones no precision.

Per-channel decays cannot be factored into one query factor and one key factor without
``exp(+x)``, so ``decayed_scores`` splits a chunk into sub-chunks of ``_SUB_CHUNK``: across
sub-chunks, queries times ``exp(sum over their own sub-chunk up to i)`` against keys times
``exp(sum from j to that sub-chunk)`` (both at most 1, one matmul per query sub-chunk);
within one, the ``[c, c, F]`` factors pairwise (``_PairwiseScores``, which recomputes them in
its backward instead of storing them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import check_first_order_backward

_SUB_CHUNK = 16
# Elements of one [m, F, c, c] block of pairwise factors made at a time.
_PAIRWISE_BLOCK = 1 << 21


def pad_time(x: torch.Tensor, pad: int, dim: int) -> torch.Tensor:
    """``x`` with ``pad`` zeros appended along ``dim``."""
    if not pad:
        return x
    widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
    return F.pad(x, widths)


def to_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk_size: int) -> tuple:
    """``q [N, G, T, F]``, ``k [N, T, F]``, ``v [N, T, E]`` and ``g [N, T(, F)]`` in chunks of
    ``C = min(chunk_size, T)`` positions, the last zero-padded (k = 0 and g = 0: nothing written,
    nothing decayed): ``(rows [M, G, C, F], keys [M, C, F], vals [M, C, E], chunk_g [M, C(, F)],
    n, C, pad)`` with ``n`` chunks per row, ``M = N n`` and ``pad = n C - T``."""
    N, G, T, Fd = q.shape
    C = min(chunk_size, T)
    n = -(-T // C)
    pad = n * C - T
    M = N * n
    rows = pad_time(q, pad, 2).view(N, G, n, C, Fd).transpose(1, 2).reshape(M, G, C, Fd)
    keys = pad_time(k, pad, 1).reshape(M, C, Fd)
    vals = pad_time(v, pad, 1).reshape(M, C, v.shape[-1])
    chunk_g = pad_time(g, pad, 1).reshape(M, C, *g.shape[2:])
    return rows, keys, vals, chunk_g, n, C, pad


def suffix_sums(g: torch.Tensor, dim: int) -> torch.Tensor:
    """``E_j = sum_{m>j} g_m`` along ``dim`` (0 at the last position): the decay from step j's
    write to the end of the chunk."""
    n = g.shape[dim]
    inclusive = g.flip(dim).cumsum(dim).flip(dim)
    return torch.cat([inclusive.narrow(dim, 1, n - 1), torch.zeros_like(g.narrow(dim, 0, 1))], dim)


def pair_sums(g: torch.Tensor) -> torch.Tensor:
    """``L [..., C, C]`` with ``L_ij = sum_{j<m<=i} g_m`` for ``i >= j`` (0 above the diagonal),
    from ``g [..., C]``."""
    later = causal_mask(g.shape[-1], True, g.device)  # m = i > j
    terms = torch.where(later, g.unsqueeze(-1), g.new_zeros(()))  # [..., i, j]: g_i where i > j
    return terms.cumsum(-2)


def causal_mask(C: int, strict: bool, device) -> torch.Tensor:
    """``[C, C]`` bool, ``j <= i`` (``j < i`` when ``strict``)."""
    i = torch.arange(C, device=device)
    return i[:, None] > i[None, :] if strict else i[:, None] >= i[None, :]


def decayed_scores(x: torch.Tensor, y: torch.Tensor, g: torch.Tensor, *, strict: bool) -> torch.Tensor:
    """Scores decayed from position j to position i of one chunk:

        A_ij = sum_f x_if y_jf exp(L_ijf)   for j <= i (j < i if ``strict``), else 0

    ``x [M, R, C, F]`` (R row groups, e.g. the query heads of one key/value head),
    ``y [M, C, F]``, ``g [M, C]`` (one decay per step: ``L_ijf = L_ij``) or ``[M, C, F]``
    -> ``[M, R, C, C]``.
    """
    M, R, C, Fd = x.shape
    mask = causal_mask(C, strict, x.device)
    if g.dim() == 2:
        decay = torch.where(mask, pair_sums(g).exp(), g.new_zeros(()))
        scores = torch.bmm(x.reshape(M, R * C, Fd), y.transpose(1, 2)).view(M, R, C, C)
        return scores * decay.unsqueeze(1)
    c = min(C, _SUB_CHUNK)
    n = -(-C // c)
    pad = n * c - C
    x, y, g = pad_time(x, pad, 2), pad_time(y, pad, 1), pad_time(g, pad, 1)
    diagonal = _PairwiseScores.apply(
        x.view(M, R, n, c, Fd).transpose(1, 2).reshape(M * n, R, c, Fd),
        y.reshape(M * n, c, Fd), g.reshape(M * n, c, Fd), strict,
    ).view(M, n, R, c, c)
    if n == 1:
        return diagonal.view(M, R, c, c)[:, :, :C, :C]
    blocks = g.view(M, n, c, Fd)
    # Queries of sub-chunk a: exp(sum from a's start to i). Keys of sub-chunk b: exp(sum from
    # j to b's end), times exp(sum over the whole sub-chunks between b and a), 0 unless b < a.
    rows = x.view(M, R, n, c, Fd) * blocks.cumsum(2).exp().unsqueeze(1)
    keys = y.view(M, n, c, Fd) * suffix_sums(blocks, 2).exp()
    spans = pair_sums(blocks.sum(2).transpose(1, 2))  # [M, F, a, b]: sum over sub-chunks b < m <= a
    between = torch.cat([torch.zeros_like(spans[:, :, :1]), spans[:, :, :-1]], 2)  # b < m < a
    earlier = causal_mask(n, True, x.device)
    factor = torch.where(earlier, between.exp(), between.new_zeros(()))
    keys = keys.unsqueeze(1) * factor.permute(0, 2, 3, 1).unsqueeze(3)  # [M, a, b, c, F]
    across = torch.bmm(
        rows.permute(0, 2, 1, 3, 4).reshape(M * n, R * c, Fd),
        keys.reshape(M * n, n * c, Fd).transpose(1, 2),
    ).view(M, n, R, c, n, c)
    # The diagonal blocks of `across` are zero: put the pairwise ones there.
    scores = torch.diagonal_scatter(across, diagonal.permute(0, 2, 3, 4, 1), dim1=1, dim2=4)
    return scores.permute(0, 2, 1, 3, 4, 5).reshape(M, R, n * c, n * c)[:, :, :C, :C]


class _PairwiseScores(torch.autograd.Function):
    """``A_ij = sum_f x_if y_jf exp(L_ijf)`` on the causal mask, ``x [M, R, c, F]``,
    ``y [M, c, F]``, ``g [M, c, F]`` -> ``[M, R, c, c]``.

    The ``[c, c, F]`` factors of a block are made, used and dropped block by block, in the
    forward and again in the backward (first order only), which saves only x, y and g. With
    ``W_fij = y_jf exp(L_ijf)`` and ``H_fij = sum_r dA_rij x_rif``: ``dx = dA W``,
    ``dy_jf = sum_i H_fij exp(L_ijf)``, ``dL = H W`` and ``dg_p = sum_{j<p<=i} dL_ij``.
    """

    @staticmethod
    def forward(ctx, x, y, g, strict):
        ctx.save_for_backward(x, y, g)
        ctx.strict = strict
        out = x.new_empty(x.shape[:-1] + (x.shape[-2],))
        for lo, hi in _blocks(x):
            factors = _decay_factors(g[lo:hi], strict) * y[lo:hi].transpose(1, 2).unsqueeze(2)
            out[lo:hi] = torch.einsum("mrif,mfij->mrij", x[lo:hi], factors)
        return out

    @staticmethod
    def backward(ctx, grad):
        check_first_order_backward("a chunk form with per-channel decay", "mode='recurrent'")
        x, y, g = ctx.saved_tensors
        c = x.shape[-2]
        earlier = causal_mask(c, True, x.device)  # [p, j]: j < p
        d_x, d_y, d_g = torch.empty_like(x), torch.empty_like(y), torch.empty_like(g)
        for lo, hi in _blocks(x):
            decay = _decay_factors(g[lo:hi], ctx.strict)  # exp(L) [m, F, i, j]
            factors = decay * y[lo:hi].transpose(1, 2).unsqueeze(2)  # W
            d_x[lo:hi] = torch.einsum("mrij,mfij->mrif", grad[lo:hi], factors)
            h = torch.einsum("mrij,mrif->mfij", grad[lo:hi], x[lo:hi])
            d_y[lo:hi] = (h * decay).sum(2).transpose(1, 2)
            after = (h * factors).flip(2).cumsum(2).flip(2)  # dL summed over i >= p: [m, F, p, j]
            d_g[lo:hi] = (after * earlier).sum(-1).transpose(1, 2)
        return d_x, d_y, d_g, None


def _blocks(x):
    """Slices ``(lo, hi)`` of the first dimension of x whose ``[m, R, F, c, c]`` temporaries
    stay near ``_PAIRWISE_BLOCK`` elements."""
    M, R, c, Fd = x.shape
    step = max(1, _PAIRWISE_BLOCK // (c * c * Fd * max(R, 1)))
    return [(lo, min(lo + step, M)) for lo in range(0, M, step)]


def _decay_factors(g, strict):
    """``exp(L_ijf)`` on the mask, 0 elsewhere: ``[m, F, c, c]`` from ``g [m, c, F]``."""
    c = g.shape[1]
    return torch.where(causal_mask(c, strict, g.device), pair_sums(g.transpose(1, 2)).exp(), g.new_zeros(()))
