"""Checkpoint writes in order: the step folder is in place before ``latest`` names it, so a
failure (or crash) between the two leaves ``latest`` on the previous, complete checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from linattn.train.checkpoint import (CheckpointError, CheckpointWriteError, load_checkpoint, resolve_checkpoint,
                                     save_checkpoint, step_name)
from test_resume_checks import write_meta


class RenameFailed(OSError):
    pass


def _save(root: Path, step: int, fill: float) -> dict[str, torch.Tensor]:
    tensors = {"weight": torch.full((3, 4), fill), "bias": torch.arange(4.0) * fill}
    save_checkpoint(root, step=step, model_tensors=tensors, optimizer_state={"state": {}, "param_groups": []},
                    rng={"torch": torch.get_rng_state()}, carries=[None], meta={"note": f"fill {fill}"}, keep=3)
    return tensors


def _fail_renames_onto(monkeypatch, target: Path) -> list[Path]:
    """Make every rename/replace whose destination is ``target`` raise; return the attempts."""
    attempts = []

    def guarded(original):
        def rename(source, destination, *args, **kwargs):
            if Path(destination).resolve() == target.resolve():
                attempts.append(Path(source))
                raise RenameFailed(f"simulated failure renaming {source} -> {destination}")
            return original(source, destination, *args, **kwargs)
        return rename

    monkeypatch.setattr(os, "rename", guarded(os.rename))
    monkeypatch.setattr(os, "replace", guarded(os.replace))
    return attempts


def _assert_latest_is(root: Path, step: int, tensors: dict[str, torch.Tensor]) -> None:
    folder = resolve_checkpoint(root)
    assert (root / "latest").read_text().strip() == folder.name
    checkpoint = load_checkpoint(root)
    assert checkpoint.step == step
    assert sorted(checkpoint.model) == sorted(tensors)
    for name, value in tensors.items():
        assert torch.equal(checkpoint.model[name], value), name


def test_failed_rename_of_a_new_step_keeps_latest_on_the_previous_step(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    first = _save(root, 1, fill=1.0)
    attempts = _fail_renames_onto(monkeypatch, root / step_name(2))
    with pytest.raises(CheckpointWriteError, match="simulated failure") as failure:
        _save(root, 2, fill=2.0)
    assert isinstance(failure.value.__cause__, RenameFailed)
    assert attempts, "the step folder was never renamed into place"
    assert not list(root.glob(".tmp-*"))  # the half-written folder goes with the failure
    assert not (root / step_name(2)).exists()
    assert (root / "latest").read_text().strip() == step_name(1)
    _assert_latest_is(root, 1, first)
    assert resolve_checkpoint(tmp_path) == root / step_name(1)  # through the run folder too
    monkeypatch.undo()
    second = _save(root, 2, fill=2.0)  # and the next save goes through
    _assert_latest_is(root, 2, second)


def test_failed_rename_when_saving_the_same_step_again_keeps_a_complete_latest(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _save(root, 1, fill=1.0)
    first = _save(root, 2, fill=2.0)
    attempts = _fail_renames_onto(monkeypatch, root / step_name(2))
    with pytest.raises(CheckpointWriteError, match="simulated failure") as failure:
        _save(root, 2, fill=3.0)
    assert isinstance(failure.value.__cause__, RenameFailed)
    assert attempts, "the step folder was never renamed into place"
    _assert_latest_is(root, 2, first)
    monkeypatch.undo()
    replaced = _save(root, 2, fill=3.0)
    _assert_latest_is(root, 2, replaced)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [step_name(1), step_name(2)]


# -- what a save creates, what pruning may fail to remove, and what a load refuses ------------


def test_a_save_creates_the_missing_folders_above_the_checkpoints(tmp_path):
    """``save_checkpoint`` into a run folder that does not exist yet creates it and its parents."""
    root = tmp_path / "not" / "yet" / "run" / "checkpoints"
    tensors = _save(root, 1, fill=1.0)
    _assert_latest_is(root, 1, tensors)


def test_pruning_that_cannot_remove_an_old_folder_does_not_fail_the_save(tmp_path):
    """The new checkpoint is complete and named by ``latest`` before pruning starts; an old step
    folder or ``.old-*`` copy that cannot be removed (here: symlinks, which ``rmtree`` refuses) is
    left in place, the save still succeeds, and the folders the links point to are untouched."""
    root = tmp_path / "checkpoints"
    elsewhere = tmp_path / "archive"
    for name in ("step", "backup"):
        (elsewhere / name).mkdir(parents=True)
        (elsewhere / name / "keep.txt").write_text(name)
    root.mkdir()
    (root / step_name(0)).symlink_to(elsewhere / "step", target_is_directory=True)  # the oldest "step folder"
    (root / f".old-{step_name(7)}-1").symlink_to(elsewhere / "backup", target_is_directory=True)
    tensors = {}
    for step in (1, 2, 3):  # keep=3: the fourth folder, step 0, is pruned
        tensors = _save(root, step, fill=float(step))
    _assert_latest_is(root, 3, tensors)
    assert (root / step_name(0)).is_symlink() and (root / f".old-{step_name(7)}-1").is_symlink()
    assert (elsewhere / "step" / "keep.txt").read_text() == "step"
    assert (elsewhere / "backup" / "keep.txt").read_text() == "backup"


def test_non_tensor_optimizer_values_come_back_as_they_were_saved(tmp_path):
    """Optimizer state that is not a tensor (counts, flags, None) is stored in meta.json and read
    back unchanged, next to the tensors; a real AdamW state loads back into the optimizer."""
    parameter = torch.nn.Parameter(torch.arange(4.0))
    optimizer = torch.optim.AdamW([parameter], lr=0.1)
    parameter.grad = torch.ones(4)
    optimizer.step()
    state = optimizer.state_dict()
    state["state"][1] = {"count": 3, "scale": 0.5, "flag": True, "nothing": None, "buffer": torch.full((2,), 7.0)}
    save_checkpoint(tmp_path, step=1, model_tensors={"w": torch.zeros(1)}, optimizer_state=state,
                    rng={"torch": torch.get_rng_state()}, carries=[None], meta={})
    restored = load_checkpoint(tmp_path).optimizer_state()
    assert {name: value for name, value in restored["state"][1].items() if name != "buffer"} == \
        {"count": 3, "scale": 0.5, "flag": True, "nothing": None}
    assert torch.equal(restored["state"][1]["buffer"], torch.full((2,), 7.0))
    for name, value in state["state"][0].items():
        assert torch.equal(restored["state"][0][name], value), name
    del restored["state"][1]
    again = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    again.load_state_dict(restored)
    assert torch.equal(again.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


@pytest.mark.parametrize("name", ["NoSuchState", "dataclass"])
def test_a_carried_state_of_an_unknown_type_is_a_checkpoint_error(tmp_path, name):
    """A meta.json whose carried state names a type that is not a linattn state (absent from
    ``linattn.state``, or something there that is no state class) is refused by name."""
    save_checkpoint(tmp_path, step=1, model_tensors={"w": torch.zeros(1)},
                    optimizer_state={"state": {}, "param_groups": []}, rng={"torch": torch.get_rng_state()},
                    carries=[None], meta={})
    meta_file = tmp_path / step_name(1) / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["carry"] = [{"state": name, "fields": {}}]
    write_meta(meta_file.parent, meta, seal=True)  # a consistent checkpoint, its hash recomputed
    checkpoint = load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=f"unknown state type '{name}' in checkpoint"):
        checkpoint.carry(0)
