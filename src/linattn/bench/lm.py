"""``linattn bench lm``: whole language models against the context length.

Every model is a layer spec of ``LMConfig.attention`` (default ``softmax``, ``vq``, ``delta``,
``linear:elu``, ``local`` and the hybrid ``local,local,vq``) at one size (default d_model 128,
3 layers, 4 heads; VQ: d_k 64, 128 codes, block 64; local window 256) with equal parameter
counts: a VQ layer's GAU value width is matched to an attention + SwiGLU block
(``models.config.matched_gau_value_width``). Each model runs in a freshly spawned process
and, for every context length C, measures:

- training step: forward, cross-entropy (+ the VQ commitment loss), backward, gradient
  clipping, AdamW step (the trainer's parameter groups) and the codebook EMA, on
  ``batch = max(1, tokens_per_step // C)`` random windows of C tokens, so every context
  trains on the same tokens per step (C above ``--tokens-per-step``: one window of C);
  tokens/s from the median step time, and the peak extra memory of one step (after the
  warm-up, so the optimizer state already exists);
- prefill: one forward pass under ``no_grad`` over the same batch; tokens/s;
- decode: after a prefill of C tokens (batch 1, not timed), ``LM.generate`` (greedy) reads
  one more token and generates ``--decode-tokens`` tokens from that state; the median
  milliseconds per token, the whole context in the state.

Memory budget: before a context runs, its training-step memory is estimated as the peak
bytes per token of the model's first measured context times the context's tokens per step;
a context whose estimate exceeds ``--memory-gb`` is skipped with the estimate as the reason
(as is every context after one that ran out of memory). Exact softmax runs torch's SDPA,
whose CPU kernel keeps no T x T scores, so the memory of every model grows with the tokens
per step, not with C. ``--profile N`` adds the N operators with the most self time of a
training step, a prefill and a decoding step of each model at its longest measured context.

Rounds: ``--rounds N`` measures every model N times, each time in a fresh process, the
models in alternating order (A B, B A, ...), and pools the timed calls of all rounds
(``pool_rounds``): on a shared machine a slow spell of minutes then falls on every model,
so the ratios between models hold where one round's do not.

Device and precision: ``--device cuda`` (or ``cuda:N``) puts every model, its optimizer, the
tokens and the decoding state on that GPU; each timed call is bracketed by a synchronization
and the peak memory is the CUDA allocator's. ``--dtype bfloat16`` runs the forward passes
under bfloat16 autocast, weights and optimizer state in float32, as the trainer's
``train.bf16``. The timed calls read no values back to the host themselves (the tokens are
drawn in range and not checked again there: ``check_inputs=False``); the model does where it
must: ``LM.generate`` for each sampled token, a VQ model's codebook update once per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import reporting
from .._checks import (available_device_name, check_choice, check_cuda_available, check_device, check_positive_int,
                       non_negative_int, positive_float, positive_int)
from ..models import LM, LMConfig, parse_layer_spec, sizes
from ..models.config import matched_gau_value_width
from ..train.optim import parameter_groups
from . import report
from .harness import in_fresh_process, measure, median, profile_call, synchronize

DEFAULT_MODELS = ("softmax", "vq", "delta", "linear:elu", "local", "local,local,vq", "retnet", "gla", "gated-delta")
DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384)
DTYPES = ("float32", "bfloat16")  # bfloat16: autocast, as train.bf16
_MIB = 2**20

# The targets of issue 21 on this CPU, checked against the measured rows (never in tests).
OVERTAKE_BY = 4096  # VQ training tokens/s >= softmax's from some context <= this one on
SPEEDUP_AT, SPEEDUP_MIN = 16384, 3.0  # VQ / softmax training tokens/s at this context
DECODE_FROM, DECODE_TO, DECODE_GROWTH_MAX = 512, 16384, 1.2  # VQ decode ms/token growth


@dataclass(frozen=True)
class LMBenchConfig:
    """Model size, contexts and measurement settings of one ``bench lm`` run."""

    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    tokens_per_step: int = 16384
    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    gau_d_k: int = 64
    codebook_size: int = 128
    block_size: int = 64
    window: int = 256
    repeats: int = 3
    rounds: int = 1
    warmup: int = 1
    decode_tokens: int = 32
    memory_gb: float = 8.0
    profile_top: int = 0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_device("device", self.device)
        check_choice("dtype", self.dtype, DTYPES)
        check_positive_int("rounds", self.rounds)

    def autocast(self) -> torch.autocast:
        """The precision of the forward passes: bfloat16 autocast on ``device`` when ``dtype``
        is bfloat16 (as ``train.bf16``), else a disabled autocast (float32)."""
        return torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16,
                              enabled=self.dtype == "bfloat16")

    def model_config(self, spec: str) -> LMConfig:
        """The ``LMConfig`` of the model ``spec`` (a layer spec or comma-separated pattern):
        VQ layers with the GAU value width matched to an attention + SwiGLU block; a spec with
        SwiGLU blocks gets the SwiGLU width (a multiple of 8) that gives it the softmax model's
        parameter count (a layer kind with extra projections, such as ``gla``, a narrower one)."""
        base = LMConfig(attention=spec, d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                        local_window=self.window, gau_d_k=self.gau_d_k,
                        gau_d_v=matched_gau_value_width(self.d_model, self.gau_d_k),
                        codebook_size=self.codebook_size, block_size=self.block_size)
        target = sizes.count_parameters(replace(base, attention="softmax"))
        try:
            width = sizes.matched_width(lambda w: replace(base, ffn_hidden=w), target, 8)
        except ValueError:  # no SwiGLU block (only VQ layers): the GAU width is the match
            return base
        return replace(base, ffn_hidden=width)

    def batch(self, context: int) -> int:
        """Windows per training step and prefill at ``context``: equal tokens per step."""
        return max(1, self.tokens_per_step // context)


QUICK = LMBenchConfig(contexts=(64, 128), tokens_per_step=256, d_model=32, n_heads=2, gau_d_k=16, codebook_size=16,
                      block_size=16, window=32, repeats=1, warmup=1, decode_tokens=4)


# --- measuring one model (in its own process) ----------------------------------------------


def _training_step(model: LM, optimizer: torch.optim.Optimizer, ids: torch.Tensor, config: LMBenchConfig):
    """One optimizer step as ``train.trainer`` takes it, on ``ids [B, C + 1]`` (inputs and
    targets); the step returns the loss (detached)."""

    def step() -> torch.Tensor:
        with config.autocast():
            logits, _, aux = model(ids[:, :-1], check_inputs=False)
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        (loss + aux["commit_loss"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.update_codebooks()
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


def _empty_row(spec: str, parameters: int, context: int, batch: int) -> dict:
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
    train = profile_call(_training_step(model, optimizer, ids, config), device=device, top=top)
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
        row = _empty_row(spec, model.num_parameters(), context, config.batch(context))
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
        train = measure(_training_step(model, optimizer, ids, config), repeats=config.repeats, warmup=config.warmup,
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


# --- summary against the targets ---------------------------------------------------------------


def _value(rows: Sequence[dict], case: str, context: int, key: str) -> float | None:
    return next((r[key] for r in rows if r["case"] == case and r["context"] == context), None)


def _train_ratios(rows: Sequence[dict], case: str, baseline: str) -> dict[int, float]:
    """``case`` / ``baseline`` training tokens/s at every context where both were measured."""
    ratios = {}
    for context in sorted({r["context"] for r in rows}):
        mine, theirs = (_value(rows, name, context, "train_tokens_per_s") for name in (case, baseline))
        if mine and theirs:
            ratios[context] = mine / theirs
    return ratios


def _growth(rows: Sequence[dict], case: str, low: int, high: int) -> float | None:
    """Decode ms/token of ``case`` at context ``high`` over that at ``low`` (None if either is missing)."""
    slow, fast = _value(rows, case, high, "decode_ms_per_token"), _value(rows, case, low, "decode_ms_per_token")
    return slow / fast if slow and fast else None


def _verdict(passed: bool | None) -> str:
    return "not measured" if passed is None else "pass" if passed else "fail"


def summarize(rows: Sequence[dict]) -> dict:
    """Parameter counts and their spread, VQ / softmax training tokens/s per context, decode
    growth per model, and the three targets of issue 21 as ``pass`` / ``fail`` / ``not
    measured`` (a target needs the VQ and softmax models and its contexts)."""
    parameters = {r["case"]: r["parameters"] for r in rows}
    summary = {"parameters": parameters,
               "parameter_spread": max(parameters.values()) / min(parameters.values()) - 1 if parameters else None,
               "decode_growth": {}}
    contexts = sorted({r["context"] for r in rows})
    if len(contexts) >= 2:
        summary["decode_growth"] = {"from_context": contexts[0], "to_context": contexts[-1], "growth": {
            case: _growth(rows, case, contexts[0], contexts[-1]) for case in parameters}}
    if "vq" not in parameters or "softmax" not in parameters:
        return summary
    ratios = _train_ratios(rows, "vq", "softmax")
    summary["vq_over_softmax_train"] = {str(c): ratio for c, ratio in ratios.items()}
    overtake = next((c for c in ratios if all(ratios[d] >= 1 for d in ratios if d >= c)), None)
    if overtake is not None and overtake <= OVERTAKE_BY:
        overtaken = True
    elif overtake is not None and overtake == min(ratios):  # ahead from the first measured C, past OVERTAKE_BY
        overtaken = None
    else:
        overtaken = False if ratios and max(ratios) >= OVERTAKE_BY else None
    speedup = ratios.get(SPEEDUP_AT)
    growth = _growth(rows, "vq", DECODE_FROM, DECODE_TO)
    summary["targets"] = [
        {"target": f"VQ training tokens/s overtakes softmax's by C={OVERTAKE_BY}", "value": overtake,
         "verdict": _verdict(overtaken)},
        {"target": f"VQ / softmax training tokens/s at C={SPEEDUP_AT} >= {SPEEDUP_MIN:g}x", "value": speedup,
         "verdict": _verdict(None if speedup is None else speedup >= SPEEDUP_MIN)},
        {"target": f"VQ decode ms/token at C={DECODE_TO} / at C={DECODE_FROM} <= {DECODE_GROWTH_MAX:g}x",
         "value": growth, "verdict": _verdict(None if growth is None else growth <= DECODE_GROWTH_MAX),
         "softmax": _growth(rows, "softmax", DECODE_FROM, DECODE_TO)},
    ]
    return summary


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def format_summary(summary: dict) -> str:
    """The targets as readable lines (or why there are none)."""
    lines = ["targets:"]
    if "targets" not in summary:
        return "targets: not computed (they compare the vq and softmax models; run both)"
    overtake, speedup, decode = summary["targets"]
    ratios = ", ".join(f"{ratio:.2f}x at {c}" for c, ratio in summary["vq_over_softmax_train"].items())
    since = "not at any measured C" if overtake["value"] is None else f"from C={overtake['value']} on"
    lines.append(f"  {overtake['target']}: {overtake['verdict'].upper()} ({since}; "
                 f"VQ / softmax: {ratios or 'none measured'})")
    lines.append(f"  {speedup['target']}: {speedup['verdict'].upper()} ({_x(speedup['value'])})")
    lines.append(f"  {decode['target']}: {decode['verdict'].upper()} ({_x(decode['value'])}; "
                 f"softmax {_x(decode['softmax'])})")
    return "\n".join(lines)


# --- report ---------------------------------------------------------------------------------


def _number(value: float | None, digits: str = ",.0f") -> str:
    return "—" if value is None else format(value, digits)


def markdown_table(rows: Sequence[dict]) -> str:
    """One line per (model, context)."""
    header = ["model", "parameters", "C", "batch", "train tok/s", "train step peak MiB", "prefill tok/s",
              "decode ms/token", "note"]
    cells = [[f"`{r['case']}`", f"{r['parameters']:,}", str(r["context"]), str(r["batch"]),
              _number(r["train_tokens_per_s"]),
              _number(None if r["train_peak_bytes"] is None else r["train_peak_bytes"] / _MIB, ",.1f"),
              _number(r["prefill_tokens_per_s"]), _number(r["decode_ms_per_token"], ".3g"), r["skip_reason"] or ""]
             for r in rows]
    return "\n".join(reporting.markdown_table_lines(header, cells)) + "\n"


# Metrics of context_table: name -> (row key, header, scale, format, "speed" | "time" | None).
_CONTEXT_METRICS = {
    "train": ("train_tokens_per_s", "train tok/s", 1.0, ",.0f", "speed"),
    "prefill": ("prefill_tokens_per_s", "prefill tok/s", 1.0, ",.0f", "speed"),
    "decode": ("decode_ms_per_token", "decode ms", 1.0, ".3g", "time"),
    "peak": ("train_peak_bytes", "step peak MiB", 1 / _MIB, ",.0f", None),
}


def _context_column(text: str) -> tuple[str, int, int | None]:
    """``METRIC@C`` -> (METRIC, C, None); ``METRIC@C/C0`` -> (METRIC, C, C0)."""
    metric, _, contexts = text.partition("@")
    first, _, second = contexts.partition("/")
    if metric not in _CONTEXT_METRICS or not first.isdigit() or (second and not second.isdigit()):
        raise ValueError(f"column {text!r}: expected METRIC@C or METRIC@C/C0 with METRIC one of "
                         f"{', '.join(_CONTEXT_METRICS)} and C, C0 context lengths")
    return metric, int(first), int(second) if second else None


def context_table(rows: Sequence[dict], columns: Sequence[str], speedup: tuple[str, str] | None = None) -> str:
    """Models (rows, in the order they ran) against ``columns``: ``METRIC@C``, the metric at
    context C, or ``METRIC@C/C0``, its growth from C0 to C (``x``); METRIC is ``train`` or
    ``prefill`` (tokens/s), ``decode`` (ms per token) or ``peak`` (training-step MiB); "—"
    where a context was skipped. ``speedup=(a, b)`` adds a row ``a / b``: how many times
    faster model ``a`` is than ``b`` in each column (tokens/s a/b, ms b/a; blank for memory
    and growth)."""
    parsed = [_context_column(c) for c in columns]
    values = {(r["case"], r["context"]): r for r in rows}
    models = list(dict.fromkeys(r["case"] for r in rows))
    if speedup is not None and any(m not in models for m in speedup):
        raise ValueError(f"speedup {'/'.join(speedup)}: both models must be among {', '.join(models)}")

    def value(model: str, metric: str, context: int) -> float | None:
        key, _, scale, _, _ = _CONTEXT_METRICS[metric]
        row = values.get((model, context))
        return None if row is None or row[key] is None else row[key] * scale

    header = ["model"] + [f"{_CONTEXT_METRICS[m][1]} {c}" + (f" / {c0}" if c0 else "") for m, c, c0 in parsed]
    cells = []
    for model in models:
        line = [f"`{model}`"]
        for metric, context, base in parsed:
            v = value(model, metric, context)
            if base is None:
                line.append(_number(v, _CONTEXT_METRICS[metric][3]))
            else:
                b = value(model, metric, base)
                line.append("—" if v is None or not b else f"{v / b:.2f}x")
        cells.append(line)
    if speedup is not None:
        a, b = speedup
        line = [f"{a} / {b}"]
        for metric, context, base in parsed:
            kind, va, vb = _CONTEXT_METRICS[metric][4], value(a, metric, context), value(b, metric, context)
            if base is not None or kind is None or not va or not vb:
                line.append("")
            else:
                line.append(f"{va / vb if kind == 'speed' else vb / va:.2f}x")
        cells.append(line)
    return "\n".join(reporting.markdown_table_lines(header, cells)) + "\n"


def _contexts_view(results: dict, *, columns: str, speedup: str | None = None) -> str:
    """``context_table`` of ``results.json``'s rows; ``columns`` comma-separated, ``speedup``
    ``a/b`` (the options of a generated block in the documentation)."""
    pair = None
    if speedup is not None:
        a, _, b = speedup.partition("/")
        if not a or not b:
            raise ValueError(f"speedup {speedup!r}: expected MODEL/MODEL")
        pair = (a, b)
    return context_table(results["rows"], columns.split(","), pair)


# Named tables of a results.json for the documentation: name -> view(results, **options).
VIEWS = {"contexts": _contexts_view}


def write_plots(rows: Sequence[dict], out_dir: Path) -> list[Path]:
    """``throughput.png`` (training and prefill tokens/s) and ``decode.png`` (decode ms per token,
    training-step peak memory) against the context, log-log, one line per model."""
    plt = reporting.pyplot()
    paths = []
    for name, panels in (
        ("throughput.png", (("train_tokens_per_s", 1.0, "tokens/s", "training step (fwd + bwd + AdamW)"),
                            ("prefill_tokens_per_s", 1.0, "tokens/s", "prefill (forward, no grad)"))),
        ("decode.png", (("decode_ms_per_token", 1.0, "ms per token", "decode, whole context in the state"),
                        ("train_peak_bytes", 1 / _MIB, "MiB", "training step peak extra memory"))),
    ):
        figure, axes = plt.subplots(1, 2, figsize=(12, 5))
        for axis, (key, scale, ylabel, title) in zip(axes, panels):
            report.plot_lines(axis, rows, key, scale, x="context", xlabel="context C (tokens)")
            axis.set(ylabel=ylabel, title=title)
        paths.append(reporting.save_figure(figure, Path(out_dir) / name))
    return paths


def _profile_markdown(rows: Sequence[dict], command: str) -> str:
    sections = [f"# bench lm: where the time goes\n\n`{command}`\n"]
    for row in rows:
        for part, profile in (row["profile"] or {}).items():
            sections.append(report.profile_section(f"`{row['case']}`, C={row['context']}, {part}", profile))
    return "\n".join(sections)


def _rounds_text(rounds: int) -> str:
    return "" if rounds == 1 else f", {rounds} rounds in alternating order, the timed calls pooled"


def page(results: dict) -> str:
    """``results.md`` of ``results.json``'s contents: the command, the settings its metadata
    records (``shapes``: the ``LMBenchConfig``), the table and the targets."""
    metadata, shapes = results["metadata"], results["metadata"]["shapes"]
    precision = "bfloat16 autocast" if shapes["dtype"] == "bfloat16" else "float32"
    return (f"# bench lm\n\n`{metadata['command']}`\n\nWhole models on {metadata['device']} "
            f"({metadata['device_name']}), {precision}, {shapes['tokens_per_step']:,} tokens per training step and "
            f"prefill (batch = tokens / C), decode at batch 1 (median of {shapes['decode_tokens']} greedy tokens); "
            f"each model in a fresh process{_rounds_text(shapes.get('rounds', 1))}.\n\n"
            f"{markdown_table(results['rows'])}\n```text\n"
            f"{format_summary(results['summary'])}\n```\n")


def write_results(rows: Sequence[dict], config: LMBenchConfig, out_dir: Path, *, command: str,
                  models: Sequence[str]) -> dict:
    """Write results.json, results.md, the plots (and profile.md with ``--profile``) into
    ``out_dir``; return ``{"summary", "text", "files"}``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows)
    shapes = {**dataclasses.asdict(config), "autocast": config.dtype != "float32", "decode_batch": 1,
              "models": {spec: config.model_config(spec).to_dict() for spec in models}}
    metadata = reporting.collect_metadata(device=config.device, command=command, shapes=shapes)
    text = page({"metadata": metadata, "rows": rows, "summary": summary})
    files = [reporting.write_json(out_dir / "results.json", rows=rows, metadata=metadata, summary=summary),
             reporting.write_markdown(out_dir / "results.md", text)]
    files += write_plots(rows, out_dir)
    if config.profile_top:
        files.append(reporting.write_markdown(out_dir / "profile.md", _profile_markdown(rows, command)))
    return {"summary": summary, "text": text, "files": files}


def run(config: LMBenchConfig, models: Sequence[str], *, out_dir: Path, command: str,
        threads: int | None = None) -> dict:
    """Measure every model in its own process; after each, (re)write the result files, so an
    interrupted run keeps the models it finished. Returns ``write_results``'s dict and ``rows``."""
    check_cuda_available("device", config.device)
    for spec in models:  # every configuration is checked before the first measurement
        try:
            config.model_config(spec)
        except ValueError as error:
            raise ValueError(f"--models {spec!r}: {error}") from None
    measured, result = [], None
    for round_index in range(config.rounds):
        order = models if round_index % 2 == 0 else models[::-1]
        settings = config if round_index == 0 else dataclasses.replace(config, profile_top=0)
        for index, spec in enumerate(order):
            started = time.perf_counter()
            try:
                measured += in_fresh_process(measure_model, spec, settings, threads=threads)
            except BrokenProcessPool as error:  # e.g. the kernel's out-of-memory killer
                parameters = LM(config.model_config(spec)).num_parameters()
                for context in sorted(config.contexts):
                    row = _empty_row(spec, parameters, context, config.batch(context))
                    row["skip_reason"] = f"the measuring process died ({error})"
                    measured.append(row)
            print(f"bench lm: {spec} measured ({index + 1}/{len(models)}, round {round_index + 1}/{config.rounds}, "
                  f"{time.perf_counter() - started:.0f} s)", flush=True)
            rows = pool_rounds(measured)
            done = [spec for spec in models if any(row["case"] == spec for row in rows)]
            result = write_results(rows, config, out_dir, command=command, models=done)
    return {**result, "rows": rows}


def pool_rounds(rows: Sequence[dict]) -> list[dict]:
    """One row per (model, context) from the rows of several rounds (``--rounds``): the timed
    calls of every round pooled, the medians and tokens/s taken over them, the peak memory
    the largest; a context skipped in any round is skipped, with that round's reason. One
    round's rows come back as they are."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["case"], row["context"]), []).append(row)
    pooled = []
    for group in groups.values():
        first = group[0]
        skipped = next((row for row in group if row["skip_reason"] is not None), None)
        if len(group) == 1 or skipped is not None:
            pooled.append(skipped or first)
            continue
        row = dict(first)
        for part in ("train", "prefill"):
            times = [t for each in group for t in each[f"{part}_times_s"]]
            row[f"{part}_times_s"], row[f"{part}_s"] = times, median(times)
            row[f"{part}_tokens_per_s"] = row["tokens_per_step"] / row[f"{part}_s"]
            peaks = [each[f"{part}_peak_bytes"] for each in group if each[f"{part}_peak_bytes"] is not None]
            row[f"{part}_peak_bytes"] = max(peaks) if peaks else None
        row["decode_times_s"] = [t for each in group for t in each["decode_times_s"]]
        row["decode_ms_per_token"] = median(row["decode_times_s"]) * 1e3
        pooled.append(row)
    return pooled


# --- the command line -----------------------------------------------------------------------


def layer_pattern(text: str) -> str:
    """An argparse type: a comma-separated pattern of layer specs (``vq``, ``local,local,vq``)."""
    try:
        for spec in text.split(","):
            parse_layer_spec(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


HELP = "whole LMs vs context length: training and prefill tokens/s, decode ms/token, peak memory"
DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linattn bench lm``."""
    defaults = LMBenchConfig()
    parser.add_argument("--models", "--mechanisms", dest="models", nargs="+", type=layer_pattern, metavar="SPEC",
                        help=f"layer specs or patterns (default {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--contexts", nargs="+", type=positive_int, metavar="C",
                        help=f"context lengths (default {' '.join(map(str, DEFAULT_CONTEXTS))}; "
                             "add 32768 65536 where memory allows)")
    parser.add_argument("--tokens-per-step", type=positive_int,
                        help=f"tokens per training step and prefill, batch = this / C (default "
                             f"{defaults.tokens_per_step})")
    parser.add_argument("--quick", action="store_true",
                        help=f"a tiny model (d_model {QUICK.d_model}) at contexts "
                             f"{' '.join(map(str, QUICK.contexts))}, for tests; flags given still apply")
    size = parser.add_argument_group("model size (every model the same)")
    for flag, help_text in (("--d-model", "width"), ("--n-layers", "layers (a pattern repeats to fill them)"),
                            ("--n-heads", "heads of the attention blocks"),
                            ("--gau-d-k", "key width of the VQ layers' gated attention units"),
                            ("--codebook-size", "VQ codes per unit"), ("--block-size", "VQ block length"),
                            ("--window", "window of the local layers")):
        name = flag[2:].replace("-", "_")
        size.add_argument(flag, type=positive_int, help=f"{help_text} (default {getattr(defaults, name)})")
    parser.add_argument("--repeats", type=positive_int, help=f"timed calls, median kept (default {defaults.repeats})")
    parser.add_argument("--rounds", type=positive_int,
                        help=f"measure every model this many times, each in a fresh process, the models in "
                             f"alternating order, and pool the timed calls (default {defaults.rounds}): a slow "
                             f"spell of a shared machine then falls on every model")
    parser.add_argument("--warmup", type=non_negative_int, help=f"untimed calls first (default {defaults.warmup})")
    parser.add_argument("--decode-tokens", type=positive_int,
                        help=f"greedy tokens generated per context, median kept (default {defaults.decode_tokens})")
    parser.add_argument("--memory-gb", type=positive_float,
                        help=f"skip a context whose estimated training-step memory exceeds this (10^9 bytes; "
                             f"default {defaults.memory_gb:g})")
    parser.add_argument("--profile", type=positive_int, metavar="N",
                        help="profile a training step, a prefill and a decoding step of each model at its longest "
                             "context; write the N operators with the most self time to profile.md")
    parser.add_argument("--device", type=available_device_name, default="cpu",
                        help="cpu, cuda or cuda:N: models, optimizer, tokens and states there (default %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="bfloat16: forward passes under bfloat16 autocast, float32 weights, as train.bf16 "
                             "(default %(default)s)")
    parser.add_argument("--seed", type=non_negative_int, help="seed of the weights and tokens (default 0)")
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("results/bench-lm"), help="output directory")


_FLAGS = ("contexts", "tokens_per_step", "d_model", "n_layers", "n_heads", "gau_d_k", "codebook_size", "block_size",
          "window", "repeats", "rounds", "warmup", "decode_tokens", "memory_gb", "seed", "device", "dtype")


def config_from_args(args: argparse.Namespace) -> LMBenchConfig:
    """``--quick``'s settings (or the defaults) with the flags given on top."""
    given = {name: getattr(args, name) for name in _FLAGS if getattr(args, name) is not None}
    if "contexts" in given:
        given["contexts"] = tuple(sorted(set(given["contexts"])))
    if args.profile:
        given["profile_top"] = args.profile
    return dataclasses.replace(QUICK if args.quick else LMBenchConfig(), **given)


def run_command(args: argparse.Namespace) -> int:
    """Measure, write the files, print the table and the targets."""
    config = config_from_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    models = list(dict.fromkeys(args.models or DEFAULT_MODELS))
    unequal = [c for c in config.contexts if config.batch(c) * c != config.tokens_per_step]
    if unequal:
        print(f"bench lm: at C = {' '.join(map(str, unequal))} the tokens per step differ from --tokens-per-step "
              f"{config.tokens_per_step} (one window above it; a remainder below); see the batch column", flush=True)
    result = run(config, models, out_dir=args.out, command=args.command_line, threads=args.threads)
    print(result["text"])
    print("wrote " + ", ".join(str(p) for p in result["files"]))
    return 0
