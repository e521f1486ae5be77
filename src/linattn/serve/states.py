"""A linattn layer's decode state as one fixed-size row of a serving engine's state cache.

A serving engine (vLLM) keeps one slot per running sequence: a flat float32 row whose
size is fixed when the model loads. ``StateLayout`` maps a layer's state (the dataclasses
of ``linattn.state``, nested as the layer makes them) to such a row and back:

- Fixed-shape tensors (kernel sums, delta-rule memories, convolution tails, the VQ cache's
  counts and means) take their own region of the row.
- Tensors whose length follows the position (``steps``, the tokens consumed) take a region
  of their largest length, of which the first rows are filled: a Transformer-VQ unit's
  current block (``steps % block_size`` rows of ``block_size``) and previous block (present
  once ``steps >= block_size``), a local window (``min(steps, window - 1)`` of
  ``window - 1``), and a GAU softmax twin's keys (``steps`` of ``max_positions``).

The shapes of a state are a function of ``steps``, which the engine knows per sequence, so
the row holds tensors only: ``read(slots, rows, steps)`` rebuilds the batched state of the
sequences ``rows`` (all at ``steps``), ``write(slots, rows, state)`` stores it back.
Everything is stored as float32: integer codes (< 2^24) and float32 tensors exactly.
``group_key(steps)``: sequences whose keys are equal have states of the same shapes and the
same position-dependent settings, so one batched layer call may continue them together.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch
from torch import nn

from ..nn.hedgehog import HEDGEHOG
from ..ops.common.versions import tensor_version
from ..state import KVCacheState, VQAttentionState, _State

# Layer kinds whose computation does not depend on the absolute position (no rotary angle, no
# count of cached keys): sequences at any position continue together. Other kinds group by
# position (or, for the VQ kinds, by the position inside the block).
_POSITION_FREE_KINDS = ("linear", "favor", "delta", "gla", "gated-delta")
_BLOCK_KINDS = ("vq", "vq-fsq", "soft-vq")

STATE_DTYPE = torch.float32


class _Leaf(NamedTuple):
    """One tensor of a state: where it sits in the state (``path``), its shape per sequence at
    the largest length (``capacity``), its dtype, and how many of its rows along ``dim`` are
    filled at a position (``filled(steps)``; None: all of them, a fixed-shape tensor).
    ``optional``: the state holds None instead of a tensor with no rows (a VQ unit's previous
    block before the first block is complete)."""

    path: tuple
    capacity: tuple[int, ...]
    dtype: torch.dtype
    dim: int = 0
    filled: Callable[[int], int] | None = None
    optional: bool = False


class StateLayout:
    """The slot row of one linattn layer (a ``PreNormBlock`` or ``GAUPair`` of an ``LM``).

    Built from ``template``, the state the layer returns for one token, and
    ``max_positions``, the longest sequence the engine serves (a GAU softmax twin's cache
    holds that many keys). ``kind`` is the layer's registered kind (``LayerSpec.kind``).
    A state this row cannot hold (an unbounded softmax cache outside a GAU, a new state
    class) is a ValueError naming it.
    """

    def __init__(self, kind: str, template: Any, max_positions: int, keys_from: Callable[[int], Any] | None = None,
                 option: str | None = None):
        self.kind = kind
        # Hedgehog's learned map reads rotary q and k: its sums depend on the positions
        self.position_free = kind in _POSITION_FREE_KINDS and option != HEDGEHOG
        self.template = template
        self.max_positions = max_positions
        self._keys_from = keys_from  # unit index -> its codebook, for states of hard VQ codes
        self.leaves: list[_Leaf] = []
        self._block_size: int | None = None
        self._describe(template, (), unit=None)
        self.offsets = list(_offsets(self.leaves))
        self.size = sum(math.prod(leaf.capacity) for leaf in self.leaves)

    # -- layout ------------------------------------------------------------------------------

    def _describe(self, state: Any, path: tuple, unit: int | None) -> None:
        if isinstance(state, tuple):
            for i, item in enumerate(state):
                self._describe(item, path + (i,), unit=i)
        elif isinstance(state, VQAttentionState):
            self._describe_vq(state, path)
        elif isinstance(state, KVCacheState):
            self._describe_cache(state, path)
        elif isinstance(state, _State):
            for field in state.value_fields():
                value = getattr(state, field.name)
                if isinstance(value, torch.Tensor):
                    self.leaves.append(_Leaf(path + (field.name,), tuple(value.shape[1:]), value.dtype))
                elif isinstance(value, (_State, tuple)):
                    self._describe(value, path + (field.name,), unit)
        else:
            raise ValueError(f"layer kind {self.kind!r}: a state of type {type(state).__name__} has no slot layout")

    def _describe_vq(self, state: VQAttentionState, path: tuple) -> None:
        L = state.block_size
        if L is None:
            raise ValueError(f"layer kind {self.kind!r}: its VQ state does not record its block size")
        self._block_size = L
        for name in ("partial_keys", "partial_values", "partial_codes"):
            value = getattr(state, name)
            capacity = (value.shape[1], L - 1, *value.shape[3:])
            self.leaves.append(_Leaf(path + (name,), capacity, value.dtype, 1, lambda steps, L=L: steps % L))
        for name in ("prev_keys", "prev_values", "prev_codes"):
            value = getattr(state, name.replace("prev", "partial"))
            capacity = (value.shape[1], L, *value.shape[3:])
            self.leaves.append(_Leaf(path + (name,), capacity, value.dtype, 1,
                                     lambda steps, L=L: L if steps >= L else 0, optional=True))
        for name in ("cache_counts", "cache_means"):
            value = getattr(state, name)
            self.leaves.append(_Leaf(path + (name,), tuple(value.shape[1:]), value.dtype))

    def _describe_cache(self, state: KVCacheState, path: tuple) -> None:
        if state.window is not None:
            keep = state.window - 1
        elif self.kind == "gau-softmax":
            keep = self.max_positions
        else:
            raise ValueError(f"layer kind {self.kind!r}: an unbounded softmax cache is served by the engine's "
                             "paged attention, not a state slot")
        for name in ("keys", "values"):
            value = getattr(state, name)
            capacity = (value.shape[1], keep, value.shape[3])
            self.leaves.append(_Leaf(path + (name,), capacity, value.dtype, 1,
                                     lambda steps, keep=keep: min(steps, keep)))

    def group_key(self, steps: int) -> Hashable:
        """Sequences at positions of equal keys continue in one batched call."""
        if self.position_free:
            return ()
        if self.kind in _BLOCK_KINDS and self._block_size is not None:
            return (steps % self._block_size, steps >= self._block_size)
        return steps

    # -- reading and writing -----------------------------------------------------------------

    def read(self, slots: torch.Tensor, rows: torch.Tensor, steps: int) -> Any:
        """The state of the sequences in slot ``rows`` ``[B]``, each at position ``steps >= 1``
        (a sequence at 0 has no state: the layer starts from none)."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1 to read a state (a new sequence has none), got {steps}")
        values = {}
        for leaf, offset in zip(self.leaves, self.offsets):
            n = math.prod(leaf.capacity)
            stored = slots.index_select(0, rows).narrow(1, offset, n).view(-1, *leaf.capacity)
            if leaf.filled is not None:
                filled = leaf.filled(steps)
                stored = None if leaf.optional and not filled else stored.narrow(leaf.dim + 1, 0, filled)
            values[leaf.path] = None if stored is None else stored.to(leaf.dtype).contiguous()
        return self._rebuild(self.template, (), values, steps, unit=None)

    def write(self, slots: torch.Tensor, rows: torch.Tensor, state: Any, steps: int) -> None:
        """Store ``state`` (batch ``B``, at position ``steps``) into slot ``rows`` ``[B]``."""
        for leaf, offset in zip(self.leaves, self.offsets):
            value = _at(state, leaf.path)
            n = math.prod(leaf.capacity)
            if value is None:
                if not leaf.optional or leaf.filled(steps):
                    raise ValueError(f"layer kind {self.kind!r}: state tensor {'.'.join(map(str, leaf.path))} is "
                                     f"missing at position {steps}")
                continue
            expected = list(leaf.capacity)
            if leaf.filled is not None:
                expected[leaf.dim] = leaf.filled(steps)
            if list(value.shape[1:]) != expected:
                raise ValueError(f"layer kind {self.kind!r}: state tensor {'.'.join(map(str, leaf.path))} has shape "
                                 f"{list(value.shape[1:])} per sequence at position {steps}, the slot layout "
                                 f"expects {expected}")
            if leaf.filled is not None and expected[leaf.dim] < leaf.capacity[leaf.dim]:
                padded = value.new_zeros(value.shape[0], *leaf.capacity)
                padded.narrow(leaf.dim + 1, 0, expected[leaf.dim]).copy_(value)
                value = padded
            slots[rows, offset : offset + n] = value.reshape(value.shape[0], n).to(slots.dtype)

    def _rebuild(self, template: Any, path: tuple, values: dict, steps: int, unit: int | None) -> Any:
        if isinstance(template, tuple):
            return tuple(self._rebuild(item, path + (i,), values, steps, unit=i) for i, item in enumerate(template))
        changes = {}
        for field in template.value_fields():
            value = getattr(template, field.name)
            key = path + (field.name,)
            if key in values:
                changes[field.name] = values[key]
            elif isinstance(value, (_State, tuple)):
                changes[field.name] = self._rebuild(value, key, values, steps, unit)
        if "steps" in {f.name for f in template.value_fields()}:
            changes["steps"] = steps
        state = dataclasses.replace(template, **changes)
        hard_codes = isinstance(state, VQAttentionState) and not state.partial_codes.is_floating_point()
        if hard_codes and self._keys_from is not None:
            codebook = self._keys_from(unit or 0)
            version = None if codebook is None else tensor_version(codebook)
            if version is not None:  # every stored key is a row of this codebook as it is now
                state._keys_from = (codebook, version)
        return state


def _offsets(leaves: list[_Leaf]):
    offset = 0
    for leaf in leaves:
        yield offset
        offset += math.prod(leaf.capacity)


def _at(state: Any, path: tuple) -> Any:
    for step in path:
        state = state[step] if isinstance(step, int) else getattr(state, step)
    return state


def layer_layout(kind: str, layer: nn.Module, d_model: int, max_positions: int, option: str | None = None
                 ) -> StateLayout:
    """The ``StateLayout`` of ``layer`` (of registered kind ``kind``, spec option ``option``): its
    state after one token of zeros, run on the layer's device and dtype without gradients."""
    weight = next(layer.parameters())
    with torch.no_grad():
        _, template, _ = layer(torch.zeros(1, 1, d_model, dtype=weight.dtype, device=weight.device), None)
    template = _detached(template)
    units = getattr(layer, "units", None)

    def codebook_of(unit: int):
        if units is None:
            return None
        quantizer = getattr(units[unit], "quantizer", None)
        return None if quantizer is None else quantizer.codebook

    return StateLayout(kind, template, max_positions, keys_from=codebook_of, option=option)


def _detached(state: Any) -> Any:
    return tuple(_detached(s) for s in state) if isinstance(state, tuple) else state.detach()
