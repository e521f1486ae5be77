"""A checkpoint resumes at another number of processes and under the other strategy, with
the same global batch (``train/resharding.py``): a DDP run of 2 processes, resumed at step 2
in 1 process and at step 4 in 2 processes again, and the same run resumed at step 2 under
FSDP and at step 4 under DDP, follow the uninterrupted 2-process DDP run.

Models are float64 (as in tests/test_train_parallel.py), so that what the number of
processes changes shows at its true size: the order of the sums that cross processes (the
loss and gradient means, the codebooks' statistics, which stay float32)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from linattn.models import LM
from linattn.train import load_checkpoint, train
from linattn.train import trainer as trainer_module
from linattn.train.microbatch import join_states
from _helpers import assert_close_rel, english_like
from test_grad_accum import assert_states_close
from test_train_parallel import model_config, run_config

WORLD = 2
STEPS = 6
KEYS = ("step", "loss", "grad_norm", "commit_loss", "lr", "codebook_perplexity")


def config(root: Path, name: str):
    """8 streams in all (4 per process of 2), 2 micro-batches each, a checkpoint every 2 steps."""
    return run_config(root / "corpus.txt", root / name, steps=STEPS, batch_size=4, grad_accum_steps=2,
                      checkpoint_every=2, keep_checkpoints=3)


def _float64(patch: pytest.MonkeyPatch) -> None:
    patch.setattr(trainer_module, "LM", lambda config: LM(config).double())


def _quiet(*args) -> None:
    pass


def _in_processes(rank: int, root: str) -> None:
    """Both processes: the uninterrupted DDP run and the DDP -> FSDP -> DDP chain; then rank 0
    alone, as a run of one process, resumes the other chain at step 2 to step 4, and both
    continue it from there to the end."""
    root = Path(root)
    torch.set_num_threads(1)
    patch = pytest.MonkeyPatch()
    _float64(patch)
    try:
        _join(rank, root / "init-first")
        train(model_config(), config(root, "ddp"), progress=False, echo=_quiet)
        if rank == 0:
            for name in ("via-one-process", "via-fsdp"):
                shutil.copytree(root / "ddp", root / name)
        dist.barrier()
        train(None, None, resume=True, resume_from=2, steps=4, out=root / "via-fsdp", parallel="fsdp",
              progress=False, echo=_quiet)
        dist.barrier()  # rank 0 has written step 4
        train(None, None, resume=True, steps=STEPS, out=root / "via-fsdp", parallel="ddp", progress=False,
              echo=_quiet)
        dist.destroy_process_group()

        done = root / "one-process-done"
        if rank == 0:  # steps 3 and 4 in one process
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            lines = []
            train(None, None, resume=True, resume_from=2, steps=4, out=root / "via-one-process", progress=False,
                  echo=lines.append)
            (root / "one-process-echo.json").write_text(json.dumps(lines))
            shutil.copytree(root / "via-one-process" / "checkpoints" / "step-00000004",
                            root / "written-by-one-process")
            done.touch()
        while not done.exists():
            time.sleep(0.1)

        _join(rank, root / "init-last")
        lines = []
        train(None, None, resume=True, steps=STEPS, out=root / "via-one-process", progress=False, echo=lines.append)
        (root / f"via-one-process-echo{rank}.json").write_text(json.dumps(lines))
    finally:
        patch.undo()
        if dist.is_initialized():
            dist.destroy_process_group()


def _join(rank: int, init: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resharding")
    (root / "corpus.txt").write_text(english_like(3000, seed=4))
    mp.spawn(_in_processes, args=(str(root),), nprocs=WORLD, join=True)
    return root


def records(run: Path) -> list[tuple]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [tuple(r[k] for k in KEYS) for r in map(json.loads, lines) if "loss" in r]


def assert_follows(resumed: list[tuple], uninterrupted: list[tuple], equal_until: int, rel: float) -> None:
    """Steps up to ``equal_until`` are the uninterrupted run's own (==); the later ones equal it
    up to the order of sums: the float64 losses and gradient norms to ``rel``, the commitment
    loss and code perplexity (float32 codebooks) to 1e-6."""
    assert [r[0] for r in resumed] == [r[0] for r in uninterrupted] == list(range(1, STEPS + 1))
    assert resumed[:equal_until] == uninterrupted[:equal_until]
    for got, wanted in zip(resumed[equal_until:], uninterrupted[equal_until:]):
        step, loss, grad_norm, commit, lr, perplexity = got
        assert lr == wanted[4], step
        assert loss == pytest.approx(wanted[1], rel=rel), step
        assert grad_norm == pytest.approx(wanted[2], rel=rel), step
        assert commit == pytest.approx(wanted[3], rel=1e-6), step
        assert perplexity == pytest.approx(wanted[5], rel=1e-6), step


def assert_same_end(root: Path, name: str) -> None:
    """The final weights, optimizer state and both ranks' carried states (stacked: the 8
    streams) of the resumed run are the uninterrupted run's, to the rounding above."""
    reference, resumed = load_checkpoint(root / "ddp"), load_checkpoint(root / name)
    assert resumed.step == reference.step == STEPS and resumed.meta["world_size"] == WORLD
    for key, value in reference.model.items():
        if value.is_floating_point():
            assert_close_rel(resumed.model[key], value, rtol=1e-7 if value.dtype == torch.float64 else 1e-5, name=key)
        else:
            assert torch.equal(resumed.model[key], value), key
    assert_states_close(join_states([resumed.carry(0), resumed.carry(1)]),
                        join_states([reference.carry(0), reference.carry(1)]), rtol=1e-6)


def test_resume_2_then_1_then_2_processes_follows_the_uninterrupted_run(runs):
    """Steps 3 and 4 ran in one process: its loss and gradients are means over the 8 streams
    summed in another grouping than two processes' means of 4 (and their all-reduce); the
    last bits differ from step 3 on and AdamW carries them on (about 1e-11 by step 6)."""
    assert_follows(records(runs / "via-one-process"), records(runs / "ddp"), equal_until=2, rel=1e-9)
    assert_same_end(runs, "via-one-process")


def test_the_one_process_segment_read_the_global_batch_in_one_process(runs):
    """The checkpoint written in one process records 8 streams in 1 process; the resume said
    how the batch was re-cut, each time."""
    single = load_checkpoint(runs / "written-by-one-process")
    assert single.meta["world_size"] == 1 and single.meta["train_config"]["batch_size"] == 8
    assert single.meta["data"]["streams"] == 8 and len(single.meta["carry"]) == 1
    assert single.carry(0) is not None
    [line] = json.loads((runs / "one-process-echo.json").read_text())
    assert line.startswith(f"resuming {runs / 'via-one-process'} at step 2 of 4 from ")
    assert line.endswith("(written by 2 processes, continued by 1 process of 8 streams each: the same global batch "
                         "of 8 streams)")
    [line] = json.loads((runs / "via-one-process-echo0.json").read_text())
    assert line.startswith(f"resuming {runs / 'via-one-process'} at step 4 of 6 from ")
    assert line.endswith("(written by 1 process, continued by 2 processes of 4 streams each: the same global batch "
                         "of 8 streams)")
    assert json.loads((runs / "via-one-process-echo1.json").read_text()) == []  # rank 1 says nothing


def test_resume_ddp_then_fsdp_then_ddp_follows_the_uninterrupted_run(runs):
    """The same 2 processes under FSDP for steps 3 and 4: the gradients are the same two
    ranks' sums, halved, so the losses come out equal; the gradient norm is summed over
    shards in another order (a last-bit difference, which moves the clipping factor by as
    much), hence the 1e-12."""
    assert_follows(records(runs / "via-fsdp"), records(runs / "ddp"), equal_until=2, rel=1e-12)
    assert_same_end(runs, "via-fsdp")
    step4 = load_checkpoint(runs / "via-fsdp" / "checkpoints" / "step-00000004")
    assert step4.meta["train_config"]["parallel"] == "fsdp"
    assert load_checkpoint(runs / "via-fsdp").meta["train_config"]["parallel"] == "ddp"
