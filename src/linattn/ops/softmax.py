"""Exact softmax attention: materialised reference, torch SDPA, and tiled online softmax.

    out_i = sum_j softmax_j(s_i q_i.k_j + b_ij [- inf if causal and j > i]) v_j

``s_i`` is the scale: ``Dk^-1/2`` by default, a number, or ``"entropy"``:
``log(n_i) / log(512) / sqrt(Dk)`` with ``n_i`` the number of keys query i sees (i + 1
when causal, S otherwise). The scale is folded into q before any implementation runs,
so all three see the same scaled queries.

The tiled form keeps, per query row, a running max ``m``, normaliser ``l`` and weighted
sum ``acc`` while it walks over key blocks (FlashAttention's online softmax); causal
blocks above the diagonal are never touched, and the backward pass recomputes each block
from the saved log-sum-exp, so memory is O(T * block_size) both ways.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._bias import offset_rows, relative_bias_table
from .._checks import (
    is_number,
    check_bool,
    check_first_order_backward,
    AttentionShapes,
    check_choice,
    check_positive_int,
    check_qkv,
    compute_dtype,
)

_IMPLS = ("auto", "reference", "sdpa", "tiled")
BiasLike = torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None


def entropy_scale(visible: torch.Tensor, key_dim: int) -> torch.Tensor:
    """The entropy-invariant scale ``log_512(n) / sqrt(Dk)`` for ``visible`` = n, the number
    of keys each query sees (a float tensor): attention keeps its entropy as n grows past the
    training length (n = 512 gives the usual ``Dk^-1/2``)."""
    return torch.log(visible) / math.log(512.0) / math.sqrt(key_dim)


def _row_scale(scale, shapes: AttentionShapes, causal: bool, key_length: int, device, dtype):
    """The per-query scale: a float, or a ``[T, 1]`` tensor for ``scale="entropy"``."""
    Dk = shapes.key_dim
    if scale is None:
        return Dk ** -0.5
    if isinstance(scale, str):
        if scale != "entropy":
            raise ValueError(f"scale must be None, a positive number or 'entropy'; got {scale!r}")
        if causal:
            visible = torch.arange(1, shapes.length + 1, device=device, dtype=dtype)
        else:
            visible = torch.full((shapes.length,), float(key_length), device=device, dtype=dtype)
        return entropy_scale(visible, Dk).unsqueeze(-1)
    if not is_number(scale) or not scale > 0:
        raise ValueError(f"scale must be None, a positive number or 'entropy'; got {scale!r}")
    return float(scale)


def _bias_table(bias: Callable, heads: int, length: int, key_length: int, device, dtype) -> torch.Tensor:
    """``[Hb, T + S - 1]`` table of ``bias(i - j)``; column ``(i - j) + S - 1`` holds the
    bias of query i on key j."""
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


def _table_block(table: torch.Tensor, key_length: int, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """Rows ``r0..r1-1`` and columns ``c0..c1-1`` of ``bias(i - j)`` from the table
    ``[Hb, T + S - 1]`` over offsets ``-(S - 1)..T - 1``: ``[Hb, r1 - r0, c1 - c0]``
    (deterministic backward, see ``_bias.offset_rows``)."""
    high = table.shape[-1] - key_length
    return offset_rows(table.unsqueeze(-2), r0 - c0, r1 - r0, c1 - c0, -(key_length - 1), high)


def _reference(q, k, v, causal, bias):
    """Materialised scores: the readable form. q is pre-scaled, ``[B, H, T, D]``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2)
    if bias is not None:
        scores = scores + bias
    if causal:
        T, S = scores.shape[-2:]
        future = torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1)
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


class _TiledBias:
    """Block access to a dense 4-D bias or a relative table, in the grouped head layout."""

    def __init__(self, dense, table, heads, kv_heads, key_length):
        self.dense, self.table = dense, table
        self.heads, self.kv_heads, self.key_length = heads, kv_heads, key_length

    def _grouped(self, block):  # [b, h, r, c] -> broadcastable to [B, Hkv, G, r, c]
        b, h, r, c = block.shape
        if h == self.heads:
            return block.reshape(b, self.kv_heads, self.heads // self.kv_heads, r, c)
        return block.reshape(b, 1, 1, r, c)

    def block(self, r0, r1, c0, c1):
        if self.dense is not None:
            d = self.dense
            rows = slice(r0, r1) if d.shape[2] > 1 else slice(None)
            cols = slice(c0, c1) if d.shape[3] > 1 else slice(None)
            return self._grouped(d[:, :, rows, cols])
        if self.table is not None:
            return self._grouped(_table_block(self.table, self.key_length, r0, r1, c0, c1).unsqueeze(0))
        return None

    def accumulate_grad(self, grad_dense, grad_table, ds, r0, r1, c0, c1):
        """Add the score gradient ``ds [B, Hkv, G, r, c]`` of one block to the bias grads."""
        B, Hkv, G, r, c = ds.shape
        ds = ds.reshape(B, Hkv * G, r, c)
        if grad_dense is not None:
            shape = grad_dense.shape
            for dim in range(4):
                if shape[dim] == 1 and ds.shape[dim] != 1:
                    ds = ds.sum(dim, keepdim=True)
            rows = slice(r0, r1) if shape[2] > 1 else slice(None)
            cols = slice(c0, c1) if shape[3] > 1 else slice(None)
            grad_dense[:, :, rows, cols] += ds
        if grad_table is not None:
            ds = ds.sum(0)
            if grad_table.shape[0] == 1:
                ds = ds.sum(0, keepdim=True)
            rows = torch.arange(r0, r1, device=ds.device)
            cols = torch.arange(c0, c1, device=ds.device)
            index = (rows[:, None] - cols[None, :] + (self.key_length - 1)).reshape(-1)
            grad_table.index_add_(1, index, ds.reshape(ds.shape[0], -1))


def _query_blocks(T, block_size):
    for r0 in range(0, T, block_size):
        yield r0, min(r0 + block_size, T)


def _key_blocks(causal, r1, S, block_size):
    """Key blocks a query block ending at row r1 can see (none above the diagonal)."""
    end = min(r1, S) if causal else S
    for c0 in range(0, end, block_size):
        yield c0, min(c0 + block_size, end)


def _block_scores(q_block, k, bias: _TiledBias, causal, r0, r1, c0, c1):
    """Scores of query rows r0:r1 on keys c0:c1, bias added, future keys at -inf."""
    s = q_block @ k[:, :, c0:c1, :].unsqueeze(2).transpose(-1, -2)
    b = bias.block(r0, r1, c0, c1)
    if b is not None:
        s = s + b
    if causal and c1 - 1 > r0:
        rows = torch.arange(r0, r1, device=s.device)
        cols = torch.arange(c0, c1, device=s.device)
        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    return s


class _TiledSoftmax(torch.autograd.Function):
    """Online-softmax forward and recomputing backward over (query, key) blocks.

    q ``[B, Hkv, G, T, D]`` (pre-scaled), k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]``.
    """

    @staticmethod
    def forward(ctx, q, k, v, dense, table, causal, block_size):
        B, Hkv, G, T, _ = q.shape
        S, Dv = k.shape[2], v.shape[-1]
        bias = _TiledBias(dense, table, Hkv * G, Hkv, S)
        out = q.new_empty(B, Hkv, G, T, Dv)
        lse = q.new_empty(B, Hkv, G, T)
        for r0, r1 in _query_blocks(T, block_size):
            q_block = q[..., r0:r1, :]
            m = q.new_full((B, Hkv, G, r1 - r0), float("-inf"))
            denominator = torch.zeros_like(m)
            acc = q.new_zeros(B, Hkv, G, r1 - r0, Dv)
            for c0, c1 in _key_blocks(causal, r1, S, block_size):
                s = _block_scores(q_block, k, bias, causal, r0, r1, c0, c1)
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - m_safe.unsqueeze(-1))
                alpha = torch.exp(m - m_safe)
                denominator = denominator * alpha + p.sum(-1)
                acc = acc * alpha.unsqueeze(-1) + p @ v[:, :, c0:c1, :].unsqueeze(2)
                m = m_new
            seen = denominator > 0  # a row that sees no key gets output 0 and, through lse = inf, zero gradients
            out[..., r0:r1, :] = torch.where(seen.unsqueeze(-1), acc / denominator.clamp_min(1.0).unsqueeze(-1), 0.0)
            lse[..., r0:r1] = torch.where(seen, m + torch.log(denominator), float("inf"))
        ctx.save_for_backward(q, k, v, dense, table, out, lse)
        ctx.causal, ctx.block_size = causal, block_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        check_first_order_backward("softmax_attention(impl='tiled')", "impl='reference' or impl='sdpa'")
        q, k, v, dense, table, out, lse = ctx.saved_tensors
        causal, block_size = ctx.causal, ctx.block_size
        B, Hkv, G, T, _ = q.shape
        S = k.shape[2]
        bias = _TiledBias(dense, table, Hkv * G, Hkv, S)
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)  # D_i = dO_i . O_i
        grad_q = torch.empty_like(q)
        grad_k = torch.zeros_like(k)
        grad_v = torch.zeros_like(v)
        grad_dense = torch.zeros_like(dense) if dense is not None and ctx.needs_input_grad[3] else None
        grad_table = torch.zeros_like(table) if table is not None and ctx.needs_input_grad[4] else None
        for r0, r1 in _query_blocks(T, block_size):
            q_block, d_out = q[..., r0:r1, :], grad_out[..., r0:r1, :]
            lse_block, delta_block = lse[..., r0:r1, None], delta[..., r0:r1, None]
            grad_q_block = torch.zeros_like(q_block)
            for c0, c1 in _key_blocks(causal, r1, S, block_size):
                s = _block_scores(q_block, k, bias, causal, r0, r1, c0, c1)
                p = torch.exp(s - lse_block)
                grad_v[:, :, c0:c1] += (p.transpose(-1, -2) @ d_out).sum(2)
                dp = d_out @ v[:, :, c0:c1, :].unsqueeze(2).transpose(-1, -2)
                ds = p * (dp - delta_block)
                grad_q_block += ds @ k[:, :, c0:c1, :].unsqueeze(2)
                grad_k[:, :, c0:c1] += (ds.transpose(-1, -2) @ q_block).sum(2)
                if grad_dense is not None or grad_table is not None:
                    bias.accumulate_grad(grad_dense, grad_table, ds, r0, r1, c0, c1)
            grad_q[..., r0:r1, :] = grad_q_block
        return grad_q, grad_k, grad_v, grad_dense, grad_table, None, None


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
) -> torch.Tensor:
    """Exact softmax attention, ``out = softmax(scale * q k^T + bias [+ causal mask]) v``.

    Args:
        q: ``[B, H, T, Dk]``; k: ``[B, Hkv, S, Dk]``; v: ``[B, Hkv, S, Dv]`` with
            ``H % Hkv == 0`` (``S == T`` when causal).
        causal: query i sees keys j <= i.
        scale: ``None`` (``Dk^-1/2``), a positive number, or ``"entropy"``
            (``log(n_i) / log(512) / sqrt(Dk)``, n_i keys visible to query i).
        bias: additive tensor broadcastable to ``[B, H, T, S]`` (a bool tensor is a
            keep-mask: False becomes -inf), or a callable mapping the offsets ``i - j``
            (1-D long tensor of n offsets) to ``[n]`` or ``[H, n]`` biases.
        impl: ``"reference"`` (materialised T x S scores), ``"sdpa"`` (torch's
            scaled_dot_product_attention), ``"tiled"`` (online softmax over key blocks,
            O(T * block_size) memory), ``"auto"`` (``"tiled"`` for a callable bias, else
            ``"sdpa"``).
        block_size: key block length of ``impl="tiled"``.

    ``impl="tiled"`` (so ``"auto"`` with a callable bias) has no second derivatives: a backward
    with ``create_graph=True`` through it raises; ``"reference"`` and ``"sdpa"`` have them.

    Returns:
        ``[B, H, T, Dv]`` in q's dtype (computed in float32, float64 for float64 input).
        A query row whose every score is -inf (a keep-mask row that is all False) gets
        output 0 and passes zero gradient, in every ``impl`` (as torch's SDPA does).
    """
    check_bool("causal", causal)
    shapes = check_qkv(q, k, v, same_length=causal)
    check_choice("impl", impl, _IMPLS)
    check_positive_int("block_size", block_size)
    B, H, T = shapes.batch, shapes.heads, shapes.length
    S = k.shape[2]
    if impl == "auto":
        impl = "tiled" if callable(bias) and not isinstance(bias, torch.Tensor) else "sdpa"

    dtype = compute_dtype(q.dtype)
    row_scale = _row_scale(scale, shapes, causal, S, q.device, dtype)
    qf, kf, vf = q.to(dtype) * row_scale, k.to(dtype), v.to(dtype)

    dense = table = None
    if bias is not None:
        if callable(bias) and not isinstance(bias, torch.Tensor):
            table = _bias_table(bias, H, T, S, q.device, dtype)
        else:
            dense = _dense_bias(bias, B, H, T, S, qf)

    if impl == "tiled":
        G = shapes.group_size
        out = _TiledSoftmax.apply(qf.reshape(B, shapes.kv_heads, G, T, -1), kf, vf, dense, table, causal, block_size)
        return out.reshape(B, H, T, -1).to(q.dtype)
    if table is not None:
        dense = _table_block(table, S, 0, T, 0, S).unsqueeze(0)
    fn = _reference if impl == "reference" else _sdpa
    return fn(qf, kf, vf, causal, dense).to(q.dtype)
