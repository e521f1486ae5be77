"""Resuming a checkpoint at another number of processes, or under the other strategy.

A checkpoint holds whole tensors (``train/parallel.py``): the model's state dict and the
optimizer state gathered to rank 0, indexed as a single process's are. DDP loads both as
they are on every rank; FSDP2 loads the whole model before sharding it and hands the whole
optimizer state to ``set_optimizer_state_dict``, which keeps each rank's shards. So the
tensors load under either strategy at any number of processes, and sharded
``torch.distributed.checkpoint`` files are not needed for that. Three recorded things do
depend on the number of processes ``W`` that wrote the checkpoint:

- ``train.batch_size`` counts streams per process: the global batch is ``G = batch_size x W``
  streams, cut from the split in rank-major order (``TokenStreams``: rank ``r`` reads streams
  ``[r B, (r + 1) B)``), each step's ``B`` streams of a process run as ``grad_accum_steps``
  micro-batches;
- the carried states, one per rank (``meta["carry"]``), each of that rank's ``B`` streams.

(``train.eval_batch_size`` is global: the evaluation's streams in all, whatever ``W``;
checkpoints written before it was, which do not record ``meta["data"]["eval_streams"]``,
counted it per process, and are read as ``eval_batch_size x W``.)

A resume at ``W'`` processes keeps the global batch: ``B' = G / W'`` streams per process
(``W'`` must divide ``G``; ``grad_accum_steps`` must divide ``B'``). What fits the memory of
fewer, fuller processes may change with it (``RESUME_SETTINGS``): ``grad_accum_steps``,
``activation_checkpointing``, and ``batch_size`` itself when it keeps ``G`` (a value that
does not is refused, naming the global batch), so the ranks read the same streams in the
same order, and the carried
states are stacked in rank order into the state of the ``G`` streams and cut into ``W'``
row blocks (``microbatch.join_states``/``split_state``). The steps then compute what the
uninterrupted run computed, up to the order of sums that cross processes (the loss and
gradient means, the codebook statistics: summed by all-reduce over ``W'`` partial sums
instead of ``W``), and two things a rank draws for itself: dropout masks (every rank draws
from the same generator for its own rows) and dead-code restarts (rank 0's recent keys).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import torch

from .._checks import check_int, is_int
from ..models import LMConfig
from . import lora
from .checkpoint import Checkpoint, NoCheckpointError, find_resume_checkpoint
from .config import TrainConfig
from .distributed import env_world_size
from .run_folder import start_instead
from .microbatch import join_states, split_state


# what a resume may change (train/cli.py: --set train.KEY=VALUE, --dist-timeout): what fits a
# step into another memory, and how long the processes wait for each other
RESUME_SETTINGS = ("batch_size", "grad_accum_steps", "activation_checkpointing", "dist_timeout", "collective_timeout")


def written_world_size(checkpoint: Checkpoint) -> int:
    """The number of processes that wrote ``checkpoint`` (1 for a checkpoint that does not say)."""
    return int(checkpoint.meta.get("world_size", 1))


def global_eval_streams(checkpoint: Checkpoint) -> int:
    """The global evaluation batch of the run that wrote ``checkpoint`` (streams in all): the
    recorded ``meta["data"]["eval_streams"]``, or, for a checkpoint written when
    ``train.eval_batch_size`` counted streams per process, that times its processes."""
    recorded = checkpoint.meta.get("data", {}).get("eval_streams")
    if recorded is not None:
        return int(recorded)
    return int(checkpoint.meta["train_config"]["eval_batch_size"]) * written_world_size(checkpoint)


def resumed_train_values(checkpoint: Checkpoint, world_size: int, settings: dict[str, Any] | None = None
                         ) -> dict[str, Any]:
    """The train config of ``checkpoint`` for ``world_size`` processes, with ``settings`` (a
    subset of ``RESUME_SETTINGS``) applied: the same global batch cut into ``world_size``
    equal parts. A setting a resume cannot change, a ``batch_size`` that changes the global
    batch, a process count that does not divide it, or a ``grad_accum_steps`` that does not
    divide the new per-process batch is a ValueError naming the setting and the numbers (and
    the process counts that would work)."""
    settings = dict(settings or {})
    fixed = [f"train.{key}" for key in settings if key not in RESUME_SETTINGS]
    if fixed:
        allowed = ", ".join(f"train.{key}" for key in RESUME_SETTINGS)
        raise ValueError(f"--resume takes the run's settings from its checkpoint: {', '.join(fixed)} cannot change "
                         f"(a resume may change {allowed}, --steps, --parallel, --lora-rank and --threads)")
    values = {**checkpoint.meta["train_config"], "eval_batch_size": global_eval_streams(checkpoint)}
    written_by = written_world_size(checkpoint)
    batch = values["batch_size"] * written_by
    if "batch_size" in settings:
        _check_same_global_batch(check_int("train.batch_size", settings.pop("batch_size")), world_size, batch,
                                 values["batch_size"], written_by)
    accumulation = check_int("train.grad_accum_steps", settings.get("grad_accum_steps",
                                                                    values.get("grad_accum_steps", 1)))

    def fits(n: int) -> bool:
        return batch % n == 0 and (batch // n) % accumulation == 0

    if not fits(world_size):
        counts = ", ".join(str(n) for n in range(1, batch + 1) if fits(n))
        if batch % world_size:
            problem = (f"its global batch of {batch} streams (train.batch_size={values['batch_size']} per process x "
                       f"{written_by} processes) cannot be shared evenly by {world_size} processes")
        else:
            problem = (f"train.grad_accum_steps={accumulation} does not divide the {batch // world_size} streams per "
                       f"process that {world_size} processes would read (--set train.grad_accum_steps=N changes it)")
        raise ValueError(f"--resume with {world_size} processes: {problem}; the resumed run keeps the checkpoint's "
                         f"global batch, so resume it with one of these process counts: {counts}")
    return {**values, **settings, "batch_size": batch // world_size}


def _check_same_global_batch(per_process: int, world_size: int, batch: int, written: int, written_by: int) -> None:
    if per_process * world_size == batch:
        return
    keep = (f"leave it out (it becomes {batch // world_size} per process)" if batch % world_size == 0 else
            "resume at a process count that divides it")
    raise ValueError(f"--resume: train.batch_size={per_process} per process x {world_size} "
                     f"{'process' if world_size == 1 else 'processes'} = {per_process * world_size} streams would "
                     f"change the run's global batch of {batch} streams (train.batch_size={written} per process x "
                     f"{written_by} {'process' if written_by == 1 else 'processes'}), and with it the data every "
                     f"step reads; a resume keeps the global batch: {keep}, or start a new run")


def rank_carry(checkpoint: Checkpoint, world_size: int, rank: int, device: torch.device | str = "cpu") -> Any:
    """The carried state of the streams that ``rank`` of ``world_size`` reads: the
    checkpoint's per-rank states stacked in rank order (the state of the global batch) and
    cut into ``world_size`` row blocks. None if the run carried none."""
    written_by = written_world_size(checkpoint)
    if world_size == written_by:
        return checkpoint.carry(rank, device)
    joined = join_states([checkpoint.carry(r, device) for r in range(written_by)])
    return split_state(joined, world_size)[rank]


def resume_note(written_by: int, world_size: int, batch_size: int) -> str:
    """What the resume message adds when the number of processes changed ("" when it did not);
    ``batch_size``: the new streams per process."""
    if world_size == written_by:
        return ""
    return (f" (written by {_processes(written_by)}, continued by {_processes(world_size)} of {batch_size} streams "
            f"each: the same global batch of {batch_size * world_size} streams)")


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def resumed_run(run_dir: Path, resume_from, steps, strategy, threads, lora_rank, settings, echo
                ) -> tuple[Checkpoint, LMConfig, TrainConfig]:
    """The checkpoint a resume continues from and the run's configs for this launch (its
    process count, strategy, threads, LoRA rank, ``steps`` and ``settings``)."""
    world_size = env_world_size()
    if world_size > 1 and not run_dir.is_dir():
        raise ValueError(f"--resume: the run folder {run_dir.absolute()} does not exist on {socket.gethostname()}: "
                         f"every process reads the checkpoint, so --out must be on storage that every node mounts at "
                         f"the same path")
    try:
        checkpoint = find_resume_checkpoint(run_dir, resume_from, echo=echo)
    except NoCheckpointError as error:
        raise NoCheckpointError(f"{error}; {start_instead(run_dir)}") from None
    model_config = LMConfig.from_saved(checkpoint.meta["model_config"])
    train_values = resumed_train_values(checkpoint, world_size, settings)
    train_values["out"] = str(run_dir)
    if strategy is not None:
        train_values["parallel"] = strategy
    if threads is not None:
        train_values["threads"] = threads
    train_values["lora_rank"] = lora.resumed_rank(train_values.get("lora_rank"), lora_rank)
    if steps is not None:
        if not is_int(steps) or steps <= checkpoint.step:
            raise ValueError(f"--steps must be larger than the checkpoint's step {checkpoint.step} to train "
                             f"further, got {steps!r}")
        train_values.update(decay_steps=train_values.get("decay_steps") or train_values["steps"], steps=steps)
    train_config = TrainConfig.from_dict(train_values)
    if checkpoint.step < train_config.steps:
        written_by = written_world_size(checkpoint)
        echo(f"resuming {run_dir} at step {checkpoint.step} of {train_config.steps} from {checkpoint.path}"
             + resume_note(written_by, world_size, train_config.batch_size))
    return checkpoint, model_config, train_config
