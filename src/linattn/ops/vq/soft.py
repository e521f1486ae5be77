"""Soft Transformer-VQ: keys softly assigned to codes (seed 000), differentiable everywhere.

``a_j = softmax_s(-|k_j - c_s|^2 / 2 tau)``; the keys become ``k~_j = sum_s a_js c_s`` and the
cache holds soft counts and soft means, so ``vq_attention``'s block form runs unchanged on
them. As tau -> 0 the assignments become one-hot and this is ``vq_attention``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...state import VQAttentionState
from ..._checks import check_positive_number, check_qkv, check_same_dtype_device, check_tensor, compute_dtype
from .attention import vq_attention


def soft_assignments(k: torch.Tensor, codebook: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax_s(-|k - c_s|^2 / (2 tau))``: k ``[B, Hkv, T, Dk]``, codebook ``[Hkv, S, Dk]``
    -> ``[B, Hkv, T, S]``; one-hot on the nearest code as tau -> 0."""
    distances = (
        k.pow(2).sum(-1, keepdim=True)
        - 2.0 * k @ codebook.unsqueeze(0).transpose(-1, -2)
        + codebook.pow(2).sum(-1).unsqueeze(0).unsqueeze(2)
    )
    return torch.softmax(-distances / (2.0 * temperature), dim=-1)


def soft_vq_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    codebook: torch.Tensor,
    *,
    temperature: float,
    causal: bool = True,
    scale: float | None = None,
    block_size: int = 128,
    bias: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
    position_keys: torch.Tensor | None = None,
    initial_state: VQAttentionState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, VQAttentionState | None]:
    """Soft Transformer-VQ: keys softly assigned to codes, differentiable everywhere.

    With ``a_j = softmax_s(-|k_j - c_s|^2 / 2 tau)`` and soft-quantized keys
    ``k~_j = sum_s a_js c_s``, a query attends exactly (softmax) to ``k~`` in its own and the
    previous block, and to older positions through a cache of soft counts
    ``n_s = sum_j a_js`` and soft means ``m_s = sum_j a_js v_j / n_s`` with logits
    ``scale q.c_s + log n_s``. No straight-through, no stop-gradient: gradients reach q, k,
    v and the codebook exactly, in linear time. As tau -> 0 it becomes ``vq_attention``.
    ``causal=False`` is linear attention with the ``SoftVQ`` feature map.
    Shapes as in ``vq_attention``; the state stores soft assignments in its ``*_codes``
    fields (``[B, Hkv, p, S]``).

    Args:
        q: the queries, ``[B, H, T, Dk]``.
        k: the keys, ``[B, Hkv, T, Dk]`` (not quantized: the op assigns them softly).
        v: the values, ``[B, Hkv, T, Dv]``.
        codebook: ``[Hkv, S, Dk]``, learned by gradient.
        temperature: tau of the soft assignment, a positive number (smaller: closer to hard VQ).
        causal: decoder (True) or encoder (False: linear attention with the ``SoftVQ`` map).
        scale: score scale, ``None`` = ``Dk^-1/2``.
        block_size: L, the block length and the bias window, as in ``vq_attention``.
        bias: relative bias for offsets ``0..L``, as in ``vq_attention``.
        position_keys: relative position keys, as in ``vq_attention``.
        initial_state: a ``VQAttentionState`` of soft assignments to continue from.
        output_final_state: also return the final state.

    Returns:
        ``(out [B, H, T, Dv] in q's dtype, final state or None)``.
    """
    check_positive_number("temperature", temperature)
    shapes = check_qkv(q, k, v)
    codebook = check_tensor("codebook", codebook, ndim=3, layout="[kv_heads, codebook_size, key_dim]")
    check_same_dtype_device(q=q, codebook=codebook)
    if codebook.shape[0] != shapes.kv_heads or codebook.shape[2] != shapes.key_dim:
        raise ValueError(
            f"codebook has shape {list(codebook.shape)}, expected [{shapes.kv_heads}, S, {shapes.key_dim}]"
        )
    dtype = compute_dtype(q.dtype)
    weights = soft_assignments(k.to(dtype), codebook.to(dtype), float(temperature))
    soft_keys = weights @ codebook.to(dtype).unsqueeze(0)
    out, state = vq_attention(
        q.to(dtype), soft_keys, v.to(dtype), weights, codebook.to(dtype),
        causal=causal, scale=scale, block_size=block_size, bias=bias, position_keys=position_keys,
        mode="block", grad_scope="none", initial_state=initial_state, output_final_state=output_final_state,
    )
    return out.to(q.dtype), state
