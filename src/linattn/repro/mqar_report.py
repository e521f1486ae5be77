"""The report of ``linattn repro mqar``: accuracy table over the seeds, the differences of
accuracy per task, per-run table and plot.

``rows`` are aggregated over the seeds (``spread.aggregate``: one per (mechanism,
d_model, (T, N))); ``runs`` are ``mqar.train_run``'s rows, one per seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..reporting import markdown_table_lines, pyplot, save_figure
from . import spread
from .journal import closing_note

if TYPE_CHECKING:
    from .mqar import MQARConfig


def _number(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.3f}"


def _task_label(seq_len: int, num_pairs: int) -> str:
    return f"T={seq_len}, {num_pairs} pairs"


def _key(row: dict) -> tuple:
    return row["mechanism"], row["d_model"], row["seq_len"], row["num_pairs"]


def _accuracy_cell(row: dict | None, runs: Sequence[dict]) -> str:
    if row is None:
        return ""
    diverged = sum(run["status"] != "ok" for run in runs if _key(run) == _key(row))
    mark = "" if not diverged else " (diverged)" if row["n"] == 1 else f" ({diverged} diverged)"
    return spread.format_stats(spread.stats_of(row, "accuracy")) + mark


def markdown_report(rows: Sequence[dict], runs: Sequence[dict], *, command: str, config: MQARConfig, metadata: dict,
                    note: str = "") -> str:
    """Accuracy table (rows: mechanism; columns: (T, pairs) per d_model; mean ± std (min–max)
    over the seeds), the differences of accuracy per column, and per-run details; ``note``
    (an interim report's sentence) replaces the clause on reused runs."""
    names = list(dict.fromkeys(r["mechanism"] for r in rows))
    d_models = sorted({r["d_model"] for r in rows})
    tasks = sorted({(r["seq_len"], r["num_pairs"]) for r in rows})
    find = {_key(r): r for r in rows}
    columns = [(d, t) for d in d_models for t in tasks]
    header = ["mechanism", *(f"d={d}, {_task_label(*t)}" for d, t in columns)]
    accuracy_rows = [[name, *(_accuracy_cell(find.get((name, d, t, n)), runs) for d, (t, n) in columns)]
                     for name in names]
    seeds = sorted({seed for r in rows for seed in r["seeds"]})
    lines = [
        "# repro mqar: multi-query associative recall (Zoology)",
        "",
        f"`{command}`",
        "",
        f"2-layer LM, vocab {config.vocab_size}, {config.n_heads} heads; AdamW lr {config.lr:g} (warm-up "
        f"{config.warmup_fraction:.0%}, cosine to {config.min_lr_ratio:g}x), weight decay {config.weight_decay:g}, "
        f"batch {config.batch_size}, {config.steps} steps; power-law query gaps a = {config.power_a:g}; local window "
        f"{config.window}; FAVOR+ {config.favor_features} features; VQ codebook {config.codebook_size}, block "
        f"{config.block_size}, d_k {config.gau_d_k}; seed{'s' if len(seeds) > 1 else ''} "
        f"{', '.join(map(str, seeds))}. Accuracy on the query positions of "
        f"{config.eval_batches} x {config.batch_size} held-out sequences (chance ~ {2 / config.vocab_size:.1e}).",
        "",
        spread.seeds_text(rows),
        "",
        "## Accuracy",
        "",
        *markdown_table_lines(header, accuracy_rows),
        "",
    ]
    tables = []
    for d, (t, n) in columns:
        mine = [find[(name, d, t, n)] for name in names if (name, d, t, n) in find]
        tables.append((f"Accuracy, d={d}, {_task_label(t, n)} (higher is better):", spread.difference_matrix(
            mine, lambda r: spread.stats_of(r, "accuracy"), lambda r: r["mechanism"])))
    lines += spread.differences_lines(tables)
    lines += [
        "",
        "## Runs",
        "",
        *markdown_table_lines(
            ["mechanism", "spec", "d_model", "T", "pairs", "seed", "parameters", "accuracy", "eval loss",
             "final train loss", "steps", "seconds"],
            [[r["mechanism"], f"`{r['spec']}`", str(r["d_model"]), str(r["seq_len"]), str(r["num_pairs"]),
              str(r["seed"]), f"{r['parameters']:,}", f"{r['accuracy']:.3f}", _number(r["eval_loss"]),
              _number(r["final_loss"]), str(r["steps"]), f"{r['seconds']:.0f}"] for r in runs]),
    ]
    lines += ["", closing_note(metadata, len(runs), note)]
    return "\n".join(lines) + "\n"


def write_plot(rows: Sequence[dict], path: Path) -> Path:
    """Accuracy against sequence length, one line per mechanism (the mean over the seeds,
    min–max error bars, each mechanism shifted a little along T), one panel per d_model."""
    d_models = sorted({r["d_model"] for r in rows})
    names = list(dict.fromkeys(r["mechanism"] for r in rows))
    figure, axes = pyplot().subplots(1, len(d_models), figsize=(5.5 * len(d_models) + 1.8, 4.5), squeeze=False,
                                     sharey=True)
    for axis, d in zip(axes[0], d_models):
        lengths = sorted({r["seq_len"] for r in rows if r["d_model"] == d})
        for index, name in enumerate(names):
            mine = sorted((r for r in rows if r["mechanism"] == name and r["d_model"] == d),
                          key=lambda r: (r["seq_len"], r["num_pairs"]))
            if mine:
                dodge = 2.0 ** (0.02 * (index - (len(names) - 1) / 2))  # keeps overlapping bars apart
                spread.plot_spread(axis, [r["seq_len"] * dodge for r in mine],
                                   [spread.stats_of(r, "accuracy") for r in mine], marker="o",
                                   color=f"C{index % 10}", label=name)
        if len(lengths) > 1:
            axis.set_xscale("log", base=2)
        pairs = {t: sorted({r["num_pairs"] for r in rows if r["d_model"] == d and r["seq_len"] == t}) for t in lengths}
        axis.set_xticks(lengths, [f"{t}\n({'/'.join(map(str, pairs[t]))} pairs)" for t in lengths])
        axis.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        axis.set_ylim(-0.03, 1.03)
        axis.set_xlabel("sequence length T")
        axis.set_title(f"d_model = {d}")
        axis.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize="small", loc="center left", bbox_to_anchor=(1.02, 0.5))
    axes[0][0].set_ylabel("query accuracy")
    several = max(r["n"] for r in rows) > 1
    figure.suptitle("MQAR: accuracy vs sequence length" + ("\n(mean over the seeds, bars: min–max)" if several else ""))
    return save_figure(figure, path)
