"""Training on token shards end to end: BPE shards of (a stand-in for) Shakespeare are
prepared, trained on, evaluated in bits per byte and generated from with the run's own
tokenizer; the vocabulary follows the tokenizer; resume is exact; the export loads with
AutoTokenizer; and a shard larger than the process may allocate trains (memory-mapped)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from linattn.cli import main
from linattn.models import LMConfig
from linattn.train import TrainConfig, load_checkpoint, load_model, train
from test_shards import quiet, write_plays
from test_train_cli import train_argv

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """``linattn data prepare --tokenizer bpe:300`` on a 3-play Shakespeare cache, then
    ``linattn train --data DIR`` (12 steps of a tiny model)."""
    root = tmp_path_factory.mktemp("e2e")
    plays = write_plays(root / "cache")
    shards = root / "shards"
    assert main(["data", "prepare", "--data", "shakespeare", "--cache-dir", str(root / "cache"),
                 "--tokenizer", "bpe:300", "--out", str(shards)]) == 0
    run = root / "run"
    assert main(train_argv(shards, run, steps=12)) == 0
    return shards, run, plays


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _curve(run: Path) -> list[dict]:
    """The records without the timings."""
    return [{k: v for k, v in r.items() if k not in ("tokens_per_second", "elapsed")} for r in _records(run)]


def test_the_run_takes_its_vocabulary_and_tokenizer_from_the_shards(bpe_run):
    shards, run, _ = bpe_run
    checkpoint = load_checkpoint(run)
    assert checkpoint.meta["model_config"]["vocab_size"] == 300
    assert (run / "tokenizer.json").read_bytes() == (shards / "tokenizer.json").read_bytes()
    meta = json.loads((shards / "meta.json").read_text())
    assert checkpoint.meta["tokenizer"] == {"kind": "bpe", "vocab_size": 300, "sha256": meta["tokenizer"]["sha256"]}
    assert json.loads((run / "data.json").read_text())["splits"] == meta["splits"]
    train_records = [r for r in _records(run) if "loss" in r]
    assert train_records and all("bits_per_token" in r and "bpb" not in r for r in train_records)
    assert train_records[-1]["bits_per_token"] == pytest.approx(train_records[-1]["loss"] / math.log(2))


def test_validation_bpb_is_per_byte(bpe_run):
    shards, run, plays = bpe_run
    model, _ = load_model(run)
    reference = Tokenizer.from_file(str(shards / "tokenizer.json"))
    ids = torch.tensor(reference.encode(plays["validation"]).ids)[:512]  # train.eval_tokens = 512
    evaluations = [r for r in _records(run) if r.get("split") == "validation"]
    assert [r["step"] for r in evaluations] == [0, 12]
    # the logged evaluation: 8 streams of the first 512 tokens, state carried, reset every 8 windows of 16
    length = ids.numel() // 8
    streams = ids[:8 * length].reshape(8, length)
    nats, targets_bytes = 0.0, 0
    with torch.no_grad():
        for start in range(0, length - 1, 16 * 8):
            end = min(start + 16 * 8, length - 1)
            logits, _, _ = model(streams[:, start:end])
            nats += F.cross_entropy(logits.double().flatten(0, 1), streams[:, start + 1:end + 1].flatten(),
                                    reduction="sum").item()
    for row in streams:
        targets_bytes += len(reference.decode(row[1:].tolist()).encode("utf-8"))
    record = evaluations[-1]
    assert record["bytes"] == targets_bytes and record["tokens"] == 8 * (length - 1)
    assert record["bpb"] == pytest.approx(nats / targets_bytes / math.log(2), rel=1e-4)
    assert record["bits_per_token"] == pytest.approx(nats / record["tokens"] / math.log(2), rel=1e-4)


def test_eval_reports_bits_per_byte_of_the_test_split(bpe_run, capsys):
    shards, run, plays = bpe_run
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(run), "--split", "test", "--json", "--no-progress", "--threads", "1"]) == 0
    record = json.loads(capsys.readouterr().out)
    reference = Tokenizer.from_file(str(shards / "tokenizer.json"))
    ids = torch.tensor(reference.encode(plays["test"]).ids)
    model, _ = load_model(run)
    with torch.no_grad():  # batch 1, state carried: the whole split in one pass
        logits, _, _ = model(ids[:-1].unsqueeze(0))
    nats = F.cross_entropy(logits[0].double(), ids[1:], reduction="sum").item()
    n_bytes = len(plays["test"].encode("utf-8")) - len(reference.decode(ids[:1].tolist()).encode("utf-8"))
    assert record["tokens"] == ids.numel() - 1 and record["bytes"] == n_bytes
    assert record["bpb"] == pytest.approx(nats / n_bytes / math.log(2), rel=1e-4)
    assert record["bits_per_token"] == pytest.approx(nats / (ids.numel() - 1) / math.log(2), rel=1e-4)
    assert main(["eval", "--ckpt", str(run), "--split", "test", "--no-progress", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"test bpb: {record['bpb']:.4f} (bits per byte: ")
    assert f"x {ids.numel() - 1:,} tokens / {n_bytes:,} bytes" in text


def test_eval_refuses_data_of_another_tokenizer(bpe_run, capsys):
    _, run, _ = bpe_run
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(run), "--data", "shakespeare", "--no-progress"]) == 2
    assert "the data's tokenizer (bytes) is not the run's (bpe, 300 tokens" in capsys.readouterr().err


def test_generate_encodes_and_decodes_with_the_runs_tokenizer(bpe_run, capsys):
    shards, run, _ = bpe_run
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(run), "--prompt", "The king", "--max-new-tokens", "12",
                 "--temperature", "0", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    reference = Tokenizer.from_file(str(shards / "tokenizer.json"))
    model, _ = load_model(run)
    sequence = reference.encode("The king").ids
    prompt_length = len(sequence)
    with torch.no_grad():  # greedy, by full forward passes
        for _ in range(12):
            logits, _, _ = model(torch.tensor([sequence]))
            sequence.append(int(logits[0, -1].argmax()))
    assert text == "The king" + reference.decode(sequence[prompt_length:]) + "\n"
    assert len(text) > len("The king\n")


def test_a_vocab_size_other_than_the_tokenizers_is_refused(bpe_run, tmp_path, capsys):
    shards, _, _ = bpe_run
    capsys.readouterr()
    assert main(train_argv(shards, tmp_path / "r", steps=1) + ["--set", "model.vocab_size=256"]) == 2
    assert "model.vocab_size=256, but the tokenizer of" in capsys.readouterr().err
    assert main(train_argv(shards, tmp_path / "r", steps=1) + ["--set", "model.vocab_size=300"]) == 0
    config = LMConfig(d_model=16, n_layers=1, n_heads=2, attention="local:4")  # vocab_size 256
    with pytest.raises(ValueError, match="has a tokenizer of 300 tokens but the model has vocab_size=256"):
        train(config, TrainConfig(data=str(shards), out=str(tmp_path / "lib"), steps=1, batch_size=2, context=8,
                                  eval_every=0), progress=False, echo=quiet)


def _without_hashes(shards: Path, copy: Path) -> None:
    """``shards`` copied to ``copy`` with a meta.json as an older linattn wrote it (no SHA-256
    and no largest id per split), so that its .bin files can be edited."""
    shutil.copytree(shards, copy)
    meta = json.loads((copy / "meta.json").read_text())
    for split in meta["splits"].values():
        split.pop("sha256", None), split.pop("max_token_id", None)
    (copy / "meta.json").write_text(json.dumps(meta))


def _put_id(path: Path, position: int, token: int) -> None:
    ids = np.fromfile(path, dtype="<u2")
    ids[position] = token
    ids.tofile(path)


def test_a_shard_id_beyond_the_vocabulary_is_refused_naming_the_file_the_id_and_the_vocabulary(bpe_run, tmp_path,
                                                                                               capsys):
    """One id of 4000 in a folder of a 300-token tokenizer: training (in the train or the
    validation split) and eval stop with one line, not an IndexError from the embedding."""
    shards, run, _ = bpe_run
    for split in ("train", "validation"):
        copy = tmp_path / split
        _without_hashes(shards, copy)
        _put_id(copy / f"{split}.bin", 7, 4000)
        capsys.readouterr()
        assert main(train_argv(copy, tmp_path / f"run-{split}", steps=2)) == 2
        err = capsys.readouterr().err
        assert err.startswith("linattn: error: ") and err.count("\n") == 1, err
        assert f"{copy / f'{split}.bin'} holds token id 4000, but the model's vocabulary has 300 tokens" in err, err
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(run), "--data", str(tmp_path / "validation"), "--split", "validation",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'validation' / 'validation.bin'} holds token id 4000, but the model's vocabulary has 300 " \
           f"tokens" in err, err


def test_resume_on_shards_continues_exactly(bpe_run, tmp_path):
    shards, _, _ = bpe_run
    model_config = LMConfig(vocab_size=300, d_model=16, n_layers=1, attention="vq", gau_d_k=8,
                            codebook_size=8, block_size=4)
    train_config = TrainConfig(data=str(shards), out=str(tmp_path / "whole"), steps=6, batch_size=2, context=8,
                               eval_every=3, eval_tokens=128, checkpoint_every=3, log_every=1, warmup_steps=2)
    whole = train(model_config, train_config, progress=False, echo=quiet)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole", resumed_dir)
    resumed = train(None, None, resume=True, resume_from=3, out=resumed_dir, progress=False, echo=quiet)
    assert resumed["start_step"] == 3 and resumed["final_bpb"] == whole["final_bpb"]
    assert _curve(resumed_dir) == _curve(tmp_path / "whole")
    assert [r["step"] for r in _curve(resumed_dir) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    for name, tensor in whole["model"].state_dict().items():
        assert torch.equal(tensor, resumed["model"].state_dict()[name]), name


def test_export_writes_a_tokenizer_auto_tokenizer_loads(bpe_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import linattn.hf  # noqa: F401 - registers the Auto classes

    shards, run, plays = bpe_run
    assert main(["export", "--ckpt", str(run), "--out", str(tmp_path / "hf")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    reference = Tokenizer.from_file(str(shards / "tokenizer.json"))
    text = plays["test"][:200]
    assert tokenizer(text).input_ids == reference.encode(text).ids
    assert tokenizer.decode(reference.encode(text).ids) == text and tokenizer.padding_side == "left"
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    lm, _ = load_model(run)
    ids = torch.tensor([reference.encode(text).ids[:20]])
    assert torch.equal(exported(ids).logits, lm(ids)[0])


_TRAIN_UNDER_A_LIMIT = """
import resource, sys
import numpy as np
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
try:  # the limit holds: the shard cannot be read into memory
    np.fromfile(sys.argv[1] + "/train.bin", dtype="<u2")
    sys.exit("read the whole shard despite the limit")
except MemoryError:
    pass
from linattn.cli import main
sys.exit(main(["train", "--data", sys.argv[1], "--out", sys.argv[2], "--steps", "2", "--attention", "local:4",
               "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--batch-size", "2", "--context", "8",
               "--eval-every", "2", "--set", "train.eval_tokens=128", "--no-progress", "--threads", "1"]))
"""


def test_a_shard_larger_than_the_process_may_allocate_trains(bpe_run, tmp_path):
    """The train shard is grown (sparsely) to 1.5 GiB; the process may allocate 1 GiB of data (and
    reads the whole shard once, to check its SHA-256)."""
    shards, _, _ = bpe_run
    big = tmp_path / "big"
    shutil.copytree(shards, big)
    size = 3 << 29
    with open(big / "train.bin", "r+b") as handle:
        handle.truncate(size)
    meta = json.loads((big / "meta.json").read_text())
    meta["splits"]["train"]["tokens"] = size // 2
    with open(big / "train.bin", "rb") as handle:  # the run checks the file against it, reading it in pieces
        meta["splits"]["train"]["sha256"] = hashlib.file_digest(handle, "sha256").hexdigest()
    (big / "meta.json").write_text(json.dumps(meta))
    src = str(Path(__file__).resolve().parents[1] / "src")
    result = subprocess.run([sys.executable, "-c", _TRAIN_UNDER_A_LIMIT, str(big), str(tmp_path / "run"),
                             str(1 << 30)], env={**os.environ, "PYTHONPATH": src}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "validation bpb" in result.stdout
    assert load_checkpoint(tmp_path / "run").step == 2
    assert os.stat(big / "train.bin").st_blocks * 512 < 64 << 20  # still sparse: nothing wrote to it
    assert np.memmap(big / "train.bin", dtype="<u2", mode="r")[-4:].tolist() == [0, 0, 0, 0]
