"""Training in 2 processes (gloo on this CPU, spawned like ``torchrun`` would): with gradient
accumulation under DDP, the run follows the single-process run over the same global batch,
in float64 up to rounding. Both processes run their trainings in one spawn, one after the
other, to keep the test to a few seconds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from linattn.models import LM, LMConfig
from linattn.train import TrainConfig, load_checkpoint, train
from linattn.train import trainer as trainer_module
from linattn.train.microbatch import join_states
from _helpers import F64, assert_close_rel, english_like
from test_grad_accum import assert_states_close

WORLD = 2
STEPS = 3


def model_config() -> LMConfig:
    return LMConfig(d_model=16, n_layers=2, attention="vq,delta", n_heads=2, gau_d_k=8, codebook_size=16,
                    block_size=4, chunk_size=4, ffn_hidden=32)


def run_config(data: Path, out: Path, **overrides) -> TrainConfig:
    """Global batch of 8 streams: ``batch_size`` per process times the number of processes."""
    options = dict(data=str(data), out=str(out), steps=STEPS, batch_size=8, context=16, lr=3e-3, warmup_steps=1,
                   eval_every=0, log_every=1, checkpoint_every=STEPS, threads=1)
    return TrainConfig(**{**options, **overrides})


def _float64_models(patch) -> None:
    patch.setattr(trainer_module, "LM", lambda config: LM(config).double())


def _worker(rank: int, root: str) -> None:
    root = Path(root)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root / 'init'}", rank=rank, world_size=WORLD)
    patch = pytest.MonkeyPatch()
    _float64_models(patch)
    deferred = []
    original_no_sync = DistributedDataParallel.no_sync

    def counting_no_sync(self):
        deferred.append(1)
        return original_no_sync(self)

    patch.setattr(DistributedDataParallel, "no_sync", counting_no_sync)
    try:
        data = root / "corpus.txt"
        train(model_config(), run_config(data, root / "ddp", batch_size=4, grad_accum_steps=2), progress=False,
              echo=lambda *a: None)
        (root / f"deferred{rank}.json").write_text(json.dumps(len(deferred)))
    finally:
        patch.undo()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    (root / "corpus.txt").write_text(english_like(3000, seed=4))
    patch = pytest.MonkeyPatch()
    _float64_models(patch)
    try:
        train(model_config(), run_config(root / "corpus.txt", root / "single"), progress=False,
              echo=lambda *a: None)
    finally:
        patch.undo()
    mp.spawn(_worker, args=(str(root),), nprocs=WORLD, join=True)
    return root


def _records(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def assert_follows_single_process_run(root: Path, name: str) -> None:
    """Losses, gradient norms, final weights and codebooks, and both processes' carried
    states (stacked: the single process's 8 streams) match the single-process run."""
    single, parallel = _records(root / "single"), _records(root / name)
    assert [r["step"] for r in parallel] == list(range(1, STEPS + 1))
    for a, b in zip(single, parallel):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-9), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-9), a["step"]
        assert b["commit_loss"] == pytest.approx(a["commit_loss"], rel=1e-6), a["step"]  # float32
    reference, checkpoint = load_checkpoint(root / "single"), load_checkpoint(root / name)
    assert checkpoint.meta["world_size"] == WORLD and checkpoint.step == STEPS
    assert sorted(checkpoint.model) == sorted(reference.model)
    for key, value in reference.model.items():
        if not value.is_floating_point():
            assert torch.equal(checkpoint.model[key], value), key
        else:
            assert checkpoint.model[key].dtype == value.dtype, key
            # AdamW divides by sqrt(v) + eps: where a gradient is tiny, its float64 rounding
            # (another order of sums over processes) shows at ~1e-8 in the weights after a few steps
            assert_close_rel(checkpoint.model[key], value, rtol=1e-7 if value.dtype == F64 else 1e-5, name=key)
    # the VQ states hold codes of the float32 codebooks
    assert_states_close(join_states([checkpoint.carry(0), checkpoint.carry(1)]), reference.carry(0), rtol=1e-6)


def test_ddp_with_accumulation_follows_the_single_process_run(parallel_runs):
    assert_follows_single_process_run(parallel_runs, "ddp")


def test_ddp_defers_the_gradient_all_reduce_to_the_last_micro_batch(parallel_runs):
    for rank in range(WORLD):
        assert json.loads((parallel_runs / f"deferred{rank}.json").read_text()) == STEPS  # 1 of 2 micro-batches
