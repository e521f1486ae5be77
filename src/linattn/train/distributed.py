"""Process-group set-up for ``torchrun`` (gloo on CPU, nccl on GPU) and the collectives of
the trainer and the evaluator.

Every tensor collective of ``linattn.train`` goes through this module, and its tensors live
on ``Context.device``, the device the run trains on: NCCL takes CUDA tensors only (a CPU
tensor fails with "No backend type associated with device type cpu"). ``all_reduce_sum``
refuses a tensor on another device with an error that names both. (The codebooks' own
collectives, ``nn/codebook.py``, reduce their buffers, which live where the model does.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._checks import check_cuda_available


@dataclass
class Context:
    """Where this process stands: ``rank`` of ``world_size``, and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False

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


def setup(device: str = "cpu") -> Context:
    """Join the process group that ``torchrun`` describes in the environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``); a plain run is rank 0 of 1."""
    world_size = env_world_size()
    rank = env_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    target = torch.device(device)
    if target.type == "cuda":
        check_cuda_available("--device", device)
        target = torch.device("cuda", local_rank if world_size > 1 else (target.index or 0))
        torch.cuda.set_device(target)
    if world_size == 1:
        return Context(device=target)
    initialized_here = False
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if target.type == "cuda" else "gloo")
        initialized_here = True
    return Context(rank=rank, world_size=world_size, local_rank=local_rank, device=target,
                   initialized_here=initialized_here)


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


def first_problem(message: str | None, context: Context) -> tuple[int, str] | None:
    """``(rank, message)`` of the lowest rank whose ``message`` is not None, on every rank
    (None when no rank has one): an error one process met, made known to all, so that every
    process stops with the same exit code and rank 0, the one that prints, can name it."""
    if not context.distributed:
        return None if message is None else (0, message)
    messages: list = [None] * context.world_size
    dist.all_gather_object(messages, message)
    return next(((rank, text) for rank, text in enumerate(messages) if text is not None), None)


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
