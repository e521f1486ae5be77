"""The report of ``linattn repro linearize``: rows over the seeds, the verdicts, tables and plot.

The verdicts, from the means over the seeds (``spread``: a difference is resolved when the seeds'
ranges do not overlap):

- *target 1*: the best converted student with at most ``TOKEN_SHARE`` (5%) of the teacher's training
  tokens is within ``GAP`` (0.05) bpb of the teacher;
- *target 2*: that student is ahead of its architecture trained from scratch with the teacher's
  tokens (its conversion and fine-tuning on top of the teacher's training: equal tokens for the
  architecture's own training, the teacher's pretraining reused);
- *the survey's claim* (seed 004): after conversion, Transformer-VQ with ReRoPE beats Transformer-VQ
  with its windowed bias, at every fraction (and right after conversion, before fine-tuning).
"""

from __future__ import annotations

from pathlib import Path

from ..reporting import markdown_table_lines, pyplot, save_figure
from . import spread
from .journal import metadata_interim_note, reuse_note

GAP = 0.05
TOKEN_SHARE = 0.05
ROW_IDENTITY = ("case", "student", "fraction")
ROW_CONSTANTS = ("spec", "parameters", "tokens", "token_share", "finetune_steps")


def with_decode_times(runs: list[dict]) -> list[dict]:
    """The runs without the ``"decode"`` ones, their ``decode_ms`` put on the row they timed (the
    teacher's, or the converted student's at that fraction, of the same seed)."""
    timed = {(run["seed"], run["student"], run["fraction"]): run["decode_ms"] for run in runs
             if run["case"] == "decode"}
    rows = []
    for run in runs:
        if run["case"] in ("teacher", "converted"):
            key = (run["seed"], run["student"], run["fraction"])
            run = {**run, "decode_ms": timed[key]} if key in timed else run
        if run["case"] != "decode":
            rows.append(run)
    return rows


def with_gaps(runs: list[dict]) -> list[dict]:
    """The per-seed rows with ``gap`` (validation bpb minus the teacher's of the same seed) and, for the
    converted students, ``gap_converted`` (the same right after conversion)."""
    teacher = {run["seed"]: run["validation_bpb"] for run in runs if run["case"] == "teacher"}
    rows = []
    for run in runs:
        row = dict(run)
        if run["case"] != "teacher" and run["seed"] in teacher:
            row["gap"] = run["validation_bpb"] - teacher[run["seed"]]
            if run["case"] == "converted":
                row["gap_converted"] = run["validation_bpb_converted"] - teacher[run["seed"]]
        rows.append(row)
    return rows


def run_metrics(run: dict) -> dict[str, float]:
    """The nested metrics of a run: ``decode_ms_at_C`` per decoding context."""
    return {f"decode_ms_at_{context}": ms for context, ms in (run.get("decode_ms") or {}).items()}


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per (case, student, fraction) over its seeds (``spread.aggregate``)."""
    return spread.aggregate(runs, identity=ROW_IDENTITY, metrics=run_metrics, constants=ROW_CONSTANTS)


def _find(rows: list[dict], case: str, student: str | None = None) -> list[dict]:
    return [row for row in rows if row["case"] == case and (student is None or row["student"] == student)]


def summarize(rows: list[dict]) -> dict:
    """The verdicts (module docstring) with the numbers behind them; None where a row is missing."""
    teacher = _find(rows, "teacher")
    summary: dict = {"gap": GAP, "token_share": TOKEN_SHARE,
                     "teacher_bpb": spread.stats_of(teacher[0], "validation_bpb") if teacher else None}
    cheap = [row for row in _find(rows, "converted") if row["token_share"] <= TOKEN_SHARE
             and spread.stats_of(row, "gap") is not None]
    best = min(cheap, key=lambda row: spread.mean_of(row, "gap"), default=None)
    summary["best"] = None if best is None else {
        "student": best["student"], "fraction": best["fraction"], "token_share": best["token_share"],
        "gap": spread.stats_of(best, "gap"), "within": spread.mean_of(best, "gap") <= GAP}
    summary["against_scratch"] = {row["student"]: _against_scratch(rows, row) for row in _find(rows, "scratch")}
    summary["survey"] = _survey(rows)
    return summary


def _against_scratch(rows: list[dict], scratch: dict) -> dict:
    """Per fraction: the converted student's mean bpb minus its scratch twin's (< 0: conversion ahead)."""
    mine = spread.stats_of(scratch, "validation_bpb")
    result = {}
    for row in _find(rows, "converted", scratch["student"]):
        theirs = spread.stats_of(row, "validation_bpb")
        if mine is not None and theirs is not None:
            result[f"{row['fraction']:g}"] = {"difference": theirs["mean"] - mine["mean"],
                                              "resolved": spread.resolved(theirs, mine)}
    return result


def _survey(rows: list[dict]) -> dict | None:
    """Per fraction: VQ with the bias minus VQ with ReRoPE, after fine-tuning and right after conversion
    (> 0: ReRoPE better); None without both students."""
    rerope = {row["fraction"]: row for row in _find(rows, "converted", "vq-rerope")}
    bias = {row["fraction"]: row for row in _find(rows, "converted", "vq-bias")}
    common = sorted(set(rerope) & set(bias))
    if not common:
        return None
    result = {}
    for fraction in common:
        entry = {}
        for key, metric in (("finetuned", "validation_bpb"), ("converted", "validation_bpb_converted")):
            a, b = spread.stats_of(bias[fraction], metric), spread.stats_of(rerope[fraction], metric)
            entry[key] = {"difference": a["mean"] - b["mean"], "resolved": spread.resolved(a, b)}
        result[f"{fraction:g}"] = entry
    return result


def _word(resolved: bool) -> str:
    return "resolved" if resolved else "within the spread"


def conclusions(summary: dict) -> str:
    """The verdicts as sentences, written from the numbers."""
    text = []
    best = summary["best"]
    if best is None:
        text.append(f"Target 1: no student was fine-tuned with at most {TOKEN_SHARE:.0%} of the teacher's tokens.")
    else:
        holds = "holds" if best["within"] else "does not hold"
        text.append(f"Target 1 (a student within {GAP} bpb of the teacher with at most {TOKEN_SHARE:.0%} of its "
                    f"tokens) {holds}: the best, {best['student']} with {best['token_share']:.1%} of them, is "
                    f"{best['gap']['mean']:+.3f} bpb from the teacher.")
        scratch = summary["against_scratch"].get(best["student"], {}).get(f"{best['fraction']:g}")
        if scratch is not None:
            ahead = "holds" if scratch["difference"] < 0 else "does not hold"
            text.append(f"Target 2 (ahead of its architecture trained from scratch with the teacher's tokens) "
                        f"{ahead} for it: {scratch['difference']:+.3f} bpb against scratch "
                        f"({_word(scratch['resolved'])}).")
    survey = summary["survey"]
    if survey is not None:
        parts = [f"{float(fraction):.0%}: {entry['finetuned']['difference']:+.3f} "
                 f"({_word(entry['finetuned']['resolved'])})" for fraction, entry in survey.items()]
        wins = sum(entry["finetuned"]["difference"] > 0 for entry in survey.values())
        verdict = ("holds" if wins == len(survey) else "does not hold" if wins == 0 else
                   f"holds at {wins} of {len(survey)} fractions")
        first = next(iter(survey.values()))["converted"]
        text.append(f"The survey's claim (after conversion, VQ with ReRoPE beats VQ with the bias) {verdict}: the "
                    f"bias's bpb minus ReRoPE's after fine-tuning, by share of the teacher's tokens, "
                    f"{'; '.join(parts)}; right after conversion {first['difference']:+.3f} "
                    f"({_word(first['resolved'])}).")
    return " ".join(text)


def _name(row: dict) -> str:
    if row["case"] == "teacher":
        return "teacher"
    if row["case"] == "scratch":
        return f"{row['student']} from scratch"
    return f"{row['student']} at {row['fraction']:.0%}"


def markdown(rows: list[dict], metadata: dict, summary: dict, *, runs: int, note: str = "") -> str:
    """The tables over the seeds (students, scratch, decoding), the verdicts and the differences."""
    stats = spread.format_stats
    teacher_tokens = metadata["teacher_tokens"]
    quality = [[_name(row), f"`{row['spec']}`", f"{row['parameters']:,}",
                f"{row['tokens']:,} ({row['tokens'] / teacher_tokens:.1%})", str(row["n"]),
                stats(spread.stats_of(row, "validation_bpb_converted")), stats(spread.stats_of(row, "validation_bpb")),
                stats(spread.stats_of(row, "gap"), "+.3f")] for row in rows]
    contexts = metadata["decode_contexts"]
    timed = [row for row in rows if any(spread.stats_of(row, f"decode_ms_at_{c}") for c in contexts)]
    decoding = [[_name(row).replace(" at ", ", fine-tuned with "),
                 *(spread.format_mean(spread.stats_of(row, f"decode_ms_at_{c}"), ".2f") for c in contexts)]
                for row in timed]
    lines = [
        "# A pretrained transformer made linear-time: conversion against training from scratch", "",
        f"Command: `{metadata['command']}`  ",
        f"Date: {metadata['date']}; device: {metadata['device_name']}, {metadata['threads']} threads; "
        f"torch {metadata['torch_version']}.", "", spread.seeds_text(rows), "",
        *markdown_table_lines(["model", "spec", "parameters", "tokens (of the teacher's)", "n",
                               "validation bpb right after conversion", "validation bpb", "gap to the teacher"],
                              quality), "",
        f"Tokens: the teacher's training tokens ({teacher_tokens:,}); a converted student's calibration tokens "
        "(k-means and attention transfer) plus its fine-tuning tokens; from scratch, the teacher's budget. "
        "Validation bpb: one stream in windows of the training context, the state reset every window.", "",
        "Decoding, milliseconds per generated token after a prompt of C tokens (greedy; the teacher under "
        "transformers' `generate` with its KV cache, the students under `LM.generate` with their state):", "",
        *markdown_table_lines(["model", *(f"C={c}" for c in contexts)], decoding), "",
        conclusions(summary), "",
        "Against training from scratch: a converted student's validation bpb minus that of its architecture "
        "trained from scratch with the teacher's tokens (< 0: the conversion is ahead; ✓: resolved):", "",
        *_scratch_table(rows, summary), "",
        *spread.differences_lines([(f"Validation bpb of the teacher, the students with the largest share of its "
                                    f"tokens up to {TOKEN_SHARE:.0%} and the architectures from scratch (lower is "
                                    "better):", spread.difference_matrix(
                                        _compared(rows), lambda r: spread.stats_of(r, "validation_bpb"), _name))]),
    ]
    if note:
        lines += ["", note]
    elif metadata.get("reused_runs"):
        lines += ["", reuse_note(metadata["reused_runs"], runs) + "."]
    return "\n".join(lines) + "\n"


def _scratch_table(rows: list[dict], summary: dict) -> list[str]:
    fractions = sorted({row["fraction"] for row in _find(rows, "converted")})
    cells = []
    for row in _find(rows, "scratch"):
        against = summary["against_scratch"].get(row["student"], {})
        cells.append([row["student"], spread.format_stats(spread.stats_of(row, "validation_bpb")),
                      *(_difference_cell(against.get(f"{fraction:g}")) for fraction in fractions)])
    return markdown_table_lines(["student", "from scratch", *(f"converted, {f:.0%}" for f in fractions)], cells)


def _difference_cell(entry: dict | None) -> str:
    return "—" if entry is None else f"{entry['difference']:+.3f}" + (" ✓" if entry["resolved"] else "")


def _compared(rows: list[dict]) -> list[dict]:
    """The teacher, the converted rows of the largest fraction within ``TOKEN_SHARE``, the scratch rows."""
    cheap = [row["fraction"] for row in _find(rows, "converted") if row["token_share"] <= TOKEN_SHARE]
    chosen = max(cheap, default=None)
    return [row for row in rows if row["case"] != "converted" or row["fraction"] == chosen]


def page(results: dict) -> str:
    """The page of ``results.json``'s contents: :func:`markdown` of its rows, metadata and summary."""
    metadata, runs = results["metadata"], len(results["runs"])
    return markdown(results["rows"], metadata, results["summary"], runs=runs,
                    note=metadata_interim_note(metadata, runs))


def write_plot(rows: list[dict], path: Path) -> Path:
    """Validation bpb against the share of the teacher's tokens, one line per student (mean, min–max
    bars); the teacher dashed, each architecture from scratch a cross at the teacher's budget."""
    figure, axis = pyplot().subplots(figsize=(7, 4.5))
    students = list(dict.fromkeys(row["student"] for row in rows if row["case"] == "converted"))
    for index, student in enumerate(students):
        mine = sorted(_find(rows, "converted", student), key=lambda row: row["token_share"])
        color = f"C{index % 10}"
        spread.plot_spread(axis, [row["token_share"] for row in mine],
                           [spread.stats_of(row, "validation_bpb") for row in mine], marker="o", color=color,
                           label=student)
        for scratch in _find(rows, "scratch", student):
            axis.plot([1.0], [spread.mean_of(scratch, "validation_bpb")], marker="x", color=color, linestyle="none")
    for teacher in _find(rows, "teacher"):
        axis.axhline(spread.mean_of(teacher, "validation_bpb"), color="grey", linestyle="--", label="teacher")
    axis.set(xscale="log", xlabel="tokens, share of the teacher's (x: from scratch)", ylabel="validation bpb",
             title="converted and fine-tuned students")
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")
    return save_figure(figure, path)
