"""The batched schedule without gradients for hard codes: one running cache for all rows of
the call, updated in place block by block.
"""

from __future__ import annotations

import torch

from .cache import nonzero_counts
from .groups import group_scores, probabilities, row_groups, row_scoring
from . import schedule
from .tensors import kv_head, row_views


def running_blocks(blocks, windows, codebook, window, band_keys, run, has_prev, full_blocks, S, out, rerope=None):
    """``all_blocks`` without gradients for hard codes. Scores and window outputs are
    computed per row in groups (``row_groups``, as ``_row_blocks``); the cache term is not:
    the cache sums of a set of rows are one ``[n, S, E]`` tensor, updated in place block by
    block (block r's cache term is a batched matmul with it, for all n rows, before block r's
    previous block enters by one ``index_add_`` into its ``[n S, E]`` view), never copied per
    block (the per-block copies of the grouped form are memory traffic that bounds it, and
    per-row products are per-call costs). Rows are taken ``rows_at_once`` at a time. The
    counts are a prefix sum per group, exact (whole numbers). Returns
    ``(out, final cache (counts [B, Hkv, S], sums [B, Hkv, S, E]))``."""
    q_blocks, _, v_blocks, _, first_prev_v, prev_codes = blocks
    B, Hkv, G, R, L, _ = q_blocks.shape
    N, E = B * Hkv, v_blocks.shape[-1]
    group = schedule.blocks_per_group(q_blocks.device, G * L * (2 * L + S))
    at_once = schedule.rows_at_once(q_blocks.device, min(group, R) * G * L * S)
    # all rows' tensors with one row dimension (views: these are fresh contiguous tensors)
    out_all, codes_all = out.view(N, G, R, L, E), prev_codes.reshape(N, R, L)
    values_all, first_values = v_blocks.reshape(N, R, L, E), first_prev_v.reshape(N, 1, L, E)
    views_by_tensor = [row_views(t) for t in (*blocks, *windows)]
    final_counts, final_sums = run[0].reshape(N, S).clone(), run[1].reshape(N, S, E).clone()
    for a in range(0, N, at_once):
        b = min(N, a + at_once)
        n = b - a
        groups = [row_groups(row[:6], row[6:], group) for row in zip(*(views[a:b] for views in views_by_tensor))]
        scorings = [row_scoring(codebook[i % Hkv : i % Hkv + 1], kv_head(window, i % Hkv), kv_head(band_keys, i % Hkv),
                                rerope) for i in range(a, b)]
        counts_now, sums_now = final_counts[a:b].clone(), final_sums[a:b].clone()  # [n, S], [n, S, E]
        sums_flat, offsets = sums_now.view(-1, E), torch.arange(0, n * S, S, device=out.device)[:, None, None]
        product = sums_now.new_empty(n, G * L, E)
        for pieces in zip(*groups):  # one group of blocks, in every row
            start, g = pieces[0][0], pieces[0][1].shape[3]
            entering = (first_values if start == 0 else values_all[:, start - 1 :])[a:b, :g]  # [n, g, L, E]
            counts, after, weights = _running_group(pieces, scorings, codes_all[a:b, start : start + g],
                                                    counts_now, start == 0 and not has_prev, out_all[a:b], S)
            # slots of the n rows' sums as one [n S, E] matrix: each block's entries in one index_add_
            slots = (codes_all[a:b, start : start + g] + offsets).transpose(0, 1).reshape(g, -1)  # [g, n L]
            group_out = out_all[a:b, :, start : start + g]
            if G == 1:  # 3-D views: the products go straight into the output
                group_out, weights = group_out.squeeze(1), weights.squeeze(2)  # [n, g, L, E], [n, g, L, S]
            for r, (block_out, block_weights, block_slots, block_values) in enumerate(
                    zip(group_out.unbind(1 + (G > 1)), weights.unbind(1), slots.unbind(0), entering.unbind(1))):
                if start + r == full_blocks:
                    final_counts[a:b], final_sums[a:b] = counts[:, r], sums_now
                if n == 1 and G == 1:
                    block_out.baddbmm_(block_weights, sums_now)
                else:  # over several rows the outputs are strided (in place, a product per row): one product first
                    block_out += torch.bmm(block_weights.reshape(n, -1, S), sums_now, out=product).view_as(block_out)
                if not (r == 0 and start == 0 and not has_prev):
                    sums_flat.index_add_(0, block_slots, block_values.reshape(-1, E))
            counts_now = after
        if full_blocks >= R:
            final_counts[a:b], final_sums[a:b] = counts_now, sums_now
    return out, (final_counts.view(B, Hkv, S), final_sums.view(B, Hkv, S, E))


def _running_group(pieces, scorings, codes, counts_now, skip_first, out, S):
    """One group of g blocks in n rows for ``running_blocks``: the counts before each block
    ``[n, g, S]`` (the carried counts ``counts_now [n, S]`` plus a prefix sum of the previous
    blocks' ``codes [n, g, L]``; ``skip_first``: block 0 has no previous block), the counts after
    the group ``[n, S]``, and the cache weights ``p_s / n_s`` ``[n, g, G, L, S]`` of one softmax
    per row over window and cache scores; the window outputs go to ``out [n, G, R, L, E]``."""
    n, g, _ = codes.shape
    added = counts_now.new_zeros(n, g, S).scatter_add_(2, codes, torch.ones_like(codes, dtype=counts_now.dtype))
    if skip_first:
        added[:, 0].fill_(0.0)
    after = added.cumsum_(1).add_(counts_now.unsqueeze(1))  # the counts after each block's previous block entered
    counts = torch.cat([counts_now.unsqueeze(1), after[:, :-1]], dim=1)  # [n, g, S]: before each block
    per_count = nonzero_counts(counts).unsqueeze(2)  # [n, g, 1, S]
    G, L = pieces[0][1].shape[2], pieces[0][1].shape[-2]
    weights = None if n == 1 else counts.new_empty(n, g, G, L, S)  # one row: its probabilities, in place
    start = pieces[0][0]
    for i, ((_, q_g, keys_g, values_g, _, _), scoring) in enumerate(zip(pieces, scorings)):
        probs = probabilities(*group_scores(q_g, keys_g, scoring, counts[i][None, None], skip_first))
        two_l = keys_g.shape[-2]
        torch.matmul(probs[..., :two_l], values_g.unsqueeze(2), out=out[i : i + 1, :, start : start + g].unsqueeze(0))
        if weights is None:
            weights = probs[0, :, ..., two_l:].div_(per_count[i]).transpose(1, 2)  # p_s / n_s, [1, g, G, L, S]
        else:
            torch.div(probs[0, 0, ..., two_l:], per_count[i], out=weights[i].transpose(0, 1))
    return counts, after[:, -1], weights
