"""Gated linear attention (GLA, Yang et al. 2023): a data-dependent decay per key channel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_layer_input, check_positive_int, check_positive_number, check_state_batch, compute_dtype
from ..ops.kernel import linear_attention
from ..state import GatedLinearAttentionState, LinearAttentionState
from ._heads import _NORM_EPS, _HeadsMixer
from ._precision import outside_autocast


class GatedLinearAttention(_HeadsMixer):
    """Gated linear attention, per key/value head h and key channel c:

        q_t, k_t, v_t = W_{q,k,v} x_t                                   (no biases)
        g_t = logsigmoid(W_up W_down x_t + b) / tau                     ([Dk] per head, <= 0)
        S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,   o_t = d^-1/2 S_t^T q_t   (d = head_dim)
        y_t = W_o (RMSNorm(o_t) * swish(W_g x_t))

    ``W_down [gate_rank, d_model]``, ``W_up [Hkv Dk, gate_rank]`` (the paper's low-rank gate,
    rank 16) and the bias ``b`` (``decay_bias``, zeros at init) make the decay
    ``alpha_t = sigmoid(.)^(1/tau)`` of the paper, ``tau = gate_temperature`` (16): large tau
    keeps the decays near 1. ``RMSNorm`` (eps 1e-5) normalises each head's output over its
    ``head_dim`` channels (one gain vector shared by the heads). No positions: the decays
    order the sequence. Computed by ``linear_attention(feature_map="identity", normalize=None, g=g)``
    with per-channel g ``[B, Hkv, T, Dk]``: chunk form over a sequence, recurrent for one token.

    ``forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], GatedLinearAttentionState,
    aux={})``; passing the returned state back continues the sequence.

    Args:
        d_model: the width of the input and output.
        n_heads: query heads.
        head_dim: the width of a head; None: ``d_model // n_heads``.
        n_kv_heads: key/value heads, dividing ``n_heads``: the states, each with its gate;
            None: ``n_heads``.
        gate_rank: the rank of the low-rank gate ``W_up W_down``.
        gate_temperature: tau, dividing the log decays (larger: decays nearer 1).
        chunk_size: the chunk length of the chunk form (per-channel decays take at most 16).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        head_dim: int | None = None,
        n_kv_heads: int | None = None,
        gate_rank: int = 16,
        gate_temperature: float = 16.0,
        chunk_size: int = 64,
    ):
        super().__init__()
        self._build_projections(d_model, n_heads, n_kv_heads, head_dim)
        head_dim, n_kv_heads = self.head_dim, self.n_kv_heads
        check_positive_int("gate_rank", gate_rank)
        self.gate_temperature = check_positive_number("gate_temperature", gate_temperature, finite=True)
        self.chunk_size = chunk_size
        self.decay_down = nn.Linear(d_model, gate_rank, bias=False)
        self.decay_up = nn.Linear(gate_rank, n_kv_heads * head_dim, bias=False)
        self.decay_bias = nn.Parameter(torch.empty(n_kv_heads * head_dim))
        self.reset_parameters()
        self.gate_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.norm = nn.RMSNorm(head_dim, eps=_NORM_EPS)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def reset_parameters(self) -> None:
        """The decay's bias zero (its own parameter; the projections are ``nn.Linear``s)."""
        nn.init.zeros_(self.decay_bias)

    def forward(self, x: torch.Tensor, state: GatedLinearAttentionState | None = None
                ) -> tuple[torch.Tensor, GatedLinearAttentionState, dict]:
        check_layer_input(x, self.d_model)
        if state is not None:
            self._check_state(state, x.shape[0])
        B, T, _ = x.shape
        q, k, v = self._split_heads(*self._project(x))
        dtype = compute_dtype(q.dtype)
        logits = self.decay_up(self.decay_down(x)).to(dtype) + self.decay_bias.to(dtype)
        g = self._heads(F.logsigmoid(logits) / self.gate_temperature, self.n_kv_heads)
        with outside_autocast(x.device.type):  # the op keeps its own float32 precision
            out, attention = linear_attention(
                q, k.to(q.dtype), v.to(q.dtype), feature_map="identity", normalize=None, g=g,
                scale=self.head_dim ** -0.5, chunk_size=self.chunk_size,
                initial_state=state.attention if state is not None else None, output_final_state=True,
                check_inputs=False,  # g is a logsigmoid: <= 0 by construction
            )
        normed = self.norm(out.transpose(1, 2).to(self.norm.weight.dtype)).reshape(B, T, -1)  # the gain's dtype
        return self._gated_output(normed, x), GatedLinearAttentionState(attention=attention, steps=attention.steps), {}

    def _check_state(self, state, batch: int) -> None:
        """A carried state fits this layer: its kind and batch size (``linear_attention``
        checks the sums' features, normalisation and shapes)."""
        if not isinstance(state, GatedLinearAttentionState) or not isinstance(state.attention, LinearAttentionState):
            raise TypeError(f"GatedLinearAttention's state is a GatedLinearAttentionState, got {type(state).__name__}")
        check_state_batch("state", state.attention.kv, batch)
