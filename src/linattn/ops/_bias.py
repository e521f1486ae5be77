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
