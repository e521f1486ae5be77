"""What vLLM reads about a linattn model before building it: the config class of
``model_type="linattn"`` and the engine settings the model needs (vLLM internals:
``vllm.transformers_utils.config._CONFIG_REGISTRY`` and
``vllm.model_executor.models.config.MODELS_CONFIG_MAP``)."""

from __future__ import annotations

import logging

import torch

from ..hf.config import LinattnConfig
from ..models.config import LMConfig

PAGED_KINDS = ("softmax",)  # layer kinds served by vLLM's paged attention; every other kind keeps a state slot

logger = logging.getLogger("linattn.serve")


class ServedLinattnConfig(LinattnConfig):
    """``LinattnConfig`` with ``layer_types``, which vLLM reads to tell a hybrid model (state
    layers beside attention layers) from a pure attention one: ``"full_attention"`` for the
    kinds of ``PAGED_KINDS``, ``"linattn_state"`` for the others."""

    # vLLM derives a head size from num_attention_heads for every model; a model of GAU pairs has
    # no heads (n_heads None) and no paged layer to use one
    attribute_map = {name: to for name, to in LinattnConfig.attribute_map.items() if name != "num_attention_heads"}

    @property
    def num_attention_heads(self) -> int:
        return self.n_heads or 1

    @property
    def num_key_value_heads(self) -> int:
        return self.n_kv_heads or self.num_attention_heads

    @property
    def layer_types(self) -> list[str]:
        return layer_types(self.to_lm_config())


def layer_types(config: LMConfig) -> list[str]:
    """One entry per layer: ``"full_attention"`` (paged attention) or ``"linattn_state"`` (a state slot)."""
    return ["full_attention" if spec.kind in PAGED_KINDS else "linattn_state" for spec in config.layer_specs()]


def check_served_config(config: LMConfig, dtype: torch.dtype, head_sizes: list[int] | None,
                        prefix_caching: bool, speculative: bool = False) -> None:
    """The settings vLLM would run the model with, refused where they do not fit (ValueError
    naming the setting): float32 weights (linattn's one-token decoding steps and the exact
    comparison with ``LM.generate`` are float32), a head size vLLM's attention kernels take
    for every paged layer (``head_sizes``; None: not checked here, vLLM checks), and no prefix
    caching (``prefix_caching``) or speculative decoding (``speculative``) for a model with
    state layers (its states are kept per sequence, not per cached block, and cannot take back
    rejected draft tokens)."""
    if dtype != torch.float32:
        raise ValueError(f"linattn models are served in float32, got dtype {dtype}: pass --dtype float32")
    types = layer_types(config)
    if "full_attention" in types and head_sizes is not None:
        head_dim = config.head_dim or config.d_model // config.n_heads
        if head_dim not in head_sizes:
            raise ValueError(f"the softmax layers of this model have head_dim={head_dim}, but vLLM's attention "
                             f"backend here takes head sizes {head_sizes}; set head_dim (or d_model / n_heads)")
    if "linattn_state" in types and prefix_caching:
        raise ValueError("prefix caching is not supported for linattn models with state layers (each sequence "
                         "keeps one state, not one per cached block): pass --no-enable-prefix-caching")
    if "linattn_state" in types and speculative:
        raise ValueError("speculative decoding is not supported for linattn models with state layers (a state "
                         "cannot take back rejected draft tokens): leave --speculative-config unset")


def _verify_and_update_config(vllm_config) -> None:
    """What vLLM calls once the engine's settings are known (``MODELS_CONFIG_MAP``)."""
    from vllm.model_executor.models.config import MambaModelConfig
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    config = model_config.hf_config.to_lm_config()
    head_sizes = _cpu_head_sizes() if current_platform.is_cpu() else None
    check_served_config(config, model_config.dtype, head_sizes, bool(vllm_config.cache_config.enable_prefix_caching),
                        speculative=vllm_config.speculative_config is not None)
    if "linattn_state" in layer_types(config):
        MambaModelConfig.verify_and_update_config(vllm_config)


def _cpu_head_sizes() -> list[int]:
    """The head sizes of vLLM's CPU attention backend (``CPUAttentionBackend.get_supported_head_sizes``)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def register_config() -> None:
    """Register ``ServedLinattnConfig`` and the engine settings' check with vLLM."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    from . import ARCHITECTURE

    class LinattnModelSettings(VerifyAndUpdateConfig):
        verify_and_update_config = staticmethod(_verify_and_update_config)

    _CONFIG_REGISTRY["linattn"] = ServedLinattnConfig
    MODELS_CONFIG_MAP[ARCHITECTURE] = LinattnModelSettings
