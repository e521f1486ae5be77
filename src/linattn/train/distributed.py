"""Process-group set-up for ``torchrun`` (gloo on CPU, nccl on GPU) and the collectives of
the trainer and the evaluator.

A multi-process run starts in two steps. ``join`` meets the other processes at the
rendezvous ``torchrun`` describes (``MASTER_ADDR``/``MASTER_PORT``: a TCP key-value store,
under ``torchrun`` its agent's), waiting at most ``train.dist_timeout`` seconds, and returns a
``Context`` with that store but no process group: the processes then compare what they are
about to run through the store (``train/startup.py``), which needs no device, so a process
that could not even read the run's checkpoint (and so does not know its device) can still
say why it stops. ``setup`` then creates the process group on the run's device over the
same store, with ``train.collective_timeout`` as the timeout of every collective
(``init_process_group(timeout=...)``; None: torch's default, 30 minutes for gloo, 10 for
NCCL).

Every tensor collective of ``linattn.train`` goes through this module, and its tensors live
on ``Context.device``, the device the run trains on: NCCL takes CUDA tensors only (a CPU
tensor fails with "No backend type associated with device type cpu"). ``all_reduce_sum``
refuses a tensor on another device with an error that names both. (The codebooks' own
collectives, ``nn/codebook.py``, reduce their buffers, which live where the model does.)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._checks import check_cuda_available


DEFAULT_COLLECTIVE_TIMEOUT = dist.default_pg_timeout.total_seconds()  # torch's, for gloo: 30 minutes


@dataclass
class Context:
    """Where this process stands: ``rank`` of ``world_size``, and its device; ``store``: the
    rendezvous store of a multi-process run (None for one process), ``timeout``: the seconds
    a start-up exchange waits for the other processes (``train.dist_timeout``)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False
    store: Any = None
    timeout: float = 120.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_rank() -> int:
    """This process's rank as ``torchrun`` sets it in the environment (0 for a plain run)."""
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """The number of processes ``torchrun`` started (``WORLD_SIZE``; 1 for a plain run)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``; 0 for a plain run)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def join(timeout: float) -> Context:
    """Meet the other processes of a ``torchrun`` launch (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) -> this process's ``Context``, with the
    rendezvous store and no process group yet (``setup`` makes it); a plain run is rank 0 of 1.

    The store is the process group's when the caller created one already, else the one of
    ``torch.distributed.rendezvous("env://")``, which waits at most ``timeout`` seconds for
    every process to connect: a ValueError naming the address, the wait and torch's account
    (e.g. "1/2 clients joined") when they do not."""
    world_size = env_world_size()
    if world_size == 1:
        return Context(timeout=timeout)
    rank, local_rank = env_rank(), env_local_rank()
    if dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
    else:
        store = _rendezvous(rank, world_size, timeout)
    return Context(rank=rank, world_size=world_size, local_rank=local_rank, store=store, timeout=timeout)


def _rendezvous(rank: int, world_size: int, timeout: float):
    where = f"{os.environ.get('MASTER_ADDR', '(MASTER_ADDR unset)')}:{os.environ.get('MASTER_PORT', '(unset)')}"
    try:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size,
                                           timeout=timedelta(seconds=timeout)))
    except (RuntimeError, ValueError) as error:
        account = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"rank {rank} of {world_size}: the rendezvous at {where} (MASTER_ADDR:MASTER_PORT) did not "
                         f"bring the {world_size} processes together within {timeout:g} s ({account}); the others "
                         f"did not start, stopped, or cannot reach that address. --dist-timeout SECONDS "
                         f"(train.dist_timeout) sets the wait") from None
    return store


def check_device(device: str) -> None:
    """A CUDA ``device`` this process cannot use is a ValueError naming it (checked before the
    start-up exchange, so that the other processes learn it rather than wait for this one)."""
    if torch.device(device).type == "cuda":
        check_cuda_available("--device", device)


def setup(context: Context, device: str = "cpu", collective_timeout: float | None = None) -> Context:
    """``context`` (from ``join``) on ``device``; with several processes, in the process group
    (created here over the rendezvous store unless the caller made one: gloo on CPU, nccl on
    GPU, every collective waiting at most ``collective_timeout`` seconds, None: torch's default)."""
    target = torch.device(device)
    if target.type == "cuda":
        check_device(device)
        target = torch.device("cuda", context.local_rank if context.distributed else (target.index or 0))
        torch.cuda.set_device(target)
    if not context.distributed:
        return dataclasses.replace(context, device=target)
    initialized_here = False
    if not dist.is_initialized():
        timeout = timedelta(seconds=collective_timeout) if collective_timeout else None
        context.store.set_timeout(timeout or dist.default_pg_timeout)  # the rendezvous set the short wait
        dist.init_process_group(backend="nccl" if target.type == "cuda" else "gloo",
                                store=dist.PrefixStore("default_pg", context.store), rank=context.rank,
                                world_size=context.world_size, timeout=timeout)
        initialized_here = True
    return dataclasses.replace(context, device=target, initialized_here=initialized_here)


def teardown(context: Context) -> None:
    if context.initialized_here and dist.is_initialized():
        dist.destroy_process_group()


def _check_device(name: str, tensor: torch.Tensor, context: Context) -> None:
    if tensor.device != context.device:
        raise ValueError(f"{name}: the tensor lives on {tensor.device}, but the process group reduces on the run's "
                         f"device {context.device}; create it with device=context.device")


def all_reduce_sum(values: torch.Tensor, context: Context) -> torch.Tensor:
    """Sum a tensor over processes, in place (identity for a single process); with several
    processes ``values`` must live on ``context.device``."""
    if context.distributed:
        _check_device("all_reduce_sum", values, context)
        dist.all_reduce(values)
    return values


def broadcast_flag(flag: bool, context: Context) -> bool:
    """True on every rank if it is True on any rank (e.g. a stop request seen by one)."""
    if not context.distributed:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=context.device)
    all_reduce_sum(value, context)
    return bool(value.item() > 0)


def barrier(context: Context) -> None:
    """Wait for every process (on the run's GPU under NCCL)."""
    if context.distributed:
        dist.barrier(device_ids=[context.device.index] if context.device.type == "cuda" else None)


def gather_objects(value, context: Context) -> list | None:
    """``[value of rank 0, value of rank 1, ...]`` on rank 0 (None elsewhere)."""
    if not context.distributed:
        return [value]
    gathered = [None] * context.world_size if context.is_main else None
    dist.gather_object(value, gathered, dst=0)
    return gathered
