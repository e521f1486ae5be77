"""``train.tensorboard = true``: the scalars in <run>/tensorboard/ are the metrics.jsonl
records (read back with TensorBoard's own reader), a resumed run does not log a step
twice, and runs without it do not need the tensorboard package."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from linattn.cli import main
from _helpers import english_like
from test_train_cli import train_argv

TENSORBOARD = ["--set", "train.tensorboard=true"]


def read_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def read_records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tb") / "tiny.txt"
    path.write_text(english_like(4000), encoding="utf-8")
    return path


def test_scalars_are_the_metrics_records(corpus, tmp_path):
    run = tmp_path / "run"
    assert main(train_argv(corpus, run, steps=6) + TENSORBOARD + ["--log-every", "2", "--eval-every", "3"]) == 0
    scalars = read_scalars(run)
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in read_records(run):
        split = record.get("split", "train")
        for key, value in record.items():
            if key not in ("step", "split"):
                expected.setdefault(f"{split}/{key}", []).append((record["step"], value))
    assert set(scalars) == set(expected) and {"train/loss", "train/lr", "validation/bpb"} <= set(scalars)
    for tag, points in expected.items():
        assert [step for step, _ in scalars[tag]] == [step for step, _ in points], tag
        assert [value for _, value in scalars[tag]] == pytest.approx([value for _, value in points], rel=1e-6), tag
    assert [step for step, _ in scalars["validation/bpb"]] == [0, 3, 6]


def test_a_resumed_run_logs_each_step_once(corpus, tmp_path):
    run = tmp_path / "run"
    argv = train_argv(corpus, run, steps=6) + TENSORBOARD + ["--log-every", "1", "--checkpoint-every", "3",
                                                             "--set", "train.keep_checkpoints=3"]
    assert main(argv) == 0
    again = tmp_path / "again"
    shutil.copytree(run, again)
    assert main(["train", "--resume", "--out", str(again), "--from", "3", "--no-progress", "--threads", "1"]) == 0
    scalars = read_scalars(again)
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]
    losses = [r["loss"] for r in read_records(again) if "loss" in r]
    assert [value for _, value in scalars["train/loss"]] == pytest.approx(losses, rel=1e-6)


def test_runs_without_tensorboard_do_not_import_it(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # importing it now fails
    assert main(train_argv(corpus, tmp_path / "plain", steps=2)) == 0
    assert not (tmp_path / "plain" / "tensorboard").exists()
    capsys.readouterr()
    assert main(train_argv(corpus, tmp_path / "asked", steps=2) + TENSORBOARD) == 2
    assert "train.tensorboard = true needs the tensorboard package" in capsys.readouterr().err
    assert main(train_argv(corpus, tmp_path / "bad", steps=2) + ["--set", "train.tensorboard=1"]) == 2
    assert "train.tensorboard must be a bool" in capsys.readouterr().err
