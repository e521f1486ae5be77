"""Gated DeltaNet (Yang et al. 2024): the delta rule with a Mamba-2-style scalar decay per head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_layer_input, check_state_batch, check_state_setting, compute_dtype
from ..ops.delta import delta_rule
from ..state import DeltaRuleState, GatedDeltaNetState
from ._heads import _NORM_EPS, _HeadsMixer
from ._precision import outside_autocast

# Mamba-2's initial decay rates A = exp(A_log) ~ U(1, 16) and step sizes dt in [1e-3, 1e-1]
# (log-uniform, at least 1e-4), per head.
_A_RANGE = (1.0, 16.0)
_DT_RANGE = (1e-3, 1e-1)
_DT_FLOOR = 1e-4


def _inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """``x`` with ``softplus(x) = log(1 + e^x) = y`` (y > 0): ``y + log(1 - e^-y)``."""
    return y + torch.log(-torch.expm1(-y))


class GatedDeltaNet(_HeadsMixer):
    """Gated DeltaNet, per key/value head:

        q_t, k_t, v_t = SiLU(conv(W_{q,k,v} x)_t)      (causal depthwise short convolution)
        beta_t = sigmoid(w_beta . x_t)
        g_t = -exp(A_log) * softplus(w_a . x_t + dt_bias)                 (<= 0)
        S_t = (I - beta_t k^_t k^_t^T) exp(g_t) S_{t-1} + beta_t k^_t v_t^T,  k^ = k / |k|
        o_t = d^-1/2 S_t^T q^_t,   q^ = q / |q|                           (d = head_dim)
        y_t = W_o (RMSNorm(o_t) * swish(W_g x_t))

    The decay is Mamba-2's ``exp(-dt A)`` with ``dt = softplus(w_a . x + dt_bias)`` and
    ``A = exp(A_log)``; ``A_log`` starts at ``log U(1, 16)`` and ``dt_bias`` at the inverse
    softplus of a log-uniform dt in [1e-3, 1e-1] (both per key/value head, never weight decayed:
    they are vectors). ``short_conv=None``: no convolution, ``SiLU(W x)`` alone. ``RMSNorm``
    (eps 1e-5) normalises each head's output over its ``head_dim`` channels (one gain vector
    shared by the heads). Computed by ``delta_rule(feature_map="identity", normalize="l2", g=g)``: the
    chunk (WY) form over a sequence, recurrent for one token. No projection biases.

    ``forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], GatedDeltaNetState,
    aux={})``; passing the returned state back continues the sequence.

    Args:
        d_model: the width of the input and output.
        n_heads: query heads.
        head_dim: the width of a head; None: ``d_model // n_heads``.
        n_kv_heads: key/value heads, dividing ``n_heads``: the memories, each with its beta and
            decay; None: ``n_heads``.
        short_conv: the kernel of the causal depthwise convolution on q, k and v; None: none.
        chunk_size: the chunk length of the chunk form (the gated form takes at most 32).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        head_dim: int | None = None,
        n_kv_heads: int | None = None,
        short_conv: int | None = 4,
        chunk_size: int = 64,
    ):
        super().__init__()
        self._build_projections(d_model, n_heads, n_kv_heads, head_dim)
        head_dim, n_kv_heads = self.head_dim, self.n_kv_heads
        self.chunk_size = chunk_size
        self._build_short_conv(short_conv)
        self.beta_proj = nn.Linear(d_model, n_kv_heads, bias=False)
        self.decay_proj = nn.Linear(d_model, n_kv_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(n_kv_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_kv_heads))
        self.reset_parameters()
        self.gate_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.norm = nn.RMSNorm(head_dim, eps=_NORM_EPS)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The decay's own parameters (the projections are ``nn.Linear``s): ``A_log = log A`` with
        A uniform in ``_A_RANGE``, ``dt_bias`` the inverse softplus of a log-uniform dt."""
        like = dict(dtype=self.A_log.dtype, device=self.A_log.device)
        self.A_log.copy_(torch.empty(self.A_log.shape, **like).uniform_(*_A_RANGE).log())
        low, high = math.log(_DT_RANGE[0]), math.log(_DT_RANGE[1])
        dt = torch.exp(torch.empty(self.dt_bias.shape, **like).uniform_(low, high)).clamp_min(_DT_FLOOR)
        self.dt_bias.copy_(_inverse_softplus(dt))

    def forward(self, x: torch.Tensor, state: GatedDeltaNetState | None = None
                ) -> tuple[torch.Tensor, GatedDeltaNetState, dict]:
        check_layer_input(x, self.d_model)
        if state is not None:
            self._check_state(state, x.shape[0])
        q, k, v = self._project(x)
        conv_cache = None
        if self.conv is not None:
            q, k, v, conv_cache = self._convolve(q, k, v, state.conv if state is not None else None)
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        dtype = compute_dtype(q.dtype)
        beta = torch.sigmoid(self.beta_proj(x)).transpose(1, 2)
        # [B, Hkv, T] made contiguous before the softplus, so that its input and its gradient
        # share one layout (with two, AOTAutograd predicts other strides for softplus_backward
        # than eager gives, and the compiled backward fails)
        logits = self.decay_proj(x).to(dtype).transpose(1, 2).contiguous() + self.dt_bias.to(dtype).unsqueeze(-1)
        g = -torch.exp(self.A_log.to(dtype)).unsqueeze(-1) * F.softplus(logits)
        q, k, v = self._split_heads(q, k.to(q.dtype), v.to(q.dtype))
        with outside_autocast(x.device.type):  # the op keeps its own float32 precision
            out, rule = delta_rule(
                q, k, v, beta.to(q.dtype), feature_map="identity", normalize="l2", g=g, chunk_size=self.chunk_size,
                initial_state=state.rule if state is not None else None, output_final_state=True,
                check_inputs=False,  # beta is a sigmoid, g = -exp * softplus: in range by construction
            )
        normed = self.norm(out.transpose(1, 2).to(self.norm.weight.dtype)).flatten(2)  # the gain's dtype
        state = GatedDeltaNetState(rule=rule, conv=conv_cache, steps=rule.steps, short_conv=self._short_conv)
        return self._gated_output(normed, x), state, {}

    def _check_state(self, state, batch: int) -> None:
        """A carried state fits this layer: its kind, the short convolution it was made with,
        its batch size (``delta_rule`` checks the rule's feature map, normalisation and shapes)."""
        if not isinstance(state, GatedDeltaNetState) or not isinstance(state.rule, DeltaRuleState):
            raise TypeError(f"GatedDeltaNet's state is a GatedDeltaNetState, got {type(state).__name__}")
        check_state_setting("state", "short_conv", state.short_conv, self._short_conv)
        check_state_batch("state", state.rule.memory, batch)
        check_state_batch("state", state.conv, batch)
