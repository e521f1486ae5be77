"""Log decays inside a chunk: range sums of ``g`` and scores decayed by them.

A gated recurrence multiplies its state by ``exp(g_t)`` (``g <= 0``; one value per step, or
one per key channel) before step t writes. A write at step j reaches a read at step
``i >= j`` multiplied by ``exp(L_ij)``, ``L_ij = sum_{j<m<=i} g_m``.

Every factor here is the exponential of a range sum of ``g`` accumulated from its own terms
(a cumulative sum over masked entries), never the difference of two cumulative sums: no
factor exceeds 1 (no ``exp(+x)`` anywhere), and a strong decay (``g = -30``, or ``-inf``, a
reset) next to weak ones costs the weak ones no precision.

Per-channel decays cannot be factored into one query factor and one key factor without
``exp(+x)``, so inside a chunk their scores are pairwise, row after row as products of the
steps' factors (``_PairwiseScores``, which never holds ``[c, c, F]`` factors and recomputes
the rows in its backward); their chunks hold at most ``CHANNEL_CHUNK`` positions, as the
pairwise work grows with the chunk while the state recurrence between chunks is cheap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import check_first_order_backward

CHANNEL_CHUNK = 16  # most positions in a chunk of a per-channel decay form


def pad_time(x: torch.Tensor, pad: int, dim: int) -> torch.Tensor:
    """``x`` with ``pad`` zeros appended along ``dim``."""
    if not pad:
        return x
    widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
    return F.pad(x, widths)


def to_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk_size: int) -> tuple:
    """``q [N, G, T, F]``, ``k [N, T, F]``, ``v [N, T, E]`` and ``g [N, T(, F)]`` in chunks of
    ``C = min(chunk_size, T)`` positions (at most ``CHANNEL_CHUNK`` for a per-channel ``g``),
    the last zero-padded (k = 0 and g = 0: nothing written, nothing decayed): ``(rows
    [M, G, C, F], keys [M, C, F], vals [M, C, E], chunk_g [M, C(, F)], n, C, pad)`` with
    ``n`` chunks per row, ``M = N n`` and ``pad = n C - T``."""
    N, G, T, Fd = q.shape
    C = min(chunk_size, T, CHANNEL_CHUNK if g.dim() == 3 else T)
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
    if g.dim() == 3:
        return _PairwiseScores.apply(x, y, g, strict)
    decay = torch.where(causal_mask(C, strict, x.device), pair_sums(g).exp(), g.new_zeros(()))
    scores = torch.bmm(x.reshape(M, R * C, Fd), y.transpose(1, 2)).view(M, R, C, C)
    return scores * decay.unsqueeze(1)


class _PairwiseScores(torch.autograd.Function):
    """``A_ij = sum_f x_if y_jf exp(L_ijf)`` on the causal mask, ``x [M, R, c, F]``,
    ``y [M, c, F]``, ``g [M, c, F]`` -> ``[M, R, c, c]``, row after row without forming
    ``exp`` of a sum: with ``a_i = exp(g_i)`` (each at most 1) the row
    ``Z_i[f, j] = y_jf exp(L_ijf)`` (``j <= i``) is ``a_i * Z_{i-1}`` with column i set to
    ``y_i``, and ``A_i = x_i Z_i`` (the diagonal zeroed when ``strict``).

    Backward (first order; a ``strict`` call's gradient has its diagonal zeroed first):
    ``dx_i = dA_i Z_i^T``; ``dy_j = Q_j[:, j]`` with ``Q_i = x_i^T dA_i + a_{i+1} * Q_{i+1}``
    (rows from the last); ``dg_p = sum_{j<p<=i} dL_ij = a_p sum_{j<p} Z_{p-1}[:, j] Q_p[:, j]``
    (every term a product of factors at most 1: no cancellation, strong decays next to weak
    ones cost nothing). The rows ``Z`` of a slice of M are held while its ``Q`` runs.
    """

    @staticmethod
    def forward(ctx, x, y, g, strict):
        ctx.save_for_backward(x, y, g)
        ctx.strict = strict
        M, R, c, Fd = x.shape
        out = x.new_zeros(M, R, c, c)
        for i, z in _rows(y, g.exp()):
            out[:, :, i, : i + 1] = _row_times(x[:, :, i], z[:, :, : i + 1])
        if strict:
            out.diagonal(dim1=2, dim2=3).zero_()
        return out

    @staticmethod
    def backward(ctx, grad):
        check_first_order_backward("a chunk form with per-channel decay", "mode='recurrent'")
        x, y, g = ctx.saved_tensors
        M, R, c, Fd = x.shape
        if ctx.strict:
            grad = grad.clone()
            grad.diagonal(dim1=2, dim2=3).zero_()
        steps = g.exp()
        d_x, d_y, d_g = torch.empty_like(x), torch.empty_like(y), torch.zeros_like(g)
        for lo, hi in _slices(M, c * Fd * c):
            xs, dA, a = x[lo:hi], grad[lo:hi], steps[lo:hi]
            rows = x.new_empty(c, hi - lo, Fd, c)
            for i, z in _rows(y[lo:hi], a):
                rows[i] = z
                d_x[lo:hi, :, i] = (dA[:, :, i, None, : i + 1] * z[:, None, :, : i + 1]).sum(-1)
            q = x.new_zeros(hi - lo, Fd, c)
            for i in range(c - 1, -1, -1):
                if i < c - 1:
                    q.mul_(a[:, i + 1].unsqueeze(-1))  # a_{i+1} Q_{i+1}
                    d_g[lo:hi, i + 1] = (rows[i, :, :, : i + 1] * q[:, :, : i + 1]).sum(-1)
                q += (xs[:, :, i, :, None] * dA[:, :, i, None, :]).sum(1)  # Q_i
                d_y[lo:hi, i] = q[:, :, i]
        return d_x, d_y, d_g, None


def _row_times(x_i: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``x_i [M, R, F]`` times ``z [M, F, n]`` -> ``[M, R, n]``, as products and a sum (a
    batched matmul of M tiny matrices would loop over them one by one)."""
    return (x_i.unsqueeze(-1) * z.unsqueeze(1)).sum(2)


# Entries of the rows Z that one slice of the backward holds at once.
_ROWS_BUDGET = 1 << 22


def _slices(M: int, per_item: int) -> list[tuple[int, int]]:
    """``(lo, hi)`` slices of ``range(M)`` of at most ``_ROWS_BUDGET // per_item`` items (at least one)."""
    step = max(1, _ROWS_BUDGET // per_item)
    return [(lo, min(lo + step, M)) for lo in range(0, M, step)]


def _rows(y, steps):
    """``(i, Z_i)`` for i = 0 .. c - 1: ``Z_i [M, F, c]`` with ``Z_i[f, j] = y_jf exp(L_ijf)``
    for ``j <= i``, 0 elsewhere, from ``y [M, c, F]`` and the step factors
    ``steps = exp(g) [M, c, F]``. One buffer, updated in place."""
    M, c, Fd = y.shape
    z = y.new_zeros(M, Fd, c)
    for i in range(c):
        if i:
            z[:, :, :i].mul_(steps[:, i].unsqueeze(-1))
        z[:, :, i] = y[:, i]
        yield i, z
