"""Training in 2 processes (gloo on this CPU, spawned like ``torchrun`` would): under DDP and
under FSDP2, with gradient accumulation (and activation checkpointing under FSDP), a run
follows the single-process run over the same global batch in float64 up to rounding; the
FSDP run's checkpoint loads into one process, and the FSDP run resumes exactly. Both
processes run their trainings in one spawn, one after the other, to keep the test short."""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import linattn
from linattn.models import LM, LMConfig
from linattn.train import TrainConfig, evaluate_bpb, load_checkpoint, load_model, train
from linattn.train import trainer as trainer_module
from linattn.train.microbatch import join_states
from _helpers import F64, assert_close_rel, english_like, run_ranks
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
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            _trainings(rank, root, deferred)
        (root / f"warnings{rank}.json").write_text(json.dumps(
            [{"category": w.category.__name__, "file": w.filename, "line": w.lineno, "message": str(w.message)}
             for w in shown]))
    finally:
        patch.undo()
        dist.destroy_process_group()


def _trainings(rank: int, root: Path, deferred: list) -> None:
    """DDP, FSDP and the FSDP run resumed from step 2, in both processes."""
    data = root / "corpus.txt"
    train(model_config(), run_config(data, root / "ddp", batch_size=4, grad_accum_steps=2), progress=False,
          echo=lambda *a: None)
    (root / f"deferred{rank}.json").write_text(json.dumps(len(deferred)))
    train(model_config(), run_config(data, root / "fsdp", batch_size=4, grad_accum_steps=2, parallel="fsdp",
                                     activation_checkpointing=True, checkpoint_every=2, keep_checkpoints=3),
          progress=False, echo=lambda *a: None)
    if rank == 0:
        shutil.copytree(root / "fsdp", root / "fsdp-resumed")
    dist.barrier()
    train(None, None, resume=True, resume_from=2, out=root / "fsdp-resumed", progress=False, echo=lambda *a: None)


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


def test_fsdp_with_accumulation_and_checkpointing_follows_the_single_process_run(parallel_runs):
    assert_follows_single_process_run(parallel_runs, "fsdp")
    meta = load_checkpoint(parallel_runs / "fsdp").meta
    assert meta["train_config"]["parallel"] == "fsdp" and meta["train_config"]["activation_checkpointing"]


def test_an_fsdp_checkpoint_loads_into_one_process(parallel_runs):
    """The gathered checkpoint is an ordinary one: ``load_model`` (eval, generate, export)
    reads it, its optimizer state is indexed like a single process's, and the model
    evaluates and generates as the single-process run's does."""
    fsdp, fsdp_checkpoint = load_model(parallel_runs / "fsdp")
    single, single_checkpoint = load_model(parallel_runs / "single")
    optimizer, expected = fsdp_checkpoint.optimizer_state(), single_checkpoint.optimizer_state()
    assert [g["params"] for g in optimizer["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert sorted(optimizer["state"]) == sorted(expected["state"])
    for index, entry in expected["state"].items():
        for name, value in entry.items():
            assert_close_rel(optimizer["state"][index][name].double(), value.double(), rtol=1e-6,
                             name=f"optimizer {index} {name}")
    tokens = torch.tensor(list((parallel_runs / "corpus.txt").read_bytes()[:400]))
    bpb = {name: evaluate_bpb(model, tokens, context=16)["bpb"] for name, model in (("fsdp", fsdp),
                                                                                   ("single", single))}
    assert bpb["fsdp"] == pytest.approx(bpb["single"], rel=1e-6)
    generated = [list(model.generate([ord("T")], 8, temperature=0)) for model in (fsdp, single)]
    assert generated[0] == generated[1] and len(generated[0]) == 8


def test_an_fsdp_run_resumes_exactly(parallel_runs):
    keys = ("step", "loss", "bpb", "lr", "grad_norm", "commit_loss", "codebook_perplexity")
    uninterrupted = [tuple(r[k] for k in keys) for r in _records(parallel_runs / "fsdp")]
    resumed = [tuple(r[k] for k in keys) for r in _records(parallel_runs / "fsdp-resumed")]
    assert len(resumed) == STEPS and resumed == uninterrupted
    a, b = load_checkpoint(parallel_runs / "fsdp"), load_checkpoint(parallel_runs / "fsdp-resumed")
    assert a.step == b.step == STEPS
    for name, value in a.model.items():
        assert torch.equal(b.model[name], value), name
    for name, value in a.training.items():
        assert torch.equal(b.training[name], value), name


def test_no_warning_comes_from_linattn_in_ddp_and_fsdp_runs(parallel_runs):
    """The trainings of both processes (DDP, FSDP, FSDP resumed) under ``simplefilter("always")``:
    no warning is attributed to a file of linattn (torch 2.13 deprecates DDP's
    ``broadcast_buffers`` with a FutureWarning; FSDP2's view warning is silenced)."""
    package = Path(linattn.__file__).parent
    for rank in range(WORLD):
        shown = json.loads((parallel_runs / f"warnings{rank}.json").read_text())
        ours = [w for w in shown if Path(w["file"]).is_relative_to(package)]
        assert ours == [], ours


def test_parallel_names_a_known_strategy():
    with pytest.raises(ValueError, match=r"^train\.parallel must be one of 'ddp', 'fsdp'; got 'zero'$"):
        TrainConfig(parallel="zero")
    assert TrainConfig(parallel="fsdp").parallel == "fsdp"


# ----------------------------------------------------------------------------- the linattn command in 2 processes


TINY_RUN = ["--d-model", "16", "--n-layers", "2", "--batch-size", "2", "--context", "16",
            "--threads", "1", "--set", "model.codebook_size=8", "--set", "model.block_size=4",
            "--set", "model.gau_d_k=8"]


def test_only_rank_0_prints_a_run_s_progress_and_summary(tmp_path):
    """``linattn train`` under torchrun: rank 0 prints the model line, the evaluations and the
    summary; rank 1 prints nothing, on stdout or stderr (no warning either), and both exit 0."""
    (tmp_path / "corpus.txt").write_text(english_like(3000, seed=4))
    rank0, rank1 = run_ranks(["train", "--data", "corpus.txt", "--out", "run", "--steps", "2", "--eval-every", "2",
                              "--set", "train.eval_tokens=600", "--set", "train.eval_batch_size=1", *TINY_RUN],
                             tmp_path)
    assert (rank0.returncode, rank1.returncode) == (0, 0), rank0.stderr[-3000:] + rank1.stderr[-3000:]
    assert "validation bpb before training" in rank0.stdout and "validation bpb:" in rank0.stdout
    assert "train:" in rank0.stderr  # the progress bar
    assert (rank1.stdout, rank1.stderr) == ("", "")


def test_an_error_is_printed_by_each_rank_that_meets_it_and_every_rank_exits_with_its_code(tmp_path):
    """Both processes miss the data: each says so in one line (rank 1's prefixed with its rank,
    as on another node it would be the only word of that node's log); nothing else is printed."""
    rank0, rank1 = run_ranks(["train", "--data", "missing.txt", "--out", "run", "--steps", "2", *TINY_RUN], tmp_path)
    assert (rank0.returncode, rank1.returncode) == (2, 2)
    assert rank0.stderr.startswith("linattn: error: ") and "missing.txt" in rank0.stderr
    assert rank1.stderr.startswith("linattn: error: rank 1: ") and "missing.txt" in rank1.stderr
    assert len([line for line in rank1.stderr.splitlines() if "linattn" in line]) == 1 and rank1.stdout == ""


def test_a_rank_of_a_multi_process_run_leaves_without_the_interpreter_s_shutdown(monkeypatch, capsys):
    """``linattn.cli.entry`` in a process of a multi-process run flushes its output and ends by
    ``os._exit`` with the command's code (the shutdown's garbage collection could deadlock
    destroying a gloo group, cli.py); a single process exits as usual, by ``SystemExit``."""
    from linattn import cli

    left = []

    def record_exit(code):
        left.append((code, capsys.readouterr().err))
        raise SystemExit(f"os._exit({code})")

    monkeypatch.setattr(cli.os, "_exit", record_exit)
    monkeypatch.setattr(cli.sys, "argv", ["linattn", "train", "--data", "missing.txt", "--steps", "0"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(cli, "main", lambda: (print("linattn: error: missing.txt", file=sys.stderr), 2)[1])
    with pytest.raises(SystemExit, match=r"os\._exit\(2\)"):
        cli.entry()
    assert left == [(2, "linattn: error: missing.txt\n")]
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as ended:
        cli.entry()
    assert ended.value.code == 2 and len(left) == 1


# ----------------------------------------------------------------------------- train.compile in 2 processes


def _compiled_worker(rank: int, root: str) -> None:
    """DDP (eager, then compiled) and FSDP with activation checkpointing (compiled), each 2
    steps; per compiled run: dynamo's graph-break and graph counters, and what was compiled."""
    from torch._dynamo.utils import counters

    root = Path(root)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root / 'init'}", rank=rank, world_size=WORLD)
    patch = pytest.MonkeyPatch()
    compiled = []
    real_compile_model = trainer_module.compile_model

    def aot_eager(function, **options):  # traces forward and backward, without inductor's C++ build
        compiled.append(function)
        return real_compile_model(function, backend="aot_eager")

    patch.setattr(trainer_module, "compile_model", aot_eager)
    config = LMConfig(d_model=16, n_layers=2, attention="linear:elu", n_heads=2, ffn_hidden=32, chunk_size=4)
    seen = {}
    try:
        for name, options in (("ddp-eager", {}), ("ddp", {"compile": True}),
                              ("fsdp", {"compile": True, "parallel": "fsdp", "activation_checkpointing": True})):
            torch._dynamo.reset()
            counters.clear()
            compiled.clear()
            summary = train(config, run_config(root / "corpus.txt", root / name, steps=2, batch_size=2, **options),
                            progress=False, echo=lambda *a: None)
            model = summary["model"]
            seen[name] = {"graph_breaks": dict(counters["graph_break"]),
                          "graphs": counters["stats"]["unique_graphs"],
                          "compiled_layers": [getattr(f, "__self__", None) is layer for f, layer in
                                              zip(compiled, model.layers)] if compiled else [],
                          "compiled": len(compiled),
                          "restored": all("forward" not in vars(layer) for layer in model.layers)
                          and model.activation_checkpointing == bool(options.get("activation_checkpointing"))}
        (root / f"compiled{rank}.json").write_text(json.dumps(seen))
    finally:
        patch.undo()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    (root / "corpus.txt").write_text(english_like(3000, seed=4))
    mp.spawn(_compiled_worker, args=(str(root),), nprocs=WORLD, join=True)
    return root


def test_compile_under_ddp_and_fsdp_compiles_each_layer_without_a_graph_break(compiled_runs):
    """``train.compile`` in 2 processes: each entry of ``LM.layers`` is compiled on its own (DDP:
    the layers' forwards; FSDP with activation checkpointing: each forward under checkpoint),
    dynamo counts no graph break and made graphs; the model comes back with its own forwards.
    The compiled DDP run's losses are the eager run's (to float32 rounding)."""
    for rank in range(WORLD):
        seen = json.loads((compiled_runs / f"compiled{rank}.json").read_text())
        assert seen["ddp-eager"]["compiled"] == 0 and seen["ddp-eager"]["graphs"] == 0
        for name in ("ddp", "fsdp"):
            run = seen[name]
            assert run["graph_breaks"] == {}, (rank, name, run["graph_breaks"])
            assert run["compiled"] == 2 and run["graphs"] >= 2, (rank, name, run)
            assert run["restored"], (rank, name)
        assert seen["ddp"]["compiled_layers"] == [True, True]  # the bound forwards of the two layers
    eager, compiled = _records(compiled_runs / "ddp-eager"), _records(compiled_runs / "ddp")
    assert len(eager) == len(compiled) == 2
    for a, b in zip(eager, compiled):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
