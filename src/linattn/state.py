"""Decode states: one small dataclass per mechanism, sharing one convention.

An op with a recurrent form takes ``initial_state=`` and, with
``output_final_state=True``, returns the state after its last position. Feeding a
sequence in pieces and carrying the state gives the output of one call. Every state
holds tensors plus ``steps`` (positions consumed so far) and offers ``.detach()``
(Transformer-XL style truncation of gradients) and ``.to(...)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


def _map_value(value, fn):
    """Apply ``fn`` to a tensor, to the tensors of a state, or to each item of a tuple."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, _State):
        return value._map(fn)
    if isinstance(value, tuple):
        return tuple(_map_value(item, fn) for item in value)
    return value


@dataclass
class _State:
    """Shared behaviour: map a function over the tensor fields, keep the rest."""

    @classmethod
    def value_fields(cls) -> tuple[dataclasses.Field, ...]:
        """The fields that make the state (a decoding buffer beside them is not one of them)."""
        return tuple(f for f in dataclasses.fields(cls) if f.init)

    def _map(self, fn) -> "_State":
        changes = {}
        for f in self.value_fields():
            value = getattr(self, f.name)
            if isinstance(value, (torch.Tensor, _State, tuple)):
                changes[f.name] = _map_value(value, fn)
        return dataclasses.replace(self, **changes)

    def detach(self) -> "_State":
        """The same state with every tensor cut from the autograd graph."""
        return self._map(lambda t: t.detach())

    def select_batch(self, index: torch.Tensor) -> "_State":
        """The state of batch rows ``index`` (``[N]`` int64, repeats allowed), in that order:
        every tensor is index-selected along its first (batch) dimension (beam search)."""
        return self._map(lambda t: t.index_select(0, index.to(t.device)))

    def to(self, *args, **kwargs) -> "_State":
        """Move/cast every tensor, with the arguments of ``torch.Tensor.to``."""
        return self._map(lambda t: t.to(*args, **kwargs))


@dataclass
class LinearAttentionState(_State):
    """State of kernel (linear) attention, per key/value head.

    ``kv``: ``[B, Hkv, F, Dv]`` = ``sum_j phi(k_j) v_j^T`` (``F`` = feature dimension).
    ``normalizer``: ``[B, Hkv, F]`` = ``sum_j phi(k_j)``; only for ``normalize="attention"``.
    ``key_shift``: ``[B, Hkv]`` log-scale of the stored keys for exponential feature maps
    (FAVOR+, exp) under ``normalize="attention"``: the stored sums are
    ``exp(-key_shift)`` times the true ones; the factor cancels in the output.
    ``steps``: number of positions consumed.
    Sums are kept in float32 (float64 for float64 inputs).
    """

    kv: torch.Tensor
    normalizer: torch.Tensor | None = None
    key_shift: torch.Tensor | None = None
    steps: int = 0


@dataclass
class DeltaRuleState(_State):
    """State of the delta rule (fast weight memory), per key/value head.

    ``memory``: ``[B, Hkv, F, Dv]``, the fast weights ``S`` read as ``S^T phi(q)``.
    ``steps``: number of positions consumed. Kept in float32 (float64 for float64 inputs).
    """

    memory: torch.Tensor
    steps: int = 0


@dataclass
class DeltaNetState(_State):
    """Decode state of the ``linattn.nn.DeltaNet`` layer.

    ``rule``: the delta-rule memory. ``conv``: ``[B, C, kernel_size - 1]`` last inputs of
    the short causal convolution over the q/k/v channels (None without one).
    """

    rule: DeltaRuleState
    conv: torch.Tensor | None = None
    steps: int = 0


@dataclass
class VQAttentionState(_State):
    """Decode state of Transformer-VQ attention (``vq_attention``), per key/value head.

    Positions are grouped in blocks of ``L`` from the start of the sequence. With the
    current block holding the last ``p < L`` positions:

    ``partial_keys [B, Hkv, p, Dk]``, ``partial_values [B, Hkv, p, Dv]``,
    ``partial_codes [B, Hkv, p]``: the current, incomplete block.
    ``prev_keys [B, Hkv, L, Dk]``, ``prev_values``, ``prev_codes``: the last complete block
    (None before the first block is complete).
    ``cache_counts [B, Hkv, S]`` and ``cache_means [B, Hkv, S, Dv]``: for every code, how many
    older positions (blocks before the previous one) were quantized to it and the mean of
    their values (float32, float64 for float64 inputs).
    ``steps``: positions consumed. Memory is constant in the sequence length.
    """

    partial_keys: torch.Tensor
    partial_values: torch.Tensor
    partial_codes: torch.Tensor
    cache_counts: torch.Tensor
    cache_means: torch.Tensor
    prev_keys: torch.Tensor | None = None
    prev_values: torch.Tensor | None = None
    prev_codes: torch.Tensor | None = None
    steps: int = 0
    # Decoding with gradients off keeps the fields as views of one buffer that later steps
    # fill in place (ops/_vq_resident.py); a state rebuilt from this one starts without it.
    _resident: object = dataclasses.field(default=None, init=False, repr=False, compare=False)


@dataclass
class KVCacheState(_State):
    """Decode state of exact (quadratic) attention: every key and value so far.

    ``keys [B, Hkv, t, Dk]``, ``values [B, Hkv, t, Dv]``; grows with the sequence (the point
    of comparison for the constant-size states above).
    """

    keys: torch.Tensor
    values: torch.Tensor
    steps: int = 0


@dataclass
class LMState(_State):
    """Decode state of ``linattn.models.LM``: one entry per layer, in order.

    ``layers[i]`` is that layer's state (a tuple of two states for a GAU layer, which
    holds two gated attention units). ``steps``: tokens consumed.
    """

    layers: tuple = ()
    steps: int = 0
