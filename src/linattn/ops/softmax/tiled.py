"""Tiled exact softmax attention: FlashAttention's online softmax in torch.

Per query row a running max ``m``, normaliser ``l`` and weighted sum ``acc`` are kept while
the rows walk over key blocks; causal blocks above the diagonal are never touched, and the
backward pass recomputes each block from the saved log-sum-exp, so memory is
O(T * block_size) both ways.

ReRoPE (``softmax_attention(rerope=w)``) gives the Function a second pair, the far queries
``R(w) q`` and the unrotated keys: a block whose every offset lies inside the window scores the
rotated pair, one beyond it the far pair, one across the edge both, merged by ``i - j < w``;
the backward splits each block's score gradient the same way.
"""

from __future__ import annotations

import torch

from ..._checks import check_first_order_backward
from ..common.bias import offset_rows


def table_block(table: torch.Tensor, key_length: int, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """Rows ``r0..r1-1`` and columns ``c0..c1-1`` of ``bias(i - j)`` from the table
    ``[Hb, T + S - 1]`` over offsets ``-(S - 1)..T - 1``: ``[Hb, r1 - r0, c1 - c0]``
    (deterministic backward, see ``common/bias.py``'s ``offset_rows``)."""
    high = table.shape[-1] - key_length
    return offset_rows(table.unsqueeze(-2), r0 - c0, r1 - r0, c1 - c0, -(key_length - 1), high)


class _TiledBias:
    """Block access to a dense 4-D bias or a relative table, in the grouped head layout."""

    def __init__(self, dense, table, heads, kv_heads, key_length, past=0):
        self.dense, self.table = dense, table
        self.heads, self.kv_heads, self.key_length = heads, kv_heads, key_length
        self.past = past  # query row r is at position past + r of the keys (a table's offsets)

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
            past = self.past
            return self._grouped(table_block(self.table, self.key_length, r0 + past, r1 + past, c0, c1).unsqueeze(0))
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
            rows = torch.arange(r0 + self.past, r1 + self.past, device=ds.device)
            cols = torch.arange(c0, c1, device=ds.device)
            index = (rows[:, None] - cols[None, :] + (self.key_length - 1)).reshape(-1)
            grad_table.index_add_(1, index, ds.reshape(ds.shape[0], -1))


def _query_blocks(T, block_size):
    for r0 in range(0, T, block_size):
        yield r0, min(r0 + block_size, T)


def _key_blocks(causal, r1, S, block_size, past=0):
    """Key blocks a query block ending at row r1 (position past + r1 - 1) can see (none above the diagonal)."""
    end = min(r1 + past, S) if causal else S
    for c0 in range(0, end, block_size):
        yield c0, min(c0 + block_size, end)


def _inside_window(far, r0, r1, c0, c1, past):
    """Which scores of rows r0:r1 on keys c0:c1 lie inside ReRoPE's window, ``i - j < w`` (row r
    at position past + r): True (all, or no ReRoPE), False (none) or a bool mask ``[r, c]``."""
    if far is None:
        return True
    window = far[2]
    if past + r1 - 1 - c0 < window:
        return True
    if past + r0 - (c1 - 1) >= window:
        return False
    rows = torch.arange(past + r0, past + r1, device=far[1].device)
    return rows[:, None] - torch.arange(c0, c1, device=far[1].device)[None, :] < window


def _block_scores(q_block, k, bias: _TiledBias, causal, r0, r1, c0, c1, past=0, far=None, far_block=None):
    """Scores of query rows r0:r1 on keys c0:c1, bias added, future keys at -inf. ``far``:
    ReRoPE's ``(far queries, unrotated keys, w)`` (q and k are then the rotated pair), with
    ``far_block`` the far queries of rows r0:r1."""
    near = _inside_window(far, r0, r1, c0, c1, past)
    if near is False:
        s = far_block @ far[1][:, :, c0:c1, :].unsqueeze(2).transpose(-1, -2)
    else:
        s = q_block @ k[:, :, c0:c1, :].unsqueeze(2).transpose(-1, -2)
        if near is not True:
            s = torch.where(near, s, far_block @ far[1][:, :, c0:c1, :].unsqueeze(2).transpose(-1, -2))
    b = bias.block(r0, r1, c0, c1)
    if b is not None:
        s = s + b
    if causal and c1 - 1 > r0 + past:
        rows = torch.arange(r0 + past, r1 + past, device=s.device)
        cols = torch.arange(c0, c1, device=s.device)
        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    return s


def _add_score_grad(ds, pair, grads, r0, r1, c0, c1):
    """The gradients of one block's scores ``ds`` sent to the queries and keys of ``pair``
    (rows r0:r1, keys c0:c1): ``grads = (grad of the query block, grad of the keys)``."""
    q, k = pair
    grads[0].add_(ds @ k[:, :, c0:c1, :].unsqueeze(2))
    grads[1][:, :, c0:c1] += (ds.transpose(-1, -2) @ q[..., r0:r1, :]).sum(2)


class TiledSoftmax(torch.autograd.Function):
    """Online-softmax forward and recomputing backward over (query, key) blocks.

    q ``[B, Hkv, G, T, D]`` (pre-scaled), k ``[B, Hkv, S, D]``, v ``[B, Hkv, S, Dv]``; query row
    r sits at position ``past + r`` of the keys (``past = S - T`` continues a cache, causal).
    ReRoPE: ``q_far [B, Hkv, G, T, D]`` and ``k_far [B, Hkv, S, D]`` score the pairs with
    ``i - j >= window`` (q and k, rotated by position, the others); None without it.
    """

    @staticmethod
    def forward(ctx, q, k, v, dense, table, causal, block_size, past=0, q_far=None, k_far=None, window=None):
        B, Hkv, G, T, _ = q.shape
        S, Dv = k.shape[2], v.shape[-1]
        bias = _TiledBias(dense, table, Hkv * G, Hkv, S, past)
        far = None if q_far is None else (q_far, k_far, window)
        out = q.new_empty(B, Hkv, G, T, Dv)
        lse = q.new_empty(B, Hkv, G, T)
        for r0, r1 in _query_blocks(T, block_size):
            q_block = q[..., r0:r1, :]
            far_block = None if far is None else q_far[..., r0:r1, :]
            m = q.new_full((B, Hkv, G, r1 - r0), float("-inf"))
            denominator = torch.zeros_like(m)
            acc = q.new_zeros(B, Hkv, G, r1 - r0, Dv)
            for c0, c1 in _key_blocks(causal, r1, S, block_size, past):
                s = _block_scores(q_block, k, bias, causal, r0, r1, c0, c1, past, far, far_block)
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
        ctx.save_for_backward(q, k, v, dense, table, out, lse, q_far, k_far)
        ctx.causal, ctx.block_size, ctx.past, ctx.window = causal, block_size, past, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        check_first_order_backward("softmax_attention(impl='tiled')", "impl='reference' or impl='sdpa'")
        q, k, v, dense, table, out, lse, q_far, k_far = ctx.saved_tensors
        causal, block_size, past = ctx.causal, ctx.block_size, ctx.past
        far = None if q_far is None else (q_far, k_far, ctx.window)
        B, Hkv, G, T, _ = q.shape
        S = k.shape[2]
        bias = _TiledBias(dense, table, Hkv * G, Hkv, S, past)
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)  # D_i = dO_i . O_i
        grad_q = torch.empty_like(q)
        grad_k = torch.zeros_like(k)
        grad_v = torch.zeros_like(v)
        grad_q_far = None if far is None else torch.empty_like(q_far)
        grad_k_far = None if far is None else torch.zeros_like(k_far)
        grad_dense = torch.zeros_like(dense) if dense is not None and ctx.needs_input_grad[3] else None
        grad_table = torch.zeros_like(table) if table is not None and ctx.needs_input_grad[4] else None
        for r0, r1 in _query_blocks(T, block_size):
            q_block, d_out = q[..., r0:r1, :], grad_out[..., r0:r1, :]
            far_block = None if far is None else q_far[..., r0:r1, :]
            lse_block, delta_block = lse[..., r0:r1, None], delta[..., r0:r1, None]
            near_grads = (torch.zeros_like(q_block), grad_k)
            far_grads = None if far is None else (torch.zeros_like(far_block), grad_k_far)
            for c0, c1 in _key_blocks(causal, r1, S, block_size, past):
                s = _block_scores(q_block, k, bias, causal, r0, r1, c0, c1, past, far, far_block)
                p = torch.exp(s - lse_block)
                grad_v[:, :, c0:c1] += (p.transpose(-1, -2) @ d_out).sum(2)
                dp = d_out @ v[:, :, c0:c1, :].unsqueeze(2).transpose(-1, -2)
                ds = p * (dp - delta_block)
                near = _inside_window(far, r0, r1, c0, c1, past)
                if near is True:
                    _add_score_grad(ds, (q, k), near_grads, r0, r1, c0, c1)
                elif near is False:
                    _add_score_grad(ds, (q_far, k_far), far_grads, r0, r1, c0, c1)
                else:
                    _add_score_grad(ds.masked_fill(~near, 0.0), (q, k), near_grads, r0, r1, c0, c1)
                    _add_score_grad(ds.masked_fill(near, 0.0), (q_far, k_far), far_grads, r0, r1, c0, c1)
                if grad_dense is not None or grad_table is not None:
                    bias.accumulate_grad(grad_dense, grad_table, ds, r0, r1, c0, c1)
            grad_q[..., r0:r1, :] = near_grads[0]
            if far is not None:
                grad_q_far[..., r0:r1, :] = far_grads[0]
        return grad_q, grad_k, grad_v, grad_dense, grad_table, None, None, None, grad_q_far, grad_k_far, None
