"""``LinattnConfig``: ``LMConfig`` as a Hugging Face ``PretrainedConfig`` (``model_type="linattn"``)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from transformers import PretrainedConfig

from ..models.config import LMConfig, saved_values

_LM_FIELDS = tuple(f.name for f in dataclasses.fields(LMConfig))


class LinattnConfig(PretrainedConfig):
    """Every ``LMConfig`` field under its own name (same defaults), plus the names Hugging
    Face code reads: ``hidden_size`` (= ``d_model``), ``num_hidden_layers`` (= ``n_layers``),
    ``num_attention_heads`` (= ``n_heads``; None for a model of GAU pairs, which have no
    heads), ``num_key_value_heads`` (= ``n_kv_heads``, or ``n_heads`` when unset),
    ``tie_word_embeddings`` (= ``tie_embeddings``), ``vocab_size``,
    ``bos/eos/pad_token_id`` (None by default: the byte vocabulary has no BOS/EOS, and a pad
    id would make ``generate`` read that byte in a prompt as padding; pass ``attention_mask``.
    An export sets ``bos_token_id`` to the newline token, the token documents start after:
    ``generate`` without a prompt starts from it, ``linattn lm-eval`` conditions an empty
    context on it).

    ``to_lm_config()`` and ``from_lm_config()`` convert losslessly; building one validates
    the model settings exactly as ``LMConfig`` does (an unknown layer kind is a ``ValueError``).
    ``from_dict`` (so ``from_pretrained``) reads a config of an older export as its model was
    built (``LMConfig.from_saved``).
    """

    model_type: ClassVar[str] = "linattn"
    attribute_map: ClassVar[dict[str, str]] = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "tie_word_embeddings": "tie_embeddings",
    }

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    attention: str | list[str] = "vq"
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_hidden: int | None = None
    rotary_base: float = 10000.0
    rotary_scaling: dict | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    norm_eps: float | None = None
    local_window: int = 256
    chunk_size: int = 64
    favor_features: int = 128
    feature_seed: int = 0
    delta_short_conv: int | None = 4
    softmax_memory: int = 0
    attention_scale: str = "default"
    gau_d_k: int = 128
    gau_d_v: int | None = None
    codebook_size: int = 512
    block_size: int = 128
    commitment_weight: float = 1e-4
    ema_decay: float = 0.99
    kmeans_init: bool = False
    dead_code_threshold: float = 0.0
    soft_vq_temperature: float = 1.0
    fsq_levels: tuple[int, ...] | list[int] = (8, 5, 5, 5)
    gau_variant: str = "linattn"
    sinusoid_dropout: float | None = None
    sinusoid_wavelength: float | None = None
    vq_grad_scope: str | None = None
    commitment_reduction: str | None = None
    tie_embeddings: bool = True
    init_std: float = 0.02
    extra: dict | None = None
    bos_token_id: int | None = None
    """The token documents start after (an export's: the newline token); None: none."""
    eos_token_id: int | list[int] | None = None
    """The token(s) that end generation; None: none (the byte vocabulary has no EOS)."""
    pad_token_id: int | None = None
    """None by default: a pad id would make ``generate`` read that byte in a prompt as padding."""
    use_cache: bool = True
    """``generate`` carries a ``LinattnCache`` of recurrent states (constant memory)."""

    def __post_init__(self, **kwargs: Any) -> None:
        if self.extra is None:
            self.extra = {}
        super().__post_init__(**kwargs)
        self.n_heads = self.to_lm_config().n_heads  # unset: 4 where a layer has heads, as LMConfig resolves it

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> "LinattnConfig":
        """``PretrainedConfig.from_dict`` (what ``from_pretrained`` reads a ``config.json`` with),
        the file read as its model was built (``models.config.saved_values``, as
        ``LMConfig.from_saved``: a field it lacks because it was written before the field
        existed, ``sinusoid_wavelength``, is 1e4; head settings saved for a model without heads
        are unset)."""
        return super().from_dict(saved_values(config_dict), **kwargs)

    @property
    def num_key_value_heads(self) -> int | None:
        return self.n_kv_heads or self.n_heads

    def to_lm_config(self) -> LMConfig:
        """The ``LMConfig`` these fields describe (validated)."""
        values = {name: getattr(self, name) for name in _LM_FIELDS}
        values["extra"] = dict(values["extra"] or {})
        if isinstance(values["attention"], tuple):
            values["attention"] = list(values["attention"])
        return LMConfig(**values)

    @classmethod
    def from_lm_config(cls, config: LMConfig, **kwargs: Any) -> "LinattnConfig":
        """A ``LinattnConfig`` holding every field of ``config``; ``kwargs`` set the
        Hugging Face-only fields (token ids, ``use_cache``, ...)."""
        if not isinstance(config, LMConfig):
            raise TypeError(f"config must be an LMConfig, got {type(config).__name__}")
        return cls(**config.to_dict(), **kwargs)
