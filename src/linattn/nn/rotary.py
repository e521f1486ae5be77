"""Rotary position embedding (RoPE, Su et al. 2021) with a position offset for decoding."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, offset: int = 0, base: float = 10000.0) -> torch.Tensor:
    """Rotate ``x [B, H, T, D]`` (D even) at positions ``offset .. offset + T - 1``.

    Pairs ``(x_{2m}, x_{2m+1})`` at position p turn by the angle ``p * base^(-2m/D)``, so
    ``rot(q, i) . rot(k, j)`` depends on ``i - j`` only. Computed in float32 (float64 for
    float64 input) and returned in x's dtype.
    """
    return apply_rotary_at(x, torch.arange(offset, offset + x.shape[-2], device=x.device), base)


def apply_rotary_at(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """``apply_rotary`` with the position of each of the ``T`` rows of ``x [..., T, D]`` given
    by ``positions [T]`` (integers): the rows of a serving engine's flat batch belong to
    several sequences, each at its own position."""
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"rotary embedding needs an even head dimension, got {D}")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    inverse_freq = base ** (-torch.arange(0, D, 2, device=x.device, dtype=dtype) / D)
    angles = positions.to(dtype)[:, None] * inverse_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos(), angles.sin()
    pairs = x.to(dtype).unflatten(-1, (D // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)
