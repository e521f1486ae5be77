"""The block form for a few new positions inside the current block (a decoding step with
gradients on): only the new queries are scored.
"""

from __future__ import annotations

import torch

from ..common.bias import offset_rows
from ..common.rotary import far_queries, rerope_scores
from .cache import fold_block, log_counts
from .codebook import codebook_scores
from .relative import relative_terms
from .tensors import as_dtype, detached_if, owned


def decode_form(q, k, v, codes, codebook, table, positions_k, L, scope, state, dtype, rerope=None):
    """The block form for T new positions that stay inside the current block (``p + T <= L``),
    e.g. one generated token: only the new queries are scored, against the previous block,
    the current block so far and the S cache slots, ``[T, L + p + T + S]`` scores instead of
    the block form's ``[L, 2L + S]``, each group read in place (no concatenated copy of the
    keys, values or cache). The cache (counts and means) is used as it is and changes only
    when the block completes: then the previous block enters it and the completed block
    becomes the previous one. Same arguments and result as ``block_form``. ``rerope``: ``(w,
    rotary_base)`` or None: the window's two score products merged by ``i - j < w`` (positions
    from the previous block's first), the cache scored by ``R(w) q`` (``rerope.py``).
    """
    B, Hkv, G, T, D = q.shape
    E, S = v.shape[-1], codebook.shape[1]
    cut = scope == "state"  # nothing from an earlier block carries a gradient
    if state is None:
        p, has_prev = 0, False
        counts, means = q.new_zeros(B, Hkv, S), q.new_zeros(B, Hkv, S, E)
        k, v, codes = owned(k, v, codes)
    else:
        p, has_prev = state.partial_keys.shape[2], state.prev_keys is not None
        if p:
            k = torch.cat([as_dtype(state.partial_keys, dtype), k], dim=2)
            v = torch.cat([as_dtype(state.partial_values, dtype), v], dim=2)
            codes = torch.cat([as_dtype(state.partial_codes, codes.dtype), codes], dim=2)
        else:
            k, v, codes = owned(k, v, codes)
        counts = detached_if(as_dtype(state.cache_counts, dtype), cut)
        means = detached_if(as_dtype(state.cache_means, dtype), cut)
    rows = q.reshape(B, Hkv, G * T, D)
    if has_prev:
        prev = (detached_if(as_dtype(state.prev_keys, dtype), cut),
                detached_if(as_dtype(state.prev_values, dtype), cut), state.prev_codes)
    first = (L if has_prev else 0) + p  # offset i - j of query 0 and window column 0
    if rerope is None:
        window = [rows @ k.transpose(-1, -2)]  # [B, Hkv, G T, p + T]
        if has_prev:
            window.insert(0, rows @ prev[0].transpose(-1, -2))
        window = torch.cat(window, dim=-1).reshape(B, Hkv, G, T, -1)
    else:  # the previous block at positions 0 .. L - 1, the current one from L
        keys = torch.cat([prev[0], k], dim=2) if has_prev else k
        window = rerope_scores(q, keys.unsqueeze(2), L + p, L - first + p, *rerope)
        rows = far_queries(rows, *rerope)  # the cache's keys are all at distance w
    columns = first + T
    relative = relative_terms(q, table, positions_k)
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
    return out, {"partial": owned(k[:, :, :0], v[:, :, :0], codes[:, :, :0]), "prev": (k, v, codes),
                 "cache": (counts, means)}
