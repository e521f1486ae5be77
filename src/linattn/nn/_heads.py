"""What the multi-head mixers built on q/k/v projections share (DeltaNet, retention, GLA,
Gated DeltaNet): the projections and their split into heads, the optional short convolution
over q/k/v, and the gated output ``W_o (norm(o) * swish(W_g x))``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_head_layout
from .short_conv import ShortConvolution

def add_attention_projections(module: nn.Module, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
                              qkv_bias: bool, out_bias: bool) -> None:
    """Multi-head attention's maps on ``module``: ``q_proj`` (``n_heads`` heads), ``k_proj`` and
    ``v_proj`` (``n_kv_heads``), ``o_proj`` back to ``d_model``; biases (zeros at first) on q, k and
    v with ``qkv_bias`` and on the output with ``out_bias`` (the names and layout of a Hugging Face
    Llama, Mistral or Qwen2 attention, so their checkpoints load as they are)."""
    module.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
    module.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
    module.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
    module.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=out_bias)
    for projection in (module.q_proj, module.k_proj, module.v_proj, module.o_proj):
        if projection.bias is not None:
            nn.init.zeros_(projection.bias)


def attention_heads(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [B, n_heads, T, head_dim]``, ``k, v [B, n_kv_heads, T, head_dim]`` of ``x [B, T, d_model]``
    through the maps of ``add_attention_projections``."""
    B, T, _ = x.shape
    q = module.q_proj(x).view(B, T, module.n_heads, module.head_dim).transpose(1, 2)
    k = module.k_proj(x).view(B, T, module.n_kv_heads, module.head_dim).transpose(1, 2)
    v = module.v_proj(x).view(B, T, module.n_kv_heads, module.head_dim).transpose(1, 2)
    return q, k, v


# The per-head output norm's eps, one value in every dtype (nn.RMSNorm's default, the dtype's
# machine epsilon, would make float32 and float64 models differ on small head outputs).
_NORM_EPS = 1e-5


class _HeadsMixer(nn.Module):
    """Base of the mixers whose queries, keys and values are ``W_{q,k,v} x`` (no biases), with
    ``n_heads`` query heads and ``n_kv_heads`` key/value heads of ``head_dim`` channels.

    ``_build_projections`` checks the head layout and makes ``q_proj``, ``k_proj``, ``v_proj``
    (in that order, so a seed gives every subclass the same initial projections);
    ``_build_short_conv`` makes ``conv`` (a ``ShortConvolution`` over the concatenated q/k/v, or
    None); ``_project`` returns ``q [B, T, H D]``, ``k, v [B, T, Hkv D]``, ``_split_heads``
    turns them into ``[B, n, T, D]``.
    """

    def _build_projections(self, d_model: int, n_heads: int, n_kv_heads: int | None, head_dim: int | None) -> None:
        n_kv_heads, head_dim = check_head_layout(d_model, n_heads, n_kv_heads, head_dim)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)

    def _build_short_conv(self, kernel_size: int | None) -> None:
        self.conv = None
        if kernel_size is not None:
            channels = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
            self.conv = ShortConvolution(channels, kernel_size=kernel_size)

    @property
    def _short_conv(self) -> int:
        """The kernel size of the short convolution, 0 without one (as the layer's state records it)."""
        conv = getattr(self, "conv", None)
        return 0 if conv is None else conv.kernel_size

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _convolve(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``SiLU(conv([q, k, v]))`` split back into q, k, v, and the convolution's new cache."""
        mixed, cache = self.conv(torch.cat([q, k, v], dim=-1), cache)
        q, k, v = mixed.split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)
        return q, k, v, cache

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """``[B, T, n D] -> [B, n, T, D]``."""
        B, T, _ = t.shape
        return t.reshape(B, T, n, self.head_dim).transpose(1, 2)

    def _split_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]`` from the projections' ``[B, T, n D]``."""
        return self._heads(q, self.n_heads), self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)

    def _gated_output(self, normed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``W_o (normed * swish(W_g x))`` with ``normed [B, T, H D]`` (the normalised heads)."""
        return self.o_proj(normed * F.silu(self.gate_proj(x)))
