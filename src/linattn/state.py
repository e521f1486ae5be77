"""Decode states: one small dataclass per mechanism, sharing one convention.

An op with a recurrent form takes ``initial_state=`` and, with
``output_final_state=True``, returns the state after its last position. Feeding a
sequence in pieces and carrying the state gives the output of one call. Every state
holds tensors plus ``steps`` (positions consumed so far) and offers ``.detach()``
(Transformer-XL style truncation of gradients) and ``.to(...)``.

Every state also records, in plain fields (str, int, None and tuples of those, so that they
survive a checkpoint's JSON, ``.detach()``/``.to()``/``select_batch`` and ``torch.compile``),
the settings of the computation that made it and that a continuation must share: the
feature map of kernel attention, the window of a local cache, the block and codebook sizes
of Transformer-VQ, the model of an ``LMState``. The op, layer or model that makes a state
sets them; every consumer compares them with its own settings and raises ``ValueError``
naming the setting and both values, and checks the state's batch size against its inputs'.
A setting left ``None`` (a state built by hand, or read from a checkpoint written before
these fields existed) is unknown: then only the shapes of the tensors are checked.
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

    def batch_size(self) -> int | None:
        """The batch size of the state: the first dimension of its first tensor (None when it
        holds no tensor, e.g. an ``LMState`` of stateless layers)."""
        return _batch_of(self)


def _batch_of(value) -> int | None:
    """The first dimension of the first tensor in a (nested) state, tuple or tensor."""
    if isinstance(value, torch.Tensor):
        return value.shape[0]
    if isinstance(value, _State):
        # fields of the instance, not value_fields(): torch.compile traces the former
        items = [getattr(value, f.name) for f in dataclasses.fields(value) if f.init]
    elif isinstance(value, tuple):
        items = value
    else:
        return None
    for item in items:
        found = _batch_of(item)
        if found is not None:
            return found
    return None


@dataclass
class LinearAttentionState(_State):
    """State of kernel (linear) attention, per key/value head.

    Sums are kept in float32 (float64 for float64 inputs). With log decays ``g`` they are
    the decayed sums (each term times ``exp`` of the decays since it was written); the
    shapes are the same, and a continuation may use decays or not. The last two fields
    record what made it (None: unknown, only shapes are checked).

    Attributes:
        kv: ``[B, Hkv, F, Dv]`` = ``sum_j phi(k_j) v_j^T`` (``F`` = feature dimension).
        normalizer: ``[B, Hkv, F]`` = ``sum_j phi(k_j)``; only for ``normalize="attention"``.
        key_shift: ``[B, Hkv]`` log-scale of the stored keys for exponential feature maps
            (FAVOR+, exp) under ``normalize="attention"``: the stored sums are
            ``exp(-key_shift)`` times the true ones; the factor cancels in the output.
        steps: number of positions consumed.
        feature_map: the map's identity (``FeatureMap.describe()``: its name and every
            parameter that changes phi's values, e.g. ``"elu"``, ``"dpfp:2"``,
            ``"favor:128:seed=3"``).
        normalize: the normalisation (``"attention"``, ``"sum"`` or ``"none"``).
    """

    kv: torch.Tensor
    normalizer: torch.Tensor | None = None
    key_shift: torch.Tensor | None = None
    steps: int = 0
    feature_map: str | None = None
    normalize: str | None = None


@dataclass
class DeltaRuleState(_State):
    """State of the delta rule (fast weight memory), per key/value head.

    Kept in float32 (float64 for float64 inputs). The last two fields record what made it
    (None: unknown, only shapes are checked).

    Attributes:
        memory: ``[B, Hkv, F, Dv]``, the fast weights ``S`` read as ``S^T phi(q)`` (decayed
            by ``g`` for the gated delta rule: same shape).
        steps: number of positions consumed.
        feature_map: the identity of the map applied to q and k (``FeatureMap.describe()``).
        normalize: their normalisation (``"l2"``, ``"sum"`` or ``"none"``).
    """

    memory: torch.Tensor
    steps: int = 0
    feature_map: str | None = None
    normalize: str | None = None


@dataclass
class DeltaNetState(_State):
    """Decode state of the ``linattn.nn.DeltaNet`` layer.

    Attributes:
        rule: the delta-rule memory.
        conv: ``[B, C, kernel_size - 1]`` last inputs of the short causal convolution over
            the q/k/v channels (None without one).
        steps: positions consumed.
        short_conv: the kernel size of that convolution, 0 for a layer without one (None:
            unknown, only shapes are checked).
    """

    rule: DeltaRuleState
    conv: torch.Tensor | None = None
    steps: int = 0
    short_conv: int | None = None


@dataclass
class RetentionState(_State):
    """Decode state of the ``linattn.nn.MultiScaleRetention`` layer (RetNet).

    Attributes:
        attention: the decayed sums ``S [B, Hkv, Dk, Dv]`` of ``linear_attention`` (identity
            features, no normaliser; it records those).
        steps: positions consumed, the rotary position of the next one.
        rotary_base: the base of the rotary positions the stored keys were turned by (None:
            unknown, only shapes are checked).
    """

    attention: LinearAttentionState
    steps: int = 0
    rotary_base: float | None = None


@dataclass
class GatedLinearAttentionState(_State):
    """Decode state of the ``linattn.nn.GatedLinearAttention`` layer (GLA).

    The gate has no setting a continuation must share beyond the shapes.

    Attributes:
        attention: the gated sums ``S [B, Hkv, Dk, Dv]`` of ``linear_attention`` (identity
            features, no normaliser; it records those).
        steps: positions consumed.
    """

    attention: LinearAttentionState
    steps: int = 0


@dataclass
class GatedDeltaNetState(_State):
    """Decode state of the ``linattn.nn.GatedDeltaNet`` layer.

    Attributes:
        rule: the gated delta-rule memory.
        conv: ``[B, C, kernel_size - 1]`` last inputs of the short causal convolution over
            the q/k/v channels (None without one).
        steps: positions consumed.
        short_conv: the kernel size of that convolution, 0 for a layer without one (None:
            unknown, only shapes are checked).
    """

    rule: DeltaRuleState
    conv: torch.Tensor | None = None
    steps: int = 0
    short_conv: int | None = None


@dataclass
class VQAttentionState(_State):
    """Decode state of Transformer-VQ attention (``vq_attention``), per key/value head.

    Positions are grouped in blocks of ``L`` from the start of the sequence, the current
    block holding the last ``p < L`` positions. Memory is constant in the sequence length.
    The last two fields record what made it (None: unknown, only shapes are checked).

    Attributes:
        partial_keys: ``[B, Hkv, p, Dk]``, the keys of the current, incomplete block.
        partial_values: ``[B, Hkv, p, Dv]``, its values.
        partial_codes: ``[B, Hkv, p]``, its codes.
        cache_counts: ``[B, Hkv, S]``: for every code, how many older positions (blocks
            before the previous one) were quantized to it (float32, float64 for float64 inputs).
        cache_means: ``[B, Hkv, S, Dv]``: the mean of those positions' values, per code.
        prev_keys: ``[B, Hkv, L, Dk]``, the keys of the last complete block (None before the
            first block is complete).
        prev_values: ``[B, Hkv, L, Dv]``, its values.
        prev_codes: ``[B, Hkv, L]``, its codes.
        steps: positions consumed.
        block_size: L.
        codebook_size: S.
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
    block_size: int | None = None
    codebook_size: int | None = None
    # Decoding with gradients off keeps the fields as views of one buffer that later steps
    # fill in place (ops/vq/resident.py); a state rebuilt from this one starts without it.
    _resident: object = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # (codebook, its version) when the forms that made this state know every key in it to be a
    # row of that codebook as it is now (hard codes); None when unknown, as after a rebuild.
    _keys_from: object = dataclasses.field(default=None, init=False, repr=False, compare=False)


@dataclass
class KVCacheState(_State):
    """Decode state of exact (quadratic) attention: every key and value so far.

    It grows with the sequence (the point of comparison for the constant-size states above).
    Without gradients an unbounded cache's tensors are views of buffers with room for later
    positions, which the next steps fill in place (``ops/softmax/kv_cache.py``).

    Attributes:
        keys: ``[B, Hkv, t, Dk]``, the keys so far.
        values: ``[B, Hkv, t, Dv]``, the values so far.
        steps: positions consumed.
        window: the keys a query sees in sliding-window attention (``local_attention``'s
            ``window * look_backward``), whose cache keeps the last ``window - 1`` of them;
            None for an unbounded softmax cache, or unknown (a state built by hand or read
            from an older checkpoint): a local consumer then checks only the shapes.
    """

    keys: torch.Tensor
    values: torch.Tensor
    steps: int = 0
    window: int | None = None
    # Decoding with gradients off keeps keys and values as views of preallocated buffers that
    # later steps fill in place (ops/softmax/kv_cache.py); a state rebuilt from this one starts without.
    _buffer: object = dataclasses.field(default=None, init=False, repr=False, compare=False)


@dataclass
class LMState(_State):
    """Decode state of ``linattn.models.LM``: one entry per layer, in order.

    Attributes:
        layers: ``layers[i]`` is layer i's state (a tuple of two states for a GAU layer,
            which holds two gated attention units).
        steps: tokens consumed.
        model: the model that made it, as ``(name, value)`` pairs of the ``LMConfig``
            settings that decide its layers' states (layer specs, widths, heads, windows,
            block and codebook sizes, feature maps, ...; ``LM.state_settings``); an ``LM``
            continues only a state of the same settings and names those that differ. None:
            unknown, only the layers' own checks apply.
    """

    layers: tuple = ()
    steps: int = 0
    model: tuple | None = None
