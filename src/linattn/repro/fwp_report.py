"""The report of the FWP retrieval experiments: per-mechanism summary, Markdown tables, plot.

``runs`` are ``fwp_retrieval.train_run``'s rows, one per (mechanism, S, seed), with the final
evaluation loss and accuracy, steps and stop reason; ``rows`` are those aggregated over the
seeds (``spread.aggregate``). The verdicts are thresholds: a size meets a criterion when
every seed of it does (with one seed, when that run does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..reporting import markdown_table_lines, pyplot, save_figure
from . import spread

if TYPE_CHECKING:
    from .fwp_retrieval import RetrievalTrainConfig, Setting


ACCURACY_LEVELS = (0.99, 0.9, 0.5)


def _every_seed(row: dict, metric: str, holds: Callable[[dict], bool]) -> bool:
    """``holds(stats)`` for the metric's stats over the seeds, every seed with a finite value."""
    stats = spread.stats_of(row, metric)
    return stats is not None and stats["n"] == row["n"] and holds(stats)


def _solved(row: dict, target_loss: float) -> bool:
    return _every_seed(row, "final_eval_loss", lambda s: s["max"] <= target_loss)


def _accurate(row: dict, level: float) -> bool:
    return _every_seed(row, "final_eval_accuracy", lambda s: s["min"] >= level)


def _largest_prefix_size(rows: Sequence[dict], holds) -> int | None:
    """The largest S such that ``holds`` is true for every row up to it (rows sorted by S); None
    when the smallest S already fails."""
    largest = None
    for r in rows:
        if not holds(r):
            break
        largest = r["size"]
    return largest


def summarize(rows: Sequence[dict], *, target_loss: float) -> dict:
    """Per mechanism, from the rows aggregated over the seeds: d_dot, the sizes whose final loss
    reached ``target_loss`` at every seed, the largest S up to which every size did, the
    largest S up to which every size's final accuracy is at least each of ``ACCURACY_LEVELS``
    at every seed, and the mean final losses by S."""
    summary = {}
    for name in dict.fromkeys(r["mechanism"] for r in rows):
        mine = sorted((r for r in rows if r["mechanism"] == name), key=lambda r: r["size"])
        summary[name] = {
            "d_dot": mine[0]["d_dot"],
            "seeds": sorted({seed for r in mine for seed in r["seeds"]}),
            "solved_sizes": [r["size"] for r in mine if _solved(r, target_loss)],
            "largest_size_all_solved": _largest_prefix_size(mine, lambda r: _solved(r, target_loss)),
            "largest_size_accuracy_at_least": {
                f"{level:g}": _largest_prefix_size(mine, lambda r, level=level: _accurate(r, level))
                for level in ACCURACY_LEVELS},
            "final_eval_loss_by_size": {str(r["size"]): spread.mean_of(r, "final_eval_loss") for r in mine},
        }
    return summary


def _loss(row: dict) -> str:
    return spread.format_stats(spread.stats_of(row, "final_eval_loss"), ".1e", bare_single=True)


def _percent(row: dict) -> str:
    stats = spread.stats_of(row, "final_eval_accuracy")
    if stats is None:
        return "—"
    scaled = {key: value if key == "n" or value is None else 100 * value for key, value in stats.items()}
    return spread.format_stats(scaled, ".1f", bare_single=True) + "%"


def _steps(row: dict, runs: Sequence[dict]) -> str:
    mine = [run for run in runs if (run["mechanism"], run["size"]) == (row["mechanism"], row["size"])]
    stops = "".join(_STOP[run["stop_reason"]] for run in mine)
    if len(mine) == 1:
        return f"{mine[0]['steps']}{stops}"
    return f"{spread.mean_of(row, 'steps'):.0f} ({stops})"


def _size(value: int | None) -> str:
    return "—" if value is None else str(value)


def _d_dot(value: int | None) -> str:
    return "∞" if value is None else str(value)  # softmax: no fixed-size memory


_STOP = {"target": "t", "plateau": "p", "max_steps": "m", "non_finite": "nan"}


def markdown_report(rows: Sequence[dict], runs: Sequence[dict], *, title: str, command: str, setting: Setting,
                    config: RetrievalTrainConfig, summary: dict) -> str:
    """The Markdown page: final loss per (mechanism, S) over the seeds, steps per run, the summary."""
    sizes = sorted({r["size"] for r in rows})
    names = list(dict.fromkeys(r["mechanism"] for r in rows))
    find = {(r["mechanism"], r["size"]): r for r in rows}
    header = ["mechanism", "d_dot", *(f"S={s}" for s in sizes)]
    losses, accuracies, steps = [], [], []
    for name in names:
        d_dot = find[(name, sizes[0])]["d_dot"] if (name, sizes[0]) in find else None
        first = [name, _d_dot(d_dot)]
        cells = [find.get((name, s)) for s in sizes]
        losses.append(first + ["" if r is None else _loss(r) for r in cells])
        accuracies.append(first + ["" if r is None else _percent(r) for r in cells])
        steps.append(first + ["" if r is None else _steps(r, runs) for r in cells])
    emb = "int(1.1 * 2S)" if config.emb_dim is None else str(config.emb_dim)
    seeds = sorted({seed for r in rows for seed in r["seeds"]})
    several = max(r["n"] for r in rows) > 1
    lines = [
        f"# {title}",
        "",
        f"`{command}`",
        "",
        f"{setting.title}. One attention layer, d_key = {config.key_dim}, d_emb = {emb}; Adam lr {config.lr:g}, "
        f"batch {config.batch_size}; evaluation every {config.eval_every} steps on {config.eval_sequences} fresh "
        f"sequences asking every key; stop at eval loss <= {config.target_loss:g}, after {config.patience} "
        f"evaluations without improvement, or at {config.max_steps} steps; seed{'s' if len(seeds) > 1 else ''} "
        f"{', '.join(map(str, seeds))}.",
        "",
        spread.seeds_text(rows, cells=several) + " The verdicts below are thresholds: a size meets a criterion "
        "when every seed of it does. " + spread.RESOLVED_RULE,
        "",
        "## Final evaluation loss (1/2 squared error per query)",
        "",
        *markdown_table_lines(header, losses),
        "",
        "## Final retrieval accuracy (argmax of the retrieved vector = target value)",
        "",
        *markdown_table_lines(header, accuracies),
        "",
        "## Training steps (t: reached the target loss, p: plateau, m: step cap"
        + ("; with several seeds: the mean, then each seed's stop" if several else "") + ")",
        "",
        *markdown_table_lines(header, steps),
        "",
        "## Capacity: the largest S up to which every S met the criterion" + (" at every seed" if several else ""),
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
    every = " at every seed" if several else ""
    for name, s in summary.items():
        largest = s["largest_size_all_solved"]
        solved = ", ".join(map(str, s["solved_sizes"]))
        if not solved:
            text = f"no S reached loss <= {config.target_loss:g}{every}"
        elif largest is None:
            text = f"the smallest S missed loss <= {config.target_loss:g}; reached{every} at S = {solved}"
        else:
            text = f"every S up to {largest} reached loss <= {config.target_loss:g}{every}; reached at S = {solved}"
        lines.append(f"- {name} (d_dot {_d_dot(s['d_dot'])}): {text}")
    return "\n".join(lines) + "\n"


def _floored(stats: dict | None, floor: float) -> dict | None:
    """Loss stats with every value at least ``floor`` (a log axis)."""
    if stats is None:
        return None
    return {key: value if key == "n" or value is None else max(value, floor) for key, value in stats.items()}


def write_plot(rows: Sequence[dict], path: Path, *, title: str, target_loss: float, mark_d_dot: bool) -> Path:
    """Two panels against S, one line per mechanism: the final evaluation loss (log y, like the
    paper's figures) and the final retrieval accuracy (where chance is 1/S); with several seeds
    the mean and min–max error bars."""
    figure, (loss_axis, accuracy_axis) = pyplot().subplots(1, 2, figsize=(14, 5))
    for index, name in enumerate(dict.fromkeys(r["mechanism"] for r in rows)):
        mine = sorted((r for r in rows if r["mechanism"] == name), key=lambda r: r["size"])
        color = f"C{index % 10}"
        xs = [r["size"] for r in mine]
        style = dict(marker="o", markersize=3, color=color, label=mine[0]["label"])
        spread.plot_spread(loss_axis, xs, [_floored(spread.stats_of(r, "final_eval_loss"), 1e-8) for r in mine],
                           **style)
        spread.plot_spread(accuracy_axis, xs, [spread.stats_of(r, "final_eval_accuracy") for r in mine],
                           scale=100, **style)
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
    several = max(r["n"] for r in rows) > 1
    figure.suptitle(title + (" (dotted: d_dot)" if mark_d_dot else "")
                    + ("; mean over the seeds, bars: min–max" if several else ""))
    return save_figure(figure, path)
