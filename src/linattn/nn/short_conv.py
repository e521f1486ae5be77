"""Depthwise causal short convolution with a decode cache (as used before DeltaNet's q/k/v)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_batch, check_state_batch


class ShortConvolution(nn.Module):
    """``y_t = SiLU(b + sum_{i<K} w_i * x_{t-K+1+i})`` per channel (depthwise), causal.

    ``forward(x [B, T, C], cache [B, C, K-1] | None) -> (y [B, T, C], cache [B, C, K-1])``:
    the cache holds the last ``K - 1`` inputs, so feeding a sequence in pieces (or one token
    at a time) equals one call. A missing cache means zeros before the first position.

    Args:
        channels: C, each convolved with its own kernel.
        kernel_size: K, the positions each output reads (the last K - 1 are the cache).
    """

    def __init__(self, channels: int, kernel_size: int = 4):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.channels, self.kernel_size = channels, kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weights and biases uniform in ``[-1/sqrt(K), 1/sqrt(K)]`` (a depthwise ``nn.Conv1d``'s bound)."""
        bound = 1.0 / math.sqrt(self.kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() != 3 or x.shape[-1] != self.channels:
            raise ValueError(f"x must have shape [batch, length, {self.channels}], got {list(x.shape)}")
        check_batch("x", x)
        B, T, C = x.shape
        history = self.kernel_size - 1
        if cache is None:
            cache = x.new_zeros(B, C, history)
        else:
            check_state_batch("cache", cache, B)
        if tuple(cache.shape) != (B, C, history):
            raise ValueError(f"conv cache has shape {list(cache.shape)}, expected [{B}, {C}, {history}]")
        full = torch.cat([cache.to(x.dtype), x.transpose(1, 2)], dim=-1)
        y = F.conv1d(full, self.weight.to(x.dtype), self.bias.to(x.dtype), groups=C)
        return F.silu(y).transpose(1, 2), full[..., full.shape[-1] - history :]
