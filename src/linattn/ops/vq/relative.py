"""The relative-position terms of Transformer-VQ's window: a bias ``b_{i-j}`` and position
keys ``P_{i-j}`` for offsets ``0 <= i - j <= L`` (zero beyond), validated and laid out per
(kv head, query group), and their values per query row and offset.
"""

from __future__ import annotations

import torch

from ..._checks import check_same_dtype_device, check_tensor
from ..common.bias import offset_rows, relative_bias_table
from .tensors import as_dtype


def window_bias(bias, heads: int, kv_heads: int, block_size: int, device, dtype) -> torch.Tensor | None:
    """The bias for offsets 0..L as ``[1 or Hkv, 1 or G, L + 1]`` (grouped head layout)."""
    if bias is None:
        return None
    L = block_size
    if callable(bias) and not isinstance(bias, torch.Tensor):
        table = relative_bias_table(bias, torch.arange(L + 1, device=device), heads, dtype)
    else:
        table = check_tensor("bias", bias)
        if table.dim() == 1:
            table = table.unsqueeze(0)
        if table.dim() != 2 or table.shape[-1] != L + 1 or table.shape[0] not in (1, heads):
            raise ValueError(
                f"bias has shape {list(bias.shape)}, expected [{L + 1}] or [{heads}, {L + 1}] "
                f"(one value per offset 0..block_size)"
            )
        if table.device != device:
            raise ValueError(f"bias is on {table.device} but q is on {device}")
        table = as_dtype(table, dtype)
    if table.shape[0] == heads:
        return table.reshape(kv_heads, heads // kv_heads, L + 1)
    return table.reshape(1, 1, L + 1)


def offset_bias(table: torch.Tensor, first_offset: int, rows: int, columns: int, L: int) -> torch.Tensor:
    """``b[i - j]`` with ``i - j = first_offset + a - c`` for row a and column c, zero outside
    ``0 <= i - j <= L``: table ``[h, g, L + 1]`` -> ``[h, g, rows, columns]``."""
    return offset_rows(table.unsqueeze(-2), first_offset, rows, columns, 0, L)


def checked_position_keys(position_keys, heads: int, kv_heads: int, block_size: int, key_dim: int, like):
    """Validate ``position_keys`` ``[L + 1, Dk]`` or ``[H, L + 1, Dk]``; return ``[1|Hkv, 1|G, L + 1, Dk]``."""
    if position_keys is None:
        return None
    P = check_tensor("position_keys", position_keys)
    check_same_dtype_device(q=like, position_keys=P)
    n = block_size + 1
    if P.dim() == 2:
        P = P.unsqueeze(0)
    if P.dim() != 3 or P.shape[0] not in (1, heads) or P.shape[1:] != (n, key_dim):
        raise ValueError(
            f"position_keys has shape {list(position_keys.shape)}, expected [{n}, {key_dim}] "
            f"or [{heads}, {n}, {key_dim}]"
        )
    if P.shape[0] == heads:
        return P.reshape(kv_heads, heads // kv_heads, n, key_dim)
    return P.reshape(1, 1, n, key_dim)


def relative_inputs(bias, position_keys, heads: int, kv_heads: int, L: int, key_dim: int, q: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(window_bias, checked_position_keys)`` of a call, both in ``dtype`` (None where not given)."""
    table = window_bias(bias, heads, kv_heads, L, q.device, dtype)
    positions_k = checked_position_keys(position_keys, heads, kv_heads, L, key_dim, q)
    return table, (as_dtype(positions_k, dtype) if positions_k is not None else None)


def position_scores(q, position_keys, first_offset: int, columns: int, L: int):
    """``q_i . P_{i-j}`` for ``0 <= i - j <= L``, else 0, with ``i - j = first_offset + a - c``:
    q ``[..., r, D]`` -> ``[..., r, columns]``."""
    per_offset = q @ position_keys.transpose(-1, -2)  # [..., r, L + 1]
    return offset_rows(per_offset, first_offset, q.shape[-2], columns, 0, L)


def relative_terms(q, table, positions_k) -> torch.Tensor | None:
    """Per query row and offset ``delta = 0..L``: ``b_delta + q.P_delta`` ``[B|1, Hkv|1, G|1, T|1, L + 1]``."""
    relative = None
    if positions_k is not None:
        relative = q @ positions_k.unsqueeze(0).transpose(-1, -2)
    if table is not None:
        relative = table.unsqueeze(-2) if relative is None else relative + table.unsqueeze(-2)
    return relative


def reversed_terms(relative: torch.Tensor | None) -> torch.Tensor | None:
    return None if relative is None else relative.flip(-1)
