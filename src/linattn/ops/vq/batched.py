"""The batched schedule of the block form: groups of blocks as batched matmuls, each block's
cache from a prefix sum over the group's blocks, carried from group to group.
"""

from __future__ import annotations

import torch

from .cache import add_code_statistics, log_counts, mean_values, nonzero_counts, scoped
from .groups import block_windows, group_scores, probabilities, row_groups, row_scoring
from .running import running_blocks
from . import schedule
from .tensors import from_row_views, kv_head, owned, row_views


def group_caches(prev_codes, prev_v, run, skip_first, scope, S):
    """The caches a group of blocks reads, by a prefix sum over its blocks: block r's previous
    block (codes ``[B, Hkv, g, L(, S)]``, values ``[B, Hkv, g, L, E]``) enters the cache after
    block r, on top of ``run = (counts, sums)``, the cache before the group's first block
    (``skip_first``: that block has no previous block). Returns the running (counts
    ``[B, Hkv, g + 1, S]``, sums ``[B, Hkv, g + 1, S, E]``): index r is the cache before block r,
    index g the cache after the group. One buffer each: the carried cache, the blocks'
    statistics added in place after it, then summed block by block in place (the loop's
    order of additions: the carried cache, then block by block)."""
    B, Hkv, g = prev_v.shape[:3]
    counts = prev_v.new_zeros(B, Hkv, g + 1, S)
    sums = prev_v.new_zeros(B, Hkv, g + 1, S, prev_v.shape[-1])
    counts[:, :, 0], sums[:, :, 0] = run
    first = 1 if skip_first else 0
    add_code_statistics(counts[:, :, first + 1 :], sums[:, :, first + 1 :], prev_codes[:, :, first:],
                        scoped(prev_v[:, :, first:], scope), detach_counts=scope != "none")
    for each in (counts, sums):  # in-place adds: torch's cumsum over a leading dimension is several times slower
        # one unbind makes every block's view at once; autograd lets only indexed views be written
        blocks = [each[:, :, r] for r in range(g + 1)] if torch.is_grad_enabled() else each.unbind(2)
        for r in range(1, g + 1):
            blocks[r].add_(blocks[r - 1])
    return counts, sums


def block_caches(prev_codes, prev_v, run, has_prev, full_blocks, scope, S):
    """The cache every block of the call reads (``group_caches`` over all R blocks). Returns
    log counts ``[B, Hkv, R, S]``, means ``[B, Hkv, R, S, E]`` and the (counts, sums) before
    block ``full_blocks``."""
    R = prev_v.shape[2]
    run_counts, run_sums = group_caches(prev_codes, prev_v, run, not has_prev, scope, S)
    final_cache = owned(run_counts[:, :, full_blocks], run_sums[:, :, full_blocks])
    run_counts, run_sums = run_counts[:, :, :R], run_sums[:, :, :R]
    return log_counts(run_counts), mean_values(run_sums, run_counts), final_cache


def all_blocks(blocks, codebook, window, band_keys, run, has_prev, full_blocks, scope, S, rerope=None):
    """The blocks in groups (``_block_loop``'s arguments and results), one (batch, kv head)
    row at a time: a row's blocks are one batch dimension of a single stride, so the batched
    matmuls read the window views (``block_windows``) in place (over several rows they would copy
    them). Without gradients every group writes its outputs into one buffer, and with hard
    codes the cache terms of all rows are one running product per block
    (``running_blocks``). ``rerope``: a ``WindowReRoPE`` or None."""
    q_blocks, k_blocks, v_blocks, first_prev_k, first_prev_v, prev_codes = blocks
    B, Hkv, G, R, L, _ = q_blocks.shape
    cut = scope == "state"
    windows = (*block_windows(first_prev_k, k_blocks, cut), *block_windows(first_prev_v, v_blocks, cut))
    out = None if torch.is_grad_enabled() else q_blocks.new_empty(B, Hkv, G, R, L, v_blocks.shape[-1])
    if out is not None and not prev_codes.is_floating_point():
        return running_blocks(blocks, windows, codebook, window, band_keys, run, has_prev, full_blocks, S, out, rerope)
    if B * Hkv == 1:
        return _row_blocks(blocks, windows, codebook, window, band_keys, run, has_prev, full_blocks, scope, S, out,
                           rerope)
    rows = [row_views(t) for t in (*blocks, *windows, *run)]  # per tensor: its B * Hkv rows, views
    out_rows = [None] * (B * Hkv) if out is None else row_views(out)
    outs, counts, sums = [], [], []
    for i, row in enumerate(zip(*rows)):
        h = i % Hkv
        o, (c, s) = _row_blocks(row[:6], row[6:10], codebook[h : h + 1], kv_head(window, h), kv_head(band_keys, h),
                                row[10:], has_prev, full_blocks, scope, S, out_rows[i], rerope)
        outs.append(o), counts.append(c), sums.append(s)
    final_cache = (from_row_views(counts, B, Hkv), from_row_views(sums, B, Hkv))
    return (from_row_views(outs, B, Hkv) if out is None else out), final_cache


def _row_blocks(blocks, windows, codebook, window, band_keys, run, has_prev, full_blocks, scope, S, out=None,
                rerope=None):
    """``all_blocks`` for one row (``B = Hkv = 1``, codebook ``[1, S, D]``; ``windows``: block 0's
    and the other blocks' window keys, then the same for values, ``block_windows``) in groups
    (``row_groups``). Within a group the cache each block reads is the carried cache plus the
    statistics of the group's blocks that entered before it, a prefix sum; scores and outputs
    are batched matmuls over the group's blocks. A group holds at most ``BATCHED_SCORES[device]``
    score entries (``blocks_per_group``). ``out``: the row's output buffer ``[1, 1, G, R, L, E]``
    (without gradients), else the outputs are concatenated."""
    q_blocks = blocks[0]
    B, Hkv, G, R, L, D = q_blocks.shape
    scoring = row_scoring(codebook, window, band_keys, rerope)
    group = schedule.blocks_per_group(q_blocks.device, B * Hkv * G * L * (2 * L + S))
    outs, final_cache = [], None
    for start, q_g, keys_g, values_g, prev_codes_g, prev_v_g in row_groups(blocks, windows, group):
        g = q_g.shape[3]
        counts, sums = group_caches(prev_codes_g, prev_v_g, run, start == 0 and not has_prev, scope, S)
        if start <= full_blocks < start + g:
            final_cache = owned(counts[:, :, full_blocks - start], sums[:, :, full_blocks - start])
        run = (counts[:, :, -1], sums[:, :, -1])
        counts, sums = counts[:, :, :-1], sums[:, :, :-1]
        scores_w, scores_c = group_scores(q_g, keys_g, scoring, counts, start == 0 and not has_prev)
        group_out = None if out is None else out[:, :, :, start : start + g]
        outs.append(_attend_window_and_cache(scores_w, scores_c, values_g.unsqueeze(2), counts, sums, group_out))
    return (torch.cat(outs, dim=3) if out is None else out), (final_cache if final_cache is not None else owned(*run))


def _attend_window_and_cache(scores_w, scores_c, values, counts, sums, out=None):
    """``probabilities`` applied to a group's window values ``[B, Hkv, 1, g, 2L, E]`` and cache
    means: ``sum_s p_s m_s = sum_s (p_s / n_s) sums_s`` (the division on the ``[L, S]``
    weights, not the ``[S, E]`` sums; counts ``[B, Hkv, g, S]``, sums ``[B, Hkv, g, S, E]``).
    ``out``: where to write the result (without gradients), else a new tensor."""
    two_l = scores_w.shape[-1]
    probs = probabilities(scores_w, scores_c)
    result = torch.matmul(probs[..., :two_l], values, out=out)
    per_count = nonzero_counts(counts)[:, :, None, :, None, :]
    result += (probs[..., two_l:] / per_count) @ sums[:, :, None]
    return result
