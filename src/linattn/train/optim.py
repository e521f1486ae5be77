"""Optimiser parameter groups: which parameters get weight decay.

One rule for the trainer and every reproduction (nanoGPT's): weight decay on the weights
of dimension >= 2 (matrices, convolution kernels), none on vectors and scalars (biases,
norm gains). Two kinds of matrices are exempt:

- embedding tables (the weights of ``nn.Embedding`` modules; a tied output head is the
  same tensor): not decayed by default, as in the trainer, since a row is only updated
  by the tokens that occur while decay shrinks every row at every step;
  ``decay_embeddings=True`` decays them like any matrix (``linattn repro mqar`` does: its
  published results were trained so);
- codebooks (parameters whose name contains ``codebook``): cluster centres, never decayed.
  (``linattn``'s VQ codebooks are EMA buffers, not parameters; the rule covers learned ones.)

The trainer's AdamW is the fused implementation (``trainer_adamw``): its step takes the
divergence guard's ``found_inf`` flag on the device (``train/divergence.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def parameter_groups(model: nn.Module, weight_decay: float, *, decay_embeddings: bool = False) -> list[dict]:
    """``[{"params": decayed, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]``
    for ``torch.optim.AdamW`` (or any optimizer taking parameter groups).

    Each group keeps the order of ``model.named_parameters()`` (an optimizer's state dict
    is indexed by it), and a parameter shared by several modules appears once.
    """
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        exempt = "codebook" in name or (id(parameter) in embeddings and not decay_embeddings)
        (decay if parameter.dim() >= 2 and not exempt else no_decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def trainer_adamw(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float]
                  ) -> torch.optim.AdamW:
    """The trainer's optimizer: fused AdamW over ``parameter_groups(model, weight_decay)``.
    Fused, because its step takes ``found_inf`` (set as ``optimizer.found_inf``, the protocol
    of ``torch.amp.GradScaler``): with it 1, parameters, moments and step counts stay as they were."""
    return torch.optim.AdamW(parameter_groups(model, weight_decay), lr=lr, betas=betas, fused=True)


def as_fused_state(state: dict[str, Any]) -> dict[str, Any]:
    """An AdamW state dict, with its groups set to the fused implementation, to load into
    ``trainer_adamw`` (``load_state_dict`` takes the implementation flags from the groups it
    loads; checkpoints written before the trainer's AdamW was fused have ``fused: None``)."""
    groups = [{**group, "fused": True, "foreach": None} for group in state["param_groups"]]
    return {**state, "param_groups": groups}
