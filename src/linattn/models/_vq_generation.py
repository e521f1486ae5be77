"""``LM.generate``'s token loop for a Transformer-VQ model on a CPU: one native call per token.

A VQ model's token is little arithmetic (a few small matmuls and one softmax over
``2L + S`` columns per unit) and, through ``LM._run``, many Python calls per unit: module
calls, argument and state checks, the cached constants' version checks, a new state
object. ``VQGeneration`` does those once, when generation starts: it checks that every
part of the model computes exactly what its parameters say (the same checks that let a unit
take its one-token path, ``nn/_gau_decode.py``), derives every unit's constants, takes each
unit's resident buffer from the prompt's state, and hands all of it to the native
``VQModelStep`` (``ops/vq/_native/vq_model_step.cpp``): each token is then one call
(embedding, every unit with its residual, the final norm, the head), and every ``L`` tokens
the completed block moves into each unit's cache as ``state_after`` moves it.

Before each token ``current()`` checks that nothing it read has changed since (no parameter
or buffer written, the model still in eval mode); when something has, the loop continues
from ``state()`` through ``LM._run``. Results equal ``LM._run``'s token by token (tested in
float64); ``LINATTN_VQ_STEP_IMPL=torch`` turns it off with the native steps.
"""

from __future__ import annotations

import torch

from ..nn._gau_decode import can_decode_token, code_like, decode_constants, norm_eps, unit_codebook
from ..nn.gau import GAU, computes_its_parameters
from ..ops.common.native import extension
from ..ops.vq.native_choice import use_native
from ..ops.vq.resident import state_after, window_for
from ..state import LMState
from ._native_generation import NativeGeneration, head_t, plain_ends
from .layers import GAUPair


def unit_constants(unit: GAU, dtype: torch.dtype) -> tuple:
    """A VQ unit's one-token constants as the native objects take them (``VQModelStep.add_unit``,
    ``BlockModelStep.add_vq_unit``): ``(constants, input_shift, eps, rerope, rerope_frequencies, fsq,
    soft_temperature)``."""
    c = decode_constants(unit, dtype)
    return ([c.input_t, c.content_bias, c.position_keys_reversed_t, c.bias_reversed, c.output_t, c.native_search_t,
             c.native_norms, c.native_codebook_t], c.input_shift, c.eps, c.rerope, c.rerope_frequencies, c.fsq,
            c.soft_temperature)


def why_units_do_not_step(units: list[GAU], unit_states: list, token: torch.Tensor) -> str | None:
    """Why VQ ``units`` continuing ``unit_states`` do not take the native one-token step (None when
    they do): each a plain GAU on its one-token path (``can_decode_token`` for ``token``, an empty
    ``[B, 1, d_model]``), one block size and one position in the block. The native step's own
    check (``use_native``) is the caller's, last: it builds."""
    if not all(computes_its_parameters(unit, (GAU,)) and can_decode_token(unit, token, unit_state)
               for unit, unit_state in zip(units, unit_states)):
        return ("a GAU pair whose units do not take the VQ one-token step (another attention, a hook or adapter, "
                "or a state that does not continue them)")
    if len({unit.block_size for unit in units}) != 1 or len({s.partial_keys.shape[2] for s in unit_states}) != 1:
        return "VQ units of different block sizes or positions in their blocks"
    return None


class UnitBuffers:
    """The resident buffers of VQ units (GAUs, or multi-head VQ attention: anything with a
    ``block_size`` and a ``quantizer``) that a native object steps one token at a time: each
    unit's buffer (``window_for``, as the unit's next step would take it, shaped as its state),
    handed to the object by ``set_window(index, window)``; the position ``p`` in the block, and
    every ``L`` tokens the completed block moved into each unit's cache as ``state_after`` moves it."""

    def __init__(self, units: list, unit_states: list, dtype: torch.dtype, set_window):
        self.units, self.dtype, self.set_window = units, dtype, set_window
        self.L = units[0].block_size
        self.p = unit_states[0].partial_keys.shape[2]
        self.has_prev = [unit_state.prev_keys is not None for unit_state in unit_states]
        self.steps = [unit_state.steps for unit_state in unit_states]
        self.windows = [None] * len(units)
        for index, unit_state in enumerate(unit_states):
            self.enter(index, unit_state)

    def advance(self) -> None:
        """One token further: every ``L`` the completed block moves into each unit's cache."""
        self.p += 1
        self.steps = [steps + 1 for steps in self.steps]
        for window in self.windows:
            window.written = self.p
        if self.p == self.L:
            for index in range(len(self.units)):
                self.enter(index, self.state(index))
            self.p, self.has_prev = 0, [True] * len(self.units)

    def state(self, index: int):
        """Unit ``index``'s state after the tokens so far (as ``decode_token`` leaves it)."""
        return state_after(self.windows[index], self.p, self.has_prev[index], self.steps[index])

    def enter(self, index: int, unit_state) -> None:
        """Take ``unit_state``'s resident buffer (as the unit's next step would) into the native object."""
        B, Hkv, _, Dk = unit_state.partial_keys.shape
        unit = self.units[index]
        window = window_for(unit_state, self.L, unit_codebook(unit), (B, Hkv, Dk, unit_state.partial_values.shape[-1]),
                            code_like(unit, self.dtype), self.dtype)
        self.windows[index] = window
        self.set_window(index, window)


class VQGeneration(NativeGeneration):
    """The state of ``LM.generate`` after the prompt, held in the native ``VQModelStep``.

    ``start(model, state)`` is None where it does not apply (a layer other than a VQ GAU
    pair, a unit that would not take its one-token path, a wrapped or hooked module, a
    device or dtype without the native step); the steps are ``NativeGeneration``'s."""

    def __init__(self, model, state: LMState, units: list[GAU], dtype: torch.dtype):
        super().__init__(model, state, dtype)
        unit_states = [unit_state for layer_state in state.layers for unit_state in layer_state]
        self.native = extension().VQModelStep(model.embed.weight.to(dtype).contiguous(), model.norm.weight.to(dtype),
                                              norm_eps(model.norm, dtype), head_t(model, dtype), units[0].block_size)
        for unit in units:
            self.native.add_unit(*unit_constants(unit, dtype))
        self.buffers = UnitBuffers(units, unit_states, dtype, lambda index, window: self.native.set_window(
            index, window.keys, window.values, window.codes, window.mask, window.keys_are_codes))
        self.codes = torch.empty(len(units), state.batch_size(), 1, dtype=torch.int64)

    @classmethod
    def start(cls, model, state: LMState, batch: int) -> "VQGeneration | None":
        """The native token loop for ``model`` continuing ``state`` (``batch`` rows), or None."""
        dtype = model.embed.weight.dtype
        layers = list(model.layers)
        if not (layers and plain_ends(model) and all(computes_its_parameters(layer, (GAUPair,)) for layer in layers)):
            return None
        units = [unit for layer in layers for unit in layer.units]
        unit_states = [unit_state for layer_state in state.layers for unit_state in layer_state]
        token = model.embed.weight.new_empty(batch, 1, model.config.d_model)
        if why_units_do_not_step(units, unit_states, token) is not None:
            return None
        if not use_native("auto", model.embed.weight.device, dtype):  # last: it builds and checks the native code
            return None
        return cls(model, state, units, dtype)

    def _call(self, ids: torch.Tensor, tokens: torch.Tensor | None) -> None:
        self.native.step(ids, self.buffers.p, self.logits, self.codes, tokens)

    def _advance(self) -> None:
        super()._advance()
        self.buffers.advance()

    def state(self) -> LMState:
        """The ``LMState`` after every token so far (the units' states as ``decode_token`` leaves them)."""
        unit_states = [self.buffers.state(index) for index in range(len(self.buffers.units))]
        pairs = tuple(tuple(unit_states[2 * i : 2 * i + 2]) for i in range(len(unit_states) // 2))
        return LMState(layers=pairs, steps=self.steps, model=self.settings)
