"""Multi-scale retention (RetNet, Sun et al. 2023): kernel attention with a fixed decay per head."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_layer_input, check_state_batch, check_state_setting, compute_dtype
from ..ops.kernel import linear_attention
from ..state import LinearAttentionState, RetentionState
from ._heads import _HeadsMixer
from .rotary import apply_rotary
from ._precision import outside_autocast


def retention_log_decays(n_heads: int, *, device: torch.device | str | None = None,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``log(gamma_h)`` ``[n_heads]`` with ``gamma_h = 1 - 2^(-5 - h)``, h = 0 .. n_heads - 1
    (RetNet's multi-scale decays, paper section 2.2: ``gamma = 1 - 2^(-5 - arange(0, h))``)."""
    exponents = -5.0 - torch.arange(n_heads, device=device, dtype=dtype)
    return torch.log1p(-torch.exp2(exponents))


class MultiScaleRetention(_HeadsMixer):
    """RetNet's multi-scale retention:

        q_t = rot(W_q x_t, t),  k_t = rot(W_k x_t, t),  v_t = W_v x_t     (per head, no biases)
        S_t = gamma_h S_{t-1} + k_t v_t^T,   o_t = d^-1/2 S_t^T q_t      (d = head_dim)
        y_t = W_o (GroupNorm_h(o_t) * swish(W_g x_t))

    with the fixed decays ``gamma_h = 1 - 2^(-5 - h)`` (``retention_log_decays``), one per
    key/value head h (the state's heads; under GQA the query heads of a group share it), and
    ``GroupNorm_h`` a normalisation of each head's output over its ``head_dim`` channels
    (``nn.GroupNorm`` with n_heads groups, per-channel gain and bias). Computed by
    ``linear_attention(feature_map="identity", normalize=None, g=log(gamma))``: chunk form over
    a sequence, recurrent for one token.

    Positions: rotary (``nn/rotary.py``, ``rotary_base``). RetNet's own relative position is
    ``Theta_n = e^{i n theta}`` on q and k with the decay in ``gamma^(n-m)`` (its xPos variant
    without xPos's scaling, which the decay replaces): that is a rotary rotation, so the layer
    computes the paper's ``(Q K^T * D) V``, not an approximation. The paper's further score
    normalisations (dividing ``D`` and the scores by their row sums) change a head's output at
    a position by one factor, which the group norm removes; they are left out.

    ``forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], RetentionState, aux={})``;
    passing the returned state back continues the sequence (token-by-token decoding equals
    the full pass).

    Args:
        d_model: the width of the input and output.
        n_heads: query heads.
        head_dim: the width of a head; None: ``d_model // n_heads``.
        n_kv_heads: key/value heads, dividing ``n_heads``, each with its decay ``gamma_h``;
            None: ``n_heads``.
        rotary_base: the base of the rotary frequencies.
        chunk_size: the chunk length of the chunk form.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        head_dim: int | None = None,
        n_kv_heads: int | None = None,
        rotary_base: float = 10000.0,
        chunk_size: int = 64,
    ):
        super().__init__()
        self._build_projections(d_model, n_heads, n_kv_heads, head_dim)
        head_dim, n_kv_heads = self.head_dim, self.n_kv_heads
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be even and >= 2 (rotary positions), got {head_dim} "
                             f"(d_model={d_model}, n_heads={n_heads})")
        self.rotary_base, self.chunk_size = float(rotary_base), chunk_size
        self.gate_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.group_norm = nn.GroupNorm(n_heads, n_heads * head_dim)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor, state: RetentionState | None = None
                ) -> tuple[torch.Tensor, RetentionState, dict]:
        check_layer_input(x, self.d_model)
        if state is not None:
            self._check_state(state, x.shape[0])
        B, T, _ = x.shape
        q, k, v = self._split_heads(*self._project(x))
        past = 0 if state is None else state.steps
        q, k = apply_rotary(q, past, self.rotary_base), apply_rotary(k, past, self.rotary_base)
        with outside_autocast(x.device.type):  # the op keeps its own float32 precision
            log_decays = retention_log_decays(self.n_kv_heads, device=x.device, dtype=compute_dtype(q.dtype))
            out, attention = linear_attention(
                q, k.to(q.dtype), v.to(q.dtype),
                feature_map="identity", normalize=None, g=log_decays.view(1, -1, 1).expand(B, -1, T),
                scale=self.head_dim ** -0.5, chunk_size=self.chunk_size,
                initial_state=state.attention if state is not None else None, output_final_state=True,
                check_inputs=False,  # g is log(gamma) < 0 by construction
            )
        normed = self.group_norm(out.transpose(1, 2).reshape(B * T, -1)).view(B, T, -1)
        state = RetentionState(attention=attention, steps=attention.steps, rotary_base=self.rotary_base)
        return self._gated_output(normed, x), state, {}

    def _check_state(self, state, batch: int) -> None:
        """A carried state fits this layer: its kind, its rotary base, its batch size
        (``linear_attention`` checks the sums' features, normalisation and shapes)."""
        if not isinstance(state, RetentionState) or not isinstance(state.attention, LinearAttentionState):
            raise TypeError(f"MultiScaleRetention's state is a RetentionState, got {type(state).__name__}")
        check_state_setting("state", "rotary_base", state.rotary_base, self.rotary_base)
        check_state_batch("state", state.attention.kv, batch)
