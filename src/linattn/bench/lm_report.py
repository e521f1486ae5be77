"""The results of ``linattn bench lm``: the summary against the targets, the tables (and the
named ``VIEWS`` of the documentation), the plots, the page and the result files."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from .. import reporting
from . import report
from .lm_config import LMBenchConfig

_MIB = 2**20

# The targets of issue 21 on this CPU, checked against the measured rows (never in tests).
OVERTAKE_BY = 4096  # VQ training tokens/s >= softmax's from some context <= this one on
SPEEDUP_AT, SPEEDUP_MIN = 16384, 3.0  # VQ / softmax training tokens/s at this context
DECODE_FROM, DECODE_TO, DECODE_GROWTH_MAX = 512, 16384, 1.2  # VQ decode ms/token growth


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
