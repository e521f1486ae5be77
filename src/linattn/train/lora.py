"""LoRA fine-tuning of a run (``train.lora_rank``, ``linattn train --resume --lora-rank R``).

LoRA (Hu et al. 2021) through PEFT: every ``nn.Linear`` inside the model's layers (attention,
gated-layer and feed-forward projections; not the embedding or the head) gets an adapter
``W x + (alpha / r) B A x`` of rank r, ``alpha = 2 r``, ``B`` zero at first, so training starts from
the model as it is; only the adapters train (codebooks still follow their EMA, as they are not
parameters). The run's checkpoints hold the base weights and the adapters under PEFT's names
(``layers.0.mixer.q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``), so a resume
continues the same adapters with their optimizer state. Every reader of a checkpoint
(``load_model``: ``eval``, ``generate``, ``export``, ``convert``) merges them into the base
weights: what it gets is a plain ``LM`` computing what the adapted model computes.
"""

from __future__ import annotations

import torch
from torch import nn

LORA_ALPHA_PER_RANK = 2  # alpha = 2 r: LoLCATs' (r 8, alpha 16)
_ADAPTER_MARK = ".lora_A."


def adapted_modules(model: nn.Module) -> list[str]:
    """The names of the linear maps LoRA adapts: every ``nn.Linear`` under ``layers``."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.startswith("layers.")]


def add_adapters(model: nn.Module, rank: int) -> nn.Module:
    """Put a LoRA adapter of ``rank`` on every map of ``adapted_modules(model)``, in place (PEFT's
    ``inject_adapter_in_model``); every other parameter is frozen. Returns ``model``."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = adapted_modules(model)
    if not targets:
        raise ValueError("the model has no linear map in its layers for LoRA to adapt")
    config = LoraConfig(r=rank, lora_alpha=LORA_ALPHA_PER_RANK * rank, lora_dropout=0.0, target_modules=targets)
    inject_adapter_in_model(config, model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name)
    return model


def holds_adapters(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a state dict holds LoRA adapters (PEFT's ``lora_A`` names)."""
    return any(_ADAPTER_MARK in name for name in tensors)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (PEFT's ``merge``) and put the plain base layer back
    in its place; every parameter trains again. Returns ``model``, changed in place."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = [(name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]
    for name, module in adapted:
        module.merge()
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attribute, module.get_base_layer())
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model


def load_adapted(model: nn.Module, tensors: dict[str, torch.Tensor] | None, rank: int | None) -> bool:
    """Load a checkpoint's model ``tensors`` (None: nothing to load) into ``model`` (strict) and leave
    it with adapters of ``rank`` (None: none). Tensors saved with adapters are loaded into a model
    adapted alike; tensors without them are loaded first and the adapters added after. Returns
    whether adapters were added to weights saved without them (the checkpoint's optimizer state
    then belongs to other parameters)."""
    saved = tensors is not None and holds_adapters(tensors)
    if saved and rank is None:
        raise ValueError("the checkpoint holds LoRA adapters but no train.lora_rank to rebuild them")
    if saved:
        add_adapters(model, rank)
    if tensors is not None:
        model.load_state_dict(tensors, strict=True)
    if rank is not None and not saved:
        add_adapters(model, rank)
        return tensors is not None
    return False


def resumed_rank(saved: int | None, requested: int | None) -> int | None:
    """The LoRA rank a resumed run trains with: ``requested`` (``--lora-rank``), else the run's own
    (``saved``); a run that already trains adapters keeps their rank (another is a ValueError)."""
    if requested is None:
        return saved
    if saved is not None and requested != saved:
        raise ValueError(f"--lora-rank {requested}: the run trains LoRA adapters of rank {saved} already; resume it "
                         f"without --lora-rank (or with --lora-rank {saved})")
    return requested


def adapter_summary(model: nn.Module, rank: int) -> str:
    """One line: the adapters' rank, how many maps they adapt and their share of the parameters."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    maps = sum("lora_A" in name for name, _ in model.named_modules() if name.endswith("lora_A"))
    return (f"LoRA adapters of rank {rank} (alpha {LORA_ALPHA_PER_RANK * rank}) on {maps} linear maps: {trained:,} "
            f"trained parameters of {total:,}")
