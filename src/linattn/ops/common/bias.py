"""Relative-position biases given as a callable of the offset ``i - j``."""

from __future__ import annotations

from collections.abc import Callable

import torch


def relative_bias_table(
    bias: Callable[[torch.Tensor], torch.Tensor], offsets: torch.Tensor, heads: int, dtype: torch.dtype
) -> torch.Tensor:
    """Evaluate ``bias(offsets)`` once; return ``[Hb, n]`` with ``Hb`` in {1, heads}.

    ``offsets`` is a 1-D long tensor of n offsets ``i - j``; the callable must return
    ``[n]`` (shared by all heads) or ``[heads, n]`` floats.
    """
    table = bias(offsets)
    n = offsets.numel()
    if not isinstance(table, torch.Tensor) or not table.is_floating_point():
        raise TypeError(f"bias callable must return a floating-point tensor of shape [{n}] or [{heads}, {n}]")
    if table.dim() == 1:
        table = table.unsqueeze(0)
    if table.dim() != 2 or table.shape[-1] != n or table.shape[0] not in (1, heads):
        raise ValueError(
            f"bias callable returned shape {list(table.shape)} for {n} offsets; expected [{n}] or [{heads}, {n}]"
        )
    return table.to(dtype)


def diagonal_gather(values: torch.Tensor, columns: int) -> torch.Tensor:
    """``M[..., a, c] = values[..., a, c - a + R - 1]``: ``values [..., R or 1, R + C - 1]`` -> ``[..., R, C]``.

    Row a of the result reads ``values`` along a diagonal, so ``M[a, c]`` depends on
    ``c - a`` (and on a when ``values`` has one row per a). Built from pad, reshape and
    slice only: its backward adds each gradient into exactly one place, in a fixed order,
    so gradients do not depend on the thread count (an index or gather backward with
    repeated indices accumulates in a thread-dependent order).
    """
    R = values.shape[-1] - columns + 1
    if R == 1:
        return values
    values = torch.nn.functional.pad(values, (0, 1)).expand(*values.shape[:-2], R, values.shape[-1] + 1)
    # flat index of row a, column k is a (R + C) + k; M[a, c] sits at a (R + C - 1) + c + R - 1
    width = R + columns - 1
    flat = values.reshape(*values.shape[:-2], R * (width + 1))
    return flat[..., R - 1 : R - 1 + R * width].unflatten(-1, (R, width))[..., :columns]


def offset_rows(table: torch.Tensor, first_offset: int, rows: int, columns: int, low: int, high: int) -> torch.Tensor:
    """``M[..., a, c] = table[..., o - low]`` with ``o = first_offset + a - c`` when ``low <= o <= high``, else 0.

    ``table [..., 1 or rows, high - low + 1]`` holds one value per offset ``low..high``
    (shared by all rows, or one row of values per a); the result is ``[..., rows, columns]``.
    Deterministic backward (see ``diagonal_gather``).
    """
    lo, hi = first_offset - (columns - 1), first_offset + rows - 1  # offsets the result reads
    left, right = max(0, low - lo), max(0, hi - high)
    start, stop = max(lo, low) - low, min(hi, high) - low + 1
    if start >= stop:
        return table.new_zeros(*table.shape[:-2], rows, columns)
    ext = torch.nn.functional.pad(table[..., start:stop], (left, right))  # offsets lo..hi
    return diagonal_gather(ext.flip(-1), columns)


def window_position_keys(position_keys: torch.Tensor) -> torch.Tensor:
    """Position keys ``P_0..P_L`` ``[..., L + 1, D]`` laid out for ``add_window_band``:
    ``[..., 2L, D]``, rows ``0..L-2`` zero and row ``L - 1 + e`` = ``P_{L - e}``."""
    L = position_keys.shape[-2] - 1
    zeros = position_keys.new_zeros(*position_keys.shape[:-2], L - 1, position_keys.shape[-1])
    return torch.cat([zeros, position_keys.flip(-2)], dim=-2)


def _add_band(scores: torch.Tensor, band: torch.Tensor) -> torch.Tensor:
    """``add_window_band``'s sum, in place on ``scores`` (autograd differentiates it through the
    strided view when called outside ``_WindowBand``)."""
    L = band.shape[-2]
    window = scores[..., : 2 * L]
    # row a of the view starts L - 1 - a entries into band's row a: a stride of 2L - 1 from
    # entry L - 1 (as_strided without an offset keeps that of the narrowed view)
    start = band.flatten(-2).narrow(-1, L - 1, 1)
    view = start.as_strided(band.shape, (*band.stride()[:-2], 2 * L - 1, 1))
    window.add_(view)
    return scores


def _add_band_gathered(scores: torch.Tensor, band: torch.Tensor) -> torch.Tensor:
    """``_add_band``'s sum read by a gather instead of a strided view over band's rows: entry
    (a, c) is band's column ``c - a + L - 1`` of row a, or 0 where that column is past the row
    (the strided view reads the next row's zero columns there)."""
    L = band.shape[-2]
    rows = torch.arange(L, device=band.device)[:, None]
    columns = torch.arange(2 * L, device=band.device)[None, :] - rows + (L - 1)
    index = columns.clamp_max(2 * L - 1).expand(band.shape)
    scores[..., : 2 * L] += band.gather(-1, index).masked_fill(columns >= 2 * L, 0.0)
    return scores


class _WindowBand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, band: torch.Tensor) -> torch.Tensor:
        _add_band(scores, band)
        ctx.mark_dirty(scores)
        ctx.band_shape = band.shape
        return scores

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        L = ctx.band_shape[-2]
        window = grad[..., : 2 * L]
        row, column = window.stride()[-2:]
        # grad[a, a + e] for e = 0..L: a diagonal band, read with row stride row + column
        diagonal = window.as_strided((*window.shape[:-2], L, L + 1), (*window.stride()[:-2], row + column, column))
        grad_band = grad.new_zeros(ctx.band_shape)
        grad_band[..., L - 1 :] = diagonal
        return grad, grad_band


def add_window_band(scores: torch.Tensor, band: torch.Tensor) -> torch.Tensor:
    """The relative term of a block's window, added in place to the first 2L columns of
    ``scores [..., L, >= 2L]`` (L queries; columns: the previous block, then the own block, so
    query a sits at column L + a): ``scores[..., a, c] += q_a . P_{L + a - c}`` for offsets
    ``0 <= L + a - c <= L``, nothing elsewhere. ``band [..., L, 2L]`` (contiguous, the leading
    shape of ``scores``) is ``q @ window_position_keys(P).T``: row a, column ``L - 1 + e`` holds
    ``q_a . P_{L - e}`` and columns ``0..L-2`` zero. Entry (a, c) reads band's flat index
    ``a (2L - 1) + c + L - 1``: row a's offsets for ``a <= c <= a + L``, its zero columns for
    ``c < a`` and the next row's zero columns for ``c > a + L``, so one strided view adds it
    all without a copy. The backward reads the band's gradient along the diagonals (each entry
    once: deterministic) and forms none for the zero columns (constant keys). Returns ``scores``.
    Under ``torch.export`` the sum is traced as plain ops (an autograd Function that marks its
    input dirty would leave tensors outside the exported graph); under ``torch.compile`` it is
    read by a gather (``_add_band_gathered``): inductor's graphs of the strided view, with or
    without the autograd Function, gave wrong gradients for the queries and position keys
    (``tests/test_compile.py``)."""
    if torch.compiler.is_exporting():
        return _add_band(scores, band)
    if torch.compiler.is_compiling():
        return _add_band_gathered(scores, band)
    return _WindowBand.apply(scores, band)
