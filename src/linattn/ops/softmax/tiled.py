"""Tiled exact softmax attention: FlashAttention's online softmax in torch.

Per query row a running max ``m``, normaliser ``l`` and weighted sum ``acc`` are kept while
the rows walk over key blocks; causal blocks above the diagonal are never touched, and the
backward pass recomputes each block from the saved log-sum-exp, so memory is
O(T * block_size) both ways.
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
            return self._grouped(table_block(self.table, self.key_length, r0, r1, c0, c1).unsqueeze(0))
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


class TiledSoftmax(torch.autograd.Function):
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
