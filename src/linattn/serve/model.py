"""``LinattnForCausalLM`` for vLLM: a linattn ``LM`` whose layers run in vLLM's engine.

The model holds the ``LM`` itself (weights loaded from the export's safetensors, every
layer linattn's own code) and runs it on vLLM's flat batches (the tokens of several
requests, one after another, each request a prompt chunk or one decoded token):

- A layer of a kind with a recurrent state (every kind but ``softmax``) is a
  ``_StateLayer``, a vLLM state-cache layer (``MambaBase``): its state sits in the
  sequence's slot of vLLM's state cache as one float32 row (``linattn.serve.states``), the
  same row size for every layer of the model (the largest one's), declared through
  ``get_state_shape``/``get_state_dtype``. A prompt chunk runs through the layer in one call
  (its chunk and block forms) from the slot's state, or from no state when the sequence
  is new (vLLM's slots are reused: what a slot held before is never read); one-token
  decoding steps of sequences whose states have the same shapes run as one batch (the
  layer's one-token steps, the native VQ step where it runs). The new state goes back to
  the slot.
- A ``softmax`` layer is a ``_PagedBlock``: linattn's projections, rotary positions and
  entropy scale around vLLM's ``Attention`` (its paged KV cache and kernels), so hybrids
  mix both.

vLLM internals used (vLLM ``VLLM_VERSION``): ``MambaBase`` and ``MambaAttentionBackendEnum.LINEAR``
(its metadata: ``query_start_loc``, ``seq_lens``, ``state_indices_tensor``), the forward
context (``get_forward_context``), ``Attention``, the interfaces ``HasInnerState`` and
``IsHybrid``, ``direct_register_custom_op`` (a state layer is one opaque op, so vLLM may
compile the model around it).
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ..models.config import LMConfig
from ..models.lm import LM
from ..nn.rotary import apply_rotary_at
from ..ops.softmax import entropy_scale
from .config import PAGED_KINDS
from .states import STATE_DTYPE, StateLayout, layer_layout

_WEIGHT_PREFIX = "model.lm."  # the export's names: LinattnForCausalLM.model (LinattnModel).lm


class LinattnForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """A linattn export served by vLLM (see the module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config.to_lm_config()
        max_positions = vllm_config.model_config.max_model_len
        self.lm = LM(config).eval()
        layouts = _layouts(self.lm, max_positions)
        width = max((layout.size for layout in layouts.values()), default=0)
        blocks = []
        for index, (spec, layer) in enumerate(zip(self.lm.specs, self.lm.layers)):
            name = f"{prefix}.blocks.{index}" if prefix else f"blocks.{index}"
            if spec.kind in PAGED_KINDS:
                blocks.append(_PagedBlock(layer, name, vllm_config))
            else:
                blocks.append(_StateLayer(layer, layouts[index], width, name, vllm_config))
        self.blocks = nn.ModuleList(blocks)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        """One float32 row per sequence, as wide as the model's largest layer state."""
        config = vllm_config.model_config.hf_config.to_lm_config()
        return ((_state_width(json.dumps(config.to_dict(), sort_keys=True), vllm_config.model_config.max_model_len),),)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return (STATE_DTYPE,)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm.embed(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Hidden states after the final norm, ``[tokens, d_model]``."""
        x = self.lm.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for block in self.blocks:
            if isinstance(block, _PagedBlock):
                x = block(x, positions)
            else:
                out = torch.zeros_like(x)
                torch.ops.vllm.linattn_state_layer(x, out, block.prefix)
                x = out
        return self.lm.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm.logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Every tensor of the export (weights, codebooks, buffers) into the ``LM``, strictly: a
        missing or unexpected name is an error naming it."""
        state = {}
        for name, tensor in weights:
            if not name.startswith(_WEIGHT_PREFIX):
                raise ValueError(f"unexpected tensor {name!r} in a linattn export (its names start with "
                                 f"{_WEIGHT_PREFIX!r})")
            state[name[len(_WEIGHT_PREFIX):]] = tensor
        self.lm.load_state_dict(state, strict=True)
        self.lm.eval()
        return {name for name, _ in self.named_parameters()}


def _layouts(lm: LM, max_positions: int) -> dict[int, StateLayout]:
    """The state layout of every layer with a state slot, by layer index."""
    return {index: layer_layout(spec.kind, layer, lm.config.d_model, max_positions, spec.option)
            for index, (spec, layer) in enumerate(zip(lm.specs, lm.layers)) if spec.kind not in PAGED_KINDS}


@functools.lru_cache(maxsize=8)
def _state_width(config_json: str, max_positions: int) -> int:
    """The slot row size of a model (its largest layer state), from a model built on the CPU."""
    with torch.device("cpu"):
        lm = LM(LMConfig.from_dict(json.loads(config_json))).float().eval()
    return max((layout.size for layout in _layouts(lm, max_positions).values()), default=0)


class _PagedBlock(nn.Module):
    """A ``softmax`` layer (``PreNormBlock`` over ``Attention(mechanism="softmax")``) on vLLM's
    paged attention: ``x + o_proj(attention(...))``, then ``x + ffn(norm(x))``."""

    def __init__(self, block: nn.Module, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self._block = [block]  # owned by the LM (not registered twice)
        mixer = block.mixer
        if mixer.rerope is not None:
            raise ValueError(f"{prefix}: a softmax layer with ReRoPE (rerope={mixer.rerope}) cannot be served: vLLM's "
                             "paged attention takes one score product, ReRoPE merges two (a local:W:rerope=R layer "
                             "keeps a window's keys and is served)")
        scale = 1.0 if mixer.scale == "entropy" else mixer.head_dim ** -0.5  # entropy: already in q
        self.attn = Attention(mixer.n_heads, mixer.head_dim, scale, num_kv_heads=mixer.n_kv_heads,
                              cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn")

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        block = self._block[0]
        mixer = block.mixer
        N, D = x.shape[0], mixer.head_dim
        h = block.mixer_norm(x)
        q = mixer.q_proj(h).view(N, mixer.n_heads, D).transpose(0, 1)  # [H, N, D]: positions along N
        k = mixer.k_proj(h).view(N, mixer.n_kv_heads, D).transpose(0, 1)
        v = mixer.v_proj(h)
        if mixer.rotary:
            q = apply_rotary_at(q, positions, mixer.rotary_base, mixer.rotary_scaling)
            k = apply_rotary_at(k, positions, mixer.rotary_base, mixer.rotary_scaling)
        if mixer.scale == "entropy":
            q = q * entropy_scale((positions + 1).to(q.dtype), D).unsqueeze(-1)
        out = self.attn(q.transpose(0, 1).reshape(N, -1), k.transpose(0, 1).reshape(N, -1), v)
        x = x + mixer.o_proj(out)
        return x + block.ffn(block.ffn_norm(x))


class _StateLayer(MambaBase, nn.Module):
    """A linattn layer whose decode state lives in vLLM's state cache (see the module docstring)."""

    def __init__(self, layer: nn.Module, layout: StateLayout, width: int, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self._layer = [layer]  # owned by the LM (not registered twice)
        self.layout, self.width, self.prefix = layout, width, prefix
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix!r}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return ((self.width,),)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return (STATE_DTYPE,)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def run(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i] =`` this layer's output for token ``i`` of the flat batch ``x``, continuing
        each sequence from its slot and writing its new state back."""
        layer = self._layer[0]
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if metadata is None:  # vLLM's profiling run: no sequences, only the shapes matter
            out.copy_(layer(x.unsqueeze(0), None)[0][0])
            return
        slots = self.kv_cache[0]
        # the batch's layout, read on the host (free on a CPU; on a GPU one copy per layer and step)
        starts = metadata.query_start_loc.tolist()
        totals = metadata.seq_lens.tolist()
        rows = metadata.state_indices_tensor.tolist()
        decodes = defaultdict(list)  # group key -> [(token, slot row, steps before)]
        for request, row in enumerate(rows[: len(starts) - 1]):
            start, end = starts[request], starts[request + 1]
            past = totals[request] - (end - start)
            if end == start or row < 0:  # padding
                continue
            if end - start == 1 and past > 0:
                decodes[self.layout.group_key(past)].append((start, row, past))
                continue
            slot = torch.tensor([row], device=slots.device)
            state = None if past == 0 else self.layout.read(slots, slot, past)
            y, state, _ = layer(x[start:end].unsqueeze(0), state)
            out[start:end] = y[0]
            self.layout.write(slots, slot, state, past + end - start)
        for members in decodes.values():
            self._decode(layer, x, out, slots, members)

    def _decode(self, layer, x, out, slots, members) -> None:
        """One token each for sequences of one group key (``members``: token index, slot row,
        position), as one batched call. Their states have the same shapes and whatever of the
        position the layer reads (``StateLayout.group_key``), so the first member's position
        stands for all of them."""
        tokens = torch.tensor([token for token, _, _ in members], device=x.device)
        rows = torch.tensor([row for _, row, _ in members], device=slots.device)
        past = members[0][2]
        state = self.layout.read(slots, rows, past)
        y, state, _ = layer(x.index_select(0, tokens).unsqueeze(1), state)
        out.index_copy_(0, tokens, y[:, 0])
        self.layout.write(slots, rows, state, past + 1)


def _run_state_layer(hidden: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].run(hidden, output)


def _run_state_layer_fake(hidden: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    return None


direct_register_custom_op(op_name="linattn_state_layer", op_func=_run_state_layer, mutates_args=["output"],
                          fake_impl=_run_state_layer_fake)
