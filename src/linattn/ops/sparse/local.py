"""Sliding-window (local) attention, computed in blocks: O(T * window) time and memory.

Query i attends exactly to the keys j with

    -look_forward * window <= i - j < look_backward * window

(causal: ``look_forward = 0``, so the last ``look_backward * window`` keys including its own).
Positions are cut into blocks of ``window``; a query block scores only the key blocks
``b - look_backward .. b + look_forward`` and masks the exact window inside them, so no
T x T tensor is ever built. The decode state is the last ``look_backward * window - 1``
keys and values: generation with a local layer is constant-memory.

ReRoPE (``rerope=w``, causal; ``ops/common/rotary.py``): q and k come unrotated and the score
of query i on key j is ``(R(min(i - j, w)) q_i).k_j``. In a block the queries are rotated by
their row's position and the keys by their column's, ``(R(i) q).(R(j) k)``, for the pairs with
``i - j < w``, and ``(R(w) q).k`` scores the others (only computed when the window of keys a
query sees reaches past w); the state keeps the keys unrotated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...state import KVCacheState
from ..common.rotary import far_queries, positions, rerope_scores, rotate_at
from ..._checks import (
    check_bool,
    check_int,
    check_positive_int,
    check_qkv,
    check_rerope,
    check_state_tensor,
    compute_dtype,
    resolve_scale,
)

_ROWS_PER_STEP = 1024  # query rows scored together


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    causal: bool = True,
    look_backward: int = 1,
    look_forward: int = 0,
    scale: float | None = None,
    initial_state: KVCacheState | None = None,
    output_final_state: bool = False,
    rerope: int | None = None,
    rotary_base: float = 10000.0,
) -> tuple[torch.Tensor, KVCacheState | None]:
    """Exact softmax attention restricted to a sliding window.

    Args:
        q: the queries, ``[B, H, T, Dk]``.
        k: the keys, ``[B, Hkv, T, Dk]``, ``H % Hkv == 0``.
        v: the values, ``[B, Hkv, T, Dv]``.
        window: block length W; query i sees keys j with
            ``-look_forward * W <= i - j < look_backward * W``.
        causal: requires ``look_forward == 0`` (the default).
        look_backward: how many windows back (>= 1).
        look_forward: how many windows ahead (>= 0; 0 when causal).
        scale: ``None`` = ``Dk^-1/2``.
        initial_state: (causal only) a ``KVCacheState`` with the last
            ``look_backward * W - 1`` keys and values; it records ``window = look_backward * W``
            and continues only a call over that many keys.
        output_final_state: (causal only) also return that state after this call.
        rerope: ReRoPE's window w (an int >= 1) or None (off; causal only): q and k are passed
            unrotated and the score of query i on key j is ``scale (R(min(i - j, w)) q_i).k_j``,
            R the rotary rotation with ``rotary_base`` (a number > 1); positions continue across
            calls through the state (which keeps unrotated keys). ``w >= look_backward * W`` is
            rotary attention in the window.
        rotary_base: the base of the rotary frequencies with ``rerope`` (a number > 1).


    Returns:
        ``(out [B, H, T, Dv] in q's dtype, state or None)``.
    """
    shapes = check_qkv(q, k, v)
    window = check_positive_int("window", window)
    look_backward = check_positive_int("look_backward", look_backward)
    look_forward = check_int("look_forward", look_forward, minimum=0)
    check_bool("causal", causal)
    rerope = check_rerope(rerope, rotary_base, shapes.key_dim)
    if rerope is not None and not causal:
        raise ValueError("rerope is ReRoPE's causal relative position min(i - j, w) (i >= j): it needs causal=True")
    if causal and look_forward:
        raise ValueError(f"causal=True needs look_forward=0 (a query cannot see later keys), got {look_forward}")
    if not causal and (initial_state is not None or output_final_state):
        raise ValueError("a state is only defined for causal local attention")
    B, H, Hkv, T = shapes.batch, shapes.heads, shapes.kv_heads, shapes.length
    G, Dk, Dv = shapes.group_size, shapes.key_dim, shapes.value_dim
    W, back = window, look_backward * window
    dtype = compute_dtype(q.dtype)
    qf = q.to(dtype).reshape(B, Hkv, G, T, Dk) * resolve_scale(scale, Dk)
    kf, vf = k.to(dtype), v.to(dtype)

    past = 0
    if initial_state is not None:
        if not isinstance(initial_state, KVCacheState):
            raise TypeError(f"initial_state must be a KVCacheState, got {type(initial_state).__name__}")
        _check_window(initial_state.window, window, look_backward)
        past = initial_state.keys.shape[2] if isinstance(initial_state.keys, torch.Tensor) else 0
        if past > back - 1:
            raise ValueError(f"initial_state holds {past} positions; local attention keeps at most {back - 1}")
        check_state_tensor("initial_state.keys", initial_state.keys, (B, Hkv, past, Dk), q)
        check_state_tensor("initial_state.values", initial_state.values, (B, Hkv, past, Dv), q)
        kf = torch.cat([initial_state.keys.to(dtype), kf], dim=2)
        vf = torch.cat([initial_state.values.to(dtype), vf], dim=2)
    total = past + T
    rope = None if rerope is None else (rerope, rotary_base)
    if causal and T <= W:
        out = _recent(qf, kf, vf, past, back, rope)
    else:
        out = _blocked(qf, kf, vf, past, W, look_backward, look_forward, rope)
    out = out.reshape(B, H, T, Dv).to(q.dtype)

    state = None
    if output_final_state:
        keep = min(back - 1, total)
        steps = (initial_state.steps if initial_state is not None else 0) + T
        # copies: a slice of a long input would keep all of it alive
        state = KVCacheState(keys=kf[:, :, total - keep :].clone(memory_format=torch.contiguous_format),
                             values=vf[:, :, total - keep :].clone(memory_format=torch.contiguous_format),
                             steps=steps, window=back)
    return out, state


def _check_window(made_with: int | None, window: int, look_backward: int) -> None:
    """A carried cache was made by local attention over the ``window * look_backward`` keys a
    query sees here (None: unknown, or an unbounded softmax cache; only shapes are checked)."""
    back = window * look_backward
    if made_with is not None and made_with != back:
        this = f"window={window}" if look_backward == 1 else f"window={window} x look_backward={look_backward} = {back}"
        raise ValueError(f"initial_state was made with window={made_with} (keys a query sees), but this call has "
                         f"{this}; a local cache continues only attention over the same window")


def _recent(qf, kf, vf, past, back, rerope=None):
    """Causal form for a few queries (decoding): the T new queries (positions ``past..past+T-1``
    of ``kf``) against every carried and new key, ``[T, past + T]`` scores, keys outside
    ``0 <= i - j < back`` masked. Same result as ``_blocked`` without padding T up to a block.
    ``rerope``: ``(w, rotary_base)`` or None."""
    T, total = qf.shape[-2], kf.shape[2]
    if rerope is None:
        scores = qf @ kf.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, T, total]
    else:
        scores = rerope_scores(qf, kf.unsqueeze(2), past, 0, *rerope)
    offsets = past + torch.arange(T, device=qf.device)[:, None] - torch.arange(total, device=qf.device)[None, :]
    scores = scores.masked_fill((offsets < 0) | (offsets >= back), float("-inf"))
    return torch.softmax(scores, dim=-1) @ vf.unsqueeze(2)


def _blocked(qf, kf, vf, past, W, look_backward, look_forward, rerope=None):
    """Blocks of W queries against the (look_backward + 1 + look_forward) key blocks around them.
    ``rerope``: ``(w, rotary_base)`` or None; a block's rows and columns are numbered from its
    first key column (``_BlockReRoPE``)."""
    B, Hkv, G, T, Dk = qf.shape
    Dv = vf.shape[-1]
    total = past + T
    back = look_backward * W
    blocks = -(-total // W)
    tail = blocks * W - total
    qf = F.pad(qf, (0, 0, past, tail))
    # Keys padded by look_backward blocks in front and look_forward blocks (+ tail) behind;
    # block b's keys are the (look_backward + 1 + look_forward) blocks starting at block b.
    span = (look_backward + 1 + look_forward) * W
    front, back_pad = look_backward * W, look_forward * W + tail
    keys = F.pad(kf, (0, 0, front, back_pad)).unfold(2, span, W).transpose(-1, -2)  # [B, Hkv, R, span, Dk]
    values = F.pad(vf, (0, 0, front, back_pad)).unfold(2, span, W).transpose(-1, -2)
    rows = torch.arange(W, device=qf.device)
    cols = torch.arange(span, device=qf.device)
    offsets = front + rows[:, None] - cols[None, :]  # i - j inside a block
    key_index = torch.arange(blocks, device=qf.device)[:, None] * W - front + cols[None, :]  # [R, span]
    visible = (offsets >= -look_forward * W) & (offsets < back)
    visible = visible & ((key_index >= 0) & (key_index < total))[:, None, :]  # [R, W, span]
    step = max(1, _ROWS_PER_STEP // W)  # blocks per step: keeps each temporary small
    scoring = _BlockReRoPE(rerope, offsets, front, W, span, qf) if rerope is not None else None
    outs = []
    pieces = zip(
        qf.reshape(B, Hkv, G, blocks, W, Dk).split(step, dim=3), keys.split(step, dim=2),
        values.split(step, dim=2), visible.split(step, dim=0),
    )
    for q_g, k_g, v_g, visible_g in pieces:
        if scoring is None:
            scores = q_g @ k_g.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, g, W, span]
        else:
            scores = scoring.scores(q_g, k_g.unsqueeze(2))
        scores.masked_fill_(~visible_g, float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ v_g.unsqueeze(2))
    out = torch.cat(outs, dim=3)
    return out.reshape(B, Hkv, G, blocks * W, Dv)[:, :, :, past:total]


class _BlockReRoPE:
    """ReRoPE's scores for a block of W queries against its ``span`` key columns: row a at
    position ``front + a``, column c at position c (so ``i - j`` is the block's ``offsets``)."""

    def __init__(self, rerope, offsets, front, W, span, like):
        self.window, self.base = rerope
        self.near = offsets < self.window  # [W, span]
        self.only_near = front <= self.window  # (causal) a query sees keys up to front - 1 behind
        self.query_at, self.key_at = positions(front, W, like.device), positions(0, span, like.device)

    def scores(self, q, keys):
        """q ``[..., W, D]``, keys ``[..., span, D]`` -> ``[..., W, span]``."""
        near = rotate_at(q, self.query_at, self.base) @ rotate_at(keys, self.key_at, self.base).transpose(-1, -2)
        if self.only_near:
            return near
        far = far_queries(q, self.window, self.base) @ keys.transpose(-1, -2)
        return torch.where(self.near, near, far)
