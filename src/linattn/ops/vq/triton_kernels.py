"""Triton kernels of Transformer-VQ attention's causal block form (imported only when used).

Layout (``ops/vq/fused.py`` builds it): positions padded to ``N = R L`` (R blocks of L),
heads ``h = hkv G + g``.

    q      [B, Hkv, G, N, D]    keys/values of the window: k [B, Hkv, N + L, D], v [.., E]
    codebook [Hkv, S, D]        (rows 0..L-1 of k, v: the previous block of block 0)
    logn   [B, Hkv, R, S]       log n_s of the cache block r reads (-inf: empty slot), float32
    means  [B, Hkv, R, S, E]    its mean values m_s, float32
    rel    [B, Hkv, G, N, L+1]  b_delta + scale q.P_delta per row and offset (any strides; optional)

Block r's window holds 2L columns: column w is key row ``r L + w`` of k (w < L: the previous
block, w >= L: the block itself). Query row a of block r sits at offset ``o = L + a - w``
from column w; the column is visible when ``o >= 0`` (and, for w < L, when block r has a
previous block) and carries ``rel[.., r L + a, o]`` when ``o <= L``. The logits are

    window: scale q_a.k_w + rel[a, o]      cache slot s: scale q_a.c_s + logn[r, s]

and the output is their joint softmax applied to (v_w, m_s). Each row of a block reads every
offset 0..L exactly once (0..a in its own block, a+1..L in the previous one), so the
gradient of ``rel`` is written, never accumulated.

Stages (one kernel each): ``forward`` (online softmax over window tiles then codebook
tiles; writes the output and the row log-sum-exp), ``query_grads`` (dq and d rel),
``window_key_grads`` (dk, dv of the window keys: each key block is read by its own block
and, as the previous block, by the next one), ``cache_grads`` (dcodebook partial sums and,
when the cache carries a gradient, d logn and d means). Products take the input dtype
(float32 as IEEE float32, bfloat16/float16 on tensor cores) and accumulate in float32.
``UPCAST`` multiplies in float32 instead: the Triton interpreter computes bfloat16 dots
on the raw bits, so under it the operands are rounded to the input dtype, then widened.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_HEAD_DIM = 256  # largest Dk and Dv the kernels take (one tile holds a whole row)

_NEG = tl.constexpr(-1.0e30)  # running maximum before any column: exp(-inf - _NEG) = 0 without a NaN


@triton.jit
def _dot(a, b, IO: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` with operands rounded to the input dtype, accumulated in float32."""
    a = a.to(IO)
    b = b.to(IO)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _window_logits(q, k, a, w, rel_rows, rel_so, scale, L,
                   HAS_REL: tl.constexpr, IO: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Logits ``[BM, BN]`` of rows a (``[BM]``) on window columns w (``[BN]``), -inf where
    causally hidden; ``rel_rows`` ``[BM]`` points at each row's relative terms (offset 0).
    (Callers never pass the previous-block columns of a block without one.)"""
    s = _dot(q, tl.trans(k), IO, UPCAST, PRECISION) * scale
    o = L + a[:, None] - w[None, :]
    visible = (o >= 0) & (w[None, :] < 2 * L)
    if HAS_REL:
        in_band = visible & (o <= L) & (a[:, None] < L)
        s += tl.load(rel_rows[:, None] + o * rel_so, mask=in_band, other=0.0)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _cache_logits(q, c, logn, scale, IO: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Logits ``[BM, BS]`` on codebook slots: ``scale q.c_s + log n_s``."""
    return _dot(q, tl.trans(c), IO, UPCAST, PRECISION) * scale + logn[None, :]


@triton.jit
def _online_softmax_step(m_i, l_i, acc, s, values, IO: tl.constexpr, UPCAST: tl.constexpr,
                         PRECISION: tl.constexpr):
    """One tile of logits ``s [BM, n]`` and its values ``[n, BE]`` into the running row
    maximum m, sum of exponentials l and unnormalised output acc (rescaled to the new m)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p, values, IO, UPCAST, PRECISION)


@triton.jit
def _window_span(r, a_last, L, HAS_PREV: tl.constexpr):
    """Window columns ``[lo, hi)`` some row <= a_last of block r can see."""
    lo = 0
    if not HAS_PREV:
        lo = tl.where(r > 0, 0, L)
    hi = tl.minimum(2 * L, L + a_last + 1)
    return lo, hi


@triton.jit
def _rows(PTR, rows, ok, cols, width):
    """``PTR[rows, cols]`` of a row-major array ``[*, width]``, zero for rows where ``ok`` is
    False and for columns past ``width``."""
    return tl.load(PTR + rows[:, None] * width + cols[None, :], mask=ok[:, None] & (cols[None, :] < width), other=0.0)


@triton.jit
def _query_tile(Q, H, G, Hkv, R, L, D, BM: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):
    """Where a (query tile, batch x head) program stands, and its queries: block r, rows a of
    the block (the last one a_last), the head indices, positions t, and q ``[BM, BD]``."""
    tiles = tl.cdiv(L, BM)
    r = tl.program_id(0) // tiles
    a_first = (tl.program_id(0) % tiles) * BM
    a = a_first + tl.arange(0, BM)
    bh = tl.program_id(1).to(tl.int64)  # offsets in int64: B H N D may pass 2^31
    b, h = bh // H, bh % H
    hkv, g = h // G, h % G
    bkv = b * Hkv + hkv
    N = R * L
    d, e = tl.arange(0, BD), tl.arange(0, BE)
    rows_ok = a < L
    t = r * L + a
    q = tl.load(Q + (bh * N + t[:, None]) * D + d[None, :], mask=rows_ok[:, None] & (d[None, :] < D), other=0.0)
    return r, a, a_first + BM - 1, bh, b, hkv, g, bkv, N, d, e, rows_ok, t, q


@triton.jit
def forward_kernel(Q, K, V, C, LOGN, MEANS, REL, OUT, LSE,
                   rel_sb, rel_sh, rel_sg, rel_st, rel_so,
                   scale, H, G, Hkv, R, L, S, D, E,
                   HAS_PREV: tl.constexpr, HAS_REL: tl.constexpr, IO: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):
    """One program per (query tile of a block, batch x head): the output rows and their
    log-sum-exp, by an online softmax over the window tiles and then the codebook tiles."""
    r, a, a_last, bh, b, hkv, g, bkv, N, d, e, rows_ok, t, q = _query_tile(Q, H, G, Hkv, R, L, D, BM, BD, BE)
    rel_rows = REL + b * rel_sb + hkv * rel_sh + g * rel_sg + t * rel_st

    m_i = tl.full([BM], _NEG, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BE], tl.float32)
    lo, hi = _window_span(r, a_last, L, HAS_PREV)
    for start in range(lo, hi, BN):
        w = start + tl.arange(0, BN)
        key_rows = bkv * (N + L) + r * L + w
        cols_ok = w < hi
        k = _rows(K, key_rows, cols_ok, d, D)
        v = _rows(V, key_rows, cols_ok, e, E)
        s = _window_logits(q, k, a, w, rel_rows, rel_so, scale, L, HAS_REL, IO, UPCAST, PRECISION)
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v, IO, UPCAST, PRECISION)
    cache = bkv * R + r
    for start in range(0, S, BS):
        slots = start + tl.arange(0, BS)
        slots_ok = slots < S
        c = _rows(C, hkv * S + slots, slots_ok, d, D)
        logn = tl.load(LOGN + cache * S + slots, mask=slots_ok, other=float("-inf"))
        mu = _rows(MEANS, cache * S + slots, slots_ok, e, E)
        s = _cache_logits(q, c, logn, scale, IO, UPCAST, PRECISION)
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, mu, IO, UPCAST, PRECISION)
    out = acc / l_i[:, None]
    tl.store(OUT + (bh * N + t[:, None]) * E + e[None, :], out.to(IO), mask=rows_ok[:, None] & (e[None, :] < E))
    tl.store(LSE + bh * N + t, m_i + tl.log(l_i), mask=rows_ok)


@triton.jit
def query_grads_kernel(Q, K, V, C, LOGN, MEANS, REL, DO, LSE, DELTA, DQ, DREL,
                       rel_sb, rel_sh, rel_sg, rel_st, rel_so,
                       scale, H, G, Hkv, R, L, S, D, E,
                       HAS_PREV: tl.constexpr, HAS_REL: tl.constexpr, REL_GRAD: tl.constexpr, IO: tl.constexpr,
                       UPCAST: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BS: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):
    """Same grid as the forward: ``dq = scale sum_j dS_ij k_j`` over window columns and
    codebook slots (``dS = P (dP - delta)``, ``dP = do.v``, ``delta = do.o``); the window's
    dS in the band ``0 <= o <= L`` is the gradient of ``rel`` (float32 ``[B, Hkv, G, N, L+1]``)."""
    r, a, a_last, bh, b, hkv, g, bkv, N, d, e, rows_ok, t, q = _query_tile(Q, H, G, Hkv, R, L, D, BM, BD, BE)
    do = tl.load(DO + (bh * N + t[:, None]) * E + e[None, :], mask=rows_ok[:, None] & (e[None, :] < E), other=0.0)
    lse = tl.load(LSE + bh * N + t, mask=rows_ok, other=0.0)
    delta = tl.load(DELTA + bh * N + t, mask=rows_ok, other=0.0)
    rel_rows = REL + b * rel_sb + hkv * rel_sh + g * rel_sg + t * rel_st
    drel_rows = DREL + (bh * N + t) * (L + 1)

    dq = tl.zeros([BM, BD], tl.float32)
    lo, hi = _window_span(r, a_last, L, HAS_PREV)
    for start in range(lo, hi, BN):
        w = start + tl.arange(0, BN)
        key_rows = bkv * (N + L) + r * L + w
        cols_ok = w < hi
        k = _rows(K, key_rows, cols_ok, d, D)
        v = _rows(V, key_rows, cols_ok, e, E)
        s = _window_logits(q, k, a, w, rel_rows, rel_so, scale, L, HAS_REL, IO, UPCAST, PRECISION)
        p = tl.exp(s - lse[:, None])
        ds = p * (_dot(do, tl.trans(v), IO, UPCAST, PRECISION) - delta[:, None])
        dq += _dot(ds, k, IO, UPCAST, PRECISION)
        if REL_GRAD:
            o = L + a[:, None] - w[None, :]
            in_band = (o >= 0) & (o <= L) & rows_ok[:, None] & (w[None, :] < hi)
            tl.store(drel_rows[:, None] + o, ds, mask=in_band)
    cache = bkv * R + r
    for start in range(0, S, BS):
        slots = start + tl.arange(0, BS)
        slots_ok = slots < S
        c = _rows(C, hkv * S + slots, slots_ok, d, D)
        logn = tl.load(LOGN + cache * S + slots, mask=slots_ok, other=float("-inf"))
        mu = _rows(MEANS, cache * S + slots, slots_ok, e, E)
        p = tl.exp(_cache_logits(q, c, logn, scale, IO, UPCAST, PRECISION) - lse[:, None])
        ds = p * (_dot(do, tl.trans(mu), IO, UPCAST, PRECISION) - delta[:, None])
        dq += _dot(ds, c, IO, UPCAST, PRECISION)
    tl.store(DQ + (bh * N + t[:, None]) * D + d[None, :], dq * scale, mask=rows_ok[:, None] & (d[None, :] < D))


@triton.jit
def _key_tile_grads(dk, dv, k, v, r, w, row_start, bh, hkv, g, b,
                    Q, DO, LSE, DELTA, REL, rel_sb, rel_sh, rel_sg, rel_st, rel_so, scale, N, L, D, E,
                    HAS_REL: tl.constexpr, IO: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    BM: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):
    """Add to ``dk [BN, BD]``, ``dv [BN, BE]`` what rows ``row_start..L-1`` of block r (head
    bh) send to the keys in window columns w: ``dv += P^T do``, ``dk += dS^T q`` (unscaled)."""
    d, e = tl.arange(0, BD), tl.arange(0, BE)
    for start in range(row_start, L, BM):
        a = start + tl.arange(0, BM)
        rows_ok = a < L
        t = r * L + a
        q = tl.load(Q + (bh * N + t[:, None]) * D + d[None, :], mask=rows_ok[:, None] & (d[None, :] < D), other=0.0)
        do = tl.load(DO + (bh * N + t[:, None]) * E + e[None, :], mask=rows_ok[:, None] & (e[None, :] < E),
                     other=0.0)
        lse = tl.load(LSE + bh * N + t, mask=rows_ok, other=0.0)
        delta = tl.load(DELTA + bh * N + t, mask=rows_ok, other=0.0)
        rel_rows = REL + b * rel_sb + hkv * rel_sh + g * rel_sg + t * rel_st
        s = _window_logits(q, k, a, w, rel_rows, rel_so, scale, L, HAS_REL, IO, UPCAST, PRECISION)
        p = tl.where(rows_ok[:, None], tl.exp(s - lse[:, None]), 0.0)
        dv += _dot(tl.trans(p), do, IO, UPCAST, PRECISION)
        ds = p * (_dot(do, tl.trans(v), IO, UPCAST, PRECISION) - delta[:, None])
        dk += _dot(tl.trans(ds), q, IO, UPCAST, PRECISION)
    return dk, dv


@triton.jit
def window_key_grads_kernel(Q, K, V, REL, DO, LSE, DELTA, DK, DV,
                            rel_sb, rel_sh, rel_sg, rel_st, rel_so,
                            scale, H, G, Hkv, R, L, D, E,
                            HAS_PREV: tl.constexpr, PREV_GRAD: tl.constexpr, HAS_REL: tl.constexpr,
                            IO: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):
    """One program per (key tile of key block j = 0..R of k, batch x kv head): key block j
    is block j - 1 (row 0: the previous block of block 0), read by block j - 1 as its own
    (causal: rows a >= the key's column) and, unless ``PREV_GRAD`` is off (grad_scope
    "state"), by block j as its previous block. float32 dk ``[B, Hkv, N + L, D]``, dv."""
    tiles = tl.cdiv(L, BN)
    j = tl.program_id(0) // tiles
    c = (tl.program_id(0) % tiles) * BN + tl.arange(0, BN)
    bkv = tl.program_id(1).to(tl.int64)
    b, hkv = bkv // Hkv, bkv % Hkv
    N = R * L
    d, e = tl.arange(0, BD), tl.arange(0, BE)
    keys_ok = c < L
    key_rows = bkv * (N + L) + j * L + c
    k = _rows(K, key_rows, keys_ok, d, D)
    v = _rows(V, key_rows, keys_ok, e, E)
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BE], tl.float32)
    for g in range(G):
        bh = b * H + hkv * G + g
        if j >= 1:  # own block of block j - 1: rows before the tile's first key see none of it
            first_row = (tl.program_id(0) % tiles) * BN // BM * BM
            dk, dv = _key_tile_grads(dk, dv, k, v, j - 1, L + c, first_row, bh, hkv, g, b,
                                     Q, DO, LSE, DELTA, REL, rel_sb, rel_sh, rel_sg, rel_st, rel_so, scale, N, L,
                                     D, E, HAS_REL, IO, UPCAST, PRECISION, BM, BD, BE)
        if PREV_GRAD:  # previous block of block j (block 0's only if it has one)
            if (j < R) & ((j > 0) | HAS_PREV):
                dk, dv = _key_tile_grads(dk, dv, k, v, j, c, 0, bh, hkv, g, b,
                                         Q, DO, LSE, DELTA, REL, rel_sb, rel_sh, rel_sg, rel_st, rel_so, scale, N,
                                         L, D, E, HAS_REL, IO, UPCAST, PRECISION, BM, BD, BE)
    tl.store(DK + key_rows[:, None] * D + d[None, :], dk * scale, mask=keys_ok[:, None] & (d[None, :] < D))
    tl.store(DV + key_rows[:, None] * E + e[None, :], dv, mask=keys_ok[:, None] & (e[None, :] < E))


@triton.jit
def cache_grads_kernel(Q, C, LOGN, MEANS, DO, LSE, DELTA, DC, DLOGN, DMEANS,
                       scale, pairs, pairs_per_split, H, G, Hkv, R, L, S, D, E,
                       MEANS_GRAD: tl.constexpr, IO: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                       BM: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):
    """One program per (codebook tile, kv head, split of the (batch, block) pairs):
    ``dc_s = scale sum_i dS_is q_i`` over the split's rows (float32 partial sums
    ``[splits, Hkv, S, D]``, added up in a fixed order by the caller; ``pairs = B R``); with ``MEANS_GRAD``
    also ``d logn[b, r, s] = sum_i dS_is`` and ``d means[b, r, s] = sum_i P_is do_i`` over
    block r's rows of every query head of the kv head."""
    slots = tl.program_id(0) * BS + tl.arange(0, BS)
    hkv = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    slots_ok = slots < S
    N = R * L
    d, e = tl.arange(0, BD), tl.arange(0, BE)
    c = _rows(C, hkv * S + slots, slots_ok, d, D)
    dc = tl.zeros([BS, BD], tl.float32)
    first = split * pairs_per_split
    last = tl.minimum(first + pairs_per_split, pairs)
    for pair in range(first, last):
        b, r = pair // R, pair % R  # (int64 offsets below through hkv)
        cache = (b * Hkv + hkv) * R + r
        logn = tl.load(LOGN + cache * S + slots, mask=slots_ok, other=float("-inf"))
        mu = _rows(MEANS, cache * S + slots, slots_ok, e, E)
        dmu = tl.zeros([BS, BE], tl.float32)
        dlogn = tl.zeros([BS], tl.float32)
        for g in range(G):
            bh = b * H + hkv * G + g
            for start in range(0, L, BM):
                a = start + tl.arange(0, BM)
                rows_ok = a < L
                t = r * L + a
                q = tl.load(Q + (bh * N + t[:, None]) * D + d[None, :], mask=rows_ok[:, None] & (d[None, :] < D),
                            other=0.0)
                do = tl.load(DO + (bh * N + t[:, None]) * E + e[None, :], mask=rows_ok[:, None] & (e[None, :] < E),
                             other=0.0)
                lse = tl.load(LSE + bh * N + t, mask=rows_ok, other=0.0)
                delta = tl.load(DELTA + bh * N + t, mask=rows_ok, other=0.0)
                p = tl.exp(_cache_logits(q, c, logn, scale, IO, UPCAST, PRECISION) - lse[:, None])
                p = tl.where(rows_ok[:, None], p, 0.0)
                ds = p * (_dot(do, tl.trans(mu), IO, UPCAST, PRECISION) - delta[:, None])
                dc += _dot(tl.trans(ds), q, IO, UPCAST, PRECISION)
                if MEANS_GRAD:
                    dmu += _dot(tl.trans(p), do, IO, UPCAST, PRECISION)
                    dlogn += tl.sum(ds, 0)
        if MEANS_GRAD:
            tl.store(DLOGN + cache * S + slots, dlogn, mask=slots_ok)
            tl.store(DMEANS + (cache * S + slots[:, None]) * E + e[None, :], dmu,
                     mask=slots_ok[:, None] & (e[None, :] < E))
    tl.store(DC + ((split * Hkv + hkv) * S + slots[:, None]) * D + d[None, :], dc * scale,
             mask=slots_ok[:, None] & (d[None, :] < D))


# -- launchers ------------------------------------------------------------------------------

_CACHE_PROGRAMS = 256  # programs the codebook-gradient kernel aims for (splits of the (batch, block) pairs)
_MOST_ROWS = 64  # the largest tile side over query rows, window columns and codebook slots


def interpreted() -> bool:
    """Whether these kernels, and Triton's own library functions they call, run in the
    interpreter (TRITON_INTERPRET=1 when each was imported)."""
    return not any(isinstance(f, triton.runtime.JITFunction) for f in (forward_kernel, tl.standard.cdiv))


def _tile(n: int, most: int) -> int:
    """A power-of-two tile for n (at least 16, the smallest ``tl.dot`` operand side)."""
    return min(most, max(16, triton.next_power_of_2(n)))


_IO = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


_SMALL_SHARED = 160 * 1024  # below this much shared memory per block (sm_86, sm_89), tiles are halved


def compile_options(dtype: torch.dtype, L: int, S: int, D: int, E: int, interpreted: bool,
                    shared_bytes: int | None = None) -> dict:
    """The compile-time constants every kernel gets for these sizes: the input dtype, how
    products are taken, and the tiles: whole rows of Dk, Dv; query rows, window columns and
    codebook slots in tiles of 64, or 32 where a row of 64 elements would pass 256 bytes,
    halved again on devices with less than 160 KiB of shared memory per block
    (``shared_bytes``; None: as much as sm_80 and sm_90 have). tools/compile_vq_kernels.py
    compiles them for sm_80, sm_86 and sm_90 within each one's shared memory."""
    BD, BE = _tile(D, MAX_HEAD_DIM), _tile(E, MAX_HEAD_DIM)
    row_bytes = max(BD, BE) * (4 if dtype == torch.float32 else 2)
    rows = _MOST_ROWS if row_bytes <= 256 else _MOST_ROWS // 2
    if shared_bytes is not None and shared_bytes < _SMALL_SHARED:
        rows //= 2
    return dict(IO=_IO[dtype], UPCAST=interpreted and dtype == torch.bfloat16,
                PRECISION="ieee" if dtype == torch.float32 else None, BD=BD, BE=BE,
                BM=_tile(L, rows), BN=_tile(L, rows), BS=_tile(S, rows))


@functools.cache
def _shared_bytes(device: torch.device) -> int | None:
    """Shared memory a block may use on a CUDA device (None elsewhere)."""
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)


def _options(q, k, v, codebook, L):
    """Shapes, and the compile-time options split into (dtype and row tiles, other tiles)."""
    B, Hkv, G, N, D = q.shape
    E, S = v.shape[-1], codebook.shape[1]
    dims = dict(H=Hkv * G, G=G, Hkv=Hkv, R=N // L, L=L, D=D, E=E)
    constants = compile_options(q.dtype, L, S, D, E, interpreted(), _shared_bytes(q.device))
    tiles = {name: constants.pop(name) for name in ("BM", "BN", "BS")}
    return B, S, dims, constants, tiles


def _rel_arguments(rel, like):
    """The relative terms' pointer and strides (a dummy pointer without them)."""
    if rel is None:
        return (like, 0, 0, 0, 0, 0), False
    return (rel, *rel.stride()), True


def forward(q, k, v, codebook, logn, means, rel, scale, L, has_prev):
    """Output ``[B, Hkv, G, N, E]`` (q's dtype) and row log-sum-exp ``[B, Hkv, G, N]`` (float32)."""
    B, S, dims, constants, tiles = _options(q, k, v, codebook, L)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    (rel, *rel_strides), has_rel = _rel_arguments(rel, q)
    grid = (dims["R"] * triton.cdiv(L, tiles["BM"]), B * dims["H"])
    forward_kernel[grid](q, k, v, codebook, logn, means, rel, out, lse, *rel_strides, scale, S=S, **dims,
                         HAS_PREV=has_prev, HAS_REL=has_rel, **constants, **tiles)
    return out, lse


def query_grads(q, k, v, codebook, logn, means, rel, d_out, lse, delta, scale, L, has_prev, rel_grad):
    """dq ``[B, Hkv, G, N, D]`` and d rel ``[B, Hkv, G, N, L + 1]`` (float32; None unless ``rel_grad``)."""
    B, S, dims, constants, tiles = _options(q, k, v, codebook, L)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    d_rel = torch.zeros(*q.shape[:-1], L + 1, dtype=torch.float32, device=q.device) if rel_grad else dq
    (rel, *rel_strides), has_rel = _rel_arguments(rel, q)
    grid = (dims["R"] * triton.cdiv(L, tiles["BM"]), B * dims["H"])
    query_grads_kernel[grid](q, k, v, codebook, logn, means, rel, d_out, lse, delta, dq, d_rel, *rel_strides,
                             scale, S=S, **dims, HAS_PREV=has_prev, HAS_REL=has_rel, REL_GRAD=rel_grad,
                             **constants, **tiles)
    return dq, (d_rel if rel_grad else None)


def window_key_grads(q, k, v, codebook, logn, means, rel, d_out, lse, delta, scale, L, has_prev, prev_grad):
    """dk ``[B, Hkv, N + L, D]`` and dv ``[B, Hkv, N + L, E]`` (float32)."""
    B, S, dims, constants, tiles = _options(q, k, v, codebook, L)
    dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    (rel, *rel_strides), has_rel = _rel_arguments(rel, q)
    grid = ((dims["R"] + 1) * triton.cdiv(L, tiles["BN"]), B * dims["Hkv"])
    window_key_grads_kernel[grid](q, k, v, rel, d_out, lse, delta, dk, dv, *rel_strides, scale, **dims,
                                  HAS_PREV=has_prev, PREV_GRAD=prev_grad, HAS_REL=has_rel, **constants,
                                  BM=tiles["BM"], BN=tiles["BN"])
    return dk, dv


def cache_grads(q, k, v, codebook, logn, means, rel, d_out, lse, delta, scale, L, means_grad):
    """d codebook ``[Hkv, S, D]`` (float32, the splits' partial sums added in order) and,
    with ``means_grad``, d logn ``[B, Hkv, R, S]`` and d means ``[B, Hkv, R, S, E]``."""
    B, S, dims, constants, tiles = _options(q, k, v, codebook, L)
    Hkv, R = dims["Hkv"], dims["R"]
    pairs = B * R
    slot_tiles = triton.cdiv(S, tiles["BS"])
    per_split = triton.cdiv(pairs, max(1, min(pairs, _CACHE_PROGRAMS // (Hkv * slot_tiles))))
    splits = triton.cdiv(pairs, per_split)
    d_parts = torch.empty(splits, Hkv, S, q.shape[-1], dtype=torch.float32, device=q.device)
    d_logn = torch.empty_like(logn) if means_grad else d_parts
    d_means = torch.empty_like(means) if means_grad else d_parts
    grid = (slot_tiles, Hkv, splits)
    cache_grads_kernel[grid](q, codebook, logn, means, d_out, lse, delta, d_parts, d_logn, d_means, scale, pairs,
                             per_split, S=S, **dims, MEANS_GRAD=means_grad, **constants, BM=tiles["BM"],
                             BS=tiles["BS"])
    return d_parts.sum(0), (d_logn if means_grad else None), (d_means if means_grad else None)
