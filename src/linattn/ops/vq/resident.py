"""Transformer-VQ decoding into buffers that live with the state (gradients off).

A decoding step attends from a few new queries to the previous block, the current block
so far and the S cache slots. Here those keys and values sit side by side in one buffer
per state, so a step is one matmul for the scores, one softmax and one matmul for the
output, and the new positions are written into their rows in place:

    keys   [B, Hkv, 2L + S, Dk]: previous block | current block | codebook
    values [B, Hkv, 2L + S, Dv]: previous block | current block | cache means m_s
    mask   [B, Hkv, 2L + S]:     0 on filled rows, -inf on empty ones | log n_s

(``codes`` keeps the codes of both blocks for the cache update: soft weights
``[B, Hkv, 2L, S]``, or hard codes ``[B, Hkv, 2L + S]`` followed by ``0 .. S - 1``, so that
gathering a query's codebook scores at ``codes`` gives its scores on every column, as
``quantize_and_decode`` does.) The
state's public fields are views of these buffers (``partial_keys`` = rows L .. L + p,
``prev_keys`` = rows 0 .. L, ``cache_means`` = rows 2L ..). When a block completes, the
previous block enters the cache and a new buffer starts with the completed block as its
previous one: one copy of the state per L tokens.

States are values: a step never changes what an earlier state reads. Rows past a state's
``p`` are free, and a step may fill them in place only if no other step from a state of
the same buffer has claimed them (``written``); a second continuation of one state copies
the buffer first (beam search, retries). A state rebuilt by ``dataclasses.replace``,
``.to``, ``.detach`` or ``select_batch`` has no buffer and gets a new one at its first step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...state import VQAttentionState
from ..._checks import compute_dtype
from ..common.bias import offset_rows
from ..common.rotary import far_queries, rerope_scores, rotary_frequencies
from ..common.versions import tensor_version
from ..common import native
from .cache import fold_block, log_counts
from .relative import relative_inputs, relative_terms, reversed_terms
from .tensors import as_dtype


class ResidentWindow:
    """The buffers of one chain of decoding states (see the module docstring), with the
    views a step reads made once: ``keys3 [B Hkv, 2L + S, Dk]`` (and its transpose ``keys_t``),
    ``values3 [B Hkv, 2L + S, Dv]``, ``mask3 [B Hkv, 1, 2L + S]``, ``codes3 [B Hkv, 2L + S]`` (hard
    codes) or ``[B Hkv, 2L, S]`` (soft)."""

    __slots__ = ("keys", "values", "codes", "mask", "counts", "block_size", "codebook", "written", "scoring",
                 "step_views", "keys_are_codes",
                 "keys3", "keys_t", "values3", "mask3", "codes3", "prev", "cache_means")

    def __init__(self, keys, values, codes, mask, counts, block_size, codebook=None, written=None, scoring=None,
                 keys_are_codes=False):
        B, Hkv, columns, D = keys.shape
        L = block_size
        self.keys, self.values, self.codes, self.mask = keys, values, codes, mask
        self.counts = counts  # [B, Hkv, S]: the states' cache_counts
        self.block_size = L
        self.codebook = codebook  # (tensor, version) that rows 2L.. were copied from
        self.written = written  # current-block rows claimed by a state of this buffer; None: copy first
        self.scoring = scoring  # the codebook as a quantizing step reads it (scoring_tensors); None until one needs it
        self.step_views = None  # _StepViews of these buffers
        # every filled key row is the row of ``codebook`` (as recorded) that its code names
        self.keys_are_codes = keys_are_codes
        self.keys3 = keys.view(B * Hkv, columns, D)
        self.keys_t = self.keys3.transpose(1, 2)
        self.values3 = values.view(B * Hkv, columns, values.shape[-1])
        self.mask3 = mask.view(B * Hkv, 1, columns)
        self.codes3 = codes.view(B * Hkv, *codes.shape[2:])
        self.prev = (keys.narrow(2, 0, L), values.narrow(2, 0, L), codes.narrow(2, 0, L))
        self.cache_means = values.narrow(2, 2 * L, columns - 2 * L)

    def append(self, p: int, k: torch.Tensor, v: torch.Tensor, codes: torch.Tensor) -> None:
        """Write positions ``p .. p + T - 1`` of the current block: k ``[B Hkv, T, Dk]``,
        v ``[B Hkv, T, Dv]``, codes ``[B Hkv, T(, S)]``."""
        T, row = k.shape[1], self.block_size + p
        self.keys3.narrow(1, row, T).copy_(k)
        self.values3.narrow(1, row, T).copy_(v)
        self.codes3.narrow(1, row, T).copy_(codes)
        self.mask3.narrow(2, row, T).fill_(0.0)
        self.written = p + T

    def append_one(self, p: int, k: torch.Tensor, v: torch.Tensor, codes: torch.Tensor) -> None:
        """``append`` of one position: k ``[B Hkv, Dk]``, v ``[B Hkv, Dv]``, codes ``[B Hkv(, S)]``."""
        row = self.block_size + p
        self.keys3.select(1, row).copy_(k)
        self.values3.select(1, row).copy_(v)
        self.codes3.select(1, row).copy_(codes)
        self.mask3.select(2, row).fill_(0.0)
        self.written = p + 1


def keys_are_rows_of(record, codebook: torch.Tensor) -> bool:
    """Whether ``record`` (``(codebook, version)`` or None) names ``codebook`` as it is now
    (the same tensor, not written since)."""
    return (record is not None and record[0] is codebook and record[1] is not None
            and record[1] == tensor_version(codebook))


def _holds(window: ResidentWindow, codebook: torch.Tensor) -> bool:
    """Whether rows 2L.. hold ``codebook`` as it is now."""
    return keys_are_rows_of(window.codebook, codebook)


def _views_of(window: ResidentWindow | None, state: VQAttentionState, columns: int, dtype) -> bool:
    """Whether ``state``'s fields are still the views of ``window`` that a step made."""
    return (window is not None and window.keys.dtype == dtype and window.keys.shape[2] == columns
            and state.partial_keys._base is window.keys and state.partial_values._base is window.values
            and state.partial_codes._base is window.codes and state.cache_counts is window.counts)


def release(state: VQAttentionState | None) -> None:
    """No step may write into ``state``'s buffer any more (a graph built with gradients on
    reads it: an in-place write would invalidate its backward)."""
    if state is not None and state._resident is not None:
        state._resident.written = None


def window_for(state: VQAttentionState | None, L: int, codebook: torch.Tensor, shape: tuple,
               code_like: torch.Tensor, dtype: torch.dtype) -> ResidentWindow:
    """The buffer the next step of ``state`` writes into: its own when no other step claimed
    the free rows and it holds this codebook, else a new one with the same content.
    ``shape`` = (B, Hkv, Dk, Dv); ``code_like``: a tensor of codes (int64 or soft weights)."""
    p = 0 if state is None else state.partial_keys.shape[2]
    window = None if state is None else state._resident
    S = codebook.shape[-2]
    if state is not None and _views_of(window, state, 2 * L + S, dtype):
        if window.written == p and _holds(window, codebook):
            return window
        window = ResidentWindow(window.keys.clone(), window.values.clone(), window.codes.clone(),
                                window.mask.clone(), window.counts, L,
                                keys_are_codes=window.keys_are_codes and _holds(window, codebook))
    else:
        window = _filled(state, L, S, shape, code_like, dtype, codebook.device)
        window.keys_are_codes = not code_like.is_floating_point() and (
            state is None or keys_are_rows_of(state._keys_from, codebook))
    window.mask[:, :, L + p : 2 * L].fill_(float("-inf"))
    window.keys[:, :, 2 * L :] = codebook.to(dtype)
    window.codebook, window.written, window.scoring = (codebook, tensor_version(codebook)), p, None
    return window


def _filled(state, L, S, shape, code_like, dtype, device) -> ResidentWindow:
    """A buffer holding what ``state``'s fields hold (nothing for None)."""
    B, Hkv, D, E = shape
    window = ResidentWindow(
        torch.zeros(B, Hkv, 2 * L + S, D, dtype=dtype, device=device),
        torch.zeros(B, Hkv, 2 * L + S, E, dtype=dtype, device=device),
        _code_buffer(code_like, B, Hkv, L, S, device),
        torch.zeros(B, Hkv, 2 * L + S, dtype=dtype, device=device),
        torch.zeros(B, Hkv, S, dtype=dtype, device=device) if state is None else state.cache_counts.to(dtype),
        L,
    )
    if state is not None:
        p = state.partial_keys.shape[2]
        for buffer, part, prev in ((window.keys, state.partial_keys, state.prev_keys),
                                   (window.values, state.partial_values, state.prev_values),
                                   (window.codes, state.partial_codes, state.prev_codes)):
            buffer[:, :, L : L + p] = part
            if prev is not None:
                buffer[:, :, :L] = prev
        window.cache_means.copy_(state.cache_means)
    if state is None or state.prev_keys is None:
        window.mask[:, :, :L].fill_(float("-inf"))
    window.mask[:, :, 2 * L :] = log_counts(window.counts)
    return window


def _code_buffer(code_like: torch.Tensor, B: int, Hkv: int, L: int, S: int, device) -> torch.Tensor:
    """Zero codes for both blocks: soft ``[B, Hkv, 2L, S]``, or hard ``[B, Hkv, 2L + S]``
    ending in ``0 .. S - 1`` (the codebook rows' own codes)."""
    if code_like.is_floating_point():
        return torch.zeros(B, Hkv, 2 * L, S, dtype=code_like.dtype, device=device)
    codes = torch.zeros(B, Hkv, 2 * L + S, dtype=torch.int64, device=device)
    codes[:, :, 2 * L :] = torch.arange(S, device=device)
    return codes


def decode(q, k, v, codes, codebook, relative_reversed, L: int, state: VQAttentionState | None, dtype: torch.dtype,
           rerope=None):
    """Gradient-free decode form over the resident buffer.

    q ``[B, Hkv, G, T, Dk]`` (scaled) for positions ``p .. p + T - 1`` of the current block
    (``p + T <= L``); k ``[B, Hkv, T, Dk]``, v ``[B, Hkv, T, Dv]``, codes ``[B, Hkv, T(, S)]``
    in ``dtype``; relative_reversed: None or ``r_delta = b_delta + q.P_delta`` for the offsets
    ``delta = L, L - 1, .., 0`` (reversed: for one query they then match columns ``p .. L + p``),
    ``[B|1, Hkv|1, G|1, T|1, L + 1]``. ``rerope``: ``(w, rotary_base)`` or None: every column
    scored by ``R(w) q`` (the far keys and the codebook), then the window's columns at distance
    ``< w`` by the rotated pair (buffer column c at position c, ``rerope.py``).
    Returns ``(out [B, Hkv, G, T, Dv], new state)``.
    """
    B, Hkv, G, T, D = q.shape
    BH, E = B * Hkv, v.shape[-1]
    p = 0 if state is None else state.partial_keys.shape[2]
    window = window_for(state, L, codebook, (B, Hkv, D, E), codes, dtype)
    window.append(p, k.reshape(BH, T, D), v.reshape(BH, T, E), codes.reshape(BH, T, *codes.shape[3:]))
    rows = q.reshape(BH, G * T, D)
    scores = torch.baddbmm(window.mask3, rows if rerope is None else far_queries(rows, *rerope), window.keys_t)
    if rerope is not None:
        add_near_window(scores.view(B, Hkv, G, T, -1), q, window, L + p + T, rerope)
    if relative_reversed is not None or T > 1:
        grid = scores.view(B, Hkv, G, T, -1)
        if T == 1:
            grid.narrow(-1, p, L + 1).add_(relative_reversed)
        else:
            if relative_reversed is not None:
                grid.narrow(-1, 0, L + p + T).add_(offset_rows(relative_reversed.flip(-1), L + p, T, L + p + T, 0, L))
            later = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # new positions see each other causally
            grid.narrow(-1, L + p, T).masked_fill_(later, float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), window.values3).view(B, Hkv, G, T, E)
    has_prev = state is not None and state.prev_keys is not None
    return out, state_after(window, p + T, has_prev, (0 if state is None else state.steps) + T)


def add_near_window(grid, q, window: ResidentWindow, columns: int, rerope) -> None:
    """Write into ``grid [B, Hkv, G, T, 2L + S]`` (scores by ``R(w) q`` plus the mask) ReRoPE's
    scores plus the mask on the first ``columns`` (window) columns, whose last T rows the
    queries ``q [B, Hkv, G, T, Dk]`` are (``rerope_scores``: the rotated pair at distance < w)."""
    keys = window.keys.narrow(2, 0, columns).unsqueeze(2)
    mask = window.mask.narrow(2, 0, columns)[:, :, None, None, :]
    grid.narrow(-1, 0, columns).copy_(rerope_scores(q, keys, columns - q.shape[-2], 0, *rerope) + mask)


HARD_CODES = torch.zeros((), dtype=torch.int64)  # stands for hard codes where a buffer is made


def scoring_tensors(codebook: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codebook_t [Hkv, Dk, S] in dtype, search_t: the same in float32 (the same tensor
    for float32), norms [Hkv, 1, S] = |c_s|^2 in float32)``."""
    search = codebook.detach().float()
    codebook_t = codebook.detach().to(dtype).transpose(1, 2).contiguous()
    search_t = codebook_t if dtype == torch.float32 else search.transpose(1, 2).contiguous()
    return codebook_t, search_t, search.pow(2).sum(-1).unsqueeze(1)


class _StepViews(NamedTuple):
    """Views of a buffer that a step of ``quantize_and_decode`` reads, made once per buffer
    and group size G: ``code_rows [B, Hkv, S, Dk]`` (rows 2L..), ``index [B, Hkv, G, 2L + S]``
    (the codes, expanded over G) and ``mask4 [B, Hkv, 1, 2L + S]``."""

    group: int
    code_rows: torch.Tensor
    index: torch.Tensor
    mask4: torch.Tensor


def _step_views(window: ResidentWindow, G: int) -> _StepViews:
    views = window.step_views
    if views is None or views.group != G:
        B, Hkv, columns, _ = window.keys.shape
        L = window.block_size
        views = window.step_views = _StepViews(
            G, window.keys.narrow(2, 2 * L, columns - 2 * L),
            window.codes.view(B, Hkv, 1, columns).expand(B, Hkv, G, columns), window.mask.view(B, Hkv, 1, columns))
    return views


def quantizing_step(q, k, v, codebook, state: VQAttentionState | None, scale: float, L: int, bias, position_keys,
                    native: bool, rerope=None):
    """``vq_decode_step`` on checked arguments: q ``[B, H, 1, Dk]``, k ``[B, Hkv, 1, Dk]`` (before
    quantization), v ``[B, Hkv, 1, Dv]``, ``scale`` resolved; the relative terms of the new query
    laid out for ``quantize_and_decode``. ``rerope``: ``(w, rotary_base)`` or None; with it the
    torch form quantizes the key and then attends to it by ``decode`` (its window scores are not
    the codebook scores gathered at the codes), the native step does both in one call. Returns
    ``(out [B, H, 1, Dv] in q's dtype, codes [B, Hkv, 1], new state)``."""
    B, H, _, Dk = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    dtype = compute_dtype(q.dtype)
    queries = as_dtype(q, dtype).reshape(B, Hkv, H // Hkv, Dk)
    relative = None
    if bias is not None or position_keys is not None:
        table, positions_k = relative_inputs(bias, position_keys, H, Hkv, L, Dk, q, dtype)
        relative = reversed_terms(relative_terms(queries.unsqueeze(3) * scale, table, positions_k))
    if rerope is not None and not native:
        out, codes, new_state = _quantize_then_decode(queries * scale, as_dtype(k, dtype), as_dtype(v, dtype), codebook,
                                                      relative, L, state, dtype, rerope)
        return as_dtype(out.view(B, H, 1, Dv), q.dtype), codes, new_state
    out, codes, new_state = quantize_and_decode(
        queries, as_dtype(k, dtype).reshape(B, Hkv, Dk), as_dtype(v, dtype).reshape(B, Hkv, Dv), codebook, scale,
        relative, L, state, dtype, native, rerope)
    return as_dtype(out.view(B, H, 1, Dv), q.dtype), codes.view(B, Hkv, 1), new_state


def quantize_and_decode(q, k, v, codebook, scale: float, relative_reversed, L: int,
                        state: VQAttentionState | None, dtype: torch.dtype, native: bool = False, rerope=None):
    """One new position, quantized and attended to in one pass: ``VectorQuantizer`` then
    ``decode`` with its codes, in fewer operations and one read of the codebook.

    q ``[B, Hkv, G, Dk]`` (not yet scaled by ``scale``) at position ``p`` of the current
    block, k ``[B, Hkv, Dk]`` (the key before quantization), v ``[B, Hkv, Dv]``, all in
    ``dtype``; codebook ``[Hkv, S, Dk]``; relative_reversed as in ``decode`` (T = 1). The code
    is ``z = argmin_s |c_s|^2 - 2 k.c_s`` in float32 (``VectorQuantizer.nearest_codes``).
    Every key in the window is a code, so a query's scores on all columns are its codebook
    scores ``q.c_s`` gathered at the columns' codes (the buffer's hard codes, then
    ``0 .. S - 1``), times ``scale`` (unless the buffer's keys may not be its codes: a state
    from another codebook or rebuilt by hand, whose stored keys are then read); in float32 the
    query rows and the key row are scored against the codebook in one matmul.
    ``native``: the same step as one C++ call (``native.py``; CPU, float32/float64), which
    also takes ``rerope`` (``(w, rotary_base)``, ``decode``'s; None: off).
    Returns ``(out [B, Hkv, G, 1, Dv], codes [B, Hkv], new state)``.
    """
    B, Hkv, G, D = q.shape
    p = 0 if state is None else state.partial_keys.shape[2]
    if state is not None and state.partial_codes.dim() == 4:
        raise ValueError("the state holds soft code assignments (soft_vq_attention); a quantizing step continues "
                         "hard codes only")
    window = window_for(state, L, codebook, (B, Hkv, D, v.shape[-1]), HARD_CODES, dtype)
    if window.scoring is None:
        window.scoring = scoring_tensors(codebook, dtype)
    codebook_t, search_t, norms = window.scoring
    if native:
        return _native_step(window, q, k, v, scale, relative_reversed, p, state, rerope)
    if rerope is not None:
        raise ValueError("quantize_and_decode computes ReRoPE natively only (the torch form is _quantize_then_decode)")
    views = _step_views(window, G)
    if search_t is codebook_t:  # float32: queries and key in one matmul
        rows = torch.cat([q.transpose(0, 1), k.transpose(0, 1).unsqueeze(2)], dim=2)  # [Hkv, B, G + 1, Dk]
        scores = torch.bmm(rows.view(Hkv, B * (G + 1), D), codebook_t).view(Hkv, B, G + 1, -1)
        query_scores, key_scores = scores.narrow(2, 0, G), scores.select(2, G)
    else:
        query_scores = torch.bmm(q.transpose(0, 1).reshape(Hkv, B * G, D), codebook_t).view(Hkv, B, G, -1)
        key_scores = torch.bmm(k.float().transpose(0, 1), search_t)  # [Hkv, B, S]
    codes = torch.add(norms, key_scores, alpha=-2.0).argmin(-1).t()  # [B, Hkv]
    row = L + p
    window.codes.select(2, row).copy_(codes)
    window.mask.select(2, row).fill_(0.0)
    torch.gather(views.code_rows, 2, codes.view(B, Hkv, 1, 1).expand(B, Hkv, 1, D),
                 out=window.keys.narrow(2, row, 1))  # k_hat = codebook[codes], into the buffer
    window.values.select(2, row).copy_(v)
    window.written = p + 1
    if window.keys_are_codes:
        scores = torch.gather(query_scores.transpose(0, 1), 3, views.index)
    else:  # the window's own keys (rows 2L.. hold the codebook)
        scores = q @ window.keys.transpose(2, 3)
    grid = torch.add(views.mask4, scores, alpha=scale)
    if relative_reversed is not None:
        grid.unsqueeze(3).narrow(-1, p, L + 1).add_(relative_reversed)
    out = torch.bmm(torch.softmax(grid, dim=-1).view(B * Hkv, G, -1), window.values3)
    has_prev = state is not None and state.prev_keys is not None
    return out.view(B, Hkv, G, 1, -1), codes, state_after(window, p + 1, has_prev,
                                                          (0 if state is None else state.steps) + 1)


def _quantize_then_decode(q, k, v, codebook, relative_reversed, L: int, state, dtype, rerope):
    """One new position with ReRoPE: the nearest code of k ``[B, Hkv, 1, Dk]`` (in float32, as
    ``quantize_and_decode``), then ``decode`` of q ``[B, Hkv, G, Dk]`` (scaled) on ``codebook[z]``.
    Returns ``(out [B, Hkv, G, 1, Dv], codes [B, Hkv, 1], new state)``."""
    _, search_t, norms = scoring_tensors(codebook, dtype)
    key_scores = torch.bmm(k.float().squeeze(2).transpose(0, 1), search_t)  # [Hkv, B, S]
    codes = torch.add(norms, key_scores, alpha=-2.0).argmin(-1).t().unsqueeze(-1)  # [B, Hkv, 1]
    heads = torch.arange(codebook.shape[0], device=codes.device)[None, :, None]
    k_hat = codebook.detach().to(dtype)[heads, codes]
    out, new_state = decode(q.unsqueeze(3), k_hat, v, codes, codebook, relative_reversed, L, state, dtype, rerope)
    return out, codes, new_state


def _native_step(window: ResidentWindow, q, k, v, scale: float, relative_reversed, p: int, state, rerope=None):
    """``quantize_and_decode``'s step by the native extension, into ``window`` (``rerope``:
    ``(w, rotary_base)`` or None)."""
    B, Hkv, G, _ = q.shape
    L = window.block_size
    codebook_t, search_t, norms = window.scoring
    out = q.new_empty(B, Hkv, G, v.shape[-1])
    codes = torch.empty(B, Hkv, dtype=torch.int64, device=q.device)
    relative = None
    if relative_reversed is not None:  # [..., G|1, 1, L + 1] -> [B, Hkv, G, L + 1] (a broadcast view)
        relative = torch.broadcast_to(relative_reversed, (B, Hkv, G, 1, L + 1)).squeeze(3)
    native.extension().vq_decode_step(q.contiguous(), k.contiguous(), v.contiguous(), search_t, norms.view(Hkv, -1),
                               codebook_t, window.keys, window.values, window.codes, window.mask, L, p, scale,
                               relative, window.keys_are_codes, 0 if rerope is None else rerope[0],
                               None if rerope is None else rotary_frequencies(q.shape[-1], rerope[1], dtype=q.dtype),
                               None, False, out, codes)
    window.written = p + 1
    has_prev = state is not None and state.prev_keys is not None
    return out.view(B, Hkv, G, 1, -1), codes, state_after(window, p + 1, has_prev,
                                                          (0 if state is None else state.steps) + 1)


def state_after(window: ResidentWindow, p: int, has_prev: bool, steps: int) -> VQAttentionState:
    """The state whose current block is the first ``p`` rows of ``window``'s (a completed
    block moves on to a new buffer)."""
    L = window.block_size
    if p == L:
        window, p, has_prev = _next_block(window, has_prev), 0, True
    prev = window.prev if has_prev else (None, None, None)
    state = VQAttentionState(
        partial_keys=window.keys.narrow(2, L, p), partial_values=window.values.narrow(2, L, p),
        partial_codes=window.codes.narrow(2, L, p), cache_counts=window.counts, cache_means=window.cache_means,
        prev_keys=prev[0], prev_values=prev[1], prev_codes=prev[2], steps=steps,
        block_size=L, codebook_size=window.counts.shape[-1],
    )
    state._resident = window
    state._keys_from = window.codebook if window.keys_are_codes else None
    return state


def _next_block(window: ResidentWindow, has_prev: bool) -> ResidentWindow:
    """A new buffer after the current block completed: the previous block enters the cache,
    the completed block becomes the previous one."""
    L = window.block_size
    counts, means = window.counts, window.cache_means
    if has_prev:
        counts, means = fold_block(counts, means, window.prev[2], window.prev[1])
    keys, values = torch.empty_like(window.keys), torch.empty_like(window.values)
    codes, mask = torch.empty_like(window.codes), torch.empty_like(window.mask)
    cached = (window.keys[:, :, 2 * L :], means, window.codes[:, :, 2 * L :])
    for new, old, cache in zip((keys, values, codes), (window.keys, window.values, window.codes), cached):
        new[:, :, :L] = old[:, :, L : 2 * L]  # the completed block, now the previous one
        new[:, :, L : 2 * L] = 0  # the new current block: masked, and finite so that its scores stay -inf
        new[:, :, 2 * L :] = cache
    mask[:, :, :L].fill_(0.0)
    mask[:, :, L : 2 * L].fill_(float("-inf"))
    mask[:, :, 2 * L :].copy_(log_counts(counts))
    return ResidentWindow(keys, values, codes, mask, counts, L, window.codebook, 0, window.scoring,
                          window.keys_are_codes)
