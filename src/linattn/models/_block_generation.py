"""``LM.generate``'s token loop for a model of pre-norm blocks on a CPU: one native call per token.

For models whose every layer is a ``PreNormBlock`` (``x + mixer(norm(x))``, then SwiGLU) with one
of these mixers: exact softmax attention over its preallocated KV cache and sliding-window
attention (``softmax``, ``local``, with rotary positions, rope scaling, ``nope`` or the entropy
scale or ReRoPE, projection biases), kernel attention with a fixed elementwise map
(``linear:elu``, ``linear:relu``, ``linear:identity``), DPFP (``linear:dpfp``), Taylor's
(``linear:taylor``), the exponential maps with their running key shift (``linear:exp``, FAVOR+:
``favor``) or Hedgehog's learned map (``linear:hedgehog``), DeltaNet (``delta`` and its maps:
``delta:elu``, ``delta:relu``, ``delta:dpfp``, ``delta:taylor``, ``delta:exp``), Gated DeltaNet
(``gated-delta``), GLA (``gla``), RetNet (``retnet``) and multi-head VQ attention with ReRoPE or
the windowed bias (``vq-attn:rerope``, ``vq-attn:bias``: the converted students of ``linattn
linearize``); GAU pairs may sit among the blocks (``local,local,vq``) or make the whole model
(``gau-softmax``), each unit a block of the native object: a Transformer-VQ unit (VQ or FSQ keys,
with or without ReRoPE) that ``vq_gau_step`` computes over its resident buffer, or a unit with
exact softmax that ``gau_softmax_step`` computes over its KV cache (claimed as a softmax
layer's); a model of VQ pairs alone is ``VQGeneration``'s. Every VQ
buffer (a unit's or a VQ attention's) moves into its cache every ``L`` tokens by the VQ loop's own
``UnitBuffers`` (``_vq_generation.py``).
``BlockGeneration`` reads every block's parameters once (the projections of a mixer's input as
one matrix, the norms' gains folded into the matrices after them), takes each block's state
tensors from the prompt's state, and hands both to the native ``BlockModelStep``
(``ops/common/_native/block_model_step.cpp``, which gives each mixer's equations): each token is
then one call (embedding, every block, the final norm, the head), the states written in place:
a softmax layer's new keys go into the rows that ``kv_cache.reserve`` left after its cache
(``kv_cache.claim``), a local layer's into a ring of
its last ``window - 1`` positions.

Before each token ``current()`` checks that nothing it read has changed (``NativeGeneration``);
when something has, the loop continues from ``state()`` through ``LM._run``. Results equal
``LM._run``'s token by token (tested in float64). ``LINATTN_BLOCK_STEP_IMPL=torch`` turns it off;
``native`` makes a model of pre-norm blocks that it does not apply to an error naming why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .._checks import env_choice
from ..nn._gau_decode import decode_constants, norm_eps, reads_plainly
from ..nn.attention import Attention
from ..nn.delta_net import DeltaNet
from ..nn.gated_delta_net import GatedDeltaNet
from ..nn.gau import GAU, computes_its_parameters
from ..nn.gla import GatedLinearAttention
from ..nn.hedgehog import HedgehogFeatureMap
from ..nn.retention import MultiScaleRetention, retention_log_decays
from ..nn.quantizer import VectorQuantizer
from ..nn.short_conv import ShortConvolution
from ..nn.vq_heads import MultiHeadVQAttention
from ..ops.common.native import Trust, extension, relative_error
from ..ops.common.rotary import rotary_frequencies
from ..ops.kernel.feature_maps import DPFP, FAVOR, EluPlusOne, Exp, FeatureMap, Identity, ReLU, Taylor
from ..ops.softmax import kv_cache
from ..ops.vq.native_choice import ENV as VQ_STEP_ENV
from ..ops.vq.native_choice import use_native as use_native_vq_step
from ..ops.vq.resident import scoring_tensors
from ..state import KVCacheState, LMState, VQAttentionState, _State
from ._native_generation import NativeGeneration, head_t, plain_ends
from ._vq_generation import UnitBuffers, unit_constants, why_units_do_not_step
from .layers import GAUPair, PreNormBlock, SwiGLU

ENV = "LINATTN_BLOCK_STEP_IMPL"
_FEATURES = {Identity: 0, EluPlusOne: 1, ReLU: 2, DPFP: 4, Taylor: 5, Exp: 6, FAVOR: 7}  # 3: Hedgehog's learned map
_NORMALIZE = {None: 0, "attention": 1, "sum": 2, "l2": 3}
_FEATURE_EPS = 1e-6  # linear_attention's and delta_rule's eps, which the layers leave at their default
_MIXERS = (Attention, DeltaNet, GatedDeltaNet, GatedLinearAttention, MultiScaleRetention, MultiHeadVQAttention)
_SEARCH = ("search_t", "norms")  # the nearest-code search's tensors: float32 in every dtype
# the state tensors of each mixer's state, by the names the native object takes them
_STATE_FIELDS = {"memory": ("kv", "memory"), "normalizer": ("normalizer",), "shift": ("key_shift",),
                 "conv": ("conv",), "keys": ("keys",), "values": ("values",)}


@dataclasses.dataclass
class _Recipe:
    """A block as the native object takes it: the mixer's rule, tensors and numbers."""

    rule: str
    tensors: dict[str, torch.Tensor]
    numbers: dict[str, float]


def _plain(module: nn.Module | None, kinds: tuple[type, ...]) -> bool:
    return module is not None and computes_its_parameters(module, kinds)


def _feature_numbers(fmap: FeatureMap) -> dict[str, int] | None:
    """The numbers of a fixed feature map the native step makes (``block_model_step.cpp``), or None."""
    code = _FEATURES.get(type(fmap))
    if code == 4:
        return dict(feature=code, dpfp_nu=fmap.nu)
    if code == 7:
        return dict(feature=code, favor_features=fmap.num_features)
    return None if code is None else dict(feature=code)


def _feature_tensors(fmap: FeatureMap, head_dim: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of a fixed feature map (FAVOR+'s projection, transposed), by the native step's names."""
    return dict(projection_t=fmap.projection(head_dim, dtype=dtype).t()) if isinstance(fmap, FAVOR) else {}


def _projection_biases(mixer: nn.Module) -> dict[str, torch.Tensor]:
    """The biases of an attention layer's projections by the native step's names: the q, k and v
    biases as one ``in_bias``, the output's ``out_bias`` (``nn/_heads.add_attention_projections``)."""
    biases = {}
    if mixer.q_proj.bias is not None:
        biases["in_bias"] = torch.cat([mixer.q_proj.bias, mixer.k_proj.bias, mixer.v_proj.bias])
    if mixer.o_proj.bias is not None:
        biases["out_bias"] = mixer.o_proj.bias
    return biases


def _mixer_recipe(mixer: nn.Module, dtype: torch.dtype) -> _Recipe | str:
    """The mixer's rule, tensors and numbers (``block_model_step.cpp``), or why it has none."""
    if not computes_its_parameters(mixer, _MIXERS):
        taken = ", ".join(kind.__name__ for kind in _MIXERS)
        return f"a mixer of type {type(mixer).__name__} (the native step takes {taken})"
    linears = [mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.o_proj]
    numbers = dict(heads=mixer.n_heads, kv_heads=mixer.n_kv_heads, head_dim=mixer.head_dim, feature=0, normalize=0,
                   feature_eps=_FEATURE_EPS, scale=mixer.head_dim ** -0.5)
    tensors: dict[str, torch.Tensor] = {}
    inputs = [mixer.q_proj.weight, mixer.k_proj.weight, mixer.v_proj.weight]
    rule = "sum"
    if isinstance(mixer, Attention):
        if mixer.mechanism in ("softmax", "local"):
            rule = mixer.mechanism
            numbers.update(window=mixer.window if rule == "local" else 0, entropy=int(mixer.scale == "entropy"))
            if mixer.rerope is not None:  # the keys stay unrotated; the step turns each query by its distance
                numbers.update(rerope=mixer.rerope)
                tensors.update(rerope_frequencies=rotary_frequencies(mixer.head_dim, mixer.rotary_base, dtype=dtype))
        elif mixer.query_map is not None:
            if not all(_plain(m, (HedgehogFeatureMap,)) for m in (mixer.query_map, mixer.key_map)):
                return "kernel attention with a Hedgehog map that is not a plain HedgehogFeatureMap"
            numbers.update(feature=3, normalize=_NORMALIZE["attention"], scale=1.0)
            tensors.update(query_map=mixer.query_map.weight, key_map=mixer.key_map.weight)
        elif _feature_numbers(mixer.feature_map) is None:
            return (f"kernel attention with the feature map {getattr(mixer.feature_map, 'name', None)!r} (the native "
                    "step takes the elu, relu, identity, DPFP, Taylor, exp, FAVOR+ and Hedgehog maps)")
        else:
            numbers.update(**_feature_numbers(mixer.feature_map), normalize=_NORMALIZE["attention"], scale=1.0)
            tensors.update(_feature_tensors(mixer.feature_map, mixer.head_dim, dtype))
        if mixer.rotary:  # softmax and local by default; kernel attention where asked (linear:hedgehog)
            tensors.update(frequencies=rotary_frequencies(mixer.head_dim, mixer.rotary_base, mixer.rotary_scaling,
                                                          dtype=dtype))
        tensors.update(_projection_biases(mixer))
    elif isinstance(mixer, MultiHeadVQAttention):
        if not _plain(mixer.quantizer, (VectorQuantizer,)):
            return "multi-head VQ attention whose quantizer is not a plain VectorQuantizer"
        rule = "vq"
        numbers.update(block_size=mixer.block_size, rerope=mixer.rerope or 0)
        codebook_t, search_t, norms = scoring_tensors(mixer.quantizer.codebook, dtype)
        tensors.update(codebook_t=codebook_t, search_t=search_t, norms=norms.squeeze(1))
        if mixer.rerope is not None:
            tensors.update(rerope_frequencies=rotary_frequencies(mixer.head_dim, mixer.rotary_base, dtype=dtype))
        if mixer.relative_bias is not None:  # b_{h, i - j} for the buffer's columns p .. p + L: offsets L .. 0
            tensors.update(relative=mixer.relative_bias.view(mixer.n_kv_heads, -1, mixer.block_size + 1).flip(-1))
        tensors.update(_projection_biases(mixer))
    elif isinstance(mixer, DeltaNet):
        if _feature_numbers(mixer.feature_map) is None:
            return f"DeltaNet with the feature map {mixer.feature_map.name!r}"
        rule = "delta"
        if mixer.feature_map.exponential and mixer.normalize != "sum":
            return f"DeltaNet with the exponential map {mixer.feature_map.name!r} under normalize={mixer.normalize!r}"
        numbers.update(**_feature_numbers(mixer.feature_map), normalize=_NORMALIZE[mixer.normalize],
                       scale=mixer.feature_map.dim_out(mixer.head_dim) ** -0.5)  # delta_rule's: F^-1/2
        tensors.update(_feature_tensors(mixer.feature_map, mixer.head_dim, dtype))
        if mixer.beta_proj is not None:
            linears.append(mixer.beta_proj)
            inputs.append(mixer.beta_proj.weight)
            numbers.update(beta=1)
    elif isinstance(mixer, GatedDeltaNet):
        rule = "delta"
        linears += [mixer.beta_proj, mixer.decay_proj, mixer.gate_proj]
        inputs += [mixer.gate_proj.weight, mixer.beta_proj.weight, mixer.decay_proj.weight]
        numbers.update(normalize=_NORMALIZE["l2"], beta=1, decay=2, gate=1, silu_qkv=int(mixer.conv is None))
        tensors.update(decay_rate=torch.exp(mixer.A_log.to(dtype)), dt_bias=mixer.dt_bias)
        if not _plain(mixer.norm, (nn.RMSNorm,)) or mixer.norm.weight is None:
            return "a Gated DeltaNet whose head norm is not a plain RMSNorm with a gain"
        numbers.update(head_norm=1, head_eps=norm_eps(mixer.norm, dtype))
        tensors.update(head_gain=mixer.norm.weight)
    elif isinstance(mixer, GatedLinearAttention):
        linears += [mixer.decay_down, mixer.decay_up, mixer.gate_proj]
        inputs += [mixer.gate_proj.weight, mixer.decay_down.weight]
        numbers.update(decay=3, rank=mixer.decay_down.out_features, temperature=mixer.gate_temperature, gate=1)
        tensors.update(decay_up_t=mixer.decay_up.weight.t(), decay_bias=mixer.decay_bias)
        if not _plain(mixer.norm, (nn.RMSNorm,)) or mixer.norm.weight is None:
            return "a GLA layer whose head norm is not a plain RMSNorm with a gain"
        numbers.update(head_norm=1, head_eps=norm_eps(mixer.norm, dtype))
        tensors.update(head_gain=mixer.norm.weight)
    else:  # MultiScaleRetention
        linears.append(mixer.gate_proj)
        inputs.append(mixer.gate_proj.weight)
        norm = mixer.group_norm
        if not _plain(norm, (nn.GroupNorm,)) or not norm.affine or norm.num_groups != mixer.n_heads:
            return "a RetNet layer whose group norm is not a plain affine GroupNorm of one group per head"
        numbers.update(decay=1, gate=1, head_norm=2, head_eps=norm.eps)
        tensors.update(frequencies=rotary_frequencies(mixer.head_dim, mixer.rotary_base, dtype=dtype),
                       log_decay=retention_log_decays(mixer.n_kv_heads, dtype=dtype),
                       head_gain=norm.weight, head_bias=norm.bias)
    conv = getattr(mixer, "conv", None)
    if conv is not None:
        if not _plain(conv, (ShortConvolution,)):
            return "a short convolution that is not a plain ShortConvolution"
        numbers.update(conv_kernel=conv.kernel_size)
        tensors.update(conv_weight=conv.weight[:, 0, :], conv_bias=conv.bias)
    if not all(_plain(linear, (nn.Linear,)) for linear in linears):
        return f"a projection of its {type(mixer).__name__} that is not a plain nn.Linear (a subclass, hook or adapter)"
    tensors.update(in_t=torch.cat(inputs).t(), out_t=mixer.o_proj.weight.t())
    return _Recipe(rule, tensors, numbers)


def _block_recipe(block: nn.Module, dtype: torch.dtype) -> _Recipe | str:
    """A ``PreNormBlock``'s recipe: its mixer's, with the norms' gains folded into the matrices
    after them and the feed-forward's matrices; or why it has none."""
    if not computes_its_parameters(block, (PreNormBlock,)):
        return f"a layer of type {type(block).__name__} (the native step takes PreNormBlock layers)"
    ffn = block.ffn
    norms = (block.mixer_norm, block.ffn_norm)
    if not (all(_plain(norm, (nn.RMSNorm,)) and norm.weight is not None for norm in norms)
            and _plain(ffn, (SwiGLU,)) and all(_plain(m, (nn.Linear,)) and m.bias is None
                                               for m in (ffn.w_gate, ffn.w_up, ffn.w_down))):
        return "a block whose norms or feed-forward are not plain (a subclass, hook or adapter)"
    recipe = _mixer_recipe(block.mixer, dtype)
    if isinstance(recipe, str):
        return recipe
    recipe.tensors["in_t"] = recipe.tensors["in_t"] * block.mixer_norm.weight.unsqueeze(1)
    gate_up = torch.cat([ffn.w_gate.weight, ffn.w_up.weight]) * block.ffn_norm.weight
    recipe.tensors.update(gate_up_t=gate_up.t(), down_t=ffn.w_down.weight.t())
    recipe.numbers.update(mixer_eps=norm_eps(block.mixer_norm, dtype), ffn_eps=norm_eps(block.ffn_norm, dtype))
    recipe.tensors = {name: t.detach().to(torch.float32 if name in _SEARCH else dtype).contiguous()
                      for name, t in recipe.tensors.items()}
    recipe.numbers = {name: float(value) for name, value in recipe.numbers.items()}
    return recipe


@dataclasses.dataclass
class _GAUUnits:
    """A layer of two gated attention units, each a block of the native object: Transformer-VQ's
    (VQ or FSQ keys), or with exact softmax over a KV cache (``softmax``)."""

    units: list[GAU]
    softmax: bool


def _gau_units(layer: nn.Module, layer_state, token: torch.Tensor) -> _GAUUnits | str:
    """A GAU pair's units when they take the native one-token step (VQ units:
    ``why_units_do_not_step`` for ``token``, an empty ``[B, 1, d_model]`` in the model's dtype;
    softmax units: ``_why_softmax_units_do_not_step``), else why not."""
    if not computes_its_parameters(layer, (GAUPair,)):
        return f"a layer of type {type(layer).__name__} that is not a plain GAUPair"
    units, states = list(layer.units), list(layer_state)
    if all(unit.attention == "softmax" for unit in units):
        reason = _why_softmax_units_do_not_step(units, states, token.dtype)
        return reason if reason is not None else _GAUUnits(units, softmax=True)
    reason = why_units_do_not_step(units, states, token)
    return reason if reason is not None else _GAUUnits(units, softmax=False)


def _why_softmax_units_do_not_step(units: list[GAU], states: list, dtype: torch.dtype) -> str | None:
    """Why softmax units continuing ``states`` do not take the native step (None when they do):
    plain units, each holding the last state of its own KV buffer in the model's dtype."""
    if not all(computes_its_parameters(unit, (GAU,)) and reads_plainly(unit) for unit in units):
        return "a GAU softmax pair whose units are not plain (a subclass, hook or adapter)"
    if not all(isinstance(state, KVCacheState) and state.window is None and state.keys.dtype == dtype
               and kv_cache.claimable(state) for state in states):
        return ("a GAU softmax pair whose KV caches are not the last states of their buffers in the model's dtype "
                "(kv_cache.reserve makes ones that are)")
    return None


def _why_vq_heads_do_not_step(mixer: MultiHeadVQAttention, state, dtype: torch.dtype) -> str | None:
    """Why multi-head VQ attention continuing ``state`` does not take the native step (None when
    it does): a state of hard codes in the model's dtype, of its block size, within a block."""
    if not isinstance(state, VQAttentionState) or state.partial_codes.dim() != 3:
        return "multi-head VQ attention holds no VQAttentionState of hard codes"
    if state.partial_keys.dtype != dtype or state.block_size != mixer.block_size \
            or state.partial_keys.shape[2] >= mixer.block_size \
            or (state.prev_keys is not None and state.prev_keys.shape[2] != mixer.block_size):
        return "multi-head VQ attention's state is not one of its blocks in the model's dtype"
    return None


def _layer_steps(layer_state) -> set[int]:
    """The positions a layer's state has consumed (a GAU pair's: each unit's)."""
    return {unit.steps for unit in layer_state} if isinstance(layer_state, tuple) else {layer_state.steps}


def why_not(model, state: LMState) -> str | None:
    """Why the native block loop does not apply to ``model`` continuing ``state`` (None when it does)."""
    plan = _plan(model, state)
    return plan if isinstance(plan, str) else None


def _plan(model, state: LMState) -> list[_Recipe | _GAUUnits] | str:
    """Every layer's recipe (a pre-norm block's, or a GAU pair's units) when the native loop
    applies to ``model`` continuing ``state``, else why not."""
    dtype, device = model.embed.weight.dtype, model.embed.weight.device
    if device.type != "cpu" or dtype not in (torch.float32, torch.float64):
        return f"the native step computes on CPU tensors in float32 or float64, got {dtype} on {device.type}"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast is on (the model computes in another dtype there)"
    if not plain_ends(model):
        return ("the model is in training mode, computes gradients, has hooks, wrapped ends or inference-mode "
                "tensors")
    if any(p.dtype != dtype for p in model.parameters()):
        return "the model's parameters are of several dtypes"
    token = model.embed.weight.new_empty(state.batch_size(), 1, model.config.d_model)
    recipes = [_gau_units(layer, layer_state, token) if isinstance(layer, GAUPair)
               else _block_recipe(layer, dtype) for layer, layer_state in zip(model.layers, state.layers)]
    for index, recipe in enumerate(recipes):
        if isinstance(recipe, str):
            return f"layer {index} is {recipe}"
    units = [unit for recipe in recipes if isinstance(recipe, _GAUUnits) and not recipe.softmax
             for unit in recipe.units]  # each pair checked by _gau_units; the step takes one L and p for all
    vq_states = [unit_state for recipe, layer_state in zip(recipes, state.layers)
                 if isinstance(recipe, _GAUUnits) and not recipe.softmax for unit_state in layer_state]
    for index, (layer, layer_state, recipe) in enumerate(zip(model.layers, state.layers, recipes)):
        if isinstance(recipe, _Recipe) and recipe.rule == "vq":
            reason = _why_vq_heads_do_not_step(layer.mixer, layer_state, dtype)
            if reason is not None:
                return f"layer {index}'s {reason}"
            units.append(layer.mixer)
            vq_states.append(layer_state)
    if units:
        if len({unit.block_size for unit in units}) != 1 or len({s.partial_keys.shape[2] for s in vq_states}) != 1:
            return "VQ layers of different block sizes or positions in their blocks (the step takes one)"
        if not use_native_vq_step("auto", device, dtype):  # builds and checks the VQ step
            return (f"a VQ layer, whose native decoding step is off ({VQ_STEP_ENV}=torch) or failed its check "
                    "(warned of)")
    for index, (layer, layer_state) in enumerate(zip(model.layers, state.layers)):
        if isinstance(recipes[index], _GAUUnits) or recipes[index].rule == "vq":
            continue
        if any(t.dtype != dtype for t in _state_tensors(layer_state, copy=False).values()):
            return f"layer {index}'s state is not in the model's dtype {dtype}"
        shifted = recipes[index].numbers["feature"] in (6, 7) and getattr(layer_state, "normalize", None) == "attention"
        if shifted and layer_state.key_shift is None:
            return f"layer {index}'s state has no key shift (an exponential map's sums are kept shifted)"
        mechanism = getattr(layer.mixer, "mechanism", None)
        if mechanism == "softmax" and not (layer_state.window is None and kv_cache.claimable(layer_state)):
            return (f"layer {index}'s KV cache is not the last state of its buffer (kv_cache.reserve makes one "
                    "that is)")
        if mechanism == "local" and (layer_state.window != layer.mixer.window or layer_state.keys.shape[2]
                                     != min(layer_state.steps, layer.mixer.window - 1)):
            return f"layer {index}'s cache is not the last window - 1 positions of its window {layer.mixer.window}"
    if len(set().union(*map(_layer_steps, state.layers))) != 1:
        return "the layers' states have consumed different numbers of positions"
    return recipes


class BlockGeneration(NativeGeneration):
    """The state of ``LM.generate`` after the prompt, held in the native ``BlockModelStep``."""

    def __init__(self, model, state: LMState, dtype: torch.dtype, recipes: list[_Recipe | _GAUUnits]):
        super().__init__(model, state, dtype)
        self.native = extension().BlockModelStep(model.embed.weight.detach().to(dtype).contiguous(),
                                                 model.norm.weight.detach().to(dtype).contiguous(),
                                                 norm_eps(model.norm, dtype), head_t(model, dtype).detach())
        self.layer_states, self.held, self.buffers, self.layer_blocks = state.layers, [], {}, []
        self.vq_unit_of = {}  # a VQ attention's native block -> its unit in self.vq
        self.pair_parts = {}  # a GAU pair's layer -> per unit ("vq", its unit in self.vq) or ("kv", block, state)
        self.position = self.start = min(_layer_steps(state.layers[0]))
        vq_blocks, vq_units, vq_states = [], [], []  # the VQ units and VQ attentions: their native blocks and states
        block = 0
        for index, (layer, layer_state, recipe) in enumerate(zip(model.layers, state.layers, recipes)):
            if isinstance(recipe, _GAUUnits):
                parts = self.pair_parts[index] = []
                for unit, unit_state in zip(recipe.units, layer_state):
                    if recipe.softmax:
                        c = decode_constants(unit, dtype)
                        self.native.add_softmax_unit(
                            [c.input_t, c.content_bias, c.position_keys_reversed_t, c.bias_reversed, c.output_t],
                            c.input_shift, c.eps, unit.scale == "entropy", unit.block_size)
                        buffer = self.buffers[block] = kv_cache.claim(unit_state)
                        self.native.set_state(block, {"keys": buffer.keys, "values": buffer.values},
                                              unit_state.keys.shape[2])
                        parts.append(("kv", block, unit_state))
                    else:
                        self.native.add_vq_unit(*unit_constants(unit, dtype), unit.block_size)
                        parts.append(("vq", len(vq_units)))
                        vq_blocks.append(block)
                        vq_units.append(unit)
                        vq_states.append(unit_state)
                    block += 1
                self.held.append(None)
                self.layer_blocks.append(None)
                continue
            self.native.add_block(recipe.rule, recipe.tensors, recipe.numbers)
            index = block  # the native object's blocks: a VQ pair is two
            self.layer_blocks.append(index)
            block += 1
            if recipe.rule == "vq":
                self.vq_unit_of[index] = len(vq_units)
                vq_blocks.append(index)
                vq_units.append(layer.mixer)
                vq_states.append(layer_state)
                held = None
            elif recipe.rule == "softmax":
                buffer = self.buffers[index] = kv_cache.claim(layer_state)
                held = {"keys": buffer.keys, "values": buffer.values}
                self.native.set_state(index, held, layer_state.keys.shape[2])
            elif recipe.rule == "local":
                held = _ring(layer_state, layer.mixer.window - 1, self.position)
                self.native.set_state(index, held)
            else:
                held = _state_tensors(layer_state)
                self.native.set_state(index, held)
            self.held.append(held)
        self.vq = None if not vq_units else UnitBuffers(vq_units, vq_states, dtype, lambda unit, window: (
            self.native.set_window(vq_blocks[unit], window.keys, window.values, window.codes, window.mask,
                                   window.keys_are_codes)))

    @classmethod
    def start(cls, model, state: LMState, batch: int) -> "BlockGeneration | None":
        """The native token loop for ``model`` continuing ``state`` (``batch`` rows), or None
        (a ValueError naming why under ``LINATTN_BLOCK_STEP_IMPL=native``)."""
        forced = env_choice(ENV, ("torch", "native"))
        if forced == "torch" or not all(isinstance(layer, (PreNormBlock, GAUPair)) for layer in model.layers) or \
                _vq_pairs_alone(model):  # VQGeneration's
            return None
        plan = _plan(model, state)
        if isinstance(plan, str):
            if forced == "native":
                raise ValueError(f"{ENV}=native: {plan}")
            return None
        dtype = model.embed.weight.dtype
        if not _trust.trusted(dtype, forced == "native", f"the native block step failed in {dtype}",  # builds, checks
                              f"Unset {ENV} (or set it to torch)",
                              f"LM.generate steps these models through LM._run in {dtype} from now on ({ENV}=torch "
                              "chooses it without trying the native step)"):
            return None
        return cls(model, state, dtype, plan)

    def current(self) -> bool:
        """``NativeGeneration.current``, and room for one more row in every softmax cache."""
        return super().current() and all(self.native.cache_length(index) < buffer.capacity
                                          for index, buffer in self.buffers.items())

    def _call(self, ids: torch.Tensor, tokens: torch.Tensor | None) -> None:
        self.native.step(ids, self.position, self.logits, tokens, 0 if self.vq is None else self.vq.p)

    def _advance(self) -> None:
        super()._advance()
        self.position += 1
        if self.vq is not None:
            self.vq.advance()

    def state(self) -> LMState:
        """The ``LMState`` after every token so far: the prompt's, with the held tensors (copies:
        the native object goes on writing its own) and the steps counted on."""
        added = self.position - self.start
        layers = []
        for layer, (layer_state, held, index) in enumerate(zip(self.layer_states, self.held, self.layer_blocks)):
            if index is None:  # a GAU pair: its units' states as their one-token steps leave them
                layers.append(tuple(self.vq.state(part[1]) if part[0] == "vq"
                                    else kv_cache.claimed_state(part[2], self.buffers[part[1]], added)
                                    for part in self.pair_parts[layer]))
            elif index in self.vq_unit_of:
                layers.append(self.vq.state(self.vq_unit_of[index]))
            elif index in self.buffers:
                layers.append(kv_cache.claimed_state(layer_state, self.buffers[index], added))
            elif isinstance(layer_state, KVCacheState):  # a local layer's ring, in the order of its positions
                rows = held["keys"].shape[2]
                order = _ring_rows(self.position, rows, held["keys"].device)
                ordered = {name: held[name][:, :, order].clone() for name in ("keys", "values")}
                layers.append(_with_tensors(layer_state, ordered, added))
            else:
                layers.append(_with_tensors(layer_state, {name: t.clone() for name, t in held.items()}, added))
        return LMState(layers=tuple(layers), steps=self.steps, model=self.settings)


def _vq_pairs_alone(model) -> bool:
    """Whether every layer is a GAU pair of VQ, FSQ or soft-VQ units (``VQGeneration``'s models)."""
    return all(isinstance(layer, GAUPair) and all(unit.attention in ("vq", "fsq", "soft-vq") for unit in layer.units)
               for layer in model.layers)


def _ring_rows(position: int, rows: int, device: torch.device) -> torch.Tensor:
    """The rows of a ring of ``rows`` that hold the last ``min(position, rows)`` positions
    before ``position``, oldest first (position i at row i mod rows)."""
    held = min(position, rows)
    return torch.arange(position - held, position, device=device) % max(rows, 1)


def _ring(state: KVCacheState, rows: int, position: int) -> dict[str, torch.Tensor]:
    """A local cache (the last positions before ``position``) as a ring of ``rows`` rows."""
    B, Hkv, _, D = state.keys.shape
    order = _ring_rows(position, rows, state.keys.device)
    ring = {}
    for name in ("keys", "values"):
        ring[name] = state.keys.new_zeros(B, Hkv, rows, D)
        ring[name][:, :, order] = getattr(state, name)
    return ring


def _state_tensors(state: _State, copy: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a mixer's state by the native object's names (with ``copy``, as contiguous copies)."""
    found: dict[str, torch.Tensor] = {}

    def visit(value: Any) -> None:
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            if isinstance(item, _State):
                visit(item)
            for name, fields in _STATE_FIELDS.items():
                if field.name in fields and isinstance(item, torch.Tensor):
                    found[name] = item.detach().clone(memory_format=torch.contiguous_format) if copy else item

    visit(state)
    return found


def _with_tensors(state: _State, tensors: dict[str, torch.Tensor], added: int) -> _State:
    """``state`` with its tensors replaced by ``tensors`` (native names) and every ``steps``
    counted ``added`` further."""
    changes = {}
    for field in dataclasses.fields(state):
        item = getattr(state, field.name)
        if isinstance(item, _State):
            changes[field.name] = _with_tensors(item, tensors, added)
        elif field.name == "steps":
            changes[field.name] = item + added
        else:
            for name, fields in _STATE_FIELDS.items():
                if field.name in fields and isinstance(item, torch.Tensor):
                    changes[field.name] = tensors[name].to(item.dtype)
    return dataclasses.replace(state, **changes)


def _self_check(dtype: torch.dtype) -> str | None:
    """A small model of every mixer the step takes (GQA, short convolutions, a window that the
    tokens pass, VQ GAU pairs with and without ReRoPE, an FSQ pair and multi-head VQ attentions whose
    blocks the tokens complete, a GAU softmax pair and a soft-VQ pair), a prompt and three tokens,
    through the native step and through ``LM._run``: None when the logits agree (``max |native -
    torch| <= 1e-5 max |torch|`` in float32, 1e-12 in float64), else the difference."""
    from .config import LMConfig
    from .lm import LM

    tolerance = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    config = LMConfig(vocab_size=32, d_model=16, n_layers=21, n_heads=4, n_kv_heads=2,
                      attention="linear:elu,delta,gated-delta,gla,retnet,softmax:entropy,local:3,linear:hedgehog,"
                                "delta:dpfp,linear:taylor,favor:8,linear:exp,vq,softmax:rerope=2,local:4:rerope=2,"
                                "vq-attn:rerope=2,vq-attn:bias,vq:rerope=2,vq-fsq,gau-softmax:entropy,soft-vq",
                      block_size=2, codebook_size=8, gau_d_k=8, gau_d_v=16, fsq_levels=(3, 2, 2))
    with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.autocast("cpu", enabled=False):
        torch.manual_seed(0)
        model = LM(config).to(dtype).eval()
        for parameter in model.parameters():  # away from the initial values (zero biases, unit gains)
            parameter.add_(0.1 * torch.randn_like(parameter))
        ids = torch.randint(0, 32, (2, 4))
        _, state, _ = model._run(ids, None, with_aux=False)
        state = kv_cache.reserve(state, 3)
        plan = _plan(model, state)
        if isinstance(plan, str):
            return f"the check's own model is refused: {plan}"
        session = BlockGeneration(model, state, dtype, plan)
        for step in range(3):
            token = ids[:, step].contiguous()
            want, state, _ = model._run(token.unsqueeze(1), state, with_aux=False)
            got = session.step(token)
            error = relative_error(got, want)
            if not error <= tolerance:
                return (f"token {step}: the logits differ by {error:.3g} of their largest value "
                        f"(tolerance {tolerance:g})")
    return None


_trust = Trust(_self_check)


def verdict(dtype: torch.dtype) -> str | None:
    """None when the native step builds and agrees with ``LM._run`` in ``dtype`` (``_self_check``),
    else what failed; the check runs at the first ask per dtype (``linattn doctor --build`` asks)."""
    return _trust.verdict(dtype)
