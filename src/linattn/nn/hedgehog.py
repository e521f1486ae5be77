"""Hedgehog's learned feature map for kernel attention (Zhang et al. 2024; LoLCATs' linearizing map)."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_positive_int, compute_dtype
from ..ops.kernel import FeatureMap

HEDGEHOG = "hedgehog"


class HedgehogFeatureMap(nn.Module):
    """``phi(x) = [softmax(x W_h), softmax(-x W_h)]`` per head h: a learned linear map
    ``W [n_heads, head_dim, head_dim]`` (the identity at first) then a softmax over the features
    of each sign, so ``phi`` is positive, ``2 head_dim`` wide, and ``phi(q).phi(k)`` can learn to
    follow a softmax attention's ``exp(q.k)`` (the spiky, monotone weights of the teacher whose
    attention it is fitted to: "attention transfer").

    ``forward(x [B, n_heads, T, head_dim]) -> [B, n_heads, T, 2 head_dim]``, in x's dtype (the
    softmax in float32, float64 for float64 inputs).

    Args:
        n_heads: the heads, each with its own map ``W_h``.
        head_dim: the width of a head's input (the output is twice as wide).
    """

    def __init__(self, n_heads: int, head_dim: int):
        super().__init__()
        check_positive_int("n_heads", n_heads)
        check_positive_int("head_dim", head_dim)
        self.n_heads, self.head_dim = n_heads, head_dim
        self.weight = nn.Parameter(torch.empty(n_heads, head_dim, head_dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every head's map the identity."""
        self.weight.copy_(torch.eye(self.head_dim, dtype=self.weight.dtype, device=self.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.n_heads or x.shape[3] != self.head_dim:
            raise ValueError(f"x must have shape [batch, {self.n_heads}, length, {self.head_dim}], got {list(x.shape)}")
        wide = compute_dtype(x.dtype)
        z = torch.einsum("bhtd,hdf->bhtf", x.to(wide), self.weight.to(wide))
        return torch.cat([z.softmax(-1), (-z).softmax(-1)], dim=-1).to(x.dtype)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, head_dim={self.head_dim}"


class LearnedFeatures(FeatureMap):
    """The ``FeatureMap`` that ``linear_attention`` is given when a layer computed the features
    itself (a ``HedgehogFeatureMap``): ``phi`` is the identity on them, and states record its
    name (``"hedgehog"``), so a state is continued only by a layer with a learned map."""

    name = HEDGEHOG

    def dim_out(self, d: int) -> int:
        return d

    def __call__(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        return x
