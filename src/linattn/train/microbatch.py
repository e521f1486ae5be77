"""Gradient accumulation: one optimizer step's batch read as ``n`` micro-batches of rows.

A step reads one window of ``batch_size`` streams (rows) per process. With
``grad_accum_steps = n`` the rows are cut into ``n`` contiguous micro-batches of
``batch_size / n`` streams, ``rows [m b, (m + 1) b)`` for micro-batch ``m`` (``b = batch_size / n``),
and each runs forward and backward on its own, so activations are held for ``b`` streams
at a time. Because a stream always falls in the same micro-batch, each micro-batch carries
the recurrent state of its own streams from window to window, and the step equals the
one-batch step up to rounding:

- the loss is the mean over all ``batch_size x context`` targets: each micro-batch's mean,
  divided by ``n``, is backpropagated, so the accumulated gradient is that of the mean;
- the codebook statistics of every micro-batch add up in the quantizers' pending sums
  and the EMA update runs once, after the optimizer step;
- the carried states of the micro-batches, stacked in row order (``join_states``), are the
  one-batch state; a checkpoint stores that stacked state, so it does not depend on ``n``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..state import _State, _batch_of


def split_rows(tensor: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """``[B, ...]`` -> ``n`` contiguous row blocks ``[B / n, ...]`` (``n`` divides ``B``)."""
    if tensor.shape[0] % n:
        raise ValueError(f"cannot cut {tensor.shape[0]} rows into {n} equal micro-batches")
    return tensor.split(tensor.shape[0] // n)


def join_states(states: list[Any]) -> Any:
    """Stack the states of consecutive row blocks into the state of all rows: every tensor is
    concatenated along its first (batch) dimension; other fields (``steps``) must agree.
    All None gives None."""
    first = states[0]
    if first is None or isinstance(first, (bool, int, float, str)):
        if any(state != first for state in states):
            raise ValueError(f"micro-batch states disagree on a non-tensor field: {states!r}")
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(states, dim=0)
    if isinstance(first, tuple):
        return tuple(join_states([state[i] for state in states]) for i in range(len(first)))
    if isinstance(first, _State):
        return dataclasses.replace(first, **{field.name: join_states([getattr(s, field.name) for s in states])
                                             for field in first.value_fields()})
    raise TypeError(f"cannot join states of type {type(first).__name__}")


def split_state(state: Any, n: int) -> list[Any]:
    """Inverse of ``join_states``: the state of ``B`` rows -> the states of ``n`` row blocks
    (None -> ``n`` Nones)."""
    if state is None:
        return [None] * n
    rows = _batch_of(state)
    if rows is None or rows % n:
        raise ValueError(f"cannot cut a carried state of {rows} rows into {n} equal micro-batches")
    size = rows // n
    return [state.select_batch(torch.arange(m * size, (m + 1) * size)) for m in range(n)]
