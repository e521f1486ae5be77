"""``LM.from_hf``: tiny random Llama, Mistral and Qwen2 models, built with transformers' own
classes and saved with ``save_pretrained``, give the logits transformers gives (max abs
difference <= 1e-4 x the largest abs logit, float32) and the same greedy tokens; every field
the import cannot reproduce is refused by name. Every parameter (norm weights and biases
included, which transformers initialises to ones and zeros) is drawn at random, so a wrong
norm epsilon, bias or rotary layout shows in the logits."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from _helpers import english_like, head_fields
from linattn import LM, LMConfig
from linattn.data import train_bpe

torch.set_num_threads(1)

TOLERANCE = 1e-4
FAMILIES = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=0.05, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def tiny_tokenizer():
    """A byte-level BPE of 300 tokens (a valid tokenizer.json for the tiny models)."""
    return train_bpe([english_like(20000, seed=5)], 300)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def hf_folder(folder: Path, tokenizer, family: str = "llama", *, seed: int = 0, dtype=torch.float32,
              save: dict | None = None, **fields) -> Path:
    """A random ``family`` model of ``TINY`` sizes (changed by ``fields``) saved with
    ``save_pretrained`` into ``folder``, with ``tokenizer`` as its tokenizer.json."""
    config = FAMILIES[family](**{**TINY, **fields})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
        model.tie_weights()
    model.to(dtype).save_pretrained(folder, **(save or {}))
    tokenizer.save(folder / "tokenizer.json")
    return folder


def reference(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def ids(length: int = 24, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def relative_gap(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Max abs difference over the largest abs reference logit."""
    return float((ours - theirs).abs().max() / theirs.abs().max())


def assert_same_logits(model: LM, folder: Path, tokens: torch.Tensor | None = None) -> None:
    tokens = ids() if tokens is None else tokens
    with torch.no_grad():
        theirs = reference(folder)(tokens).logits
        ours, _, _ = model(tokens)
    assert ours.dtype == theirs.dtype == torch.float32
    assert relative_gap(ours, theirs) <= TOLERANCE


# -- logits ------------------------------------------------------------------------------------

CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-multi-head-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama-head-dim": ("llama", {"head_dim": 16}),
    "llama-rope-llama3": ("llama", {"rope_parameters": LLAMA3}),
    "llama-rope-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 300.0}}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 6}),
    "mistral-full": ("mistral", {"sliding_window": None, "num_key_value_heads": 1}),
    "qwen2-biases-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-biases-untied": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 50.0}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(tmp_path, tokenizer, case):
    family, fields = CASES[case]
    folder = hf_folder(tmp_path / case, tokenizer, family, **fields)
    model = LM.from_hf(folder)
    assert not model.training
    assert_same_logits(model, folder)


def test_what_each_case_exercises(tmp_path, tokenizer):
    """The cases above can fail: the head is tied or not as asked, biases and windows are where
    the checkpoint has them, and llama3 keeps, blends and divides frequencies (all three bands)."""
    from linattn.ops.common.rotary import rotary_frequencies

    built = {case: LM.from_hf(hf_folder(tmp_path / case, tokenizer, family, **fields))
             for case, (family, fields) in CASES.items()}
    assert built["llama-gqa-untied"].head is not None and built["llama-multi-head-tied"].head is None
    assert built["qwen2-biases-tied"].head is None
    qwen = built["qwen2-biases-untied"].layers[0].mixer
    assert qwen.q_proj.bias.abs().min() > 0 and qwen.o_proj.bias is None
    llama = built["llama-attention-bias"].layers[0].mixer
    assert llama.q_proj.bias is not None and llama.o_proj.bias is not None
    assert built["llama-gqa-untied"].layers[0].mixer.q_proj.bias is None
    assert [str(spec) for spec in built["mistral-sliding-window"].specs] == ["local:6", "local:6"]
    assert ids().shape[1] > 6  # the window cuts off keys
    assert [str(spec) for spec in built["mistral-full"].specs] == ["softmax", "softmax"]
    plain = rotary_frequencies(8, 500.0, dtype=torch.float64)
    scaled = rotary_frequencies(8, 500.0, built["llama-rope-llama3"].config.rotary_scaling, dtype=torch.float64)
    wavelengths = 2 * math.pi / plain
    assert wavelengths.min() < 64 / 4 and wavelengths.max() > 64 / 1
    assert ((wavelengths > 16) & (wavelengths < 64)).any()
    assert torch.equal(scaled[wavelengths < 16], plain[wavelengths < 16])
    assert torch.allclose(scaled[wavelengths > 64], plain[wavelengths > 64] / 8)


def test_llama3_frequencies_follow_the_written_out_rule():
    """Llama 3.1's rule from transformers' _compute_llama3_parameters, written out per frequency."""
    from linattn.ops.common.rotary import rotary_frequencies

    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    ours = rotary_frequencies(16, 500.0, scaling, dtype=torch.float64)
    for m, value in enumerate(ours.tolist()):
        f = 500.0 ** (-2 * m / 16)
        wavelength = 2 * math.pi / f
        if wavelength < 64 / 4:
            expected = f
        elif wavelength > 64 / 1:
            expected = f / 8
        else:
            blend = (64 / wavelength - 1) / (4 - 1)
            expected = (1 - blend) * f / 8 + blend * f
        assert value == pytest.approx(expected, rel=1e-12)


def test_without_the_rotary_permutation_the_logits_differ(tmp_path, tokenizer, monkeypatch):
    """The mutant: q/k rows left in rotate-half order (the permutation replaced by the identity)."""
    from linattn.models import pretrained_weights

    folder = hf_folder(tmp_path / "llama", tokenizer)
    monkeypatch.setattr(pretrained_weights, "rotate_half_permutation", lambda head_dim: torch.arange(head_dim))
    unpermuted = LM.from_hf(folder)
    with torch.no_grad():
        gap = relative_gap(unpermuted(ids())[0], reference(folder)(ids()).logits)
    assert gap > 100 * TOLERANCE


@pytest.mark.parametrize("rope, base, factor", [
    ({"rope_theta": 70.0, "rope_scaling": {"type": "linear", "factor": 3.0}}, 70.0, 3.0),
    ({"rope_theta": 70.0, "rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 300.0}}, 300.0, 3.0),
    ({"rope_theta": 70.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
      "rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 300.0}}, 70.0, 2.0),
])
def test_rope_fields_are_read_as_transformers_reads_them(tmp_path, tokenizer, rope, base, factor):
    """Older config.json files put rope_theta at the top and name the scaling rope_scaling (with
    'type' or 'rope_type'); a rope dict's own rope_theta wins over the top-level one, and
    rope_scaling over rope_parameters."""
    folder = hf_folder(tmp_path / "legacy", tokenizer)
    values = json.loads((folder / "config.json").read_text())
    values.pop("rope_parameters")
    (folder / "config.json").write_text(json.dumps({**values, **rope}))
    model = LM.from_hf(folder)
    assert model.config.rotary_base == base and model.config.rotary_scaling == {"type": "linear", "factor": factor}
    assert_same_logits(model, folder)


def test_a_sharded_checkpoint(tmp_path, tokenizer):
    folder = hf_folder(tmp_path / "sharded", tokenizer, "qwen2", save={"max_shard_size": "20KB"})
    assert not (folder / "model.safetensors").exists() and len(list(folder.glob("model-*.safetensors"))) > 2
    assert_same_logits(LM.from_hf(folder), folder)


def test_a_bfloat16_checkpoint_loads_as_float32_unless_asked(tmp_path, tokenizer):
    folder = hf_folder(tmp_path / "bf16", tokenizer, dtype=torch.bfloat16)
    assert next(iter(load_file(folder / "model.safetensors").values())).dtype == torch.bfloat16
    model = LM.from_hf(folder)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert_same_logits(model, folder)
    assert {p.dtype for p in LM.from_hf(folder, dtype=torch.bfloat16).parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("case", ["llama-gqa-untied", "mistral-sliding-window", "qwen2-biases-tied"])
def test_greedy_generation_matches_token_for_token(tmp_path, tokenizer, case):
    family, fields = CASES[case]
    folder = hf_folder(tmp_path / case, tokenizer, family, **fields)
    prompt = ids(length=5, batch=1, seed=3)
    with torch.no_grad():
        theirs = reference(folder).generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                            max_new_tokens=24, min_new_tokens=24, pad_token_id=0)[0, 5:]
    ours = list(LM.from_hf(folder).generate(prompt[0], 24, temperature=0))
    assert len(theirs) == 24 and ours == theirs.tolist()


def test_transformers_is_not_needed(tmp_path, tokenizer):
    """In a process where ``import transformers`` fails, the import still reads the folder."""
    folder = hf_folder(tmp_path / "llama", tokenizer)
    script = ("import sys; sys.modules['transformers'] = None\n"
              "from linattn import LM\n"
              "model = LM.from_hf(sys.argv[1]); print(model.config.attention, model.num_parameters())")
    done = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["softmax", str(sum(p.numel() for p in reference(folder).parameters()))]


# -- refusals ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory, tokenizer) -> Path:
    return hf_folder(tmp_path_factory.mktemp("base") / "llama", tokenizer)


def edited(saved: Path, tmp_path: Path, **changes) -> Path:
    """A copy of ``saved`` whose config.json has ``changes`` (None removes a key)."""
    folder = tmp_path / "edited"
    shutil.copytree(saved, folder)
    values = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        values.pop(key, None) if value is None else values.__setitem__(key, value)
    (folder / "config.json").write_text(json.dumps(values))
    return folder


@pytest.mark.parametrize("changes, named", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                          "rope_theta": 1e4}}, "rope_parameters.rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0.0, "rope_theta": 1e4}}, "factor"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"pretraining_tp": 2}, "pretraining_tp=2"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures=['LlamaForSequenceClassification']"),
    ({"model_type": "gpt2"}, "model_type='gpt2'"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_unsupported_fields_are_refused_by_name(saved_llama, tmp_path, changes, named):
    with pytest.raises(ValueError) as info:
        LM.from_hf(edited(saved_llama, tmp_path, **changes))
    assert named in str(info.value) and "config.json" in str(info.value)


def test_qwen2_sliding_window_layers_are_refused(tmp_path, tokenizer):
    folder = hf_folder(tmp_path / "qwen", tokenizer, "qwen2")
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        LM.from_hf(edited(folder, tmp_path, use_sliding_window=True))
    shutil.rmtree(tmp_path / "edited")
    with pytest.raises(ValueError, match="layer_types"):
        LM.from_hf(edited(folder, tmp_path, layer_types=["full_attention", "sliding_attention"]))


def test_a_missing_shard_is_named(tmp_path, tokenizer):
    folder = hf_folder(tmp_path / "sharded", tokenizer, save={"max_shard_size": "20KB"})
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"names the shard.s. {shard.name}, missing from"):
        LM.from_hf(folder)


def test_tensors_that_do_not_fit_are_named(saved_llama, tmp_path):
    folder = edited(saved_llama, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(8)}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="no place for: model.layers.0.self_attn.q_norm.weight"):
        LM.from_hf(folder)
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="lacks the tensor.s. model.layers.1.mlp.up_proj.weight"):
        LM.from_hf(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        LM.from_hf(folder)


# -- the LMConfig fields of the import ---------------------------------------------------------------


def test_new_fields_default_to_the_models_saved_before_them():
    """A config saved before the import existed (no such keys) builds the model it built then:
    no biases, nn.RMSNorm's default eps, plain rotary frequencies."""
    old = LMConfig(attention="softmax", d_model=16, n_heads=2, n_layers=1).to_dict()
    for key in ("rotary_scaling", "qkv_bias", "out_bias", "norm_eps"):
        old.pop(key)
    model = LM(LMConfig.from_saved(old))
    assert model.layers[0].mixer.q_proj.bias is None and model.layers[0].mixer.o_proj.bias is None
    assert model.norm.eps is None and model.layers[0].mixer.rotary_scaling is None


@pytest.mark.parametrize("attention, field, value", [
    ("vq", "qkv_bias", True), ("delta", "out_bias", True), ("vq", "norm_eps", 1e-5),
    ("retnet", "rotary_scaling", {"type": "linear", "factor": 2.0}),
])
def test_a_layer_that_cannot_honour_a_setting_refuses_it(attention, field, value):
    with pytest.raises(ValueError, match=f"LMConfig.{field}="):
        LMConfig(attention=attention, d_model=16, n_layers=1, **head_fields(attention, n_heads=2), **{field: value})


@pytest.mark.parametrize("scaling, named", [
    ({"type": "yarn", "factor": 2.0}, "['type']"), ({"type": "linear"}, "keys"),
    ({"type": "linear", "factor": -1.0}, "['factor']"),
    ({"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 64}, "high_freq_factor"),
])
def test_bad_rotary_scaling_is_refused_by_name(scaling, named):
    with pytest.raises(ValueError) as info:
        LMConfig(attention="softmax", d_model=16, n_heads=2, n_layers=1, rotary_scaling=scaling)
    assert "LMConfig.rotary_scaling" in str(info.value) and named in str(info.value)
