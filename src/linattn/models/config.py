"""``LMConfig``: the shape of a decoder-only language model and the attention of each layer."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from .._checks import (check_bool_fields, check_choice, check_int_fields, check_number_fields, config_from_dict,
                       is_int, is_number)
from ..nn.attention import ATTENTION_SCALES
from ..nn.fsq import check_levels
from ..nn.gau import GAU_VARIANTS
from ..nn.quantizer import COMMITMENT_REDUCTIONS
from ..nn.rotary import check_rotary_scaling
from ..ops.vq import GRAD_SCOPES
from .layers import LayerSpec, layer_kind, layer_spec_help, parse_layer_spec

_SEED_LIMIT = 2**63
# Fields added after models were first saved, with the value a saved config without them meant:
# before sinusoid_wavelength existed, every GAU (paper variant included) used 1e4.
SAVED_BEFORE = {"sinusoid_wavelength": 1e4}
DEFAULT_HEADS = 4  # n_heads where a layer has heads and n_heads is unset
HEAD_FIELDS = ("n_heads", "n_kv_heads", "head_dim")


def _check_attention_kind(attention: object) -> None:
    """``attention`` is a str or a list (or tuple) of str; its specs are parsed by ``layer_specs``."""
    if isinstance(attention, str):
        return
    if isinstance(attention, (list, tuple)):
        for spec in attention:
            if not isinstance(spec, str):
                raise TypeError(f"LMConfig.attention must be a str or a list of str, got a {type(attention).__name__} "
                                f"holding {type(spec).__name__} {spec!r}")
        return
    raise TypeError(f"LMConfig.attention must be a str or a list of str, got {type(attention).__name__} "
                    f"{attention!r}")


def _check_extra(extra: object) -> None:
    """``extra`` is a dict with str keys that JSON can write (checkpoints store it in meta.json,
    so another value would fail at the first save, after training)."""
    if not isinstance(extra, dict):
        raise TypeError(f"LMConfig.extra must be a dict, got {type(extra).__name__} {extra!r}")
    keys = [key for key in extra if not isinstance(key, str)]
    if keys:
        raise TypeError(f"LMConfig.extra must have str keys (JSON turns others into strings), got {keys[0]!r}")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as error:
        raise TypeError(f"LMConfig.extra must hold JSON values (it is saved in checkpoints): {error}") from None


@dataclass
class LMConfig:
    """Configuration of ``linattn.models.LM``.

    ``attention`` is one spec for every layer, a comma-separated pattern, or a list; a
    pattern shorter than ``n_layers`` repeats (``"local:128,vq"`` alternates). A ``"vq"``
    layer is a pair of gated attention units (Transformer-VQ), about as many parameters
    as one attention + SwiGLU block of the same width.

    ``rotary_scaling``, ``qkv_bias``, ``out_bias`` and ``norm_eps`` describe models imported
    from Hugging Face checkpoints (``LM.from_hf``); their defaults are what every model saved
    before they existed was built with.
    ``n_heads``, ``n_kv_heads`` and ``head_dim`` shape the layers with heads (every kind but
    the GAU pairs: ``vq``, ``vq-fsq``, ``soft-vq``, ``gau-softmax``). ``n_heads`` unset is 4
    where a layer has heads; it must divide ``d_model`` unless ``head_dim`` is set (else part
    of the width would go unused). A model without such layers refuses all three set (they
    would be ignored); ``from_saved`` reads configs saved before that rule as they were built.
    """

    vocab_size: int = 256
    """Tokens the model reads and predicts (256: bytes)."""
    d_model: int = 256
    """The width of the residual stream."""
    n_layers: int = 4
    """The number of layers (a ``vq`` layer is one GAU pair)."""
    attention: str | list[str] = "vq"
    """The layer specs: one for every layer, a comma-separated pattern, or a list; a pattern
    shorter than ``n_layers`` repeats (docs/guide/models.md lists every kind)."""
    n_heads: int | None = None
    """Query heads of the layers with heads (every kind but the GAU pairs); None: 4 there."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention; must divide ``n_heads``); None: ``n_heads``."""
    head_dim: int | None = None
    """The width of a head; None: ``d_model // n_heads``."""
    ffn_hidden: int | None = None
    """The hidden width of the SwiGLU feed-forward of the blocks; None: 8/3 ``d_model`` rounded up to 32."""
    rotary_base: float = 10000.0
    """The base of the rotary position frequencies ``base^(-2i/head_dim)`` (a number > 1)."""
    rotary_scaling: dict | None = None
    """The rotary frequencies as an imported checkpoint's rope type changes them (Llama 3's
    ``rope_scaling``, ``linattn.nn.rotary``); None: plain rotary."""
    qkv_bias: bool = False
    """Attention layers: biases on the q, k and v projections (Qwen2)."""
    out_bias: bool = False
    """Attention layers: a bias on the output projection (Llama's ``attention_bias``)."""
    norm_eps: float | None = None
    """The eps of the blocks' and the final RMSNorm; None: ``nn.RMSNorm``'s (the dtype's eps)."""
    local_window: int = 256
    """The window W of ``local`` layers (``local:W`` overrides it per layer)."""
    chunk_size: int = 64
    """The chunk length of the chunked forms (kernel attention, the delta rule, the gated layers)."""
    favor_features: int = 128
    """Random features M of ``favor`` layers (``favor:M`` overrides it per layer)."""
    feature_seed: int = 0
    """The seed of the FAVOR+ projections: layer i draws from ``feature_seed + i``."""
    delta_short_conv: int | None = 4
    """The kernel of the short causal convolution on q, k and v of ``delta`` and ``gated-delta``
    layers; None: no convolution."""
    softmax_memory: int = 0
    """Keys an exact softmax layer keeps across training windows (Transformer-XL memory; 0: none)."""
    attention_scale: str = "default"
    """The scale of the exact softmax layers (``softmax``, ``local``, ``gau-softmax``):
    ``"default"`` (``1/sqrt(d)``) or ``"entropy"`` (``log_512(n) / sqrt(d)``, n the keys a query sees)."""
    gau_d_k: int = 128
    """The query/key width of the GAU layers (``vq``, ``vq-fsq``, ``soft-vq``, ``gau-softmax``)."""
    gau_d_v: int | None = None
    """The value and gate width of the GAU layers; None: 2 ``d_model``."""
    codebook_size: int = 512
    """S, the codes per codebook of the VQ layers (``vq``, ``soft-vq``, ``vq-attn``)."""
    block_size: int = 128
    """L, the block length of the VQ layers: exact attention to the own and the previous block,
    the codebook cache beyond."""
    commitment_weight: float = 1e-4
    """The weight of the VQ commitment loss in ``aux["commit_loss"]`` (a number >= 0)."""
    ema_decay: float = 0.99
    """The decay of the codebooks' EMA update (``model.update_codebooks()``), in [0, 1)."""
    kmeans_init: bool = False
    """Set the codebooks by k-means on the keys of the first training batch."""
    dead_code_threshold: float = 0.0
    """In ``update_codebooks()``, codes whose EMA count is below this restart on random recent
    keys (0: never)."""
    soft_vq_temperature: float = 1.0
    """The temperature of the soft assignment of ``soft-vq`` layers (a positive number)."""
    fsq_levels: tuple[int, ...] = (8, 5, 5, 5)
    """``vq-fsq`` layers: the levels per bounded dimension; the implicit codebook size S is
    their product."""
    gau_variant: str = "linattn"
    """``"linattn"`` or ``"paper"`` (the official Transformer-VQ code's GAU and training,
    docs/results.md); the four fields below left None take the variant's choice."""
    sinusoid_dropout: float | None = None
    """Dropout on the GAU's relative-position sinusoids; None: the variant's (linattn 0, paper
    0.2, its enwik8 setting)."""
    sinusoid_wavelength: float | None = None
    """The wavelength of those sinusoids; None: the variant's (linattn 1e4, paper 1e5, the
    official ``pe_lam``)."""
    vq_grad_scope: str | None = None
    """``vq_attention``'s ``grad_scope`` in the VQ layers; None: the variant's (linattn
    ``"cache"``, paper ``"state"``)."""
    commitment_reduction: str | None = None
    """How the quantizer reduces the commitment loss; None: the variant's (linattn ``"mean"``,
    paper ``"paper"``)."""
    tie_embeddings: bool = True
    """The output projection shares the token embedding's weights."""
    init_std: float = 0.02
    """The standard deviation of the initial weights (output projections scaled by ``1/sqrt(2 n_layers)``)."""
    extra: dict = field(default_factory=dict)
    """Free-form notes carried into checkpoints (str keys, JSON values)."""

    def __post_init__(self) -> None:
        """Check every field, naming it: ValueError for a value out of range, TypeError for a
        wrong kind; then each layer kind checks the settings it is built with."""
        check_int_fields(self, "LMConfig", ("vocab_size", "d_model", "n_layers", "local_window", "chunk_size",
                                            "favor_features", "gau_d_k", "codebook_size", "block_size"), minimum=1)
        check_int_fields(self, "LMConfig", (*HEAD_FIELDS, "ffn_hidden", "gau_d_v", "delta_short_conv"),
                         minimum=1, optional=True)
        check_int_fields(self, "LMConfig", ("softmax_memory", "feature_seed"), minimum=0)
        if self.feature_seed + self.n_layers > _SEED_LIMIT:  # layer i draws its FAVOR features from seed + i
            raise ValueError(f"LMConfig.feature_seed must be at most 2**63 - n_layers, got {self.feature_seed}")
        check_number_fields(self, "LMConfig", ("ema_decay",), low=0, high=1, high_inclusive=False, wanted="in [0, 1)")
        check_number_fields(self, "LMConfig", ("soft_vq_temperature", "init_std"), low=0, low_inclusive=False,
                            wanted="a positive number")
        check_number_fields(self, "LMConfig", ("commitment_weight", "dead_code_threshold"), low=0,
                            wanted="a number >= 0")
        check_number_fields(self, "LMConfig", ("rotary_base",), low=1, low_inclusive=False,
                            wanted="a number > 1 (rotary frequencies are rotary_base^(-2i/head_dim): with a base "
                                   "<= 1 they do not fall with the dimension i, and a base of 0 gives inf and NaN)")
        check_bool_fields(self, "LMConfig", ("kmeans_init", "tie_embeddings", "qkv_bias", "out_bias"))
        if self.norm_eps is not None:
            check_number_fields(self, "LMConfig", ("norm_eps",), low=0, low_inclusive=False,
                                wanted="a positive number or None (nn.RMSNorm's default)")
        self.rotary_scaling = check_rotary_scaling("LMConfig.rotary_scaling", self.rotary_scaling)
        _check_extra(self.extra)
        _check_attention_kind(self.attention)
        check_choice("LMConfig.gau_variant", self.gau_variant, GAU_VARIANTS)
        check_choice("LMConfig.attention_scale", self.attention_scale, ATTENTION_SCALES)
        try:
            self.fsq_levels = check_levels(self.fsq_levels)
        except ValueError as error:
            raise ValueError(f"LMConfig.fsq_levels: {error}") from None
        check_choice("LMConfig.vq_grad_scope", self.vq_grad_scope, (None, *GRAD_SCOPES))
        check_choice("LMConfig.commitment_reduction", self.commitment_reduction, (None, *COMMITMENT_REDUCTIONS))
        if self.sinusoid_dropout is not None and not (is_number(self.sinusoid_dropout)
                                                      and 0.0 <= self.sinusoid_dropout < 1.0):
            raise ValueError(f"LMConfig.sinusoid_dropout must be in [0, 1) or None, got {self.sinusoid_dropout!r}")
        if self.sinusoid_wavelength is not None:
            check_number_fields(self, "LMConfig", ("sinusoid_wavelength",), low=0, low_inclusive=False,
                                wanted="a positive number or None (the variant's: 1e4, paper 1e5)")
        specs = self.layer_specs()  # validates the attention pattern
        self._check_heads(specs)
        for spec in specs:
            layer_kind(spec).check_config(self, spec)

    def _check_heads(self, specs: list[LayerSpec]) -> None:
        """The head settings against the layers (class docstring): refused by name where no
        layer has heads, else ``n_heads`` resolved (None: 4) and checked against ``d_model``."""
        if not any(layer_kind(spec).uses_heads for spec in specs):
            for name in HEAD_FIELDS:
                if getattr(self, name) is not None:
                    kinds = ", ".join(sorted({spec.kind for spec in specs}))
                    raise ValueError(f"LMConfig.{name}={getattr(self, name)!r} is used by no layer: the {kinds} "
                                     "layers have no heads (a GAU pair attends with one head of gau_d_k channels); "
                                     "leave it unset")
            return
        if self.n_heads is None:
            self.n_heads = DEFAULT_HEADS
        if self.n_heads % (self.n_kv_heads or self.n_heads):
            raise ValueError(f"LMConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim is None and self.d_model % self.n_heads:
            width = self.d_model // self.n_heads
            raise ValueError(f"LMConfig.n_heads={self.n_heads} must divide d_model={self.d_model} (head_dim = "
                             f"d_model // n_heads = {width} would leave {self.d_model - width * self.n_heads} of its "
                             f"{self.d_model} channels unused); set head_dim to choose the heads' width")

    def layer_specs(self) -> list[LayerSpec]:
        """The parsed spec of each of the ``n_layers`` layers."""
        pattern = self.attention.split(",") if isinstance(self.attention, str) else list(self.attention)
        if not pattern:
            raise ValueError(f"LMConfig.attention is empty. {layer_spec_help()}")
        specs = [parse_layer_spec(spec) for spec in pattern]
        if len(specs) > self.n_layers:
            raise ValueError(f"LMConfig.attention lists {len(specs)} layers but n_layers={self.n_layers}")
        return [specs[i % len(specs)] for i in range(self.n_layers)]

    def gau_options(self) -> dict[str, Any]:
        """The GAU settings of the variant, with unset (None) fields filled by its choice."""
        paper = self.gau_variant == "paper"

        def pick(value, ours, official):
            return value if value is not None else (official if paper else ours)

        return dict(variant=self.gau_variant, sinusoid_dropout=pick(self.sinusoid_dropout, 0.0, 0.2),
                    sinusoid_wavelength=pick(self.sinusoid_wavelength, 1e4, 1e5),
                    grad_scope=pick(self.vq_grad_scope, "cache", "state"),
                    commitment_reduction=pick(self.commitment_reduction, "mean", "paper"))

    @property
    def ffn_width(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 32 * math.ceil(8 * self.d_model / 3 / 32)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "LMConfig":
        """Build from a dict (a checkpoint's JSON, a TOML ``[model]`` table); unknown keys are an error."""
        return config_from_dict(cls, values, "model")

    @classmethod
    def from_saved(cls, values: dict[str, Any]) -> "LMConfig":
        """``from_dict`` of a config a model was saved with (a checkpoint's ``model_config``, an
        export's ``config.json``), read as that model was built (``saved_values``)."""
        return cls.from_dict(saved_values(values))


def uses_heads(attention: str | list[str]) -> bool:
    """Whether a layer of the pattern ``attention`` (``LMConfig.attention``'s forms) has heads,
    so that ``n_heads``, ``n_kv_heads`` and ``head_dim`` apply (every kind but the GAU pairs)."""
    _check_attention_kind(attention)
    pattern = attention.split(",") if isinstance(attention, str) else list(attention)
    return any(layer_kind(parse_layer_spec(spec)).uses_heads for spec in pattern)


def saved_values(values: dict[str, Any]) -> dict[str, Any]:
    """The fields of a saved config as its model was built, for configs written before a
    rule of today's ``LMConfig``: a field it lacks because it did not exist yet takes the
    value the model was built with (``SAVED_BEFORE``), not today's default; head settings
    saved for a model without heads (every config recorded ``n_heads``, 4 by default) are
    unset; and a model whose ``n_heads`` did not divide ``d_model`` gets the ``head_dim`` it
    was built with (``d_model // n_heads``), so its weights keep their shapes."""
    values = {**SAVED_BEFORE, **values}
    if not uses_heads(values.get("attention", LMConfig.attention)):
        return {**values, **dict.fromkeys(HEAD_FIELDS)}
    n_heads, d_model = values.get("n_heads") or DEFAULT_HEADS, values.get("d_model", LMConfig.d_model)
    if values.get("head_dim") is None and is_int(n_heads) and is_int(d_model) and n_heads > 0 and d_model % n_heads:
        values["head_dim"] = d_model // n_heads
    return values


def matched_gau_value_width(d_model: int, gau_d_k: int) -> int:
    """The GAU value width ``d_v`` (a multiple of 8) that makes a Transformer-VQ layer (two
    GAUs: ``2 d_model d_k + 3 d_model d_v + d_k^2`` weights each) about as large as one
    pre-norm attention + SwiGLU block of the same ``d_model`` (``4 d^2 + 3 d ffn_width``),
    so models that mix or compare the two have equal parameter counts."""
    block_params = 4 * d_model * d_model + 3 * d_model * LMConfig(d_model=d_model).ffn_width
    per_unit = block_params / 2 - 2 * d_model * gau_d_k - gau_d_k * gau_d_k
    return max(8, int(round(per_unit / (3 * d_model) / 8)) * 8)
