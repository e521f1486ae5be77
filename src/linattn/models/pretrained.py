"""The ``LMConfig`` of a Hugging Face Llama, Mistral or Qwen2 checkpoint (its ``config.json``).

``LM.from_hf`` reads a model folder as ``transformers`` 5.24 builds ``LlamaForCausalLM``,
``MistralForCausalLM`` and ``Qwen2ForCausalLM`` from it, without importing transformers:
this module maps ``config.json`` onto an ``LMConfig``, ``pretrained_weights.py`` maps the
tensors. Every layer is a pre-norm attention + SwiGLU block (``softmax``, or ``local:W`` for
Mistral's ``sliding_window`` W: a query sees its own and the W - 1 keys before it, as
transformers' sliding-window mask ``kv_idx > q_idx - W`` does), with the checkpoint's head
layout (``num_key_value_heads``, ``head_dim``), ``intermediate_size``, ``rms_norm_eps``,
``rope_theta`` and rope scaling (``default``, ``linear``, ``llama3``), q/k/v biases (Qwen2;
Llama's ``attention_bias``, which also gives the output projection one) and tied or untied
head. A field the import cannot reproduce exactly is a ``ValueError`` naming it, and so is a
field it does not know: ``config.json`` keys are either mapped, checked to be harmless for
the logits (``_HARMLESS``: bookkeeping, token ids, generation defaults), or refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._checks import is_int, is_number
from .config import LMConfig

# model_type -> (the causal-LM class, config.json fields it reads with transformers 5.24's
# default for a field a file leaves out: LlamaConfig, MistralConfig, Qwen2Config)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {
        "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
        "attention_dropout": 0.0, "max_position_embeddings": 2048}),
    "mistral": ("MistralForCausalLM", {
        "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "sliding_window": 4096, "attention_dropout": 0.0,
        "max_position_embeddings": 4096 * 32}),
    "qwen2": ("Qwen2ForCausalLM", {
        "num_key_value_heads": 32, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
        "layer_types": None, "attention_dropout": 0.0, "max_position_embeddings": 32768}),
}
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_ROPE = ("rope_theta", "rope_scaling", "rope_parameters", "original_max_position_embeddings")
ROPE_TYPES = ("default", "linear", "llama3")
_DEFAULT_THETA = 10000.0
# keys that do not change the logits: bookkeeping, token ids, output switches, generation defaults
_HARMLESS = frozenset({
    "model_type", "architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "num_labels", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "cross_attention_hidden_size", "torchscript", "use_bfloat16", "tf_legacy_loss", "finetuning_task",
    "tokenizer_class", "prefix", "task_specific_params", "_attn_implementation_autoset", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
})


def read_config_file(folder: Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict; a missing or unreadable file is a ValueError naming it."""
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: expected a Hugging Face model folder (config.json, "
                         f"model.safetensors or model.safetensors.index.json, tokenizer.json)")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(values).__name__}")
    return values


def hf_lm_config(values: dict[str, Any], source: str = "config.json") -> LMConfig:
    """The ``LMConfig`` of a Llama, Mistral or Qwen2 ``config.json`` (``values``); every field
    that would make the model compute something else than transformers does is a ValueError
    naming ``source`` and the field."""
    family = _family(values, source)
    fields = {**FAMILIES[family][1], **{key: values[key] for key in FAMILIES[family][1] if key in values}}
    _refuse_unknown(values, family, source)
    for name in _SIZES:
        if not is_int(values.get(name)) or values[name] < 1:
            raise ValueError(f"{source}: {name} must be a positive int, got {values.get(name)!r}")
    _require(fields["hidden_act"] == "silu", source, "hidden_act", fields["hidden_act"],
             "only 'silu' (the SwiGLU of Llama, Mistral and Qwen2) is supported")
    _require(fields.get("mlp_bias", False) is False, source, "mlp_bias", fields.get("mlp_bias"),
             "linattn's SwiGLU has no biases")
    _require(fields.get("pretraining_tp", 1) == 1, source, "pretraining_tp", fields.get("pretraining_tp"),
             "only 1 (projections computed whole) is supported")
    _require(fields.get("use_sliding_window") is not True, source, "use_sliding_window", True,
             "Qwen2's sliding-window layers are not imported")
    layer_types = fields.get("layer_types")
    _require(layer_types is None or (isinstance(layer_types, list)
                                     and all(kind == "full_attention" for kind in layer_types)),
             source, "layer_types", layer_types, "only 'full_attention' layers are imported")
    for name in ("tie_word_embeddings", "attention_bias"):
        _require(isinstance(fields.get(name, False), bool), source, name, fields.get(name), "a bool is expected")
    _require(is_number(fields["rms_norm_eps"]) and fields["rms_norm_eps"] > 0, source, "rms_norm_eps",
             fields["rms_norm_eps"], "a positive number is expected")
    theta, scaling = rope_settings(values, fields["max_position_embeddings"], source)
    heads = dict(n_heads=values["num_attention_heads"],
                 n_kv_heads=_positive_or_none(fields["num_key_value_heads"], source, "num_key_value_heads"),
                 head_dim=_positive_or_none(fields["head_dim"], source, "head_dim"))
    attention = _attention(family, fields, source)
    try:
        return LMConfig(
            vocab_size=values["vocab_size"], d_model=values["hidden_size"], n_layers=values["num_hidden_layers"],
            attention=attention, **heads, ffn_hidden=values["intermediate_size"], rotary_base=theta,
            rotary_scaling=scaling, qkv_bias=family == "qwen2" or fields.get("attention_bias", False),
            out_bias=fields.get("attention_bias", False), norm_eps=float(fields["rms_norm_eps"]),
            tie_embeddings=fields["tie_word_embeddings"], extra={"imported_from": FAMILIES[family][0]},
        )
    except (ValueError, TypeError) as error:  # e.g. a rope factor of 0, heads that do not divide
        raise ValueError(f"{source}: {error}") from None


def _family(values: dict[str, Any], source: str) -> str:
    """``values["model_type"]`` when it is a family this import reads and ``architectures``
    (when given) names its causal-LM class; else ValueError."""
    family = values.get("model_type")
    if family not in FAMILIES:
        supported = ", ".join(f"{name} ({cls})" for name, (cls, _) in FAMILIES.items())
        raise ValueError(f"{source}: model_type={family!r} is not supported; linattn imports {supported}")
    architectures = values.get("architectures")
    if architectures is not None and architectures != [FAMILIES[family][0]]:
        raise ValueError(f"{source}: architectures={architectures!r} is not supported; linattn imports "
                         f"[{FAMILIES[family][0]!r}] for model_type={family!r} (a causal language model with its "
                         f"output head)")
    return family


def _refuse_unknown(values: dict[str, Any], family: str, source: str) -> None:
    known = set(_SIZES) | set(_ROPE) | set(FAMILIES[family][1]) | _HARMLESS
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{source}: the field(s) {', '.join(unknown)} are not known to linattn's import of "
                         f"{FAMILIES[family][0]}; they may change what the model computes, so nothing was imported")


def _require(holds: bool, source: str, name: str, value: object, why: str) -> None:
    if not holds:
        raise ValueError(f"{source}: {name}={value!r} is not supported: {why}")


def _positive_or_none(value: object, source: str, name: str) -> int | None:
    _require(value is None or (is_int(value) and value >= 1), source, name, value, "a positive int is expected")
    return value


def _attention(family: str, fields: dict[str, Any], source: str) -> str:
    """``"softmax"``, or ``"local:W"`` for Mistral's ``sliding_window`` W (module docstring)."""
    window = fields.get("sliding_window") if family == "mistral" else None
    if window is None:
        return "softmax"
    _require(is_int(window) and window >= 1, source, "sliding_window", window, "a positive int or null is expected")
    return f"local:{window}"


def rope_settings(values: dict[str, Any], max_positions: object, source: str = "config.json"
                  ) -> tuple[float, dict[str, Any] | None]:
    """``(rotary_base, rotary_scaling)`` of a config's rotary settings, read as transformers 5.24
    reads them: the dict ``rope_scaling`` (older files) or else ``rope_parameters``; its
    ``rope_theta``, else the top-level ``rope_theta``, else 10000; its type from ``rope_type``
    (or the older ``type``); for llama3 its ``original_max_position_embeddings``, else the
    top-level one, else ``max_position_embeddings``. Types other than ``ROPE_TYPES``, a
    ``partial_rotary_factor`` other than 1 and per-layer rope dicts are refused by name."""
    rope = values.get("rope_scaling") or values.get("rope_parameters") or {}
    key = "rope_scaling" if values.get("rope_scaling") else "rope_parameters"
    _require(isinstance(rope, dict), source, key, rope, "a dict is expected")
    nested = [name for name, value in rope.items() if isinstance(value, dict)]
    _require(not nested, source, key, rope, "one rope setting for every layer is expected (not one per layer type)")
    theta = rope.get("rope_theta", values.get("rope_theta", _DEFAULT_THETA))
    _require(is_number(theta) and theta > 1, source, "rope_theta", theta, "a number > 1 is expected")
    kind = rope.get("rope_type", rope.get("type", "default"))
    _require(kind in ROPE_TYPES, source, f"{key}.rope_type", kind, f"linattn imports the rope types {ROPE_TYPES}")
    partial = rope.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))
    _require(partial == 1.0, source, "partial_rotary_factor", partial, "rotary positions on every channel (1.0)")
    if kind == "default":
        return float(theta), None
    names = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    for name in names:
        _require(name in rope, source, f"{key}.{name}", None, f"rope type {kind!r} needs it")
    scaling = {"type": kind, **{name: rope[name] for name in names}}
    if kind == "llama3":
        length = values.get("original_max_position_embeddings",
                            rope.get("original_max_position_embeddings", max_positions))
        scaling["original_max_position_embeddings"] = length
    return float(theta), scaling
