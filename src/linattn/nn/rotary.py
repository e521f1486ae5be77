"""Rotary position embedding (RoPE, Su et al. 2021) with a position offset for decoding."""

from __future__ import annotations

import torch

from ..ops.common.rotary import rotate, rotation


def apply_rotary(x: torch.Tensor, offset: int = 0, base: float = 10000.0) -> torch.Tensor:
    """Rotate ``x [B, H, T, D]`` (D even) at positions ``offset .. offset + T - 1``.

    Pairs ``(x_{2m}, x_{2m+1})`` at position p turn by the angle ``p * base^(-2m/D)``, so
    ``rot(q, i) . rot(k, j)`` depends on ``i - j`` only. Computed in float32 (float64 for
    float64 input) and returned in x's dtype. The ops' ReRoPE (``rerope=``) uses the same
    rotation (``ops/common/rotary.py``).
    """
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"rotary embedding needs an even head dimension, got {D}")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    positions = torch.arange(offset, offset + x.shape[-2], device=x.device, dtype=dtype)
    return rotate(x.to(dtype), *rotation(positions, D, base, dtype)).to(x.dtype)
