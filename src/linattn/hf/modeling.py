"""``LinattnModel`` and ``LinattnForCausalLM``: ``linattn.models.LM`` behind the Hugging Face API.

Both wrap one ``LM`` (``model.lm``), so every layer is linattn's own; the HF classes add
padding masks, the ``LinattnCache`` that ``generate`` carries, HF outputs and the loss.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .._checks import check_token_ids
from ..models.lm import LM
from ..nn.codebook import Codebook
from ..state import LMState
from . import _native_steps
from .cache import LinattnCache, RowGroup
from .config import LinattnConfig
from .remote_code import REMOTE_CODE_FILE, auto_map_modules, write_remote_code


_ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


class LinattnPreTrainedModel(PreTrainedModel):
    """Shared Hugging Face plumbing: the config class, weight init (``LM``'s own, done when
    the ``LM`` is built), the flags ``generate`` reads, activation checkpointing (``LM``'s
    own switch), the attention-implementation choice and vocabulary resizing."""

    config_class = LinattnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules: list[str] = []
    _is_stateful = True
    lm: LM  # the wrapped linattn LM (LinattnModel's module, LinattnForCausalLM's model.lm)

    # -- activation checkpointing: LM.activation_checkpointing behind the HF switches ---------

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Turn on ``LM.activation_checkpointing`` (each layer recomputed in backward by
        ``torch.utils.checkpoint`` with ``use_reentrant=False``): same values and gradients,
        one layer's activations at a time. ``gradient_checkpointing_enable`` and the
        ``Trainer``'s ``activation_checkpointing=True`` arrive here. Every layer is
        checkpointed and activations stay on their device, so ``every_n_layers`` other than 1,
        ``offload=True`` and checkpoint options other than ``use_reentrant=False`` are refused."""
        if activation_checkpointing_kwargs is not None:
            if not isinstance(activation_checkpointing_kwargs, dict):
                raise TypeError(f"activation_checkpointing_kwargs must be a dict or None, got "
                                f"{type(activation_checkpointing_kwargs).__name__}")
            other = {key: value for key, value in activation_checkpointing_kwargs.items()
                     if not (key == "use_reentrant" and value is False)}
            if other:
                raise ValueError(f"activation_checkpointing_kwargs {other} are not supported: linattn's LM "
                                 "checkpoints every layer with torch.utils.checkpoint(use_reentrant=False) and "
                                 "takes no other options")
        if every_n_layers != 1:
            raise ValueError(f"every_n_layers={every_n_layers!r} is not supported: linattn's LM checkpoints every "
                             "layer (every_n_layers=1)")
        if offload is not False:
            raise ValueError(f"offload={offload!r} is not supported: linattn's LM keeps the checkpointed "
                             "activations on their device (offload=False)")
        self._set_gradient_checkpointing(enable=True)

    def activation_checkpointing_disable(self) -> None:
        """Turn off ``LM.activation_checkpointing`` (``gradient_checkpointing_disable`` too)."""
        self._set_gradient_checkpointing(enable=False)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func: Any = None,
                                    every_n_layers: int = 1) -> None:
        """HF's hook for the switch (also reached from a config's legacy
        ``gradient_checkpointing=True``): it sets the ``LM``'s own flag."""
        self.lm.activation_checkpointing = bool(enable)

    @property
    def is_activation_checkpointing(self) -> bool:
        """Whether the ``LM`` recomputes its layers in backward."""
        return bool(self.lm.activation_checkpointing)

    # -- attention implementation ----------------------------------------------------------

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, is_init_check: bool = False,
                                              allow_all_kernels: bool = False) -> str:
        """``attn_implementation``: None, ``"eager"`` or ``"sdpa"``, all recorded as ``"eager"``.
        linattn's layers always run their own attention code (VQ, kernel, delta, local and
        softmax layers alike), so neither choice changes a computation; any other value (flash
        attention, flex attention, a kernel from the Hub, ``"paged|eager"``) is a ValueError."""
        return _attn_implementation(attn_implementation)

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        return _attn_implementation(requested_attention)

    # -- vocabulary resizing ---------------------------------------------------------------

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """``PreTrainedModel.resize_token_embeddings`` (embedding and untied output head), then the
        ``LM``'s own ``config.vocab_size`` set to the new row count, so new ids train and generate."""
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self._match_vocab_size()
        return embeddings

    def _match_vocab_size(self) -> None:
        """Make ``lm.config.vocab_size`` and ``config.vocab_size`` the embedding's row count."""
        rows = self.lm.embed.num_embeddings
        if self.lm.head is not None and self.lm.head.out_features != rows:
            return  # mid-resize: the head follows (set_output_embeddings calls this again)
        if self.lm.config.vocab_size != rows:
            self.lm.config = dataclasses.replace(self.lm.config, vocab_size=rows)
        self.config.vocab_size = rows

    def get_output_embeddings(self) -> nn.Linear | None:
        """The LM's untied output head (None when it is tied to the embedding); LinattnModel
        holds the whole LM too, so resizing either class resizes the head with the embedding."""
        return self.lm.head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        if self.lm.head is None:
            raise ValueError("this model ties its output head to the embedding (tie_embeddings=True); "
                             "set the input embeddings instead")
        if not isinstance(value, nn.Linear) or value.in_features != self.lm.config.d_model:
            raise ValueError(f"output embeddings must be an nn.Linear from d_model={self.lm.config.d_model}, "
                             f"got {value!r}")
        self.lm.head = value
        self._match_vocab_size()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.lm.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        if not isinstance(value, nn.Embedding) or value.embedding_dim != self.lm.config.d_model:
            raise ValueError(f"input embeddings must be an nn.Embedding of width d_model={self.lm.config.d_model}, "
                             f"got {value!r}")
        self.lm.embed = value
        self._match_vocab_size()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        """``PreTrainedModel.from_pretrained``, then every tensor copied to freshly allocated
        memory (safetensors loads leave tensors at unaligned addresses, where BLAS takes
        other vector paths and float results differ in the last bit from the saved model's;
        an aligned one may still lie in the file's memory map, and change when the file is
        rewritten in place) and the codebooks' buffers returned to float32 (their invariant;
        the loader casts every buffer to the requested dtype). With ``output_loading_info=True``
        it returns ``(model, loading_info)``, as transformers does."""
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if kwargs.get("output_loading_info") else loaded
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.data = tensor.data.clone()
            for module in model.modules():
                if isinstance(module, Codebook):  # the loader casts buffers to the model dtype
                    module._apply(lambda t: t)  # codes and EMA statistics back to float32
        return loaded

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """``PreTrainedModel.save_pretrained``, with the module ``config.auto_map`` names: when it
        names ``modeling_linattn`` (an export, or a model loaded from one, with or without
        ``import linattn.hf``), that file is written too, so the saved folder loads with
        ``trust_remote_code=True``. A module of another name that the folder then lacks is a
        ValueError naming it."""
        super().save_pretrained(save_directory, *args, **kwargs)
        modules = auto_map_modules(getattr(self.config, "auto_map", None))
        if REMOTE_CODE_FILE.removesuffix(".py") in modules:
            write_remote_code(save_directory)
        missing = sorted(name for name in modules if not (Path(save_directory) / f"{name}.py").is_file())
        if missing:
            raise ValueError(f"config.auto_map names the modules {missing}, which {save_directory} lacks: "
                             "trust_remote_code=True could not load it; remove config.auto_map or add the files")

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Initialise ``module``'s own tensors (parameters and buffers, not its submodules') as a
        freshly built ``LM`` has them; HF calls it for every module not yet initialised (on
        construction, in ``init_weights()``, and in ``from_pretrained`` for whatever a checkpoint
        lacks). Its ``reset_parameters()`` (every linattn module's, torch's for ``nn.Linear``,
        ``nn.Embedding`` and the norms) writes them, then linear and embedding weights get the
        ``LM``'s normal draw (``LM.weight_std``); only non-persistent buffers missing (a loaded
        checkpoint) are recomputed by ``_reset_buffers()``, drawing nothing. Tensors a checkpoint
        loaded (HF marks them ``_is_hf_initialized``) are kept. A module with tensors of its own
        and no ``reset_parameters`` is a TypeError naming its class."""
        own = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
        pending = {name for name, tensor in own.items() if not getattr(tensor, "_is_hf_initialized", False)}
        if not pending:
            return
        if pending <= module._non_persistent_buffers_set and hasattr(module, "_reset_buffers"):
            module._reset_buffers()
            return
        if not hasattr(module, "reset_parameters"):
            raise TypeError(f"{type(module).__qualname__} holds tensors ({', '.join(sorted(own))}) but has no "
                            "reset_parameters() to initialise them with")
        loaded = {name: tensor.clone() for name, tensor in own.items() if name not in pending}
        module.reset_parameters()
        for name, tensor in loaded.items():
            getattr(module, name).copy_(tensor)
        if isinstance(module, (nn.Linear, nn.Embedding)) and "weight" in pending:
            nn.init.normal_(module.weight, mean=0.0, std=self.lm.weight_std(module))

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> "LinattnPreTrainedModel":
        """``nn.Module.to_empty``: every tensor becomes uninitialised memory on ``device``; so every
        module is marked not initialised, and ``init_weights()`` initialises them all (HF marks the
        modules of a model built under accelerate's ``init_empty_weights`` as initialised, though
        their weights were on the meta device)."""
        super().to_empty(device=device, recurse=recurse)
        for submodule in self.modules():
            submodule.__dict__.pop("_is_hf_initialized", None)
        return self


class LinattnModel(LinattnPreTrainedModel):
    """The decoder without its output head: ``forward`` returns ``BaseModelOutputWithPast``
    (``last_hidden_state [B, T, d_model]`` after the final norm, ``cache``, ``hidden_states``).

    ``attention_mask [B, past + T]`` (1 = token, 0 = padding) may only pad on the left (each
    row zeros then ones): padded positions enter no state and no position count, so a
    left-padded row computes exactly what it computes alone. Rows of different real
    lengths run as separate groups (one model call per distinct length per step); their
    hidden states at padded positions are zero.

    Args:
        config: the model's settings (``LinattnConfig``).
    """

    def __init__(self, config: LinattnConfig):
        super().__init__(config)
        self.lm = LM(config.to_lm_config())
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: LinattnCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: LinattnCache | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast | tuple:
        result = self._forward(input_ids, attention_mask, cache if cache is not None else past_key_values,
                               inputs_embeds, use_cache, output_hidden_states, output_attentions, kwargs)
        h, new_cache, hidden, _, _ = result
        output = BaseModelOutputWithPast(last_hidden_state=h, cache=new_cache, hidden_states=hidden)
        return output if self._return_dict(return_dict) else output.to_tuple()

    def _return_dict(self, return_dict: bool | None) -> bool:
        return self.config.return_dict if return_dict is None else return_dict

    def _forward(self, input_ids, attention_mask, cache, inputs_embeds, use_cache, output_hidden_states,
                 output_attentions, kwargs, logits_only: bool = False
                 ) -> tuple[torch.Tensor | None, LinattnCache | None, tuple | None, torch.Tensor, torch.Tensor | None]:
        """-> ``(normed hidden [B, T, d_model], cache or None, hidden states or None, commit loss, None)``;
        with ``logits_only`` (the caller needs the logits only), ``(None, cache, None, 0, logits)``
        where a native token loop steps the token (``_native_steps.py``)."""
        if output_attentions:
            raise ValueError("output_attentions=True is not supported: linattn's mechanisms (VQ, kernel, delta, "
                             "local attention) do not form a [T, T] attention matrix")
        _check_unused(kwargs)
        batch, length, device = self._check_inputs(input_ids, inputs_embeds)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is not None and not isinstance(cache, LinattnCache):
            if not isinstance(cache, Cache) or cache.get_seq_length() != 0:
                raise TypeError(f"cache must be a LinattnCache (from this model), got {type(cache).__name__}")
            cache = None  # an empty cache of another type (a DynamicCache made by generic code)
        if cache is not None and cache.batch_size != batch:
            raise ValueError(f"cache holds {cache.batch_size} rows but input has batch {batch}")
        for group in cache.groups if cache is not None else ():  # states of this model, one per row group
            group.check_current()
            if group.live_loop() is None:  # a loop's state is this model's by construction
                self.lm._check_state(group.state, group.rows.numel(), name="cache state")
        seen = cache.seen if cache is not None else 0
        real = _real_tokens(attention_mask, batch, seen, length, device)
        keep_hidden = bool(self.config.output_hidden_states if output_hidden_states is None
                           else output_hidden_states)
        whole = cache.whole_group() if cache is not None else None
        if logits_only and use_cache and length == 1 and real is None and input_ids is not None and not keep_hidden \
                and whole is not None:
            stepped = _native_steps.step(self.lm, whole, input_ids)
            if stepped is not None:
                logits, group = stepped
                zero = torch.zeros((), dtype=torch.float32, device=device)
                return None, LinattnCache(batch, [group], seen + 1), None, zero, logits
        x = self.lm.embed(input_ids.long()) if input_ids is not None else inputs_embeds
        groups = _plan_groups(cache, real, length, batch)
        hidden = [] if keep_hidden else None
        if len(groups) == 1 and groups[0][0] is None:  # every row, no padding: one call
            state = cache.groups[0].state if cache is not None and cache.groups else None
            h, new_state, unit_aux, _ = self.lm._trunk(x, state, hidden)
            commit = self.lm._commit_loss(h, unit_aux)
            native_start = cache.groups[0].native_start if cache is not None and cache.groups else True
            new_groups = [RowGroup(rows=torch.arange(batch), state=new_state, native_start=native_start)]
            if hidden is not None:
                hidden[-1] = h  # the last entry is the normed output, as for HF decoders
        else:
            h, new_groups, commit, hidden = self._grouped(x, groups, hidden)
        new_cache = LinattnCache(batch, new_groups, seen + length) if use_cache else None
        return h, new_cache, tuple(hidden) if hidden is not None else None, commit, None

    def _check_inputs(self, input_ids, inputs_embeds) -> tuple[int, int, torch.device]:
        """Exactly one of ``input_ids`` (ids in range) and ``inputs_embeds``: ``(batch, length, device)``."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [batch, length] and inputs_embeds [batch, length, d_model]")
        if input_ids is not None:
            check_token_ids("input_ids", input_ids, self.config.vocab_size, values=False)  # named as HF names it
            self.lm._check_ids(input_ids)
            return input_ids.shape[0], input_ids.shape[1], input_ids.device
        d_model = self.config.d_model
        if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 \
                or inputs_embeds.shape[-1] != d_model or inputs_embeds.shape[1] == 0:
            raise ValueError(f"inputs_embeds must have shape [batch, length >= 1, {d_model}], got "
                             f"{list(getattr(inputs_embeds, 'shape', []))}")
        return inputs_embeds.shape[0], inputs_embeds.shape[1], inputs_embeds.device

    def _grouped(self, x, groups, hidden):
        """Run each ``(rows, pad, state)`` group on its unpadded columns; scatter the outputs."""
        batch, length, d_model = x.shape
        h = x.new_zeros(batch, length, d_model)
        layers_out = [x.new_zeros(batch, length, d_model) for _ in range(len(self.lm.layers) + 1)] \
            if hidden is not None else None
        new_groups, commit, tokens = [], x.new_zeros((), dtype=torch.float32), 0
        for rows, pad, state in groups:
            rows_device = rows.to(x.device)
            group_hidden = [] if hidden is not None else None
            h_group, new_state, unit_aux, _ = self.lm._trunk(x[rows_device, pad:], state, group_hidden)
            h[rows_device, pad:] = h_group
            if layers_out is not None:
                for out, value in zip(layers_out, group_hidden):
                    out[rows_device, pad:] = value
            n = rows.numel() * (length - pad)
            commit = commit + self.lm._commit_loss(h_group, unit_aux) * n
            tokens += n
            new_groups.append(RowGroup(rows=rows, state=new_state))
        commit = commit / max(tokens, 1)
        if layers_out is not None:
            layers_out[-1] = h  # the last entry is the normed output, as for HF decoders
        return h, new_groups, commit, layers_out


def _attn_implementation(requested: str | None) -> str:
    """The recorded attention implementation for a requested one: always ``"eager"`` (the
    model's own code); None, ``"eager"`` and ``"sdpa"`` are accepted, anything else refused
    (a paged one, which transformers' continuous batching asks for, pointing to vLLM)."""
    if isinstance(requested, str) and requested.startswith("paged"):
        raise ValueError(f"attn_implementation={requested!r}: transformers' continuous batching (generate_batch, "
                         "transformers serve) keeps every layer's keys and values in its paged cache, but linattn "
                         "layers carry their own recurrent states (constant size for all but exact softmax); serve "
                         "linattn models with continuous batching through vLLM instead: `linattn serve DIR` "
                         "(docs/guide/serving.md), or generate with model.generate")
    if requested is not None and requested not in _ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation={requested!r} is not supported by linattn models: their layers always "
                         f"run linattn's own attention code; pass 'eager' or 'sdpa' (both run that code) or leave it "
                         f"unset")
    return "eager"


# Keyword arguments HF code passes to forward that change nothing here: generate() passes on its
# own ``tokenizer`` (stop_strings) and ``assistant_tokenizer`` arguments, the Trainer passes
# ``num_items_in_batch`` (read by LinattnForCausalLM), tokenizers may return ``token_type_ids``.
_PASSED_ON = ("num_items_in_batch", "token_type_ids", "tokenizer", "assistant_tokenizer")


def _check_unused(kwargs: dict) -> None:
    """Accept the keyword arguments HF code passes that change nothing here; reject the rest."""
    position_ids = kwargs.pop("position_ids", None)
    for name in _PASSED_ON:
        kwargs.pop(name, None)
    if position_ids is not None:
        raise ValueError("position_ids are not supported: positions follow the attention_mask (padding is "
                         "skipped) and the cache")
    if kwargs:
        raise TypeError(f"unexpected arguments {sorted(kwargs)}")


def _real_tokens(attention_mask, batch: int, seen: int, length: int, device) -> torch.Tensor | None:
    """Real (unpadded) tokens per row among the new ``length`` columns -> ``[B]`` int64, or
    None when every new column is real. Checks the mask is ``[B, seen + length]`` or
    ``[B, length]``, holds only 0/1, and pads only on the left."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 \
            or attention_mask.shape[0] != batch or attention_mask.shape[1] not in (length, seen + length):
        raise ValueError(f"attention_mask must have shape [batch, past + length] = [{batch}, {seen + length}] "
                         f"(or [{batch}, {length}]), got {list(getattr(attention_mask, 'shape', []))}")
    mask = attention_mask.long()
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise ValueError("attention_mask must pad on the left only (each row zeros, then ones): linattn's "
                         "recurrent states cannot skip padding after real tokens")
    new = mask[:, -length:]
    if bool(new.all()):
        return None
    return new.sum(1).cpu()


def _plan_groups(cache: LinattnCache | None, real: torch.Tensor | None, length: int, batch: int) -> list:
    """The ``(rows or None, leading pad, state)`` runs of one forward: rows that carry a state
    continue it; stateless rows start a group per real length (all-padding rows run nowhere).
    They run in this order, continued groups first, then new rows longest first (in training
    the first group's keys initialise a pending k-means codebook)."""
    if cache is None or not cache.groups:
        if real is None:
            return [(None, 0, None)]
        plans = []
        for count in sorted(set(real.tolist()), reverse=True):
            if count:
                plans.append((torch.nonzero(real == count).flatten(), length - count, None))
        return plans
    covered = torch.zeros(batch, dtype=torch.bool)
    plans = []
    for group in cache.groups:
        rows = group.rows.cpu()
        covered[rows] = True
        if real is not None and bool((real[rows] != length).any()):
            raise ValueError("attention_mask pads a row that already holds tokens")
        plans.append((rows, 0, group.state))
    if cache.whole_group() is not None:
        return [(None, 0, plans[0][2])]
    fresh = (~covered).nonzero().flatten()
    if fresh.numel():
        counts = real[fresh] if real is not None else torch.full((fresh.numel(),), length)
        for count in sorted(set(counts.tolist()), reverse=True):
            if count:
                plans.append((fresh[counts == count], length - count, None))
    return plans


class LinattnForCausalLM(LinattnPreTrainedModel, GenerationMixin):
    """A linattn language model as a Hugging Face causal LM: ``forward`` returns
    ``CausalLMOutputWithPast``; with ``labels [B, T]`` (-100 = ignored) the loss is
    ``cross_entropy(logits[:, :-1], labels[:, 1:])`` (mean over counted tokens) plus the VQ
    commitment loss of the forward -- the number linattn's trainer computes on that batch.
    ``shift_labels [B, T]`` (targets already aligned with the logits, transformers 5's contract
    for sequence- and context-parallel training) replace ``labels``: ``cross_entropy(logits,
    shift_labels)`` (``causal_lm_loss``). With ``num_items_in_batch`` (the HF ``Trainer`` under
    gradient accumulation: the counted targets of the whole optimizer step) the loss is this
    micro-batch's share of the step's:
    the summed cross-entropy over ``num_items_in_batch``, plus the commitment loss times this
    micro-batch's counted targets over ``num_items_in_batch``. The micro-batches' losses then
    add up to the step's: exactly the full batch's when the micro-batches hold counted
    targets in proportion to their tokens (equal shapes, no -100 labels), else the commitment
    term is their target-weighted mean.

    ``generate`` carries a ``LinattnCache`` (constant memory for every recurrent
    mechanism); greedy, sampling, beam search, left-padded batches and ``use_cache=False``
    work. In training mode VQ layers gather codebook statistics: call
    ``update_codebooks()`` after each optimizer step (``CodebookUpdateCallback`` does it for
    the HF ``Trainer``).

    Args:
        config: the model's settings (``LinattnConfig``).
    """

    def __init__(self, config: LinattnConfig):
        super().__init__(config)
        self.model = LinattnModel(config)
        self.post_init()

    @property
    def lm(self) -> LM:
        """The wrapped ``linattn.models.LM``."""
        return self.model.lm

    @classmethod
    def from_lm(cls, lm: LM, **config_kwargs: Any) -> "LinattnForCausalLM":
        """A causal LM holding a copy of ``lm``'s weights and buffers (same dtype)."""
        config = LinattnConfig.from_lm_config(lm.config, **config_kwargs)
        model = cls(config)
        model.lm.load_state_dict(lm.state_dict())
        parameter = next(lm.parameters())
        return model.to(device=parameter.device, dtype=parameter.dtype)

    def update_codebooks(self) -> None:
        """The EMA codebook update of every VQ layer (once per optimizer step in training)."""
        self.lm.update_codebooks()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """False: ``generate`` must not build a KV cache; ``forward`` returns a ``LinattnCache``."""
        return False

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: LinattnCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: LinattnCache | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        num_items = kwargs.get("num_items_in_batch")
        shift_labels = kwargs.pop("shift_labels", None)
        h, new_cache, hidden, commit, logits = self.model._forward(
            input_ids, attention_mask, cache if cache is not None else past_key_values, inputs_embeds,
            use_cache, output_hidden_states, output_attentions, kwargs,
            logits_only=labels is None and shift_labels is None)
        if logits is None:
            keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
            logits = self.lm.logits(h[:, keep])
        loss = None
        if labels is not None or shift_labels is not None:
            commit = commit.to(logits.dtype)
            if num_items is not None:
                _, targets = _aligned_targets(logits, labels, shift_labels)
                commit = commit * _share_of_targets(targets, num_items, logits)
            loss = causal_lm_loss(logits, labels, num_items, shift_labels=shift_labels) + commit
        output = CausalLMOutputWithPast(loss=loss, logits=logits, cache=new_cache, hidden_states=hidden)
        return output if self.model._return_dict(return_dict) else output.to_tuple()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | None, num_items_in_batch: Any = None, *,
                   shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy of ``logits`` against ``labels`` shifted by one: the mean over
    counted targets, or their sum divided by ``num_items_in_batch``.

    Args:
        logits: ``[B, T, V]``.
        labels: ``[B, T]`` token ids; ``labels[:, t + 1]`` is the target of position ``t``,
            and -100 is ignored. Not read when ``shift_labels`` is given.
        num_items_in_batch: the counted targets of the whole optimizer step (the HF
            ``Trainer`` under gradient accumulation); None: this batch's.
        shift_labels: ``[B, T]``, transformers 5's loss contract: targets already aligned with
            the logits (``shift_labels[:, t]`` is the target of position ``t``: what sequence-
            and context-parallel training pass, shifted before the sequence was split); given,
            they replace ``labels``. ``shift_labels`` equal to ``labels[:, 1:]`` followed by
            -100 give the loss of ``labels`` (to rounding).
    """
    predictions, targets = _aligned_targets(logits, labels, shift_labels)
    predictions = predictions.float() if predictions.dtype != torch.float64 else predictions
    targets = targets.to(logits.device).long()
    if num_items_in_batch is None:
        return F.cross_entropy(predictions.flatten(0, 1), targets.flatten(), ignore_index=-100)
    total = F.cross_entropy(predictions.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return total / torch.as_tensor(num_items_in_batch, device=total.device).to(total.dtype)


def _aligned_targets(logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(predictions, targets)``: ``logits[:, :-1]`` and ``labels[:, 1:]``, or all of ``logits``
    and ``shift_labels`` when given; each checked to be ``[batch, length]`` token ids (-100 allowed)."""
    name, given = ("shift_labels", shift_labels) if shift_labels is not None else ("labels", labels)
    if not isinstance(given, torch.Tensor) or given.shape != logits.shape[:2]:
        raise ValueError(f"{name} must have shape [batch, length] = {list(logits.shape[:2])} (logits_to_keep=0), "
                         f"got {list(getattr(given, 'shape', []))}")
    check_token_ids(name, given, logits.shape[-1], values=False)  # .long() would truncate float labels
    return (logits, shift_labels) if shift_labels is not None else (logits[:, :-1], labels[:, 1:])


def _share_of_targets(targets: torch.Tensor, num_items_in_batch: Any, like: torch.Tensor) -> torch.Tensor:
    """This micro-batch's counted targets (``targets != -100``, the aligned targets: what the HF
    ``Trainer`` counts for a causal LM) over ``num_items_in_batch``, the step's: the weight of its
    commitment loss, so the micro-batches of one optimizer step add up to the step's loss."""
    counted = (targets != -100).sum().to(device=like.device, dtype=like.dtype)
    return counted / torch.as_tensor(num_items_in_batch, device=like.device).to(like.dtype)


def lm_state_of(cache: LinattnCache) -> LMState:
    """The ``LMState`` of a cache whose rows share one group (no padding): hand it to
    ``LM.forward``/``LM.generate`` to continue with linattn's own API.

    Args:
        cache: the ``LinattnCache`` that ``generate`` or ``forward`` returned; a cache of
            left-padded rows of different lengths is refused (take its groups' states).
    """
    if len(cache.groups) != 1 or cache.groups[0].rows.numel() != cache.batch_size:
        raise ValueError("the cache holds rows of different lengths (left padding); take group states from "
                         "cache.groups")
    group = cache.groups[0]
    order = torch.argsort(group.rows)  # state rows in batch order (rows sorted: the identity)
    in_order = bool((order == torch.arange(order.numel(), device=order.device)).all())
    return group.state if in_order else group.state.select_batch(order)
