"""``linattn convert``: a ``gau-softmax`` model becomes a ``vq`` (or ``soft-vq``) model with the
same weights and codebooks fitted by k-means++ / Lloyd on its own keys. With a codebook as
large as the set of keys it sees, the converted model computes what the softmax model
computes; the converted run evaluates, generates and fine-tunes like any run."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import linattn
from linattn.convert import calibration_ids, collect_keys, convert_model, converted_config
from linattn.nn.codebook import kmeans
from linattn.train import load_checkpoint, load_model
from _helpers import head_fields
from test_resume_checks import write_meta
from test_train_cli import TINY_SETS, corpus, run_captured, train_argv  # noqa: F401  (the tiny corpus fixture)

torch.set_num_threads(1)


def _softmax_model(seed: int = 0, codebook_size: int = 64, attention: str = "local:4,gau-softmax",
                   **options) -> linattn.LM:
    config = linattn.LMConfig(d_model=16, n_layers=2, attention=attention, gau_d_k=8, block_size=4,
                              codebook_size=codebook_size, **head_fields(attention, n_heads=2), **options)
    torch.manual_seed(seed)
    model = linattn.LM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


def test_converted_config_maps_gau_softmax_layers_only():
    config = _softmax_model().config
    converted = converted_config(config, "vq", codebook_size=32)
    assert [str(spec) for spec in converted.layer_specs()] == ["local:4", "vq"]
    assert converted.codebook_size == 32
    assert [str(s) for s in converted_config(config, "soft-vq").layer_specs()] == ["local:4", "soft-vq"]
    with pytest.raises(ValueError, match="no gau-softmax layer"):
        converted_config(linattn.LMConfig(attention="vq,local:4"), "vq")
    with pytest.raises(ValueError, match="to"):
        converted_config(config, "delta")


def test_a_codebook_that_holds_every_key_reproduces_the_softmax_model():
    """Calibrated on the very tokens it is then run on, with S >= the keys each unit sees, every
    key is a code: the VQ model's logits are the softmax model's (float32 codebooks)."""
    source = _softmax_model()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    converted = convert_model(source, ids, to="vq", codebook_size=64, kmeans_iters=5)
    want, _, _ = source(ids)
    got, _, _ = converted.eval()(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    small = convert_model(source, ids, to="vq", codebook_size=2, kmeans_iters=5)  # too few codes: not the same
    assert not torch.allclose(small.eval()(ids)[0], want, rtol=1e-3, atol=1e-3)
    for name, tensor in source.state_dict().items():  # every weight copied
        assert torch.equal(converted.state_dict()[name], tensor), name


def test_codebooks_are_the_kmeans_of_the_units_keys():
    source = _softmax_model()
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(2))
    keys = collect_keys(source, ids)
    assert [k.shape for k in keys] == [(48, 8), (48, 8)]  # the two units of the gau-softmax pair
    converted = convert_model(source, ids, to="vq", codebook_size=8, kmeans_iters=30, tokens_per_step=96, seed=3)
    for unit, unit_keys in zip(converted.layers[1].units, keys):
        codebook = unit.quantizer.codebook[0]
        nearest = torch.cdist(unit_keys, codebook).argmin(-1)
        for s in range(8):  # a converged Lloyd step: each used code is the mean of its keys
            chosen = unit_keys[nearest == s]
            if len(chosen):
                torch.testing.assert_close(codebook[s], chosen.mean(0), rtol=1e-5, atol=1e-6)
        counts = torch.bincount(nearest, minlength=8).float() * (96 / 48)
        torch.testing.assert_close(unit.quantizer.ema_counts[0], torch.where(counts > 0, counts, 0.01))
        torch.testing.assert_close(unit.quantizer.ema_sums[0], codebook * unit.quantizer.ema_counts[0, :, None])
    soft = convert_model(source, ids, to="soft-vq", codebook_size=8, kmeans_iters=30, seed=3)
    torch.testing.assert_close(soft.layers[1].units[0].codebook, converted.layers[1].units[0].quantizer.codebook)


def test_kmeans_plus_plus_seeds_every_cluster():
    """Three tight, far-apart clusters and three codes: k-means++ seeds one code in each
    (a far key is drawn with probability ~1), so Lloyd ends at the cluster means."""
    g = torch.Generator().manual_seed(0)
    means = torch.tensor([[0.0, 0.0], [50.0, 0.0], [0.0, 50.0]])
    keys = (means.repeat_interleave(30, 0) + 0.01 * torch.randn(90, 2, generator=g)).unsqueeze(0)
    for seed in range(5):
        centers = kmeans(keys, 3, 5, torch.Generator().manual_seed(seed), seeding="kmeans++")[0]
        order = centers[:, 0] * 10 + centers[:, 1]  # sort: (0,0), (0,50), (50,0)
        torch.testing.assert_close(centers[order.argsort()], means[[0, 2, 1]], rtol=0, atol=0.01)
    twice = torch.tensor([[[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]])  # fewer distinct keys than codes
    assert kmeans(twice, 4, 2, seeding="kmeans++").shape == (1, 4, 2)
    with pytest.raises(ValueError, match="seeding"):
        kmeans(twice, 2, seeding="far")


def test_convert_command_end_to_end(corpus, tmp_path):  # noqa: F811
    source = tmp_path / "softmax"
    argv = ["train", "--data", str(corpus), "--out", str(source), "--steps", "6", "--attention", "gau-softmax",
            "--d-model", "16", "--n-layers", "1", "--batch-size", "2", "--context", "16", "--eval-every", "6",
            *TINY_SETS, "--no-progress", "--threads", "1"]
    assert run_captured(argv)[0] == 0
    out = tmp_path / "vq"
    code, stdout, stderr = run_captured(["convert", "--ckpt", str(source), "--out", str(out), "--codebook-size", "16",
                                         "--calibration-tokens", "256", "--kmeans-iters", "3"])
    assert code == 0, stderr
    model, checkpoint = load_model(out)
    assert [str(s) for s in model.specs] == ["vq"] and model.config.codebook_size == 16
    assert checkpoint.step == 6 and checkpoint.meta["converted_from"]["calibration_tokens"] == 256
    code, stdout, _ = run_captured(["eval", "--ckpt", str(out), "--split", "test", "--json"])
    assert code == 0 and json.loads(stdout)["bpb"] > 0
    assert run_captured(["generate", "--ckpt", str(out), "--prompt", "The", "--max-new-tokens", "5"])[0] == 0
    code, _, stderr = run_captured(["train", "--resume", "--out", str(out), "--steps", "8", "--no-progress"])
    assert code == 0, stderr
    assert load_checkpoint(out).step == 8
    code, _, stderr = run_captured(["convert", "--ckpt", str(out), "--out", str(tmp_path / "again")])
    assert code == 2 and "no gau-softmax layer" in stderr
    code, _, stderr = run_captured(["convert", "--ckpt", str(source), "--out", str(out)])
    assert code == 2 and "already holds a run" in stderr


# ----------------------------------------------------------------------------- which layers, which codes


def _assert_lloyd_fixed_point(codebook: torch.Tensor, keys: torch.Tensor) -> None:
    """Each code that is the nearest of some keys is their mean (a converged Lloyd step)."""
    nearest = torch.cdist(keys, codebook).argmin(-1)
    for s in range(codebook.shape[0]):
        chosen = keys[nearest == s]
        if len(chosen):
            torch.testing.assert_close(codebook[s], chosen.mean(0), rtol=1e-5, atol=1e-6)


def test_a_gau_softmax_layer_with_options_is_refused():
    config = _softmax_model(attention="local:4,gau-softmax:entropy").config
    with pytest.raises(ValueError, match="a gau-softmax layer with options .* has no VQ twin to convert to"):
        converted_config(config, "vq")


def test_only_the_gau_softmax_layers_are_refitted():
    """In a ``vq,gau-softmax`` model the keys are collected from the gau-softmax pair only, and the
    ``vq`` layer keeps its trained codebook and statistics exactly."""
    source = _softmax_model(attention="vq,gau-softmax", codebook_size=8)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    keys = collect_keys(source, ids)
    assert [k.shape for k in keys] == [(32, 8), (32, 8)]  # the two units of layer 1, none of layer 0
    converted = convert_model(source, ids, to="vq", codebook_size=8, kmeans_iters=30)
    for name, tensor in source.state_dict().items():
        if name.startswith("layers.0."):
            assert torch.equal(converted.state_dict()[name], tensor), name
    for unit, unit_keys in zip(converted.layers[1].units, keys):
        _assert_lloyd_fixed_point(unit.quantizer.codebook[0], unit_keys)


def test_collecting_keys_leaves_the_model_as_it_was():
    """``collect_keys`` wraps each unit's attention only while it runs: afterwards no unit holds
    the recording wrapper, so the model still pickles whole and records nothing more."""
    source = _softmax_model()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    collect_keys(source, ids)
    assert all("_attend" not in vars(unit) for unit in source.layers[1].units)
    buffer = io.BytesIO()
    torch.save(source, buffer)  # a local function left on a unit cannot be pickled
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(again(ids)[0], source(ids)[0], rtol=0, atol=0)


def test_convert_model_refuses_a_source_whose_weights_differ_from_its_config():
    """A source whose state dict holds a tensor its config does not make, or lacks one it makes,
    is refused with the names, not converted with weights dropped or left random."""
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(6))
    extra = _softmax_model()
    extra.layers[1].register_buffer("stray", torch.zeros(1))
    with pytest.raises(ValueError, match=r"the models differ beyond the codebooks: missing \[.*\], "
                                         + re.escape("unexpected ['layers.1.stray']")):
        convert_model(extra, ids, codebook_size=4, kmeans_iters=1)
    lacking = _softmax_model()
    lacking.layers[0].mixer_norm.weight = None  # no longer in the state dict
    with pytest.raises(ValueError, match=re.escape("the models differ beyond the codebooks: missing "
                                                   "['layers.0.mixer_norm.weight', ")):
        convert_model(lacking, ids, codebook_size=4, kmeans_iters=1)


def test_soft_vq_codebooks_of_every_unit_are_the_kmeans_of_its_keys():
    """``to="soft-vq"`` fits every converted unit (both units of each pair, every pair), not only
    the first: each learned codebook is a converged k-means of that unit's keys."""
    source = _softmax_model(attention="gau-softmax", codebook_size=8)
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(7))
    keys = collect_keys(source, ids)
    assert len(keys) == 4  # two layers of two units
    soft = convert_model(source, ids, to="soft-vq", codebook_size=8, kmeans_iters=30, seed=1)
    units = [unit for layer in soft.layers for unit in layer.units]
    for unit, unit_keys in zip(units, keys):
        _assert_lloyd_fixed_point(unit.codebook[0], unit_keys)


def test_codes_no_key_chose_keep_a_count_of_one_hundredth():
    """With more codes (8) than keys (3 per unit) some codes get no key: their EMA count is 0.01,
    so the first EMA update does not divide by zero; the counts of the chosen codes add up to
    ``tokens_per_step`` and the EMA sums are code x count."""
    source = _softmax_model(codebook_size=8)
    ids = torch.randint(0, 256, (1, 3), generator=torch.Generator().manual_seed(8))
    converted = convert_model(source, ids, to="vq", codebook_size=8, kmeans_iters=5, tokens_per_step=12)
    for unit in converted.layers[1].units:
        counts = unit.quantizer.ema_counts[0]
        unused = counts < 0.1
        assert int(unused.sum()) >= 8 - 3
        assert torch.equal(counts[unused], torch.full_like(counts[unused], 0.01))
        assert float(counts[~unused].sum()) == pytest.approx(12.0, rel=1e-6)
        assert all(float(c) * 3 / 12 == pytest.approx(round(float(c) * 3 / 12)) for c in counts[~unused])
        torch.testing.assert_close(unit.quantizer.ema_sums[0], unit.quantizer.codebook[0] * counts[:, None])


@pytest.mark.parametrize("kmeans_init", [False, True], ids=["random-init", "kmeans-init"])
def test_converted_codebooks_are_marked_fitted_and_training_keeps_them(kmeans_init):
    """The fitted codes are not replaced by the quantizer's k-means initialisation: in the model
    ``convert_model`` returns and in one loaded from its state dict (what ``linattn convert``
    saves), ``initialized`` is set, nothing is pending, and a training forward keeps the codes."""
    source = _softmax_model(codebook_size=8, kmeans_init=kmeans_init)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(9))
    converted = convert_model(source, ids, to="vq", codebook_size=8, kmeans_iters=3)
    reloaded = linattn.LM(converted.config)
    reloaded.load_state_dict(converted.state_dict())
    fitted = [q.codebook.clone() for q in converted.quantizers()]
    for model in (converted, reloaded):
        quantizers = list(model.quantizers())
        assert len(quantizers) == 2
        assert all(bool(q.initialized) and not q.initialization_pending() for q in quantizers)
        model.train()(ids)  # without update_codebooks only an initialisation could move the codes
        for quantizer, codes in zip(quantizers, fitted):
            assert torch.equal(quantizer.codebook, codes)


def test_calibration_takes_whole_windows_from_the_start_of_the_train_split(corpus):  # noqa: F811
    """``calibration_ids`` cuts the first tokens of the train split into windows of the context:
    one whole window is enough, a remainder is dropped, less than one window is refused."""
    data = torch.tensor(list(corpus.read_bytes()))  # the train split is the first 90% of the bytes
    assert torch.equal(calibration_ids(str(corpus), 16, 16), data[:16].reshape(1, 16))
    assert torch.equal(calibration_ids(str(corpus), 40, 16), data[:32].reshape(2, 16))
    with pytest.raises(ValueError, match="--calibration-tokens 15 gives no whole window of the run's context 16"):
        calibration_ids(str(corpus), 15, 16)


# ----------------------------------------------------------------------------- linattn convert on a token run


@pytest.fixture(scope="module")
def token_softmax_run(corpus, tmp_path_factory):  # noqa: F811
    """A 2-step gau-softmax run on BPE shards (vocabulary 260) of the tiny corpus: its folder
    holds the tokenizer.json and data.json a token run keeps."""
    from linattn.data import prepare_shards

    root = tmp_path_factory.mktemp("convert-tokens")
    shards = prepare_shards(corpus, "bpe:260", root / "shards", echo=lambda *a: None)
    run = root / "softmax"
    code, _, stderr = run_captured(train_argv(shards, run, steps=2, attention="gau-softmax"))
    assert code == 0, stderr
    assert (run / "tokenizer.json").is_file() and (run / "data.json").is_file()
    return run


def _convert(ckpt: Path, out: Path, *more: str):
    return run_captured(["convert", "--ckpt", str(ckpt), "--out", str(out), "--codebook-size", "8",
                         "--calibration-tokens", "256", "--kmeans-iters", "2", *more])


@pytest.mark.parametrize("where", ["new/nested/vq", "existing-empty"])
def test_convert_writes_a_self_contained_run_with_the_sources_tokenizer(token_softmax_run, tmp_path, where):
    """The new run folder may not exist yet (parents created) or exist empty; it gets the source's
    tokenizer.json and data.json, so the converted run generates and evaluates on its own."""
    out = tmp_path / where
    if where == "existing-empty":
        out.mkdir()
    code, _, stderr = _convert(token_softmax_run, out)
    assert code == 0, stderr
    for name in ("tokenizer.json", "data.json"):
        assert (out / name).read_bytes() == (token_softmax_run / name).read_bytes(), name
    assert load_model(out)[0].config.vocab_size == 260
    code, stdout, stderr = run_captured(["generate", "--ckpt", str(out), "--prompt", "The", "--max-new-tokens", "4"])
    assert code == 0 and stdout.startswith("The"), stderr
    code, stdout, stderr = run_captured(["eval", "--ckpt", str(out), "--max-tokens", "200", "--json",
                                         "--no-progress"])
    assert code == 0 and json.loads(stdout)["bytes"] > 0, stderr


def test_codebook_counts_are_one_training_step_of_tokens(token_softmax_run, tmp_path):
    """``ema_counts`` of the chosen codes add up to the tokens of one training step of the source
    run, batch_size x context x processes (here 2 x 16 x 2, a 2-process run's checkpoint)."""
    source = tmp_path / "two-processes"
    shutil.copytree(token_softmax_run, source)
    meta_file = load_checkpoint(source).path / "meta.json"
    meta = json.loads(meta_file.read_text())
    assert (meta["train_config"]["batch_size"], meta["train_config"]["context"]) == (2, 16)
    meta["world_size"] = 2
    write_meta(meta_file.parent, meta, seal=True)
    code, _, stderr = _convert(source, tmp_path / "vq")
    assert code == 0, stderr
    model, _ = load_model(tmp_path / "vq")
    for quantizer in model.quantizers():
        counts = quantizer.ema_counts[0]
        assert float(counts[counts > 0.1].sum()) == pytest.approx(2 * 16 * 2, rel=1e-5)


def test_convert_refuses_a_checkpoint_whose_tensors_do_not_match_its_config(token_softmax_run, tmp_path):
    """A checkpoint whose meta.json describes another model than its tensors (here one layer more)
    is a clear error naming the checkpoint (exit 2), and nothing is written."""
    source = tmp_path / "edited"
    shutil.copytree(token_softmax_run, source)
    meta_file = load_checkpoint(source).path / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["model_config"]["n_layers"] += 1
    write_meta(meta_file.parent, meta, seal=True)  # consistent hashes: only the config is wrong
    code, _, stderr = _convert(source, tmp_path / "vq")
    assert code == 2 and "the stored model does not match its config" in stderr and "layers.2" in stderr, stderr
    assert not (tmp_path / "vq").exists()


@pytest.mark.parametrize("missing", ["--ckpt", "--out"])
def test_convert_needs_ckpt_and_out(tmp_path, missing):
    argv = {"--ckpt": str(tmp_path / "source"), "--out": str(tmp_path / "vq")}
    del argv[missing]
    code, _, stderr = run_captured(["convert", *[item for pair in argv.items() for item in pair]])
    assert code == 2 and f"the following arguments are required: {missing}" in stderr, stderr


KILLED_CONVERT = """
import os, signal, sys
from pathlib import Path
import linattn.train.checkpoint as checkpoint

def save_file(tensors, path):  # the first tensor file half written, then the process is killed
    Path(path).write_bytes(b"\\0" * 100)
    os.kill(os.getpid(), signal.SIGKILL)

checkpoint.save_file = save_file
from linattn.cli import main
main(sys.argv[1:])
"""


def test_a_convert_killed_while_writing_can_be_run_again(token_softmax_run, tmp_path):
    """A convert killed in the middle of writing its run must leave nothing at --out that a retry
    would take for a training run's folder; the retry converts, and the dead one's leftovers go."""
    import os
    import subprocess
    import sys

    out = tmp_path / "vq"
    argv = ["convert", "--ckpt", str(token_softmax_run), "--out", str(out), "--codebook-size", "8",
            "--calibration-tokens", "256", "--kmeans-iters", "2"]
    killed = subprocess.run([sys.executable, "-c", KILLED_CONVERT, *argv], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    code, stdout, stderr = run_captured(argv)
    assert code == 0, stderr
    model, checkpoint = load_model(out)
    assert checkpoint.step == 2 and {str(s) for s in model.specs} == {"vq"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vq"]  # no temporary of the killed convert is left
