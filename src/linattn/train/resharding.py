"""Resuming a checkpoint at another number of processes, or under the other strategy.

A checkpoint holds whole tensors (``train/parallel.py``): the model's state dict and the
optimizer state gathered to rank 0, indexed as a single process's are. DDP loads both as
they are on every rank; FSDP2 loads the whole model before sharding it and hands the whole
optimizer state to ``set_optimizer_state_dict``, which keeps each rank's shards. So the
tensors load under either strategy at any number of processes, and sharded
``torch.distributed.checkpoint`` files are not needed for that. Three recorded things do
depend on the number of processes ``W`` that wrote the checkpoint:

- ``train.batch_size`` and ``train.eval_batch_size`` count streams per process: the global
  batch is ``G = batch_size x W`` streams, cut from the split in rank-major order
  (``TokenStreams``: rank ``r`` reads streams ``[r B, (r + 1) B)``);
- the carried states, one per rank (``meta["carry"]``), each of that rank's ``B`` streams.

A resume at ``W'`` processes keeps the global batch: ``B' = G / W'`` streams per process
(``W'`` must divide ``G``, and the global evaluation batch likewise; ``grad_accum_steps``
must divide ``B'``), so the ranks read the same streams in the same order, and the carried
states are stacked in rank order into the state of the ``G`` streams and cut into ``W'``
row blocks (``microbatch.join_states``/``split_state``). The steps then compute what the
uninterrupted run computed, up to the order of sums that cross processes (the loss and
gradient means, the codebook statistics: summed by all-reduce over ``W'`` partial sums
instead of ``W``), and two things a rank draws for itself: dropout masks (every rank draws
from the same generator for its own rows) and dead-code restarts (rank 0's recent keys).
"""

from __future__ import annotations

from typing import Any

import torch

from .checkpoint import Checkpoint
from .microbatch import join_states, split_state


def written_world_size(checkpoint: Checkpoint) -> int:
    """The number of processes that wrote ``checkpoint`` (1 for a checkpoint that does not say)."""
    return int(checkpoint.meta.get("world_size", 1))


def resharded_train_values(train_values: dict[str, Any], written_by: int, world_size: int) -> dict[str, Any]:
    """``train_values`` (a checkpoint's train config) for ``world_size`` processes: the same
    global batch and evaluation batch, cut into ``world_size`` equal parts. A count that does
    not divide them, or a ``grad_accum_steps`` that does not divide the new per-process batch,
    is a ValueError naming the numbers and the process counts that would work."""
    if world_size == written_by:
        return dict(train_values)
    batch, evaluation = train_values["batch_size"] * written_by, train_values["eval_batch_size"] * written_by
    accumulation = train_values.get("grad_accum_steps", 1)

    def fits(n: int) -> bool:
        return batch % n == 0 and evaluation % n == 0 and (batch // n) % accumulation == 0

    if not fits(world_size):
        counts = ", ".join(str(n) for n in range(1, batch + 1) if fits(n))
        if batch % world_size:
            problem = (f"its global batch of {batch} streams (train.batch_size={train_values['batch_size']} per "
                       f"process x {written_by} processes) cannot be shared evenly by {world_size} processes")
        elif evaluation % world_size:
            problem = (f"its global evaluation batch of {evaluation} streams (train.eval_batch_size="
                       f"{train_values['eval_batch_size']} per process x {written_by} processes) cannot be shared "
                       f"evenly by {world_size} processes")
        else:
            problem = (f"train.grad_accum_steps={accumulation} does not divide the {batch // world_size} streams per "
                       f"process that {world_size} processes would read")
        raise ValueError(f"--resume with {world_size} processes: {problem}; the resumed run keeps the checkpoint's "
                         f"global batch, so resume it with one of these process counts: {counts}")
    return {**train_values, "batch_size": batch // world_size, "eval_batch_size": evaluation // world_size}


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
