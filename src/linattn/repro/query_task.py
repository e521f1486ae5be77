"""Training and scoring an ``LM`` on a synthetic task whose targets sit at query positions only.

Shared by the recall reproductions (``mqar``, ``long_range``). A batch is ``(inputs [B, T],
targets [B, T])`` int64 with ``targets == IGNORE`` (-100) everywhere but at the query
positions, the same number per row. The loss and the accuracy are taken at those positions
only, and the output projection is applied there only (``query_logits``).

Training (``fit_queries``): AdamW (betas 0.9/0.98; weight decay on matrices and the
embedding, ``train.optim.parameter_groups(decay_embeddings=True)``), linear warm-up then
cosine decay to ``min_lr_ratio`` of the peak (``train.schedule.learning_rate``), gradient
clipping, loss = cross-entropy over the query positions + the VQ commitment loss,
``update_codebooks()`` after every optimizer step; a non-finite loss stops the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from ..models import LM
from ..train.optim import parameter_groups
from ..train.schedule import learning_rate

IGNORE = -100
Batch = tuple[torch.Tensor, torch.Tensor]


def query_positions(targets: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` sorted positions where ``targets != -100`` (every row must have the same count)."""
    mask = targets != IGNORE
    counts = mask.sum(1)
    if counts.numel() == 0 or not bool((counts == counts[0]).all()) or int(counts[0]) == 0:
        raise ValueError(f"every row needs the same number (>= 1) of query positions, got {counts.tolist()}")
    return mask.nonzero()[:, 1].view(targets.shape[0], int(counts[0]))


def query_logits(model: LM, inputs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``model(inputs)``'s logits at ``positions [B, N]`` only: ``([B, N, V], aux)``.

    ``LM.forward`` runs unchanged except that a pre-hook on the final norm keeps only the
    hidden states of the query positions, so the ``[B, T, V]`` output projection (the bulk of
    the cost at a large vocabulary) is never built. Equal to ``model(inputs)[0].gather(...)``.
    """
    index = positions.unsqueeze(-1).expand(-1, -1, model.config.d_model)

    def keep_queries(_module, args):
        return (args[0].gather(1, index),)

    handle = model.norm.register_forward_pre_hook(keep_queries)
    try:
        logits, _, aux = model(inputs)
    finally:
        handle.remove()
    return logits, aux


def fit_queries(
    model: LM,
    next_batch: Callable[[], Batch],
    *,
    steps: int,
    lr: float,
    weight_decay: float,
    warmup_fraction: float,
    min_lr_ratio: float,
    grad_clip: float,
    on_step: Callable[[int, float], None] | None = None,
) -> dict:
    """Train ``model`` (in train mode) for ``steps`` optimizer steps, one ``next_batch()`` each
    (see the module docstring for the recipe).

    Returns ``{"status": "ok" | "non_finite", "steps": steps taken, "final_loss": mean query
    cross-entropy of the last 20 steps (None without a step), "loss_curve": [[step, loss], ...]
    (about 50 points), "train_seconds"}``. ``on_step(step, loss)`` is called at each logged step.
    """
    model.train()
    optimizer = torch.optim.AdamW(parameter_groups(model, weight_decay, decay_embeddings=True), lr=lr,
                                  betas=(0.9, 0.98))
    warmup = max(1, round(warmup_fraction * steps))
    log_every = max(1, steps // 50)
    curve: list[list[float]] = []
    recent: list[float] = []
    steps_taken = 0
    status = "ok"
    start = time.perf_counter()
    for step in range(1, steps + 1):
        rate = learning_rate(step - 1, peak=lr, total_steps=steps, warmup_steps=warmup, min_ratio=min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = rate
        inputs, targets = next_batch()
        positions = query_positions(targets)
        logits, aux = query_logits(model, inputs, positions)
        task_loss = F.cross_entropy(logits.flatten(0, 1), targets.gather(1, positions).flatten())
        loss = task_loss + aux["commit_loss"]
        if not torch.isfinite(loss):
            status = "non_finite"
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        model.update_codebooks()
        steps_taken += 1
        value = task_loss.item()
        recent = (recent + [value])[-20:]
        if step % log_every == 0 or step == steps:
            curve.append([step, value])
            if on_step is not None:
                on_step(step, value)
    return {"status": status, "steps": steps_taken, "final_loss": sum(recent) / len(recent) if recent else None,
            "loss_curve": curve, "train_seconds": time.perf_counter() - start}


@torch.no_grad()
def evaluate_queries(model: LM, batches: Iterable[Batch]) -> dict:
    """Accuracy (argmax over the whole vocabulary == target) and mean cross-entropy at the
    query positions of ``batches``, in eval mode (no codebook statistics); the model's mode
    is restored. ``{"accuracy", "loss", "queries"}``."""
    was_training = model.training
    model.eval()
    hits = total = 0
    loss_sum = 0.0
    try:
        for inputs, targets in batches:
            positions = query_positions(targets)
            logits, _ = query_logits(model, inputs, positions)
            wanted = targets.gather(1, positions)
            loss_sum += F.cross_entropy(logits.flatten(0, 1), wanted.flatten(), reduction="sum").item()
            hits += int((logits.argmax(-1) == wanted).sum())
            total += wanted.numel()
    finally:
        model.train(was_training)
    if not total:
        raise ValueError("evaluate_queries needs at least one batch")
    return {"accuracy": hits / total, "loss": loss_sum / total, "queries": total}
