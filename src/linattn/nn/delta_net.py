"""DeltaNet: a multi-head attention layer whose memory is written with the delta rule."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_head_layout, check_layer_input, check_state_batch, check_state_setting
from ..ops.delta import delta_rule
from ..ops.feature_maps import FeatureMap, get_feature_map
from ..state import DeltaNetState
from .short_conv import ShortConvolution


class DeltaNet(nn.Module):
    """``y = W_o delta_rule(q, k, v, beta)`` with ``q, k, v = W_{q,k,v} x`` (optionally through
    a causal depthwise short convolution + SiLU) and ``beta = sigmoid(W_beta x)`` per
    key/value head (``beta = 1`` with ``use_beta=False``). No projection biases.

    ``forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], DeltaNetState, aux={})``;
    passing the returned state back continues the sequence (token-by-token decoding
    equals the full pass).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        head_dim: int | None = None,
        n_kv_heads: int | None = None,
        feature_map: str | FeatureMap = "identity",
        normalize: str | None = "l2",
        use_beta: bool = True,
        short_conv: int | None = None,
        chunk_size: int = 64,
    ):
        super().__init__()
        n_kv_heads, head_dim = check_head_layout(d_model, n_heads, n_kv_heads, head_dim)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.feature_map = get_feature_map(feature_map)
        self.normalize, self.use_beta, self.chunk_size = normalize, use_beta, chunk_size
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.beta_proj = nn.Linear(d_model, n_kv_heads, bias=False) if use_beta else None
        self.conv = None
        if short_conv is not None:
            self.conv = ShortConvolution((n_heads + 2 * n_kv_heads) * head_dim, kernel_size=short_conv)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor, state: DeltaNetState | None = None) -> tuple[torch.Tensor, DeltaNetState, dict]:
        check_layer_input(x, self.d_model)
        if state is not None:
            self._check_state(state, x.shape[0])
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        conv_cache = None
        if self.conv is not None:
            mixed, conv_cache = self.conv(torch.cat([q, k, v], dim=-1), state.conv if state is not None else None)
            q, k, v = mixed.split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)
        if self.beta_proj is not None:
            beta = torch.sigmoid(self.beta_proj(x)).transpose(1, 2)
        else:
            beta = x.new_ones(B, self.n_kv_heads, T)
        heads = lambda t, n: t.reshape(B, T, n, self.head_dim).transpose(1, 2)  # noqa: E731
        with torch.autocast(x.device.type, enabled=False):  # the op keeps its own float32 precision
            out, rule_state = delta_rule(
                heads(q, self.n_heads),
                heads(k.to(q.dtype), self.n_kv_heads),
                heads(v.to(q.dtype), self.n_kv_heads),
                beta.to(q.dtype),
                feature_map=self.feature_map,
                normalize=self.normalize,
                chunk_size=self.chunk_size,
                initial_state=state.rule if state is not None else None,
                output_final_state=True,
                check_inputs=False,  # beta is a sigmoid (or ones): in [0, 1] without reading it
            )
        y = self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        return y, DeltaNetState(rule=rule_state, conv=conv_cache, steps=rule_state.steps,
                                short_conv=self._short_conv), {}

    @property
    def _short_conv(self) -> int:
        """The kernel size of the short convolution, 0 without one (as ``DeltaNetState`` records it)."""
        return 0 if self.conv is None else self.conv.kernel_size

    def _check_state(self, state, batch: int) -> None:
        """A carried state fits this layer: its kind, the short convolution it was made with,
        its batch size (``delta_rule`` checks the rule's feature map, normalisation and shapes)."""
        if not isinstance(state, DeltaNetState):
            raise TypeError(f"DeltaNet's state is a DeltaNetState, got {type(state).__name__}")
        check_state_setting("state", "short_conv", state.short_conv, self._short_conv)
        check_state_batch("state", getattr(state.rule, "memory", None), batch)
        check_state_batch("state", state.conv, batch)
