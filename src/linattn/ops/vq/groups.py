"""Blocks in groups for the batched schedules: every block's window as a view, a row's blocks
cut into groups, and a group's scores over its windows and the codebook.
"""

from __future__ import annotations

import torch

from ..common.bias import add_window_band
from .cache import log_counts
from .tensors import detached_if, per_block


def block_windows(first: torch.Tensor, blocks: torch.Tensor, cut: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's window, its previous block then its own, from ``blocks [B, Hkv, R, L, X]``
    and ``first [B, Hkv, L, X]`` (block 0's previous block): block 0's ``[B, Hkv, 1, 2L, X]``
    and those of blocks 1..R-1 ``[B, Hkv, R - 1, 2L, X]``, a view of overlapping windows of
    ``blocks`` (no copy); with ``cut``, previous halves detached (a copy)."""
    B, Hkv, R, L, X = blocks.shape
    head = torch.cat([detached_if(first, cut).unsqueeze(2), blocks[:, :, :1]], dim=-2)
    if cut:
        return head, torch.cat([blocks[:, :, :-1].detach(), blocks[:, :, 1:]], dim=-2)
    if R == 1:
        return head, blocks.new_empty(B, Hkv, 0, 2 * L, X)
    return head, blocks.flatten(2, 3).unfold(2, 2 * L, L).transpose(-1, -2)


def row_scoring(codebook, window, band_keys, rerope=None):
    """What scores a row's blocks (``group_scores``' ``scoring``) from its kv head's codebook
    ``[1, S, D]``, window ``[(1, G|1,) L, 2L]`` and position keys: the window with a dimension
    for the blocks, the codebook as one matrix ``[D, S]`` (the matmul folds the rows), the
    position keys transposed and ReRoPE's rotations (a ``WindowReRoPE``, or None)."""
    band_keys_t = None if band_keys is None else per_block(band_keys).transpose(-1, -2)  # [(1, G|1, 1,) D, 2L]
    return window.unsqueeze(-3), band_keys_t, codebook[0].transpose(-1, -2), rerope


def row_groups(blocks, windows, group):
    """A row's blocks (``B = Hkv = 1``) in groups, each ``(first block, queries [1, 1, G, g, L, D],
    window keys [1, 1, g, 2L, D], window values [1, 1, g, 2L, E], previous blocks' codes
    [1, 1, g, L(, S)], previous blocks' values [1, 1, g, L, E])``: block 0 alone (its window
    is the only copy), then ``group`` blocks at a time."""
    q_blocks, _, v_blocks, _, first_prev_v, prev_codes = blocks
    R = q_blocks.shape[3]
    # split, not sliced: the backward of a split is one concatenation, that of each slice a
    # zero-filled gradient of the whole tensor
    q_first, q_rest = q_blocks.split([1, R - 1], dim=3)
    codes_first, codes_rest = prev_codes.split([1, R - 1], dim=2)
    pieces = [(0, q_first, windows[0], windows[2], codes_first, first_prev_v.unsqueeze(2))]
    pieces += zip(range(1, R, group), q_rest.split(group, dim=3), windows[1].split(group, dim=2),
                  windows[3].split(group, dim=2), codes_rest.split(group, dim=2),
                  v_blocks[:, :, : R - 1].split(group, dim=2))  # block r's previous block is block r - 1
    return pieces


def group_scores(q_g, keys_g, scoring, counts, first_without_prev: bool):
    """A group's scores: queries ``[B, Hkv, G, g, L, D]`` over their windows ``[B, Hkv, g, 2L, D]``
    with the window's bias and the position band (``scoring`` = window ``[.., 1, L, 2L]``,
    position keys transposed or None, codebook ``[D, S]``, ReRoPE's rotations or None), and over
    the codes with ``log n_s`` of the caches ``counts [B, Hkv, g, S]``. ``first_without_prev``:
    the group's first block has no previous block (its first L columns get -inf)."""
    window, band_keys_t, codebook_t, rerope = scoring
    L = q_g.shape[-2]
    if rerope is None:
        scores_w = q_g @ keys_g.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, g, L, 2L]
        scores_c = q_g @ codebook_t
    else:
        far_q = rerope.far_queries(q_g)
        scores_w = rerope.window_scores(q_g, keys_g.unsqueeze(2), far_q)
        scores_c = far_q @ codebook_t
    scores_w += window
    if first_without_prev:
        scores_w[:, :, :, 0, :, :L].fill_(float("-inf"))
    if band_keys_t is not None:
        add_window_band(scores_w, q_g @ band_keys_t)
    scores_c += log_counts(counts)[:, :, None, :, None, :]
    return scores_w, scores_c


def probabilities(scores_w: torch.Tensor, scores_c: torch.Tensor) -> torch.Tensor:
    """One softmax over a group's window scores ``[..., 2L]`` and cache scores ``[..., S]``:
    ``[..., 2L + S]`` (the concatenation costs less than normalising the two parts in place:
    ``exp`` of the masked ``-inf`` entries is slow outside the softmax kernel on a CPU)."""
    return torch.softmax(torch.cat([scores_w, scores_c], dim=-1), dim=-1)
