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

from ..._checks import check_first_order_backward

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


def decayed_scan(carry: torch.Tensor, writes: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The state before each of n chunks and after the last, for

        S_{c+1} = carry_c * S_c + W_c       (S_0 = ``state``)

    with ``carry`` ``[N, n, 1 or F, 1]`` (each chunk's decay, ``exp`` of its summed log decay),
    ``writes`` W ``[N, n, F, W]`` and ``state [N, F, W]``: ``(entering [N, n, F, W], final
    [N, F, W])``. Backward by the reverse recurrence
    ``dS_c = carry_c * dS_{c+1} + d entering_c``, ``dW_c = dS_{c+1}``,
    ``d carry_c = sum(S_c * dS_{c+1})`` over its broadcast channels, written with differentiable
    operations (second derivatives hold); one operation per chunk each way instead of
    autograd's several.
    """
    return _DecayedScan.apply(carry, writes, state)


class _DecayedScan(torch.autograd.Function):
    """``decayed_scan``."""

    @staticmethod
    def forward(ctx, carry, writes, state):
        entering = []
        for carry_c, writes_c in zip(carry.unbind(1), writes.unbind(1)):
            entering.append(state)
            state = torch.addcmul(writes_c, carry_c, state)
        entering = torch.stack(entering, 1)
        ctx.save_for_backward(carry, entering)
        return entering, state

    @staticmethod
    def backward(ctx, d_entering, d_final):
        carry, entering = ctx.saved_tensors
        d_after = []  # dS_{c+1}, from the last chunk
        d = d_final
        for carry_c, d_entering_c in zip(reversed(carry.unbind(1)), reversed(d_entering.unbind(1))):
            d_after.append(d)
            d = torch.addcmul(d_entering_c, carry_c, d)
        d_writes = torch.stack(d_after[::-1], 1)
        d_carry = (entering * d_writes).sum(-1, keepdim=True)
        if carry.shape[2] == 1:
            d_carry = d_carry.sum(2, keepdim=True)
        return d_carry, d_writes, d


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
    ``Z_i[j, f] = y_jf exp(L_ijf)`` (``j <= i``) is ``a_i * Z_{i-1}`` with row i set to
    ``y_i``, and ``A_i = Z_i x_i`` (the diagonal zeroed when ``strict``).

    Backward (first order; a ``strict`` call's gradient has its diagonal zeroed first):
    ``dx_i = Z_i^T dA_i``; ``dy_j = Q_j[j]`` with ``Q_i = dA_i^T x_i + a_{i+1} * Q_{i+1}``
    (rows from the last); ``dg_p = sum_{j<p<=i} dL_ij = a_p sum_{j<p} Z_{p-1}[j] Q_p[j]``
    (every term a product of factors at most 1: no cancellation, strong decays next to weak
    ones cost nothing).

    Both directions walk M in slices (``_FORWARD_BUDGET``, ``_BACKWARD_BUDGET`` entries of
    the rows at once) so that a slice's rows stay in the cache across its c steps.
    """

    @staticmethod
    def forward(ctx, x, y, g, strict):
        ctx.save_for_backward(x, y, g)
        ctx.strict = strict
        M, R, c, Fd = x.shape
        out = x.new_zeros(M, R, c, c)
        steps = g.exp()
        for lo, hi in _slices(M, c * Fd, _FORWARD_BUDGET):
            xs, scores = x[lo:hi], out[lo:hi]
            for i, z in _rows(y[lo:hi], steps[lo:hi]):
                scores[:, :, i, : i + 1] = (xs[:, :, i].unsqueeze(2) * z[:, None, : i + 1]).sum(-1)
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
        for lo, hi in _slices(M, c * c * Fd, _BACKWARD_BUDGET):
            xs, dA, a = x[lo:hi], grad[lo:hi], steps[lo:hi]
            dxs, dys, dgs = d_x[lo:hi], d_y[lo:hi], d_g[lo:hi]
            rows = x.new_empty(c, hi - lo, c, Fd)
            for i, z in _rows(y[lo:hi], a):
                rows[i, :, : i + 1] = z[:, : i + 1]  # the rest of rows[i] is never read
                dxs[:, :, i] = (dA[:, :, i, : i + 1, None] * z[:, None, : i + 1]).sum(2)
            q = x.new_zeros(hi - lo, c, Fd)  # Q_i [m, j, F]
            for i in range(c - 1, -1, -1):
                if i < c - 1:
                    q[:, : i + 2].mul_(a[:, i + 1].unsqueeze(1))  # a_{i+1} Q_{i+1}
                    dgs[:, i + 1] = (rows[i, :, : i + 1] * q[:, : i + 1]).sum(1)
                if R == 1:
                    q[:, : i + 1].addcmul_(dA[:, 0, i, : i + 1, None], xs[:, 0, i, None, :])
                else:
                    q[:, : i + 1] += (dA[:, :, i, : i + 1, None] * xs[:, :, i, None, :]).sum(1)
                dys[:, i] = q[:, i]
        return d_x, d_y, d_g, None


# Entries of the rows Z (forward: one Z_i per chunk; backward: all c of them) that one slice
# of M holds at once: a few MB, so that the c steps over a slice find it in the cache.
_FORWARD_BUDGET = 1 << 20
_BACKWARD_BUDGET = 1 << 22


def _slices(M: int, per_item: int, budget: int) -> list[tuple[int, int]]:
    """``(lo, hi)`` slices of ``range(M)`` of at most ``budget // per_item`` items (at least one)."""
    step = max(1, budget // per_item)
    return [(lo, min(lo + step, M)) for lo in range(0, M, step)]


def _rows(y, steps):
    """``(i, Z_i)`` for i = 0 .. c - 1: ``Z_i [M, c, F]`` with ``Z_i[j, f] = y_jf exp(L_ijf)``
    for ``j <= i``, 0 elsewhere, from ``y [M, c, F]`` and the step factors
    ``steps = exp(g) [M, c, F]``. One buffer, updated in place."""
    M, c, Fd = y.shape
    z = y.new_zeros(M, c, Fd)
    for i in range(c):
        if i:
            z[:, :i].mul_(steps[:, i].unsqueeze(1))
        z[:, i] = y[:, i]
        yield i, z
