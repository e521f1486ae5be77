"""Exact attention's KV cache, preallocated: no copy of the cache per decoded token.

The decode state of exact softmax attention (``KVCacheState``, the softmax ``Attention``
layer and the softmax GAU) holds every key and value so far. With gradients off its
``keys [B, Hkv, t, Dk]`` and ``values [B, Hkv, t, Dv]`` are views of the first t rows of
two buffers ``[B, Hkv, capacity, D]``, and a step writes its T new rows in place. A step
that does not fit allocates buffers of ``max(t + T, 2 t)`` rows and copies the cache into
them once, so n one-token steps copy O(n) rows in all (amortised doubling) where
concatenating copied O(n^2). A caller that knows how long the sequence gets reserves the
room up front (``reserve``; ``LM.generate`` reserves exactly the tokens it will feed), and
nothing is copied again.

States stay values (as in the VQ decode buffer, ``vq/resident.py``): a step writes only
rows past its state's end, and only when no other step from a state of the same buffer
has claimed them (``written``); a second continuation of one state (beam search, a retry)
copies first. A state rebuilt by ``dataclasses.replace``, ``.to``, ``.detach`` or
``select_batch`` carries no buffer and starts one at its next step. With gradients on (or
under ``torch.compile``) a step concatenates, as a graph may hold the old tensors, and a
buffer read with gradients on is released: no later step writes into it.
"""

from __future__ import annotations

import dataclasses

import torch

from ...state import KVCacheState, LMState


class KVBuffer:
    """The buffers of one chain of cache states: ``keys [B, Hkv, capacity, Dk]``, ``values
    [B, Hkv, capacity, Dv]``; ``written``: the rows some state of this buffer holds (a step
    may append in place only to a state of that length); None: no step may write."""

    __slots__ = ("keys", "values", "written")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, written: int | None):
        self.keys, self.values, self.written = keys, values, written

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]


def _buffer_of(state: KVCacheState, dtype: torch.dtype) -> KVBuffer | None:
    """``state``'s buffer when its fields are still the views a step made of it, in ``dtype``
    and writable here (an inference-mode tensor takes in-place writes only in that mode)."""
    buffer = state._buffer
    if buffer is None or buffer.keys.dtype != dtype:
        return None
    if state.keys._base is not buffer.keys or state.values._base is not buffer.values:
        return None
    if buffer.keys.is_inference() and not torch.is_inference_mode_enabled():
        return None
    return buffer


def _with_room(state: KVCacheState, rows: int, dtype: torch.dtype) -> KVBuffer:
    """A buffer whose first rows hold ``state``'s cache (in ``dtype``), with room for ``rows``
    more after them and no claim on that room: its own buffer when it has both, else a new
    one of ``max(t + rows, 2 t, its capacity)`` rows with the cache copied in."""
    t = state.keys.shape[2]
    buffer = _buffer_of(state, dtype)
    if buffer is not None and buffer.written == t and t + rows <= buffer.capacity:
        return buffer
    capacity = max(t + rows, 2 * t, buffer.capacity if buffer is not None else 0)
    B, Hkv, _, Dk = state.keys.shape
    keys = state.keys.new_empty(B, Hkv, capacity, Dk, dtype=dtype)
    values = state.values.new_empty(B, Hkv, capacity, state.values.shape[-1], dtype=dtype)
    keys[:, :, :t] = state.keys
    values[:, :, :t] = state.values
    return KVBuffer(keys, values, t)


def _state_on(buffer: KVBuffer, rows: int, steps: int, window: int | None) -> KVCacheState:
    """The state holding the first ``rows`` rows of ``buffer`` (views of it)."""
    state = KVCacheState(keys=buffer.keys.narrow(2, 0, rows), values=buffer.values.narrow(2, 0, rows),
                         steps=steps, window=window)
    state._buffer = buffer
    return state


def extend(state: KVCacheState | None, k: torch.Tensor, v: torch.Tensor) -> KVCacheState:
    """The cache after ``state``'s (None: empty) with ``k [B, Hkv, T, Dk]`` and ``v
    [B, Hkv, T, Dv]`` appended: its ``keys``/``values`` hold every position so far in k's
    dtype, ``steps`` advances by T, ``window`` is kept. From an empty cache the new tensors
    are the cache (no copy); else, with gradients off, the new rows are written into the
    state's buffer in place when it has room (module docstring)."""
    T = k.shape[2]
    if state is None or state.keys.shape[2] == 0:
        return KVCacheState(keys=k, values=v, steps=T if state is None else state.steps + T,
                            window=None if state is None else state.window)
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        release(state)
        return KVCacheState(keys=torch.cat([state.keys.to(k.dtype), k], dim=2),
                            values=torch.cat([state.values.to(v.dtype), v], dim=2),
                            steps=state.steps + T, window=state.window)
    t = state.keys.shape[2]
    buffer = _with_room(state, T, k.dtype)
    buffer.keys[:, :, t : t + T] = k
    buffer.values[:, :, t : t + T] = v
    buffer.written = t + T
    return _state_on(buffer, t + T, state.steps + T, state.window)


def claimable(state: KVCacheState) -> bool:
    """Whether a step may append to ``state`` in place: it has a buffer of its own and no other
    step has written rows past it."""
    buffer = _buffer_of(state, state.keys.dtype)
    return buffer is not None and buffer.written == state.keys.shape[2]


def claim(state: KVCacheState) -> KVBuffer:
    """``state``'s buffer (``claimable(state)`` must hold), for a caller that writes the rows after
    ``state``'s cache in place itself (the native decoding loop, ``models/_block_generation.py``).
    From then on no step appends in place to a state of that buffer (each copies) until
    ``claimed_state`` gives the state after the caller's rows."""
    if not claimable(state):
        raise ValueError("claim: the state's buffer is not its own to append to (check claimable first)")
    buffer = state._buffer
    buffer.written = None
    return buffer


def claimed_state(state: KVCacheState, buffer: KVBuffer, rows: int) -> KVCacheState:
    """The state after ``state`` and ``rows`` more positions, which the caller of ``claim(state)``
    wrote into ``buffer``; a step may append to it in place again."""
    t = state.keys.shape[2] + rows
    buffer.written = t
    return _state_on(buffer, t, state.steps + rows, state.window)


def release(state: KVCacheState) -> None:
    """No step may write into ``state``'s buffer any more."""
    if state._buffer is not None:
        state._buffer.written = None


def reserve(state, rows: int):
    """``state`` with room for ``rows`` more positions in each of its unbounded KV caches
    (``KVCacheState`` with ``window=None``; bounded local caches keep their size), so that
    as many one-token steps write in place without copying; ``state`` is an ``LMState``,
    a tuple of states (a GAU pair's) or one state; the others pass through unchanged.
    Copies each such cache once (unless it has the room and no other claim on it); without
    gradients only: with gradients on, steps concatenate anyway and it returns ``state``."""
    if torch.is_grad_enabled() or rows <= 0:
        return state
    if isinstance(state, LMState):
        return dataclasses.replace(state, layers=tuple(reserve(layer, rows) for layer in state.layers))
    if isinstance(state, tuple):
        return tuple(reserve(item, rows) for item in state)
    if not isinstance(state, KVCacheState) or state.window is not None or state.keys.shape[2] == 0:
        return state
    buffer = _with_room(state, rows, state.keys.dtype)
    return _state_on(buffer, state.keys.shape[2], state.steps, state.window)
