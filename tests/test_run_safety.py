"""No run is lost or silently changed: the divergence guard (train/divergence.py), one writer
per run folder and no accidental reuse (train/run_folder.py), write failures that leave the
previous checkpoint intact, and checkpoints with non-finite weights refused by their readers.

Runs are tiny and in-process through ``linattn.cli.main``; a second writer is a subprocess."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import linattn.train.checkpoint as checkpoint_module
import linattn.train.trainer as trainer_module
from linattn.bench.harness import in_fresh_process
from linattn.models import LM, LMConfig
from linattn.train import load_checkpoint
from linattn.train.checkpoint import save_checkpoint
from linattn.train.divergence import NonFiniteGuard, TrainingDiverged
from linattn.train.run_folder import RunFolderError, RunLock, remove_stale_temporaries
from _helpers import english_like, torchrun_env
from test_train_cli import run_captured as run

torch.set_num_threads(1)


def run_argv(data: Path, out: Path, *extra: str, steps: int = 12) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--steps", str(steps), "--attention", "vq,local:4",
            "--d-model", "16", "--n-layers", "2", "--n-heads", "2", "--batch-size", "2", "--context", "16",
            "--eval-every", "0", "--checkpoint-every", "4", "--log-every", "4", "--lr", "0.003",
            "--set", "model.codebook_size=8", "--set", "model.gau_d_k=8", "--set", "model.block_size=4",
            "--no-progress", "--threads", "1", *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "data.txt"
    path.write_text(english_like(6000, seed=3), encoding="utf-8")
    return path


def records(run_dir: Path) -> list[dict]:
    """The complete lines of ``metrics.jsonl`` (a line being written is left out)."""
    complete = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            complete.append(json.loads(line))
    return complete


def step_folders(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


def file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` but the lock (which names its latest holder)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def poison(monkeypatch, steps: set[int], what: str = "gradient") -> None:
    """Make the trainer's steps ``steps`` (1-based) non-finite: NaN gradients, a NaN loss, or
    (``"weights"``) an inf weight after the step's forward and backward, whose loss and
    gradients are finite."""
    original = trainer_module.accumulate_gradients
    calls = {"n": 0}

    def accumulate(trained, *args, **kwargs):
        calls["n"] += 1
        loss, commit, states = original(trained, *args, **kwargs)
        if what == "weights" and calls["n"] in steps:
            with torch.no_grad():
                next(trained.parameters()).view(-1)[0] = float("inf")
        if calls["n"] in steps and what == "gradient":
            for parameter in trained.parameters():
                parameter.grad.fill_(float("nan"))
        if calls["n"] in steps and what == "loss":
            loss = loss * float("nan")
        return loss, commit, states

    monkeypatch.setattr(trainer_module, "accumulate_gradients", accumulate)


# ----------------------------------------------------------------------------- the divergence guard


def _raise_diverged():
    raise TrainingDiverged("training diverged: at step 3 ...", step=3, what=["the loss"], last_checkpoint="step-2")


def test_a_divergence_reaches_the_parent_of_a_worker_process_whole():
    """``bench train`` trains in a fresh process: the parent gets the same exception, not a
    broken process pool (the exception's keyword-only fields once failed to unpickle)."""
    with pytest.raises(TrainingDiverged, match="at step 3") as raised:
        in_fresh_process(_raise_diverged, threads=1)
    assert (raised.value.step, raised.value.what, raised.value.last_checkpoint) == (3, ["the loss"], "step-2")


def test_found_inf_leaves_parameters_moments_and_codebooks_as_they_were():
    """The gate itself: with the guard's flag set the fused AdamW step and the codebook EMA
    change nothing; with it clear they do."""
    torch.manual_seed(0)
    model = LM(LMConfig(d_model=16, n_layers=1, attention="vq", gau_d_k=8, codebook_size=8, block_size=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = NonFiniteGuard(torch.device("cpu"))

    def step(poisoned: bool) -> None:
        logits, _, aux = model(torch.randint(0, 256, (2, 8)))
        loss = logits.logsumexp(-1).mean() + aux["commit_loss"]
        loss.backward()
        if poisoned:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.found_inf = guard.observe(1, loss.detach(), aux["commit_loss"].detach(), norm)
        optimizer.step()
        model.update_codebooks(apply=optimizer.found_inf == 0)
        optimizer.zero_grad()

    step(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for p in model.parameters() for k, v in optimizer.state[p].items()}
    step(True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after = {k: v for p in model.parameters() for k, v in optimizer.state[p].items()}
    assert moments.keys() == after.keys() and all(torch.equal(moments[k], after[k]) for k in moments)
    assert guard.what() == ["gradient norm"]
    guard = NonFiniteGuard(torch.device("cpu"))  # stop mode keeps the flag: a new guard for a finite step
    step(False)  # a finite step moves the weights and the codebook
    changed = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
    assert any("codebook" in k for k in changed) and any("weight" in k for k in changed)


@pytest.mark.parametrize("what, named", [("gradient", "gradient norm"), ("loss", "the loss")])
def test_a_nonfinite_step_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, data, monkeypatch, what, named):
    run_dir = tmp_path / "run"
    poison(monkeypatch, {6}, what)
    code, stdout, stderr = run(run_argv(data, run_dir))
    assert code == 3, stderr
    assert "training diverged: at step 6" in stderr and named in stderr
    assert str(run_dir / "checkpoints" / "step-00000004") in stderr
    assert step_folders(run_dir) == ["step-00000004"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    logged = records(run_dir)
    assert max(r["step"] for r in logged if "loss" in r) == 4
    assert logged[-1] == {"step": 6, "event": "diverged", "nonfinite": [named.removeprefix("the ")]}
    load_checkpoint(run_dir)  # the kept checkpoint verifies


def test_nonfinite_weights_are_never_written(tmp_path, data, monkeypatch):
    run_dir = tmp_path / "run"
    poison(monkeypatch, {8}, "weights")  # a checkpoint step: the save finds the inf weight
    code, _, stderr = run(run_argv(data, run_dir))
    assert code == 3 and "weights" in stderr, stderr
    assert step_folders(run_dir) == ["step-00000004"]


def test_skip_mode_leaves_skipped_steps_unapplied_and_counts_them(tmp_path, data, monkeypatch):
    run_dir = tmp_path / "run"
    poison(monkeypatch, {3, 6})
    code, _, stderr = run(run_argv(data, run_dir, "--checkpoint-every", "1", "--log-every", "1",
                                   "--set", "train.keep_checkpoints=20", "--set", "train.max_skipped_steps=1"))
    assert code == 0, stderr
    ckpt = {step: load_checkpoint(run_dir / "checkpoints" / f"step-{step:08d}") for step in (2, 3, 4)}
    for name, tensor in ckpt[2].model.items():  # weights and codebooks of step 3 are those of step 2
        assert torch.equal(tensor, ckpt[3].model[name]), name
    moments = [n for n in ckpt[2].training if n.startswith("optimizer.")]
    assert moments and all(torch.equal(ckpt[2].training[n], ckpt[3].training[n]) for n in moments)
    assert not all(torch.equal(t, ckpt[4].model[n]) for n, t in ckpt[3].model.items())
    assert ckpt[2].carry(0) is not None and ckpt[3].carry(0) is None  # the skipped step's state is dropped
    logged = records(run_dir)
    assert [r["step"] for r in logged if r.get("skipped")] == [3, 6]
    assert [r["skipped_steps"] for r in logged if "loss" in r][-1] == 2


def test_skip_mode_stops_after_more_consecutive_skips_than_allowed(tmp_path, data, monkeypatch):
    run_dir = tmp_path / "run"
    poison(monkeypatch, {5, 6})
    code, _, stderr = run(run_argv(data, run_dir, "--set", "train.max_skipped_steps=1"))
    assert code == 3, stderr
    assert "at step 6" in stderr and "2 consecutive steps" in stderr
    assert step_folders(run_dir) == ["step-00000004"]


def test_readers_refuse_a_checkpoint_with_nonfinite_weights(tmp_path):
    torch.manual_seed(0)
    model = LM(LMConfig(d_model=16, n_layers=1, n_heads=2, attention="local:4"))
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    tensors["embed.weight"][3, 1] = float("nan")
    root = tmp_path / "run" / "checkpoints"
    save_checkpoint(root, step=5, model_tensors=tensors, optimizer_state={"state": {}, "param_groups": []},
                    rng={"torch": torch.get_rng_state()}, carries=[None],
                    meta={"model_config": model.config.to_dict(), "train_config": {"data": "x", "context": 8}})
    for argv in (["eval", "--ckpt", str(tmp_path / "run"), "--no-progress"],
                 ["generate", "--ckpt", str(tmp_path / "run"), "--max-new-tokens", "2"],
                 ["export", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]):
        code, _, stderr = run(argv)
        assert code == 2, (argv, stderr)
        assert "embed.weight" in stderr and "NaN or inf" in stderr, stderr


# ----------------------------------------------------------------------------- one writer per folder


HOLD_LOCK = """
import sys, time
from linattn.train.run_folder import RunLock
lock = RunLock.acquire(sys.argv[1], what="train", command="holder")
print("locked", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def lock_held_by_another_process(folder: Path):
    process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "locked"
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_second_writer_is_refused_naming_the_holder_and_a_dead_holder_releases(tmp_path, data):
    run_dir = tmp_path / "run"
    with lock_held_by_another_process(run_dir) as holder:
        for argv in (run_argv(data, run_dir), ["train", "--resume", "--out", str(run_dir), "--no-progress"]):
            code, _, stderr = run(argv)
            assert code == 2, stderr
            assert f"in use by another writer, PID {holder.pid} (holder)" in stderr
        assert not (run_dir / "metrics.jsonl").exists()
    code, _, stderr = run(run_argv(data, run_dir, steps=4))  # the holder was killed: its lock went with it
    assert code == 0, stderr


def test_the_lock_excludes_a_second_claim_in_the_same_process(tmp_path):
    lock = RunLock.acquire(tmp_path / "r", what="train")
    with pytest.raises(RunFolderError, match=f"PID {os.getpid()}"):
        RunLock.acquire(tmp_path / "r", what="train")
    lock.release()
    RunLock.acquire(tmp_path / "r", what="train").release()


def test_a_filesystem_that_cannot_lock_a_folder_locks_its_lock_file(tmp_path, monkeypatch):
    """Where a folder cannot be locked (NFS takes ``flock`` as a byte-range lock, which a folder
    opened for reading cannot hold: EBADF), the run locks its ``.lock`` file instead, writes its
    description into that same file (replacing it would drop the lock) and still keeps a second
    writer and a converter out; released, the folder is free."""
    import stat

    import linattn.train.run_folder as run_folder

    real = run_folder._try_lock

    def no_folder_locks(descriptor):
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(descriptor)

    monkeypatch.setattr(run_folder, "_try_lock", no_folder_locks)
    run = tmp_path / "run"
    with run_folder.RunLock.acquire(run, what="train", command="first writer"):
        assert "command=first writer" in (run / ".lock").read_text()
        with pytest.raises(run_folder.RunFolderError, match="in use by another writer"):
            run_folder.RunLock.acquire(run, what="train")
        with pytest.raises(run_folder.RunFolderError, match="in use by a training run"):
            run_folder.check_not_in_use(run, what="export")
    run_folder.RunLock.acquire(run, what="train").release()
    run_folder.check_not_in_use(tmp_path / "no-lock-here", what="export")


def test_deleting_the_lock_file_lets_no_second_writer_in(tmp_path, data):
    """``.lock`` stays in a run folder and invites clean-up; deleting it while the run is live
    must not let a second writer in: it is refused, naming the holder."""
    run_dir = tmp_path / "run"
    with lock_held_by_another_process(run_dir) as holder:
        (run_dir / ".lock").unlink()
        for argv in (run_argv(data, run_dir, steps=4), ["train", "--resume", "--out", str(run_dir), "--no-progress"]):
            code, _, stderr = run(argv)
            assert code == 2, stderr
            assert f"in use by another writer, PID {holder.pid}" in stderr
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    code, _, stderr = run(run_argv(data, run_dir, steps=4))  # the holder is gone: the folder is free again
    assert code == 0, stderr


@pytest.mark.parametrize("where", ["new/run", "existing-empty"])
def test_a_start_that_fails_before_writing_leaves_the_folder_as_it_was(tmp_path, data, where):
    """A bad --data path (or a resume of a folder without a run) fails after the folder was
    claimed: the claim's ``.lock``, and the folders it created, go with it, so nothing is left
    that a retry would take for a run."""
    run_dir = tmp_path / where
    if where == "existing-empty":
        run_dir.mkdir()
    missing = tmp_path / "no-such-data.txt"
    for argv in (run_argv(missing, run_dir, steps=4), ["train", "--resume", "--out", str(run_dir), "--no-progress"]):
        code, _, stderr = run(argv)
        assert code == 2, stderr
        if where == "existing-empty":
            assert list(run_dir.iterdir()) == [], stderr
        else:
            assert not (tmp_path / "new").exists(), stderr
    code, _, stderr = run(run_argv(data, run_dir, steps=4))
    assert code == 0, stderr


SLOW_TRAIN = """
import sys, time
import linattn.train.trainer as trainer
original = trainer.learning_rate
trainer.learning_rate = lambda *a, **k: (time.sleep(0.2), original(*a, **k))[1]
from linattn.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_two_concurrent_trainings_one_is_refused_and_the_other_is_untouched(tmp_path, data):
    run_dir = tmp_path / "run"
    argv = run_argv(data, run_dir, "--log-every", "1", steps=30)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-c", SLOW_TRAIN, *argv], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file() or not records(run_dir):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        code, _, stderr = run(argv)
        assert code == 2 and f"PID {first.pid}" in stderr, stderr
        code, _, stderr = run(["train", "--resume", "--out", str(run_dir), "--no-progress"])
        assert code == 2 and f"PID {first.pid}" in stderr, stderr
        _, err = first.communicate(timeout=180)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
    steps = [r["step"] for r in records(run_dir) if "loss" in r]
    assert steps == list(range(1, 31))


# ----------------------------------------------------------------------------- no accidental reuse


def test_a_folder_that_lost_its_latest_is_refused_and_left_as_it_was(tmp_path, data):
    run_dir = tmp_path / "run"
    assert run(run_argv(data, run_dir))[0] == 0
    (run_dir / "checkpoints" / "latest").unlink()
    before = file_digests(run_dir)
    code, _, stderr = run(run_argv(data, run_dir, "--seed", "1"))
    assert code == 2
    assert "already holds a run" in stderr and f"linattn train --resume --out {run_dir}" in stderr
    assert file_digests(run_dir) == before
    code, stdout, stderr = run(["train", "--resume", "--out", str(run_dir), "--no-progress", "--steps", "16"])
    assert code == 0, stderr  # the newest complete checkpoint


def test_overwrite_moves_the_old_run_aside_and_deletes_nothing(tmp_path, data):
    run_dir = tmp_path / "run"
    assert run(run_argv(data, run_dir, steps=4))[0] == 0
    first = file_digests(run_dir)
    code, stdout, stderr = run(run_argv(data, run_dir, "--overwrite", "--seed", "1", steps=8))
    assert code == 0, stderr
    assert f"moved the previous run in {run_dir} to {tmp_path / 'run.old-1'}" in stdout
    assert file_digests(tmp_path / "run.old-1") == first
    assert step_folders(run_dir) == ["step-00000004", "step-00000008"]
    second = file_digests(run_dir)
    assert run(run_argv(data, run_dir, "--overwrite", steps=4))[0] == 0
    assert file_digests(tmp_path / "run.old-2") == second and file_digests(tmp_path / "run.old-1") == first
    code, _, stderr = run(["train", "--resume", "--overwrite", "--out", str(run_dir), "--no-progress"])
    assert code == 2 and "--overwrite" in stderr


def _tiny_checkpoint(root: Path, step: int, keep: int = 2) -> Path:
    model = LM(LMConfig(d_model=8, n_layers=1, n_heads=2, attention="local:4"))
    return save_checkpoint(root, step=step, model_tensors=model.state_dict(),
                           optimizer_state={"state": {}, "param_groups": []}, rng={"torch": torch.get_rng_state()},
                           carries=[None], meta={"model_config": model.config.to_dict()}, keep=keep)


def test_pruning_never_removes_the_checkpoint_latest_names(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (8, 12):
        _tiny_checkpoint(root, step)
    _tiny_checkpoint(root, 5)  # e.g. resumed --from an earlier step while later ones remain
    assert (root / "latest").read_text().strip() == "step-00000005"
    assert load_checkpoint(root).step == 5
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000005", "step-00000008", "step-00000012"]
    _tiny_checkpoint(root, 6)  # the older of the kept ones goes now, as it is neither new nor named
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000006", "step-00000008", "step-00000012"]


def test_convert_and_export_refuse_a_run_folder_and_a_locked_one(tmp_path, data):
    run_dir = tmp_path / "run"
    assert run(run_argv(data, run_dir, steps=4))[0] == 0
    code, _, stderr = run(["convert", "--ckpt", str(run_dir), "--out", str(run_dir)])
    assert code == 2 and "already holds a run" in stderr, stderr
    code, _, stderr = run(["export", "--ckpt", str(run_dir), "--out", str(run_dir)])
    assert code == 2 and "training run's folder" in stderr, stderr
    with lock_held_by_another_process(tmp_path / "busy") as holder:
        code, _, stderr = run(["convert", "--ckpt", str(run_dir), "--out", str(tmp_path / "busy")])
        assert code == 2 and f"PID {holder.pid}" in stderr, stderr
        code, _, stderr = run(["export", "--ckpt", str(run_dir), "--out", str(tmp_path / "busy")])
        assert code == 2 and f"PID {holder.pid}" in stderr, stderr


# ----------------------------------------------------------------------------- write failures


@pytest.mark.parametrize("failure", ["ENOSPC", "EIO"])
def test_a_failed_save_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path, data, monkeypatch, failure):
    run_dir = tmp_path / "run"
    saves = {"n": 0}
    if failure == "ENOSPC":
        original = checkpoint_module.save_file

        def save_file(tensors, path):
            saves["n"] += 1
            if saves["n"] >= 3:  # the second checkpoint's first file: half written, then the disk is full
                Path(path).write_bytes(b"\0" * 100)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return original(tensors, path)

        monkeypatch.setattr(checkpoint_module, "save_file", save_file)
    else:
        original = checkpoint_module.fsync_file

        def fsync_file(path):
            saves["n"] += 1
            if saves["n"] >= 4:  # the second checkpoint's first fsync
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return original(path)

        monkeypatch.setattr(checkpoint_module, "fsync_file", fsync_file)
    snapshot = {}

    original_save = checkpoint_module.save_checkpoint

    def save_checkpoint_recording(root, **kwargs):
        if (Path(root) / "step-00000004").is_dir():
            snapshot.update(file_digests(Path(root) / "step-00000004"))
        return original_save(root, **kwargs)

    monkeypatch.setattr(trainer_module, "save_checkpoint", save_checkpoint_recording)
    code, _, stderr = run(run_argv(data, run_dir))
    assert code == 2
    assert stderr.startswith("linattn: error: cannot write checkpoint")
    assert str(run_dir / "checkpoints" / "step-00000008") in stderr
    assert os.strerror(getattr(errno, failure)) in stderr and "MB free there" in stderr
    assert f"the previous checkpoint {run_dir / 'checkpoints' / 'step-00000004'} is intact" in stderr
    assert snapshot and file_digests(run_dir / "checkpoints" / "step-00000004") == snapshot
    assert step_folders(run_dir) == ["step-00000004"]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000004"


def test_a_failed_metrics_write_is_a_clear_error(tmp_path, data, monkeypatch):
    run_dir = tmp_path / "run"
    real_open = open
    writes = {"n": 0}

    def failing_open(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and "a" in mode:
            writes["n"] += 1
            if writes["n"] >= 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", failing_open)
    code, _, stderr = run(run_argv(data, run_dir))
    assert code == 2
    assert f"cannot write {run_dir / 'metrics.jsonl'}" in stderr and "No space left on device" in stderr


class _InterruptedWrite:
    """A text file handle whose first ``write`` writes half of its text and then raises
    KeyboardInterrupt, as a Ctrl-C (or a kill) in the middle of writing would."""

    def __init__(self, handle):
        self._handle = handle

    def write(self, text: str) -> int:
        self._handle.write(text[: len(text) // 2])
        self._handle.flush()
        raise KeyboardInterrupt

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()

    def __getattr__(self, name):
        return getattr(self._handle, name)


def test_a_resume_stopped_while_it_rewrites_metrics_leaves_the_old_file(tmp_path, data, monkeypatch):
    """A resume rewrites metrics.jsonl without the lines logged after its checkpoint. Stopped in
    the middle of that rewrite, the file must be the old one, not an empty or half one."""
    import builtins
    import io

    run_dir = tmp_path / "run"
    assert run(run_argv(data, run_dir, steps=8))[0] == 0
    shutil.rmtree(run_dir / "checkpoints" / "step-00000008")  # as if killed before its checkpoint at 8
    (run_dir / "checkpoints" / "latest").write_text("step-00000004\n")
    before = (run_dir / "metrics.jsonl").read_bytes()
    assert [r["step"] for r in records(run_dir)] == [4, 8]
    real_open = builtins.open

    def interrupting_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        return _InterruptedWrite(handle) if "metrics.jsonl" in Path(str(file)).name and "w" in mode else handle

    monkeypatch.setattr(builtins, "open", interrupting_open)
    monkeypatch.setattr(io, "open", interrupting_open)  # what Path.write_text opens with
    code, _, stderr = run(["train", "--resume", "--out", str(run_dir), "--no-progress"])
    monkeypatch.undo()
    assert code == 130, stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    code, _, stderr = run(["train", "--resume", "--out", str(run_dir), "--no-progress"])
    assert code == 0, stderr
    assert [r["step"] for r in records(run_dir)] == [4, 8]


def _strict_json(line: str) -> dict:
    def refuse(token: str):
        raise ValueError(f"not strict JSON: {token}")

    return json.loads(line, parse_constant=refuse)


def test_metrics_are_strict_json_and_name_what_was_not_finite(tmp_path, data, monkeypatch):
    """A skipped step's NaN loss is logged as null with the values that were not finite named,
    so every line parses under a strict JSON reader; linattn's reader gives the NaN back and
    still reads the bare NaN of older files."""
    run_dir = tmp_path / "run"
    poison(monkeypatch, {4}, "loss")
    code, _, stderr = run(run_argv(data, run_dir, "--set", "train.max_skipped_steps=1", steps=8))
    assert code == 0, stderr
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    logged = [_strict_json(line) for line in lines]
    [step4] = [r for r in logged if r["step"] == 4 and "lr" in r]
    assert step4["loss"] is None and step4["bpb"] is None
    assert step4["nonfinite_values"] == {"loss": "NaN", "bpb": "NaN"}
    assert math.isfinite(step4["grad_norm"])
    from linattn.train.metrics import read_metrics

    read = dict((r["step"], r) for _, r in read_metrics(run_dir / "metrics.jsonl") if "lr" in r)
    assert math.isnan(read[4]["loss"]) and "nonfinite_values" not in read[4] and math.isfinite(read[8]["loss"])
    old = tmp_path / "old.jsonl"
    old.write_text('{"step": 1, "loss": NaN, "bpb": Infinity}\n')
    [(_, record)] = read_metrics(old)
    assert math.isnan(record["loss"]) and record["bpb"] == math.inf


def test_a_skipped_final_step_is_an_error_naming_the_final_checkpoint(tmp_path, data, monkeypatch):
    """In skip mode a final step that is not finite would end the run with exit 0 and a NaN
    'last training loss': it is an error (exit 3) naming the final checkpoint instead."""
    run_dir = tmp_path / "run"
    poison(monkeypatch, {12}, "loss")
    code, stdout, stderr = run(run_argv(data, run_dir, "--set", "train.max_skipped_steps=1"))
    assert code == 3, stdout + stderr
    assert "nan" not in stdout.lower()
    assert "at the final step, 12, the loss was not finite" in stderr
    assert str(run_dir / "checkpoints" / "step-00000012") in stderr and "holds the weights of step 11" in stderr
    assert load_checkpoint(run_dir).step == 12  # written, with the weights of step 11: finite


def _overflowing_checkpoint(run_dir: Path) -> Path:
    """Save, through the checkpoint writer, step 5 of ``run_dir``: its step-4 weights with the final
    norm's weight at 3e38, finite, but the forward pass overflows to inf and NaN."""
    checkpoint = load_checkpoint(run_dir)
    tensors = dict(checkpoint.model)
    tensors["norm.weight"] = torch.full_like(tensors["norm.weight"], 3e38)
    meta = {key: value for key, value in checkpoint.meta.items()
            if key not in ("format", "version", "step", "files", "optimizer", "rng", "carry", "meta_sha256")}
    return save_checkpoint(run_dir / "checkpoints", step=5, model_tensors=tensors,
                           optimizer_state=checkpoint.optimizer_state(), rng=checkpoint.rng(),
                           carries=[checkpoint.carry(0)], meta=meta)


def test_eval_and_generate_refuse_a_checkpoint_whose_forward_is_not_finite(tmp_path, data):
    from linattn.train import load_model

    run_dir = tmp_path / "run"
    assert run(run_argv(data, run_dir, steps=4))[0] == 0
    path = _overflowing_checkpoint(run_dir)
    model, _ = load_model(run_dir)  # finite weights: the readers take it
    assert not torch.isfinite(model(torch.tensor([[65, 66, 67]]))[0]).all()
    for argv in (["eval", "--ckpt", str(run_dir), "--no-progress"],
                 ["eval", "--ckpt", str(run_dir), "--no-progress", "--json"],
                 ["generate", "--ckpt", str(run_dir), "--temperature", "0", "--max-new-tokens", "4"],
                 ["generate", "--ckpt", str(run_dir), "--max-new-tokens", "4"]):
        code, stdout, stderr = run(argv)
        assert code == 2, (argv, stdout, stderr)
        assert stderr.startswith("linattn: error:") and stderr.count("\n") == 1, stderr
        assert str(path) in stderr and "not finite" in stderr, stderr
        assert "\0" not in stdout and "nan" not in stdout.lower(), stdout


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_temporaries_of_dead_writers_are_removed_and_live_ones_kept(tmp_path, data):
    run_dir = tmp_path / "run"
    assert run(run_argv(data, run_dir, steps=4))[0] == 0
    root = run_dir / "checkpoints"
    dead, live = _dead_pid(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [root / f".tmp-step-00000008-{dead}", root / f".old-step-00000004-{dead}"]
        kept = [root / f".tmp-step-00000008-{live.pid}"]
        for folder in stale + kept:
            folder.mkdir()
            (folder / "model.safetensors").write_bytes(b"x" * 10)
        (root / f".latest.tmp-{dead}").write_text("step-00000004\n")
        stale.append(root / f".latest.tmp-{dead}")
        code, _, stderr = run(["train", "--resume", "--out", str(run_dir), "--steps", "8", "--no-progress"])
        assert code == 0, stderr
        assert not any(p.exists() for p in stale)
        assert all(p.is_dir() for p in kept)
    finally:
        live.kill()
        live.wait()
    assert remove_stale_temporaries(root) == kept  # its writer is dead now


def test_an_optimizer_state_saved_before_the_fused_adamw_loads_into_it():
    """Checkpoints written before the guard hold a non-fused AdamW's groups (``fused: None``);
    ``load_state_dict`` takes the implementation from them, so they are set to fused on
    resume, where the guard's ``found_inf`` needs it."""
    from linattn.train.optim import as_fused_state, parameter_groups, trainer_adamw

    model = LM(LMConfig(d_model=8, n_layers=1, n_heads=2, attention="local:4"))
    old = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randint(0, 256, (1, 4)))[0].sum().backward()
    old.step()
    saved = old.state_dict()
    for state, works in ((saved, False), (as_fused_state(saved), True)):
        optimizer = trainer_adamw(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
        optimizer.load_state_dict(state)
        optimizer.found_inf = torch.ones(())
        if works:
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        else:
            with pytest.raises(AssertionError, match="found_inf"):
                optimizer.step()


def test_a_torchrun_run_into_a_locked_folder_stops_on_every_rank(tmp_path, data):
    """Rank 0 is the writer that claims the folder; the other ranks learn its refusal through the
    process group instead of training alone (or waiting forever), and stop without a word:
    rank 0's error is printed once."""
    run_dir = tmp_path / "run"
    env = torchrun_env()
    with lock_held_by_another_process(run_dir) as holder:
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                 "2", "-m", "linattn.cli", *run_argv(data, run_dir, steps=4)],
                                env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode != 0
    assert result.stderr.count(f"in use by another writer, PID {holder.pid}") == 1, result.stderr[-3000:]
    assert "rank 0 could not claim the run folder" not in result.stderr  # rank 1 stops silently
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]


DDP_NAN_ON_ONE_RANK = """
import os, sys
import torch
torch.set_num_threads(1)
from safetensors.torch import save_file
import linattn.train.trainer as trainer
from linattn.models import LMConfig
from linattn.train import TrainConfig, train

out, data = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
original, calls = trainer.accumulate_gradients, []

def accumulate(*args, **kwargs):  # rank 1's loss of step 3 is NaN; its gradients (all-reduced) stay finite
    calls.append(1)
    loss, commit, states = original(*args, **kwargs)
    return (loss * float("nan") if rank == 1 and len(calls) == 3 else loss), commit, states

trainer.accumulate_gradients = accumulate
model_config = LMConfig(d_model=16, n_layers=2, attention="vq,linear:elu", n_heads=2, gau_d_k=8, codebook_size=8,
                        block_size=4, chunk_size=8, ffn_hidden=32)
train_config = TrainConfig(data=data, out=out, steps=5, batch_size=2, context=16, lr=3e-3, warmup_steps=2,
                           eval_every=0, log_every=1, checkpoint_every=5, threads=1, max_skipped_steps=1)
summary = train(model_config, train_config, progress=False, echo=lambda *a: None)
tensors = {name: value.detach().contiguous() for name, value in summary["model"].state_dict().items()}
save_file(tensors, os.path.join(out, f"rank{rank}.safetensors"))
"""


def test_a_step_that_is_not_finite_on_one_rank_is_skipped_on_every_rank(tmp_path, data):
    from safetensors.torch import load_file

    script, run_dir = tmp_path / "ddp_nan.py", tmp_path / "run"
    script.write_text(DDP_NAN_ON_ONE_RANK)
    env = torchrun_env()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(script), str(run_dir), str(data)], env=env, capture_output=True, text=True,
                            timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in records(run_dir) if r.get("skipped")] == [3]
    rank0, rank1 = (load_file(str(run_dir / f"rank{r}.safetensors")) for r in (0, 1))
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), f"{name} differs across ranks"
