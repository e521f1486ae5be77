"""Unit tests of ``linattn.train`` (trainer, checkpoint, config, evaluate), in-process and
small: each checks one behaviour against a value computed here or a documented rule
(which checkpoint a resume takes, what the metrics log keeps, what a step descends, how
rank 0 and the others take turns), so a change of that behaviour fails it."""

from __future__ import annotations

import copy
import io
import json
import math
import os
import re
import signal
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.optim.optimizer import register_optimizer_step_pre_hook
from tqdm import tqdm

from linattn.models import LM, LMConfig
from linattn.train import (CheckpointError, TrainConfig, distributed, evaluate_bpb, load_checkpoint, load_model,
                           parallel, train)
from linattn.train import evaluate as evaluate_module
from linattn.train import resharding, startup
from linattn.train import trainer as trainer_module
from linattn.train.checkpoint import find_resume_checkpoint, save_checkpoint
from linattn.train.config import parse_override
from linattn.train.distributed import Context
from linattn.train.metrics import MetricsLog
from _helpers import english_like, head_fields, mirrored_exchange, record_state_resets

torch.set_num_threads(1)


def quiet(*args):
    pass


def vq_config(**overrides) -> LMConfig:
    options = dict(d_model=16, n_layers=1, n_heads=2, attention="vq", gau_d_k=8, codebook_size=8, block_size=4,
                   chunk_size=4, ffn_hidden=32)
    options.update(overrides)
    return LMConfig(**head_fields(options["attention"], **options))


def linear_config(**overrides) -> LMConfig:
    return LMConfig(**{**dict(d_model=16, n_layers=1, n_heads=2, attention="linear:elu", ffn_hidden=32), **overrides})


def write_corpus(folder: Path, n_bytes: int = 1000) -> Path:
    path = folder / "corpus.txt"
    path.write_text(english_like(n_bytes))
    assert path.stat().st_size == n_bytes
    return path


def run_config(data: Path, out: Path, **overrides) -> TrainConfig:
    options = dict(data=str(data), out=str(out), steps=3, batch_size=4, context=16, warmup_steps=1, eval_every=0,
                   checkpoint_every=0, log_every=1, threads=1)
    return TrainConfig(**{**options, **overrides})


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_records(run: Path) -> list[dict]:
    return [r for r in metrics(run) if "loss" in r]


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", ["lr", "grad_clip"])
def test_lr_and_grad_clip_must_be_positive(name):
    for zero in (0, 0.0):
        with pytest.raises(ValueError, match=rf"^train\.{name} must be a positive number, got {zero!r}$"):
            TrainConfig(**{name: zero})
    assert getattr(TrainConfig(**{name: 1e-9}), name) == 1e-9


@pytest.mark.parametrize("name", ["beta1", "beta2"])
def test_adam_betas_must_lie_below_one(name):
    for one in (1, 1.0):
        with pytest.raises(ValueError, match=rf"^train\.{name} must be in \[0, 1\), got {one!r}$"):
            TrainConfig(**{name: one})
    for allowed in (0.0, 0.999):
        assert getattr(TrainConfig(**{name: allowed}), name) == allowed


@pytest.mark.parametrize("text", ["model.d_model", "optim.lr=1", "d_model=3", "model.=3", "=3", "train.steps"])
def test_set_rejects_what_is_not_table_dot_key_equals_value(text):
    with pytest.raises(ValueError, match=r"^--set expects model\.KEY=VALUE or train\.KEY=VALUE, got ") as info:
        parse_override(text)
    assert str(info.value).endswith(repr(text))


def test_set_reads_the_value_as_toml_else_as_a_bare_string():
    assert parse_override("model.d_model=128") == ("model", "d_model", 128)
    assert parse_override(" train.lr = 1e-3 ") == ("train", "lr", 0.001)
    assert parse_override("train.bf16=true") == ("train", "bf16", True)
    assert parse_override("train.data=shakespeare") == ("train", "data", "shakespeare")
    assert parse_override('model.attention="vq,local:4"') == ("model", "attention", "vq,local:4")


def test_by_default_training_carries_the_state_and_runs_in_float32(tmp_path, monkeypatch):
    """``TrainConfig`` defaults: the state is carried from window to window (``carry_state``,
    reset every ``carry_windows=8``) and bf16 autocast is off."""
    seen = []
    original = LM.forward

    def recording_forward(self, ids, state=None, **options):
        if self.training:
            seen.append((state is not None, torch.is_autocast_enabled("cpu")))
        return original(self, ids, state, **options)

    monkeypatch.setattr(LM, "forward", recording_forward)
    defaults = TrainConfig()
    assert defaults.carry_windows > 3
    train(linear_config(), run_config(write_corpus(tmp_path), tmp_path / "run"), progress=False, echo=quiet)
    assert seen == [(False, False), (True, False), (True, False)]


# ----------------------------------------------------------------------------- evaluate


def _bits_per_byte(model: LM, tokens: torch.Tensor) -> float:
    """Every next byte predicted from all the bytes before it, by one forward pass in float64."""
    with torch.no_grad():
        logits, _, _ = model(tokens[:-1].unsqueeze(0))
    return F.cross_entropy(logits[0].double(), tokens[1:], reduction="mean").item() / math.log(2)


@pytest.fixture(scope="module")
def sharp_model() -> LM:
    """A float32 model whose predictions are far from uniform and depend on the context."""
    torch.manual_seed(0)
    return LM(linear_config(init_std=0.5)).eval()


def test_evaluate_bpb_is_the_mean_cross_entropy_in_bits(sharp_model):
    """Batch 1 with the state carried = one pass over the whole sequence; computed in float32
    (no bf16 autocast by default, which moves the result by about 1e-3)."""
    tokens = torch.randint(0, 256, (97,), generator=torch.Generator().manual_seed(1))
    expected = _bits_per_byte(sharp_model, tokens)
    assert abs(expected - 8.0) > 0.5  # not the uniform model's 8 bits
    result = evaluate_bpb(sharp_model, tokens, context=16)
    assert result["tokens"] == 96
    assert result["bpb"] == pytest.approx(expected, rel=2e-6)
    in_bf16 = evaluate_bpb(sharp_model, tokens, context=16, bf16=True)["bpb"]
    assert in_bf16 != pytest.approx(expected, rel=1e-4)  # so the default's precision is visible


def test_evaluate_bpb_max_tokens_keeps_the_first_bytes_and_scores_the_short_last_window(sharp_model):
    tokens = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(2))
    result = evaluate_bpb(sharp_model, tokens, context=16, max_tokens=50)
    assert result["tokens"] == 49  # 3 full windows of 16 and one of 1
    assert result["bpb"] == pytest.approx(_bits_per_byte(sharp_model, tokens[:50]), rel=2e-6)
    assert evaluate_bpb(sharp_model, tokens, context=16)["tokens"] == 119


# ----------------------------------------------------------------------------- checkpoints


def _save(root: Path, step: int) -> None:
    save_checkpoint(root, step=step, model_tensors={"w": torch.full((3,), float(step))},
                    optimizer_state={"state": {}, "param_groups": []}, rng={"torch": torch.get_rng_state()},
                    carries=[None], meta={}, keep=10)


def _corrupt(folder: Path) -> None:
    target = folder / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))


@pytest.fixture
def three_steps(tmp_path) -> tuple[Path, Path]:
    """A run folder with complete checkpoints at steps 1, 2, 3; ``latest`` names step 3."""
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _save(root, step)
    assert (root / "latest").read_text().strip() == "step-00000003"
    return tmp_path, root


def test_resume_takes_the_checkpoint_latest_names_and_says_nothing(three_steps):
    run, root = three_steps
    (root / "latest").write_text("step-00000002\n")
    said = []
    checkpoint = find_resume_checkpoint(run, echo=said.append)
    assert checkpoint.step == 2 and checkpoint.path == root / "step-00000002" and said == []


def test_without_latest_resume_takes_the_newest_complete_checkpoint(three_steps):
    run, root = three_steps
    (root / "latest").unlink()
    said = []
    checkpoint = find_resume_checkpoint(run, echo=said.append)
    assert checkpoint.step == 3 and torch.equal(checkpoint.model["w"], torch.full((3,), 3.0))
    assert said == [f"{root / 'latest'} is missing; resuming from the newest complete checkpoint, step-00000003"]
    _corrupt(root / "step-00000003")
    said.clear()
    assert find_resume_checkpoint(run, echo=said.append).step == 2
    assert said == [f"{root / 'latest'} is missing; resuming from the newest complete checkpoint, step-00000002"]
    for step in (1, 2):
        _corrupt(root / f"step-0000000{step}")
    with pytest.raises(CheckpointError, match="holds no checkpoint to resume"):
        find_resume_checkpoint(run, echo=said.append)


def test_a_corrupt_latest_lists_the_usable_earlier_checkpoints_newest_first(three_steps):
    run, root = three_steps
    _corrupt(root / "step-00000003")
    with pytest.raises(CheckpointError) as info:
        find_resume_checkpoint(run)
    message = str(info.value)
    assert message.startswith(f"{root / 'step-00000003' / 'model.safetensors'} is corrupt")
    assert message.endswith(". Usable earlier checkpoints: step-00000002 (step 2), step-00000001 (step 1). Resume "
                            f"from the newest with: linattn train --resume --out {run} --from 2")


def test_resume_from_a_step_number(three_steps, tmp_path_factory):
    run, root = three_steps
    checkpoint = find_resume_checkpoint(run, 2)
    assert checkpoint.step == 2 and checkpoint.path == root / "step-00000002"
    with pytest.raises(CheckpointError) as info:
        find_resume_checkpoint(run, 5)
    assert str(info.value) == (f"{root / 'step-00000005'} does not exist; the usable checkpoints of {run} are at "
                               "steps 1, 2, 3")
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(CheckpointError) as info:
        find_resume_checkpoint(empty, 5)
    assert str(info.value).endswith(f"the usable checkpoints of {empty} are at steps none")


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_load_model_refuses_tensors_that_do_not_match_the_config(tmp_path, change):
    config = linear_config()
    torch.manual_seed(0)
    tensors = dict(LM(config).state_dict())
    name = sorted(tensors)[0]
    if change == "missing":
        del tensors[name]
    else:
        tensors["extra.weight"] = torch.zeros(2)
    save_checkpoint(tmp_path, step=1, model_tensors=tensors, optimizer_state={"state": {}, "param_groups": []},
                    rng={"torch": torch.get_rng_state()}, carries=[None], meta={"model_config": config.to_dict()})
    with pytest.raises(CheckpointError, match="the stored model does not match its config") as info:
        load_model(tmp_path)
    assert (name if change == "missing" else "extra.weight") in str(info.value)


# ----------------------------------------------------------------------------- trainer: pieces


def test_stop_request_puts_the_previous_signal_handlers_back():
    def mine(signum, frame):
        pass

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in previous:
            signal.signal(s, mine)
        stop = trainer_module._StopRequest()
        with stop.installed():
            assert signal.getsignal(signal.SIGINT) is stop and signal.getsignal(signal.SIGTERM) is stop
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_resumed_metrics_keep_only_what_was_logged_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    """(A line without a step is an error: tests/test_resume_checks.py.) Blank lines are left out."""
    records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "split": "validation", "bpb": 6.0},
               {"step": 3, "loss": 3.0}, {"step": 4, "loss": 2.0}, {"step": 3, "loss": 9.0}]
    lines = [json.dumps(r) for r in records]
    path.write_text("\n".join(lines[:3]) + "\n\n   \n" + "\n".join(lines[3:]) + "\n")
    MetricsLog(path, enabled=True, resume_step=2)
    kept = path.read_text()
    assert kept.endswith("\n") and [json.loads(line) for line in kept.splitlines()] == [
        r for r in records if r["step"] <= 2]
    MetricsLog(path, enabled=False, resume_step=None)  # another rank: leaves the file alone
    assert path.read_text() == kept
    MetricsLog(path, enabled=True, resume_step=None)  # a fresh run starts an empty log
    assert path.read_text() == ""


def test_restoring_the_rng_touches_cuda_only_on_a_cuda_device(monkeypatch):
    """A checkpoint written on a GPU resumed on the CPU restores the CPU generator only; on a
    GPU the CUDA generator of that device is restored too (when the checkpoint has one)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append((state, device)))
    before = torch.get_rng_state()
    try:
        saved = torch.manual_seed(123).get_state()
        cuda_state = torch.arange(8, dtype=torch.uint8)
        torch.manual_seed(456)
        trainer_module._restore_rng({"torch": saved, "cuda": cuda_state}, torch.device("cpu"))
        assert torch.equal(torch.get_rng_state(), saved) and calls == []
        gpu = torch.device("cuda", 1)
        trainer_module._restore_rng({"torch": saved, "cuda": cuda_state}, gpu)
        assert len(calls) == 1 and calls[0][0] is cuda_state and calls[0][1] == gpu
        trainer_module._restore_rng({"torch": saved}, gpu)  # written on the CPU: nothing for CUDA
        assert len(calls) == 1
    finally:
        torch.set_rng_state(before)


@pytest.mark.parametrize("rank, world_size, expected", [
    (0, 1, ["load"]), (0, 2, ["load", "barrier"]), (1, 2, ["barrier", "load"]), (2, 3, ["barrier", "load"])])
def test_rank_zero_loads_the_corpus_before_the_other_ranks(monkeypatch, tmp_path, rank, world_size, expected):
    """Rank 0 may download the corpus: the others wait at a barrier until it has it. Then every
    rank shares its verdict on the data (``startup.exchange``), so all go on or all stop."""
    events = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda *args, **kwargs: events.append("barrier"))

    def load_corpus(spec, cache_dir=None):
        events.append("load")
        return (spec, cache_dir)

    monkeypatch.setattr(trainer_module, "load_corpus", load_corpus)
    monkeypatch.setattr(trainer_module, "data_fingerprint", lambda data: {"kind": "fake"})
    monkeypatch.setattr(startup, "exchange", lambda context, name, problem, record, timeout=None: events.append(
        f"{name} verdict"))
    corpus = str(tmp_path.resolve() / "some-corpus")
    config = TrainConfig(data=corpus, cache_dir="some-cache")
    assert trainer_module._load_data(config, Context(rank=rank, world_size=world_size)) == \
        ((corpus, "some-cache"), corpus, {"kind": "fake"})
    assert events == expected + ["data verdict"]


# ----------------------------------------------------------------------------- trainer: runs


def test_train_shows_a_progress_bar_unless_told_not_to(tmp_path, capsys):
    data = write_corpus(tmp_path)
    train(linear_config(), run_config(data, tmp_path / "default", steps=2), echo=quiet)  # progress: the default
    assert re.search(r"train: 100%\|[^\n\r]*\| 2/2 ", capsys.readouterr().err)
    train(linear_config(), run_config(data, tmp_path / "quiet", steps=2), progress=False, echo=quiet)
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """17 steps over 14 windows per pass (a 1000-byte corpus: 900 train bytes, 4 streams of 225,
    (225 - 1) // 16 full windows), a checkpoint every 5 steps; with the wall-clock span of the run."""
    tmp_path = tmp_path_factory.mktemp("logged")
    config = run_config(write_corpus(tmp_path, 1000), tmp_path / "run", steps=17, checkpoint_every=5,
                        keep_checkpoints=10)
    started = time.perf_counter()
    summary = train(linear_config(), config, progress=False, echo=quiet)
    return tmp_path / "run", summary, time.perf_counter() - started


def test_checkpoints_record_the_data_position_and_tokens_seen(logged_run):
    run, summary, _ = logged_run
    config = load_checkpoint(run).meta["train_config"]
    windows = (900 // 4 - 1) // 16
    assert windows == 14 and summary["step"] == 17
    for step in (5, 10, 15, 17):
        meta = json.loads((run / "checkpoints" / f"step-{step:08d}" / "meta.json").read_text())
        assert meta["step"] == step
        assert meta["data"] == {"window": step % windows, "pass": step // windows, "streams": 4,
                                "eval_streams": config["eval_batch_size"]}
        assert type(meta["data"]["pass"]) is int
        assert meta["tokens_seen"] == step * 4 * 16 and meta["world_size"] == 1


def test_logged_elapsed_time_is_the_time_since_training_started(logged_run):
    run, _, span = logged_run
    elapsed = [r["elapsed"] for r in train_records(run)]
    assert len(elapsed) == 17
    assert 0 <= elapsed[0] and elapsed == sorted(elapsed) and elapsed[-1] <= span


def test_resume_says_where_it_continues_and_a_finished_run_says_only_that(tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(linear_config(), run_config(write_corpus(tmp_path), run, steps=4, checkpoint_every=2), progress=False,
          echo=quiet)
    said = []
    summary = train(None, None, resume=True, resume_from=2, out=run, progress=False, echo=said.append)
    assert summary["start_step"] == 2 and summary["step"] == 4
    assert said == [f"resuming {run} at step 2 of 4 from {run / 'checkpoints' / 'step-00000002'}"]
    said.clear()
    summary = train(None, None, resume=True, out=run, progress=False, echo=said.append)
    assert summary["finished"] is True and summary["step"] == 4
    assert said == [f"the run in {run} is finished (step 4 of 4); nothing to train. Extend it with: linattn train "
                    f"--resume --out {run} --steps N (N > 4)"]
    said.clear()
    monkeypatch.setenv("RANK", "1")  # under torchrun only rank 0 speaks
    train(None, None, resume=True, resume_from=2, out=run, progress=False, echo=said.append)
    assert said == []


def test_each_step_descends_the_cross_entropy_plus_the_commitment_loss(tmp_path, monkeypatch):
    """The gradient the first step clips and applies is that of cross-entropy + commit loss,
    recomputed here from the same weights, window and random state."""
    data = write_corpus(tmp_path, 1000)
    seen = {}
    original_forward = LM.forward

    def recording_forward(self, ids, state=None, **options):
        if self.training and not seen:
            seen.update(ids=ids.clone(), state=state, rng=torch.get_rng_state(),
                        weights={k: v.clone() for k, v in self.state_dict().items()})
        return original_forward(self, ids, state, **options)

    clipped = []
    original_clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(parameters, *args, **kwargs):
        parameters = list(parameters)
        if not clipped:
            clipped.extend(p.grad.clone() for p in parameters)
        return original_clip(parameters, *args, **kwargs)

    monkeypatch.setattr(LM, "forward", recording_forward)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    config = vq_config()
    train(config, run_config(data, tmp_path / "run", steps=1), progress=False, echo=quiet)
    monkeypatch.undo()

    train_bytes = data.read_bytes()[: 1000 * 90 // 100]
    streams = torch.tensor(list(train_bytes), dtype=torch.long).reshape(4, -1)  # 4 streams of 225
    assert seen["state"] is None and torch.equal(seen["ids"], streams[:, :16])
    model = LM(config)
    model.load_state_dict(seen["weights"])
    model.train()
    torch.set_rng_state(seen["rng"])
    logits, _, aux = model(seen["ids"])
    cross_entropy = F.cross_entropy(logits.float().flatten(0, 1), streams[:, 1:17].flatten())
    parameters = list(model.parameters())
    expected = torch.autograd.grad(cross_entropy + aux["commit_loss"], parameters, retain_graph=True)
    without = torch.autograd.grad(cross_entropy - aux["commit_loss"], parameters)
    assert len(clipped) == len(expected)

    def close(a, b):
        return all(torch.allclose(x, y, rtol=1e-4, atol=1e-7) for x, y in zip(a, b))

    assert close(clipped, expected)
    assert not close(without, expected)  # the commitment term moves the gradient visibly


@pytest.fixture
def mirrored_second_rank(monkeypatch) -> list[dict]:
    """Rank 0 of two ranks simulated in one process: the other rank mirrors this one (every sum
    over ranks doubles); DDP is recorded, not applied. Returns the DDP keyword arguments seen."""
    monkeypatch.setattr(distributed, "setup", lambda context, device="cpu", collective_timeout=None: Context(
        rank=0, world_size=2, device=torch.device(device)))
    def mirrored_sum(values, context):
        return values.mul_(context.world_size)

    monkeypatch.setattr(distributed, "all_reduce_sum", mirrored_sum)
    monkeypatch.setattr(evaluate_module, "all_reduce_sum", mirrored_sum)  # imported by name there
    monkeypatch.setattr(distributed, "broadcast_flag", lambda flag, context: flag)
    monkeypatch.setattr(startup, "exchange", mirrored_exchange)
    monkeypatch.setattr(distributed, "gather_objects",  # each rank's object arrives as its own copy
                        lambda value, context: [copy.deepcopy(value) for _ in range(context.world_size)])
    monkeypatch.setattr(torch.distributed, "barrier", lambda *args, **kwargs: None)
    wrapped = []

    def fake_ddp(module, **kwargs):
        wrapped.append(kwargs)
        return module

    monkeypatch.setattr(parallel, "DistributedDataParallel", fake_ddp)
    return wrapped


def test_under_ddp_on_cpu_the_model_is_wrapped_without_device_ids_and_logged_losses_are_rank_means(
        tmp_path, monkeypatch, mirrored_second_rank):
    """With the other rank mirroring this one, the logged loss, a mean over ranks, equals this
    rank's loss. DDP takes ``device_ids=None`` for a CPU module (a list is for one GPU each)."""
    wrapped = mirrored_second_rank
    losses = []
    original_cross_entropy = F.cross_entropy

    def recording_cross_entropy(*args, **kwargs):
        loss = original_cross_entropy(*args, **kwargs)
        losses.append(loss.item())
        return loss

    monkeypatch.setattr(F, "cross_entropy", recording_cross_entropy)
    run = tmp_path / "run"
    train(linear_config(), run_config(write_corpus(tmp_path, 2000), run), progress=False, echo=quiet)
    assert wrapped == [{"device_ids": None, "forward_sync_buffers": False}]
    records = train_records(run)
    assert len(losses) == 3 and [r["loss"] for r in records] == losses
    assert [r["bpb"] for r in records] == [x / math.log(2) for x in losses]


# ----------------------------------------------------------------------------- compile and the data boundary


def test_compile_setting_is_a_bool():
    with pytest.raises(TypeError, match="train.compile must be a bool"):
        TrainConfig(compile="yes")


def test_train_compile_runs_the_compiled_model_and_trains_as_eager(tmp_path, monkeypatch):
    """``train.compile = true``: each layer's forward is compiled on its own (the eager backend
    here, with fullgraph=True, so any graph break fails), and steps run through them, except
    the step of the k-means initialisation, which runs eagerly; the logged losses equal eager
    training's, and the returned model has its own forwards again."""
    compiled_modules, real_compile = [], torch.compile

    def recording_compile(module, **options):
        compiled_modules.append(module)
        return real_compile(module, backend="eager", fullgraph=True)

    data = write_corpus(tmp_path)
    config = vq_config(kmeans_init=True)
    train(config, run_config(data, tmp_path / "eager", steps=4), progress=False, echo=quiet)
    monkeypatch.setattr(trainer_module.torch, "compile", recording_compile)
    torch._dynamo.reset()
    summary = train(config, run_config(data, tmp_path / "compiled", steps=4, compile=True), progress=False,
                    echo=quiet)
    torch._dynamo.reset()
    model = summary["model"]
    assert [function.__self__ for function in compiled_modules] == list(model.layers)
    assert all("forward" not in vars(layer) for layer in model.layers)
    losses = [[r["loss"] for r in train_records(tmp_path / run)] for run in ("eager", "compiled")]
    assert len(losses[0]) == 4
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_train_compile_with_activation_checkpointing_counts_the_codebook_statistics_once(tmp_path, monkeypatch):
    """Compiled layers under activation checkpointing recompute inside their graph (AOTAutograd
    here): the codebooks' EMA sees each window's statistics once, as in eager training, so the
    codebooks and the losses after 3 steps are eager's (a compiled layer recomputed from outside
    would count them again in the backward pass)."""
    data = write_corpus(tmp_path)
    config = vq_config()
    eager = train(config, run_config(data, tmp_path / "eager", activation_checkpointing=True), progress=False,
                  echo=quiet)
    real_compile_model = trainer_module.compile_model
    monkeypatch.setattr(trainer_module, "compile_model",
                        lambda function, **options: real_compile_model(function, backend="aot_eager"))
    torch._dynamo.reset()
    try:
        compiled = train(config, run_config(data, tmp_path / "compiled", activation_checkpointing=True, compile=True),
                         progress=False, echo=quiet)
    finally:
        torch._dynamo.reset()
    losses = [[r["loss"] for r in train_records(tmp_path / run)] for run in ("eager", "compiled")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    codebooks = [dict(summary["model"].named_buffers()) for summary in (eager, compiled)]
    for name in ("ema_counts", "ema_sums", "codebook"):
        for key in [k for k in codebooks[0] if k.endswith("quantizer." + name)]:
            torch.testing.assert_close(codebooks[1][key], codebooks[0][key], rtol=1e-5, atol=1e-6, msg=key)
    assert compiled["model"].activation_checkpointing


def test_training_tokens_outside_the_vocabulary_are_refused_where_they_are_loaded(tmp_path):
    """The trainer reads the ids' range once, from the split, not in every forward pass."""
    data = write_corpus(tmp_path)  # English text: bytes up to 'z' = 122
    with pytest.raises(ValueError, match=r"the train split of .*corpus.txt holds token id 1[12]\d, but the model's "
                                         r"vocabulary has 100 tokens"):
        train(linear_config(vocab_size=100), run_config(data, tmp_path / "run"), progress=False, echo=quiet)


def test_evaluate_bpb_refuses_tokens_outside_the_vocabulary(sharp_model):
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 256\), got values in \[0, 300\]"):
        evaluate_bpb(sharp_model, torch.tensor([0, 5, 300, 7] * 10), context=8)


# ----------------------------------------------------------------------------- trainer: more pieces

CPU = torch.device("cpu")


def test_a_first_signal_requests_a_stop_and_a_second_one_gets_the_default_behaviour():
    """The first SIGINT or SIGTERM only sets the flag; the handler it leaves is the default one
    of that signal: KeyboardInterrupt for a second Ctrl-C, termination for a second SIGTERM."""
    stop = trainer_module._StopRequest()
    with stop.installed():
        stop(signal.SIGINT, None)
        assert stop.signal_name == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is stop
        stop(signal.SIGTERM, None)
        assert stop.signal_name == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_metrics_mirror_to_tensorboard_only_when_asked_and_a_resume_purges_the_later_steps(tmp_path):
    """By default only ``metrics.jsonl`` is written (its folders made as needed); with
    ``tensorboard`` the records also go to ``<run>/tensorboard``, and a run resumed at step 2
    drops the events logged after step 2, as the JSONL log drops those lines."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # heavy: only here

    run = tmp_path / "runs" / "run"
    path = run / "metrics.jsonl"
    MetricsLog(path, enabled=True, resume_step=None).close()
    assert path.read_text() == "" and sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    metrics_log = MetricsLog(path, enabled=True, resume_step=None, tensorboard=True)
    for step in (1, 2, 3, 4):
        metrics_log.write({"step": step, "loss": float(step)})
    metrics_log.close()
    resumed = MetricsLog(path, enabled=True, resume_step=2, tensorboard=True)
    resumed.write({"step": 3, "loss": 30.0})
    resumed.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_accumulate_gradients_averages_loss_commitment_and_gradients_over_the_micro_batches():
    """Two micro-batches of different difficulty (rows of zeros, random rows), float64: the
    returned loss and commitment loss are the means of the blocks' values, and the gradient is
    that of the mean of (cross-entropy + commitment loss) over the blocks, each block written
    out here as its own forward."""
    torch.manual_seed(0)
    model = LM(vq_config()).double().train()
    reference = copy.deepcopy(model)
    inputs = torch.cat([torch.zeros(2, 8, dtype=torch.long),
                        torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))])
    targets = inputs.roll(-1, dims=1)
    loss, commit, states = trainer_module.accumulate_gradients(model, inputs, targets, [None, None], device=CPU)

    cross_entropies, commits, objective = [], [], 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        logits, _, aux = reference(inputs[rows])
        cross_entropies.append(F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten()))
        commits.append(aux["commit_loss"])
        objective = objective + (cross_entropies[-1] + commits[-1]) / 2
    expected = torch.autograd.grad(objective, list(reference.parameters()))
    first, second = (x.item() for x in cross_entropies)
    assert abs(first - second) > 0.1 and commits[1] > 0 and abs(commits[0].item() - commits[1].item()) > 0
    assert len(states) == 2
    assert loss.item() == pytest.approx((first + second) / 2, rel=1e-12)
    assert commit.item() == pytest.approx((commits[0].item() + commits[1].item()) / 2, rel=1e-6)
    for (name, parameter), wanted in zip(model.named_parameters(), expected):
        torch.testing.assert_close(parameter.grad, wanted, rtol=1e-10, atol=1e-12, msg=name)


def test_accumulate_gradients_runs_the_given_forward_without_id_checks_and_without_autocast_by_default(
        monkeypatch):
    """``forward`` defaults to the trained module itself; a given one (the compiled wrapper) is
    what runs. Either way the ids are not range-checked there (``check_inputs=False``), and
    bf16 autocast is on only when asked."""
    calls = []
    original_forward = LM.forward

    def recording_forward(self, ids, state=None, **options):
        calls.append(("model", options, torch.is_autocast_enabled("cpu")))
        return original_forward(self, ids, state, **options)

    monkeypatch.setattr(LM, "forward", recording_forward)
    model = LM(linear_config())
    inputs = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    targets = inputs.roll(-1, dims=1)
    trainer_module.accumulate_gradients(model, inputs, targets, [None], device=CPU)
    assert calls == [("model", {"check_inputs": False}, False)]

    calls.clear()

    def given(ids, state, **options):
        calls.append(("given", options))
        return model(ids, state, **options)

    trainer_module.accumulate_gradients(model, inputs, targets, [None, None], device=CPU, bf16=True, forward=given)
    assert calls == [("given", {"check_inputs": False}), ("model", {"check_inputs": False}, True)] * 2


def test_compiled_training_writes_forward_side_effects_once_under_activation_checkpointing():
    """``compile_model``: a module that records each forward call, compiled (eager backend,
    fullgraph) inside activation checkpointing, runs its forward and backward (dynamo would
    refuse the write inside a checkpointed region) and records the call once, not again in the
    recomputation; the gradients are eager's."""

    class Recording(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)
            self.calls = []

        def forward(self, x):
            self.calls.append(x.shape[0])
            return self.linear(x).tanh()

    torch.manual_seed(0)
    module = Recording()
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    module(x).sum().backward()
    wanted = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    module.calls.clear()
    torch._dynamo.reset()
    try:
        compiled = trainer_module.compile_model(
            lambda inputs: torch.utils.checkpoint.checkpoint(module, inputs, use_reentrant=False),
            backend="eager", fullgraph=True)
        compiled(x).sum().backward()
    finally:
        torch._dynamo.reset()
    assert module.calls == [2]
    for parameter, expected in zip(module.parameters(), wanted):
        torch.testing.assert_close(parameter.grad, expected)


def test_code_perplexity_is_the_mean_over_vq_units_of_the_exp_entropy_of_their_pooled_code_counts():
    """exp(-sum p log p) of each quantizer's pending counts summed over heads (0 log 0 = 0),
    averaged over the quantizers; None for a model without VQ."""
    model = LM(vq_config())
    quantizers = model.quantizers()
    assert len(quantizers) == 2
    generator = torch.Generator().manual_seed(0)
    expected = []
    for index, quantizer in enumerate(quantizers):
        counts = torch.randint(0, 6, quantizer.pending_counts.shape, generator=generator).float()
        counts[:, index] = 0  # a code no head used
        counts[0, -1] = 7
        quantizer._pending_counts.copy_(counts)
        pooled = counts.sum(0).tolist()
        total = sum(pooled)
        expected.append(math.exp(-sum(c / total * math.log(c / total) for c in pooled if c > 0)))
    assert abs(expected[0] - expected[1]) > 0.01
    assert trainer_module.code_perplexity(model).item() == pytest.approx(sum(expected) / 2, rel=1e-6)
    assert trainer_module.code_perplexity(LM(linear_config())) is None


# ----------------------------------------------------------------------------- trainer: more runs


def test_resume_steps_must_exceed_the_checkpoint_step_and_an_extension_keeps_the_schedule(tmp_path):
    """``steps`` with ``resume`` must be an int above the checkpoint's step. A finished 4-step
    run extended to 6 trains steps 5 and 6 at the floor learning rate (``lr * min_lr_ratio``)
    of its 4-step schedule (``decay_steps`` becomes 4); a run with its own ``decay_steps`` keeps it."""
    data = write_corpus(tmp_path)
    run = tmp_path / "run"
    config = run_config(data, run, steps=4)
    train(linear_config(), config, progress=False, echo=quiet)
    for bad in (4, 3, True, 5.0, "6"):
        with pytest.raises(ValueError) as info:
            train(None, None, resume=True, out=run, steps=bad, progress=False, echo=quiet)
        assert str(info.value) == f"--steps must be larger than the checkpoint's step 4 to train further, got {bad!r}"
    summary = train(None, None, resume=True, out=run, steps=6, progress=False, echo=quiet)
    assert summary["start_step"] == 4 and summary["step"] == 6
    records = train_records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    floor = config.lr * config.min_lr_ratio
    assert [r["lr"] for r in records[4:]] == pytest.approx([floor, floor], rel=1e-12)
    assert records[2]["lr"] > floor  # step 3: on the cosine, above its floor
    meta = load_checkpoint(run).meta["train_config"]
    assert meta["steps"] == 6 and meta["decay_steps"] == 4

    other = tmp_path / "other"
    train(linear_config(), run_config(data, other, steps=4, decay_steps=3), progress=False, echo=quiet)
    train(None, None, resume=True, out=other, steps=5, progress=False, echo=quiet)
    assert load_checkpoint(other).meta["train_config"]["decay_steps"] == 3


def test_train_sets_the_thread_count_only_when_asked(tmp_path):
    data = write_corpus(tmp_path)
    before = torch.get_num_threads()
    try:
        train(linear_config(), run_config(data, tmp_path / "unset", steps=1, threads=None), progress=False,
              echo=quiet)
        assert torch.get_num_threads() == before
        train(linear_config(), run_config(data, tmp_path / "set", steps=1, threads=before + 1), progress=False,
              echo=quiet)
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_resume_refuses_a_checkpoint_whose_tensors_do_not_fit_the_model(tmp_path, monkeypatch, change):
    """A resumed run loads the weights strictly: a tensor missing from the checkpoint, or one
    the model does not have, is an error naming it, not a silently fresh or ignored weight."""
    run = tmp_path / "run"
    train(linear_config(), run_config(write_corpus(tmp_path), run, steps=3, checkpoint_every=2), progress=False,
          echo=quiet)
    real_find = resharding.find_resume_checkpoint
    names = []

    def tampered(*args, **kwargs):
        checkpoint = real_find(*args, **kwargs)
        if change == "missing":
            names.append(sorted(checkpoint.model)[0])
            del checkpoint.model[names[0]]
        else:
            names.append("extra.weight")
            checkpoint.model["extra.weight"] = torch.zeros(2)
        return checkpoint

    monkeypatch.setattr(resharding, "find_resume_checkpoint", tampered)
    kind = "Missing" if change == "missing" else "Unexpected"
    with pytest.raises(RuntimeError, match=rf"{kind} key\(s\) in state_dict") as info:
        train(None, None, resume=True, resume_from=2, out=run, progress=False, echo=quiet)
    assert f'"{names[0]}"' in str(info.value)


def test_a_fresh_run_describes_its_model_and_data_and_the_validation_bpb_before_training(tmp_path):
    """Rank 0 of a new run says what it trains (parameters in millions; the train split in
    bytes for byte data; windows per pass) and the validation bpb it starts from."""
    data = write_corpus(tmp_path, 1000)
    run = tmp_path / "run"
    config = linear_config()
    said = []
    train(config, run_config(data, run, steps=2, eval_every=2, eval_batch_size=2), progress=False,
          echo=said.append)
    n_parameters = sum(p.numel() for p in LM(config).parameters())
    windows = (900 // 4 - 1) // 16
    initial = [r["bpb"] for r in metrics(run) if r.get("split") == "validation" and r["step"] == 0]
    assert len(initial) == 1
    assert said == [f"model: linear:elu x 1 layers, d_model 16, {n_parameters / 1e6:.2f}M parameters; data: {data} "
                    f"(900 train bytes, {windows} windows per pass)",
                    f"validation bpb before training: {initial[0]:.3f}"]


def test_under_two_ranks_the_tokens_seen_are_those_of_every_rank(tmp_path, mirrored_second_rank):
    run = tmp_path / "run"
    train(linear_config(), run_config(write_corpus(tmp_path, 2000), run, steps=2), progress=False, echo=quiet)
    meta = json.loads((run / "checkpoints" / "step-00000002" / "meta.json").read_text())
    assert meta["world_size"] == 2
    assert meta["tokens_seen"] == 2 * 4 * 16 * 2 and type(meta["tokens_seen"]) is int  # steps x batch x context x ranks


def test_a_run_without_validation_reports_neither_a_final_bpb_nor_its_step(logged_run):
    _, summary, _ = logged_run
    assert summary["final_bpb"] is None and summary["final_bpb_step"] is None


def test_logged_speed_and_elapsed_times_are_read_from_the_clock(tmp_path, monkeypatch):
    """With a clock that moves 0.25 s per training forward and a record every 2 steps, each
    record's ``tokens_per_second`` is the tokens of the steps since the last record (64 per
    step) over their time, 256; ``elapsed`` (records and summary) is the time since training began."""
    clock = [1000.0]
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    original_forward = LM.forward

    def ticking_forward(self, ids, state=None, **options):
        if self.training:
            clock[0] += 0.25
        return original_forward(self, ids, state, **options)

    monkeypatch.setattr(LM, "forward", ticking_forward)
    run = tmp_path / "run"
    summary = train(linear_config(), run_config(write_corpus(tmp_path), run, steps=5, log_every=2), progress=False,
                    echo=quiet)
    records = train_records(run)
    assert [r["step"] for r in records] == [2, 4, 5]
    assert [r["tokens_per_second"] for r in records] == [4 * 16 / 0.25] * 3
    assert [r["elapsed"] for r in records] == [0.5, 1.0, 1.25]
    assert summary["elapsed"] == 1.25


def test_training_logs_and_evaluates_every_n_steps_and_at_the_last_step(tmp_path):
    run = tmp_path / "run"
    train(linear_config(), run_config(write_corpus(tmp_path), run, steps=5, log_every=2, eval_every=2,
                                      eval_batch_size=2), progress=False, echo=quiet)
    assert [r["step"] for r in train_records(run)] == [2, 4, 5]
    assert [r["step"] for r in metrics(run) if r.get("split") == "validation"] == [0, 2, 4, 5]


def test_the_carried_state_is_reset_at_each_new_pass_over_the_data(tmp_path, monkeypatch):
    """With ``carry_windows=0`` the state is carried through a whole pass and dropped where the
    next pass starts again at window 0 (8 windows per pass here)."""
    seen = record_state_resets(monkeypatch)
    windows = (600 * 90 // 100 // 4 - 1) // 16
    assert windows == 8
    train(linear_config(), run_config(write_corpus(tmp_path, 600), tmp_path / "run", steps=10, carry_windows=0),
          progress=False, echo=quiet)
    assert seen == [True] + [False] * 7 + [True, False]


def test_the_optimizer_steps_with_the_scheduled_learning_rate(tmp_path):
    """Every parameter group steps at ``peak * (s + 1) / warmup`` during warm-up, then at the
    cosine from ``peak`` down to ``peak * min_lr_ratio`` at the last step (``s`` 0-based)."""
    peak, ratio, warmup, steps = 1e-3, 0.1, 2, 6
    applied = []
    handle = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: applied.append([group["lr"] for group in optimizer.param_groups]))
    try:
        train(linear_config(), run_config(write_corpus(tmp_path), tmp_path / "run", steps=steps, lr=peak,
                                          min_lr_ratio=ratio, warmup_steps=warmup), progress=False, echo=quiet)
    finally:
        handle.remove()
    floor = peak * ratio
    expected = [peak * (s + 1) / warmup if s < warmup else
                floor + (peak - floor) * (1 + math.cos(math.pi * (s - warmup) / (steps - 1 - warmup))) / 2
                for s in range(steps)]
    assert len(applied) == steps and all(len(groups) >= 1 for groups in applied)
    for lrs, wanted in zip(applied, expected):
        assert lrs == pytest.approx([wanted] * len(lrs), rel=1e-12)


class _DrawnBar(tqdm):
    """The trainer's progress bar with tqdm's timed redraws switched off: every draw is one the
    trainer asked for (``set_postfix(refresh=True)``), the first or the last. Records
    ``(count, postfix)`` per draw."""

    draws: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "mininterval": math.inf})

    def display(self, *args, **kwargs):
        _DrawnBar.draws.append((self.n, self.postfix))
        return super().display(*args, **kwargs)


def test_the_progress_bar_is_redrawn_for_each_evaluation_not_for_each_log(tmp_path, monkeypatch, capsys):
    """A log record only updates the bar's postfix (tqdm redraws it at its own pace); an
    evaluation shows its bpb at once, labelled with its step."""
    monkeypatch.setattr(trainer_module, "tqdm", _DrawnBar)
    monkeypatch.setattr(_DrawnBar, "draws", [])
    run = tmp_path / "run"
    train(linear_config(), run_config(write_corpus(tmp_path), run, steps=3, eval_every=2, eval_batch_size=2),
          echo=quiet)
    loss = {r["step"]: r["loss"] for r in train_records(run)}
    bpb = {r["step"]: r["bpb"] for r in metrics(run) if r.get("split") == "validation"}
    assert sorted(loss) == [1, 2, 3] and sorted(bpb) == [0, 2, 3]
    after = {step: f"loss={loss[step]:.3f}, val_bpb@{step}={bpb[step]:.3f}" for step in (2, 3)}
    assert _DrawnBar.draws == [(0, None), (2, after[2]), (3, after[3]), (3, after[3])]  # start, evals, close
    assert "val_bpb@3=" in capsys.readouterr().err


def test_the_progress_bar_follows_the_terminal_width(tmp_path, monkeypatch):
    """A terminal widened from 80 to 150 columns during the run: the last bar drawn fills the
    new width (tqdm leaves the last column free)."""
    columns = [80]

    class Terminal(io.StringIO):
        def fileno(self):
            return 2

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=None: os.terminal_size((columns[0], 24)))
    original_forward = LM.forward

    def widening_forward(self, ids, state=None, **options):
        columns[0] = 150
        return original_forward(self, ids, state, **options)

    monkeypatch.setattr(LM, "forward", widening_forward)
    train(linear_config(), run_config(write_corpus(tmp_path), tmp_path / "run", steps=2), echo=quiet)
    lines = [line for line in re.split(r"[\r\n]", terminal.getvalue()) if line]
    assert len(lines[0]) == 79 and len(lines[-1]) == 149 and lines[-1].startswith("train: 100%")


def test_a_signal_stops_the_run_after_its_step_with_a_checkpoint_and_says_how_to_continue(tmp_path, monkeypatch):
    seen = []
    original_forward = LM.forward

    def interrupting_forward(self, ids, state=None, **options):
        if self.training:
            seen.append(True)
            if len(seen) == 2:
                signal.raise_signal(signal.SIGINT)
        return original_forward(self, ids, state, **options)

    monkeypatch.setattr(LM, "forward", interrupting_forward)
    run = tmp_path / "run"
    said = []
    summary = train(linear_config(), run_config(write_corpus(tmp_path), run, steps=5), progress=False,
                    echo=said.append)
    assert summary["interrupted"] == "SIGINT" and summary["step"] == 2 and len(seen) == 2
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert said[-1] == (f"stopped by SIGINT after step 2; checkpoint saved to {run / 'checkpoints' / 'step-00000002'}; "
                        f"continue with: linattn train --resume --out {run}")


def test_validation_bits_per_byte_on_tokenized_data_count_the_bytes_of_every_ranks_streams(
        tmp_path, mirrored_second_rank):
    """BPE shards, two ranks sharing 4 evaluation streams: the validation record's ``bytes``
    are the text bytes of the targets of all 4 streams of the split (``bpb`` then divides the
    nats by them), counted here by decoding each stream with the tokenizer itself."""
    from tokenizers import Tokenizer

    from linattn.data.shards import prepare_shards

    texts = tmp_path / "texts"
    texts.mkdir()
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):  # three documents: train, validation, test
        (texts / f"{name}.txt").write_text(english_like(3000, seed=seed))
    shards = prepare_shards(texts, "bpe:300", tmp_path / "shards", echo=quiet)
    run = tmp_path / "run"
    train(linear_config(vocab_size=300), run_config(shards, run, steps=1, eval_every=1, eval_batch_size=4),
          progress=False, echo=quiet)
    record = [r for r in metrics(run) if r.get("split") == "validation"][-1]
    reference = Tokenizer.from_file(str(shards / "tokenizer.json"))
    ids = torch.tensor(reference.encode((texts / "b.txt").read_text()).ids)
    length = ids.numel() // 4
    streams = ids[:4 * length].reshape(4, length)
    assert record["tokens"] == 4 * (length - 1)
    assert record["bytes"] == sum(len(reference.decode(row[1:].tolist()).encode()) for row in streams)
    assert record["bpb"] == pytest.approx(record["bits_per_token"] * record["tokens"] / record["bytes"], rel=1e-12)
