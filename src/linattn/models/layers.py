"""Layer kinds of the language model: one registry from a spec string to a built layer.

A layer spec is ``KIND`` or ``KIND:OPTION`` (``"vq"``, ``"linear:dpfp:2"``, ``"local:128"``).
The exact softmax kinds take flags after the kind (and after local's window), in any order:
``nope`` (no positional encoding; softmax and local), ``entropy`` (the entropy-invariant
scale ``log_512(n)/sqrt(d)``; softmax, local, gau-softmax) and ``rerope=W`` (ReRoPE, rotary
positions inside a window of W and distance W beyond it; softmax and local, not with
``nope``), e.g. the window + global hybrid ``local:128,local:128,softmax:nope:entropy`` or
``softmax:rerope=64:entropy``. The VQ kinds take ``rerope`` (window = ``block_size``) or
``rerope=W`` (``W <= block_size``): ReRoPE instead of the GAU's Transformer-XL terms
(``vq:rerope``, ``vq-fsq:rerope=32``). ``vq-attn:rerope[=W]`` and ``vq-attn:bias`` are multi-head
attention over VQ keys (a transformer's q/k/v/o, ReRoPE or Transformer-VQ's windowed bias; what
``linattn convert`` makes of a softmax layer); ``linear:hedgehog`` is kernel attention through
Hedgehog's learned feature map.
Each kind is one ``LayerKind`` entry that says everything the model needs to know about it:
how its option is checked, how the layer is built from an ``LMConfig``, which of its linear
maps are output projections (initialised with the smaller residual std), how its decode
state is carried between training windows, and whether that state grows with the context.
``LM`` never matches kind names; adding a mechanism is one ``register_layer_kind`` call.

Every built layer has the same interface as every mixer in ``linattn.nn``:
``forward(x [B, T, d_model], state=None) -> (x_out [B, T, d_model], state, aux)``, where
``aux`` is a list of the mixers' aux dicts (``commit_loss``, ``codes`` for VQ units).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.attention import Attention, truncate_cache
from ..nn.delta_net import DeltaNet
from ..nn.gated_delta_net import GatedDeltaNet
from ..nn.gau import GAU
from ..nn.gla import GatedLinearAttention
from ..nn.hedgehog import HEDGEHOG
from ..nn.retention import MultiScaleRetention
from ..nn.vq_heads import MultiHeadVQAttention
from ..ops.kernel import FAVOR

if TYPE_CHECKING:
    from .config import LMConfig

LINEAR_FEATURE_MAPS = ("elu", "relu", "identity", "exp", "dpfp", "taylor", HEDGEHOG)


@dataclass(frozen=True)
class LayerSpec:
    """One parsed layer spec: ``kind`` plus its option (feature map, window, ...)."""

    kind: str
    option: str | None = None

    def __str__(self) -> str:
        return self.kind if self.option is None else f"{self.kind}:{self.option}"


def _no_option(option: str | None) -> bool:
    return option is None


def _is_count(text: str) -> bool:
    """ASCII digits spelling an int >= 1 (``str.isdigit`` also accepts ``"²"``, which ``int`` refuses)."""
    return text.isascii() and text.isdigit() and int(text) >= 1


def _optional_count(option: str | None) -> bool:
    return option is None or _is_count(option)


def _linear_option(option: str | None) -> bool:
    """A feature map the layer builds: a name of ``LINEAR_FEATURE_MAPS``, or ``dpfp:NU``."""
    name, _, nu = (option or "").partition(":")
    return name in LINEAR_FEATURE_MAPS and (not nu or (name == "dpfp" and _is_count(nu)))


def _delta_option(option: str | None) -> bool:
    """No option (identity features), or a linear layer's fixed feature map (``dpfp:NU`` included):
    ``delta:elu:3`` or ``delta:dpfp:x`` would fail only when the layer is built."""
    return option is None or (_linear_option(option) and option != HEDGEHOG)


def _rerope_part(parts: list[str]) -> tuple[int | None, bool]:
    """Take a ``rerope=W`` part out of ``parts``: ``(W or None, valid)``."""
    found = [part for part in parts if part.startswith("rerope=")]
    if not found:
        return None, True
    value = found[0].removeprefix("rerope=")
    if len(found) > 1 or not _is_count(value):
        return None, False
    parts.remove(found[0])
    return int(value), True


def _exact_options(option: str | None, flags: tuple[str, ...], window: bool = False, rerope: bool = False):
    """``(window or None, set of flags, rerope window or None)`` of an exact softmax kind's option
    text, or None if invalid (``rerope``: the kind takes ``rerope=W``, not with ``nope``)."""
    parts = [] if option is None else option.split(":")
    size = None
    if window and parts and parts[0].isascii() and parts[0].isdigit():
        size = int(parts.pop(0))
        if size < 1:
            return None
    rerope_window, valid = _rerope_part(parts) if rerope else (None, True)
    if not valid or any(part not in flags for part in parts) or len(set(parts)) != len(parts):
        return None
    if rerope_window is not None and "nope" in parts:
        return None
    return size, set(parts), rerope_window


def _softmax_option(option: str | None) -> bool:
    return _exact_options(option, ("nope", "entropy"), rerope=True) is not None


def _local_option(option: str | None) -> bool:
    return _exact_options(option, ("nope", "entropy"), window=True, rerope=True) is not None


def _gau_softmax_option(option: str | None) -> bool:
    return _exact_options(option, ("entropy",)) is not None


def _vq_rerope(option: str | None, config: LMConfig | None = None) -> int | None:
    """The ReRoPE window of a VQ kind's option: None (no option), ``config.block_size`` for
    ``rerope``, W for ``rerope=W``."""
    if option is None:
        return None
    if option == "rerope":
        return config.block_size
    return int(option.removeprefix("rerope="))


def _vq_option(option: str | None) -> bool:
    """No option, ``rerope`` or ``rerope=W``."""
    return option in (None, "rerope") or (option.startswith("rerope=") and _is_count(option.removeprefix("rerope=")))


def _vq_heads_option(option: str | None) -> bool:
    """``rerope``, ``rerope=W`` or ``bias``: the positions of a ``vq-attn`` layer."""
    return option == "bias" or (option is not None and _vq_option(option))


def _scale(config: LMConfig, flags: set) -> str:
    return "entropy" if "entropy" in flags else config.attention_scale


def _unchanged(state: Any, config: LMConfig) -> Any:
    return state


@dataclass(frozen=True)
class LayerKind:
    """Everything the model knows about one kind of layer (``register_layer_kind`` adds one).

    Attributes:
        name: the spec's kind (before the first ``:``).
        build: ``build(config, spec, index) -> nn.Module``, the layer (``index``: its
            position, for per-layer seeds).
        usage: the spec forms, shown in error messages and ``--help``.
        check_option: ``check_option(option) -> bool``, whether the text after ``:`` (None if
            absent) is valid.
        output_projections: dotted names, inside the built layer, of the linear maps that
            write into the residual stream; they are initialised with ``init_std / sqrt(2 n_layers)``.
        carry: ``carry(state, config) -> state``, the detached state a training window passes
            to the next (e.g. a softmax cache cut to ``config.softmax_memory`` keys).
        growing_cache: the decode state grows with the context (exact softmax's KV cache).
        check_config: ``check_config(config, spec)`` raises ValueError, at ``LMConfig``
            construction, for settings the layer cannot be built with (e.g. an odd head
            dimension under rotary).
        uses_heads: the layer is built with ``n_heads``, ``n_kv_heads`` and ``head_dim`` (a
            model none of whose layers is refuses them set: ``LMConfig``).
    """

    name: str
    build: Callable[[LMConfig, LayerSpec, int], nn.Module]
    usage: str
    check_option: Callable[[str | None], bool] = _no_option
    output_projections: tuple[str, ...] = ()
    carry: Callable[[Any, LMConfig], Any] = _unchanged
    growing_cache: bool = False
    check_config: Callable[[LMConfig, LayerSpec], None] = lambda config, spec: None
    uses_heads: bool = True


_LAYER_KINDS: dict[str, LayerKind] = {}


def register_layer_kind(kind: LayerKind) -> LayerKind:
    """Make ``kind`` available to ``LMConfig.attention`` specs; a name is registered once.

    Args:
        kind: the ``LayerKind``; its name (non-empty, without ``:`` or ``,``) must be new.

    Returns:
        ``kind``.
    """
    if not isinstance(kind, LayerKind):
        raise TypeError(f"kind must be a LayerKind, got {type(kind).__name__}")
    if kind.name in _LAYER_KINDS:
        raise ValueError(f"layer kind {kind.name!r} is already registered")
    if not kind.name or ":" in kind.name or "," in kind.name:
        raise ValueError(f"layer kind name must be non-empty without ':' or ',', got {kind.name!r}")
    _LAYER_KINDS[kind.name] = kind
    return kind


def layer_kinds() -> dict[str, LayerKind]:
    """The registered kinds by name (a copy)."""
    return dict(_LAYER_KINDS)


def layer_spec_help() -> str:
    """One line listing every registered spec form."""
    return "layer attention specs: " + ", ".join(kind.usage for kind in _LAYER_KINDS.values())


def parse_layer_spec(spec: str) -> LayerSpec:
    """Parse ``"vq"``, ``"linear:dpfp:2"``, ``"local:256"``, ... against the registry."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a layer attention spec must be a non-empty string; got {spec!r}. {layer_spec_help()}")
    name, _, option = spec.strip().partition(":")
    kind = _LAYER_KINDS.get(name)
    if kind is None or not kind.check_option(option or None):
        raise ValueError(f"unknown layer attention spec {spec!r}. {layer_spec_help()}")
    return LayerSpec(name, option or None)


def layer_kind(spec: LayerSpec | str) -> LayerKind:
    """The registered kind of a parsed spec (or of a kind name)."""
    return _LAYER_KINDS[spec.kind if isinstance(spec, LayerSpec) else spec]


# -- the layers ------------------------------------------------------------------------------


class SwiGLU(nn.Module):
    """``W_down(SiLU(W_gate x) * W_up x)``, no biases."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class PreNormBlock(nn.Module):
    """``x + mixer(norm(x))`` then ``x + SwiGLU(norm(x))``; ``mixer`` is any ``linattn.nn`` layer."""

    def __init__(self, config: LMConfig, mixer: nn.Module):
        super().__init__()
        self.mixer_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mixer = mixer
        self.ffn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.ffn = SwiGLU(config.d_model, config.ffn_width)

    def forward(self, x: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any, list[dict]]:
        mixed, state, aux = self.mixer(self.mixer_norm(x), state)
        x = x + mixed
        return x + self.ffn(self.ffn_norm(x)), state, [aux]


class GAUPair(nn.Module):
    """Transformer-VQ's layer: two gated attention units, each ``x + GAU(x)`` (pre-norm inside),
    no feed-forward. The state is a pair of unit states."""

    def __init__(self, config: LMConfig, attention: str, scale: str = "default", rerope: int | None = None):
        super().__init__()
        gau_options = config.gau_options()
        if rerope is not None:  # no sinusoids to drop out (a set sinusoid_dropout is refused by the config check)
            gau_options.update(sinusoid_dropout=0.0)
        options = dict(scale=scale, rerope=rerope, rotary_base=config.rotary_base,
            d_k=config.gau_d_k, d_v=config.gau_d_v, codebook_size=config.codebook_size,
            block_size=config.block_size, attention=attention,
            temperature=config.soft_vq_temperature, ema_decay=config.ema_decay,
            commitment_weight=config.commitment_weight, kmeans_init=config.kmeans_init,
            dead_code_threshold=config.dead_code_threshold, fsq_levels=config.fsq_levels, **gau_options,
        )
        self.units = nn.ModuleList([GAU(config.d_model, **options) for _ in range(2)])

    def forward(self, x: torch.Tensor, state: tuple | None = None) -> tuple[torch.Tensor, tuple, list[dict]]:
        states, auxes = [], []
        for unit, unit_state in zip(self.units, state or (None, None)):
            y, unit_state, aux = unit(x, unit_state)
            x = x + y
            states.append(unit_state)
            auxes.append(aux)
        return x, tuple(states), auxes


# -- the built-in kinds ----------------------------------------------------------------------


def _heads(config: LMConfig) -> dict:
    return dict(n_kv_heads=config.n_kv_heads, head_dim=config.head_dim)


def _attention_block(config: LMConfig, **options) -> PreNormBlock:
    mixer = Attention(config.d_model, config.n_heads, chunk_size=config.chunk_size, rotary_base=config.rotary_base,
                      rotary_scaling=config.rotary_scaling, qkv_bias=config.qkv_bias, out_bias=config.out_bias,
                      **_heads(config), **options)
    return PreNormBlock(config, mixer)


def _linear_block(config: LMConfig, spec: LayerSpec, index: int) -> PreNormBlock:
    """Kernel attention with the spec's feature map; the learned Hedgehog map reads rotated q and k
    (as LoLCATs does: it is fitted to a rotary softmax layer's attention), the fixed maps none."""
    return _attention_block(config, mechanism="linear", feature_map=spec.option,
                            rotary=True if spec.option == HEDGEHOG else None)


def _vq_heads_block(config: LMConfig, spec: LayerSpec, index: int) -> PreNormBlock:
    """A ``vq-attn`` layer: multi-head VQ attention (ReRoPE or the windowed bias) + SwiGLU."""
    gau = config.gau_options()
    positions = "bias" if spec.option == "bias" else "rerope"
    mixer = MultiHeadVQAttention(
        config.d_model, config.n_heads, codebook_size=config.codebook_size, block_size=config.block_size,
        positions=positions, rerope=_vq_rerope(spec.option, config) if positions == "rerope" else None,
        rotary_base=config.rotary_base, qkv_bias=config.qkv_bias, out_bias=config.out_bias,
        ema_decay=config.ema_decay, commitment_weight=config.commitment_weight, kmeans_init=config.kmeans_init,
        dead_code_threshold=config.dead_code_threshold, grad_scope=gau["grad_scope"],
        commitment_reduction=gau["commitment_reduction"], **_heads(config))
    return PreNormBlock(config, mixer)


def _check_vq_heads_config(config: LMConfig, spec: LayerSpec) -> None:
    """A ``vq-attn`` layer's head dimension (even, for ReRoPE), its ReRoPE window (at most the block)
    and, with ReRoPE, no ``rotary_scaling`` (ReRoPE turns at ``rotary_base``'s frequencies)."""
    if spec.option == "bias":
        return
    _check_rotary_head_dim(config, spec)
    window = _vq_rerope(spec.option, config)
    if window > config.block_size:
        raise ValueError(f"LMConfig: layer {str(spec)!r} has a ReRoPE window of {window} > block_size="
                         f"{config.block_size}: Transformer-VQ's cache keeps no distances, so the window must fit "
                         "in a block; use rerope=W with W <= block_size (or 'rerope' for W = block_size)")
    if config.rotary_scaling is not None:
        raise ValueError(f"LMConfig.rotary_scaling={config.rotary_scaling}: layer {str(spec)!r} applies ReRoPE at "
                         f"rotary_base's frequencies, which the scaling would change; use 'vq-attn:bias' or a model "
                         "without rotary_scaling")


def _delta_block(config: LMConfig, spec: LayerSpec, index: int) -> PreNormBlock:
    feature_map = spec.option or "identity"
    normalize = "l2" if feature_map == "identity" else "sum"
    mixer = DeltaNet(config.d_model, config.n_heads, feature_map=feature_map, normalize=normalize,
                     short_conv=config.delta_short_conv, chunk_size=config.chunk_size, **_heads(config))
    return PreNormBlock(config, mixer)


def _retnet_block(config: LMConfig, spec: LayerSpec, index: int) -> PreNormBlock:
    mixer = MultiScaleRetention(config.d_model, config.n_heads, rotary_base=config.rotary_base,
                                chunk_size=config.chunk_size, **_heads(config))
    return PreNormBlock(config, mixer)


def _gla_block(config: LMConfig, spec: LayerSpec, index: int) -> PreNormBlock:
    return PreNormBlock(config, GatedLinearAttention(config.d_model, config.n_heads, chunk_size=config.chunk_size,
                                                     **_heads(config)))


def _gated_delta_block(config: LMConfig, spec: LayerSpec, index: int) -> PreNormBlock:
    mixer = GatedDeltaNet(config.d_model, config.n_heads, short_conv=config.delta_short_conv,
                          chunk_size=config.chunk_size, **_heads(config))
    return PreNormBlock(config, mixer)


def _softmax_block(config: LMConfig, spec: LayerSpec, index: int) -> PreNormBlock:
    _, flags, rerope = _exact_options(spec.option, ("nope", "entropy"), rerope=True)
    return _attention_block(config, mechanism="softmax", rotary="nope" not in flags, scale=_scale(config, flags),
                            rerope=rerope)


def _local_block(config: LMConfig, spec: LayerSpec, index: int) -> PreNormBlock:
    window, flags, rerope = _exact_options(spec.option, ("nope", "entropy"), window=True, rerope=True)
    return _attention_block(config, mechanism="local", window=window or config.local_window,
                            rotary="nope" not in flags, scale=_scale(config, flags), rerope=rerope)


def _gau_softmax_pair(config: LMConfig, spec: LayerSpec, index: int) -> GAUPair:
    _, flags, _ = _exact_options(spec.option, ("entropy",))
    return GAUPair(config, "softmax", scale=_scale(config, flags))


def _vq_pair(attention: str) -> Callable[[LMConfig, LayerSpec, int], GAUPair]:
    """The builder of a VQ kind's GAU pair (``attention``: ``"vq"`` or ``"fsq"``)."""
    return lambda config, spec, index: GAUPair(config, attention, rerope=_vq_rerope(spec.option, config))


def _check_vq_config(config: LMConfig, spec: LayerSpec) -> None:
    """A VQ kind's ReRoPE window fits the block (the cache keeps no distances) and has no
    sinusoids to drop out."""
    rerope = _vq_rerope(spec.option, config)
    if rerope is None:
        return
    if rerope > config.block_size:
        raise ValueError(f"LMConfig: layer {str(spec)!r} has a ReRoPE window of {rerope} > block_size="
                         f"{config.block_size}: Transformer-VQ's cache keeps no distances, so the window must fit "
                         "in a block; use rerope=W with W <= block_size (or 'rerope' for W = block_size)")
    if config.sinusoid_dropout:
        raise ValueError(f"LMConfig: layer {str(spec)!r} replaces the GAU's sinusoids by ReRoPE, so "
                         f"sinusoid_dropout={config.sinusoid_dropout} has nothing to drop; leave it unset or 0")
    if config.gau_d_k % 2:
        raise ValueError(f"LMConfig: layer {str(spec)!r} uses rotary positions, which need an even gau_d_k; got "
                         f"gau_d_k={config.gau_d_k}")


def _favor_block(config: LMConfig, spec: LayerSpec, index: int) -> PreNormBlock:
    features = FAVOR(int(spec.option or config.favor_features), seed=config.feature_seed + index)
    return _attention_block(config, mechanism="linear", feature_map=features)


def _check_rotary_head_dim(config: LMConfig, spec: LayerSpec) -> None:
    head_dim = config.head_dim or config.d_model // config.n_heads
    if head_dim % 2:
        raise ValueError(f"LMConfig: layer {str(spec)!r} uses rotary positions, which need an even head dimension; "
                         f"got head_dim={head_dim} (d_model={config.d_model}, n_heads={config.n_heads}): "
                         "set head_dim or change n_heads")


def _check_linear_config(config: LMConfig, spec: LayerSpec) -> None:
    """Hedgehog's rotary q and k need an even head dimension."""
    if spec.option == HEDGEHOG:
        _check_rotary_head_dim(config, spec)


def _check_position_head_dim(config: LMConfig, spec: LayerSpec) -> None:
    """Rotary positions need an even head dimension; a ``nope`` layer has none."""
    if "nope" not in (spec.option or "").split(":"):
        _check_rotary_head_dim(config, spec)


def _unused_settings(*names: str, then: Callable[[LMConfig, LayerSpec], None] = lambda config, spec: None
                     ) -> Callable[[LMConfig, LayerSpec], None]:
    """A ``check_config`` that refuses each ``LMConfig`` field of ``names`` set away from its
    default (the layer has no such bias, norm or rotary frequencies to honour it), then runs ``then``."""

    def check(config: LMConfig, spec: LayerSpec) -> None:
        defaults = type(config).__dataclass_fields__
        for name in names:
            if getattr(config, name) != defaults[name].default:
                raise ValueError(f"LMConfig.{name}={getattr(config, name)!r}: layer {str(spec)!r} does not use it "
                                 f"(it applies to {_USED_BY[name]}); leave it at {defaults[name].default!r}")
        then(config, spec)

    return check


_USED_BY = {"qkv_bias": "the attention kinds softmax, local, linear, favor and vq-attn",
            "out_bias": "the attention kinds softmax, local, linear, favor and vq-attn",
            "norm_eps": "the pre-norm blocks, every kind but the GAU pairs",
            "rotary_scaling": "the rotary positions of softmax and local"}
_PROJECTION_BIASES = ("qkv_bias", "out_bias")
_GAU_UNUSED = _unused_settings(*_PROJECTION_BIASES, "norm_eps")
_VQ_CHECKS = _unused_settings(*_PROJECTION_BIASES, "norm_eps", then=_check_vq_config)


def _truncated_cache(state: Any, config: LMConfig) -> Any:
    return truncate_cache(state, config.softmax_memory)


def _truncated_unit_caches(state: tuple, config: LMConfig) -> tuple:
    return tuple(truncate_cache(unit, config.softmax_memory) for unit in state)


_BLOCK_OUTPUTS = ("mixer.o_proj", "ffn.w_down")
_PAIR_OUTPUTS = ("units.0.w_o", "units.1.w_o")

for _kind in (
    LayerKind("vq", _vq_pair("vq"), "'vq' (Transformer-VQ GAU pair; 'vq:rerope' / 'vq:rerope=W': ReRoPE)",
              check_option=_vq_option, output_projections=_PAIR_OUTPUTS, check_config=_VQ_CHECKS, uses_heads=False),
    LayerKind("vq-fsq", _vq_pair("fsq"), "'vq-fsq' (GAU pair, keys on the FSQ grid of fsq_levels; ':rerope' as vq)",
              check_option=_vq_option, output_projections=_PAIR_OUTPUTS, check_config=_VQ_CHECKS, uses_heads=False),
    LayerKind("soft-vq", lambda config, spec, index: GAUPair(config, "soft-vq"), "'soft-vq'",
              output_projections=_PAIR_OUTPUTS, check_config=_GAU_UNUSED, uses_heads=False),
    LayerKind("gau-softmax", _gau_softmax_pair, "'gau-softmax' / 'gau-softmax:entropy' (the GAU's quadratic twin)",
              check_option=_gau_softmax_option, output_projections=_PAIR_OUTPUTS,
              carry=_truncated_unit_caches, growing_cache=True, check_config=_GAU_UNUSED,
              uses_heads=False),
    LayerKind("softmax", _softmax_block,
              "'softmax' (flags ':nope', ':entropy', ':rerope=W', e.g. 'softmax:nope:entropy', 'softmax:rerope=64')",
              check_option=_softmax_option, output_projections=_BLOCK_OUTPUTS, carry=_truncated_cache,
              growing_cache=True, check_config=_check_position_head_dim),
    LayerKind("linear", _linear_block,
              "'linear:elu' / 'linear:relu' / 'linear:dpfp' / 'linear:dpfp:NU' / 'linear:taylor' / "
              "'linear:hedgehog' (a learned map, rotary q and k)",
              check_option=_linear_option, output_projections=_BLOCK_OUTPUTS, check_config=_check_linear_config),
    LayerKind("vq-attn", _vq_heads_block,
              "'vq-attn:rerope' / 'vq-attn:rerope=W' / 'vq-attn:bias' (multi-head attention over VQ keys, "
              "ReRoPE or the windowed bias, + SwiGLU: what linattn convert makes of a softmax layer)",
              check_option=_vq_heads_option, output_projections=_BLOCK_OUTPUTS,
              check_config=_check_vq_heads_config),
    LayerKind("favor", _favor_block, "'favor' / 'favor:M'", check_option=_optional_count,
              output_projections=_BLOCK_OUTPUTS),
    LayerKind("delta", _delta_block, "'delta' / 'delta:dpfp' / 'delta:elu'", check_option=_delta_option,
              output_projections=_BLOCK_OUTPUTS, check_config=_unused_settings(*_PROJECTION_BIASES)),
    LayerKind("retnet", _retnet_block, "'retnet' (multi-scale retention: fixed decay per head, rotary positions)",
              output_projections=_BLOCK_OUTPUTS,
              check_config=_unused_settings(*_PROJECTION_BIASES, "rotary_scaling", then=_check_rotary_head_dim)),
    LayerKind("gla", _gla_block, "'gla' (gated linear attention: data-dependent decay per key channel)",
              output_projections=_BLOCK_OUTPUTS, check_config=_unused_settings(*_PROJECTION_BIASES)),
    LayerKind("gated-delta", _gated_delta_block, "'gated-delta' (Gated DeltaNet: delta rule with a decay per head)",
              output_projections=_BLOCK_OUTPUTS, check_config=_unused_settings(*_PROJECTION_BIASES)),
    LayerKind("local", _local_block,
              "'local' / 'local:WINDOW' (flags ':nope', ':entropy', ':rerope=W', e.g. 'local:128:entropy')",
              check_option=_local_option, output_projections=_BLOCK_OUTPUTS, check_config=_check_position_head_dim),
):
    register_layer_kind(_kind)
