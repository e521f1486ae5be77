"""Transformer-VQ's causal block form on fused Triton kernels (``vq_attention(impl="triton")``).

The same computation as ``block.py``'s block form, split where memory allows: torch lays the
stream out in blocks (the state's partial block in front, padding behind, the previous
block of block 0 as key rows 0..L-1) and computes, by the prefix sum over blocks that the
batched schedule uses (``batched.block_caches``), the cache every block reads: ``log n_s`` and
the means ``m_s`` per block, ``[B, Hkv, R, S(, E)]`` in float32 (the analogue of the
per-chunk states of chunked linear attention). It also forms the relative terms
``b_delta + scale q_i.P_delta`` per row and offset ``[B, H, N, L + 1]`` (a broadcast view
when there are no position keys). The kernels (``triton_kernels.py``) then compute every
block's softmax over (previous block, own block, S cache slots) with an online softmax,
never holding more than one tile of its ``2L + S`` columns, and the backward by
recomputation from the row log-sum-exp.

Gradients: the kernels return the gradients of q, the window keys and values, the codebook
(through the cache logits), the per-block ``log n_s`` and ``m_s`` and the relative terms;
torch's autograd carries the last three back through the prefix sum, the code statistics
and the bias/position-key products, so ``grad_scope`` acts exactly as in the torch form:
``"cache"`` and ``"state"`` build the cache from detached values (and detached soft
counts), ``"none"`` does not; ``"state"`` also detaches the carried state and tells the
key kernel to skip what a block sends to its previous block (the one stop-gradient inside
the kernels).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .batched import block_caches
from .cache import mean_values
from .tensors import detached_if, owned


@functools.cache
def kernels():
    """The kernel module (``triton_kernels.py``), imported at first use (``ImportError`` without triton)."""
    from . import triton_kernels

    return triton_kernels


def block_form(q, k_hat, v, codes, codebook, table, positions_k, L, scope, state, scale):
    """``block.block_form`` on the kernels. q ``[B, H, T, Dk]`` (unscaled), k_hat, v, codebook in
    q's dtype; table ``[h, g, L + 1]`` and positions_k ``[h, g, L + 1, Dk]`` (float32, each
    may be None); returns (out ``[B, Hkv, G, T, Dv]``, the pieces of the final state)."""
    B, H, T, D = q.shape
    Hkv, E, S = k_hat.shape[1], v.shape[-1], codebook.shape[1]
    G = H // Hkv
    io, acc = q.dtype, torch.float32
    cut = scope == "state"
    # The stream continues the state's partial block; queries exist only for new positions.
    k, v_all, codes_all, p = k_hat, v, codes, 0
    if state is not None:
        p = state.partial_keys.shape[2]
        k = torch.cat([state.partial_keys.to(io), k_hat], dim=2)
        v_all = torch.cat([state.partial_values.to(io), v], dim=2)
        codes_all = torch.cat([state.partial_codes.to(codes.dtype), codes], dim=2)
    P = p + T
    R = -(-P // L)
    N, pad = R * L, R * L - P
    has_prev = state is not None and state.prev_keys is not None
    if has_prev:
        first = (detached_if(state.prev_keys, cut).to(io), detached_if(state.prev_values, cut).to(io), state.prev_codes)
    else:
        first = (k.new_zeros(B, Hkv, L, D), v.new_zeros(B, Hkv, L, E), codes.new_zeros(B, Hkv, L, *codes.shape[3:]))
    k_ext = F.pad(torch.cat([first[0], k], dim=2), (0, 0, 0, pad))  # [B, Hkv, N + L, D]
    v_ext = F.pad(torch.cat([first[1], v_all], dim=2), (0, 0, 0, pad))
    codes_ext = torch.cat([first[2].to(codes.dtype), codes_all], dim=2)
    codes_ext = F.pad(codes_ext, (0, 0, 0, pad)) if codes.is_floating_point() else F.pad(codes_ext, (0, pad))
    q_blocks = F.pad(q.reshape(B, Hkv, G, T, D), (0, 0, p, pad))  # [B, Hkv, G, N, D]

    if state is not None:
        run_counts = detached_if(state.cache_counts.to(acc), cut)
        run = (run_counts, detached_if(state.cache_means.to(acc), cut) * run_counts.unsqueeze(-1))
    else:
        run = (q.new_zeros(B, Hkv, S, dtype=acc), q.new_zeros(B, Hkv, S, E, dtype=acc))
    full_blocks = P // L
    prev_codes = codes_ext[:, :, :N].reshape(B, Hkv, R, L, *codes.shape[3:])  # block r's previous block
    prev_v = v_ext[:, :, :N].to(acc).reshape(B, Hkv, R, L, E)
    logn, means, final_cache = block_caches(prev_codes, prev_v, run, has_prev, full_blocks, scope, S)
    rel = _relative_terms(q_blocks, table, positions_k, scale)

    o = _FusedBlocks.apply(q_blocks, k_ext, v_ext, codebook, logn, means, rel, scale, L, has_prev, not cut)
    out = o[:, :, :, p : p + T]

    stream = (k_ext[:, :, L:], v_ext[:, :, L:], codes_ext[:, :, L:])
    start = full_blocks * L
    if full_blocks >= 1:
        prev = tuple(x[:, :, start - L : start] for x in stream)
        prev = owned(prev[0].to(acc), prev[1].to(acc), prev[2])
    elif has_prev:
        prev = (state.prev_keys, state.prev_values, state.prev_codes)
    else:
        prev = (None, None, None)
    pieces = {
        "partial": owned(stream[0][:, :, start:P].to(acc), stream[1][:, :, start:P].to(acc), stream[2][:, :, start:P]),
        "prev": prev,
        "cache": (final_cache[0], mean_values(final_cache[1], final_cache[0])),
    }
    return out, pieces


def _relative_terms(q_blocks, table, positions_k, scale):
    """``b_delta + scale q_i.P_delta`` per row and offset 0..L, ``[B, Hkv, G, N, L + 1]``
    float32 (a broadcast view of the table without position keys), or None."""
    rel = None
    if positions_k is not None:
        rel = (q_blocks.to(torch.float32) * scale) @ positions_k.transpose(-1, -2)
    if table is not None:
        rel = table.unsqueeze(-2) if rel is None else rel + table.unsqueeze(-2)
    if rel is None:
        return None
    B, Hkv, G, N = q_blocks.shape[:4]
    return rel.expand(B, Hkv, G, N, rel.shape[-1])


class _FusedBlocks(torch.autograd.Function):
    """Every block's softmax over (previous block, own block, cache) on the kernels.

    q ``[B, Hkv, G, N, D]``, k ``[B, Hkv, N + L, D]``, v ``[B, Hkv, N + L, E]``, codebook
    ``[Hkv, S, D]``, logn ``[B, Hkv, R, S]``, means ``[B, Hkv, R, S, E]``, rel
    ``[B, Hkv, G, N, L + 1]`` or None -> out ``[B, Hkv, G, N, E]`` in q's dtype.
    ``prev_grad=False`` (grad_scope "state"): no gradient from a block to its previous block.
    """

    @staticmethod
    def forward(ctx, q, k, v, codebook, logn, means, rel, scale, L, has_prev, prev_grad):
        kernel_module = kernels()
        q, k, v, codebook = (x.contiguous() for x in (q, k, v, codebook))
        logn, means = logn.contiguous(), means.contiguous()
        out, lse = kernel_module.forward(q, k, v, codebook, logn, means, rel, scale, L, has_prev)
        ctx.save_for_backward(q, k, v, codebook, logn, means, rel, out, lse)
        ctx.options = (scale, L, has_prev, prev_grad)
        return out

    @staticmethod
    def backward(ctx, d_out):
        kernel_module = kernels()
        q, k, v, codebook, logn, means, rel, out, lse = ctx.saved_tensors
        scale, L, has_prev, prev_grad = ctx.options
        needs = ctx.needs_input_grad
        d_out = d_out.contiguous()
        # delta_i = do_i.o_i: the softmax backward's row term, dS = P (dP - delta)
        delta = (d_out.to(torch.float32) * out.to(torch.float32)).sum(-1)
        saved = (q, k, v, codebook, logn, means, rel, d_out, lse, delta)
        dq = dk = dv = d_codebook = d_logn = d_means = d_rel = None
        if needs[0] or needs[6]:
            dq, d_rel = kernel_module.query_grads(*saved, scale, L, has_prev, rel_grad=needs[6])
            dq = dq.to(q.dtype)
        if needs[1] or needs[2]:
            dk, dv = kernel_module.window_key_grads(*saved, scale, L, has_prev, prev_grad)
            dk, dv = dk.to(k.dtype), dv.to(v.dtype)
        if needs[3] or needs[4] or needs[5]:
            d_codebook, d_logn, d_means = kernel_module.cache_grads(*saved, scale, L, means_grad=needs[4] or needs[5])
            d_codebook = d_codebook.to(codebook.dtype)
        return dq, dk, dv, d_codebook, d_logn, d_means, d_rel, None, None, None, None
