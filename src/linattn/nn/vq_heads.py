"""Multi-head attention over vector-quantized keys: Transformer-VQ on a transformer's heads."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_bool, check_choice, check_head_layout, check_layer_input, check_state_batch
from ..ops.vq import GRAD_SCOPES, check_vq_rerope, check_vq_state, vq_attention
from ..state import VQAttentionState
from ._heads import add_attention_projections, attention_heads
from .quantizer import VectorQuantizer
from ._precision import outside_autocast

VQ_POSITIONS = ("rerope", "bias")


class MultiHeadVQAttention(nn.Module):
    """``y = W_o vq_attention(W_q x, VQ(W_k x), W_v x)``: the q/k/v/o projections of multi-head
    attention (``Attention``'s, with its names, head layout and optional biases), the keys of each
    key/value head quantized to that head's codebook (a ``VectorQuantizer`` ``[n_kv_heads, S,
    head_dim]``, learned by EMA), and Transformer-VQ's linear-time attention over them
    (``vq_attention``, blocks of ``block_size``, scale ``head_dim^-1/2``).

    This is the layer the efficient-attention survey's recipe turns a pretrained transformer
    into: keep the projections, quantize the keys with codebooks fitted by k-means on the
    keys the model computes, fine-tune. Positions (``positions``):

    - ``"rerope"``: ReRoPE with window ``rerope`` (default ``block_size``, at most it) and
      ``rotary_base``: query i scores key j at the rotary position ``min(i - j, w)``. The keys are
      quantized unrotated (the op rotates), so a code stands for keys wherever they sit, and every
      cached key is scored at distance w. The survey's proposal for a RoPE model: no bias needed.
    - ``"bias"``: Transformer-VQ's windowed relative bias instead, a learned ``b_{h, i-j}`` per query
      head for ``0 <= i - j <= block_size`` (``relative_bias [n_heads, block_size + 1]``, zeros at
      first), no rotary positions.

    ``forward(x [B, T, d_model], state=None) -> (y, VQAttentionState, aux)``; ``aux`` holds the
    quantizer's ``commit_loss`` (weighted) and ``codes [B, n_kv_heads, T]``, as a GAU's does (the
    trainer's codebook update reaches the quantizer through ``LM.quantizers``). The state has a size
    independent of the sequence length; passing it back continues the sequence.

    Args:
        d_model: the width of the input and output.
        n_heads: query heads.
        n_kv_heads: key/value heads, dividing ``n_heads``, one codebook each; None: ``n_heads``.
        head_dim: the width of a head; None: ``d_model // n_heads``.
        codebook_size: S, the codes per codebook.
        block_size: L, the block length of ``vq_attention``.
        positions: ``"rerope"`` or ``"bias"`` (above).
        rerope: ReRoPE's window w (``positions="rerope"``), at most ``block_size``; None: ``block_size``.
        rotary_base: the base of the rotary frequencies of ReRoPE.
        qkv_bias: biases on the q, k and v projections.
        out_bias: a bias on the output projection.
        ema_decay: the decay of the codebooks' EMA update.
        commitment_weight: the weight of the commitment loss in ``aux["commit_loss"]``.
        kmeans_init: set the codebooks by k-means on the first training batch's keys.
        dead_code_threshold: codes whose EMA count falls below this restart on recent keys (0: never).
        grad_scope: ``vq_attention``'s gradient scope (``"cache"``, ``"state"`` or ``"none"``).
        commitment_reduction: how the quantizer reduces the commitment loss (``VectorQuantizer``).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        codebook_size: int = 512,
        block_size: int = 128,
        positions: str = "rerope",
        rerope: int | None = None,
        rotary_base: float = 10000.0,
        qkv_bias: bool = False,
        out_bias: bool = False,
        ema_decay: float = 0.99,
        commitment_weight: float = 1e-4,
        kmeans_init: bool = False,
        dead_code_threshold: float = 0.0,
        grad_scope: str = "cache",
        commitment_reduction: str = "mean",
    ):
        super().__init__()
        n_kv_heads, head_dim = check_head_layout(d_model, n_heads, n_kv_heads, head_dim)
        check_choice("positions", positions, VQ_POSITIONS)
        check_choice("grad_scope", grad_scope, GRAD_SCOPES)
        check_bool("qkv_bias", qkv_bias)
        check_bool("out_bias", out_bias)
        if positions == "bias" and rerope is not None:
            raise ValueError(f"rerope={rerope} is the window of positions='rerope'; positions='bias' has no rotary "
                             "positions (leave rerope None)")
        window = (block_size if rerope is None else rerope) if positions == "rerope" else None
        self.rerope = check_vq_rerope(window, rotary_base, head_dim, block_size, True)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.block_size, self.positions, self.grad_scope = block_size, positions, grad_scope
        self.rotary_base = float(rotary_base)
        add_attention_projections(self, d_model, n_heads, n_kv_heads, head_dim, qkv_bias=qkv_bias, out_bias=out_bias)
        self.relative_bias = nn.Parameter(torch.empty(n_heads, block_size + 1)) if positions == "bias" else None
        self.reset_parameters()
        self.quantizer = VectorQuantizer(
            n_kv_heads, head_dim, codebook_size, ema_decay=ema_decay, commitment_weight=commitment_weight,
            kmeans_init=kmeans_init, dead_code_threshold=dead_code_threshold, commitment_reduction=commitment_reduction,
        )
        self.codebook_size = codebook_size

    def reset_parameters(self) -> None:
        """The windowed bias (``positions="bias"``) zero; the projections and the quantizer reset their own."""
        if self.relative_bias is not None:
            nn.init.zeros_(self.relative_bias)

    def forward(self, x: torch.Tensor, state: VQAttentionState | None = None
                ) -> tuple[torch.Tensor, VQAttentionState, dict]:
        check_layer_input(x, self.d_model)
        if state is not None:
            self._check_state(state, x)
        B, T, _ = x.shape
        q, k, v = attention_heads(self, x)
        # the op keeps its own precision (float32 sums and softmax); under autocast it runs on q's dtype
        with outside_autocast(x.device.type):
            k_hat, codes, commit = self.quantizer(k)
            dtype = q.dtype
            bias = None if self.relative_bias is None else self.relative_bias.to(dtype)
            out, state = vq_attention(
                q, k_hat.to(dtype), v.to(dtype), codes, self.quantizer.codebook.to(dtype),
                block_size=self.block_size, bias=bias, grad_scope=self.grad_scope, initial_state=state,
                output_final_state=True, rerope=self.rerope, rotary_base=self.rotary_base,
                check_inputs=False,  # the keys are the quantizer's codes, by construction
            )
        y = self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        return y, state, {"commit_loss": commit, "codes": codes}

    def _check_state(self, state: object, x: torch.Tensor) -> None:
        """A carried state continues this layer for the rows of ``x``: its kind, the block and
        codebook sizes it was made with, its batch and its shapes (no tensor is read)."""
        if not isinstance(state, VQAttentionState):
            raise TypeError(f"MultiHeadVQAttention's state is a VQAttentionState, got {type(state).__name__}")
        check_state_batch("state", state.cache_counts, x.shape[0])
        check_vq_state(state, x.shape[0], self.n_kv_heads, self.head_dim, self.head_dim, self.block_size,
                       self.codebook_size, x, soft=False)

    def extra_repr(self) -> str:
        where = f"rerope={self.rerope}" if self.positions == "rerope" else "windowed bias"
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, block_size={self.block_size}, {where}")
