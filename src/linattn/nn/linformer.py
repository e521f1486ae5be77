"""Linformer self-attention layer (non-causal, fixed maximum length)."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_layer_input
from ..ops.sparse import linformer_attention


class LinformerAttention(nn.Module):
    """``y = W_o linformer(W_q x, W_k x, W_v x; E, F)`` with learned length projections
    ``E, F [k, max_len]`` shared by all heads (the paper's head-wise sharing).

    ``forward(x [B, T, d_model], state=None)`` with ``T <= max_len`` -> ``(y [B, T, d_model], None, {})``
    (the common layer interface; there is no state to carry). Non-causal: for encoders only.

    Args:
        d_model: the width of the input and output.
        n_heads: heads (``d_model // n_heads`` wide).
        max_len: the longest sequence: the number of columns of E and F.
        k: the projected length: the rows of E and F.
    """

    def __init__(self, d_model: int, n_heads: int, max_len: int, k: int = 256):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
        self.d_model, self.n_heads, self.max_len, self.k = d_model, n_heads, max_len, k
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.E = nn.Parameter(torch.randn(k, max_len) / k**0.5)
        self.F = nn.Parameter(torch.randn(k, max_len) / k**0.5)

    def forward(self, x: torch.Tensor, state: None = None) -> tuple[torch.Tensor, None, dict]:
        check_layer_input(x, self.d_model)
        if state is not None:
            raise ValueError("LinformerAttention is non-causal and carries no state; state must be None")
        B, T, _ = x.shape
        heads = lambda t: t.reshape(B, T, self.n_heads, -1).transpose(1, 2)  # noqa: E731
        out = linformer_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), self.E.to(x.dtype), self.F.to(x.dtype)
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.d_model)), None, {}
