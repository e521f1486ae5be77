"""DeltaNet: a multi-head attention layer whose memory is written with the delta rule."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_layer_input, check_state_batch, check_state_setting
from ..ops.delta import delta_rule
from ..ops.kernel import FeatureMap, get_feature_map
from ..state import DeltaNetState
from ._heads import _HeadsMixer
from ._precision import outside_autocast


class DeltaNet(_HeadsMixer):
    """``y = W_o delta_rule(q, k, v, beta)`` with ``q, k, v = W_{q,k,v} x`` (optionally through
    a causal depthwise short convolution + SiLU) and ``beta = sigmoid(W_beta x)`` per
    key/value head (``beta = 1`` with ``use_beta=False``). No projection biases.

    ``forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], DeltaNetState, aux={})``;
    passing the returned state back continues the sequence (token-by-token decoding
    equals the full pass).

    Args:
        d_model: the width of the input and output.
        n_heads: query heads.
        head_dim: the width of a head; None: ``d_model // n_heads``.
        n_kv_heads: key/value heads, dividing ``n_heads``: the memories, and the beta of each;
            None: ``n_heads``.
        feature_map: applied to q and k before ``normalize`` (a name or a ``FeatureMap``).
        normalize: ``"l2"``, ``"sum"`` or None, as in ``delta_rule``.
        use_beta: learn the write strength ``beta``; False: ``beta = 1``.
        short_conv: the kernel of the causal depthwise convolution on q, k and v (its last
            inputs are part of the state); None: none.
        chunk_size: the chunk length of ``delta_rule``'s chunk form.
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
        self._build_projections(d_model, n_heads, n_kv_heads, head_dim)
        head_dim, n_kv_heads = self.head_dim, self.n_kv_heads
        self.feature_map = get_feature_map(feature_map)
        self.normalize, self.use_beta, self.chunk_size = normalize, use_beta, chunk_size
        self.beta_proj = nn.Linear(d_model, n_kv_heads, bias=False) if use_beta else None
        self._build_short_conv(short_conv)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor, state: DeltaNetState | None = None) -> tuple[torch.Tensor, DeltaNetState, dict]:
        check_layer_input(x, self.d_model)
        if state is not None:
            self._check_state(state, x.shape[0])
        B, T, _ = x.shape
        q, k, v = self._project(x)
        conv_cache = None
        if self.conv is not None:
            q, k, v, conv_cache = self._convolve(q, k, v, state.conv if state is not None else None)
        if self.beta_proj is not None:
            beta = torch.sigmoid(self.beta_proj(x)).transpose(1, 2)
        else:
            beta = x.new_ones(B, self.n_kv_heads, T)
        q, k, v = self._split_heads(q, k.to(q.dtype), v.to(q.dtype))
        with outside_autocast(x.device.type):  # the op keeps its own float32 precision
            out, rule_state = delta_rule(
                q, k, v, beta.to(q.dtype),
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

    def _check_state(self, state, batch: int) -> None:
        """A carried state fits this layer: its kind, the short convolution it was made with,
        its batch size (``delta_rule`` checks the rule's feature map, normalisation and shapes)."""
        if not isinstance(state, DeltaNetState):
            raise TypeError(f"DeltaNet's state is a DeltaNetState, got {type(state).__name__}")
        check_state_setting("state", "short_conv", state.short_conv, self._short_conv)
        check_state_batch("state", getattr(state.rule, "memory", None), batch)
        check_state_batch("state", state.conv, batch)
