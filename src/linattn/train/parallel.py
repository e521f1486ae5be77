"""How the model is spread over processes: ``train.parallel = "ddp" | "fsdp"``.

- ``"ddp"``: DistributedDataParallel. Every process holds the whole model and optimizer
  state; gradients are averaged by all-reduce. The buffers (the codebooks and their EMA
  statistics) are not broadcast before each forward (``forward_sync_buffers=False``; before
  torch 2.13 ``broadcast_buffers=False``, which 2.13 deprecates): every rank updates them
  from statistics summed over the ranks, so they stay equal on their own.
- ``"fsdp"``: FSDP2 (``torch.distributed.fsdp.fully_shard``), each layer of ``LM.layers`` a
  unit and the LM itself the root (embedding, final norm, head). Parameters, gradients and
  AdamW's moments are sharded over the processes (DTensors on a 1-D device mesh); a unit's
  parameters are all-gathered for its forward and backward and its gradients
  reduce-scattered (averaged). The codebooks are buffers: not sharded, kept equal on every
  rank by their own all-reduce (``nn/codebook.py``).

With one process neither wraps the model.

Checkpoints are gathered to rank 0 (``full_model_state``, ``full_optimizer_state``) and
written in the one format a single process writes: the whole model in
``model.safetensors``, the optimizer state indexed like ``torch.optim.Optimizer.state_dict``.
So ``eval``, ``generate`` and ``export`` load an FSDP run like any other, and a run resumes
under either strategy, at any number of processes that shares its global batch
(``train/resharding.py``). The price is that rank 0 holds
the full model and optimizer state in CPU memory while it saves; sharded
``torch.distributed.checkpoint`` files would avoid that, but every reader of a checkpoint
would then need that library and a conversion step, for models that fit one host anyway.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from .distributed import Context

STRATEGIES = ("ddp", "fsdp")


def check_launched(option: str, strategy: str | None, world_size: int) -> None:
    """A strategy named (``strategy`` not None) for a run of one process is a ValueError that
    names ``torchrun``: a launch without it would silently train a single process."""
    if strategy is not None and world_size == 1:
        raise ValueError(f"{option}={strategy!r} spreads training over processes, but this run is a single "
                         f"process (not started by torchrun: WORLD_SIZE unset or 1): launch it with torchrun, e.g. "
                         f"torchrun --nproc_per_node 2 $(which linattn) train ..., or leave {option} unset to "
                         f"train in one process")

# FSDP2 warns when a unit returns a view (a layer's carried state holds slices of its keys and
# values): an in-place op on such an output would skip the gradient's all-gather. The trainer
# never writes into layer outputs or states in place.
_VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"


def wrap(model: nn.Module, strategy: str | None, context: Context) -> nn.Module:
    """The module the training step calls: ``model`` under DDP (``strategy`` ``"ddp"`` or None),
    or ``model`` itself sharded in place by FSDP2 (``"fsdp"``: its parameters become DTensors:
    build the optimizer afterwards)."""
    if not context.distributed:
        return model
    if strategy in (None, "ddp"):
        device_ids = [context.device.index] if context.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **_rank_local_buffers())
    mesh = init_device_mesh(context.device.type, (context.world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


_FORWARD_SYNC_BUFFERS = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def _rank_local_buffers() -> dict[str, bool]:
    """DDP's option for buffers that are not broadcast before each forward. torch 2.13 names it
    ``forward_sync_buffers`` and deprecates ``broadcast_buffers`` (a FutureWarning); unlike the
    old flag, the new one still broadcasts rank 0's buffers once, when DDP is built. That copy
    changes no value: every rank built its model from the same seed, or loaded the same
    checkpoint, and nothing has run yet."""
    if _FORWARD_SYNC_BUFFERS:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


@contextmanager
def view_warnings_silenced() -> Iterator[None]:
    """Within: FSDP2's warning about units that return views is not shown (see ``_VIEW_WARNING``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_VIEW_WARNING, category=UserWarning)
        yield


@contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Run a forward + backward whose gradients are reduced over processes only if ``enabled``;
    otherwise they accumulate on this process for the next backward to reduce (DDP's
    ``no_sync``, FSDP2's ``set_requires_gradient_sync``; nothing to do for a plain module)."""
    if enabled:
        yield
    elif isinstance(module, DistributedDataParallel):
        with module.no_sync():
            yield
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def _sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: nn.Module, context: Context) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with whole tensors, on rank 0 (every rank must call it; ranks
    other than 0 get ``{}`` under FSDP)."""
    if _sharded(model):
        return get_model_state_dict(model, options=_GATHER)
    return model.state_dict()


def _parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters in its order (the indices of its state dict)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, context: Context) -> dict:
    """``optimizer.state_dict()`` with whole tensors, indexed by parameter position as a single
    process's is, on rank 0 (every rank must call it; others get ``{}`` under FSDP)."""
    if not _sharded(model):
        return optimizer.state_dict()
    by_name = get_optimizer_state_dict(model, optimizer, options=_GATHER)
    if not by_name:
        return {}
    index = {name: i for i, name in enumerate(_parameter_names(model, optimizer))}
    return {"state": {index[name]: entry for name, entry in by_name["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in by_name["param_groups"]]}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a ``full_optimizer_state`` (every rank passes the whole one; under FSDP each keeps
    its shards)."""
    if not _sharded(model):
        optimizer.load_state_dict(state)
        return
    names = _parameter_names(model, optimizer)
    by_name = {"state": {names[int(i)]: entry for i, entry in state["state"].items()},
               "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                                for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, optim_state_dict=by_name,
                             options=StateDictOptions(full_state_dict=True))
