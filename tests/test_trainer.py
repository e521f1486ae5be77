"""linattn.train: the training loop (loss falls, exact resume after SIGINT and SIGKILL),
checkpoints (atomic, verified, never unpickled), the schedule, and 2-process torchrun.

Runs are tiny; the ones that need signals or several processes are subprocesses with
``--threads 1`` so their numbers are comparable."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from linattn.models import LM, LMConfig
from linattn.state import LMState, _State
from linattn.train import CheckpointError, TrainConfig, load_checkpoint, load_model, train
from linattn.train.checkpoint import flatten_state, resolve_checkpoint, save_checkpoint, unflatten_state
from linattn.train.schedule import learning_rate
from _helpers import english_like, head_fields, record_state_resets, torchrun_env
from test_resume_checks import write_meta

torch.set_num_threads(1)


def quiet(*args):
    pass


def tiny_model(attention="vq", n_layers=2, **overrides):
    options = dict(d_model=32, n_layers=n_layers, attention=attention, n_heads=2, gau_d_k=16, codebook_size=16,
                   block_size=8, chunk_size=8, ffn_hidden=64)
    options.update(overrides)
    return LMConfig(**head_fields(options["attention"], **options))


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_records(records):
    return [r for r in records if "loss" in r]


def eval_records(records):
    return [r for r in records if r.get("split") == "validation"]


# ----------------------------------------------------------------------------- learning


@pytest.mark.parametrize("attention", ["vq", "linear:elu,delta"])
def test_tiny_run_learns(tmp_path, attention):
    data = tmp_path / "corpus.txt"
    data.write_text(english_like(8000))
    train_config = TrainConfig(data=str(data), out=str(tmp_path / "run"), steps=30, batch_size=4, context=32,
                               lr=3e-3, warmup_steps=4, eval_every=30, eval_tokens=None, eval_batch_size=2,
                               log_every=1, checkpoint_every=0, threads=1)
    summary = train(tiny_model(attention), train_config, progress=False, echo=quiet)
    assert summary["step"] == 30 and summary["interrupted"] is None
    losses = [r["loss"] for r in train_records(read_metrics(tmp_path / "run"))]
    assert len(losses) == 30
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 0.3  # starts near uniform over bytes
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert summary["final_bpb"] < summary["initial_bpb"] - 0.5
    evals = eval_records(read_metrics(tmp_path / "run"))
    assert [r["step"] for r in evals] == [0, 30]
    assert evals[0]["bpb"] == summary["initial_bpb"] and evals[-1]["bpb"] == summary["final_bpb"]
    # the final checkpoint holds the trained model
    model, checkpoint = load_model(tmp_path / "run")
    assert checkpoint.step == 30
    for name, value in summary["model"].state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


# ----------------------------------------------------------------------------- exact resume

DELAY_SCRIPT = """
import os, sys, time
import linattn.train.trainer as trainer
_learning_rate = trainer.learning_rate
_delay = float(os.environ["LINATTN_TEST_STEP_DELAY"])
def _slow(*args, **kwargs):
    time.sleep(_delay)  # slows each step down so a signal lands mid-run; the math is unchanged
    return _learning_rate(*args, **kwargs)
trainer.learning_rate = _slow
from linattn.cli import main
sys.exit(main(sys.argv[1:]))
"""

RESUME_STEPS = 16


def _train_args(data: Path, out: Path) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--steps", str(RESUME_STEPS), "--attention", "vq,delta",
            "--d-model", "16", "--n-layers", "2", "--n-heads", "2", "--batch-size", "4", "--context", "32",
            "--eval-every", "8", "--checkpoint-every", "4", "--log-every", "1", "--lr", "0.003",
            "--set", "model.codebook_size=8", "--set", "model.gau_d_k=8", "--set", "model.block_size=4",
            "--set", "model.chunk_size=8", "--set", "train.eval_batch_size=2", "--set", "train.warmup_steps=3",
            "--no-progress", "--threads", "1"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "LINATTN_TEST_STEP_DELAY": "0.15", "PYTHONUNBUFFERED": "1"}


def _popen(args, cwd):
    return subprocess.Popen(args, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(condition, process, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if process.poll() is not None:
            return condition()
        time.sleep(0.01)
    return False


def _max_logged_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line).get("step", -1))
        except json.JSONDecodeError:  # a line being written
            pass
    return max(steps, default=-1)


def _latest_step(run: Path) -> int:
    try:
        name = (run / "checkpoints" / "latest").read_text().strip()
    except FileNotFoundError:
        return -1
    return int(name.split("-")[1]) if name.startswith("step-") else -1


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """An uninterrupted run, and alongside it one run taken through SIGINT -> resume ->
    SIGKILL -> resume."""
    root = tmp_path_factory.mktemp("resume")
    data = root / "corpus.txt"
    # 2000 bytes: 1800 train bytes = 4 streams of 450 -> 14 windows, so step 14 starts a new pass
    data.write_text(english_like(2000, seed=1))
    delay_script = root / "slow_linattn.py"
    delay_script.write_text(DELAY_SCRIPT)
    plain = [sys.executable, "-m", "linattn.cli"]
    slow = [sys.executable, str(delay_script)]
    full, run = root / "full", root / "run"
    resume_args = ["train", "--resume", "--out", str(run), "--threads", "1", "--no-progress"]
    results: dict = {}
    processes = [_popen(plain + _train_args(data, full), root)]
    try:
        # 1. SIGINT once step 5 is logged: the run saves a checkpoint where it stopped and exits
        process = _popen(slow + _train_args(data, run), root)
        processes.append(process)
        results["saw_step"] = _wait_for(lambda: _max_logged_step(run) >= 5, process)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
        results["sigint"] = {"rc": process.returncode, "out": out, "err": err, "latest": _latest_step(run),
                             "folders": sorted(p.name for p in (run / "checkpoints").glob("step-*"))}
        # 2. resume, then SIGKILL once step 10 is logged (after the checkpoint at step 8)
        process = _popen(slow + resume_args, root)
        processes.append(process)
        results["saw_checkpoint"] = _wait_for(
            lambda: _latest_step(run) >= 8 and _max_logged_step(run) >= 10, process)
        process.kill()
        out, err = process.communicate(timeout=120)
        results["sigkill"] = {"rc": process.returncode, "out": out, "err": err, "latest": _latest_step(run),
                              "metrics": read_metrics(run)}
        # 3. resume to the end
        process = _popen(plain + resume_args, root)
        processes.append(process)
        out, err = process.communicate(timeout=120)
        results["final"] = {"rc": process.returncode, "out": out, "err": err}
        out, err = processes[0].communicate(timeout=120)
        results["full"] = {"rc": processes[0].returncode, "out": out, "err": err}
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return full, run, results


def _curve(records):
    keys = ("step", "loss", "bpb", "lr", "grad_norm", "commit_loss", "codebook_perplexity")
    return [tuple(r.get(k) for k in keys) for r in train_records(records)]


def _evals(records):
    return [(r["step"], r["bpb"], r["tokens"]) for r in eval_records(records)]


def test_uninterrupted_reference_run(resume_runs):
    full, _, results = resume_runs
    assert results["full"]["rc"] == 0, results["full"]["err"]
    records = read_metrics(full)
    assert [r["step"] for r in train_records(records)] == list(range(1, RESUME_STEPS + 1))
    assert [r["step"] for r in eval_records(records)] == [0, 8, 16]
    assert "codebook_perplexity" in train_records(records)[0]


def test_sigint_saves_at_the_stop_and_exits_cleanly(resume_runs):
    _, run, results = resume_runs
    result = results["sigint"]
    assert results["saw_step"], "the run never logged step 5"
    assert result["rc"] == 0, result["err"]
    assert "SIGINT" in result["out"]
    assert f"linattn train --resume --out {run}" in result["out"]
    stopped = result["latest"]
    assert 5 <= stopped < 8, "the signal should stop the run within a step or two"
    assert f"after step {stopped}" in result["out"]
    assert result["folders"] == ["step-00000004", f"step-{stopped:08d}"]


def test_sigint_resume_continues_exactly(resume_runs):
    """What the resumed run logged (before it was killed) is what the uninterrupted run logged."""
    full, _, results = resume_runs
    logged = results["sigkill"]["metrics"]
    reference = read_metrics(full)
    assert max(r["step"] for r in logged) >= 10
    n = len(_curve(logged))
    assert n >= 10 and _curve(logged) == _curve(reference)[:n]
    assert _evals(logged) == _evals(reference)[: len(_evals(logged))] and len(_evals(logged)) >= 2


def test_sigkill_resume_reproduces_the_loss_curve_exactly(resume_runs):
    full, run, results = resume_runs
    assert results["saw_checkpoint"], "no checkpoint at step >= 8 appeared"
    assert results["sigkill"]["rc"] == -signal.SIGKILL
    killed_at = results["sigkill"]["latest"]
    assert 8 <= killed_at < RESUME_STEPS
    assert results["final"]["rc"] == 0, results["final"]["err"]
    resumed = read_metrics(run)
    steps = [r["step"] for r in train_records(resumed)]
    assert steps == list(range(1, RESUME_STEPS + 1))  # no duplicated steps
    assert [r["step"] for r in eval_records(resumed)] == [0, 8, 16]
    reference = read_metrics(full)
    assert _curve(resumed) == _curve(reference)
    assert _evals(resumed) == _evals(reference)


def test_resumed_model_and_carry_are_bit_identical(resume_runs):
    full, run, results = resume_runs
    assert results["final"]["rc"] == 0 and results["full"]["rc"] == 0
    a, b = load_checkpoint(full), load_checkpoint(run)
    assert a.step == b.step == RESUME_STEPS
    assert sorted(a.model) == sorted(b.model) and any("codebook" in k for k in a.model)
    for name in a.model:
        assert torch.equal(a.model[name], b.model[name]), name
    carry_a = {k: v for k, v in a.training.items() if k.startswith("carry.")}
    carry_b = {k: v for k, v in b.training.items() if k.startswith("carry.")}
    assert carry_a and sorted(carry_a) == sorted(carry_b)
    for name in carry_a:
        assert torch.equal(carry_a[name], carry_b[name]), name
    optimizer_a = {k: v for k, v in a.training.items() if k.startswith("optimizer.")}
    assert optimizer_a and all(torch.equal(v, b.training[k]) for k, v in optimizer_a.items())


def test_resume_continues_the_data_position(resume_runs):
    """The corpus gives 14 windows per pass; the runs cross a pass boundary at step 14."""
    _, run, _ = resume_runs
    meta = load_checkpoint(run).meta
    assert meta["data"] == {"window": RESUME_STEPS % 14, "pass": RESUME_STEPS // 14, "streams": 4,
                            "eval_streams": meta["train_config"]["eval_batch_size"]}
    assert meta["tokens_seen"] == RESUME_STEPS * 4 * 32
    assert meta["world_size"] == 1


# ----------------------------------------------------------------------------- checkpoints


def _write_checkpoints(root: Path, steps=(1, 2), keep=2):
    """Checkpoints of a tiny hybrid model whose weights change between steps; returns the
    tensors saved at each step."""
    torch.manual_seed(0)
    model = LM(tiny_model("vq,delta", d_model=16, gau_d_k=8, codebook_size=8, block_size=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved = {}
    for step in steps:
        model.train()
        logits, state, aux = model(torch.randint(0, 256, (2, 9)))
        (logits.logsumexp(-1).mean() + aux["commit_loss"]).backward()
        optimizer.step()
        optimizer.zero_grad()
        model.update_codebooks()
        tensors = {k: v.clone() for k, v in model.state_dict().items()}
        saved[step] = tensors
        save_checkpoint(root, step=step, model_tensors=tensors, optimizer_state=optimizer.state_dict(),
                        rng={"torch": torch.get_rng_state()}, carries=[model.carry(state)],
                        meta={"model_config": model.config.to_dict()}, keep=keep)
    return saved


def _rewrite_meta_hash(folder: Path, name: str) -> None:
    """Record the size and SHA-256 of the file ``name`` as it is now in meta.json, and seal
    meta.json again (its own hash), so the checkpoint's hashes all match."""
    import hashlib

    meta = json.loads((folder / "meta.json").read_text())
    data = (folder / name).read_bytes()
    meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    write_meta(folder, meta, seal=True)


def test_truncated_checkpoint_is_rejected_and_previous_loads(tmp_path):
    root = tmp_path / "checkpoints"
    saved = _write_checkpoints(root)
    latest = root / "step-00000002" / "model.safetensors"
    size = latest.stat().st_size
    with open(latest, "r+b") as handle:
        handle.truncate(size // 2)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(root)
    assert "truncated" in str(info.value) and "model.safetensors" in str(info.value)
    with pytest.raises(CheckpointError):
        load_model(tmp_path)
    previous = load_checkpoint(root / "step-00000001")
    assert previous.step == 1
    assert sorted(previous.model) == sorted(saved[1])
    for name, value in saved[1].items():
        assert torch.equal(previous.model[name], value), name
    assert any(not torch.equal(saved[1][n], saved[2][n]) for n in saved[1])  # the steps really differ
    model, _ = load_model(root / "step-00000001")
    for name, value in saved[1].items():
        assert torch.equal(model.state_dict()[name], value), name


def test_flipped_byte_is_corrupt(tmp_path):
    root = tmp_path / "checkpoints"
    _write_checkpoints(root, steps=(1,))
    for name in ("model.safetensors", "training.safetensors"):
        target = root / "step-00000001" / name
        original = target.read_bytes()
        data = bytearray(original)
        data[len(data) * 2 // 3] ^= 0x01
        target.write_bytes(bytes(data))
        assert target.stat().st_size == len(original)
        with pytest.raises(CheckpointError, match="corrupt") as info:
            load_checkpoint(root)
        assert name in str(info.value)
        target.write_bytes(original)
    load_checkpoint(root)  # restored: loads again


def test_foreign_folders_are_rejected(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError):
        load_checkpoint(foreign)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "missing")

    root = tmp_path / "checkpoints"
    _write_checkpoints(root, steps=(1,))
    folder = root / "step-00000001"
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "format": "someone-elses-checkpoint"}))
    with pytest.raises(CheckpointError, match="not a linattn checkpoint"):
        load_checkpoint(folder)
    (folder / "meta.json").write_text(json.dumps({**meta, "version": 999}))
    with pytest.raises(CheckpointError, match="version"):
        load_checkpoint(folder)
    (folder / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError):
        load_checkpoint(folder)


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("fix_hash", [False, True])
def test_pickle_renamed_model_safetensors_is_never_unpickled(tmp_path, fix_hash):
    root = tmp_path / "checkpoints"
    _write_checkpoints(root, steps=(1,))
    folder = root / "step-00000001"
    marker = tmp_path / "pwned"
    (folder / "model.safetensors").write_bytes(pickle.dumps({"weight": _Payload(marker)}))
    if fix_hash:  # even with matching sizes and hashes in meta.json, the file is not unpickled
        _rewrite_meta_hash(folder, "model.safetensors")
    with pytest.raises(CheckpointError, match="cannot read the tensor files" if fix_hash else "truncated"):
        load_checkpoint(root)
    with pytest.raises(CheckpointError):
        load_model(root)
    assert not marker.exists()


def test_leftover_tmp_folder_is_never_picked_and_keep_prunes(tmp_path):
    root = tmp_path / "checkpoints"
    saved = _write_checkpoints(root, steps=(1, 2, 3), keep=2)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step-00000002", "step-00000003"]
    assert (root / "latest").read_text().strip() == "step-00000003"
    # a crash mid-save leaves a temporary folder of a newer step, even with a meta.json in it
    leftover = root / ".tmp-step-00000009-12345"
    shutil.copytree(root / "step-00000003", leftover)
    assert resolve_checkpoint(root) == root / "step-00000003"
    assert resolve_checkpoint(tmp_path) == root / "step-00000003"
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.step == 3
    for name, value in saved[3].items():
        assert torch.equal(checkpoint.model[name], value), name
    # the next save moves latest on, prunes step 2, and still ignores the leftover
    torch.manual_seed(1)
    model = LM(LMConfig.from_dict(checkpoint.meta["model_config"]))
    save_checkpoint(root, step=4, model_tensors=model.state_dict(), optimizer_state={"state": {}, "param_groups": []},
                    rng={"torch": torch.get_rng_state()}, carries=[None], meta={}, keep=2)
    assert (root / "latest").read_text().strip() == "step-00000004"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000003", "step-00000004"]
    assert resolve_checkpoint(root) == root / "step-00000004"
    assert not any(p.name.startswith(".tmp-step-00000004") for p in root.iterdir())


def test_save_same_step_twice_replaces_it(tmp_path):
    root = tmp_path / "checkpoints"
    _write_checkpoints(root, steps=(5,))
    first = load_checkpoint(root).model
    saved = _write_checkpoints(root, steps=(5,))  # seeded identically, so trains identically
    second = load_checkpoint(root)
    assert second.step == 5 and sorted(p.name for p in root.iterdir()) == ["latest", "step-00000005"]
    for name in first:
        assert torch.equal(second.model[name], saved[5][name])


def _assert_same_state(a, b, path="state"):
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, _State):
        for f in dataclasses.fields(a):
            _assert_same_state(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        assert a == b, path


def test_flatten_unflatten_round_trip_of_a_hybrid_state(tmp_path):
    kinds = ["vq", "softmax", "linear:elu", "favor:8", "delta", "local:5", "soft-vq", "gau-softmax", "delta:dpfp"]
    config = tiny_model(kinds, n_layers=len(kinds), d_model=16, gau_d_k=8, codebook_size=8, block_size=4,
                        chunk_size=4, softmax_memory=3)
    torch.manual_seed(0)
    model = LM(config).eval()
    with torch.no_grad():
        _, state, _ = model(torch.randint(0, 256, (2, 11)))
    state = model.carry(state)
    tensors: dict[str, torch.Tensor] = {}
    structure = json.loads(json.dumps(flatten_state(state, "carry", tensors)))  # JSON-serialisable
    assert tensors and all(isinstance(t, torch.Tensor) for t in tensors.values())
    restored = unflatten_state(structure, tensors)
    assert isinstance(restored, LMState)
    _assert_same_state(restored, state)
    # through a real checkpoint file as well
    save_checkpoint(tmp_path, step=1, model_tensors=model.state_dict(),
                    optimizer_state={"state": {}, "param_groups": []},
                    rng={"torch": torch.get_rng_state()}, carries=[state, None], meta={})
    checkpoint = load_checkpoint(tmp_path)
    _assert_same_state(checkpoint.carry(0), state)
    assert checkpoint.carry(1) is None and checkpoint.carry(2) is None
    # and the restored state continues the sequence like the original
    with torch.no_grad():
        ids = torch.randint(0, 256, (2, 5))
        expected, _, _ = model(ids, state)
        actual, _, _ = model(ids, checkpoint.carry(0))
    assert torch.equal(actual, expected)


# ----------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("warmup, total, ratio", [(10, 50, 0.1), (1, 8, 0.0), (5, 7, 0.5)])
def test_learning_rate_schedule(warmup, total, ratio):
    peak = 3e-3
    lrs = [learning_rate(s, peak=peak, total_steps=total, warmup_steps=warmup, min_ratio=ratio) for s in range(total)]
    for s in range(warmup):
        assert lrs[s] == pytest.approx(peak * (s + 1) / warmup, rel=1e-12)
    assert lrs[0] == pytest.approx(peak / warmup)
    assert lrs[warmup] == pytest.approx(peak, rel=1e-12)
    assert lrs[-1] == pytest.approx(peak * ratio, rel=1e-12, abs=1e-15)
    after = lrs[warmup:]
    assert all(b <= a for a, b in zip(after, after[1:]))
    floor = peak * ratio
    for s in range(warmup, total):  # the cosine written out
        progress = (s - warmup) / max(total - 1 - warmup, 1)
        expected = floor + (peak - floor) * (1 + math.cos(math.pi * progress)) / 2
        assert lrs[s] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert max(lrs) == pytest.approx(peak)


def test_learning_rate_without_warmup_starts_at_peak():
    assert learning_rate(0, peak=1.0, total_steps=10, warmup_steps=0, min_ratio=0.1) == pytest.approx(1.0)
    assert learning_rate(9, peak=1.0, total_steps=10, warmup_steps=0, min_ratio=0.1) == pytest.approx(0.1)


# ----------------------------------------------------------------------------- torchrun

DISTRIBUTED_SCRIPT = """
import os, sys
import torch
torch.set_num_threads(1)
from safetensors.torch import save_file
from linattn.models import LMConfig
from linattn.train import TrainConfig, train

out, data = sys.argv[1], sys.argv[2]
model_config = LMConfig(d_model=16, n_layers=2, attention="vq,linear:elu", n_heads=2, gau_d_k=8, codebook_size=8,
                        block_size=4, chunk_size=8, ffn_hidden=32)
train_config = TrainConfig(data=data, out=out, steps=12, batch_size=2, context=32, lr=3e-3, warmup_steps=2,
                           eval_every=6, eval_tokens=None, eval_batch_size=1, log_every=1, checkpoint_every=6,
                           threads=1)
summary = train(model_config, train_config, progress=False, echo=lambda *a: None)
rank = int(os.environ["RANK"])
os.makedirs(out, exist_ok=True)
tensors = {name: value.detach().contiguous() for name, value in summary["model"].state_dict().items()}
save_file(tensors, os.path.join(out, f"rank{rank}.safetensors"))
"""


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    data = root / "corpus.txt"
    data.write_text(english_like(6000, seed=2))
    script = root / "ddp_train.py"
    script.write_text(DISTRIBUTED_SCRIPT)
    out = root / "run"
    env = torchrun_env()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
         str(out), str(data)],
        cwd=root, env=env, capture_output=True, text=True, timeout=150)
    return out, result


def test_two_process_training_keeps_ranks_identical(two_process_run):
    out, result = two_process_run
    assert result.returncode == 0, result.stderr[-4000:]
    rank0, rank1 = load_file(str(out / "rank0.safetensors")), load_file(str(out / "rank1.safetensors"))
    assert sorted(rank0) == sorted(rank1)
    assert any(name.endswith("quantizer.codebook") for name in rank0)
    assert any(name.endswith("ema_counts") for name in rank0)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), f"{name} differs across ranks"
    # the codebooks did move away from their initial values (the EMA ran)
    torch.manual_seed(0)
    fresh = LM(LMConfig(d_model=16, n_layers=2, attention="vq,linear:elu", n_heads=2, gau_d_k=8, codebook_size=8,
                        block_size=4, chunk_size=8, ffn_hidden=32)).state_dict()
    codebooks = [n for n in rank0 if n.endswith("quantizer.codebook")]
    assert all(not torch.equal(rank0[n], fresh[n]) for n in codebooks)


def test_two_process_training_learns_and_only_rank0_writes(two_process_run):
    out, result = two_process_run
    assert result.returncode == 0, result.stderr[-4000:]
    assert len(list(out.parent.rglob("metrics.jsonl"))) == 1
    records = read_metrics(out)
    losses = [r["loss"] for r in train_records(records)]
    assert [r["step"] for r in train_records(records)] == list(range(1, 13))  # one record per step, not two
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.2
    evals = eval_records(records)
    assert [r["step"] for r in evals] == [0, 6, 12] and evals[-1]["bpb"] < evals[0]["bpb"]
    checkpoint = load_checkpoint(out)
    assert checkpoint.step == 12
    assert checkpoint.meta["world_size"] == 2
    assert len(checkpoint.meta["carry"]) == 2  # both ranks' carried states
    assert checkpoint.meta["tokens_seen"] == 12 * 2 * 32 * 2
    entries = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert entries == ["latest", "step-00000006", "step-00000012"]
    rank0 = load_file(str(out / "rank0.safetensors"))
    for name, value in checkpoint.model.items():
        assert torch.equal(value, rank0[name]), name


def test_a_two_process_checkpoint_resumes_in_one_process_but_not_in_three(two_process_run, tmp_path, monkeypatch):
    """The run's global batch is 2 streams x 2 processes (evaluation: 1 stream in all): 3
    processes cannot share it (refused before anything is said or written, naming the counts
    that can), one process continues with both ranks' 4 streams and their carried states, and
    the same evaluation stream."""
    out, result = two_process_run
    assert result.returncode == 0, result.stderr[-4000:]
    run = tmp_path / "run"
    shutil.copytree(out, run)
    before = (run / "metrics.jsonl").read_text()
    lines = []
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"^--resume with 3 processes: its global batch of 4 streams \(train\.batch_"
                                         r"size=2 per process x 2 processes\) cannot be shared evenly by 3 processes; "
                                         r".* one of these process counts: 1, 2, 4$"):
        train(None, None, resume=True, steps=13, out=run, progress=False, echo=lines.append)
    assert lines == [] and (run / "metrics.jsonl").read_text() == before
    monkeypatch.delenv("WORLD_SIZE")
    summary = train(None, None, resume=True, steps=13, out=run, progress=False, echo=lines.append)
    assert summary["step"] == 13
    assert lines[0].endswith("(written by 2 processes, continued by 1 process of 4 streams each: the same global "
                             "batch of 4 streams)")
    meta = load_checkpoint(run).meta
    recorded = meta["train_config"]
    assert (meta["world_size"], recorded["batch_size"], recorded["eval_batch_size"]) == (1, 4, 1)
    assert meta["tokens_seen"] == 13 * 4 * 32


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_parallel_strategy_without_torchrun_is_refused_and_old_ddp_checkpoints_resume(tmp_path, monkeypatch,
                                                                                        strategy):
    """``train.parallel`` set in a single process (no WORLD_SIZE) is a ValueError naming
    torchrun, before the run folder is touched; left unset the run trains. A checkpoint whose
    train_config holds "ddp" (the default before None) resumes in one process."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = tmp_path / "corpus.txt"
    data.write_text(english_like(3000))
    options = dict(data=str(data), steps=2, batch_size=2, context=16, eval_every=0, checkpoint_every=1, threads=1)
    with pytest.raises(ValueError, match=rf"^train\.parallel='{strategy}' spreads .* launch it with torchrun"):
        train(tiny_model(), TrainConfig(**options, out=str(tmp_path / "refused"), parallel=strategy),
              progress=False, echo=quiet)
    assert not (tmp_path / "refused").exists()
    run = tmp_path / "run"
    assert train(tiny_model(), TrainConfig(**options, out=str(run)), progress=False, echo=quiet)["step"] == 2
    folder = run / "checkpoints" / "step-00000001"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["train_config"]["parallel"] is None
    meta["train_config"]["parallel"] = strategy  # as a run under torchrun recorded it
    write_meta(folder, meta, seal=True)
    assert train(None, None, resume=True, resume_from=1, out=run, progress=False, echo=quiet)["step"] == 2


def test_linattn_train_names_torchrun_for_a_parallel_strategy_in_one_process(tmp_path, monkeypatch, capsys):
    from linattn.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    data = tmp_path / "corpus.txt"
    data.write_text(english_like(3000))
    code = main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "1",
                 "--set", "train.parallel=fsdp", "--no-progress"])
    assert code == 2
    assert "torchrun --nproc_per_node" in capsys.readouterr().err
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "1", "--batch-size", "2",
                 "--context", "16", "--eval-every", "0", "--no-progress"]) == 0
    capsys.readouterr()
    code = main(["train", "--resume", "--out", str(tmp_path / "run"), "--steps", "2", "--parallel", "ddp",
                 "--no-progress"])
    assert code == 2
    assert capsys.readouterr().err.startswith("linattn: error: --parallel='ddp' spreads training over processes")


def test_an_evaluation_that_does_not_fit_names_eval_batch_size_and_eval_tokens(tmp_path):
    """The corpus's validation split is 5% of 4000 bytes = 200. 8 streams (train.eval_batch_size)
    of context 32 need 8 x 33 = 264 tokens: refused before training, naming the settings and
    the evaluation's budget (train.eval_tokens, or the whole split when it is unset); with
    eval_every=0 nothing is evaluated, and nothing is refused."""
    data = tmp_path / "corpus.txt"
    data.write_text(english_like(4000))
    options = dict(data=str(data), steps=1, batch_size=2, context=32, eval_every=1, eval_batch_size=8, threads=1)
    cases = [
        (100, r"train\.eval_tokens=100 reads only 100 of the validation split's 200; lower train\.eval_batch_size "
              r"or raise train\.eval_tokens$"),
        (None, r"the whole validation split \(train\.eval_tokens unset\) has 200; lower train\.eval_batch_size$"),
        (5000, r"the validation split has only 200 \(train\.eval_tokens=5000\); lower train\.eval_batch_size$"),
    ]
    for index, (budget, ending) in enumerate(cases):
        run = tmp_path / f"run{index}"
        with pytest.raises(ValueError, match=r"^train\.eval_batch_size=8 streams of context 32 need at least "
                                             r"8 x \(32 \+ 1\) = 264 tokens per evaluation, but " + ending):
            train(tiny_model(), TrainConfig(**options, eval_tokens=budget, out=str(run)), progress=False, echo=quiet)
        assert not (run / "metrics.jsonl").exists()
    summary = train(tiny_model(), TrainConfig(**{**options, "eval_every": 0}, out=str(tmp_path / "no-eval")),
                    progress=False, echo=quiet)
    assert summary["step"] == 1


def test_linattn_eval_names_batch_size_and_max_tokens_when_the_evaluation_does_not_fit(tmp_path, capsys):
    from linattn.cli import main

    data = tmp_path / "corpus.txt"
    data.write_text(english_like(4000))
    train(tiny_model(), TrainConfig(data=str(data), out=str(tmp_path / "run"), steps=1, batch_size=2, context=32,
                                    eval_every=0, threads=1), progress=False, echo=quiet)
    assert main(["eval", "--ckpt", str(tmp_path / "run"), "--split", "validation", "--batch-size", "8",
                 "--max-tokens", "100", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        "linattn: error: --batch-size=8 streams of context 32 need at least 8 x (32 + 1) = 264 tokens per "
        "evaluation, but --max-tokens=100 reads only 100 of the validation split's 200; lower --batch-size or raise "
        "--max-tokens\n")


# ------------------------------------------------------------------- carry schedule


def test_evaluate_reads_the_ids_once_not_per_window():
    """``evaluate_bpb`` checks the ids' range once; the windows run without the check, so on a
    GPU its loop never waits for the device: 3 windows make the round trips that 12 make."""
    from linattn.train import evaluate_bpb
    from _helpers import HostRoundTrips

    model = LM(tiny_model("vq,softmax")).eval()
    tokens = torch.randint(0, 256, (12 * 8 + 1,), generator=torch.Generator().manual_seed(4))
    counts = []
    for windows in (3, 12):
        with HostRoundTrips() as trips:
            evaluate_bpb(model, tokens, context=8, max_tokens=windows * 8 + 1)
        counts.append(len(trips))
    assert counts[0] == counts[1], counts


def test_evaluate_reset_every_interpolates_between_reset_and_carry():
    from linattn.train import evaluate_bpb

    torch.manual_seed(0)
    model = LM(LMConfig(d_model=16, n_layers=1, n_heads=2, attention="delta", chunk_size=4)).double()
    tokens = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1))
    common = dict(context=16, batch_size=1)
    reset = evaluate_bpb(model, tokens, carry_state=False, **common)["bpb"]
    every_one = evaluate_bpb(model, tokens, reset_every=1, **common)["bpb"]
    carried = evaluate_bpb(model, tokens, **common)["bpb"]
    never = evaluate_bpb(model, tokens, reset_every=1000, **common)["bpb"]
    every_three = evaluate_bpb(model, tokens, reset_every=3, **common)["bpb"]
    assert every_one == pytest.approx(reset, abs=1e-12)
    assert never == pytest.approx(carried, abs=1e-12)
    assert every_three != pytest.approx(reset, abs=1e-9) and every_three != pytest.approx(carried, abs=1e-9)


def test_training_resets_the_carried_state_every_carry_windows(tmp_path, monkeypatch):
    """The trainer passes state=None exactly at windows 0, N, 2N, ... of each pass."""
    from linattn.train import trainer as trainer_module

    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(chr(97 + (i * 7) % 26) for i in range(4000)))
    seen = record_state_resets(monkeypatch)
    model_config = LMConfig(d_model=16, n_layers=1, n_heads=2, attention="linear:elu")
    train_config = trainer_module.TrainConfig(
        data=str(corpus), out=str(tmp_path / "run"), steps=7, batch_size=2, context=16, eval_every=0,
        checkpoint_every=0, carry_windows=3, threads=1)
    trainer_module.train(model_config, train_config, progress=False, echo=lambda *a: None)
    assert seen == [True, False, False, True, False, False, True]


# ------------------------------------------------------- resume with dead-code restarts on


def _record_restart_draws(monkeypatch, interrupt_after: int | None = None) -> list[bool]:
    """Wrap ``LM.update_codebooks`` (once per step) to record whether it drew from torch's
    global RNG, which only dead-code restarts do; raise SIGINT after call ``interrupt_after``."""
    draws: list[bool] = []
    original = LM.update_codebooks

    def update_codebooks(self, apply=None):
        before = torch.get_rng_state()
        original(self, apply)
        draws.append(not torch.equal(before, torch.get_rng_state()))
        if len(draws) == interrupt_after:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(LM, "update_codebooks", update_codebooks)
    return draws


def test_resume_restores_the_rng_that_dead_code_restarts_draw_from(tmp_path, monkeypatch):
    """With dead-code restarts drawing random keys at every step (a threshold above the EMA
    count of a code left unused for one step), a run interrupted after step 4 and resumed
    matches the uninterrupted run bit for bit, which needs the RNG state of step 4 back."""
    data = tmp_path / "corpus.txt"
    data.write_text(english_like(3000, seed=2))
    model_config = tiny_model("vq", n_layers=1, dead_code_threshold=1.0, ema_decay=0.99)
    steps, stop_after = 8, 4

    def run_config(name):
        return TrainConfig(data=str(data), out=str(tmp_path / name), steps=steps, batch_size=4, context=32,
                           lr=3e-3, warmup_steps=2, eval_every=0, log_every=1, checkpoint_every=0, threads=1)

    draws = _record_restart_draws(monkeypatch)
    reference = train(model_config, run_config("full"), progress=False, echo=quiet)
    assert any(draws[:stop_after]) and any(draws[stop_after:]), f"no restarts before or after the stop: {draws}"

    monkeypatch.undo()
    _record_restart_draws(monkeypatch, interrupt_after=stop_after)
    stopped = train(model_config, run_config("resumed"), progress=False, echo=quiet)
    assert stopped["interrupted"] == "SIGINT" and stopped["step"] == stop_after
    monkeypatch.undo()
    draws = _record_restart_draws(monkeypatch)
    resumed = train(None, None, resume=True, out=tmp_path / "resumed", progress=False, echo=quiet)
    assert resumed["start_step"] == stop_after and resumed["step"] == steps
    assert any(draws), "the resumed steps drew no restarts"

    losses = [r["loss"] for r in train_records(read_metrics(tmp_path / "full"))]
    resumed_losses = [r["loss"] for r in train_records(read_metrics(tmp_path / "resumed"))]
    assert len(losses) == steps and resumed_losses == losses
    final, resumed_final = reference["model"].state_dict(), resumed["model"].state_dict()
    assert sorted(final) == sorted(resumed_final)
    for name, value in final.items():
        assert torch.equal(resumed_final[name], value), name
