"""The block form without gradients by the native kernel (``_native/vq_block_forward.cpp``,
built by ``native.py``): ``running.running_blocks``' computation for hard codes without
ReRoPE, one C++ call for the whole call (``native_block_check.py`` decides
when it runs).
"""

from __future__ import annotations

import torch

from . import native


def window_matrix(window: torch.Tensor) -> torch.Tensor:
    """The window's bias ``[L, 2L]`` or ``[Hkv|1, G|1, L, 2L]`` as the kernel reads it, 4-D and contiguous."""
    if window.dim() == 2:
        window = window.view(1, 1, *window.shape)
    if window.dim() != 4:
        raise ValueError(f"the block form's window must be [L, 2L] or [Hkv|1, G|1, L, 2L], got {list(window.shape)}")
    return window.contiguous()


def running_blocks(blocks, codebook, window, position_keys, run, has_prev: bool, full_blocks: int,
                   scale: float = 1.0):
    """The outputs of every block ``[B, Hkv, G, R, L, E]`` and the cache before block
    ``full_blocks`` (counts ``[B, Hkv, S]``, sums ``[B, Hkv, S, E]``), as ``block._block_loop``
    returns them: ``blocks`` = (queries ``[B, Hkv, G, R, L, D]``, keys ``[B, Hkv, R, L, D]``,
    values ``[B, Hkv, R, L, E]``, block 0's previous keys ``[B, Hkv, L, D]`` and values
    ``[B, Hkv, L, E]``, each block's previous codes ``[B, Hkv, R, L]``), the codebook
    ``[Hkv, S, D]``, the window's bias, the position keys ``[Hkv|1, G|1, L + 1, D]`` (``P_delta``
    for offsets delta = 0..L, or None), ``run`` = (counts, sums) of the cache before block 0;
    ``scale`` multiplies the products of the queries, which come unscaled."""
    q_blocks, k_blocks, v_blocks, first_k, first_v, prev_codes = (t.contiguous() for t in blocks)
    B, Hkv, G, R, L, _ = q_blocks.shape
    counts, sums = (t.contiguous() for t in run)
    out = q_blocks.new_empty(B, Hkv, G, R, L, v_blocks.shape[-1])
    final_counts, final_sums = torch.empty_like(counts), torch.empty_like(sums)
    native.extension().vq_block_forward(q_blocks, k_blocks, v_blocks, prev_codes, codebook.contiguous(),
                                        window_matrix(window).to(q_blocks.dtype), _keys(position_keys), first_k,
                                        first_v, has_prev, counts, sums, full_blocks, float(scale), out, final_counts,
                                        final_sums)
    return out, (final_counts, final_sums)


def _keys(position_keys: torch.Tensor | None) -> torch.Tensor | None:
    """The position keys 4-D and contiguous (or None)."""
    if position_keys is None:
        return None
    if position_keys.dim() != 4:
        raise ValueError(f"the position keys must be [Hkv|1, G|1, L + 1, D], got {list(position_keys.shape)}")
    return position_keys.contiguous()
