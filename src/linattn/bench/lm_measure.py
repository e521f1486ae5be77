"""Measuring one model of ``linattn bench lm`` (in its own process): a training step, a
prefill and decoding at every context, the memory budget, and the profiles (see
``bench.lm``'s module docstring)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..models import LM
from ..train.optim import parameter_groups
from .harness import measure, median, profile_call, synchronize
from .lm_config import LMBenchConfig


def training_step(model: LM, optimizer: torch.optim.Optimizer, ids: torch.Tensor, config: LMBenchConfig):
    """One optimizer step as ``train.trainer`` takes it, on ``ids [B, C + 1]`` (inputs and
    targets), the codebook update gated on a finite loss on the device (no host read); the
    step returns the loss (detached)."""

    def step() -> torch.Tensor:
        with config.autocast():
            logits, _, aux = model(ids[:, :-1], check_inputs=False)
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        total = loss + aux["commit_loss"]
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.update_codebooks(apply=torch.isfinite(total.detach()))
        return loss.detach()

    return step


def _prefill(model: LM, ids: torch.Tensor, config: LMBenchConfig):
    def prefill() -> None:
        with torch.no_grad(), config.autocast():
            model(ids, check_inputs=False)

    return prefill


def _prefilled_state(model: LM, config: LMBenchConfig, context: int, seed: int) -> tuple[torch.Tensor, object]:
    """``(next token [1, 1], state after C random tokens)`` of the model in eval mode, on its device."""
    ids = torch.randint(0, model.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(config.device)
    with torch.no_grad(), config.autocast():
        _, state, _ = model(ids[:, :context])
    return ids[:, context:], state


def _decode_times(model: LM, config: LMBenchConfig, context: int, seed: int) -> list[float]:
    """Seconds of each of ``config.decode_tokens`` greedy ``LM.generate`` steps after a context
    of C tokens (each step waits for the device before the clock is read)."""
    token, state = _prefilled_state(model, config, context, seed)
    with config.autocast():
        synchronize(config.device)
        times, start = [], time.perf_counter()
        for _ in model.generate(token, config.decode_tokens, temperature=0, state=state):
            synchronize(config.device)
            now = time.perf_counter()
            times.append(now - start)
            start = now
    return times


def empty_row(spec: str, parameters: int, context: int, batch: int) -> dict:
    """The row of one (model, context) with nothing measured yet: every measurement None or empty."""
    return {"case": spec, "label": spec, "parameters": parameters, "threads": torch.get_num_threads(),
            "context": context, "batch": batch,
            "tokens_per_step": batch * context, "train_s": None, "train_times_s": [], "train_tokens_per_s": None,
            "train_peak_bytes": None, "prefill_s": None, "prefill_times_s": [], "prefill_tokens_per_s": None,
            "prefill_peak_bytes": None, "decode_ms_per_token": None, "decode_times_s": [], "skip_reason": None,
            "profile": None}


def _decode_step(model: LM, token: torch.Tensor, state, config: LMBenchConfig):
    def step() -> None:
        with torch.no_grad(), config.autocast():
            model(token, state, check_inputs=False)

    return step


def _ids(model: LM, config: LMBenchConfig, context: int) -> torch.Tensor:
    """``[batch, C + 1]`` random tokens on the run's device (drawn on the CPU: the same on every device)."""
    generator = torch.Generator().manual_seed(config.seed + context)
    ids = torch.randint(0, model.config.vocab_size, (config.batch(context), context + 1), generator=generator)
    return ids.to(config.device)


def _profiles(model: LM, optimizer, config: LMBenchConfig, context: int) -> dict:
    """Top operators of one training step, one prefill and one decoding step at ``context``."""
    ids, device, top = _ids(model, config, context), config.device, config.profile_top
    train = profile_call(training_step(model, optimizer, ids, config), device=device, top=top)
    model.eval()
    try:
        prefill = profile_call(_prefill(model, ids[:, :-1], config), device=device, top=top)
        token, state = _prefilled_state(model, config, context, config.seed + context)
        decode = profile_call(_decode_step(model, token, state, config), device=device, top=top)
    finally:
        model.train()
    return {"train": train, "prefill": prefill, "decode": decode}


def measure_model(spec: str, config: LMBenchConfig) -> list[dict]:
    """One row per context of ``config.contexts`` (ascending) for the model ``spec`` (see the
    module docstring) on ``config.device``; run it in a fresh process (``harness.in_fresh_process``)."""
    torch.manual_seed(config.seed)
    model = LM(config.model_config(spec)).to(config.device).train()
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-4)
    rows, failed, measured = [], None, None
    bytes_per_token, reference = None, None  # training-step peak per token, at the context ``reference``
    for context in sorted(config.contexts):
        row = empty_row(spec, model.num_parameters(), context, config.batch(context))
        rows.append(row)
        if failed is not None:
            row["skip_reason"] = failed
            continue
        if bytes_per_token is not None:
            estimate = bytes_per_token * row["tokens_per_step"]
            if estimate > config.memory_gb * 1e9:
                row["skip_reason"] = (f"estimated training-step memory {estimate / 1e9:.3g} GB ({bytes_per_token:,.0f} "
                                      f"bytes per token at C={reference}) > --memory-gb {config.memory_gb:g}")
                continue
        ids = _ids(model, config, context)
        train = measure(training_step(model, optimizer, ids, config), repeats=config.repeats, warmup=config.warmup,
                        device=config.device)
        if train.failure is not None:
            row["skip_reason"], failed = train.failure, f"skipped after {train.failure} at C={context}"
            continue
        row.update(train_s=train.median_s, train_times_s=list(train.times_s), train_peak_bytes=train.peak_bytes,
                   train_tokens_per_s=row["tokens_per_step"] / train.median_s)
        if bytes_per_token is None and train.peak_bytes:
            bytes_per_token, reference = train.peak_bytes / row["tokens_per_step"], context
        model.eval()
        try:
            prefill = measure(_prefill(model, ids[:, :-1], config), repeats=config.repeats, warmup=config.warmup,
                              device=config.device)
            if prefill.failure is None:
                row.update(prefill_s=prefill.median_s, prefill_times_s=list(prefill.times_s),
                           prefill_peak_bytes=prefill.peak_bytes,
                           prefill_tokens_per_s=row["tokens_per_step"] / prefill.median_s)
                times = _decode_times(model, config, context, config.seed + context)
                row.update(decode_times_s=times, decode_ms_per_token=median(times) * 1e3)
            else:
                row["skip_reason"] = f"prefill: {prefill.failure}"
        finally:
            model.train()
        measured = row
    if config.profile_top and measured is not None:
        measured["profile"] = _profiles(model, optimizer, config, measured["context"])
    return rows
