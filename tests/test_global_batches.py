"""What a run computes does not depend on its number of processes: the evaluation batch is
global (``train.eval_batch_size`` streams in all, shared by the processes), so the validation
bits per byte of 1 and 2 processes are equal; and a run resumed onto fewer, fuller processes
may change its gradient accumulation and activation checkpointing, as long as its global
batch is kept (a change of the global batch is refused by name).

Models are float64 (as in tests/test_train_parallel.py). One spawn of 2 processes trains the
2-process run; the single-process run and the resumes run in this process."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from linattn.cli import main
from linattn.models import LM
from linattn.train import Checkpoint, load_checkpoint, train
from linattn.train import trainer as trainer_module
from linattn.train.resharding import global_eval_streams
from _helpers import english_like
from test_train_parallel import model_config, run_config

WORLD = 2
STEPS = 4
KEYS = ("step", "loss", "grad_norm", "lr")


def config(root: Path, name: str, batch_size: int):
    """4 training streams in all, 2 micro-batches per process; 3 evaluation streams in all
    (shared 1 + 2 by two processes), evaluated at steps 0, 2 and 4; checkpoints at 2 and 4."""
    return run_config(root / "corpus.txt", root / name, steps=STEPS, batch_size=batch_size, grad_accum_steps=2,
                      eval_every=2, eval_batch_size=3, checkpoint_every=2, keep_checkpoints=3)


def _quiet(*args) -> None:
    pass


def _train_in_float64(root: Path, name: str, batch_size: int) -> None:
    patch = pytest.MonkeyPatch()
    patch.setattr(trainer_module, "LM", lambda config: LM(config).double())
    try:
        train(model_config(), config(root, name, batch_size=batch_size), progress=False, echo=_quiet)
    finally:
        patch.undo()


def _two_processes(rank: int, root: str) -> None:
    root = Path(root)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root / 'init'}", rank=rank, world_size=WORLD)
    try:
        _train_in_float64(root, "two", batch_size=2)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("global")
    (root / "corpus.txt").write_text(english_like(3000, seed=4))
    mp.spawn(_two_processes, args=(str(root),), nprocs=WORLD, join=True)
    _train_in_float64(root, "one", batch_size=4)
    return root


def _records(run: Path, kind: str) -> list[dict]:
    lines = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r for r in lines if (r.get("split") == "validation") == (kind == "validation") and "step" in r
            and ("loss" in r or kind == "validation")]


def test_validation_bits_per_byte_are_those_of_one_process(runs):
    """Before training both runs hold the same weights: the bits per byte of 2 processes
    (streams 0 | 1-2) are the single process's (streams 0-2), to float64 rounding; the old
    per-process evaluation batch read 3 streams per process, 6 in all, and scored other
    tokens. After training the weights differ by the order of sums over processes."""
    one, two = _records(runs / "one", "validation"), _records(runs / "two", "validation")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 2, 4]
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]
    assert two[0]["bpb"] == pytest.approx(one[0]["bpb"], rel=1e-13, abs=0)
    for a, b in zip(one[1:], two[1:]):
        assert b["bpb"] == pytest.approx(a["bpb"], rel=1e-9), a["step"]
    assert load_checkpoint(runs / "two").meta["train_config"]["eval_batch_size"] == 3


@pytest.fixture
def resumable(runs, tmp_path) -> Path:
    """A copy of the 2-process run, to be resumed from its step-2 checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(runs / "two", run)
    return run


def test_a_resume_onto_one_process_may_double_the_accumulation_and_checkpoint_activations(runs, resumable,
                                                                                          monkeypatch, capsys):
    """The 2-process run (2 streams per process, 2 micro-batches of 1) resumed at step 2 in one
    process that reads all 4 streams as 4 micro-batches of 1, with activation checkpointing:
    the memory of a step stays that of one stream, and the steps follow the uninterrupted
    2-process run's (to the order of sums over processes)."""
    monkeypatch.setattr(trainer_module, "LM", lambda config: LM(config).double())
    code = main(["train", "--resume", "--out", str(resumable), "--from", "2", "--no-progress",
                 "--set", "train.grad_accum_steps=4", "--set", "train.activation_checkpointing=true"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "continued by 1 process of 4 streams each: the same global batch of 4 streams" in out.out
    recorded = load_checkpoint(resumable).meta
    assert recorded["step"] == STEPS and recorded["world_size"] == 1
    assert {k: recorded["train_config"][k] for k in ("batch_size", "grad_accum_steps", "activation_checkpointing",
                                                     "eval_batch_size")} == \
        {"batch_size": 4, "grad_accum_steps": 4, "activation_checkpointing": True, "eval_batch_size": 3}
    uninterrupted = _records(runs / "two", "training")
    resumed = _records(resumable, "training")
    assert [r["step"] for r in resumed] == [r["step"] for r in uninterrupted] == list(range(1, STEPS + 1))
    for a, b in zip(uninterrupted, resumed):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-9), (a["step"], key)
    evaluated = _records(resumable, "validation")
    assert evaluated[-1]["bpb"] == pytest.approx(_records(runs / "two", "validation")[-1]["bpb"], rel=1e-9)


def test_a_resume_that_changes_the_global_batch_is_refused_by_name(resumable, monkeypatch, capsys):
    before = sorted(p.name for p in (resumable / "checkpoints").iterdir())
    code = main(["train", "--resume", "--out", str(resumable), "--no-progress", "--batch-size", "3"])
    assert code == 2
    assert capsys.readouterr().err == (
        "linattn: error: --resume: train.batch_size=3 per process x 1 process = 3 streams would change the run's "
        "global batch of 4 streams (train.batch_size=2 per process x 2 processes), and with it the data every step "
        "reads; a resume keeps the global batch: leave it out (it becomes 4 per process), or start a new run\n")
    code = main(["train", "--resume", "--out", str(resumable), "--no-progress", "--set", "train.lr=0.1"])
    assert code == 2
    assert capsys.readouterr().err.startswith(
        "linattn: error: --resume takes the run's settings from its checkpoint: train.lr cannot change (a resume "
        "may change train.batch_size, train.grad_accum_steps, train.activation_checkpointing, ")
    assert sorted(p.name for p in (resumable / "checkpoints").iterdir()) == before


def test_a_checkpoint_of_per_process_evaluation_batches_keeps_its_global_one():
    """Checkpoints written when ``train.eval_batch_size`` counted streams per process record no
    ``eval_streams``: their global evaluation batch is that times their processes."""
    older = Checkpoint(path=Path("step-00000002"), model={}, training={},
                       meta={"world_size": 2, "train_config": {"eval_batch_size": 3}, "data": {"streams": 4}})
    assert global_eval_streams(older) == 6
    newer = Checkpoint(path=Path("step-00000002"), model={}, training={},
                       meta={"world_size": 2, "train_config": {"eval_batch_size": 3},
                             "data": {"streams": 4, "eval_streams": 3}})
    assert global_eval_streams(newer) == 3
