"""The quadratic reference of Transformer-VQ attention (``mode="parallel"``): softmax over
every earlier quantized key with the windowed relative terms, materialised; and the encoder
form (``causal=False``) over the codebook.
"""

from __future__ import annotations

import torch

from ..._checks import check_positive_int, compute_dtype, resolve_scale
from ..common.rotary import pairwise_rerope_scores
from .cache import code_statistics, mean_values
from .relative import offset_bias, position_scores, relative_inputs
from .rerope import check_vq_rerope
from .tensors import as_dtype


def windowed_softmax(q, k, v, table, positions_k, L, causal, past: int = 0, row_scale=None, rerope=None):
    """Quadratic softmax with the windowed relative terms: the reference, and the GAU's
    softmax twin. Materialised scores; q ``[B, Hkv, G, T, D]`` (scaled) holds positions
    ``past .. past + T - 1``, k ``[B, Hkv, past + T, D]`` and v every position from 0;
    ``row_scale`` ``[T]`` (or None) multiplies each query's logits, relative terms included;
    ``rerope``: ``(w, rotary_base)`` or None, ReRoPE's score ``(R(min(i - j, w)) q_i).k_j``
    with one rotated query per pair (``common/rotary.py``)."""
    return windowed_weights(q, k, table, positions_k, L, causal, past, row_scale, rerope) @ v.unsqueeze(2)


def windowed_weights(q, k, table, positions_k, L, causal, past: int = 0, row_scale=None, rerope=None):
    """The attention probabilities of ``windowed_softmax`` ``[B, Hkv, G, T, past + T]``."""
    if rerope is None:
        scores = q @ k.unsqueeze(2).transpose(-1, -2)
    else:
        scores = pairwise_rerope_scores(q, k.unsqueeze(2), past, 0, *rerope)
    rows = torch.arange(past, past + q.shape[-2], device=q.device)
    offsets = rows[:, None] - torch.arange(k.shape[-2], device=q.device)[None, :]
    if table is not None:
        scores = scores + offset_bias(table, past, q.shape[-2], k.shape[-2], L)
    if positions_k is not None:
        scores = scores + position_scores(q, positions_k.unsqueeze(0), past, k.shape[-2], L)
    if row_scale is not None:
        scores = scores * row_scale.unsqueeze(-1)
    if causal:
        scores = scores.masked_fill(offsets < 0, float("-inf"))
    return torch.softmax(scores, dim=-1)


def vq_attention_weights(q: torch.Tensor, k_hat: torch.Tensor, *, scale: float | None = None, block_size: int = 128,
                         bias=None, position_keys: torch.Tensor | None = None, rerope: int | None = None,
                         rotary_base: float = 10000.0) -> torch.Tensor:
    """The causal attention probabilities ``[B, H, T, T]`` that ``vq_attention`` applies to v
    (its quadratic reference form, materialised: for inspection on bounded lengths). Same
    arguments as ``vq_attention``; the block form gives the same outputs."""
    B, H, T, Dk = q.shape
    Hkv = k_hat.shape[1]
    dtype = compute_dtype(q.dtype)
    L = check_positive_int("block_size", block_size)
    rerope = check_vq_rerope(rerope, rotary_base, Dk, L, True)
    qf = as_dtype(q, dtype).reshape(B, Hkv, H // Hkv, T, Dk) * resolve_scale(scale, Dk)
    table, positions_k = relative_inputs(bias, position_keys, H, Hkv, L, Dk, q, dtype)
    rope = None if rerope is None else (rerope, rotary_base)
    return windowed_weights(qf, as_dtype(k_hat, dtype), table, positions_k, L, True, rerope=rope).reshape(B, H, T, T)


def noncausal(q, codes, v, codebook):
    """Encoder form: ``softmax_s(q.c_s + log n_s) m_s`` over all positions."""
    counts, sums = code_statistics(codes.unsqueeze(2), v.unsqueeze(2), codebook.shape[1])
    counts, sums = counts.squeeze(2), sums.squeeze(2)
    logits = q @ codebook.unsqueeze(0).unsqueeze(2).transpose(-1, -2) + torch.log(counts).unsqueeze(2).unsqueeze(-2)
    means = mean_values(sums, counts)
    return torch.softmax(logits, dim=-1) @ means.unsqueeze(2)
