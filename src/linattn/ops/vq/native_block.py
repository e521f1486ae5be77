"""The block form by the native kernels (``_native/vq_block_forward.cpp`` and, with gradients,
``_native/vq_block_backward.cpp``, built by ``native.py``): ``running.running_blocks``'
computation for hard codes without ReRoPE, one C++ call for the whole call and one for its
backward (``native_block_check.py`` decides when it runs).

Gradients (grad_scope ``"cache"`` and ``"state"``): the queries, the window's keys and values
(block 0's previous block included: the carried state's), the codebook through the cache's
logits, the window's bias (so a bias table) and the position keys. The cache (counts and
sums, carried or built) takes none: those scopes build it from detached values, and a carried
cache that requires gradients is refused before the call (``native_block_check``).
"""

from __future__ import annotations

import torch

from ..common import native

SEGMENT_BLOCKS = 32
"""Blocks per task of the kernels: a row (one sequence's kv head) is cut into segments of this
many blocks, each computed by one thread from the cache at its start. Fixed, not taken from the
thread count, so results do not depend on it; small enough that one sequence with one kv head
(a GAU) at 16k (256 blocks of 64) keeps two threads busy."""


def window_matrix(window: torch.Tensor) -> torch.Tensor:
    """The window's bias ``[L, 2L]`` or ``[Hkv|1, G|1, L, 2L]`` as the kernel reads it, 4-D and contiguous."""
    if window.dim() == 2:
        window = window.view(1, 1, *window.shape)
    if window.dim() != 4:
        raise ValueError(f"the block form's window must be [L, 2L] or [Hkv|1, G|1, L, 2L], got {list(window.shape)}")
    return window.contiguous()


def running_blocks(blocks, codebook, window, position_keys, run, has_prev: bool, full_blocks: int,
                   scale: float = 1.0, prev_grad: bool = True):
    """The outputs of every block ``[B, Hkv, G, R, L, E]`` and the cache before block
    ``full_blocks`` (counts ``[B, Hkv, S]``, sums ``[B, Hkv, S, E]``), as ``block._block_loop``
    returns them: ``blocks`` = (queries ``[B, Hkv, G, R, L, D]``, keys ``[B, Hkv, R, L, D]``,
    values ``[B, Hkv, R, L, E]``, block 0's previous keys ``[B, Hkv, L, D]`` and values
    ``[B, Hkv, L, E]``, each block's previous codes ``[B, Hkv, R, L]``), the codebook
    ``[Hkv, S, D]``, the window's bias, the position keys ``[Hkv|1, G|1, L + 1, D]`` (``P_delta``
    for offsets delta = 0..L, or None), ``run`` = (counts, sums) of the cache before block 0;
    ``scale`` multiplies the products of the queries, which come unscaled. With gradients
    enabled the outputs are differentiable (module docstring); ``prev_grad=False``
    (grad_scope ``"state"``) sends no gradient from a block to its previous block."""
    q_blocks, k_blocks, v_blocks, first_k, first_v, prev_codes = blocks
    window = window_matrix(window).to(q_blocks.dtype)
    position_keys = _keys(position_keys)
    counts, sums = _kernel_inputs(*run)
    if torch.is_grad_enabled():
        out, final_counts, final_sums = _NativeBlocks.apply(q_blocks, k_blocks, v_blocks, first_k, first_v, codebook,
                                                            window, position_keys, prev_codes, counts, sums,
                                                            has_prev, full_blocks, float(scale), prev_grad)
        return out, (final_counts, final_sums)
    out, final_counts, final_sums, _ = _forward(q_blocks, k_blocks, v_blocks, first_k, first_v, codebook, window,
                                                position_keys, prev_codes, counts, sums, has_prev, full_blocks,
                                                float(scale), keep_lse=False)
    return out, (final_counts, final_sums)


def _forward(q, k, v, first_k, first_v, codebook, window, position_keys, prev_codes, counts, sums, has_prev,
             full_blocks, scale, keep_lse):
    """One call of the forward kernel: (out, final counts, final sums,
    row log-sum-exp ``[B, Hkv, G, R, L]`` or None)."""
    q, k, v, first_k, first_v, codebook, prev_codes, window, position_keys = _kernel_inputs(
        q, k, v, first_k, first_v, codebook, prev_codes, window, position_keys)
    B, Hkv, G, R, L, _ = q.shape
    out = q.new_empty(B, Hkv, G, R, L, v.shape[-1])
    final_counts, final_sums = torch.empty_like(counts), torch.empty_like(sums)
    lse = q.new_empty(B, Hkv, G, R, L) if keep_lse else None
    native.extension().vq_block_forward(q, k, v, prev_codes, codebook, window, position_keys, first_k, first_v,
                                        has_prev, counts, sums, full_blocks, scale, out, final_counts, final_sums,
                                        lse, SEGMENT_BLOCKS)
    return out, final_counts, final_sums, lse


class _NativeBlocks(torch.autograd.Function):
    """``running_blocks`` with gradients: the forward kernel keeps each row's log-sum-exp, the
    backward kernel recomputes every block's softmax from it (``vq_block_backward.cpp``)."""

    @staticmethod
    def forward(ctx, q, k, v, first_k, first_v, codebook, window, position_keys, prev_codes, counts, sums, has_prev,
                full_blocks, scale, prev_grad):
        out, final_counts, final_sums, lse = _forward(q, k, v, first_k, first_v, codebook, window, position_keys,
                                                      prev_codes, counts, sums, has_prev, full_blocks, scale,
                                                      keep_lse=True)
        ctx.save_for_backward(q, k, v, first_k, first_v, codebook, window, position_keys, prev_codes, counts, sums,
                              out, lse)
        ctx.options = (has_prev, scale, prev_grad)
        ctx.segment_blocks = SEGMENT_BLOCKS  # the forward's tasks
        ctx.mark_non_differentiable(final_counts, final_sums)
        return out, final_counts, final_sums

    @staticmethod
    def backward(ctx, d_out, _d_counts, _d_sums):
        q, k, v, first_k, first_v, codebook, window, position_keys, prev_codes, counts, sums, out, lse = (
            ctx.saved_tensors)
        has_prev, scale, prev_grad = ctx.options
        needs = ctx.needs_input_grad
        q, k, v, first_k, first_v, codebook, prev_codes, window, position_keys = _kernel_inputs(
            q, k, v, first_k, first_v, codebook, prev_codes, window, position_keys)
        B, Hkv, G, R, L, _ = q.shape
        dq = torch.empty_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        d_first_k, d_first_v = torch.zeros_like(first_k), torch.zeros_like(first_v)
        d_codebook = q.new_zeros(B, *codebook.shape) if needs[5] else None
        d_window = q.new_zeros(B, Hkv, window.shape[1], L, 2 * L) if needs[6] else None
        d_keys = None
        if position_keys is not None and needs[7]:
            d_keys = q.new_zeros(B, Hkv, position_keys.shape[1], L + 1, q.shape[-1])
        native.extension().vq_block_backward(q, k, v, prev_codes, codebook, window, position_keys, first_k, first_v,
                                             has_prev, counts, sums, scale, out, d_out.contiguous(), lse, prev_grad,
                                             dq, dk, dv, d_first_k, d_first_v, d_codebook, d_window, d_keys,
                                             ctx.segment_blocks)
        # per-row partial sums, added in a fixed order: the same bits at any thread count
        if d_codebook is not None:
            d_codebook = d_codebook.sum(0)
        if d_window is not None:
            d_window = d_window.sum(0).sum(0, keepdim=True) if window.shape[0] == 1 else d_window.sum(0)
        if d_keys is not None:
            d_keys = d_keys.sum(0).sum(0, keepdim=True) if position_keys.shape[0] == 1 else d_keys.sum(0)
        prev = prev_grad and has_prev
        return (dq, dk, dv, d_first_k if needs[3] and prev else None, d_first_v if needs[4] and prev else None,
                d_codebook, d_window,
                d_keys, None, None, None, None, None, None, None)


def _kernel_inputs(*tensors):
    """The tensors as the kernels read them: detached (their products run on the intra-op
    threads, where autograd is not turned off) and contiguous; None stays None."""
    return tuple(None if t is None else t.detach().contiguous() for t in tensors)


def _keys(position_keys: torch.Tensor | None) -> torch.Tensor | None:
    """The position keys 4-D and contiguous (or None)."""
    if position_keys is None:
        return None
    if position_keys.dim() != 4:
        raise ValueError(f"the position keys must be [Hkv|1, G|1, L + 1, D], got {list(position_keys.shape)}")
    return position_keys.contiguous()
