"""Multi-head attention layer over a choice of mechanisms (exact, kernel, sliding window)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .._checks import (check_bool, check_choice, check_head_layout, check_layer_input, check_rerope,
                       check_state_batch,
                       check_state_tensor)
from ..ops.kernel import FeatureMap, get_feature_map, linear_attention
from ..ops.softmax import entropy_scale, kv_cache, softmax_attention
from ..ops.sparse import local_attention
from ..state import KVCacheState, LinearAttentionState
from ._heads import add_attention_projections, attention_heads
from .hedgehog import HEDGEHOG, HedgehogFeatureMap, LearnedFeatures
from .rotary import apply_rotary, check_rotary_scaling
from ._precision import outside_autocast

_MECHANISMS = ("softmax", "linear", "local")
ATTENTION_SCALES = ("default", "entropy")


class Attention(nn.Module):
    """Causal multi-head attention ``y = W_o attention(W_q x, W_k x, W_v x)`` (no biases unless
    ``qkv_bias``: ``W_q x + b_q`` and likewise for k and v, as Qwen2 has; ``out_bias``: ``W_o o + b_o``).

    ``mechanism``:

    - ``"softmax"``: exact attention (torch SDPA); decode state is a growing ``KVCacheState``
      (preallocated without gradients, ``ops/softmax/kv_cache.py``).
    - ``"linear"``: kernel attention ``linear_attention`` with ``feature_map`` (e.g. ``"elu"``,
      ``"dpfp:2"``, ``"favor:128"``), chunk form; constant-size ``LinearAttentionState``.
      ``feature_map="hedgehog"``: Hedgehog's learned map (``nn/hedgehog.py``), one per query
      head (``query_map``) and per key/value head (``key_map``), identity weights at first.
    - ``"local"``: sliding-window softmax ``local_attention`` over the last ``window``
      positions; constant-size ``KVCacheState``.

    Rotary position embeddings are applied to q and k for the softmax mechanisms
    (``rotary=None`` = on for softmax/local, off for linear: causal kernel attention has
    no use for them; ``rotary=False`` on softmax is NoPE, no positional encoding at all);
    ``rotary_scaling`` changes their frequencies (``nn/rotary.py``: linear, llama3).
    ``rerope=w`` (softmax/local): ReRoPE instead: the op rotates the unrotated q and k so that
    query i scores key j at the relative position ``min(i - j, w)`` (rotary inside the window,
    w beyond it); the caches keep unrotated keys. Exact softmax runs the tiled form
    (``softmax_attention(rerope=)``: SDPA has no ReRoPE form). The ops' ReRoPE turns at
    ``rotary_base``'s frequencies, so it does not combine with ``rotary_scaling``.
    ``scale`` (softmax/local): ``"default"`` (``head_dim^-1/2``) or ``"entropy"``: the
    entropy-invariant ``log_512(n_i) / sqrt(head_dim)`` with n_i the number of keys query i
    sees (its position + 1, at most ``window`` for local; the keys in the cache + 1 when a
    softmax layer continues a truncated cache). Heads: ``n_heads`` query heads sharing
    ``n_kv_heads`` key/value heads.

    ``forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], state, aux)`` (``aux`` is
    empty: the layer interface of docs/design.md, section 5); passing the state back continues the
    sequence, so token-by-token decoding equals the full pass.

    Args:
        d_model: the width of the input and output.
        n_heads: query heads.
        mechanism: ``"softmax"``, ``"linear"`` or ``"local"`` (above).
        n_kv_heads: key/value heads, dividing ``n_heads`` (grouped-query attention); None: ``n_heads``.
        head_dim: the width of a head; None: ``d_model // n_heads``.
        feature_map: the map of ``mechanism="linear"``: a name or a ``FeatureMap``.
        window: the window of ``mechanism="local"``.
        chunk_size: the chunk length of the linear chunk form.
        rotary: rotary positions on q and k; None: on for softmax and local, off for linear.
        rotary_base: the base of the rotary frequencies (a number > 1).
        rotary_scaling: a checkpoint's rope scaling of the frequencies (``nn/rotary.py``); None: plain.
        scale: ``"default"`` or ``"entropy"`` (softmax and local; above).
        qkv_bias: biases on the q, k and v projections.
        out_bias: a bias on the output projection.
        rerope: ReRoPE's window w (softmax and local; above); None: off.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        mechanism: str = "softmax",
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        feature_map: str | FeatureMap = "elu",
        window: int = 256,
        chunk_size: int = 64,
        rotary: bool | None = None,
        rotary_base: float = 10000.0,
        rotary_scaling: dict | None = None,
        scale: str = "default",
        qkv_bias: bool = False,
        out_bias: bool = False,
        rerope: int | None = None,
    ):
        super().__init__()
        check_choice("mechanism", mechanism, _MECHANISMS)
        check_choice("scale", scale, ATTENTION_SCALES)
        if scale == "entropy" and mechanism == "linear":
            raise ValueError("scale='entropy' is for the softmax mechanisms (softmax, local), not 'linear'")
        n_kv_heads, head_dim = check_head_layout(d_model, n_heads, n_kv_heads, head_dim)
        self.rerope = check_rerope(rerope, rotary_base, head_dim)
        if rerope is not None and (mechanism == "linear" or rotary is False):
            raise ValueError(f"rerope is a rotary position rule for the softmax mechanisms (softmax, local); got "
                             f"mechanism={mechanism!r}, rotary={rotary!r}")
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.mechanism, self.window, self.chunk_size = mechanism, window, chunk_size
        self.query_map = self.key_map = None
        if mechanism == "linear" and feature_map == HEDGEHOG:  # learned: the layer computes the features
            self.feature_map = LearnedFeatures()
            self.query_map, self.key_map = HedgehogFeatureMap(n_heads, head_dim), HedgehogFeatureMap(n_kv_heads,
                                                                                                     head_dim)
        else:
            self.feature_map = get_feature_map(feature_map) if mechanism == "linear" else None
        if self.feature_map is not None:
            self.feature_map.prepare(head_dim)  # random features are drawn here, not in a compiled forward
        # whether the layer rotates q and k itself (with rerope the op does)
        self.rotary = rerope is None and ((mechanism != "linear") if rotary is None else bool(rotary))
        self.rotary_base, self.scale = rotary_base, scale
        self.rotary_scaling = check_rotary_scaling("rotary_scaling", rotary_scaling)
        if rerope is not None and self.rotary_scaling is not None:
            raise ValueError(f"rerope={rerope} turns at rotary_base's frequencies; rotary_scaling="
                             f"{self.rotary_scaling} would change them: pass one of the two")
        check_bool("qkv_bias", qkv_bias)
        check_bool("out_bias", out_bias)
        add_attention_projections(self, d_model, n_heads, n_kv_heads, head_dim, qkv_bias=qkv_bias, out_bias=out_bias)

    def forward(
        self, x: torch.Tensor, state: KVCacheState | LinearAttentionState | None = None
    ) -> tuple[torch.Tensor, KVCacheState | LinearAttentionState, dict]:
        check_layer_input(x, self.d_model)
        if state is not None:
            self._check_state(state, x)
        B, T, _ = x.shape
        q, k, v = attention_heads(self, x)
        past = 0 if state is None else state.steps
        if self.rotary:
            q = apply_rotary(q, past, self.rotary_base, self.rotary_scaling)
            k = apply_rotary(k, past, self.rotary_base, self.rotary_scaling)
        if self.scale == "entropy":
            q = q * self._entropy_scale(T, state, q)
        # The ops keep their own precision (float32 sums/softmax); under autocast they run
        # outside it, on the projections' dtype.
        with outside_autocast(x.device.type):
            out, state = self._attend(q, k.to(q.dtype), v.to(q.dtype), state)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), state, {}

    def _check_state(self, state, x: torch.Tensor) -> None:
        """A carried state fits this layer: its kind, and for the softmax mechanism (which has
        no op to check its cache) no window, the batch size and the shapes. The linear and local
        ops check the settings of their states (feature map, window), batch and shapes."""
        kind = LinearAttentionState if self.mechanism == "linear" else KVCacheState
        if not isinstance(state, kind):
            raise TypeError(f"{self.mechanism} attention's state is a {kind.__name__}, got {type(state).__name__}")
        if self.mechanism != "softmax":
            return
        if state.window is not None:
            raise ValueError(f"state was made by local attention with window={state.window}, but this softmax "
                             "layer keeps every key (a cache with window=None)")
        batch = x.shape[0]
        check_state_batch("state", state.keys, batch)
        past = state.keys.shape[2] if isinstance(state.keys, torch.Tensor) and state.keys.dim() == 4 else 0
        check_state_tensor("state.keys", state.keys, (batch, self.n_kv_heads, past, self.head_dim), x)
        check_state_tensor("state.values", state.values, (batch, self.n_kv_heads, past, self.head_dim), x)

    def _entropy_scale(self, T: int, state, q: torch.Tensor) -> torch.Tensor:
        """``log_512(n_t) / sqrt(head_dim)`` ``[T, 1]`` for the T new queries (the ops then use scale 1)."""
        if self.mechanism == "local":
            seen = torch.arange(1, T + 1, device=q.device) + (0 if state is None else state.steps)
            seen = seen.clamp_max(self.window)
        else:
            seen = torch.arange(1, T + 1, device=q.device) + (0 if state is None else state.keys.shape[2])
        return entropy_scale(seen.to(q.dtype), self.head_dim).unsqueeze(-1)

    def _attend(self, q, k, v, state):
        if self.mechanism == "linear":
            if self.query_map is not None:
                q, k = self.query_map(q), self.key_map(k)
            out, state = linear_attention(
                q, k, v, feature_map=self.feature_map, chunk_size=self.chunk_size,
                initial_state=state, output_final_state=True,
            )
        elif self.mechanism == "local":
            out, state = local_attention(
                q, k, v, window=self.window, scale=self._op_scale, initial_state=state, output_final_state=True,
                rerope=self.rerope, rotary_base=self.rotary_base,
            )
        elif self.rerope is not None:
            out, state = self._softmax_rerope(q, k, v, state)
        else:
            out, state = self._softmax(q, k, v, state, self._op_scale)
        return out, state

    def _softmax_rerope(self, q, k, v, state: KVCacheState | None):
        """Exact softmax with ReRoPE: the T new queries are the last T positions of the cache."""
        state = kv_cache.extend(state, k, v)
        out = softmax_attention(q, state.keys, state.values, causal=True, scale=self._op_scale, rerope=self.rerope,
                                rotary_base=self.rotary_base)
        return out, state

    @property
    def _op_scale(self) -> float | None:
        return 1.0 if self.scale == "entropy" else None  # the entropy scale is already in q

    @staticmethod
    def _softmax(q, k, v, state: KVCacheState | None, scale: float | None):
        T = q.shape[2]
        cached = 0 if state is None else state.keys.shape[2]
        state = kv_cache.extend(state, k, v)
        if cached == 0:
            return softmax_attention(q, k, v, causal=True, scale=scale), state
        # query i (after `cached` older keys) sees keys j <= cached + i: every key for one query
        visible = None if T == 1 else torch.ones(T, cached + T, dtype=torch.bool, device=q.device).tril(cached)
        out = softmax_attention(q, state.keys, state.values, causal=False, bias=visible, scale=scale)
        return out, state


def truncate_cache(state: KVCacheState, memory: int) -> KVCacheState:
    """Keep the last ``memory`` keys/values of a softmax cache (a Transformer-XL memory);
    ``memory == 0`` keeps none but still counts the positions consumed. The other fields
    (``window``) are kept."""
    start = state.keys.shape[2] - min(memory, state.keys.shape[2])
    return dataclasses.replace(state, keys=state.keys[:, :, start:], values=state.values[:, :, start:])
