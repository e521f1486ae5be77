"""The report of the FWP retrieval experiments: per-mechanism summary, Markdown tables, plot.

Rows are ``fwp_retrieval.train_run``'s: one per (mechanism, S), with its final evaluation
loss and accuracy, steps and stop reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..reporting import markdown_table_lines, pyplot, save_figure

if TYPE_CHECKING:
    from .fwp_retrieval import RetrievalTrainConfig, Setting


ACCURACY_LEVELS = (0.99, 0.9, 0.5)


def _largest_prefix_size(runs: Sequence[dict], holds) -> int | None:
    """The largest S such that ``holds`` is true for every run up to it (runs sorted by S); None
    when the smallest S already fails."""
    largest = None
    for r in runs:
        if not holds(r):
            break
        largest = r["size"]
    return largest


def summarize(rows: Sequence[dict], *, target_loss: float) -> dict:
    """Per mechanism: d_dot, the sizes whose final loss reached ``target_loss``, the largest S
    up to which every size reached it, the largest S up to which every size's final accuracy is
    at least each of ``ACCURACY_LEVELS``, and the final losses by S."""
    summary = {}
    for name in dict.fromkeys(r["mechanism"] for r in rows):
        mine = sorted((r for r in rows if r["mechanism"] == name), key=lambda r: r["size"])
        summary[name] = {
            "d_dot": mine[0]["d_dot"],
            "solved_sizes": [r["size"] for r in mine if r["final_eval_loss"] <= target_loss],
            "largest_size_all_solved": _largest_prefix_size(mine, lambda r: r["final_eval_loss"] <= target_loss),
            "largest_size_accuracy_at_least": {
                f"{level:g}": _largest_prefix_size(mine, lambda r, level=level: r["final_eval_accuracy"] >= level)
                for level in ACCURACY_LEVELS},
            "final_eval_loss_by_size": {str(r["size"]): r["final_eval_loss"] for r in mine},
        }
    return summary


def _loss(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.1e}"


def _percent(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{100 * value:.1f}%"


def _size(value: int | None) -> str:
    return "—" if value is None else str(value)


def _d_dot(value: int | None) -> str:
    return "∞" if value is None else str(value)  # softmax: no fixed-size memory


_STOP = {"target": "t", "plateau": "p", "max_steps": "m", "non_finite": "nan"}


def markdown_report(rows: Sequence[dict], *, title: str, command: str, setting: Setting,
                    config: RetrievalTrainConfig, summary: dict) -> str:
    """The Markdown page: final loss per (mechanism, S), steps per run, the summary."""
    sizes = sorted({r["size"] for r in rows})
    names = list(dict.fromkeys(r["mechanism"] for r in rows))
    find = {(r["mechanism"], r["size"]): r for r in rows}
    header = ["mechanism", "d_dot", *(f"S={s}" for s in sizes)]
    losses, accuracies, steps = [], [], []
    for name in names:
        d_dot = find[(name, sizes[0])]["d_dot"] if (name, sizes[0]) in find else None
        first = [name, _d_dot(d_dot)]
        runs = [find.get((name, s)) for s in sizes]
        losses.append(first + ["" if r is None else _loss(r["final_eval_loss"]) for r in runs])
        accuracies.append(first + ["" if r is None else _percent(r["final_eval_accuracy"]) for r in runs])
        steps.append(first + ["" if r is None else f"{r['steps']}{_STOP[r['stop_reason']]}" for r in runs])
    emb = "int(1.1 * 2S)" if config.emb_dim is None else str(config.emb_dim)
    lines = [
        f"# {title}",
        "",
        f"`{command}`",
        "",
        f"{setting.title}. One attention layer, d_key = {config.key_dim}, d_emb = {emb}; Adam lr {config.lr:g}, "
        f"batch {config.batch_size}; evaluation every {config.eval_every} steps on {config.eval_sequences} fresh "
        f"sequences asking every key; stop at eval loss <= {config.target_loss:g}, after {config.patience} "
        f"evaluations without improvement, or at {config.max_steps} steps; seed {config.seed}.",
        "",
        "## Final evaluation loss (1/2 squared error per query)",
        "",
        *markdown_table_lines(header, losses),
        "",
        "## Final retrieval accuracy (argmax of the retrieved vector = target value)",
        "",
        *markdown_table_lines(header, accuracies),
        "",
        "## Training steps (t: reached the target loss, p: plateau, m: step cap)",
        "",
        *markdown_table_lines(header, steps),
        "",
        "## Capacity: the largest S up to which every S met the criterion",
        "",
        *markdown_table_lines(
            ["mechanism", "d_dot", f"loss <= {config.target_loss:g}",
             *(f"accuracy >= {100 * level:g}%" for level in ACCURACY_LEVELS)],
            [[name, _d_dot(s["d_dot"]), _size(s["largest_size_all_solved"]),
              *(_size(s["largest_size_accuracy_at_least"][f"{level:g}"]) for level in ACCURACY_LEVELS)]
             for name, s in summary.items()]),
        "",
        "## Summary",
        "",
    ]
    for name, s in summary.items():
        largest = s["largest_size_all_solved"]
        solved = ", ".join(map(str, s["solved_sizes"]))
        if not solved:
            text = f"no S reached loss <= {config.target_loss:g}"
        elif largest is None:
            text = f"the smallest S missed loss <= {config.target_loss:g}; reached at S = {solved}"
        else:
            text = f"every S up to {largest} reached loss <= {config.target_loss:g}; reached at S = {solved}"
        lines.append(f"- {name} (d_dot {_d_dot(s['d_dot'])}): {text}")
    return "\n".join(lines) + "\n"


def write_plot(rows: Sequence[dict], path: Path, *, title: str, target_loss: float, mark_d_dot: bool) -> Path:
    """Two panels against S, one line per mechanism: the final evaluation loss (log y, like the
    paper's figures) and the final retrieval accuracy (where chance is 1/S)."""
    figure, (loss_axis, accuracy_axis) = pyplot().subplots(1, 2, figsize=(14, 5))
    for index, name in enumerate(dict.fromkeys(r["mechanism"] for r in rows)):
        mine = sorted((r for r in rows if r["mechanism"] == name), key=lambda r: r["size"])
        color = f"C{index % 10}"
        xs = [r["size"] for r in mine]
        losses = [max(r["final_eval_loss"], 1e-8) if math.isfinite(r["final_eval_loss"]) else math.nan for r in mine]
        accuracies = [100 * r["final_eval_accuracy"] for r in mine]
        loss_axis.plot(xs, losses, marker="o", markersize=3, color=color, label=mine[0]["label"])
        accuracy_axis.plot(xs, accuracies, marker="o", markersize=3, color=color, label=mine[0]["label"])
        d_dot = mine[0]["d_dot"]
        if mark_d_dot and d_dot is not None and min(xs) <= d_dot <= max(xs):
            for axis in (loss_axis, accuracy_axis):
                axis.axvline(d_dot, color=color, linestyle=":", alpha=0.6)
    loss_axis.axhline(target_loss, color="gray", linestyle="--", linewidth=0.8, label=f"stop criterion {target_loss:g}")
    loss_axis.set_yscale("log")
    loss_axis.set_ylabel("final evaluation loss")
    accuracy_axis.set_ylabel("final retrieval accuracy (%)")
    accuracy_axis.set_ylim(-2, 102)
    for axis in (loss_axis, accuracy_axis):
        axis.set_xlabel("number of unique keys S")
        axis.grid(True, which="both", alpha=0.3)
    loss_axis.legend(fontsize="small")
    figure.suptitle(title + (" (dotted: d_dot)" if mark_d_dot else ""))
    return save_figure(figure, path)
