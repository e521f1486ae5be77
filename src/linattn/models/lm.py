"""``LM``: a decoder-only byte-level language model over any mix of attention mechanisms."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._checks import (check_batch, check_int, check_sampling, check_state_batch, check_token_ids, compute_dtype,
                       token_id_tensor)
from ..nn.quantizer import VectorQuantizer
from ..ops.softmax import kv_cache
from ..state import LMState
from .config import LMConfig
from .pretrained import hf_lm_config, read_config_file
from .pretrained_weights import FLOAT_DTYPES, lm_state_dict, read_hf_tensors
from ._block_generation import BlockGeneration
from ._vq_generation import VQGeneration
from .layers import layer_kind
from .sampling import NO_TOKEN, NonFiniteLogits, sample_next


class LM(nn.Module):
    """Decoder-only language model: token embedding, ``n_layers`` layers (each a GAU pair or
    a pre-norm attention + SwiGLU block, per ``config.attention``), final RMSNorm, output
    head (tied to the embedding by default).

    ``forward(ids [B, T] int64, state=None) -> (logits [B, T, vocab], LMState, aux)``
    (logits in float32, or float64 for a float64 model)
    where ``aux`` holds ``commit_loss`` (sum of the VQ commitment losses, already weighted;
    add it to the training loss) and ``codebook_perplexity`` (mean over VQ units of
    exp(entropy) of this batch's code histogram; None without VQ layers). Passing the
    returned state back continues the sequence: token-by-token decoding equals the full pass.

    ``activation_checkpointing`` (attribute, default False): when gradients are enabled, each
    layer keeps only its inputs and recomputes its forward during backward
    (``torch.utils.checkpoint``, non-reentrant): the same values and gradients, with the
    activations of one layer at a time instead of all. A recomputed quantizer forward adds
    no codebook statistics (``nn/quantizer.py``).

    Args:
        config: the model's settings (checked when it was built; the layers are built from
            ``config.layer_specs()``).
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.specs = config.layer_specs()
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(layer_kind(spec).build(config, spec, i) for i, spec in enumerate(self.specs))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.activation_checkpointing = False
        self.state_settings = _state_settings(config)
        self._init_weights()

    @classmethod
    def from_hf(cls, path: str | Path, *, dtype: torch.dtype | None = None) -> "LM":
        """The model of a Hugging Face ``LlamaForCausalLM``, ``MistralForCausalLM`` or
        ``Qwen2ForCausalLM`` folder (``config.json`` and ``model.safetensors`` or a sharded
        ``model.safetensors.index.json``), computing what transformers computes from it, in
        eval mode. Weights are read as ``dtype`` (default float32, whatever the checkpoint
        stores). transformers is not needed. What is imported and what is refused (by name, as
        a ValueError): ``models/pretrained.py``; the rotary layout: ``models/pretrained_weights.py``.
        The folder's ``tokenizer.json`` is not read here (``linattn convert --to softmax``
        keeps it with the model in a run folder)."""
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"from_hf: {folder} is not a folder (expected a Hugging Face model folder)")
        if dtype is None:
            dtype = torch.float32
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"from_hf: dtype must be one of {[str(d) for d in FLOAT_DTYPES]} or None, got {dtype!r}")
        config = hf_lm_config(read_config_file(folder), source=str(folder / "config.json"))
        with torch.device("meta"):
            model = cls(config)
        expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
        state = lm_state_dict(read_hf_tensors(folder, dtype), config, expected)
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()

    def _init_weights(self) -> None:
        """Normal init of every linear and embedding weight with ``weight_std``'s deviation."""
        outputs = self._output_projections()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.weight_std(module, outputs))

    def weight_std(self, module: nn.Module, outputs: set[int] | None = None) -> float:
        """The standard deviation a linear or embedding weight is drawn with: ``init_std``, or
        ``init_std / sqrt(2 n_layers)`` (GPT-2's residual scaling) for the output projections of
        each layer (as its ``LayerKind`` names them). ``outputs``: ``_output_projections()``, when
        the caller has it."""
        outputs = self._output_projections() if outputs is None else outputs
        if id(module) in outputs:
            return self.config.init_std / math.sqrt(2 * self.config.n_layers)
        return self.config.init_std

    def _output_projections(self) -> set[int]:
        """The ids of the modules each layer's ``LayerKind`` names as its output projections."""
        return {id(self.get_submodule(f"layers.{i}.{name}")) for i, spec in enumerate(self.specs)
                for name in layer_kind(spec).output_projections}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _check_ids(self, ids: torch.Tensor, values: bool = True) -> None:
        """Type and shape of ``ids``, and with ``values`` their range ``[0, vocab_size)``.

        The range is read from the values (a host sync on a GPU). Under ``torch.compile``
        it is not read: a data-dependent check would split the graph; ids out of range
        then fail in the embedding's indexing ("index out of bounds").
        """
        check_token_ids("ids", ids, self.config.vocab_size, values=False)
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must have shape [batch, length] with length >= 1, got {list(ids.shape)}")
        check_batch("ids", ids)
        if values and not torch.compiler.is_compiling():
            check_token_ids("ids", ids, self.config.vocab_size)

    def forward(self, ids: torch.Tensor, state: LMState | None = None, *, check_inputs: bool = True
                ) -> tuple[torch.Tensor, LMState, dict]:
        """``check_inputs=False`` skips reading the ids to check their range (see ``_check_ids``),
        for callers that checked their tokens where they were loaded (the trainer and
        ``evaluate_bpb``): then nothing in the forward pass waits for the device."""
        self._check_ids(ids, values=check_inputs)
        if state is not None:
            self._check_state(state, ids.shape[0])
        return self._run(ids, state)

    def _check_state(self, state: object, batch: int, name: str = "state") -> None:
        """``state`` continues this model for ``batch`` rows: an ``LMState`` with one entry per
        layer, made by a model of the same ``state_settings`` (when it records them: the
        differing settings are named), holding ``batch`` rows. Else ValueError (TypeError for
        another kind of object). Reads sizes only, never a tensor's values; the layers check
        their own states (kinds, settings, shapes) as they run."""
        if not isinstance(state, LMState) or len(state.layers) != len(self.layers):
            raise ValueError(f"{name} must be the LMState this model returned ({len(self.layers)} layers), "
                             f"got {type(state).__name__}"
                             + (f" of {len(state.layers)} layers" if isinstance(state, LMState) else ""))
        made_by = state.model
        if made_by is not None and made_by is not self.state_settings and made_by != self.state_settings:
            if not isinstance(made_by, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in made_by):
                raise TypeError(f"{name}.model must be a tuple of (name, value) pairs, got {made_by!r}")
            theirs, ours = dict(made_by), dict(self.state_settings)
            differ = [key for key in ours if key in theirs and theirs[key] != ours[key]]
            if differ:
                shown = lambda values: ", ".join(f"{key}={_shown(values[key])!r}" for key in differ)  # noqa: E731
                raise ValueError(f"{name} was made by a model with {shown(theirs)}, but this model has {shown(ours)}; "
                                 "an LMState continues only a model with the settings that made it")
        check_state_batch(name, state.batch_size(), batch)

    def _run(self, ids: torch.Tensor, state: LMState | None, with_aux: bool = True
             ) -> tuple[torch.Tensor, LMState, dict]:
        """``forward`` without the argument checks (for ids and states the model made itself);
        ``with_aux=False`` skips the batch statistics of ``aux`` (returns it empty)."""
        h, new_state, unit_aux, x = self._trunk(self.embed(ids.long()), state)
        aux = self._aux(x, unit_aux) if with_aux else {}
        return self.logits(h), new_state, aux

    def _trunk(self, x: torch.Tensor, state: LMState | None, hidden: list | None = None
               ) -> tuple[torch.Tensor, LMState, list[dict], torch.Tensor]:
        """Layers and final norm on embedded tokens ``x [B, T, d_model]`` -> ``(normed
        [B, T, d_model], state, per-unit aux, last residual stream)``; ``hidden``, when a
        list, receives ``x`` and each layer's output (before the final norm)."""
        if hidden is not None:
            hidden.append(x)
        layer_states = state.layers if state is not None else (None,) * len(self.layers)
        new_states, unit_aux = [], []
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for layer, layer_state in zip(self.layers, layer_states):
            if recompute:
                x, layer_state, aux = checkpoint(layer, x, layer_state, use_reentrant=False)
            else:
                x, layer_state, aux = layer(x, layer_state)
            new_states.append(layer_state)
            unit_aux.extend(aux)
            if hidden is not None:
                hidden.append(x)
        steps = x.shape[1] + (state.steps if state is not None else 0)
        return self.norm(x), LMState(layers=tuple(new_states), steps=steps, model=self.state_settings), unit_aux, x

    def _embedding_matrix(self) -> torch.Tensor:
        """The matrix the embedding looks tokens up in, ``[vocab, d_model]``: its ``weight``,
        or, when the embedding is not a plain ``nn.Embedding`` (a PEFT LoRA layer wraps it),
        the rows it returns for every id, so a tied head sees what the embedding computes.
        (A forward hook on a plain embedding changes its lookups, not the head.)"""
        if type(self.embed) is nn.Embedding:
            return self.embed.weight
        return self.embed(torch.arange(self.config.vocab_size, device=self.embed.weight.device))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Output head on normed hidden states ``[..., d_model] -> [..., vocab]`` (the tied
        embedding by default); half-precision logits are returned in float32."""
        logits = h @ self._embedding_matrix().T if self.head is None else self.head(h)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return logits

    def _commit_loss(self, x: torch.Tensor, unit_aux: list[dict]) -> torch.Tensor:
        """The sum of the units' (already weighted) commitment losses, in float32 (float64 for
        a float64 model: ``x``, the residual stream, in float64)."""
        dtype = compute_dtype(x.dtype)
        commit = x.new_zeros((), dtype=dtype)
        for aux in unit_aux:
            if "commit_loss" in aux:
                commit = commit + aux["commit_loss"].to(dtype)
        return commit

    def _aux(self, x: torch.Tensor, unit_aux: list[dict]) -> dict:
        commit = self._commit_loss(x, unit_aux)
        perplexities = []
        for aux in unit_aux:
            if aux.get("codes") is not None:
                # a histogram of a fixed size (bincount's would depend on the codes): every code of
                # a VQ unit is below codebook_size, of an FSQ unit below the size of its grid
                codes = aux["codes"].flatten()
                size = max(self.config.codebook_size, math.prod(self.config.fsq_levels))
                ones = torch.ones_like(codes, dtype=torch.float32)
                counts = x.new_zeros(size, dtype=torch.float32).index_add_(0, codes, ones)
                probs = counts / counts.sum()
                perplexities.append(torch.exp(-(probs * probs.clamp_min(1e-30).log()).sum()))
        perplexity = torch.stack(perplexities).mean() if perplexities else None
        return {"commit_loss": commit, "codebook_perplexity": perplexity}

    # -- training helpers ------------------------------------------------------------------

    def quantizers(self) -> list[VectorQuantizer]:
        """Every VQ unit's quantizer, in layer order."""
        return [module for module in self.modules() if isinstance(module, VectorQuantizer)]

    @torch.no_grad()
    def update_codebooks(self, apply: torch.Tensor | None = None) -> None:
        """The EMA codebook update of every VQ unit; call once per optimizer step. ``apply``, a
        bool tensor, False drops the step's statistics instead (read on the device, no sync).
        Without ``apply``, statistics that are not finite are dropped and named: every unit
        is updated or dropped, then one ValueError names each unit that was dropped
        (``Codebook.update``)."""
        refused = []
        for name, module in self.named_modules():
            if isinstance(module, VectorQuantizer):
                try:
                    module.update(apply=apply)
                except ValueError as error:
                    refused.append(f"{name}: {error}")
        if refused:
            raise ValueError("\n".join(refused))

    def codebook_usage(self) -> dict[str, float] | None:
        """Mean EMA code perplexity and total dead codes over the VQ units (None without any)."""
        quantizers = self.quantizers()
        if not quantizers:
            return None
        usages = [q.usage() for q in quantizers]
        return {
            "perplexity": float(torch.stack([u["perplexity"].float().mean() for u in usages]).mean()),
            "dead_codes": int(sum(int(u["dead_codes"].sum()) for u in usages)),
        }

    def carry(self, state: LMState) -> LMState:
        """The state to pass to the next training/eval window: detached (Transformer-XL),
        then each layer's ``LayerKind.carry`` (exact-softmax caches of ``softmax`` and
        ``gau-softmax`` layers are cut to the last ``config.softmax_memory`` keys so memory
        and time per window stay bounded)."""
        layers = tuple(layer_kind(spec).carry(layer_state, self.config)
                       for spec, layer_state in zip(self.specs, state.detach().layers))
        return dataclasses.replace(state, layers=layers)

    @property
    def has_growing_cache(self) -> bool:
        """Whether some layer's decode state grows with the context (exact softmax)."""
        return any(layer_kind(spec).growing_cache for spec in self.specs)

    # -- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: torch.Tensor | list[int],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        state: LMState | None = None,
    ) -> Iterator:
        """Stream ``max_new_tokens`` sampled tokens after the prompt.

        ``prompt_ids``: ``[T]`` (yields ints) or ``[B, T]`` (yields ``[B]`` tensors), an
        integer tensor or a list of ints (a float or bool is a TypeError, never rounded to
        an id). The prompt is read in one pass, then one token per step with the carried
        state, so the memory per step is constant for every recurrent mechanism (VQ, linear,
        FAVOR, delta, local) and grows only for exact softmax's KV cache, which is allocated
        once after the prompt for all the tokens to come (``ops/softmax/kv_cache.py``). A model
        of VQ GAU pairs, or of pre-norm blocks with recurrent mixers, steps each token on a CPU in one
        native call (``models/_vq_generation.py``, ``models/_block_generation.py``; equal to the
        step through ``forward``). ``temperature=0`` is
        greedy; ``top_k``/``top_p`` filter before sampling; ``seed`` makes it reproducible.
        The model is in eval mode while generating (no codebook statistics). Logits that are
        not finite (a forward pass that overflowed) give no token: a ``[T]`` prompt raises
        ``NonFiniteLogits`` (a ValueError) there; a ``[B, T]`` prompt, which reads nothing on
        the host, yields ``-1`` in that row instead of a token (``sampling.NO_TOKEN``).

        Every argument is checked here, when ``generate`` is called, before the prompt is run
        and before the first token is asked for (the returned iterator does the work).
        """
        ids = token_id_tensor("prompt_ids", prompt_ids)
        if ids.dim() == 2:
            check_batch("prompt_ids", ids)
        if ids.dim() not in (1, 2) or ids.numel() == 0:
            raise ValueError(f"prompt_ids must have shape [length] or [batch, length] with at least one token, "
                             f"got {list(ids.shape)}")
        check_int("max_new_tokens", max_new_tokens, minimum=0)
        check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
        check_int("seed", seed, minimum=0, optional=True)
        single = ids.dim() == 1
        ids = (ids.unsqueeze(0) if single else ids).to(self.embed.weight.device)
        check_token_ids("prompt_ids", ids, self.config.vocab_size)
        if state is not None:
            self._check_state(state, ids.shape[0])
        generator = torch.Generator(device=ids.device)
        generator.manual_seed(torch.seed() if seed is None else seed)
        return self._generate(ids, single, max_new_tokens, dict(temperature=temperature, top_k=top_k, top_p=top_p),
                              generator, state)

    @torch.no_grad()
    def _generate(self, ids: torch.Tensor, single: bool, max_new_tokens: int, sampling: dict,
                  generator: torch.Generator, state: LMState | None) -> Iterator:
        """``generate``'s loop on checked arguments (``ids [B, T]`` on the model's device)."""
        was_training = self.training
        self.eval()
        try:
            logits, state, _ = self(ids, state, check_inputs=False)  # the ids' range was read in generate
            state = kv_cache.reserve(state, max_new_tokens - 1)  # exact softmax caches: room for every fed token
            batch, native = ids.shape[0], None
            if max_new_tokens > 1:
                native = VQGeneration.start(self, state, batch) or BlockGeneration.start(self, state, batch)
            greedy = sampling["temperature"] == 0
            token = sample_next(logits[:, -1], generator=generator, **sampling)
            for produced in range(1, max_new_tokens + 1):
                if not single:
                    yield token
                elif int(token[0]) == NO_TOKEN:
                    raise NonFiniteLogits(f"the logits of generated token {produced} are not finite (NaN or inf): "
                                          f"the model's forward pass overflowed")
                else:
                    yield int(token[0])
                if produced == max_new_tokens:  # the last token's logits would go unused
                    break
                if native is not None and not native.current():  # a parameter changed: the general step
                    state, native = native.state(), None
                fed = token.clamp_min(0)
                if native is None:
                    logits, state, _ = self._run(fed.unsqueeze(1), state, with_aux=False)
                    token = sample_next(logits[:, -1], generator=generator, **sampling)
                elif greedy:
                    token = native.step_greedy(fed)
                else:
                    token = sample_next(native.step(fed)[:, -1], generator=generator, **sampling)
        finally:
            self.train(was_training)


def _state_settings(config: LMConfig) -> tuple[tuple[str, object], ...]:
    """The ``(name, value)`` pairs of ``config`` that decide what its layers' states hold, as
    ``LMState.model`` records them: the layer specs, widths, heads and head sizes (defaults
    resolved), windows, feature maps, the short convolution, rotary base, the GAU sizes,
    codebook, grid and variant. Settings that change only how a state is computed or carried
    (``chunk_size``, ``softmax_memory``) or training (``commitment_weight``, ...) are not in it:
    a state made under other values of those is the same state."""
    return (
        ("attention", tuple(str(spec) for spec in config.layer_specs())),
        ("d_model", config.d_model),
        ("n_heads", config.n_heads),
        ("n_kv_heads", config.n_kv_heads or config.n_heads),
        ("head_dim", config.head_dim or (config.d_model // config.n_heads if config.n_heads else None)),
        ("local_window", config.local_window),
        ("favor_features", config.favor_features),
        ("feature_seed", config.feature_seed),
        ("rotary_base", config.rotary_base),
        ("rotary_scaling", None if config.rotary_scaling is None else tuple(sorted(config.rotary_scaling.items()))),
        ("delta_short_conv", config.delta_short_conv),
        ("gau_d_k", config.gau_d_k),
        ("gau_d_v", config.gau_d_v or 2 * config.d_model),
        ("codebook_size", config.codebook_size),
        ("block_size", config.block_size),
        ("fsq_levels", tuple(config.fsq_levels)),
        ("soft_vq_temperature", config.soft_vq_temperature),
        ("gau_variant", config.gau_variant),
    )


def _shown(value: object) -> object:
    """A setting as a mismatch message shows it (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value
