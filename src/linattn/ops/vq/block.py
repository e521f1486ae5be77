"""Transformer-VQ's linear-time block form (``mode="block"``): the stream laid out in blocks of
L, the carried state in front, and the loop schedule (one block after another, the readable
form); the batched schedules are in ``batched.py`` and ``running.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.bias import add_window_band, window_position_keys
from . import native_block
from .batched import all_blocks
from .cache import entering, log_counts, mean_values
from .relative import offset_bias
from .rerope import WindowReRoPE
from .tensors import detached_if, owned, shared_matrix


def block_form(q, k, v, codes, codebook, table, positions_k, L, scope, state, dtype, schedule="loop", rerope=None,
               scale=1.0):
    """Linear-time causal form. q ``[B, Hkv, G, T, D]`` (scaled; the native schedule scales it by
    ``scale`` itself); returns (out, pieces of the final state).
    ``schedule``: ``"loop"`` (one block after another), ``"batched"`` (all blocks at once, in groups) or
    ``"native"`` (the native kernels, ``native_block.py``: hard codes, no ReRoPE, grad_scope "cache" or "state").
    ``rerope``: ``(w, rotary_base)`` with ``w <= L``, or None (``rerope.py``)."""
    B, Hkv, G, T, D = q.shape
    E, S = v.shape[-1], codebook.shape[1]
    # The stream continues the state's partial block; queries exist only for new positions.
    if state is not None:
        p = state.partial_keys.shape[2]
        k = torch.cat([state.partial_keys.to(dtype), k], dim=2)
        v = torch.cat([state.partial_values.to(dtype), v], dim=2)
        codes = torch.cat([state.partial_codes, codes], dim=2)
        q = F.pad(q, (0, 0, p, 0))
    else:
        p = 0
    P = p + T
    R = -(-P // L)
    pad = R * L - P
    if pad:
        q, k, v = F.pad(q, (0, 0, 0, pad)), F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        codes = F.pad(codes, (0, 0, 0, pad)) if codes.is_floating_point() else F.pad(codes, (0, pad))
    k_blocks = k.reshape(B, Hkv, R, L, D)
    # one copy of a strided v (a GAU's view of its projection) costs less than reading it strided
    v_blocks = v.contiguous().reshape(B, Hkv, R, L, E)
    code_blocks = codes.reshape(B, Hkv, R, L, *codes.shape[3:])
    q_blocks = q.reshape(B, Hkv, G, R, L, D)

    has_prev = state is not None and state.prev_keys is not None
    cut = scope == "state"  # nothing from an earlier block carries a gradient
    if has_prev:
        first_prev = (state.prev_keys.to(dtype), state.prev_values.to(dtype), state.prev_codes)
    else:
        first_prev = (
            k.new_zeros(B, Hkv, L, D), v.new_zeros(B, Hkv, L, E), codes.new_zeros(B, Hkv, L, *codes.shape[3:])
        )
    # Block r's previous block: the state's (or zeros) for r = 0, else block r - 1.
    prev_codes = torch.cat([first_prev[2].unsqueeze(2), code_blocks[:, :, :-1]], dim=2)

    if state is not None:
        run_counts = detached_if(state.cache_counts.to(dtype), cut)
        run_sums = detached_if(state.cache_means.to(dtype), cut) * run_counts.unsqueeze(-1)
    else:
        run_counts, run_sums = q.new_zeros(B, Hkv, S), q.new_zeros(B, Hkv, S, E)

    # Columns of a block's window: the previous block (j = 0..L-1), then its own (L..2L-1);
    # offset i - j = L + a - c for query row a and window column c.
    rows = torch.arange(L, device=q.device)
    offsets = L + rows[:, None] - torch.arange(2 * L, device=q.device)[None, :]
    window = torch.zeros(L, 2 * L, dtype=dtype, device=q.device).masked_fill(offsets < 0, float("-inf"))
    if table is not None:
        window = window + offset_bias(table, L, L, 2 * L, L)
    # q . P over a block's window: one matmul with keys laid out for add_window_band, [(Hkv|1, G|1,) 2L, D]
    band_keys = None if positions_k is None else shared_matrix(window_position_keys(positions_k))

    full_blocks = P // L  # the cache after the call is the one block `full_blocks` would use
    blocks = (q_blocks, k_blocks, v_blocks, first_prev[0], first_prev[1], prev_codes)
    run = (run_counts, run_sums)
    rotations = None if rerope is None else WindowReRoPE(*rerope, L, D, q.device, dtype)
    if schedule == "native":
        outs, final_cache = native_block.running_blocks(blocks, codebook, window, positions_k, run, has_prev,
                                                        full_blocks, scale, prev_grad=not cut)
    elif schedule == "batched":
        outs, final_cache = all_blocks(blocks, codebook, window, band_keys, run, has_prev, full_blocks, scope, S,
                                       rotations)
    else:
        outs, final_cache = _block_loop(blocks, codebook, window, band_keys, run, has_prev, full_blocks, scope, S,
                                        rotations)
    out = outs.reshape(B, Hkv, G, R * L, E)[:, :, :, p : p + T]

    start = full_blocks * L
    new_state = {
        "partial": owned(k[:, :, start:P], v[:, :, start:P], codes[:, :, start:P]),
        "prev": (
            owned(k_blocks[:, :, full_blocks - 1], v_blocks[:, :, full_blocks - 1], code_blocks[:, :, full_blocks - 1])
            if full_blocks >= 1
            else ((state.prev_keys, state.prev_values, state.prev_codes) if has_prev else (None, None, None))
        ),
        "cache": (final_cache[0], mean_values(final_cache[1], final_cache[0])),
    }
    return out, new_state


def _block_loop(blocks, codebook, window, band_keys, run, has_prev, full_blocks, scope, S, rerope=None):
    """The blocks one after another, the cache carried from each to the next (``rerope``: a
    ``WindowReRoPE`` or None). Returns (outputs ``[B, Hkv, G, R, L, E]``, (counts, sums) of the
    cache before block ``full_blocks``)."""
    q_blocks, k_blocks, v_blocks, first_prev_k, first_prev_v, prev_codes = blocks
    B, L, cut = k_blocks.shape[0], k_blocks.shape[3], scope == "state"
    run_counts, run_sums = run
    codebook_keys = codebook.unsqueeze(0).expand(B, -1, -1, -1)
    outs, final_cache = [], None
    k_each, v_each = k_blocks.unbind(2), v_blocks.unbind(2)
    prev_k_each, prev_v_each = (first_prev_k, *k_each[:-1]), (first_prev_v, *v_each[:-1])
    each = zip(q_blocks.unbind(3), k_each, v_each, prev_k_each, prev_v_each, prev_codes.unbind(2))
    for r, (q_r, k_r, v_r, prev_k_r, prev_v_r, prev_codes_r) in enumerate(each):
        if r == full_blocks:
            final_cache = (run_counts, run_sums)
        with_prev = r > 0 or has_prev
        # One softmax over (previous block, own block, S cache slots): keys [prev; own; C].
        keys = torch.cat([detached_if(prev_k_r, cut), k_r, codebook_keys], dim=-2)
        values = torch.cat([detached_if(prev_v_r, cut), v_r, mean_values(run_sums, run_counts)], dim=-2)
        if rerope is None:
            scores = q_r @ keys.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, L, 2L + S]
        else:
            scores = rerope.block_scores(q_r, keys.unsqueeze(2))
        scores[..., : 2 * L] += window
        if not with_prev:  # the first block has no previous block
            scores[..., :L].fill_(float("-inf"))
        if band_keys is not None:
            add_window_band(scores, q_r @ band_keys.transpose(-1, -2))
        scores[..., 2 * L :] += log_counts(run_counts)[:, :, None, None, :]
        outs.append(torch.softmax(scores, dim=-1) @ values.unsqueeze(2))
        if with_prev:
            # Block r's previous block is two blocks behind block r + 1: it enters the cache.
            counts, sums = entering(prev_codes_r.unsqueeze(2), prev_v_r.unsqueeze(2), scope, S)
            run_counts, run_sums = run_counts + counts.squeeze(2), run_sums + sums.squeeze(2)
    if final_cache is None:
        final_cache = (run_counts, run_sums)
    return torch.stack(outs, dim=3), final_cache
