"""Reformer's LSH attention: shared query/key, hashed into buckets, attention within chunks.

Per hash round r: ``b_i = argmax([x_i R_r ; -x_i R_r])`` with ``x_i = qk_i / |qk_i|`` and a
random rotation ``R_r [D, n_buckets / 2]``; positions are sorted by (bucket, position) and cut
into chunks of ``bucket_size``; every query attends to the keys (``qk / |qk|``) of its own
chunk and of the previous one (wrapping around), with
- padded positions masked, ``j > i`` masked when causal,
- a token's own key scored ``-1e5``: used only when it has nothing else to attend to.
Each round gives an output and a log-sum-exp per position; the rounds are combined with
weights ``softmax_r(lse_r)``, which is exact attention over the union of the rounds' keys
when no key is seen twice. Time and memory O(n_hashes * T * bucket_size).

With ``bucket_size >= T`` there is one chunk and the result is exact attention with the
self-mask rule. Which keys share a chunk depends on every token's bucket, so outputs are
causal in their gradients (the Jacobian w.r.t. later positions is zero) but the chunk
membership itself is a discrete function of the whole sequence, as in the Reformer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._checks import check_batch, check_bool, check_positive_int, check_same_dtype_device, check_tensor, compute_dtype

SELF_SCORE = -1e5


def lsh_attention(
    qk: torch.Tensor,
    v: torch.Tensor,
    *,
    n_hashes: int = 4,
    bucket_size: int = 64,
    causal: bool = True,
    seed: int | None = None,
) -> torch.Tensor:
    """LSH attention (Reformer): shared queries and keys hashed into buckets, attention within chunks.

    Args:
        qk: the shared queries and keys, ``[B, H, T, D]`` (the keys are ``qk / |qk|``).
        v: the values, ``[B, H, T, Dv]``.
        n_hashes: hash rounds, each with its own random rotation; their outputs are combined
            by their log-sum-exps (more rounds: fewer keys missed, more time).
        bucket_size: the chunk length C: a query sees the keys of its own chunk and of the
            previous one in the sorted order (``bucket_size >= T``: exact attention).
        causal: mask keys after the query (``j > i``).
        seed: fixes the random rotations; ``None`` draws them from torch's global RNG.

    Returns:
        ``[B, H, T, Dv]`` in qk's dtype.
    """
    qk = check_tensor("qk", qk, ndim=4, layout="[batch, heads, length, dim]")
    v = check_tensor("v", v, ndim=4, layout="[batch, heads, length, value_dim]")
    check_same_dtype_device(qk=qk, v=v)
    if v.shape[:3] != qk.shape[:3]:
        raise ValueError(f"v has shape {list(v.shape)}, expected [{', '.join(map(str, qk.shape[:3]))}, Dv]")
    B, H, T, D = qk.shape
    check_batch("qk", qk)
    if T == 0:
        raise ValueError(f"qk has length 0 (shape {list(qk.shape)}); at least one position is required")
    n_hashes = check_positive_int("n_hashes", n_hashes)
    C = check_positive_int("bucket_size", bucket_size)
    check_bool("causal", causal)
    dtype = compute_dtype(qk.dtype)
    n_chunks = -(-T // C)
    Tp = n_chunks * C
    n_buckets = max(2, n_chunks + n_chunks % 2)

    queries = F.pad(qk.to(dtype), (0, 0, 0, Tp - T))
    keys = F.normalize(queries, dim=-1)
    values = F.pad(v.to(dtype), (0, 0, 0, Tp - T))
    generator = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
    rotations = torch.randn(n_hashes, D, n_buckets // 2, generator=generator, dtype=torch.float64)
    rotations = rotations.to(device=qk.device, dtype=dtype)
    outs, lses = [], []
    for rotation in rotations:  # one hash round at a time keeps the temporaries small
        out, lse = _round(queries, keys, values, rotation, T, C, causal)
        outs.append(out)
        lses.append(lse)
    weights = torch.softmax(torch.stack(lses), dim=0).unsqueeze(-1)  # combine rounds by log-sum-exp
    return (weights * torch.stack(outs)).sum(0)[:, :, :T].to(qk.dtype)


def _round(queries, keys, values, rotation, T, C, causal):
    """One hash round: ``(out [B, H, Tp, E], lse [B, H, Tp])`` in position order."""
    B, H, Tp, D = queries.shape
    E = values.shape[-1]
    n_chunks, n_buckets = Tp // C, 2 * rotation.shape[-1]
    with torch.no_grad():
        rotated = keys @ rotation  # [B, H, Tp, n_buckets / 2]
        buckets = torch.cat([rotated, -rotated], dim=-1).argmax(-1)
        positions = torch.arange(Tp, device=queries.device)
        buckets = buckets.masked_fill(positions >= T, n_buckets)  # padding sorts last
        order = (buckets * Tp + positions).argsort(dim=-1)  # sort by (bucket, position)
    gather = lambda x: torch.gather(x, 2, order.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))  # noqa: E731
    q_sorted = gather(queries).reshape(B, H, n_chunks, C, D)
    k_window = gather(keys).reshape(B, H, n_chunks, C, D)
    v_window = gather(values).reshape(B, H, n_chunks, C, E)
    pos = order.reshape(B, H, n_chunks, C)
    pos_window = pos
    if n_chunks > 1:  # own chunk + the previous one (wrapping around)
        look_back = lambda x: torch.cat([x, x.roll(1, dims=2)], dim=3)  # noqa: E731
        k_window, v_window, pos_window = look_back(k_window), look_back(v_window), look_back(pos)
    scores = q_sorted @ k_window.transpose(-1, -2) * D ** -0.5  # [B, H, n_chunks, C, 2C or C]
    query_pos, key_pos = pos.unsqueeze(-1), pos_window.unsqueeze(-2)
    scores = scores.masked_fill(key_pos == query_pos, SELF_SCORE)
    hidden = key_pos >= T
    if causal:
        hidden = hidden | (key_pos > query_pos)
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out_sorted = (torch.exp(scores - lse) @ v_window).reshape(B, H, Tp, E)
    # Unsort: sorted slot p belongs to position order[p].
    out = torch.zeros_like(out_sorted).scatter(2, order.unsqueeze(-1).expand(-1, -1, -1, E), out_sorted)
    lse = torch.zeros(B, H, Tp, dtype=lse.dtype, device=lse.device).scatter(2, order, lse.reshape(B, H, Tp))
    return out, lse
