"""Bits per byte of a model on a token sequence, with the recurrent state carried."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._checks import check_token_ids
from ..data import TokenStreams
from .distributed import Context, all_reduce_sum


def check_evaluation_fits(split_tokens: int, max_tokens: int | None, *, batch_size: int, world_size: int,
                          context: int, split: str, batch_name: str, budget_name: str) -> None:
    """An evaluation reads ``batch_size`` streams per process (``world_size`` processes) of at
    least one window of ``context`` tokens (and the next one) from the first ``max_tokens``
    tokens of a split of ``split_tokens`` (all of it for None): a ValueError naming the
    settings (``batch_name``, ``budget_name``) when they ask for more than that."""
    streams = batch_size * world_size
    needed = streams * (context + 1)
    available = split_tokens if max_tokens is None else min(max_tokens, split_tokens)
    if available >= needed:
        return
    processes = f" x {world_size} processes" if world_size > 1 else ""
    if max_tokens is None:
        budget = f"the whole {split} split ({budget_name} unset) has {split_tokens}"
    elif max_tokens <= split_tokens:
        budget = f"{budget_name}={max_tokens} reads only {max_tokens} of the {split} split's {split_tokens}"
    else:
        budget = f"the {split} split has only {split_tokens} ({budget_name}={max_tokens})"
    raise ValueError(f"{batch_name}={batch_size} streams{processes} of context {context} need at least "
                     f"{streams} x ({context} + 1) = {needed} tokens per evaluation, but {budget}; lower "
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

    ``tokens`` (1-D) is cut into ``batch_size`` (times the number of processes) contiguous
    streams read in consecutive windows of ``context``; with ``carry_state`` the state of
    window w is passed (detached) to window w+1, so with ``batch_size=1`` every byte is
    predicted from the whole split before it (as far as the mechanism remembers);
    ``reset_every=N`` starts a fresh state every N windows (the training schedule).
    ``max_tokens`` keeps only the first bytes. Returns ``{"bpb", "tokens"}``.
    """
    dist_context = dist_context or Context()
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    check_token_ids("tokens", tokens, model.config.vocab_size)  # once here, not in every forward
    streams = TokenStreams(tokens, batch_size=batch_size, context=context, rank=dist_context.rank,
                           world_size=dist_context.world_size, drop_last=False)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device  # the run's device (dist_context.device) when training
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed over processes there
    state = None
    try:
        for index, (inputs, targets) in enumerate(streams):
            if reset_every and index % reset_every == 0:
                state = None
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits, state, _ = model(inputs.to(device), state, check_inputs=False)
            totals[0] += F.cross_entropy(
                logits.float().flatten(0, 1), targets.to(device).flatten(), reduction="sum"
            ).double()
            totals[1] += targets.numel()
            state = model.carry(state) if carry_state else None
            if progress is not None:
                progress.update(targets.numel())
    finally:
        model.train(was_training)
    all_reduce_sum(totals, dist_context)
    return {"bpb": float(totals[0] / totals[1] / math.log(2)), "tokens": int(totals[1])}
