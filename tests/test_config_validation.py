"""Every config value is checked when the config is built (``LMConfig``, ``TrainConfig``,
their ``from_dict``, the ``linattn`` command), token ids are never rounded from floats or
bools, and sampling settings are checked when ``LM.generate`` is called: each bad value
is a ValueError (TypeError for a wrong kind) naming the field or argument."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import linattn.hf as H
from linattn.cli import main
from linattn.models import LM, LMConfig, sample_next
from linattn.train import TrainConfig
from _helpers import english_like

torch.set_num_threads(1)

NAN, INF = math.nan, math.inf
TINY = dict(vocab_size=32, d_model=16, n_layers=1, n_heads=2, gau_d_k=8, codebook_size=8, block_size=4,
            chunk_size=4, local_window=4, favor_features=8, ffn_hidden=32)


# ----------------------------------------------------------------------------- LMConfig


@pytest.mark.parametrize("field, bad, good", [
    ("ema_decay", [1.0, 1.5, -0.1, NAN, INF, "0.9", True], [0.0, 0.5, 0.999]),
    ("soft_vq_temperature", [0, 0.0, -1.0, NAN, INF, "1"], [1e-3, 1, 50.0]),
    ("commitment_weight", [-1, -1e-9, NAN, INF, None], [0, 0.0, 1e-4, 10]),
    ("dead_code_threshold", [-1, NAN, INF, "0"], [0, 0.0, 2.5]),
    ("init_std", [-1, 0, 0.0, NAN, INF, -INF], [1e-4, 0.02, 1]),
    ("rotary_base", [0, 0.0, 1, 1.0, 0.5, -2.0, NAN, INF, "10000"], [1.5, 10000, 500000.0]),
    ("feature_seed", [-1, 1.5, None, "0", True, 2**63], [0, 7, 2**63 - 1]),
])
def test_lm_config_refuses_bad_numbers_by_name(field, bad, good):
    for value in bad:
        with pytest.raises(ValueError, match=rf"^LMConfig\.{field} must be "):
            LMConfig(**TINY, attention="softmax", **{field: value})
    for value in good:  # the values next to the refused ones build
        assert getattr(LMConfig(**TINY, attention="softmax", **{field: value}), field) == value


def test_rotary_base_message_says_why():
    with pytest.raises(ValueError, match=r"do not fall with the dimension.*base of 0 gives inf and NaN"):
        LMConfig(**TINY, attention="softmax", rotary_base=0)


@pytest.mark.parametrize("field, value", [
    ("kmeans_init", 1), ("kmeans_init", "false"), ("kmeans_init", None), ("tie_embeddings", 0),
    ("tie_embeddings", "true"), ("tie_embeddings", np.bool_(True)),
])
def test_lm_config_bools_must_be_bools(field, value):
    with pytest.raises(TypeError, match=rf"^LMConfig\.{field} must be a bool, got "):
        LMConfig(**TINY, **{field: value})


@pytest.mark.parametrize("value, match", [
    ([1], r"must be a dict, got list"), (None, r"must be a dict, got NoneType"), ("note", r"must be a dict"),
    ({1: "a"}, r"must have str keys"), ({"when": object()}, r"must hold JSON values"),
    ({"tensor": torch.zeros(1)}, r"must hold JSON values"),
])
def test_lm_config_extra_is_a_json_dict(value, match):
    with pytest.raises(TypeError, match=rf"^LMConfig\.extra {match}"):
        LMConfig(**TINY, extra=value)
    assert LMConfig(**TINY, attention="softmax", extra={"note": "x", "n": [1, 2.5, None]}).extra["n"] == [1, 2.5, None]


@pytest.mark.parametrize("value", [3, None, ["vq", 3], ("vq", None), {"vq"}, b"vq"])
def test_lm_config_attention_is_a_str_or_a_list_of_str(value):
    with pytest.raises(TypeError, match=r"^LMConfig\.attention must be a str or a list of str, got "):
        LMConfig(**TINY, attention=value)


@pytest.mark.parametrize("bad, good", [
    ("delta:elu:3", "delta:elu"), ("delta:dpfp:x", "delta:dpfp:2"), ("delta:dpfp:0", "delta:dpfp:1"),
    ("delta:identity:2", "delta:identity"), ("local:²", "local:2"), ("local:²:nope", "local:3:nope"),
    ("favor:²", "favor:4"), ("linear:dpfp:²", "linear:dpfp:3"),
])
def test_layer_options_that_would_fail_when_built_are_refused_at_construction(bad, good):
    with pytest.raises(ValueError, match=rf"^unknown layer attention spec '{bad}'"):
        LMConfig(**TINY, attention=bad)
    LM(LMConfig(**TINY, attention=good))  # the same form with a valid option builds


def test_lm_config_from_dict_checks_the_same():
    with pytest.raises(ValueError, match=r"^LMConfig\.rotary_base must be "):
        LMConfig.from_dict({**TINY, "attention": "softmax", "rotary_base": 0})
    with pytest.raises(TypeError, match=r"^LMConfig\.kmeans_init must be a bool"):
        LMConfig.from_dict({**TINY, "kmeans_init": 0})
    with pytest.raises(ValueError, match=r"^LMConfig\.ema_decay must be finite"):
        LMConfig.from_dict({**TINY, "ema_decay": NAN})


def test_hf_config_checks_the_same():
    with pytest.raises(ValueError, match=r"^LMConfig\.soft_vq_temperature must be "):
        H.LinattnConfig(**TINY, attention="soft-vq", soft_vq_temperature=0.0)


# ----------------------------------------------------------------------------- heads

NO_HEADS = {**{key: value for key, value in TINY.items() if key != "n_heads"}, "n_layers": 2}
GAU_PATTERNS = ["vq", "vq-fsq", "soft-vq", "gau-softmax", ["vq", "gau-softmax"]]


@pytest.mark.parametrize("n_heads, d_model", [(3, 16), (5, 16), (4, 30), (8, 4)])
def test_n_heads_that_does_not_divide_d_model_is_refused_by_name(n_heads, d_model):
    """``d_model // n_heads`` channels per head would leave ``d_model % n_heads`` of the width
    unused (or none at all for more heads than channels): refused, unless ``head_dim`` is set
    (then the heads' width is chosen, not a remainder dropped)."""
    settings = {**TINY, "n_heads": n_heads, "d_model": d_model, "n_layers": 2}
    for attention in ("linear:elu", "vq,delta"):
        with pytest.raises(ValueError, match=rf"^LMConfig\.n_heads={n_heads} must divide d_model={d_model} "
                                             rf"\(.*{d_model % n_heads} of its {d_model} channels unused.*head_dim"):
            LMConfig(**settings, attention=attention)
    LM(LMConfig(**settings, attention="vq,delta", head_dim=2))


@pytest.mark.parametrize("field, value", [("n_heads", 4), ("n_heads", 2), ("n_kv_heads", 1), ("head_dim", 8)])
@pytest.mark.parametrize("attention", GAU_PATTERNS, ids=str)
def test_head_settings_of_a_model_without_heads_are_refused_by_name(attention, field, value):
    """A GAU pair (vq, vq-fsq, soft-vq, gau-softmax) has no heads: ``n_heads``, ``n_kv_heads``
    and ``head_dim`` set for a model of only such layers would be ignored, so they are
    refused; unset (None, the default) the model builds."""
    with pytest.raises(ValueError, match=rf"^LMConfig\.{field}={value} is used by no layer"):
        LMConfig(**NO_HEADS, attention=attention, **{field: value})
    config = LMConfig(**NO_HEADS, attention=attention)
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (None, None, None)
    LM(config)


def test_n_heads_is_4_where_a_layer_has_heads():
    assert LMConfig(attention="softmax").n_heads == 4
    assert LMConfig(attention="vq,local", n_layers=2).n_heads == 4
    assert LMConfig(attention="vq").n_heads is None
    assert LMConfig.from_dict(LMConfig(attention="delta").to_dict()).n_heads == 4


@pytest.mark.parametrize("attention", GAU_PATTERNS, ids=str)
def test_saved_configs_of_models_without_heads_still_load(attention):
    """Every config saved before n_heads could be unset recorded it (4 by default, or the
    grid's) for models without heads too: read back as saved (``from_saved``, the HF config's
    ``from_dict``), the head settings of such a model are dropped, and the model builds."""
    saved = {**LMConfig(**NO_HEADS, attention=attention).to_dict(), "n_heads": 2, "n_kv_heads": 1}
    config = LMConfig.from_saved(saved)
    assert (config.n_heads, config.n_kv_heads) == (None, None)
    LM(config)
    assert H.LinattnConfig.from_dict(saved).to_lm_config() == config


def test_a_saved_config_whose_n_heads_did_not_divide_d_model_loads_as_it_was_built():
    """Such a model was built with ``d_model // n_heads`` channels per head: read back as
    saved it gets that ``head_dim``, so its weights keep their shapes."""
    saved = {**LMConfig(**TINY, attention="linear:elu").to_dict(), "d_model": 16, "n_heads": 3}
    config = LMConfig.from_saved(saved)
    assert (config.n_heads, config.head_dim) == (3, 5)
    assert LM(config).layers[0].mixer.q_proj.weight.shape == (15, 16)  # 3 heads of 16 // 3 channels
    assert H.LinattnConfig.from_dict(saved).to_lm_config() == config


# ----------------------------------------------------------------------------- TrainConfig


@pytest.mark.parametrize("field", ["lr", "grad_clip", "weight_decay"])
def test_train_config_numbers_must_be_finite(field):
    with pytest.raises(ValueError, match=rf"^train\.{field} must be finite and "):
        TrainConfig(**{field: INF})
    assert getattr(TrainConfig(**{field: 1e30}), field) == 1e30


@pytest.mark.parametrize("value", ["", "   ", "\t\n"])
def test_train_data_must_not_be_empty_and_the_error_says_what_to_pass(value):
    with pytest.raises(ValueError, match=r"^train\.data must be a non-empty str") as info:
        TrainConfig(data=value)
    for form in ("'shakespeare'", "a text file", "a folder of .txt files", ".zip", "shard folder"):
        assert form in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("data", None), ("data", 5), ("data", Path("corpus.txt")), ("out", None), ("out", Path("runs/x")),
    ("cache_dir", 3), ("cache_dir", Path("cache")),
])
def test_train_paths_must_be_str(field, value):
    with pytest.raises(TypeError, match=rf"^train\.{field} must be a non-empty str"):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("out", ""), ("out", " "), ("cache_dir", ""), ("cache_dir", "  ")])
def test_train_out_and_cache_dir_must_not_be_empty(field, value):
    with pytest.raises(ValueError, match=rf"^train\.{field} must be a non-empty str"):
        TrainConfig(**{field: value})
    assert TrainConfig(cache_dir=None).cache_dir is None


@pytest.mark.parametrize("field", ["bf16", "carry_state"])
def test_train_bools_must_be_bools(field):
    for value in (0, 1, "true", None):
        with pytest.raises(TypeError, match=rf"^train\.{field} must be a bool, got "):
            TrainConfig(**{field: value})


def test_train_config_from_dict_checks_the_same():
    with pytest.raises(ValueError, match=r"^train\.lr must be finite"):
        TrainConfig.from_dict({"lr": INF})
    with pytest.raises(ValueError, match=r"^train\.data must be a non-empty str"):
        TrainConfig.from_dict({"data": ""})


# ----------------------------------------------------------------------------- the command


def _train_argv(out: Path, *sets: str) -> list[str]:
    tiny = ["model.codebook_size=8", "model.gau_d_k=8", "model.block_size=4", "train.eval_tokens=512", *sets]
    return ["train", "--out", str(out), "--steps", "1", "--attention", "local:4", "--d-model", "16", "--n-layers",
            "1", "--n-heads", "2", "--batch-size", "2", "--context", "16", "--eval-every", "0",
            *[arg for text in tiny for arg in ("--set", text)], "--no-progress", "--threads", "1"]


@pytest.fixture
def corpus_folder(tmp_path, monkeypatch) -> Path:
    """The working directory: one small .txt file (what an empty ``train.data`` used to read)."""
    (tmp_path / "notes.txt").write_text(english_like(6000), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("sets, named", [
    (["train.data="], "train.data must be a non-empty str"),
    (["train.data=' '"], "train.data must be a non-empty str"),
    (["train.data=5"], "train.data must be a non-empty str"),
    (["train.lr=inf"], "train.lr must be finite"),
    (["train.grad_clip=inf"], "train.grad_clip must be finite"),
    (["model.rotary_base=0"], "LMConfig.rotary_base must be a number > 1"),
    (["model.ema_decay=1.0"], "LMConfig.ema_decay must be in [0, 1)"),
    (["model.attention='delta:elu:3'"], "unknown layer attention spec 'delta:elu:3'"),
    (["model.attention='vq'"], "LMConfig.n_heads=2 is used by no layer"),
])
def test_train_command_refuses_bad_settings_before_training(corpus_folder, capsys, sets, named):
    out = corpus_folder / "run"
    if "train.data" not in sets[0]:
        sets = [f"train.data='{corpus_folder / 'notes.txt'}'", *sets]
    assert main(_train_argv(out, *sets)) == 2
    err = capsys.readouterr().err
    assert "linattn: error:" in err and named in err, err
    assert not out.exists()


@pytest.mark.parametrize("flag, value", [
    ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-0.5"), ("--temperature", "hot"),
    ("--top-p", "1.5"), ("--top-p", "2"),
])
def test_generate_command_refuses_bad_sampling_flags(tmp_path, capsys, flag, value):
    assert main(["generate", "--ckpt", str(tmp_path / "no-run"), flag, value]) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected " in err and repr(value) in err, err


def test_sampling_flag_types_accept_their_ranges():
    from linattn._checks import non_negative_float, positive_fraction

    assert [non_negative_float(text) for text in ("0", "0.8", "3")] == [0.0, 0.8, 3.0]
    assert [positive_fraction(text) for text in ("1", "0.5", "1e-9")] == [1.0, 0.5, 1e-9]
    for parse, text in ((non_negative_float, "-1e-9"), (positive_fraction, "1.0000001")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


# ----------------------------------------------------------------------------- token ids and sampling


@pytest.fixture(scope="module")
def model() -> LM:
    torch.manual_seed(0)
    return LM(LMConfig(**TINY, attention="linear:elu")).eval()


@pytest.mark.parametrize("prompt", [
    [1.7, 2.2], [1.0, 2.0], [True, False], [1, True], [[1, 2], [3, 2.5]], torch.tensor([1.0, 2.0]),
    torch.tensor([True, False]), np.array([1.5, 2.0]), "ab", None, 3.0, 5,
])
def test_generate_refuses_prompts_that_are_not_integer_ids(model, prompt):
    with pytest.raises(TypeError, match=r"^prompt_ids must "):
        model.generate(prompt, 3)  # at the call, before the first token is asked for


@pytest.mark.parametrize("prompt", [[], [[]], torch.zeros(0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long),
                                    torch.ones(1, 2, 3, dtype=torch.long), [[1, 2], [3]], [2**70], [40], [-1]])
def test_generate_refuses_empty_ragged_or_out_of_range_prompts(model, prompt):
    with pytest.raises(ValueError, match=r"^prompt_ids must "):
        model.generate(prompt, 3)


def test_generate_refuses_a_float_prompt_but_takes_every_integer_kind(model):
    with pytest.raises(TypeError, match=r"^prompt_ids must hold integer token ids, got float 1\.7$"):
        model.generate([1.7, 2.2], 3)
    expected = list(model.generate([3, 1, 4], 5, temperature=0))
    for prompt in ((3, 1, 4), torch.tensor([3, 1, 4], dtype=torch.uint8), torch.tensor([3, 1, 4], dtype=torch.int32),
                   np.array([3, 1, 4]), [np.int64(3), 1, 4]):
        assert list(model.generate(prompt, 5, temperature=0)) == expected, prompt
    batched = list(model.generate([[3, 1, 4], [3, 1, 4]], 5, temperature=0))
    assert [[int(t[0]) for t in batched], [int(t[1]) for t in batched]] == [expected, expected]


@pytest.mark.parametrize("options, name", [
    (dict(temperature=NAN), "temperature"), (dict(temperature=INF), "temperature"),
    (dict(temperature=-1e-9), "temperature"), (dict(temperature="0.8"), "temperature"),
    (dict(top_p=NAN), "top_p"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=True), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_k=True), "top_k"),
    (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"),
])
def test_generate_checks_sampling_settings_before_running_the_prompt(model, options, name):
    calls = []
    handle = model.embed.register_forward_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match=rf"^{name} must be "):
            model.generate([1, 2, 3], 4, **options)
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize("options, name", [
    (dict(temperature=NAN), "temperature"), (dict(temperature=INF), "temperature"), (dict(top_p=True), "top_p"),
])
def test_sample_next_refuses_the_same_settings(options, name):
    with pytest.raises(ValueError, match=rf"^{name} must be "):
        sample_next(torch.zeros(2, 5), **options)


def test_hf_model_names_non_integer_input_ids_and_labels():
    torch.manual_seed(0)
    hf = H.LinattnForCausalLM.from_lm(LM(LMConfig(**TINY, attention="linear:elu"))).eval()
    ids = torch.randint(0, 32, (2, 5))
    with pytest.raises(TypeError, match=r"^input_ids must be an integer tensor"):
        hf(ids.float())
    with pytest.raises(TypeError, match=r"^labels must be an integer tensor"):
        hf(ids, labels=ids.float() + 0.5)
    assert torch.isfinite(hf(ids, labels=ids).loss)
