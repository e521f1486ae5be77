"""Transformer-VQ attention: softmax attention over vector-quantized keys, in linear time.

Every key is a codebook vector, ``k_hat_j = c_{z_j}`` (codebook ``C [Hkv, S, Dk]``,
codes ``z``). The score of query i on key j is ``s_ij = scale q_i.(k_hat_j + P_{i-j}) + b_{i-j}``
with relative terms (a bias table ``b``, position keys ``P``) that are non-zero only for
``0 <= i - j <= L`` (L = block_size).

``mode="parallel"`` (the reference) materialises ``softmax(s) V`` causally.

``mode="block"`` groups positions in blocks of L from the start of the sequence. A query
in block r attends exactly to its own block (causal) and to block r-1 (both with the
bias), and to every older position through a cache: per code s, the count ``n_s`` and
mean value ``m_s`` of the positions in blocks <= r-2 quantized to s. Since all those keys
equal ``c_s`` and carry no bias,

    sum_{j in blocks <= r-2} exp(scale q.k_hat_j) v_j = exp(scale q.c_s + log n_s) m_s   (summed over s)

so one softmax over (own block, previous block, S cache slots) equals the reference exactly
at O(T (2L + S)) cost. ``causal=False``:
``softmax over s of (scale q.c_s + log n_s)`` applied to ``m_s`` (the encoder form
``exp(Q C^T)(Delta^T V)``, normalised).

Gradients (``grad_scope``, the block and decode forms): ``"cache"`` (default) builds the
cache from detached values, so no gradient reaches v through the cache but the exact
window (own and previous block) is differentiated; ``"state"`` is the official code's
training: nothing carried across a block boundary (previous block, cache counts and means)
passes a gradient, only the cache logits reach the codebook and q; ``"none"`` stops
nothing, so the block form's gradients equal the quadratic reference's w.r.t. q, v and
the codebook. The reference form (``mode="parallel"``) is always ``"none"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..state import VQAttentionState
from ._bias import add_window_band, offset_rows, relative_bias_table, window_position_keys
from ._codebook import codebook_scores
from . import _vq_resident as resident
from . import _vq_selfcheck as selfcheck
from . import _vq_triton as fused
from ._vq_cache import add_code_statistics, code_statistics, fold_block, log_counts, mean_values, nonzero_counts
from .._checks import (
    check_bool,
    check_choice,
    check_positive_int,
    check_qkv,
    check_same_dtype_device,
    check_state_setting,
    check_state_tensor,
    check_tensor,
    compute_dtype,
    resolve_scale,
)

_MODES = ("parallel", "block")

GRAD_SCOPES = ("cache", "state", "none")
SCHEDULES = ("auto", "loop", "batched")


def _window_bias(bias, heads: int, kv_heads: int, block_size: int, device, dtype) -> torch.Tensor | None:
    """The bias for offsets 0..L as ``[1 or Hkv, 1 or G, L + 1]`` (grouped head layout)."""
    if bias is None:
        return None
    L = block_size
    if callable(bias) and not isinstance(bias, torch.Tensor):
        table = relative_bias_table(bias, torch.arange(L + 1, device=device), heads, dtype)
    else:
        table = check_tensor("bias", bias)
        if table.dim() == 1:
            table = table.unsqueeze(0)
        if table.dim() != 2 or table.shape[-1] != L + 1 or table.shape[0] not in (1, heads):
            raise ValueError(
                f"bias has shape {list(bias.shape)}, expected [{L + 1}] or [{heads}, {L + 1}] "
                f"(one value per offset 0..block_size)"
            )
        if table.device != device:
            raise ValueError(f"bias is on {table.device} but q is on {device}")
        table = _as(table, dtype)
    if table.shape[0] == heads:
        return table.reshape(kv_heads, heads // kv_heads, L + 1)
    return table.reshape(1, 1, L + 1)


def _offset_bias(table: torch.Tensor, first_offset: int, rows: int, columns: int, L: int) -> torch.Tensor:
    """``b[i - j]`` with ``i - j = first_offset + a - c`` for row a and column c, zero outside
    ``0 <= i - j <= L``: table ``[h, g, L + 1]`` -> ``[h, g, rows, columns]``."""
    return offset_rows(table.unsqueeze(-2), first_offset, rows, columns, 0, L)


def _position_keys(position_keys, heads: int, kv_heads: int, block_size: int, key_dim: int, like):
    """Validate ``position_keys`` ``[L + 1, Dk]`` or ``[H, L + 1, Dk]``; return ``[1|Hkv, 1|G, L + 1, Dk]``."""
    if position_keys is None:
        return None
    P = check_tensor("position_keys", position_keys)
    check_same_dtype_device(q=like, position_keys=P)
    n = block_size + 1
    if P.dim() == 2:
        P = P.unsqueeze(0)
    if P.dim() != 3 or P.shape[0] not in (1, heads) or P.shape[1:] != (n, key_dim):
        raise ValueError(
            f"position_keys has shape {list(position_keys.shape)}, expected [{n}, {key_dim}] "
            f"or [{heads}, {n}, {key_dim}]"
        )
    if P.shape[0] == heads:
        return P.reshape(kv_heads, heads // kv_heads, n, key_dim)
    return P.reshape(1, 1, n, key_dim)


def _relative_inputs(bias, position_keys, heads: int, kv_heads: int, L: int, key_dim: int, q: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(_window_bias, _position_keys)`` of a call, both in ``dtype`` (None where not given)."""
    table = _window_bias(bias, heads, kv_heads, L, q.device, dtype)
    positions_k = _position_keys(position_keys, heads, kv_heads, L, key_dim, q)
    return table, (_as(positions_k, dtype) if positions_k is not None else None)


def _position_scores(q, position_keys, first_offset: int, columns: int, L: int):
    """``q_i . P_{i-j}`` for ``0 <= i - j <= L``, else 0, with ``i - j = first_offset + a - c``:
    q ``[..., r, D]`` -> ``[..., r, columns]``."""
    per_offset = q @ position_keys.transpose(-1, -2)  # [..., r, L + 1]
    return offset_rows(per_offset, first_offset, q.shape[-2], columns, 0, L)


def windowed_softmax(q, k, v, table, positions_k, L, causal, past: int = 0, row_scale=None):
    """Quadratic softmax with the windowed relative terms: the reference, and the GAU's
    softmax twin. Materialised scores; q ``[B, Hkv, G, T, D]`` (scaled) holds positions
    ``past .. past + T - 1``, k ``[B, Hkv, past + T, D]`` and v every position from 0;
    ``row_scale`` ``[T]`` (or None) multiplies each query's logits, relative terms included."""
    return windowed_weights(q, k, table, positions_k, L, causal, past, row_scale) @ v.unsqueeze(2)


def windowed_weights(q, k, table, positions_k, L, causal, past: int = 0, row_scale=None):
    """The attention probabilities of ``windowed_softmax`` ``[B, Hkv, G, T, past + T]``."""
    scores = q @ k.unsqueeze(2).transpose(-1, -2)
    rows = torch.arange(past, past + q.shape[-2], device=q.device)
    offsets = rows[:, None] - torch.arange(k.shape[-2], device=q.device)[None, :]
    if table is not None:
        scores = scores + _offset_bias(table, past, q.shape[-2], k.shape[-2], L)
    if positions_k is not None:
        scores = scores + _position_scores(q, positions_k.unsqueeze(0), past, k.shape[-2], L)
    if row_scale is not None:
        scores = scores * row_scale.unsqueeze(-1)
    if causal:
        scores = scores.masked_fill(offsets < 0, float("-inf"))
    return torch.softmax(scores, dim=-1)


def vq_attention_weights(q: torch.Tensor, k_hat: torch.Tensor, *, scale: float | None = None, block_size: int = 128,
                         bias=None, position_keys: torch.Tensor | None = None) -> torch.Tensor:
    """The causal attention probabilities ``[B, H, T, T]`` that ``vq_attention`` applies to v
    (its quadratic reference form, materialised: for inspection on bounded lengths). Same
    arguments as ``vq_attention``; the block form gives the same outputs."""
    B, H, T, Dk = q.shape
    Hkv = k_hat.shape[1]
    dtype = compute_dtype(q.dtype)
    L = check_positive_int("block_size", block_size)
    qf = _as(q, dtype).reshape(B, Hkv, H // Hkv, T, Dk) * resolve_scale(scale, Dk)
    table, positions_k = _relative_inputs(bias, position_keys, H, Hkv, L, Dk, q, dtype)
    return windowed_weights(qf, _as(k_hat, dtype), table, positions_k, L, True).reshape(B, H, T, T)


def _noncausal(q, codes, v, codebook):
    """Encoder form: ``softmax_s(q.c_s + log n_s) m_s`` over all positions."""
    counts, sums = code_statistics(codes.unsqueeze(2), v.unsqueeze(2), codebook.shape[1])
    counts, sums = counts.squeeze(2), sums.squeeze(2)
    logits = q @ codebook.unsqueeze(0).unsqueeze(2).transpose(-1, -2) + torch.log(counts).unsqueeze(2).unsqueeze(-2)
    means = mean_values(sums, counts)
    return torch.softmax(logits, dim=-1) @ means.unsqueeze(2)


def _block(q, k, v, codes, codebook, table, positions_k, L, scope, state, dtype, schedule="loop"):
    """Linear-time causal form. q ``[B, Hkv, G, T, D]`` (scaled); returns (out, pieces of the final state).
    ``schedule``: ``"loop"`` (one block after another) or ``"batched"`` (all blocks at once, in groups)."""
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
        run_counts = _cut(state.cache_counts.to(dtype), cut)
        run_sums = _cut(state.cache_means.to(dtype), cut) * run_counts.unsqueeze(-1)
    else:
        run_counts, run_sums = q.new_zeros(B, Hkv, S), q.new_zeros(B, Hkv, S, E)

    # Columns of a block's window: the previous block (j = 0..L-1), then its own (L..2L-1);
    # offset i - j = L + a - c for query row a and window column c.
    rows = torch.arange(L, device=q.device)
    offsets = L + rows[:, None] - torch.arange(2 * L, device=q.device)[None, :]
    window = torch.zeros(L, 2 * L, dtype=dtype, device=q.device).masked_fill(offsets < 0, float("-inf"))
    if table is not None:
        window = window + _offset_bias(table, L, L, 2 * L, L)
    # q . P over a block's window: one matmul with keys laid out for add_window_band
    band_keys = None if positions_k is None else _shared(window_position_keys(positions_k))  # [(Hkv|1, G|1,) 2L, D]

    full_blocks = P // L  # the cache after the call is the one block `full_blocks` would use
    blocks = (q_blocks, k_blocks, v_blocks, first_prev[0], first_prev[1], prev_codes)
    run = (run_counts, run_sums)
    if schedule == "batched":
        outs, final_cache = _all_blocks(blocks, codebook, window, band_keys, run, has_prev, full_blocks, scope, S)
    else:
        outs, final_cache = _block_loop(blocks, codebook, window, band_keys, run, has_prev, full_blocks, scope, S)
    out = outs.reshape(B, Hkv, G, R * L, E)[:, :, :, p : p + T]

    start = full_blocks * L
    new_state = {
        "partial": _owned(k[:, :, start:P], v[:, :, start:P], codes[:, :, start:P]),
        "prev": (
            _owned(k_blocks[:, :, full_blocks - 1], v_blocks[:, :, full_blocks - 1], code_blocks[:, :, full_blocks - 1])
            if full_blocks >= 1
            else ((state.prev_keys, state.prev_values, state.prev_codes) if has_prev else (None, None, None))
        ),
        "cache": (final_cache[0], mean_values(final_cache[1], final_cache[0])),
    }
    return out, new_state


def _block_loop(blocks, codebook, window, band_keys, run, has_prev, full_blocks, scope, S):
    """The blocks one after another, the cache carried from each to the next.
    Returns (outputs ``[B, Hkv, G, R, L, E]``, (counts, sums) of the cache before block ``full_blocks``)."""
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
        keys = torch.cat([_cut(prev_k_r, cut), k_r, codebook_keys], dim=-2)
        values = torch.cat([_cut(prev_v_r, cut), v_r, mean_values(run_sums, run_counts)], dim=-2)
        scores = q_r @ keys.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, L, 2L + S]
        scores[..., : 2 * L] += window
        if not with_prev:  # the first block has no previous block
            scores[..., :L] = float("-inf")
        if band_keys is not None:
            add_window_band(scores, q_r @ band_keys.transpose(-1, -2))
        scores[..., 2 * L :] += log_counts(run_counts)[:, :, None, None, :]
        outs.append(torch.softmax(scores, dim=-1) @ values.unsqueeze(2))
        if with_prev:
            # Block r's previous block is two blocks behind block r + 1: it enters the cache.
            counts, sums = _entering(prev_codes_r.unsqueeze(2), prev_v_r.unsqueeze(2), scope, S)
            run_counts, run_sums = run_counts + counts.squeeze(2), run_sums + sums.squeeze(2)
    if final_cache is None:
        final_cache = (run_counts, run_sums)
    return torch.stack(outs, dim=3), final_cache


def _entering(codes, values, scope, S):
    """Counts and value sums of blocks entering the cache (``[B, Hkv, R, L(, S)]`` codes), with
    the gradient the scope lets through (values detached unless ``"none"``, soft counts too)."""
    counts, sums = code_statistics(codes, _scoped(values, scope), S)
    if codes.is_floating_point() and scope != "none":
        counts = counts.detach()
    return counts, sums


def _scoped(values: torch.Tensor, scope: str) -> torch.Tensor:
    """The values a block adds to the cache, detached unless the scope is ``"none"``."""
    return values if scope == "none" else values.detach()


# Score entries a group of blocks may hold at once (batched schedule), by device type: on a
# GPU few large kernels (memory stays bounded at 64k); on a CPU 2 MB of float32 scores, the
# fastest of 2^15..2^22 over batch x heads 1..16, L 64/128, Dv 64/256 (docs/results.md).
_BATCHED_SCORES = {"cuda": 1 << 22, "cpu": 1 << 19}


# schedule="auto" on a CPU: the faster schedule at the nearest point (in log2 of each
# coordinate) of grids measured with Dk = Dv = 64, bias and position keys, keyed by (gradients
# on, rows = batch x heads, block length L, codebook size S, blocks per row R); quiet machine,
# 2 threads. Long sequences (T = 16384, R = 16384 / L): `.venv/bin/python
# tools/vq_schedule_grid.py --threads 2 --emit` (with gradients:
# docs/benchmarks/vq-schedule-grid/grid-after-running-cache.txt), without them the same with
# `--modes forward` (grid-running-rows.txt). Few blocks in many rows (R = 2, 8):
# `.venv/bin/python tools/vq_schedule_grid.py --threads 2 --block-counts 2 8 --rows 8 64 256
# --blocks 32 64 128 --codes 64 512 --emit` (grid-short.txt). The times are in
# docs/results.md, "VQ block schedules".
_AUTO_SCHEDULE = {
    (False, 1, 64, 128, 256): "batched", (False, 1, 64, 512, 256): "batched", (False, 1, 128, 128, 128): "batched",
    (False, 1, 128, 512, 128): "batched", (False, 1, 256, 128, 64): "batched", (False, 1, 256, 512, 64): "batched",
    (False, 4, 64, 128, 256): "batched", (False, 4, 64, 512, 256): "batched", (False, 4, 128, 128, 128): "batched",
    (False, 4, 128, 512, 128): "batched", (False, 4, 256, 128, 64): "batched", (False, 4, 256, 512, 64): "loop",
    (False, 8, 64, 128, 256): "batched", (False, 8, 64, 512, 256): "batched", (False, 8, 128, 128, 128): "batched",
    (False, 8, 128, 512, 128): "batched", (False, 8, 256, 128, 64): "loop", (False, 8, 256, 512, 64): "loop",
    (False, 32, 64, 128, 256): "batched", (False, 32, 64, 512, 256): "batched", (False, 32, 128, 128, 128): "loop",
    (False, 32, 128, 512, 128): "loop", (False, 32, 256, 128, 64): "loop", (False, 32, 256, 512, 64): "batched",
    (False, 8, 32, 64, 2): "loop", (False, 8, 32, 64, 8): "loop", (False, 8, 32, 512, 2): "loop",
    (False, 8, 32, 512, 8): "batched", (False, 8, 64, 64, 2): "loop", (False, 8, 64, 64, 8): "loop",
    (False, 8, 64, 512, 2): "loop", (False, 8, 64, 512, 8): "loop", (False, 8, 128, 64, 2): "loop",
    (False, 8, 128, 64, 8): "loop", (False, 8, 128, 512, 2): "loop", (False, 8, 128, 512, 8): "loop",
    (False, 64, 32, 64, 2): "loop", (False, 64, 32, 64, 8): "loop", (False, 64, 32, 512, 2): "loop",
    (False, 64, 32, 512, 8): "batched", (False, 64, 64, 64, 2): "loop", (False, 64, 64, 64, 8): "loop",
    (False, 64, 64, 512, 2): "loop", (False, 64, 64, 512, 8): "batched", (False, 64, 128, 64, 2): "loop",
    (False, 64, 128, 64, 8): "loop", (False, 64, 128, 512, 2): "loop", (False, 64, 128, 512, 8): "batched",
    (False, 256, 32, 64, 2): "loop", (False, 256, 32, 64, 8): "loop", (False, 256, 32, 512, 2): "loop",
    (False, 256, 32, 512, 8): "batched", (False, 256, 64, 64, 2): "loop", (False, 256, 64, 64, 8): "loop",
    (False, 256, 64, 512, 2): "batched", (False, 256, 64, 512, 8): "batched", (False, 256, 128, 64, 2): "loop",
    (False, 256, 128, 64, 8): "batched", (False, 256, 128, 512, 2): "batched", (False, 256, 128, 512, 8): "batched",
    (True, 1, 64, 128, 256): "batched", (True, 1, 64, 512, 256): "batched", (True, 1, 128, 128, 128): "batched",
    (True, 1, 128, 512, 128): "batched", (True, 1, 256, 128, 64): "batched", (True, 1, 256, 512, 64): "batched",
    (True, 4, 64, 128, 256): "batched", (True, 4, 64, 512, 256): "batched", (True, 4, 128, 128, 128): "batched",
    (True, 4, 128, 512, 128): "batched", (True, 4, 256, 128, 64): "batched", (True, 4, 256, 512, 64): "batched",
    (True, 8, 64, 128, 256): "batched", (True, 8, 64, 512, 256): "batched", (True, 8, 128, 128, 128): "batched",
    (True, 8, 128, 512, 128): "batched", (True, 8, 256, 128, 64): "loop", (True, 8, 256, 512, 64): "batched",
    (True, 32, 64, 128, 256): "batched", (True, 32, 64, 512, 256): "batched", (True, 32, 128, 128, 128): "batched",
    (True, 32, 128, 512, 128): "batched", (True, 32, 256, 128, 64): "loop", (True, 32, 256, 512, 64): "batched",
    (True, 8, 32, 64, 2): "loop", (True, 8, 32, 64, 8): "loop", (True, 8, 32, 512, 2): "loop",
    (True, 8, 32, 512, 8): "loop", (True, 8, 64, 64, 2): "loop", (True, 8, 64, 64, 8): "loop",
    (True, 8, 64, 512, 2): "loop", (True, 8, 64, 512, 8): "loop", (True, 8, 128, 64, 2): "loop",
    (True, 8, 128, 64, 8): "loop", (True, 8, 128, 512, 2): "loop", (True, 8, 128, 512, 8): "loop",
    (True, 64, 32, 64, 2): "loop", (True, 64, 32, 64, 8): "loop", (True, 64, 32, 512, 2): "loop",
    (True, 64, 32, 512, 8): "loop", (True, 64, 64, 64, 2): "loop", (True, 64, 64, 64, 8): "loop",
    (True, 64, 64, 512, 2): "loop", (True, 64, 64, 512, 8): "loop", (True, 64, 128, 64, 2): "loop",
    (True, 64, 128, 64, 8): "loop", (True, 64, 128, 512, 2): "loop", (True, 64, 128, 512, 8): "batched",
    (True, 256, 32, 64, 2): "loop", (True, 256, 32, 64, 8): "loop", (True, 256, 32, 512, 2): "loop",
    (True, 256, 32, 512, 8): "batched", (True, 256, 64, 64, 2): "loop", (True, 256, 64, 64, 8): "loop",
    (True, 256, 64, 512, 2): "loop", (True, 256, 64, 512, 8): "batched", (True, 256, 128, 64, 2): "loop",
    (True, 256, 128, 64, 8): "batched", (True, 256, 128, 512, 2): "batched", (True, 256, 128, 512, 8): "batched",
}


def _auto_schedule(grad: bool, rows: int, L: int, S: int, blocks: int, device: torch.device) -> str:
    """``schedule="auto"``'s choice for a call with gradients on or off over ``rows`` =
    batch x heads rows, block length ``L``, ``S`` codes and ``blocks`` blocks per row: on a CPU
    the winner of the nearest ``_AUTO_SCHEDULE`` point; elsewhere ``"batched"`` (fewer, larger
    kernels; not measured)."""
    if device.type != "cpu":
        return "batched"
    best, best_distance = "batched", math.inf
    for (key_grad, key_rows, key_L, key_S, key_blocks), winner in _AUTO_SCHEDULE.items():  # a plain loop: compiles
        if key_grad == grad:
            distance = (abs(math.log2(key_rows) - math.log2(rows)) + abs(math.log2(key_L) - math.log2(L))
                        + abs(math.log2(key_S) - math.log2(S)) + abs(math.log2(key_blocks) - math.log2(blocks)))
            if distance < best_distance:
                best, best_distance = winner, distance
    return best


def _blocks_per_group(device: torch.device, scores_per_block: int) -> int:
    """Blocks the batched schedule takes at once: as many as ``_BATCHED_SCORES`` allows."""
    return max(1, _BATCHED_SCORES.get(device.type, _BATCHED_SCORES["cuda"]) // scores_per_block)


def _group_caches(prev_codes, prev_v, run, skip_first, scope, S):
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
                        _scoped(prev_v[:, :, first:], scope), detach_counts=scope != "none")
    for each in (counts, sums):  # in-place adds: torch's cumsum over a leading dimension is several times slower
        # one unbind makes every block's view at once; autograd lets only indexed views be written
        blocks = [each[:, :, r] for r in range(g + 1)] if torch.is_grad_enabled() else each.unbind(2)
        for r in range(1, g + 1):
            blocks[r].add_(blocks[r - 1])
    return counts, sums


def _block_caches(prev_codes, prev_v, run, has_prev, full_blocks, scope, S):
    """The cache every block of the call reads (``_group_caches`` over all R blocks). Returns
    log counts ``[B, Hkv, R, S]``, means ``[B, Hkv, R, S, E]`` and the (counts, sums) before
    block ``full_blocks``."""
    R = prev_v.shape[2]
    run_counts, run_sums = _group_caches(prev_codes, prev_v, run, not has_prev, scope, S)
    final_cache = _owned(run_counts[:, :, full_blocks], run_sums[:, :, full_blocks])
    run_counts, run_sums = run_counts[:, :, :R], run_sums[:, :, :R]
    return log_counts(run_counts), mean_values(run_sums, run_counts), final_cache


def _windows(first: torch.Tensor, blocks: torch.Tensor, cut: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's window, its previous block then its own, from ``blocks [B, Hkv, R, L, X]``
    and ``first [B, Hkv, L, X]`` (block 0's previous block): block 0's ``[B, Hkv, 1, 2L, X]``
    and those of blocks 1..R-1 ``[B, Hkv, R - 1, 2L, X]``, a view of overlapping windows of
    ``blocks`` (no copy); with ``cut``, previous halves detached (a copy)."""
    B, Hkv, R, L, X = blocks.shape
    head = torch.cat([_cut(first, cut).unsqueeze(2), blocks[:, :, :1]], dim=-2)
    if cut:
        return head, torch.cat([blocks[:, :, :-1].detach(), blocks[:, :, 1:]], dim=-2)
    if R == 1:
        return head, blocks.new_empty(B, Hkv, 0, 2 * L, X)
    return head, blocks.flatten(2, 3).unfold(2, 2 * L, L).transpose(-1, -2)


def _shared(t: torch.Tensor) -> torch.Tensor:
    """``t [1, ..., 1, n, D]`` as ``[n, D]`` when it is the same for every head (a matmul
    with a matrix folds the rows into one product), else unchanged."""
    return t.reshape(t.shape[-2:]) if t.shape[:-2].numel() == 1 else t


def _per_block(keys: torch.Tensor) -> torch.Tensor:
    """Keys per head ``[Hkv|1, G|1, n, D]`` with a dimension for the blocks of a group; a shared
    matrix ``[n, D]`` as it is."""
    return keys if keys.dim() == 2 else keys.unsqueeze(-3)


def _all_blocks(blocks, codebook, window, band_keys, run, has_prev, full_blocks, scope, S):
    """The blocks in groups (``_block_loop``'s arguments and results), one (batch, kv head)
    row at a time: a row's blocks are one batch dimension of a single stride, so the batched
    matmuls read the window views (``_windows``) in place (over several rows they would copy
    them). Without gradients every group writes its outputs into one buffer, and with hard
    codes the cache terms of all rows are one running product per block
    (``_running_blocks``)."""
    q_blocks, k_blocks, v_blocks, first_prev_k, first_prev_v, prev_codes = blocks
    B, Hkv, G, R, L, _ = q_blocks.shape
    cut = scope == "state"
    windows = (*_windows(first_prev_k, k_blocks, cut), *_windows(first_prev_v, v_blocks, cut))
    out = None if torch.is_grad_enabled() else q_blocks.new_empty(B, Hkv, G, R, L, v_blocks.shape[-1])
    if out is not None and not prev_codes.is_floating_point():
        return _running_blocks(blocks, windows, codebook, window, band_keys, run, has_prev, full_blocks, S, out)
    if B * Hkv == 1:
        return _row_blocks(blocks, windows, codebook, window, band_keys, run, has_prev, full_blocks, scope, S, out)
    rows = [_rows(t) for t in (*blocks, *windows, *run)]  # per tensor: its B * Hkv rows, views
    out_rows = [None] * (B * Hkv) if out is None else _rows(out)
    outs, counts, sums = [], [], []
    for i, row in enumerate(zip(*rows)):
        h = i % Hkv
        o, (c, s) = _row_blocks(row[:6], row[6:10], codebook[h : h + 1], _head(window, h), _head(band_keys, h),
                                row[10:], has_prev, full_blocks, scope, S, out_rows[i])
        outs.append(o), counts.append(c), sums.append(s)
    return (_unrows(outs, B, Hkv) if out is None else out), (_unrows(counts, B, Hkv), _unrows(sums, B, Hkv))


def _rows(t: torch.Tensor) -> list[torch.Tensor]:
    """``t [B, Hkv, ...]`` as B * Hkv views ``[1, 1, ...]``, batch-major (one split each way:
    its backward is one concatenation)."""
    return [row for batch in t.split(1, dim=0) for row in batch.split(1, dim=1)]


def _unrows(rows: list[torch.Tensor], B: int, Hkv: int) -> torch.Tensor:
    """The inverse of ``_rows``: B * Hkv tensors ``[1, 1, ...]`` -> ``[B, Hkv, ...]``."""
    return torch.cat(rows, dim=1).reshape(B, Hkv, *rows[0].shape[2:])


def _head(t: torch.Tensor | None, h: int) -> torch.Tensor | None:
    """Kv head h of a per-head tensor ``[Hkv, G|1, ...]`` (4-D); a shared one (a matrix, or
    a first dimension of 1) as it is."""
    return t if t is None or t.dim() == 2 or t.shape[0] == 1 else t.narrow(0, h, 1)


def _row_scoring(codebook, window, band_keys):
    """What scores a row's blocks (``_group_scores``' ``scoring``) from its kv head's codebook
    ``[1, S, D]``, window ``[(1, G|1,) L, 2L]`` and position keys: the window with a dimension
    for the blocks, the codebook as one matrix ``[D, S]`` (the matmul folds the rows) and the
    position keys transposed."""
    band_keys_t = None if band_keys is None else _per_block(band_keys).transpose(-1, -2)  # [(1, G|1, 1,) D, 2L]
    return window.unsqueeze(-3), band_keys_t, codebook[0].transpose(-1, -2)


def _row_groups(blocks, windows, group):
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


def _row_blocks(blocks, windows, codebook, window, band_keys, run, has_prev, full_blocks, scope, S, out=None):
    """``_all_blocks`` for one row (``B = Hkv = 1``, codebook ``[1, S, D]``; ``windows``: block 0's
    and the other blocks' window keys, then the same for values, ``_windows``) in groups
    (``_row_groups``). Within a group the cache each block reads is the carried cache plus the
    statistics of the group's blocks that entered before it, a prefix sum; scores and outputs
    are batched matmuls over the group's blocks. A group holds at most ``_BATCHED_SCORES[device]``
    score entries (``_blocks_per_group``). ``out``: the row's output buffer ``[1, 1, G, R, L, E]``
    (without gradients), else the outputs are concatenated."""
    q_blocks = blocks[0]
    B, Hkv, G, R, L, D = q_blocks.shape
    scoring = _row_scoring(codebook, window, band_keys)
    group = _blocks_per_group(q_blocks.device, B * Hkv * G * L * (2 * L + S))
    outs, final_cache = [], None
    for start, q_g, keys_g, values_g, prev_codes_g, prev_v_g in _row_groups(blocks, windows, group):
        g = q_g.shape[3]
        counts, sums = _group_caches(prev_codes_g, prev_v_g, run, start == 0 and not has_prev, scope, S)
        if start <= full_blocks < start + g:
            final_cache = _owned(counts[:, :, full_blocks - start], sums[:, :, full_blocks - start])
        run = (counts[:, :, -1], sums[:, :, -1])
        counts, sums = counts[:, :, :-1], sums[:, :, :-1]
        scores_w, scores_c = _group_scores(q_g, keys_g, scoring, counts, start == 0 and not has_prev)
        group_out = None if out is None else out[:, :, :, start : start + g]
        outs.append(_attend_window_and_cache(scores_w, scores_c, values_g.unsqueeze(2), counts, sums, group_out))
    return (torch.cat(outs, dim=3) if out is None else out), (final_cache if final_cache is not None else _owned(*run))


# Cache weights ``p_s / n_s`` the running form holds at once (rows x blocks of a group x
# queries x codes), by device type: it takes as many rows at a time as they allow.
_RUNNING_WEIGHTS = {"cuda": 1 << 24, "cpu": 1 << 21}


def _running_blocks(blocks, windows, codebook, window, band_keys, run, has_prev, full_blocks, S, out):
    """``_all_blocks`` without gradients for hard codes. Scores and window outputs are
    computed per row in groups (``_row_groups``, as ``_row_blocks``); the cache term is not:
    the cache sums of a set of rows are one ``[n, S, E]`` tensor, updated in place block by
    block (block r's cache term is a batched matmul with it, for all n rows, before block r's
    previous block enters by one ``index_add_`` into its ``[n S, E]`` view), never copied per
    block (the per-block copies of the grouped form are memory traffic that bounds it, and
    per-row products are per-call costs). Rows are taken ``_rows_at_once`` at a time. The
    counts are a prefix sum per group, exact (whole numbers). Returns
    ``(out, final cache (counts [B, Hkv, S], sums [B, Hkv, S, E]))``."""
    q_blocks, _, v_blocks, _, first_prev_v, prev_codes = blocks
    B, Hkv, G, R, L, _ = q_blocks.shape
    N, E = B * Hkv, v_blocks.shape[-1]
    group = _blocks_per_group(q_blocks.device, G * L * (2 * L + S))
    at_once = _rows_at_once(q_blocks.device, min(group, R) * G * L * S)
    # all rows' tensors with one row dimension (views: these are fresh contiguous tensors)
    out_all, codes_all = out.view(N, G, R, L, E), prev_codes.reshape(N, R, L)
    values_all, first_values = v_blocks.reshape(N, R, L, E), first_prev_v.reshape(N, 1, L, E)
    row_views = [_rows(t) for t in (*blocks, *windows)]
    final_counts, final_sums = run[0].reshape(N, S).clone(), run[1].reshape(N, S, E).clone()
    for a in range(0, N, at_once):
        b = min(N, a + at_once)
        n = b - a
        groups = [_row_groups(row[:6], row[6:], group) for row in zip(*(views[a:b] for views in row_views))]
        scorings = [_row_scoring(codebook[i % Hkv : i % Hkv + 1], _head(window, i % Hkv), _head(band_keys, i % Hkv))
                    for i in range(a, b)]
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


def _rows_at_once(device: torch.device, weights_per_row: int) -> int:
    """Rows ``_running_blocks`` takes at once: as many as ``_RUNNING_WEIGHTS`` allows."""
    return max(1, _RUNNING_WEIGHTS.get(device.type, _RUNNING_WEIGHTS["cuda"]) // weights_per_row)


def _running_group(pieces, scorings, codes, counts_now, skip_first, out, S):
    """One group of g blocks in n rows for ``_running_blocks``: the counts before each block
    ``[n, g, S]`` (the carried counts ``counts_now [n, S]`` plus a prefix sum of the previous
    blocks' ``codes [n, g, L]``; ``skip_first``: block 0 has no previous block), the counts after
    the group ``[n, S]``, and the cache weights ``p_s / n_s`` ``[n, g, G, L, S]`` of one softmax
    per row over window and cache scores; the window outputs go to ``out [n, G, R, L, E]``."""
    n, g, _ = codes.shape
    added = counts_now.new_zeros(n, g, S).scatter_add_(2, codes, torch.ones_like(codes, dtype=counts_now.dtype))
    if skip_first:
        added[:, 0] = 0.0
    after = added.cumsum_(1).add_(counts_now.unsqueeze(1))  # the counts after each block's previous block entered
    counts = torch.cat([counts_now.unsqueeze(1), after[:, :-1]], dim=1)  # [n, g, S]: before each block
    per_count = nonzero_counts(counts).unsqueeze(2)  # [n, g, 1, S]
    G, L = pieces[0][1].shape[2], pieces[0][1].shape[-2]
    weights = None if n == 1 else counts.new_empty(n, g, G, L, S)  # one row: its probabilities, in place
    start = pieces[0][0]
    for i, ((_, q_g, keys_g, values_g, _, _), scoring) in enumerate(zip(pieces, scorings)):
        probs = _probabilities(*_group_scores(q_g, keys_g, scoring, counts[i][None, None], skip_first))
        two_l = keys_g.shape[-2]
        torch.matmul(probs[..., :two_l], values_g.unsqueeze(2), out=out[i : i + 1, :, start : start + g].unsqueeze(0))
        if weights is None:
            weights = probs[0, :, ..., two_l:].div_(per_count[i]).transpose(1, 2)  # p_s / n_s, [1, g, G, L, S]
        else:
            torch.div(probs[0, 0, ..., two_l:], per_count[i], out=weights[i].transpose(0, 1))
    return counts, after[:, -1], weights


def _group_scores(q_g, keys_g, scoring, counts, first_without_prev: bool):
    """A group's scores: queries ``[B, Hkv, G, g, L, D]`` over their windows ``[B, Hkv, g, 2L, D]``
    with the window's bias and the position band (``scoring`` = window ``[.., 1, L, 2L]``,
    position keys transposed or None, codebook ``[D, S]``), and over the codes with ``log n_s``
    of the caches ``counts [B, Hkv, g, S]``. ``first_without_prev``: the group's first block
    has no previous block (its first L columns get -inf)."""
    window, band_keys_t, codebook_t = scoring
    L = q_g.shape[-2]
    scores_w = q_g @ keys_g.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, g, L, 2L]
    scores_w += window
    if first_without_prev:
        scores_w[:, :, :, 0, :, :L] = float("-inf")
    if band_keys_t is not None:
        add_window_band(scores_w, q_g @ band_keys_t)
    scores_c = q_g @ codebook_t
    scores_c += log_counts(counts)[:, :, None, :, None, :]
    return scores_w, scores_c


def _probabilities(scores_w: torch.Tensor, scores_c: torch.Tensor) -> torch.Tensor:
    """One softmax over a group's window scores ``[..., 2L]`` and cache scores ``[..., S]``:
    ``[..., 2L + S]`` (the concatenation costs less than normalising the two parts in place:
    ``exp`` of the masked ``-inf`` entries is slow outside the softmax kernel on a CPU)."""
    return torch.softmax(torch.cat([scores_w, scores_c], dim=-1), dim=-1)


def _attend_window_and_cache(scores_w, scores_c, values, counts, sums, out=None):
    """``_probabilities`` applied to a group's window values ``[B, Hkv, 1, g, 2L, E]`` and cache
    means: ``sum_s p_s m_s = sum_s (p_s / n_s) sums_s`` (the division on the ``[L, S]``
    weights, not the ``[S, E]`` sums; counts ``[B, Hkv, g, S]``, sums ``[B, Hkv, g, S, E]``).
    ``out``: where to write the result (without gradients), else a new tensor."""
    two_l = scores_w.shape[-1]
    probs = _probabilities(scores_w, scores_c)
    result = torch.matmul(probs[..., :two_l], values, out=out)
    per_count = nonzero_counts(counts)[:, :, None, :, None, :]
    result += (probs[..., two_l:] / per_count) @ sums[:, :, None]
    return result


def _decode(q, k, v, codes, codebook, table, positions_k, L, scope, state, dtype):
    """The block form for T new positions that stay inside the current block (``p + T <= L``),
    e.g. one generated token: only the new queries are scored, against the previous block,
    the current block so far and the S cache slots, ``[T, L + p + T + S]`` scores instead of
    the block form's ``[L, 2L + S]``, each group read in place (no concatenated copy of the
    keys, values or cache). The cache (counts and means) is used as it is and changes only
    when the block completes: then the previous block enters it and the completed block
    becomes the previous one. Same arguments and result as ``_block``.
    """
    B, Hkv, G, T, D = q.shape
    E, S = v.shape[-1], codebook.shape[1]
    cut = scope == "state"  # nothing from an earlier block carries a gradient
    if state is None:
        p, has_prev = 0, False
        counts, means = q.new_zeros(B, Hkv, S), q.new_zeros(B, Hkv, S, E)
        k, v, codes = _owned(k, v, codes)
    else:
        p, has_prev = state.partial_keys.shape[2], state.prev_keys is not None
        if p:
            k = torch.cat([_as(state.partial_keys, dtype), k], dim=2)
            v = torch.cat([_as(state.partial_values, dtype), v], dim=2)
            codes = torch.cat([_as(state.partial_codes, codes.dtype), codes], dim=2)
        else:
            k, v, codes = _owned(k, v, codes)
        counts, means = _cut(_as(state.cache_counts, dtype), cut), _cut(_as(state.cache_means, dtype), cut)
    rows = q.reshape(B, Hkv, G * T, D)
    window = [rows @ k.transpose(-1, -2)]  # [B, Hkv, G T, p + T]
    if has_prev:
        prev = (_cut(_as(state.prev_keys, dtype), cut), _cut(_as(state.prev_values, dtype), cut), state.prev_codes)
        window.insert(0, rows @ prev[0].transpose(-1, -2))
    window = torch.cat(window, dim=-1).reshape(B, Hkv, G, T, -1)
    first = (L if has_prev else 0) + p  # offset i - j of query 0 and window column 0
    columns = first + T
    relative = _relative_terms(q, table, positions_k)
    if relative is not None:
        window = window + offset_rows(relative, first, T, columns, 0, L)
    if T > 1:
        offsets = first + torch.arange(T, device=q.device)[:, None] - torch.arange(columns, device=q.device)
        window = window.masked_fill(offsets < 0, float("-inf"))
    cache = codebook_scores(rows, codebook) + log_counts(counts).unsqueeze(2)
    probs = torch.softmax(torch.cat([window.reshape(B, Hkv, G * T, columns), cache], dim=-1), dim=-1)
    out = probs[..., first - p : columns] @ v + probs[..., columns:] @ means
    if has_prev:
        out = out + probs[..., :L] @ prev[1]
    out = out.reshape(B, Hkv, G, T, E)

    if p + T < L:
        return out, {"partial": (k, v, codes),
                     "prev": prev if has_prev else (None, None, None), "cache": (counts, means)}
    if has_prev:  # the completed block pushes the previous one into the cache
        entering = prev[1] if scope == "none" else prev[1].detach()
        counts, means = fold_block(counts, means, prev[2], entering,
                                   detach_counts=codes.is_floating_point() and scope != "none")
    return out, {"partial": _owned(k[:, :, :0], v[:, :, :0], codes[:, :, :0]), "prev": (k, v, codes),
                 "cache": (counts, means)}


def _relative_terms(q, table, positions_k) -> torch.Tensor | None:
    """Per query row and offset ``delta = 0..L``: ``b_delta + q.P_delta`` ``[B|1, Hkv|1, G|1, T|1, L + 1]``."""
    relative = None
    if positions_k is not None:
        relative = q @ positions_k.unsqueeze(0).transpose(-1, -2)
    if table is not None:
        relative = table.unsqueeze(-2) if relative is None else relative + table.unsqueeze(-2)
    return relative


def _reversed(relative: torch.Tensor | None) -> torch.Tensor | None:
    return None if relative is None else relative.flip(-1)


def _cut(t: torch.Tensor, cut: bool) -> torch.Tensor:
    """``t`` detached when ``cut`` (a block boundary the gradient must not cross)."""
    return t.detach() if cut else t


def _owned(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies for the state: a slice of a long input or padded buffer would keep all of it
    alive (and strided), so the state would not be constant-size in memory."""
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in tensors)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, without the cost of a call when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


def _grad_scope(grad_scope, cache_grad) -> str:
    """The effective gradient scope from ``grad_scope`` and the older ``cache_grad`` alias."""
    check_choice("grad_scope", grad_scope, GRAD_SCOPES)
    if cache_grad is None:
        return grad_scope
    check_bool("cache_grad", cache_grad)
    implied = "none" if cache_grad else "cache"
    if grad_scope not in ("cache", implied):
        raise ValueError(f"cache_grad={cache_grad} means grad_scope={implied!r}, which contradicts "
                         f"grad_scope={grad_scope!r}; pass grad_scope alone")
    return implied


def _check_codebook(codebook, Hkv: int, Dk: int, like: torch.Tensor) -> torch.Tensor:
    """A codebook ``[Hkv, S, Dk]`` in the dtype and on the device of ``like`` (q)."""
    codebook = check_tensor("codebook", codebook, ndim=3, layout="[kv_heads, codebook_size, key_dim]")
    check_same_dtype_device(q=like, codebook=codebook)
    if codebook.shape[0] != Hkv or codebook.shape[2] != Dk:
        raise ValueError(f"codebook has shape {list(codebook.shape)}, expected [{Hkv}, S, {Dk}]")
    return codebook


def _check_codes(codes, codebook, B, Hkv, T, like):
    """Hard codes ``[B, Hkv, T]`` (int64) or soft assignment weights ``[B, Hkv, T, S]``."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be an int64 tensor [B, Hkv, T], got {type(codes).__name__}")
    if codes.device != like.device:
        raise ValueError(f"codes is on {codes.device} but q is on {like.device}")
    if codes.is_floating_point():
        S = codebook.shape[1]
        if tuple(codes.shape) != (B, Hkv, T, S):
            raise ValueError(f"soft codes have shape {list(codes.shape)}, expected [{B}, {Hkv}, {T}, {S}]")
        return codes.to(compute_dtype(like.dtype)), codebook
    if codes.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"codes must be an int64 tensor [B, Hkv, T], got dtype {codes.dtype}")
    if tuple(codes.shape) != (B, Hkv, T):
        raise ValueError(f"codes has shape {list(codes.shape)}, expected [{B}, {Hkv}, {T}]")
    return codes.long(), codebook


def _check_codes_match_keys(codes: torch.Tensor, codebook: torch.Tensor, k_hat: torch.Tensor) -> None:
    """Hard codes lie in ``[0, S)`` and ``k_hat[b, h, t] == codebook[h, codes[b, h, t]]``."""
    S = codebook.shape[1]
    low, high = torch.aminmax(codes)
    if low < 0 or high >= S:
        raise ValueError(f"codes must lie in [0, {S}) (codebook_size S = {S}), got values in [{int(low)}, {int(high)}]")
    looked_up = torch.gather(codebook.unsqueeze(0).expand(codes.shape[0], -1, -1, -1), 2,
                             codes.unsqueeze(-1).expand(*codes.shape, codebook.shape[-1]))
    if not torch.equal(looked_up, k_hat.detach()):
        gap = (looked_up - k_hat.detach()).abs().max().item()
        raise ValueError(
            f"k_hat must equal codebook[h, codes] (the quantized keys); they differ by up to {gap:.3g}. "
            "Pass the keys VectorQuantizer returns, or check_inputs=False if they differ on purpose"
        )


def _check_arguments(q, k_hat, v, codes, codebook, causal, mode, block_size, bias, position_keys, initial_state,
                     output_final_state):
    """Every check of ``vq_attention``'s arguments; returns the normalised ``(codes, codebook)``."""
    check_bool("causal", causal)
    shapes = check_qkv(q, k_hat, v, key_name="k_hat")
    check_choice("mode", mode, (None,) + _MODES)
    check_positive_int("block_size", block_size)
    B, Hkv, T = shapes.batch, shapes.kv_heads, shapes.length
    Dk, Dv, L = shapes.key_dim, shapes.value_dim, block_size
    codes, codebook = _check_codes(codes, _check_codebook(codebook, Hkv, Dk, q), B, Hkv, T, q)
    S = codebook.shape[1]
    if not codes.is_floating_point():
        _check_codes_match_keys(codes, codebook, k_hat)
    if not causal and (bias is not None or position_keys is not None):
        raise ValueError(
            "bias and position_keys act on the causal window 0 <= i - j <= block_size; not defined for causal=False"
        )
    if (mode or "block") == "parallel" and (initial_state is not None or output_final_state):
        raise ValueError("mode='parallel' is the stateless reference; use mode='block' to carry a state")
    if initial_state is None:
        return codes, codebook
    _check_state(initial_state, B, Hkv, Dk, Dv, L, S, q, soft=codes.is_floating_point())
    return codes, codebook


def _check_state(state: object, B: int, Hkv: int, Dk: int, Dv: int, L: int, S: int, like: torch.Tensor, *,
                 soft: bool) -> None:
    """A carried ``VQAttentionState`` continues this call: made with block size ``L`` and
    codebook size ``S`` (when it records them), ``B`` rows, and tensors of the shapes these
    inputs give (``soft``: soft assignments ``[B, Hkv, p, S]`` in the ``*_codes`` fields,
    else hard codes ``[B, Hkv, p]``)."""
    name = "initial_state"
    if not isinstance(state, VQAttentionState):
        raise TypeError(f"{name} must be a VQAttentionState, got {type(state).__name__}")
    s = state
    check_state_setting(name, "block_size", s.block_size, L)
    check_state_setting(name, "codebook_size", s.codebook_size, S)
    if isinstance(s.cache_counts, torch.Tensor) and s.cache_counts.dim() == 3 and s.cache_counts.shape[2] != S:
        raise ValueError(f"{name}.cache_counts has {s.cache_counts.shape[2]} slots (shape "
                         f"{list(s.cache_counts.shape)}): the state was made with codebook_size="
                         f"{s.cache_counts.shape[2]}, but this call has codebook_size={S}")
    check_state_tensor(f"{name}.cache_counts", s.cache_counts, (B, Hkv, S), like)
    check_state_tensor(f"{name}.cache_means", s.cache_means, (B, Hkv, S, Dv), like)
    p = s.partial_keys.shape[2] if isinstance(s.partial_keys, torch.Tensor) and s.partial_keys.dim() == 4 else -1
    if not 0 <= p < L:
        raise ValueError(f"{name}.partial_keys must hold 0..{L - 1} positions for block_size={L}, got shape "
                         f"{list(getattr(s.partial_keys, 'shape', ()))}")
    check_state_tensor(f"{name}.partial_keys", s.partial_keys, (B, Hkv, p, Dk), like)
    check_state_tensor(f"{name}.partial_values", s.partial_values, (B, Hkv, p, Dv), like)
    _check_state_codes(f"{name}.partial_codes", s.partial_codes, (B, Hkv, p), S, soft, like)
    if s.prev_keys is not None:
        if isinstance(s.prev_keys, torch.Tensor) and s.prev_keys.dim() == 4 and s.prev_keys.shape[2] != L:
            raise ValueError(f"{name}.prev_keys holds a block of {s.prev_keys.shape[2]} positions: the state was "
                             f"made with block_size={s.prev_keys.shape[2]}, but this call has block_size={L}")
        check_state_tensor(f"{name}.prev_keys", s.prev_keys, (B, Hkv, L, Dk), like)
        check_state_tensor(f"{name}.prev_values", s.prev_values, (B, Hkv, L, Dv), like)
        _check_state_codes(f"{name}.prev_codes", s.prev_codes, (B, Hkv, L), S, soft, like)


def _check_state_codes(name: str, codes: object, shape: tuple[int, ...], S: int, soft: bool,
                       like: torch.Tensor) -> None:
    """A state's codes: ``shape`` for hard codes, ``shape + (S,)`` for soft assignments (their
    dtype is not checked: ``.to(dtype)`` casts hard codes too, a step casts them back)."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(codes).__name__}")
    expected = (*shape, S) if soft else shape
    if tuple(codes.shape) != expected:
        kind = "soft assignments (soft_vq_attention)" if soft else "hard codes (vq_attention)"
        raise ValueError(f"{name} has shape {list(codes.shape)}, expected {kind} of shape {list(expected)}")
    if codes.device != like.device:
        raise ValueError(f"{name} is on {codes.device} but the inputs are on {like.device}")


def vq_attention(
    q: torch.Tensor,
    k_hat: torch.Tensor,
    v: torch.Tensor,
    codes: torch.Tensor,
    codebook: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_size: int = 128,
    bias: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
    position_keys: torch.Tensor | None = None,
    mode: str | None = None,
    grad_scope: str = "cache",
    cache_grad: bool | None = None,
    initial_state: VQAttentionState | None = None,
    output_final_state: bool = False,
    check_inputs: bool = True,
    schedule: str = "auto",
    impl: str = "auto",
) -> tuple[torch.Tensor, VQAttentionState | None]:
    """Softmax attention over vector-quantized keys (Transformer-VQ).

    Args:
        q: ``[B, H, T, Dk]``; k_hat: ``[B, Hkv, T, Dk]`` quantized keys (equal to
            ``codebook[h, codes]`` in value; ``VectorQuantizer`` gives them with a
            straight-through gradient); v: ``[B, Hkv, T, Dv]``.
        codes: ``[B, Hkv, T]`` int64 code indices; codebook: ``[Hkv, S, Dk]``.
        causal: decoder (True) or encoder (False; no bias, no state).
        scale: score scale, ``None`` = ``Dk^-1/2``.
        block_size: L, the block length and the bias window.
        bias: relative bias for offsets ``0..L``: a tensor ``[L + 1]`` or ``[H, L + 1]``, or
            a callable of the offsets (1-D long tensor) returning ``[n]`` or ``[H, n]``.
            Zero for larger offsets.
        position_keys: ``[L + 1, Dk]`` or ``[H, L + 1, Dk]``: adds the query-dependent
            relative term ``scale q_i . P_{i-j}`` for ``0 <= i - j <= L`` (Transformer-XL's
            content-position term; the GAU layer uses it).
        mode: ``"parallel"`` (quadratic reference) or ``"block"`` (linear; default).
        grad_scope: where the block form stops gradients: ``"cache"`` (the values entering
            the cache), ``"state"`` (everything carried across a block boundary: the official
            Transformer-VQ training, ``grad_thru_cache=False``) or ``"none"`` (exact gradients,
            the official ``grad_thru_cache=True``); see the module docstring.
        cache_grad: the former switch, kept as an alias: ``True`` is ``grad_scope="none"``,
            ``False`` is ``"cache"``.
        initial_state: a ``VQAttentionState`` to continue from (block mode).
        output_final_state: also return the final ``VQAttentionState`` (block mode).
        check_inputs: check every argument (types, shapes, the carried state) and that every
            code lies in ``[0, S)`` and ``k_hat`` equals ``codebook[h, codes]`` exactly (the
            block form reads the codebook where the reference reads ``k_hat``, so keys that
            are not their codes would give two answers). ``False`` skips all of it, for callers
            whose inputs are valid by construction: the GAU layer, whose keys come from its
            ``VectorQuantizer``, decodes a token in less time than the checks take.
        schedule: how the block form walks the blocks: ``"loop"`` (one block after another,
            the readable form) or ``"batched"`` (groups of blocks as batched matmuls, each
            block's cache from a prefix sum over the group's blocks, or without gradients one
            running cache: fewer, larger kernels; the faster on CPUs when batch x heads is
            small, by up to 3x).
            ``"auto"``: on a CPU the faster of the two at the nearest point of a measured grid
            of (gradients on or off, batch x heads, L, S, blocks per row) (``_AUTO_SCHEDULE``:
            for long sequences batched with gradients but at two near-ties, without them
            batched up to 4 rows, mostly the loop at 32; for a few blocks per row, as in
            training at a small context, mostly the loop), batched on other devices. Same
            results.
        impl: ``"torch"`` (the forms above), ``"triton"`` (the causal block form as fused
            Triton kernels, ``ops/_vq_triton.py``: inputs stay in their dtype, float32, bfloat16
            or float16, with float32 accumulation; CUDA tensors, or CPU tensors under the
            Triton interpreter, ``TRITON_INTERPRET=1``) or ``"auto"`` (triton for CUDA inputs
            of those dtypes when ``triton`` imports, torch otherwise; ``LINATTN_VQ_IMPL=torch``
            or ``triton`` replaces this choice). Before the kernels first run on a device in a
            dtype they check themselves against the torch form on a small call
            (``ops/_vq_selfcheck.py``): after a failed check ``"auto"`` warns once and uses
            torch there, ``"triton"`` raises ``RuntimeError``. Calls whose new positions
            stay inside the current block (decoding steps) use the torch decode form either way;
            ``mode="parallel"`` and ``causal=False`` are torch only.

    Returns:
        ``(out [B, H, T, Dv] in q's dtype, final state or None)``.
    """
    check_bool("check_inputs", check_inputs)
    check_choice("schedule", schedule, SCHEDULES)
    scope = _grad_scope(grad_scope, cache_grad)
    if check_inputs:
        codes, codebook = _check_arguments(q, k_hat, v, codes, codebook, causal, mode, block_size, bias,
                                           position_keys, initial_state, output_final_state)
    mode = mode or "block"
    requested, impl = impl, fused.resolve_impl(impl, q, v, causal, mode)
    B, H, T, Dk = q.shape
    Hkv, Dv = k_hat.shape[1], v.shape[-1]
    G = H // Hkv
    scale = resolve_scale(scale, Dk)
    dtype = compute_dtype(q.dtype)
    L = block_size
    table, positions_k = _relative_inputs(bias, position_keys, H, Hkv, L, Dk, q, dtype)
    filled = initial_state.partial_keys.shape[2] if initial_state is not None else 0
    if impl == "triton" and filled + T > L and selfcheck.trusted(
            q.device, q.dtype, strict=requested == "triton" or selfcheck.forced_impl() == "triton"):
        # the block form on the kernels, inputs in their own dtype
        if torch.is_grad_enabled():
            resident.release(initial_state)
        out, pieces = fused.block(q, k_hat, v, codes, codebook, table, positions_k, L, scope, initial_state, scale)
        return _result(out, pieces, q.dtype, initial_state, output_final_state, L, _keys_record(codes, codebook,
                                                                                                initial_state))
    qf = _as(q, dtype).reshape(B, Hkv, G, T, Dk)
    qf = qf * scale if scale != 1.0 else qf
    kf, vf, cb = _as(k_hat, dtype), _as(v, dtype), _as(codebook, dtype)

    if not causal:
        if initial_state is not None:
            raise ValueError("causal=False takes no state (the encoder form sees the whole sequence)")
        out = _noncausal(qf, codes, vf, cb)
        return _as(out.reshape(B, H, T, Dv), q.dtype), None
    if mode == "parallel":
        out = windowed_softmax(qf, kf, vf, table, positions_k, L, causal)
        return _as(out.reshape(B, H, T, Dv), q.dtype), None

    if filled + T <= L and not torch.is_grad_enabled():
        out, state = resident.decode(qf, kf, vf, codes, codebook, _reversed(_relative_terms(qf, table, positions_k)), L,
                                     initial_state, dtype)
        return _as(out.reshape(B, H, T, Dv), q.dtype), (state if output_final_state else None)
    if torch.is_grad_enabled():
        resident.release(initial_state)
    if filled + T <= L:
        out, pieces = _decode(qf, kf, vf, codes, cb, table, positions_k, L, scope, initial_state, dtype)
    else:
        if schedule == "auto":
            blocks = -(-(filled + T) // L)
            schedule = _auto_schedule(torch.is_grad_enabled(), B * H, L, cb.shape[1], blocks, q.device)
        out, pieces = _block(qf, kf, vf, codes, cb, table, positions_k, L, scope, initial_state, dtype, schedule)
    return _result(out, pieces, q.dtype, initial_state, output_final_state, L,
                   _keys_record(codes, codebook, initial_state))


def _keys_record(codes, codebook, initial_state):
    """``(codebook, version)`` for the state a call returns when its keys are rows of the
    codebook as it is now: hard codes (``k_hat = codebook[codes]``, checked or promised) and
    a continued state recorded so too; None otherwise (``VQAttentionState._keys_from``)."""
    if codes.is_floating_point() or torch.compiler.is_compiling():  # a tensor's version is not traceable
        return None
    if initial_state is not None and not resident.keys_are_rows_of(initial_state._keys_from, codebook):
        return None
    return codebook, codebook._version


def _result(out, pieces, out_dtype, initial_state, output_final_state, block_size: int, keys_from=None):
    """``vq_attention``'s return value from a causal form's output ``[B, Hkv, G, T, Dv]`` and
    the pieces of its final state (made with ``block_size``)."""
    B, Hkv, G, T, Dv = out.shape
    out = _as(out.reshape(B, Hkv * G, T, Dv), out_dtype)
    if not output_final_state:
        return out, None
    counts, means = pieces["cache"]
    partial_k, partial_v, partial_codes = pieces["partial"]
    prev_k, prev_v, prev_codes = pieces["prev"]
    state = VQAttentionState(
        partial_keys=partial_k,
        partial_values=partial_v,
        partial_codes=partial_codes,
        cache_counts=counts,
        cache_means=means,
        prev_keys=prev_k,
        prev_values=prev_v,
        prev_codes=prev_codes,
        steps=(initial_state.steps if initial_state is not None else 0) + T,
        block_size=block_size,
        codebook_size=counts.shape[-1],
    )
    state._keys_from = keys_from
    return out, state
