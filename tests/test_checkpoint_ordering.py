"""Checkpoint writes in order: the step folder is in place before ``latest`` names it, so a
failure (or crash) between the two leaves ``latest`` on the previous, complete checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from linattn.train.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint, step_name


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
    with pytest.raises(RenameFailed):
        _save(root, 2, fill=2.0)
    assert attempts, "the step folder was never renamed into place"
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
    with pytest.raises(RenameFailed):
        _save(root, 2, fill=3.0)
    assert attempts, "the step folder was never renamed into place"
    _assert_latest_is(root, 2, first)
    monkeypatch.undo()
    replaced = _save(root, 2, fill=3.0)
    _assert_latest_is(root, 2, replaced)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [step_name(1), step_name(2)]
