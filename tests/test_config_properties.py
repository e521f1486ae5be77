"""Property-based tests (hypothesis) of the config checks: random ``LMConfig`` and
``TrainConfig`` values, each field drawn from a strategy of valid values or, for a drawn
set of fields, from one of invalid values. A config whose values are all valid builds and
trains one step with finite numbers; a config with any invalid value is refused at
construction, by a ValueError or TypeError that names one of the invalid fields. Sizes
are tiny and the examples derandomized, so every run sees the same ones."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.models import LM, LMConfig, uses_heads
from linattn.models.config import HEAD_FIELDS
from linattn.nn.quantizer import COMMITMENT_REDUCTIONS
from linattn.ops.vq import GRAD_SCOPES
from linattn.train import TrainConfig
from linattn.train.optim import parameter_groups

torch.set_num_threads(1)

PROPERTY = settings(max_examples=150, deadline=None, derandomize=True)
NAN, INF = math.nan, math.inf


def floats(low: float, high: float) -> st.SearchStrategy:
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


def bad(*values) -> st.SearchStrategy:
    return st.sampled_from(values)


def optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | strategy


BAD_BOOLS = bad(0, 1, "true", None)
BAD_COUNTS = bad(0, -1, 1.5, True, "4", None)

# every layer spec form (each option of each kind); a pattern is drawn from these
SPECS = ["vq", "vq-fsq", "soft-vq", "gau-softmax", "gau-softmax:entropy", "softmax", "softmax:nope",
         "softmax:entropy:nope", "linear:elu", "linear:relu", "linear:identity", "linear:exp", "linear:dpfp",
         "linear:dpfp:2", "linear:taylor", "favor", "favor:4", "delta", "delta:elu", "delta:dpfp:2", "delta:taylor",
         "retnet", "gla", "gated-delta", "local", "local:3", "local:2:nope:entropy", "vq-attn:rerope", "vq-attn:bias",
         "linear:hedgehog"]
BAD_ATTENTION = bad("", "bogus", "local:0", "local:²", "delta:elu:3", "delta:dpfp:x", "linear", "linear:dpfp:0",
                    "favor:0", "softmax:nope:nope", "vq:2", "retnet:nope", "gla:16", "gated-delta:4", "vq,,vq", 3,
                    "vq-attn", "vq-attn:rope", "vq-attn:rerope=0", "delta:hedgehog",
                    None, ["vq", 3], {"vq"})

# field -> (valid values, invalid values); n_layers and attention are drawn together below
LM_FIELDS = {
    "vocab_size": (st.integers(2, 64), BAD_COUNTS),
    # multiples of 4 over at most 2 heads: an even head dimension, as rotary positions need
    "d_model": (st.sampled_from([8, 12, 16, 24, 32]), bad(0, -8, 16.0, False, "16")),
    "n_heads": (st.integers(1, 2), bad(0, -1, 1.5, True, "4")),  # None (4 where a layer has heads) is valid too
    "n_kv_heads": (optional(st.just(1)), bad(0, -1, 3, 1.0, True)),  # 3 divides neither 1 nor 2 heads
    "head_dim": (optional(st.sampled_from([2, 4, 8])), bad(0, -2, 4.0, "4")),
    "ffn_hidden": (optional(st.integers(1, 64)), bad(0, -1, 3.5)),
    "rotary_base": (floats(1.01, 1e6), bad(1, 1.0, 0.5, 0, -10.0, NAN, INF, "10000", None)),
    # the import's settings: valid values other than the defaults are refused by some kinds (GAU
    # pairs have no projection biases), so only their defaults are drawn as valid
    "rotary_scaling": (st.none(), bad({"type": "yarn", "factor": 2.0}, {"type": "linear", "factor": 0.0},
                                      {"type": "linear"}, "linear", 2.0)),
    "qkv_bias": (st.just(False), BAD_BOOLS),
    "out_bias": (st.just(False), BAD_BOOLS),
    "norm_eps": (st.none(), bad(0, 0.0, -1e-6, NAN, INF, "1e-6")),
    "local_window": (st.integers(1, 20), BAD_COUNTS),
    "chunk_size": (st.integers(1, 8), BAD_COUNTS),
    "favor_features": (st.integers(1, 16), BAD_COUNTS),
    "feature_seed": (st.integers(0, 2**20), bad(-1, 0.5, None, "0", 2**63)),
    "delta_short_conv": (optional(st.integers(1, 4)), bad(0, -1, 2.5, "4")),
    "softmax_memory": (st.integers(0, 8), bad(-1, 1.5, None)),
    "attention_scale": (st.sampled_from(["default", "entropy"]), bad("big", None, 1)),
    "gau_d_k": (st.integers(2, 16), BAD_COUNTS),
    "gau_d_v": (optional(st.integers(1, 16)), bad(0, -4, 8.0)),
    "codebook_size": (st.integers(1, 16), BAD_COUNTS),
    "block_size": (st.integers(1, 8), BAD_COUNTS),
    "commitment_weight": (floats(0, 1), bad(-0.1, NAN, INF, "0", None)),
    "ema_decay": (floats(0, 0.999), bad(1, 1.0, 1.5, -0.01, NAN, INF, "0.99", None)),
    "kmeans_init": (st.booleans(), BAD_BOOLS),
    "dead_code_threshold": (floats(0, 2), bad(-1, -1e-9, NAN, INF, None)),
    "soft_vq_temperature": (floats(0.05, 10), bad(0, 0.0, -1.0, NAN, INF, None)),
    "fsq_levels": (st.lists(st.integers(2, 5), min_size=1, max_size=3).map(tuple),
                   bad((), (1,), (2.5, 3), "855", None, (True, 3))),
    "gau_variant": (st.sampled_from(["linattn", "paper"]), bad("other", None)),
    "sinusoid_dropout": (optional(floats(0, 0.9)), bad(1.0, -0.1, NAN, INF, "0.1")),
    "sinusoid_wavelength": (optional(floats(1.5, 1e6)), bad(0, 0.0, -1e4, NAN, INF, "1e4", True)),
    "vq_grad_scope": (optional(st.sampled_from(GRAD_SCOPES)), bad("all", 0)),
    "commitment_reduction": (optional(st.sampled_from(COMMITMENT_REDUCTIONS)), bad("sum", 0)),
    "tie_embeddings": (st.booleans(), BAD_BOOLS),
    "init_std": (floats(1e-3, 0.3), bad(0, 0.0, -0.02, NAN, INF, "0.02", None)),
    "extra": (st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=2),
              bad([], None, "note", {1: 2}, {"when": object()})),
}

TRAIN_FIELDS = {
    "data": (st.sampled_from(["shakespeare", "corpus.txt", "data/shards", "enwik8.zip", " spaced name "]),
             bad("", " ", "\n\t", None, 5)),
    "out": (st.sampled_from(["runs/latest", "r", "/tmp/run"]), bad("", "  ", None, 0)),
    "cache_dir": (optional(st.sampled_from(["cache", "~/.cache/linattn"])), bad("", " ", 3)),
    "steps": (st.integers(1, 10**6), BAD_COUNTS),
    "decay_steps": (optional(st.integers(1, 10**6)), bad(0, -1, 1.5)),
    "batch_size": (st.sampled_from([1, 2, 4, 8]), BAD_COUNTS),
    "grad_accum_steps": (st.just(1), BAD_COUNTS),  # 1 divides any batch size
    "activation_checkpointing": (st.booleans(), BAD_BOOLS),
    "parallel": (optional(st.sampled_from(["ddp", "fsdp"])), bad("zero", "", 5)),
    "context": (st.integers(1, 4096), BAD_COUNTS),
    "lr": (floats(1e-6, 1.0), bad(0, 0.0, -1e-3, NAN, INF, "2e-3", None)),
    "min_lr_ratio": (floats(0, 1), bad(-0.1, 1.1, NAN, INF, None)),
    "warmup_steps": (st.integers(0, 1000), bad(-1, 1.5, None)),
    "weight_decay": (floats(0, 1), bad(-0.1, NAN, INF, "0.1")),
    "beta1": (floats(0, 0.999), bad(1, 1.0, -0.1, NAN, INF)),
    "beta2": (floats(0, 0.999), bad(1, 1.0, -0.1, NAN, INF)),
    "grad_clip": (floats(1e-3, 100), bad(0, -1.0, NAN, INF, None)),
    "bf16": (st.booleans(), BAD_BOOLS),
    "compile": (st.booleans(), BAD_BOOLS),
    "carry_state": (st.booleans(), BAD_BOOLS),
    "carry_windows": (st.integers(0, 16), bad(-1, 1.5, None)),
    "max_skipped_steps": (st.integers(0, 16), bad(-1, 0.5, True)),
    "eval_every": (st.integers(0, 1000), bad(-1, 2.5)),
    "eval_tokens": (optional(st.integers(1, 10**6)), bad(0, -1, 1.5)),
    "eval_batch_size": (st.integers(1, 8), BAD_COUNTS),
    "log_every": (st.integers(1, 100), BAD_COUNTS),
    "checkpoint_every": (st.integers(0, 1000), bad(-1, 1.5)),
    "keep_checkpoints": (st.integers(1, 5), BAD_COUNTS),
    "seed": (st.integers(0, 2**31), bad(-1, 0.5, None)),
    "device": (st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:3"]), bad("tpu", "cuda:x", "cpu:0", "", None)),
    "threads": (optional(st.integers(1, 8)), bad(0, -1, 1.5)),
    "tensorboard": (st.booleans(), BAD_BOOLS),
    "lora_rank": (optional(st.integers(1, 64)), bad(0, -1, 1.5, "4")),
    "dist_timeout": (floats(0.1, 3600), bad(0, -1.0, NAN, INF, None, "120")),
    "collective_timeout": (optional(floats(1, 3600)), bad(0, -5.0, NAN, INF, "60")),
}


@st.composite
def broken_fields(draw, names: list[str]) -> frozenset:
    """No field (in about half the examples) or one to three fields to draw invalid values for."""
    if draw(st.sampled_from([True, True, False]), label="all valid"):
        return frozenset()
    return draw(st.frozensets(st.sampled_from(names), min_size=1, max_size=3))


@st.composite
def lm_values(draw) -> tuple[dict, frozenset]:
    broken = draw(broken_fields([*LM_FIELDS, "n_layers", "attention"]))
    values = {name: draw(invalid if name in broken else valid, label=name)
              for name, (valid, invalid) in LM_FIELDS.items()}
    values["n_layers"] = draw(bad(0, -1, 2.0, True) if "n_layers" in broken else st.integers(1, 2), label="n_layers")
    if "attention" in broken:
        values["attention"] = draw(BAD_ATTENTION, label="attention")
    else:  # a pattern no longer than the layers (or one spec, when n_layers itself is invalid)
        longest = values["n_layers"] if "n_layers" not in broken else 1
        pattern = draw(st.lists(st.sampled_from(SPECS), min_size=1, max_size=longest), label="attention")
        values["attention"] = draw(st.sampled_from([",".join(pattern), pattern]), label="attention form")
        if not uses_heads(pattern):  # GAU pairs only: no heads, so the valid head settings are unset
            values.update({name: None for name in HEAD_FIELDS if name not in broken})
    return values, broken


@st.composite
def train_values(draw) -> tuple[dict, frozenset]:
    broken = draw(broken_fields(list(TRAIN_FIELDS)))
    values = {name: draw(invalid if name in broken else valid, label=name)
              for name, (valid, invalid) in TRAIN_FIELDS.items()}
    return values, broken


def _names_a_broken_field(message: str, prefix: str, broken: frozenset) -> bool:
    return any(f"{prefix}.{name}" in message or (name == "attention" and "layer attention spec" in message)
               for name in broken)


def _training_step(model: LM, ids: torch.Tensor, optimizer: torch.optim.Optimizer, grad_clip: float) -> torch.Tensor:
    """Forward, next-token cross-entropy + the commitment loss, backward, clip, step, codebook update."""
    logits, _, aux = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) + aux["commit_loss"]
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    model.update_codebooks()
    return loss.detach()


@PROPERTY
@given(drawn=lm_values(), batch=st.integers(1, 2), length=st.integers(2, 16), seed=st.integers(0, 2**16))
def test_lm_config_builds_and_trains_exactly_when_every_value_is_valid(drawn, batch, length, seed):
    values, broken = drawn
    if broken:
        with pytest.raises((ValueError, TypeError)) as info:
            LMConfig(**values)
        assert _names_a_broken_field(str(info.value), "LMConfig", broken), (sorted(broken), str(info.value))
        return
    config = LMConfig(**values)
    torch.manual_seed(seed)
    model = LM(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = _training_step(model, ids, optimizer, grad_clip=1.0)
    assert torch.isfinite(loss), values
    assert all(torch.isfinite(p).all() for p in model.parameters()), values
    assert all(torch.isfinite(q.codebook).all() for q in model.quantizers()), values


@pytest.fixture(scope="module")
def tiny_lm_config() -> LMConfig:
    return LMConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, attention="vq,local:4", gau_d_k=8,
                    codebook_size=8, block_size=4, chunk_size=4, ffn_hidden=32)


@PROPERTY
@given(drawn=train_values(), seed=st.integers(0, 2**16))
def test_train_config_builds_and_steps_exactly_when_every_value_is_valid(tiny_lm_config, drawn, seed):
    """A valid config's optimizer settings (AdamW with the trainer's parameter groups, its
    betas, weight decay and clipping) take one finite step of a tiny model."""
    values, broken = drawn
    if broken:
        with pytest.raises((ValueError, TypeError)) as info:
            TrainConfig(**values)
        assert _names_a_broken_field(str(info.value), "train", broken), (sorted(broken), str(info.value))
        return
    config = TrainConfig(**values)
    assert TrainConfig.from_dict(config.to_dict()) == config
    torch.manual_seed(seed)
    model = LM(tiny_lm_config).train()
    optimizer = torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.lr,
                                  betas=(config.beta1, config.beta2))
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(seed))
    loss = _training_step(model, ids, optimizer, config.grad_clip)
    assert torch.isfinite(loss), values
    assert all(torch.isfinite(p).all() for p in model.parameters()), values
