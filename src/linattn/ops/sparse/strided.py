"""Sparse Transformer patterns (Child et al. 2019), computed block-sparse.

``pattern="strided"``: query i sees the band ``|i - j| < block`` and every key with
``(i - j) % stride == 0`` (stride defaults to block).
``pattern="fixed"``: query i sees its own block (``j // block == i // block``) and the
summary columns, the last ``summary`` positions of every block (``j % block >= block - summary``).
``causal=True`` adds ``j <= i``.

Both are a union of two structured groups, scored separately and joined in one softmax:
the local group (block b against blocks b-1, b, b+1: O(T * block)) and the long-range
group, either per residue class mod ``stride`` (O(T^2 / stride)) or against the summary
columns (O(T^2 * summary / block)). Keys that fall in both groups are counted once (the
long-range group masks them). No T x T tensor is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._checks import check_bool, check_choice, check_positive_int, check_qkv, compute_dtype, resolve_scale

_PATTERNS = ("strided", "fixed")


def _local_group(q, k, v, block, visible):
    """Scores of each query against the keys of its own and both neighbouring blocks.

    q ``[B, H, T, D]``; returns scores ``[B, H, T, 3 * block]`` (masked by
    ``visible(i, j)`` and key range) and values ``[B, H, R, 3 * block, E]``.
    """
    B, H, T, _ = q.shape
    W = block
    R = -(-T // W)
    tail = R * W - T
    q_blocks = F.pad(q, (0, 0, 0, tail)).reshape(B, H, R, W, -1)
    keys = F.pad(k, (0, 0, W, W + tail)).unfold(2, 3 * W, W)  # [B, H, R, D, 3W]
    values = F.pad(v, (0, 0, W, W + tail)).unfold(2, 3 * W, W).transpose(-1, -2)  # [B, H, R, 3W, E]
    scores = q_blocks @ keys  # [B, H, R, W, 3W]
    i = torch.arange(R * W, device=q.device).reshape(R, W, 1)
    j = (torch.arange(R, device=q.device) * W - W).reshape(R, 1, 1) + torch.arange(3 * W, device=q.device)
    keep = visible(i, j) & (j >= 0) & (j < T)
    scores = scores.masked_fill(~keep, float("-inf"))
    return scores.reshape(B, H, R * W, 3 * W)[:, :, :T], values


def _strided_group(q, k, v, stride, visible, in_local):
    """Scores against the keys with ``(i - j) % stride == 0``, per residue class.

    Returns scores ``[B, H, T, n]`` (n = ceil(T / stride) keys per class) and a function
    mapping probabilities ``[B, H, T, n]`` to outputs ``[B, H, T, E]``.
    """
    B, H, T, _ = q.shape
    n = -(-T // stride)
    tail = n * stride - T
    # position m * stride + rho -> class rho, index m
    by_class = lambda x: F.pad(x, (0, 0, 0, tail)).reshape(B, H, n, stride, -1).transpose(2, 3)  # noqa: E731
    q_c, k_c, v_c = by_class(q), by_class(k), by_class(v)  # [B, H, stride, n, D]
    scores = q_c @ k_c.transpose(-1, -2)  # [B, H, stride, n, n]
    m = torch.arange(n, device=q.device)
    rho = torch.arange(stride, device=q.device).reshape(stride, 1, 1)
    i = m.reshape(1, n, 1) * stride + rho
    j = m.reshape(1, 1, n) * stride + rho
    keep = visible(i, j) & ~in_local(i, j) & (j < T)
    scores = scores.masked_fill(~keep, float("-inf"))
    scores = scores.transpose(2, 3).reshape(B, H, n * stride, n)[:, :, :T]

    def read(probs):
        probs = F.pad(probs, (0, 0, 0, tail)).reshape(B, H, n, stride, n).transpose(2, 3)
        out = probs @ v_c  # [B, H, stride, n, E]
        return out.transpose(2, 3).reshape(B, H, n * stride, -1)[:, :, :T]

    return scores, read


def _summary_group(q, k, v, block, summary, visible, in_local):
    """Scores against the summary columns (the last ``summary`` positions of every block)."""
    T = q.shape[2]
    columns = torch.arange(T, device=q.device)
    columns = columns[columns % block >= block - summary]
    scores = q @ k[:, :, columns].transpose(-1, -2)  # [B, H, T, |columns|]
    i = torch.arange(T, device=q.device).reshape(T, 1)
    keep = visible(i, columns.reshape(1, -1)) & ~in_local(i, columns.reshape(1, -1))
    scores = scores.masked_fill(~keep, float("-inf"))
    values = v[:, :, columns]
    return scores, lambda probs: probs @ values


def strided_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    pattern: str = "strided",
    block: int,
    stride: int | None = None,
    summary: int = 1,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact softmax attention over a Sparse Transformer pattern (see the module docstring).

    Args:
        q: the queries, ``[B, H, T, Dk]``.
        k: the keys, ``[B, Hkv, T, Dk]``, ``H % Hkv == 0``.
        v: the values, ``[B, Hkv, T, Dv]``.
        pattern: ``"strided"`` (band of ``block`` + every ``stride``-th key) or ``"fixed"``
            (own block + ``summary`` summary columns per block).
        block: band length / block length.
        stride: period of the strided keys (default ``block``).
        summary: summary columns per block for ``"fixed"`` (1 <= summary <= block).
        causal: only keys ``j <= i``.
        scale: score scale, ``None`` = ``Dk^-1/2``.


    Returns:
        ``[B, H, T, Dv]`` in q's dtype.
    """
    shapes = check_qkv(q, k, v)
    check_choice("pattern", pattern, _PATTERNS)
    block = check_positive_int("block", block)
    stride = block if stride is None else check_positive_int("stride", stride)
    summary = check_positive_int("summary", summary)
    if summary > block:
        raise ValueError(f"summary must be at most block={block}, got {summary}")
    check_bool("causal", causal)
    dtype = compute_dtype(q.dtype)
    G = shapes.group_size
    qf = q.to(dtype) * resolve_scale(scale, shapes.key_dim)
    kf = k.to(dtype).repeat_interleave(G, dim=1)
    vf = v.to(dtype).repeat_interleave(G, dim=1)

    def visible(i, j):
        return j <= i if causal else torch.ones_like(i - j, dtype=torch.bool)

    if pattern == "strided":
        in_local = lambda i, j: (i - j).abs() < block  # noqa: E731
        local_scores, local_values = _local_group(qf, kf, vf, block, lambda i, j: visible(i, j) & in_local(i, j))
        far_scores, far_read = _strided_group(
            qf, kf, vf, stride, lambda i, j: visible(i, j) & ((i - j) % stride == 0), in_local
        )
    else:
        in_local = lambda i, j: torch.div(i, block, rounding_mode="floor") == torch.div(j, block, rounding_mode="floor")  # noqa: E731
        local_scores, local_values = _local_group(qf, kf, vf, block, lambda i, j: visible(i, j) & in_local(i, j))
        far_scores, far_read = _summary_group(qf, kf, vf, block, summary, visible, in_local)

    probs = torch.softmax(torch.cat([local_scores, far_scores], dim=-1), dim=-1)
    local_probs, far_probs = probs.split([local_scores.shape[-1], far_scores.shape[-1]], dim=-1)
    B, H, T = shapes.batch, shapes.heads, shapes.length
    R = local_values.shape[2]
    local_probs = F.pad(local_probs, (0, 0, 0, R * block - T)).reshape(B, H, R, block, -1)
    out = (local_probs @ local_values).reshape(B, H, R * block, -1)[:, :, :T] + far_read(far_probs)
    return out.to(q.dtype)
