"""``linattn train --resume`` as a user meets it: choosing a checkpoint (``--from``), a corrupt or
missing ``latest``, extending a finished run (``--steps``), and what the command prints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from linattn.cli import main
from linattn.train import load_checkpoint
from linattn.train.schedule import learning_rate
from _helpers import english_like

ARCH = ["--attention", "vq,local:4", "--d-model", "16", "--n-layers", "2", "--n-heads", "2",
        "--set", "model.gau_d_k=8", "--set", "model.codebook_size=8", "--set", "model.block_size=4",
        "--set", "model.chunk_size=4", "--set", "model.ffn_hidden=32", "--set", "train.warmup_steps=2",
        "--set", "train.keep_checkpoints=4"]


def _train(tmp_path: Path, name: str, steps: int, *extra: str) -> list[str]:
    data = tmp_path / "corpus.txt"
    if not data.exists():
        data.write_text(english_like(4000))
    return ["train", "--data", str(data), "--out", str(tmp_path / name), "--steps", str(steps), *ARCH,
            "--batch-size", "2", "--context", "16", "--lr", "0.003", "--checkpoint-every", "3", "--log-every", "1",
            "--no-progress", "--threads", "1", *extra]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run) if "loss" in r}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 9-step run with checkpoints at 3, 6, 9."""
    tmp_path = tmp_path_factory.mktemp("resume")
    assert main(_train(tmp_path, "run", 9, "--eval-every", "0")) == 0
    return tmp_path, tmp_path / "run"


def _copy(finished, name: str) -> Path:
    tmp_path, run = finished
    copy = tmp_path / name
    shutil.copytree(run, copy)
    return copy


def test_resume_from_an_earlier_step_retrains_the_same_steps(finished, capsys):
    run = _copy(finished, "from-step")
    reference = _losses(run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(line for line in lines if json.loads(line).get("step", 0) <= 3) + "\n")
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(run), "--from", "3", "--no-progress", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "resuming" in out and "at step 3 of 9" in out
    assert _losses(run) == reference


def test_resume_from_a_checkpoint_folder(finished, capsys):
    run = _copy(finished, "from-path")
    folder = run / "checkpoints" / "step-00000006"
    assert main(["train", "--resume", "--out", str(run), "--from", str(folder), "--no-progress"]) == 0
    assert "at step 6 of 9" in capsys.readouterr().out


def test_from_a_step_that_does_not_exist_lists_the_usable_ones(finished, capsys):
    run = _copy(finished, "from-missing")
    assert main(["train", "--resume", "--out", str(run), "--from", "5", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "step-00000005 does not exist" in err and "3, 6, 9" in err


def test_from_without_resume_is_an_error(finished, capsys):
    tmp_path, _ = finished
    assert main(_train(tmp_path, "fresh", 3, "--from", "3")) == 2
    assert "add --resume" in capsys.readouterr().err


def test_corrupt_latest_names_the_earlier_checkpoints_and_the_command(finished, capsys):
    run = _copy(finished, "corrupt")
    model_file = run / "checkpoints" / "step-00000009" / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-1] ^= 0xFF
    model_file.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(run), "--steps", "12", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "step-00000006 (step 6)" in err and "step-00000003 (step 3)" in err
    command = f"linattn train --resume --out {run} --from 6"
    assert command in err
    assert main(command.split()[1:] + ["--steps", "12", "--no-progress"]) == 0  # the command works as printed
    assert load_checkpoint(run).step == 12


def test_missing_latest_falls_back_to_the_newest_complete_checkpoint(finished, capsys):
    run = _copy(finished, "no-latest")
    (run / "checkpoints" / "latest").unlink()
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(run), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "latest is missing; resuming from the newest complete checkpoint, step-00000009" in out
    assert "is finished" in out


def test_finished_run_says_so_and_how_to_extend_it(finished, capsys):
    run = _copy(finished, "done")
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(run), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"the run in {run} is finished (step 9 of 9)" in out and "--steps N (N > 9)" in out
    assert (run / "metrics.jsonl").read_text() == before


def test_extending_a_finished_run_keeps_the_schedule_and_trains_at_its_floor(finished, capsys):
    """--steps 14 on a finished 9-step run: steps 10..14 run at the floor learning rate of the
    original schedule, and the extension is itself exactly resumable."""
    run = _copy(finished, "extend")
    assert main(["train", "--resume", "--out", str(run), "--steps", "14", "--no-progress"]) == 0
    records = [r for r in _records(run) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 15))
    floor = learning_rate(8, peak=0.003, total_steps=9, warmup_steps=2, min_ratio=0.1)
    assert [r["lr"] for r in records[9:]] == [floor] * 5
    assert [r["lr"] for r in records[:9]] == [learning_rate(s, peak=0.003, total_steps=9, warmup_steps=2,
                                                            min_ratio=0.1) for s in range(9)]
    meta = load_checkpoint(run).meta["train_config"]
    assert meta["steps"] == 14 and meta["decay_steps"] == 9
    # the extended run resumed from its step-12 checkpoint ends on the same curve
    again = _copy(finished, "extend-again")
    assert main(["train", "--resume", "--out", str(again), "--steps", "14", "--no-progress"]) == 0
    shutil.rmtree(again / "checkpoints" / "step-00000014")
    (again / "checkpoints" / "latest").write_text("step-00000012\n")
    assert main(["train", "--resume", "--out", str(again), "--no-progress"]) == 0
    assert _losses(again) == _losses(run)
    final = {k: v for k, v in load_checkpoint(again).model.items()}
    for name, value in load_checkpoint(run).model.items():
        assert torch.equal(final[name], value), name


def test_summary_line_without_validation(finished, capsys):
    tmp_path, _ = finished
    capsys.readouterr()
    assert main(_train(tmp_path, "summary", 3, "--eval-every", "0")) == 0
    out = capsys.readouterr().out
    assert "last training loss:" in out and "at step 3" in out and "no validation" in out


def test_eval_help_states_the_default_split(capsys):
    assert main(["eval", "--help"]) == 0
    assert "default: test" in capsys.readouterr().out


def test_progress_bar_labels_validation_bpb_with_its_step(tmp_path, capsys):
    """The bar never shows the pre-training evaluation as if it were current: every validation
    bpb it prints names the step it was measured at."""
    capsys.readouterr()
    argv = [a for a in _train(tmp_path, "bar", 6, "--eval-every", "3") if a != "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "val_bpb@6=" in err
    assert "val_bpb=" not in err
