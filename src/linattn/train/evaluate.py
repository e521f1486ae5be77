"""Bits per byte of a model on a token sequence, with the recurrent state carried.

The evaluation batch is global: ``batch_size`` streams in all, shared by the processes of a
multi-process run, and the sums are kept per stream (float64, in window order) and added in
stream order after the reduction, so the result does not depend on the number of processes:
each stream's windows are computed alike whichever process holds it (up to what a batch's
row count changes in the model's arithmetic, nothing in float64).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._checks import check_token_ids
from ..data import TokenStreams
from .distributed import Context, all_reduce_sum


def check_evaluation_fits(split_tokens: int, max_tokens: int | None, *, batch_size: int, context: int, split: str,
                          batch_name: str, budget_name: str) -> None:
    """An evaluation reads ``batch_size`` streams (all processes together) of at least one
    window of ``context`` tokens (and the next one) from the first ``max_tokens`` tokens of a
    split of ``split_tokens`` (all of it for None): a ValueError naming the settings
    (``batch_name``, ``budget_name``) when they ask for more than that."""
    needed = batch_size * (context + 1)
    available = split_tokens if max_tokens is None else min(max_tokens, split_tokens)
    if available >= needed:
        return
    if max_tokens is None:
        budget = f"the whole {split} split ({budget_name} unset) has {split_tokens}"
    elif max_tokens <= split_tokens:
        budget = f"{budget_name}={max_tokens} reads only {max_tokens} of the {split} split's {split_tokens}"
    else:
        budget = f"the {split} split has only {split_tokens} ({budget_name}={max_tokens})"
    raise ValueError(f"{batch_name}={batch_size} streams of context {context} need at least "
                     f"{batch_size} x ({context} + 1) = {needed} tokens per evaluation, but {budget}; lower "
                     f"{batch_name}" + (f" or raise {budget_name}" if max_tokens is not None
                                        and max_tokens < split_tokens else ""))


@torch.no_grad()
def evaluate_bpb(
    model,
    tokens: torch.Tensor,
    *,
    context: int,
    batch_size: int = 1,
    max_tokens: int | None = None,
    carry_state: bool = True,
    reset_every: int | None = None,
    dist_context: Context | None = None,
    bf16: bool = False,
    progress=None,
) -> dict[str, float]:
    """Mean negative log-likelihood of every next byte, in bits (``nats / ln 2``).

    ``tokens`` (1-D) is cut into ``batch_size`` contiguous streams read in consecutive
    windows of ``context``; with ``dist_context`` of several processes, rank ``r`` of ``W``
    evaluates streams ``[r B / W, (r + 1) B / W)`` (rounded down; a process left without one
    runs the first stream's windows and counts nothing, so that a sharded model's forward
    passes stay collective) and the per-stream sums are all-reduced: the same streams and
    the same result at any number of processes. With ``carry_state`` the state of window w
    is passed (detached) to window w+1, so with ``batch_size=1`` every byte is predicted from
    the whole split before it (as far as the mechanism remembers); ``reset_every=N`` starts a
    fresh state every N windows (the training schedule). ``max_tokens`` keeps only the first
    bytes. Returns ``{"bpb", "tokens"}``.
    """
    dist_context = dist_context or Context()
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    check_token_ids("tokens", tokens, model.config.vocab_size)  # once here, not in every forward
    streams = TokenStreams(tokens, batch_size=batch_size, context=context, drop_last=False)
    rows, counted = stream_share(batch_size, dist_context.rank, dist_context.world_size)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device  # the run's device (dist_context.device) when training
    totals = torch.zeros(batch_size, 2, dtype=torch.float64, device=device)  # per stream, summed over processes
    state = None
    try:
        for index, (inputs, targets) in enumerate(streams):
            if reset_every and index % reset_every == 0:
                state = None
            inputs, targets = inputs[rows], targets[rows].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits, state, _ = model(inputs.to(device), state, check_inputs=False)
            if counted:
                losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
                totals[rows, 0] += losses.view_as(targets).double().sum(1)
                totals[rows, 1] += targets.shape[1]
            state = model.carry(state) if carry_state else None
            if progress is not None and counted:
                progress.update(targets.numel())
    finally:
        model.train(was_training)
    summed = all_reduce_sum(totals, dist_context).sum(0)
    return {"bpb": float(summed[0] / summed[1] / math.log(2)), "tokens": int(summed[1])}


def stream_share(n_streams: int, rank: int, world_size: int) -> tuple[slice, bool]:
    """The streams of ``n_streams`` that ``rank`` of ``world_size`` evaluates, and whether they
    count: ``[rank n / W, (rank + 1) n / W)`` rounded down; an empty share (more processes than
    streams) is the first stream, not counted."""
    start, stop = rank * n_streams // world_size, (rank + 1) * n_streams // world_size
    return (slice(start, stop), True) if stop > start else (slice(0, 1), False)
