"""The cache of Transformer-VQ attention: per code, how many positions were quantized to it
and the mean of their values (the compressed past that every later query reads)."""

from __future__ import annotations

import torch


def code_statistics(codes: torch.Tensor, values: torch.Tensor, num_codes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: how many positions use each code and the sum of their values.

    codes ``[B, Hkv, R, L]`` (hard, int64) or assignment weights ``[B, Hkv, R, L, S]``
    (soft) -> counts ``[B, Hkv, R, S]``; values ``[B, Hkv, R, L, E]`` -> sums ``[B, Hkv, R, S, E]``.
    """
    if codes.is_floating_point():
        return codes.sum(-2), codes.transpose(-1, -2) @ values
    counts = values.new_zeros(*codes.shape[:-1], num_codes)
    counts.scatter_add_(-1, codes, torch.ones_like(codes, dtype=values.dtype))
    index = codes.unsqueeze(-1).expand(*codes.shape, values.shape[-1])
    sums = values.new_zeros(*codes.shape[:-1], num_codes, values.shape[-1]).scatter_add(-2, index, values)
    return counts, sums


def add_code_statistics(counts: torch.Tensor, sums: torch.Tensor, codes: torch.Tensor, values: torch.Tensor,
                        detach_counts: bool = False) -> None:
    """``code_statistics`` added in place into ``counts [..., S]`` and ``sums [..., S, E]``
    (e.g. views of a larger buffer): codes ``[..., L]`` (hard) or ``[..., L, S]`` (soft),
    values ``[..., L, E]``. ``detach_counts`` cuts the gradient of soft counts (the sums keep it)."""
    if codes.is_floating_point():
        added = codes.sum(-2)
        counts.add_(added.detach() if detach_counts else added)
        sums.add_(codes.transpose(-1, -2) @ values)
        return
    counts.scatter_add_(-1, codes, torch.ones_like(codes, dtype=counts.dtype))
    sums.scatter_add_(-2, codes.unsqueeze(-1).expand(*codes.shape, values.shape[-1]), values)


def nonzero_counts(counts: torch.Tensor) -> torch.Tensor:
    """``counts`` with zeros raised to the smallest normal number: a divisor (an empty slot's
    sums and weights are zero, so it contributes 0) and a logarithm's argument."""
    return counts.clamp_min(torch.finfo(counts.dtype).tiny)


def mean_values(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean value per code, ``sums / counts`` (0 for unused codes; soft counts may be < 1)."""
    return sums / nonzero_counts(counts).unsqueeze(-1)


def log_counts(counts: torch.Tensor) -> torch.Tensor:
    """``log n_s``, ``-inf`` where ``n_s = 0`` (computed on clamped counts: log(0) is slow)."""
    return nonzero_counts(counts).log().masked_fill(counts == 0, float("-inf"))


def fold_block(counts: torch.Tensor, cache_means: torch.Tensor, codes: torch.Tensor, values: torch.Tensor,
               detach_counts: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache after one block enters it: counts ``[B, Hkv, S]``, means ``[B, Hkv, S, E]``,
    the block's codes ``[B, Hkv, L]`` (or soft ``[B, Hkv, L, S]``) and values ``[B, Hkv, L, E]``:
    ``n'_s = n_s + c_s``, ``m'_s = (n_s m_s + sum_{j: z_j = s} v_j) / n'_s``. ``detach_counts``
    cuts the gradient of soft counts."""
    total, sums = counts.clone(), cache_means * counts.unsqueeze(-1)  # n_s and n_s m_s, then the block added
    add_code_statistics(total, sums, codes, values, detach_counts)
    return total, sums.div_(nonzero_counts(total).unsqueeze(-1))


def entering(codes, values, scope, S):
    """Counts and value sums of blocks entering the cache (``[B, Hkv, R, L(, S)]`` codes), with
    the gradient the scope lets through (values detached unless ``"none"``, soft counts too)."""
    counts, sums = code_statistics(codes, scoped(values, scope), S)
    if codes.is_floating_point() and scope != "none":
        counts = counts.detach()
    return counts, sums


def scoped(values: torch.Tensor, scope: str) -> torch.Tensor:
    """The values a block adds to the cache, detached unless the scope is ``"none"``."""
    return values if scope == "none" else values.detach()
