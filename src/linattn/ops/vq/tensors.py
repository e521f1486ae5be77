"""Small tensor helpers the VQ forms share: dtype casts, stop-gradients at block boundaries,
owned copies for states, and the (batch, kv head) row views of the batched schedules.
"""

from __future__ import annotations

import torch


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, without the cost of a call when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


def detached_if(t: torch.Tensor, cut: bool) -> torch.Tensor:
    """``t`` detached when ``cut`` (a block boundary the gradient must not cross)."""
    return t.detach() if cut else t


def owned(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies for the state: a slice of a long input or padded buffer would keep all of it
    alive (and strided), so the state would not be constant-size in memory."""
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in tensors)


def shared_matrix(t: torch.Tensor) -> torch.Tensor:
    """``t [1, ..., 1, n, D]`` as ``[n, D]`` when it is the same for every head (a matmul
    with a matrix folds the rows into one product), else unchanged."""
    return t.reshape(t.shape[-2:]) if t.shape[:-2].numel() == 1 else t


def per_block(keys: torch.Tensor) -> torch.Tensor:
    """Keys per head ``[Hkv|1, G|1, n, D]`` with a dimension for the blocks of a group; a shared
    matrix ``[n, D]`` as it is."""
    return keys if keys.dim() == 2 else keys.unsqueeze(-3)


def row_views(t: torch.Tensor) -> list[torch.Tensor]:
    """``t [B, Hkv, ...]`` as B * Hkv views ``[1, 1, ...]``, batch-major (one split each way:
    its backward is one concatenation)."""
    return [row for batch in t.split(1, dim=0) for row in batch.split(1, dim=1)]


def from_row_views(rows: list[torch.Tensor], B: int, Hkv: int) -> torch.Tensor:
    """The inverse of ``row_views``: B * Hkv tensors ``[1, 1, ...]`` -> ``[B, Hkv, ...]``."""
    return torch.cat(rows, dim=1).reshape(B, Hkv, *rows[0].shape[2:])


def kv_head(t: torch.Tensor | None, h: int) -> torch.Tensor | None:
    """Kv head h of a per-head tensor ``[Hkv, G|1, ...]`` (4-D); a shared one (a matrix, or
    a first dimension of 1) as it is."""
    return t if t is None or t.dim() == 2 or t.shape[0] == 1 else t.narrow(0, h, 1)
