"""``linattn convert --ckpt SRC --to SPEC``: a tiny random Llama (GQA: 4 query heads, 2 key/value
heads), or a linattn softmax run, converted to each linear-time target: the teacher's tensors kept
exactly, the ``vq-attn`` codebooks the k-means centers of the teacher's unrotated calibration keys
(computed here from transformers' own model), attention transfer lowering its loss (computed here
from the teacher's and the student's layers), two finite training steps after, token-by-token
decoding equal to the full pass with a state that does not grow, and every refusal named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from linattn import LM
from linattn.data import Shards
from linattn.linearize import LinearizeOptions, calibration_ids, linearize_model, student_config
from linattn.models import LMConfig
from linattn.models.pretrained_weights import rotate_half_permutation
from linattn.train import load_checkpoint, load_model

from _helpers import assert_decodes_as_full_pass
from test_convert_hf import prepare
from test_from_hf import LLAMA3, hf_folder, reference, tiny_tokenizer
from test_train_cli import run_captured

torch.set_num_threads(1)

CONTEXT, BLOCK, CODES = 16, 8, 8
SETS = ["--set", f"train.context={CONTEXT}", "--set", "train.batch_size=2", "--set", "train.eval_tokens=256",
        "--set", "train.eval_batch_size=2", "--set", "train.lr=1e-3", "--set", "train.warmup_steps=0",
        "--set", f"model.block_size={BLOCK}", "--set", f"model.codebook_size={CODES}"]
TARGETS = ["vq-attn:rerope", "vq-attn:bias", "gated-delta", "gla", "linear:hedgehog", "vq-attn:rerope=4,softmax"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random tiny Llama folder and shards of the Shakespeare stand-in in its tokenizer."""
    root = tmp_path_factory.mktemp("linearize")
    hf = hf_folder(root / "hf", tiny_tokenizer(), "llama")
    return hf, prepare(root, hf / "tokenizer.json")


def convert(hf: Path, out: Path, shards: Path, to: str, *extra: str) -> tuple[int, str, str]:
    return run_captured(["convert", "--ckpt", str(hf), "--to", to, "--out", str(out), "--data", str(shards),
                         "--calibration-tokens", "512", "--transfer-steps", "10", *SETS, *extra])


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """``{spec: run folder}``: the tiny Llama converted to every target."""
    hf, shards = source
    root = tmp_path_factory.mktemp("converted")
    runs = {}
    for to in TARGETS:
        runs[to] = root / to.replace(":", "-").replace(",", "+")
        code, _, err = convert(hf, runs[to], shards, to)
        assert code == 0, err
    return runs


@pytest.mark.parametrize("to", TARGETS)
def test_conversion_keeps_the_teachers_tensors_and_trains_two_finite_steps(to, source, converted):
    hf, _ = source
    run = converted[to]
    student, checkpoint = load_model(run)
    teacher = LM.from_hf(hf)
    assert [str(spec) for spec in student.specs] == [to.split(",")[i % len(to.split(","))] for i in range(2)]
    assert checkpoint.step == 0 and checkpoint.meta["converted_from"]["folder"] == str(hf.resolve())
    for name, tensor in teacher.state_dict().items():  # embedding, norms, q/k/v/o, SwiGLU, head
        assert torch.equal(student.state_dict()[name], tensor), name
    code, _, err = run_captured(["train", "--resume", "--out", str(run), "--steps", "2", "--no-progress"])
    assert code == 0, err
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [record["loss"] for record in losses if "loss" in record]
    assert trained and all(torch.isfinite(torch.tensor(trained)))
    assert load_checkpoint(run).step == 2
    assert load_checkpoint(run).meta["converted_from"] == checkpoint.meta["converted_from"]  # carried along
    after, _ = load_model(run)
    assert any(not torch.equal(value, student.state_dict()[name]) for name, value in after.state_dict().items())


def _teacher_keys(hf: Path, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The keys transformers' Llama computes at ``layer`` before its rotary embedding, in linattn's
    channel order (the pairs of ``rotate_half_permutation``), as ``[kv_heads, N, head_dim]``."""
    model = reference(hf)
    recorded = []
    hook = model.model.layers[layer].self_attn.k_proj.register_forward_hook(lambda m, i, out: recorded.append(out))
    with torch.no_grad():
        model(ids)
    hook.remove()
    keys = recorded[0].reshape(-1, 2, 8)[:, :, rotate_half_permutation(8)]
    return keys.transpose(0, 1)


def test_vq_codebooks_are_the_kmeans_centers_of_the_unrotated_calibration_keys(source, tmp_path):
    """Each code of each layer and key/value head is the mean of the calibration keys nearest to it
    (Lloyd's fixed point) and its EMA count is their number scaled to one training step (2 x 16
    tokens): the keys computed by transformers' model, before rotation."""
    hf, shards = source
    run = tmp_path / "vq"
    code, _, err = convert(hf, run, shards, "vq-attn:rerope", "--kmeans-iters", "100")
    assert code == 0, err
    model, checkpoint = load_model(run)
    ids = Shards(shards).tokens("train")[:512].long().reshape(-1, CONTEXT)
    assert checkpoint.meta["converted_from"]["kmeans_layers"] == [0, 1]
    for layer in (0, 1):
        quantizer = model.layers[layer].mixer.quantizer
        keys = _teacher_keys(hf, ids, layer)
        for head in range(2):
            codes = quantizer.codebook[head]
            nearest = torch.cdist(keys[head], codes).argmin(-1)
            for s in range(CODES):
                mine = keys[head][nearest == s]
                expected_count = mine.shape[0] * (2 * CONTEXT) / keys.shape[1] if mine.shape[0] else 0.01
                assert float(quantizer.ema_counts[head, s]) == pytest.approx(expected_count, rel=1e-5)
                if mine.shape[0]:
                    torch.testing.assert_close(codes[s], mine.mean(0), rtol=1e-4, atol=1e-5)
    # what ReRoPE's codes must not be: centers of the rotated keys (these are far from them)
    rotated = model.layers[0].mixer.quantizer.codebook
    positions = torch.arange(CONTEXT).repeat(ids.shape[0])
    angles = positions[:, None] * 10000.0 ** (-torch.arange(0, 8, 2) / 8)
    keys = _teacher_keys(hf, ids, 0)[0].reshape(-1, 4, 2)
    cos, sin = angles.cos(), angles.sin()
    turned = torch.stack([keys[..., 0] * cos - keys[..., 1] * sin, keys[..., 0] * sin + keys[..., 1] * cos], -1)
    turned = turned.reshape(-1, 8)
    nearest = torch.cdist(turned, rotated[0]).argmin(-1)
    gaps = [(rotated[0][s] - turned[nearest == s].mean(0)).abs().max() for s in range(CODES) if (nearest == s).any()]
    assert max(gaps) > 1e-2


def _recorded_mixers(model: LM, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    records = []
    handles = [layer.mixer.register_forward_hook(lambda m, i, out: records.append((i[0], out[0])))
               for layer in model.layers]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return records


def transfer_objective(teacher: LM, student: LM, ids: torch.Tensor) -> float:
    """``sum over layers of mean((student attention(x) - teacher attention(x))^2)``, x the teacher's
    attention inputs (hooked here)."""
    total = 0.0
    with torch.no_grad():
        for layer, (x, y) in zip(student.layers, _recorded_mixers(teacher, ids)):
            total += float((layer.mixer(x)[0] - y).pow(2).mean())
    return total


@pytest.mark.parametrize("to", ["gated-delta", "gla", "linear:hedgehog", "vq-attn:bias"])
def test_attention_transfer_lowers_its_own_loss_and_trains_only_new_parameters(to, source):
    hf, shards = source
    teacher = LM.from_hf(hf)
    ids = calibration_ids(str(shards), 512, CONTEXT)
    options = dict(codebook_size=CODES, calibration_tokens=512, seed=0)
    untrained, _ = linearize_model(teacher, ids, to, LinearizeOptions(transfer_steps=0, **options),
                                   model_overrides={"block_size": BLOCK})
    fitted, record = linearize_model(teacher, ids, to, LinearizeOptions(transfer_steps=30, **options),
                                     model_overrides={"block_size": BLOCK})
    before, after = transfer_objective(teacher, untrained, ids), transfer_objective(teacher, fitted, ids)
    assert after < before  # (no step taken: equal)
    transfer = record["attention_transfer"]
    assert sum(transfer["loss_before"].values()) == pytest.approx(before, rel=1e-5)
    assert sum(transfer["loss_after"].values()) == pytest.approx(after, rel=1e-5)
    changed = {name for name, value in fitted.state_dict().items()
               if not torch.equal(value, untrained.state_dict()[name])}
    assert changed and changed <= set(record["new_parameters"])
    assert not changed & set(teacher.state_dict())


@pytest.mark.parametrize("to", ["vq-attn:rerope", "vq-attn:bias", "gated-delta", "gla", "linear:hedgehog"])
def test_the_converted_model_decodes_as_its_full_pass_with_a_state_that_does_not_grow(to, converted):
    model, _ = load_model(converted[to])
    model = model.double()
    ids = torch.randint(0, 300, (2, 21), generator=torch.Generator().manual_seed(3))
    assert_decodes_as_full_pass(model, ids, prefill=5)
    sizes = []
    with torch.no_grad():
        for length in (17, 17 + 4 * BLOCK, 17 + 20 * BLOCK):  # the same place in a block
            _, state, _ = model(torch.randint(0, 300, (1, length)))
            sizes.append(sum(t.numel() for layer in state.layers for t in vars(layer).values()
                             if isinstance(t, torch.Tensor)))
    assert sizes[0] == sizes[1] == sizes[2] and not model.has_growing_cache


def test_a_linattn_softmax_run_converts_on_its_own_data(tmp_path):
    from test_shards import write_plays

    write_plays(tmp_path / "cache")
    corpus = tmp_path / "cache"
    code, _, err = run_captured(["train", "--attention", "softmax", "--d-model", "16", "--n-layers", "2", "--n-heads",
                                 "2", "--steps", "2", "--batch-size", "2", "--context", "16", "--eval-every", "0",
                                 "--cache-dir", str(corpus), "--out", str(tmp_path / "softmax"), "--no-progress"])
    assert code == 0, err
    code, out, err = run_captured(["convert", "--ckpt", str(tmp_path / "softmax"), "--to", "gated-delta,softmax",
                                   "--out", str(tmp_path / "hybrid"), "--calibration-tokens", "256",
                                   "--transfer-steps", "3"])
    assert code == 0, err
    assert "attention transfer on 1 layers" in out
    student, checkpoint = load_model(tmp_path / "hybrid")
    assert [str(s) for s in student.specs] == ["gated-delta", "softmax"] and checkpoint.step == 2
    assert checkpoint.meta["converted_from"]["step"] == 2
    code, _, err = run_captured(["train", "--resume", "--out", str(tmp_path / "hybrid"), "--steps", "4",
                                 "--no-progress"])
    assert code == 0, err


@pytest.mark.parametrize(
    ("family", "fields", "to", "extra", "named"),
    [
        ("llama", {}, "vq", [], "layer 0 would become 'vq', Transformer-VQ's pair of gated attention units"),
        ("llama", {}, "vq-attn", [], "unknown layer attention spec 'vq-attn'"),
        ("qwen2", {}, "gla", [], "LMConfig.qkv_bias=True: layer 'gla' does not use it"),
        ("llama", {"rope_parameters": LLAMA3}, "vq-attn:rerope", [], "LMConfig.rotary_scaling="),
        ("llama", {}, "vq-attn:rerope=16", [], "ReRoPE window of 16 > block_size=8"),
        ("llama", {}, "gated-delta", ["--set", "model.ffn_hidden=64"],
         "the teacher's layers.0.ffn.w_gate.weight has shape [48, 32] but layer 0 ('gated-delta') holds [64, 32]"),
        ("llama", {}, "gla", ["--set", "model.attention=gla"], "--set model.attention"),
        ("llama", {}, "gla,gla,gla", [], "3 layer specs for a source of 2 layers"),
    ],
)
def test_what_does_not_convert_is_refused_by_name(family, fields, to, extra, named, source, tmp_path):
    hf, shards = source
    if family != "llama" or fields:
        hf = hf_folder(tmp_path / "hf", tiny_tokenizer(), family, **fields)
    code, _, err = convert(hf, tmp_path / "out", shards, to, *extra)
    assert code == 2 and named in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_source_and_option_refusals(source, tmp_path):
    hf, shards = source
    code, _, err = run_captured(["convert", "--ckpt", str(hf), "--to", "gla", "--out", str(tmp_path / "a")])
    assert code == 2 and "--to gla needs --data SHARDS" in err
    code, _, err = run_captured(["convert", "--ckpt", str(hf), "--to", "vq", "--out", str(tmp_path / "a")])
    assert code == 2 and "would become 'vq'" in err  # the specs are checked first
    code, _, err = run_captured(["convert", "--ckpt", str(hf), "--to", "softmax", "--out", str(tmp_path / "b"),
                                 "--data", str(shards), "--transfer-steps", "3"])
    assert code == 2 and "--transfer-steps: not an option of --to softmax" in err
    assert not any((tmp_path / name).exists() for name in "ab")
    teacher = LMConfig(d_model=16, n_layers=2, n_heads=2, attention="gla,softmax")
    with pytest.raises(ValueError, match="layer 0 of the source is 'gla'; only softmax and local layers convert"):
        student_config(teacher, "softmax,gla")
    with pytest.raises(ValueError, match="nothing to convert"):
        student_config(LMConfig(d_model=16, n_layers=2, n_heads=2, attention="softmax"), "softmax")
