"""Training is bit-exact at two threads: identical runs give identical losses, weights and
optimizer state, and a run resumed from a checkpoint continues the identical curve.

Two threads split reductions and accumulations; an op whose result depended on how work
was split (an index backward that adds repeated indices in thread order) would make the
runs below differ. Every comparison is ``==``. The VQ block is 128 positions (the
default) because torch splits such work across threads only past ~32k elements: with the
relative-bias table read by an index op (the code before this test), these runs differ
from the first steps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from linattn.models import LMConfig
from linattn.train import TrainConfig, train
from _helpers import english_like

ATTENTION = "vq,delta,softmax"


@pytest.fixture(autouse=True)
def two_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _model_config() -> LMConfig:
    return LMConfig(d_model=32, n_layers=3, attention=ATTENTION, n_heads=2, gau_d_k=16, codebook_size=16,
                    block_size=128, chunk_size=8, ffn_hidden=64, dead_code_threshold=0.5)


def _run(tmp_path: Path, name: str, steps: int = 12) -> Path:
    data = tmp_path / "corpus.txt"
    if not data.exists():
        data.write_text(english_like(6000))
    out = tmp_path / name
    config = TrainConfig(data=str(data), out=str(out), steps=steps, batch_size=2, context=256, lr=3e-3,
                         warmup_steps=2, eval_every=0, log_every=1, checkpoint_every=4, keep_checkpoints=3, threads=2)
    train(_model_config(), config, progress=False, echo=lambda *a: None)
    return out


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records if "loss" in r]


def _tensors(run: Path, step: int) -> dict[str, torch.Tensor]:
    folder = run / "checkpoints" / f"step-{step:08d}"
    return {**load_file(folder / "model.safetensors"),
            **{f"training.{k}": v for k, v in load_file(folder / "training.safetensors").items()}}


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"tensors that differ: {different[:8]}"


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("determinism")
    before = torch.get_num_threads()
    try:
        return tmp_path, _run(tmp_path, "first"), _run(tmp_path, "second")
    finally:
        torch.set_num_threads(before)


def test_two_runs_at_two_threads_are_identical(reference_runs):
    _, first, second = reference_runs
    assert len(_losses(first)) == 12
    assert _losses(first) == _losses(second)
    _assert_identical(_tensors(first, 12), _tensors(second, 12))


def test_resume_at_two_threads_continues_the_identical_run(reference_runs):
    """What a SIGKILL after the step-8 checkpoint leaves (checkpoints to step 8, metrics to
    step 8), resumed, must end where the uninterrupted run ended, bit for bit."""
    tmp_path, first, _ = reference_runs
    killed = tmp_path / "killed"
    (killed / "checkpoints").mkdir(parents=True)
    for step in (4, 8):
        name = f"step-{step:08d}"
        shutil.copytree(first / "checkpoints" / name, killed / "checkpoints" / name)
    (killed / "checkpoints" / "latest").write_text("step-00000008\n")
    lines = (first / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in lines if json.loads(line).get("step", 0) <= 8]
    (killed / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    train(None, None, resume=True, out=str(killed), progress=False, echo=lambda *a: None)
    assert _losses(killed) == _losses(first)
    _assert_identical(_tensors(killed, 12), _tensors(first, 12))
