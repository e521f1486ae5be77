"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically.

A checkpoint is a folder ``<run>/checkpoints/step-00000100/`` holding

- ``model.safetensors``: the model's ``state_dict`` (parameters and persistent buffers);
- ``training.safetensors``: optimizer tensors, RNG states and the carried recurrent
  state of every process (``carry.rank<r>.*``);
- ``meta.json``: format tag, step, configs, data position (and a fingerprint of the data,
  ``data_fingerprint``), the non-tensor parts of the optimizer state and of the carried
  state, the size and SHA-256 of both tensor files, and ``meta_sha256``, the SHA-256 of the
  document itself: of ``json.dumps(document_without_meta_sha256, sort_keys=True)`` (UTF-8),
  so an edited ``step``, learning rate or config is refused like a corrupt tensor file.

It is written into a temporary folder and renamed into place, then ``checkpoints/latest``
is replaced atomically, so a crash leaves either the old or the new checkpoint, never a
half one; ``latest`` never names a folder that is not complete (a step saved again is
swapped in while ``latest`` names a hard-linked copy of the old one). ``latest`` holds the
name of a folder beside it and nothing else: a path (``../other-run/...``), or a name that is
a symbolic link, would continue or evaluate another run's checkpoint in this run's name,
and is refused, as is a ``step-*`` symbolic link selected by ``--from``; the fallbacks skip
such links. Loading never
unpickles: it checks sizes and hashes first, so a truncated, edited or foreign file is a
``CheckpointError`` that says what is wrong.

Format versions: 2 (this one) and 1, written before ``meta.json`` carried its own hash;
version-1 checkpoints still load, their ``meta.json`` unchecked (the tensor files are).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .. import state as state_module
from .._checks import is_int
from .._files import fsync_file, sha256_json, write_text_atomic

FORMAT = "linattn-checkpoint"
VERSION = 2
_READABLE_VERSIONS = (1, 2)  # 1: meta.json without META_HASH
META_HASH = "meta_sha256"
TENSOR_FILES = ("model.safetensors", "training.safetensors")


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupt or not a linattn checkpoint."""


# -- states <-> (tensors, JSON structure) ---------------------------------------------------


def flatten_state(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Describe a (nested) decode state as JSON, moving its tensors into ``tensors``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value.detach().contiguous().cpu()
        return {"tensor": prefix}
    if isinstance(value, tuple):
        return {"tuple": [flatten_state(item, f"{prefix}.{i}", tensors) for i, item in enumerate(value)]}
    if isinstance(value, state_module._State):
        fields = {f.name: flatten_state(getattr(value, f.name), f"{prefix}.{f.name}", tensors)
                  for f in value.value_fields()}
        return {"state": type(value).__name__, "fields": fields}
    raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint state")


def unflatten_state(structure: Any, tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> Any:
    """Inverse of ``flatten_state``."""
    if structure is None or isinstance(structure, (bool, int, float, str)):
        return structure
    if "tensor" in structure:
        return tensors[structure["tensor"]].to(device)
    if "tuple" in structure:
        return tuple(unflatten_state(item, tensors, device) for item in structure["tuple"])
    cls = getattr(state_module, structure["state"], None)
    if not (isinstance(cls, type) and issubclass(cls, state_module._State)):
        raise CheckpointError(f"unknown state type {structure['state']!r} in checkpoint")
    return cls(**{name: unflatten_state(item, tensors, device) for name, item in structure["fields"].items()})


# -- optimizer state <-> (tensors, JSON) ----------------------------------------------------


def _split_optimizer(state_dict: dict, tensors: dict[str, torch.Tensor]) -> dict:
    state = {}
    for index, entry in state_dict["state"].items():
        state[str(index)] = {}
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = value.detach().contiguous().cpu()
                state[str(index)][name] = {"tensor": f"optimizer.{index}.{name}"}
            else:
                state[str(index)][name] = value
    return {"state": state, "param_groups": state_dict["param_groups"]}


def _join_optimizer(structure: dict, tensors: dict[str, torch.Tensor]) -> dict:
    state = {}
    for index, entry in structure["state"].items():
        state[int(index)] = {
            name: tensors[value["tensor"]] if isinstance(value, dict) and "tensor" in value else value
            for name, value in entry.items()
        }
    return {"state": state, "param_groups": structure["param_groups"]}


# -- writing --------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _meta_hash(document: dict[str, Any]) -> str:
    """SHA-256 of ``json.dumps(document without META_HASH, sort_keys=True)``, taken of the
    document as JSON reads it back (tuples as lists, keys as strings)."""
    body = json.loads(json.dumps(document))
    body.pop(META_HASH, None)
    return sha256_json(body)


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(
    root: str | Path,
    *,
    step: int,
    model_tensors: dict[str, torch.Tensor],
    optimizer_state: dict,
    rng: dict[str, torch.Tensor],
    carries: list[Any],
    meta: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write ``root/step-XXXXXXXX`` atomically, point ``root/latest`` at it, keep the newest ``keep``.

    ``carries``: the carried decode state of each process (rank order), or None entries.
    """
    root = Path(root)
    final = root / step_name(step)
    temporary = root / f".tmp-{step_name(step)}-{os.getpid()}"
    tensors = {name: t.detach().contiguous().cpu() for name, t in model_tensors.items()}
    training: dict[str, torch.Tensor] = {}
    optimizer_structure = _split_optimizer(optimizer_state, training)
    for name, value in rng.items():
        training[f"rng.{name}"] = value.detach().contiguous().cpu()
    carry_structure = [flatten_state(carry, f"carry.rank{rank}", training) for rank, carry in enumerate(carries)]
    needed = sum(t.numel() * t.element_size() for t in (*tensors.values(), *training.values()))
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
        save_file(tensors, str(temporary / "model.safetensors"))
        save_file(training, str(temporary / "training.safetensors"))

        files = {}
        for name in TENSOR_FILES:
            fsync_file(temporary / name)
            files[name] = {"bytes": (temporary / name).stat().st_size, "sha256": _sha256(temporary / name)}
        document = {
            "format": FORMAT, "version": VERSION, "step": step, "files": files,
            "optimizer": optimizer_structure, "rng": sorted(rng), "carry": carry_structure, **meta,
        }
        document[META_HASH] = _meta_hash(document)  # replaces one copied in with ``meta``
        (temporary / "meta.json").write_text(json.dumps(document, indent=1), encoding="utf-8")
        fsync_file(temporary / "meta.json")

        if final.exists():  # the same step saved again (e.g. on interrupt)
            _remove_keeping_latest_complete(root, final)
        os.rename(temporary, final)
        write_text_atomic(root / "latest", final.name + "\n")
    except (OSError, SafetensorError) as error:
        shutil.rmtree(temporary, ignore_errors=True)
        raise _write_error(root, final, error, needed) from error
    _prune(root, keep)
    return final


class NoCheckpointError(CheckpointError):
    """A run folder without any checkpoint to resume from."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (a full disk, an I/O error, no permission);
    the previous checkpoints and ``latest`` are as they were."""


def _write_error(root: Path, final: Path, error: Exception, needed: int) -> CheckpointWriteError:
    """The error for a failed save: the path, the cause, the space it needs and what is free."""
    try:
        free = f"{shutil.disk_usage(root if root.exists() else root.parent).free / 1e6:,.1f} MB free there"
    except OSError:
        free = "free space unknown"
    size = f"it needs about {needed / 1e6:,.1f} MB, {free}"
    latest = _latest_name(root) if root.is_dir() else None
    kept = (f"the previous checkpoint {root / latest} is intact" if latest else "no earlier checkpoint exists")
    return CheckpointWriteError(f"cannot write checkpoint {final}: {error} ({size}); {kept}. Free space or fix the "
                                f"folder's permissions, then continue with linattn train --resume")


def _latest_name(root: Path) -> str | None:
    pointer = root / "latest"
    return pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None


_OWN_FOLDER = re.compile(r"^(?:step-\d+|\.old-step-\d+-\d+)$")  # what ``latest`` may name


def _step_folders(root: Path) -> list[Path]:
    """The ``step-*`` folders of ``root`` (symbolic links left out), oldest first."""
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.is_symlink())


def _refuse_link(folder: Path, named_by: str) -> None:
    """``CheckpointError`` if ``folder`` (``named_by`` says what named it) is a symbolic link."""
    if folder.is_symlink():
        raise CheckpointError(f"{named_by} names {folder.name}, a symbolic link to {os.readlink(folder)}: a "
                              f"checkpoint of another run is not this run's; a run continues and is evaluated from "
                              f"its own step-* folders only (to use that checkpoint, name it: --ckpt or --from PATH)")


def latest_folder(root: Path) -> Path:
    """The folder ``root/latest`` names: a ``step-*`` folder (or the ``.old-step-*`` copy a
    save keeps) directly in ``root``, not a symbolic link; else ``CheckpointError`` naming
    ``latest`` and what it points to."""
    pointer = root / "latest"
    name = pointer.read_text(encoding="utf-8").strip()
    if not _OWN_FOLDER.match(name):
        raise CheckpointError(f"{pointer} names {name!r}, which is not a step-* folder of this run's {root}: latest "
                              f"may only hold the name of a checkpoint folder beside it, never a path (it would "
                              f"continue or evaluate another run's checkpoint in this run's name)")
    _refuse_link(root / name, str(pointer))
    return root / name


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _remove_keeping_latest_complete(root: Path, folder: Path) -> None:
    """Remove the step folder ``folder``; if ``latest`` names it, first point ``latest`` at a
    hard-linked copy (``.old-*``), so it never names a missing folder while the new one moves in."""
    if _latest_name(root) == folder.name:
        backup = root / f".old-{folder.name}-{os.getpid()}"
        shutil.rmtree(backup, ignore_errors=True)
        shutil.copytree(folder, backup, copy_function=_link_or_copy)
        write_text_atomic(root / "latest", backup.name + "\n")
    shutil.rmtree(folder)


def _prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` step folders, and no ``.old-*`` copy that ``latest`` does not name.
    Never removed: the folder ``latest`` names and the newest complete one (with its meta.json)."""
    steps = _step_folders(root)
    latest = _latest_name(root)
    complete = [p for p in steps if (p / "meta.json").is_file()]
    protected = {latest, complete[-1].name if complete else None}
    for old in steps[: max(len(steps) - keep, 0)]:
        if old.name not in protected:
            shutil.rmtree(old, ignore_errors=True)
    for backup in root.glob(".old-step-*"):
        if backup.name != latest:
            shutil.rmtree(backup, ignore_errors=True)


# -- reading --------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """A verified checkpoint: ``meta`` (the JSON), ``model`` and ``training`` tensor dicts."""

    path: Path
    meta: dict[str, Any]
    model: dict[str, torch.Tensor]
    training: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def optimizer_state(self) -> dict:
        return _join_optimizer(self.meta["optimizer"], self.training)

    def rng(self) -> dict[str, torch.Tensor]:
        return {name: self.training[f"rng.{name}"] for name in self.meta["rng"]}

    def identity(self) -> str:
        """The folder's name and the SHA-256 its ``meta.json`` records (of itself; a version-1
        checkpoint: of ``model.safetensors``), which covers every file: what tells two copies
        of a run's checkpoint apart without reading them again."""
        digest = self.meta.get(META_HASH) or self.meta["files"]["model.safetensors"]["sha256"]
        return f"{self.path.name} (SHA-256 {digest[:16]})"

    def carry(self, rank: int, device: torch.device | str = "cpu") -> Any:
        structures = self.meta["carry"]
        if rank >= len(structures):
            return None
        return unflatten_state(structures[rank], self.training, device)


def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder, its ``checkpoints`` folder, or one ``step-*`` folder -> the step folder."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if (path / "meta.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        pointer = root / "latest"
        if pointer.is_file():
            target = latest_folder(root)
            if not (target / "meta.json").is_file():
                raise CheckpointError(f"{pointer} names {target.name}, which is not a complete checkpoint")
            return target
    raise CheckpointError(
        f"{path} is not a linattn checkpoint: expected meta.json in it, or checkpoints/latest under a run folder"
    )


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Verify and read a checkpoint (see ``resolve_checkpoint`` for what ``path`` may be)."""
    folder = resolve_checkpoint(path)
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(
            f"{folder / 'meta.json'} is not valid JSON ({error}); the checkpoint is corrupt"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder} is not a linattn checkpoint (meta.json has no format={FORMAT!r})")
    if not is_int(meta.get("version")) or meta["version"] not in _READABLE_VERSIONS:
        raise CheckpointError(f"{folder}: checkpoint format version {meta.get('version')} is not supported "
                              f"(this linattn reads versions {', '.join(map(str, _READABLE_VERSIONS))})")
    if meta["version"] >= 2 and meta.get(META_HASH) != _meta_hash(meta):
        raise CheckpointError(f"{folder / 'meta.json'} was edited or is corrupt: its content does not match the "
                              f"SHA-256 recorded in it ({META_HASH}); use an earlier checkpoint in {folder.parent}")
    for name in TENSOR_FILES:
        file = folder / name
        expected = meta["files"][name]
        if not file.is_file():
            raise CheckpointError(f"{file} is missing; the checkpoint is incomplete")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{file} is truncated or altered: {size} bytes, the checkpoint recorded "
                                  f"{expected['bytes']}; use an earlier checkpoint in {folder.parent}")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{file} is corrupt: its SHA-256 does not match the one recorded in meta.json; "
                                  f"use an earlier checkpoint in {folder.parent}")
    try:
        model = load_file(str(folder / "model.safetensors"))
        training = load_file(str(folder / "training.safetensors"))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{folder}: cannot read the tensor files ({error})") from None
    return Checkpoint(path=folder, meta=meta, model=model, training=training)


def _usable_checkpoints(root: Path, skip: Path | None = None) -> list[Checkpoint]:
    """The complete, verified ``step-*`` checkpoints under ``root``, newest first."""
    usable = []
    for folder in reversed(_step_folders(root)):
        if skip is not None and folder.resolve() == skip.resolve():
            continue
        try:
            usable.append(load_checkpoint(folder))
        except CheckpointError:
            continue
    return usable


def find_resume_checkpoint(run_dir: str | Path, select: int | str | Path | None = None, *,
                           echo: Callable[[str], None] = print) -> Checkpoint:
    """The checkpoint ``linattn train --resume`` continues from, in the run folder ``run_dir``.

    ``select``: a step number (``run_dir/checkpoints/step-N``) or a checkpoint folder; None
    takes the one ``checkpoints/latest`` names. If ``latest`` is missing, the newest
    complete checkpoint is taken (and ``echo`` says so). If it names a corrupt or incomplete
    checkpoint, the ``CheckpointError`` lists the usable earlier ones and the command that
    resumes from the newest of them.
    """
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    if select is not None:
        if is_int(select):
            folder = root / step_name(select)
            _refuse_link(folder, f"--from {select}")
            if not folder.is_dir():
                steps = ", ".join(str(c.step) for c in reversed(_usable_checkpoints(root))) or "none"
                raise CheckpointError(f"{folder} does not exist; the usable checkpoints of {run_dir} are at steps "
                                      f"{steps}")
            return load_checkpoint(folder)
        return load_checkpoint(select)
    if not (root / "latest").is_file():
        usable = _usable_checkpoints(root) if root.is_dir() else []
        if not usable:
            raise NoCheckpointError(f"{run_dir} holds no checkpoint to resume (no {root / 'latest'} and no complete "
                                    "step-* folder)")
        echo(f"{root / 'latest'} is missing; resuming from the newest complete checkpoint, {usable[0].path.name}")
        return usable[0]
    try:
        return load_checkpoint(root)
    except CheckpointError as error:
        named = root / (root / "latest").read_text(encoding="utf-8").strip()
        usable = _usable_checkpoints(root, skip=None if named.parent != root else named)
        if not usable:
            raise
        steps = ", ".join(f"{c.path.name} (step {c.step})" for c in usable)
        raise CheckpointError(f"{error}. Usable earlier checkpoints: {steps}. Resume from the newest with: "
                              f"linattn train --resume --out {run_dir} --from {usable[0].step}") from None


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors of ``tensors`` holding a NaN or an inf (reads
    every value: a host sync on a GPU)."""
    return [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def load_model(path: str | Path, device: torch.device | str = "cpu"):
    """The ``LM`` stored in a checkpoint, in eval mode -> ``(model, checkpoint)``. A checkpoint
    whose model tensors are not all finite is refused (``CheckpointError``). LoRA adapters (a run
    fine-tuned with ``train.lora_rank``) are merged into the weights (``train/lora.py``)."""
    from ..models import LM, LMConfig
    from .lora import holds_adapters, load_adapted, merge_adapters

    checkpoint = load_checkpoint(path)
    nonfinite = nonfinite_tensors(checkpoint.model)
    if nonfinite:
        raise CheckpointError(
            f"{checkpoint.path}: {len(nonfinite)} of {len(checkpoint.model)} model tensors hold NaN or inf values "
            f"({', '.join(nonfinite[:3])}{', ...' if len(nonfinite) > 3 else ''}); the training that wrote it had "
            f"diverged. Use an earlier checkpoint of {checkpoint.path.parent} (a step-* folder)")
    try:
        model = LM(LMConfig.from_saved(checkpoint.meta["model_config"]))
        adapted = holds_adapters(checkpoint.model)
        load_adapted(model, checkpoint.model, checkpoint.meta["train_config"].get("lora_rank") if adapted else None)
        if adapted:  # PEFT is imported only for a checkpoint that holds adapters
            merge_adapters(model)
    except (KeyError, RuntimeError) as error:
        raise CheckpointError(f"{checkpoint.path}: the stored model does not match its config ({error})") from None
    return model.to(device).eval(), checkpoint
