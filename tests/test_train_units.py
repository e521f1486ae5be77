"""Unit tests of ``linattn.train`` (trainer, checkpoint, config, evaluate), in-process and
small: each checks one behaviour against a value computed here or a documented rule
(which checkpoint a resume takes, what the metrics log keeps, what a step descends, how
rank 0 and the others take turns), so a change of that behaviour fails it."""

from __future__ import annotations

import copy
import json
import math
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from linattn.models import LM, LMConfig
from linattn.train import CheckpointError, TrainConfig, distributed, evaluate_bpb, load_model, parallel, train
from linattn.train import trainer as trainer_module
from linattn.train.checkpoint import find_resume_checkpoint, save_checkpoint
from linattn.train.config import parse_override
from linattn.train.distributed import Context
from _helpers import english_like

torch.set_num_threads(1)


def quiet(*args):
    pass


def vq_config(**overrides) -> LMConfig:
    options = dict(d_model=16, n_layers=1, n_heads=2, attention="vq", gau_d_k=8, codebook_size=8, block_size=4,
                   chunk_size=4, ffn_hidden=32)
    return LMConfig(**{**options, **overrides})


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
    records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "split": "validation", "bpb": 6.0},
               {"note": "no step"}, {"step": 3, "loss": 3.0}, {"step": 4, "loss": 2.0}, {"step": 3, "loss": 9.0}]
    lines = [json.dumps(r) for r in records]
    path.write_text("\n".join(lines[:3]) + "\n\n   \n" + "\n".join(lines[3:]) + "\n")
    trainer_module._Metrics(path, enabled=True, resume_step=2)
    kept = path.read_text()
    assert kept.endswith("\n") and [json.loads(line) for line in kept.splitlines()] == [
        r for r in records if r.get("step", 0) <= 2]
    trainer_module._Metrics(path, enabled=False, resume_step=None)  # another rank: leaves the file alone
    assert path.read_text() == kept
    trainer_module._Metrics(path, enabled=True, resume_step=None)  # a fresh run starts an empty log
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
def test_rank_zero_loads_the_corpus_before_the_other_ranks(monkeypatch, rank, world_size, expected):
    """Rank 0 may download the corpus: the others wait at a barrier until it has it."""
    events = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda *args, **kwargs: events.append("barrier"))

    def load_corpus(spec, cache_dir=None):
        events.append("load")
        return (spec, cache_dir)

    monkeypatch.setattr(trainer_module, "load_corpus", load_corpus)
    config = TrainConfig(data="some-corpus", cache_dir="some-cache")
    assert trainer_module._load_data(config, Context(rank=rank, world_size=world_size)) == ("some-corpus",
                                                                                           "some-cache")
    assert events == expected


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
    windows = (900 // 4 - 1) // 16
    assert windows == 14 and summary["step"] == 17
    for step in (5, 10, 15, 17):
        meta = json.loads((run / "checkpoints" / f"step-{step:08d}" / "meta.json").read_text())
        assert meta["step"] == step
        assert meta["data"] == {"window": step % windows, "pass": step // windows}
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


def test_under_ddp_on_cpu_the_model_is_wrapped_without_device_ids_and_logged_losses_are_rank_means(
        tmp_path, monkeypatch):
    """Two ranks simulated in one process: the other rank mirrors this one (every sum over ranks
    doubles), so the logged loss, a mean over ranks, equals this rank's loss. DDP takes
    ``device_ids=None`` for a CPU module (a list is for one GPU each)."""
    monkeypatch.setattr(distributed, "setup", lambda device="cpu": Context(rank=0, world_size=2,
                                                                          device=torch.device(device)))
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda values, context: values.mul_(context.world_size))
    monkeypatch.setattr(distributed, "broadcast_flag", lambda flag, context: flag)
    monkeypatch.setattr(distributed, "gather_objects",  # each rank's object arrives as its own copy
                        lambda value, context: [copy.deepcopy(value) for _ in range(context.world_size)])
    monkeypatch.setattr(torch.distributed, "barrier", lambda *args, **kwargs: None)
    wrapped = []

    def fake_ddp(module, **kwargs):
        wrapped.append(kwargs)
        return module

    monkeypatch.setattr(parallel, "DistributedDataParallel", fake_ddp)
    losses = []
    original_cross_entropy = F.cross_entropy

    def recording_cross_entropy(*args, **kwargs):
        loss = original_cross_entropy(*args, **kwargs)
        losses.append(loss.item())
        return loss

    monkeypatch.setattr(F, "cross_entropy", recording_cross_entropy)
    run = tmp_path / "run"
    train(linear_config(), run_config(write_corpus(tmp_path, 2000), run), progress=False, echo=quiet)
    assert wrapped == [{"device_ids": None, "broadcast_buffers": False}]
    records = train_records(run)
    assert len(losses) == 3 and [r["loss"] for r in records] == losses
    assert [r["bpb"] for r in records] == [x / math.log(2) for x in losses]


# ----------------------------------------------------------------------------- compile and the data boundary


def test_compile_setting_is_a_bool():
    with pytest.raises(TypeError, match="train.compile must be a bool"):
        TrainConfig(compile="yes")


def test_train_compile_runs_the_compiled_model_and_trains_as_eager(tmp_path, monkeypatch):
    """``train.compile = true``: steps run through ``torch.compile`` (the eager backend here,
    with fullgraph=True, so any graph break fails), except the step of the k-means
    initialisation, which runs eagerly; the logged losses equal eager training's."""
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
    assert compiled_modules == [summary["model"]]
    losses = [[r["loss"] for r in train_records(tmp_path / run)] for run in ("eager", "compiled")]
    assert len(losses[0]) == 4
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_training_tokens_outside_the_vocabulary_are_refused_where_they_are_loaded(tmp_path):
    """The trainer reads the ids' range once, from the split, not in every forward pass."""
    data = write_corpus(tmp_path)  # English text: bytes up to 'z' = 122
    with pytest.raises(ValueError, match=r"training split must lie in \[0, 100\), got values in \[\d+, 1[12]\d\]"):
        train(linear_config(vocab_size=100), run_config(data, tmp_path / "run"), progress=False, echo=quiet)


def test_evaluate_bpb_refuses_tokens_outside_the_vocabulary(sharp_model):
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 256\), got values in \[0, 300\]"):
        evaluate_bpb(sharp_model, torch.tensor([0, 5, 300, 7] * 10), context=8)
