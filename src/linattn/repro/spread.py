"""The spread over seeds of ``linattn repro``'s rows, and the reports' text and plots of it.

:func:`aggregate` groups the per-seed rows by their row identity and gives each
numeric metric's n, mean, sample standard deviation, min and max (:func:`metric_stats`);
:func:`resolved` is the one rule for when a difference between two rows is real
(:data:`RESOLVED_RULE`), and :func:`differences_lines` the reports' "Differences" section.
:func:`format_stats`, :func:`seeds_text`, :func:`plot_band` and :func:`plot_spread` show the
spread in the reports' cells, sentences and plots.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..reporting import markdown_table_lines
from .journal import canonical_key

RESOLVED_RULE = ("A difference between two rows is *resolved* when their min–max ranges over the seeds do not "
                 "overlap, each row with n >= 2 seeds; otherwise it is *within the spread* (with n = 1 nothing is "
                 "resolved).")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric_stats(values: Sequence[float | None]) -> dict:
    """``{"n", "mean", "std", "min", "max"}`` of the finite numbers among ``values`` (None and
    NaN/inf are left out; n counts the rest): ``std`` is the sample standard deviation
    ``sqrt(sum (x - mean)^2 / (n - 1))``, None when n < 2; mean, min and max are None when n = 0."""
    finite = [float(v) for v in values if _is_number(v) and math.isfinite(v)]
    n = len(finite)
    if not n:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    mean = math.fsum(finite) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / (n - 1)) if n > 1 else None
    return {"n": n, "mean": mean, "std": std, "min": min(finite), "max": max(finite)}


def aggregate(runs: Sequence[dict], identity: Sequence[str], *,
              metrics: Callable[[dict], dict[str, float | None]] | None = None,
              constants: Sequence[str] = ()) -> list[dict]:
    """One row per row identity (the values of the ``identity`` fields), in order of first
    appearance, from the per-seed ``runs`` (each with its ``"seed"``):

    - the identity fields; ``"seeds"``: the seeds of its runs, in run order; ``"n"``: their count;
    - the ``constants`` (fields that describe the row, not a result: a width, a parameter
      count), which must be equal at every seed (a ValueError otherwise), as they are;
    - every other field that is a string or a bool with the same value at every seed (a spec,
      a label), as it is;
    - ``"metrics"``: for every other numeric top-level field (bools are not numbers) and every
      entry of ``metrics(run)`` (derived or nested metrics), :func:`metric_stats` over the seeds.
    """
    groups: dict[str, list[dict]] = {}
    for run in runs:
        missing = [name for name in (*identity, "seed") if name not in run]
        if missing:
            raise ValueError(f"a run row lacks the field(s) {missing} (identity {list(identity)} and seed)")
        groups.setdefault(canonical_key([run[name] for name in identity]), []).append(run)
    rows = []
    for members in groups.values():
        row = {name: members[0][name] for name in identity}
        row.update(seeds=[run["seed"] for run in members], n=len(members))
        for name in constants:
            column = [run.get(name) for run in members]
            if any(value != column[0] for value in column):
                raise ValueError(f"{name} differs between the seeds of the row {[row[key] for key in identity]}: "
                                 f"{column}")
            row[name] = column[0]
        fields = dict.fromkeys(key for run in members for key in run if key not in row and key != "seed")
        values: dict[str, list] = {}
        for key in fields:
            column = [run.get(key) for run in members]
            if any(_is_number(v) for v in column):
                values[key] = column
            elif all(isinstance(v, (str, bool)) and v == column[0] for v in column):
                row[key] = column[0]
        for run_index, run in enumerate(members):
            for key, value in (metrics(run) if metrics else {}).items():
                values.setdefault(key, [None] * len(members))[run_index] = value
        row["metrics"] = {key: metric_stats(column) for key, column in values.items()}
        rows.append(row)
    return rows


def stats_of(row: dict, metric: str) -> dict | None:
    """The stats of ``metric`` in an aggregated row, or None when no seed had a number for it."""
    stats = row["metrics"].get(metric)
    return stats if stats and stats["n"] else None


def mean_of(row: dict, metric: str) -> float | None:
    """The mean of ``metric`` over an aggregated row's seeds (None without a number)."""
    stats = stats_of(row, metric)
    return None if stats is None else stats["mean"]


def resolved(a: dict | None, b: dict | None) -> bool:
    """The rule of :data:`RESOLVED_RULE` for two metrics' stats (:func:`metric_stats`): both
    with n >= 2 and ``a.max < b.min`` or ``b.max < a.min`` (ranges that touch overlap)."""
    if a is None or b is None or a["n"] < 2 or b["n"] < 2:
        return False
    return a["max"] < b["min"] or b["max"] < a["min"]


def format_stats(stats: dict | None, spec: str = ".3f", *, bare_single: bool = False) -> str:
    """``"mean ± std (min–max)"``; with n = 1 ``"mean ± —"`` (``bare_single``: the mean
    alone); ``"—"`` without a number."""
    if stats is None or not stats["n"]:
        return "—"
    mean = format(stats["mean"], spec)
    if stats["n"] == 1:
        return mean if bare_single else f"{mean} ± —"
    return f"{mean} ± {format(stats['std'], spec)} ({format(stats['min'], spec)}–{format(stats['max'], spec)})"


def format_mean(stats: dict | None, spec: str = ".3f") -> str:
    """The mean alone (throughput, memory: no spread shown); ``"—"`` without a number."""
    return "—" if stats is None or not stats["n"] else format(stats["mean"], spec)


def seeds_text(rows: Sequence[dict], *, cells: bool = True) -> str:
    """The report's sentence on the seeds behind its aggregated rows, e.g. "n = 3 seeds per row
    (0, 1, 2)", and with ``cells`` how a cell with a spread reads (:func:`format_stats`)."""
    seeds = sorted({seed for row in rows for seed in row["seeds"]})
    counts = sorted({row["n"] for row in rows}) or [0]
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    text = f"n = {n} seed{'' if counts[-1] == 1 else 's'} per row ({', '.join(map(str, seeds))})."
    if cells:
        text += (" A cell over the seeds reads mean ± sample standard deviation (min–max); with n = 1, "
                 "mean ± — (no spread).")
    return text


def difference_matrix(rows: Sequence[dict], value: Callable[[dict], dict | None], name: Callable[[dict], str],
                      spec: str = "+.3f") -> list[str]:
    """A Markdown table: cell (i, j) is mean_i - mean_j of the stats ``value(row)`` (rows
    without them are left out), marked ``✓`` when :func:`resolved`."""
    present = [(row, value(row)) for row in rows]
    present = [(row, stats) for row, stats in present if stats is not None and stats["n"]]
    header = ["row − column", *(name(row) for row, _ in present)]
    cells = []
    for row, a in present:
        line = [name(row)]
        for other, b in present:
            if other is row:
                line.append("")
            else:
                text = format(a["mean"] - b["mean"], spec)
                if float(text) == 0:  # no "-0.000"
                    text = format(0.0, spec)
                line.append(text + (" ✓" if resolved(a, b) else ""))
        cells.append(line)
    return markdown_table_lines(header, cells)


def differences_lines(tables: Sequence[tuple[str, list[str]]]) -> list[str]:
    """The "Differences" section of a report: the rule, then each ``(caption, table lines)``
    (:func:`difference_matrix`)."""
    lines = ["## Differences", "",
             RESOLVED_RULE + " Each table: row minus column, difference of the means over the seeds; ✓: resolved, "
             "no mark: within the spread."]
    for caption, table in tables:
        lines += ["", caption, "", *table]
    return lines


def curve_band(curves: Sequence[Sequence[Sequence[float]]]) -> tuple[list[float], list[float], list[float],
                                                                     list[float]]:
    """``(x, mean, min, max)`` over the seeds' curves ``[(x, y), ...]`` at the x's every curve
    has (seeds of one row log at the same steps)."""
    common = set.intersection(*({x for x, _ in curve} for curve in curves)) if curves else set()
    xs = sorted(common)
    at = [dict((x, y) for x, y in curve) for curve in curves]
    ys = [[values[x] for values in at] for x in xs]
    return xs, [math.fsum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def plot_band(axis, curves: Sequence[Sequence[Sequence[float]]], *, scale: float = 1.0, **style) -> None:
    """The mean curve of ``curves`` (times ``scale``) with its min–max band over the seeds."""
    xs, mean, low, high = curve_band(curves)
    if not xs:
        return
    (line,) = axis.plot(xs, [y * scale for y in mean], **style)
    if len(curves) > 1:
        axis.fill_between(xs, [y * scale for y in low], [y * scale for y in high], color=line.get_color(),
                          alpha=0.2, linewidth=0)


def plot_spread(axis, xs: Sequence[float], stats: Sequence[dict | None], *, scale: float = 1.0, **style) -> None:
    """Means at ``xs`` with min–max error bars over the seeds (points without a number left out)."""
    points = [(x, s) for x, s in zip(xs, stats) if s is not None and s["n"]]
    if not points:
        return
    means = [s["mean"] * scale for _, s in points]
    below = [(s["mean"] - s["min"]) * scale for _, s in points]
    above = [(s["max"] - s["mean"]) * scale for _, s in points]
    axis.errorbar([x for x, _ in points], means, yerr=[below, above], capsize=3, **style)
