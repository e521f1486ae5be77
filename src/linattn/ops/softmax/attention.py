"""Exact softmax attention: materialised reference, torch SDPA, and tiled online softmax.

    out_i = sum_j softmax_j(s_i q_i.k_j + b_ij [- inf if causal and j > i]) v_j

``s_i`` is the scale: ``Dk^-1/2`` by default, a number, or ``"entropy"``:
``log(n_i) / log(512) / sqrt(Dk)`` with ``n_i`` the number of keys query i sees (i + 1
when causal, S otherwise). The scale is folded into q before any implementation runs,
so all three see the same scaled queries.

The tiled form (``tiled.py``) is FlashAttention's online softmax: memory O(T * block_size)
both ways. ``kv_cache.py`` holds the preallocated KV cache that decoding appends to.

ReRoPE (``rerope=w``, seed 004; ``ops/common/rotary.py``): q and k come unrotated and the score
of query i on key j is ``s_i (R(min(i - j, w)) q_i).k_j``, causal. The T queries are the last
T of the S >= T keys (``S > T``: a block continuing a KV cache of S - T keys), so query t is at
position ``S - T + t``. The reference rotates one query per pair, ``[B, H, T, S, Dk]``; the tiled
form scores two pairs per key block, ``(R(i) q).(R(j) k)`` inside the window and ``(R(w) q).k``
beyond it, merged by the mask. SDPA takes one score product, so it has no ReRoPE form:
``impl="auto"`` takes the tiled one (exact, O(T * block_size) memory like SDPA's kernels).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..common.bias import relative_bias_table
from ..common.rotary import far_queries, pairwise_rerope_scores, positions, rotate_at
from ..._checks import (
    check_bool,
    check_scale,
    AttentionShapes,
    check_choice,
    check_positive_int,
    check_qkv,
    check_rerope,
    compute_dtype,
)
from .tiled import TiledSoftmax, table_block

_IMPLS = ("auto", "reference", "sdpa", "tiled")
BiasLike = torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None


def entropy_scale(visible: torch.Tensor, key_dim: int) -> torch.Tensor:
    """The entropy-invariant scale ``log_512(n) / sqrt(Dk)`` for ``visible`` = n, the number
    of keys each query sees (a float tensor): attention keeps its entropy as n grows past the
    training length (n = 512 gives the usual ``Dk^-1/2``)."""
    return torch.log(visible) / math.log(512.0) / math.sqrt(key_dim)


def _row_scale(scale, shapes: AttentionShapes, causal: bool, key_length: int, device, dtype):
    """The per-query scale: a float, or a ``[T, 1]`` tensor for ``scale="entropy"`` (causal:
    query t sees ``key_length - T + t + 1`` keys, t + 1 when ``key_length == T``)."""
    Dk = shapes.key_dim
    if scale is None:
        return Dk ** -0.5
    if isinstance(scale, str) and scale == "entropy":
        if causal:
            past = key_length - shapes.length
            visible = torch.arange(past + 1, key_length + 1, device=device, dtype=dtype)
        else:
            visible = torch.full((shapes.length,), float(key_length), device=device, dtype=dtype)
        return entropy_scale(visible, Dk).unsqueeze(-1)
    return check_scale(scale, also=", None (key_dim^-1/2) or 'entropy'")


def _bias_table(bias: Callable, heads: int, length: int, key_length: int, device, dtype) -> torch.Tensor:
    """``[Hb, length + S - 1]`` table of ``bias(i - j)`` for query positions ``0 .. length - 1``;
    column ``(i - j) + S - 1`` holds the bias of query i on key j."""
    offsets = torch.arange(-(key_length - 1), length, device=device)
    return relative_bias_table(bias, offsets, heads, dtype)


def _dense_bias(bias: torch.Tensor, B: int, H: int, T: int, S: int, like: torch.Tensor) -> torch.Tensor:
    """Validate an additive (or boolean keep-mask) bias; return it as a 4-D tensor."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a tensor, a callable of (i - j), or None; got {type(bias).__name__}")
    if bias.device != like.device:
        raise ValueError(f"bias is on {bias.device} but q is on {like.device}")
    if bias.dim() > 4:
        raise ValueError(f"bias must broadcast to [B, H, T, S] = [{B}, {H}, {T}, {S}], got shape {list(bias.shape)}")
    bias4 = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    for size, full in zip(bias4.shape, (B, H, T, S)):
        if size not in (1, full):
            raise ValueError(
                f"bias must broadcast to [B, H, T, S] = [{B}, {H}, {T}, {S}], got shape {list(bias.shape)}"
            )
    if bias4.dtype == torch.bool:
        return torch.zeros(bias4.shape, dtype=like.dtype, device=like.device).masked_fill(~bias4, float("-inf"))
    if not bias4.is_floating_point():
        raise TypeError(f"bias must be floating point (additive) or bool (keep-mask), got dtype {bias.dtype}")
    return bias4.to(like.dtype)


def _reference(q, k, v, causal, bias, rerope=None):
    """Materialised scores: the readable form. q is pre-scaled, ``[B, H, T, D]``; ``rerope``:
    ``(w, rotary_base)``, the queries the last T of the S keys (module docstring)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    T, S = q.shape[-2], k.shape[-2]
    past = S - T if rerope is not None else 0
    if rerope is None:
        scores = q @ k.transpose(-1, -2)
    else:
        scores = pairwise_rerope_scores(q, k, past, 0, *rerope)
    if bias is not None:
        scores = scores + bias
    if causal:
        future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1 + past)
        scores = scores.masked_fill(future, float("-inf"))
    masked_rows = scores.amax(-1, keepdim=True) == float("-inf")  # rows that see no key: output 0
    probs = torch.softmax(scores.masked_fill(masked_rows, 0.0), dim=-1).masked_fill(masked_rows, 0.0)
    return probs @ v


def _sdpa(q, k, v, causal, bias):
    """torch.nn.functional.scaled_dot_product_attention on pre-scaled q."""
    group = q.shape[1] // k.shape[1]
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0, enable_gqa=group > 1)
    if causal:
        T, S = q.shape[-2], k.shape[-2]
        future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1)
        bias = bias.masked_fill(future, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0, enable_gqa=group > 1)


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | str | None = None,
    bias: BiasLike = None,
    impl: str = "auto",
    block_size: int = 256,
    rerope: int | None = None,
    rotary_base: float = 10000.0,
) -> torch.Tensor:
    """Exact softmax attention, ``out = softmax(scale * q k^T + bias [+ causal mask]) v``.

    Args:
        q: the queries, ``[B, H, T, Dk]``.
        k: the keys, ``[B, Hkv, S, Dk]`` with ``H % Hkv == 0`` (``S == T`` when causal,
            ``S >= T`` with ``rerope``).
        v: the values, ``[B, Hkv, S, Dv]``.

        causal: query i sees keys j <= i.
        scale: ``None`` (``Dk^-1/2``), a positive number, or ``"entropy"``
            (``log(n_i) / log(512) / sqrt(Dk)``, n_i keys visible to query i).
        bias: additive tensor broadcastable to ``[B, H, T, S]`` (a bool tensor is a
            keep-mask: False becomes -inf), or a callable mapping the offsets ``i - j``
            (1-D long tensor of n offsets) to ``[n]`` or ``[H, n]`` biases.
        impl: ``"reference"`` (materialised T x S scores), ``"sdpa"`` (torch's
            scaled_dot_product_attention), ``"tiled"`` (online softmax over key blocks,
            O(T * block_size) memory), ``"auto"`` (``"tiled"`` for a callable bias or
            ``rerope``, else ``"sdpa"``).
        block_size: key block length of ``impl="tiled"``.
        rerope: ReRoPE's window w (an int >= 1) or None (off). q and k are passed unrotated; the
            score of query i on key j is ``scale (R(min(i - j, w)) q_i).k_j`` with R the rotary
            rotation of ``linattn.nn.rotary`` (``rotary_base``): rotary positions inside the
            window, distance w beyond it. Causal only; query t is at position ``S - T + t``.
            ``impl="sdpa"`` has no ReRoPE form (one score product) and is refused.
        rotary_base: the base of the rotary frequencies ``base^(-2m/Dk)`` (a number > 1).

    ``impl="tiled"`` (so ``"auto"`` with a callable bias) has no second derivatives: a backward
    with ``create_graph=True`` through it raises; ``"reference"`` and ``"sdpa"`` have them.

    Returns:
        ``[B, H, T, Dv]`` in q's dtype (computed in float32, float64 for float64 input).
        A query row whose every score is -inf (a keep-mask row that is all False) gets
        output 0 and passes zero gradient, in every ``impl`` (as torch's SDPA does).
    """
    check_bool("causal", causal)
    shapes = check_qkv(q, k, v, same_length=causal and rerope is None)
    check_choice("impl", impl, _IMPLS)
    check_positive_int("block_size", block_size)
    rerope = check_rerope(rerope, rotary_base, shapes.key_dim)
    B, H, T = shapes.batch, shapes.heads, shapes.length
    S = k.shape[2]
    if rerope is not None:
        _check_rerope_call(causal, impl, T, S)
    if impl == "auto":
        impl = "tiled" if rerope is not None or (callable(bias) and not isinstance(bias, torch.Tensor)) else "sdpa"
    past = S - T if rerope is not None else 0  # query t is at position past + t of the keys

    dtype = compute_dtype(q.dtype)
    row_scale = _row_scale(scale, shapes, causal, S, q.device, dtype)
    qf, kf, vf = q.to(dtype) * row_scale, k.to(dtype), v.to(dtype)

    dense = table = None
    if bias is not None:
        if callable(bias) and not isinstance(bias, torch.Tensor):
            table = _bias_table(bias, H, past + T, S, q.device, dtype)
        else:
            dense = _dense_bias(bias, B, H, T, S, qf)

    if impl == "tiled":
        grouped = qf.reshape(B, shapes.kv_heads, shapes.group_size, T, -1)
        if rerope is None:
            out = TiledSoftmax.apply(grouped, kf, vf, dense, table, causal, block_size)
        else:  # the rotated pair, then the far pair
            out = TiledSoftmax.apply(
                rotate_at(grouped, positions(past, T, q.device), rotary_base),
                rotate_at(kf, positions(0, S, q.device), rotary_base), vf, dense, table, causal, block_size, past,
                far_queries(grouped, rerope, rotary_base), kf, rerope)
        return out.reshape(B, H, T, -1).to(q.dtype)
    if table is not None:
        dense = table_block(table, S, past, past + T, 0, S).unsqueeze(0)
    if impl == "reference":
        return _reference(qf, kf, vf, causal, dense, None if rerope is None else (rerope, rotary_base)).to(q.dtype)
    return _sdpa(qf, kf, vf, causal, dense).to(q.dtype)


def _check_rerope_call(causal: bool, impl: str, length: int, key_length: int) -> None:
    """ReRoPE's score is causal and has no SDPA form (module docstring)."""
    if not causal:
        raise ValueError("rerope is ReRoPE's causal relative position min(i - j, w) (i >= j): it needs causal=True")
    if key_length < length:
        raise ValueError(f"with rerope the T queries are the last T of the S keys, so S >= T; got T={length} "
                         f"queries and S={key_length} keys")
    if impl == "sdpa":
        raise ValueError("impl='sdpa' takes one score product, and rerope merges two (rotated by position inside the "
                         "window, at distance w beyond it): use impl='tiled' (what 'auto' picks) or 'reference'")
