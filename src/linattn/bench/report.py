"""Benchmark tables and plots: the timing table, a speed-up table of chosen cases and lengths,
the profile tables, log-log PNG plots (``plot_lines``, shared by ``bench attention`` and
``bench lm``).

Rows are the dicts of ``harness.run_cases``; metadata and the JSON file are written by
``linattn.reporting``. Speed ratios are ``baseline time / case time`` at the same length
in the same run, so ``10.3x`` means the case is 10.3 times faster than the baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..reporting import pyplot, save_figure

_MIB = 2**20
_PLOTS = (
    ("forward_time.png", "forward_s", "forward time (s)", "forward (no grad)"),
    ("forward_backward_time.png", "forward_backward_s", "forward+backward time (s)", "forward + backward"),
)
_MEMORY_PANELS = (("forward_peak_bytes", "forward (no grad)"), ("forward_backward_peak_bytes", "forward + backward"))


def find_row(rows: Sequence[dict], case: str, length: int) -> dict | None:
    """The row of ``case`` at ``length``, or None."""
    return next((r for r in rows if r["case"] == case and r["length"] == length), None)


def speed_ratio(rows: Sequence[dict], case: str, baseline: str, length: int, key: str) -> float | None:
    """``baseline time / case time`` for ``key`` (``forward_s`` or ``forward_backward_s``)."""
    row, base = find_row(rows, case, length), find_row(rows, baseline, length)
    if row is None or base is None or not row[key] or not base[key]:
        return None
    return base[key] / row[key]


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _mib(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / _MIB:.1f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x" if value < 10 else f"{value:.1f}x"


def _cases_in_order(rows: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(r["case"] for r in rows))


def markdown_table(rows: Sequence[dict], *, baseline: str | None = None) -> str:
    """One line per (case, length): times in ms, peaks in MiB, speed ratios vs ``baseline``."""
    header = ["case", "T", "fwd ms", "fwd+bwd ms", "fwd peak MiB", "fwd+bwd peak MiB"]
    with_ratios = baseline is not None and any(r["case"] == baseline for r in rows)
    if with_ratios:
        header += [f"{baseline}/case fwd", f"{baseline}/case fwd+bwd"]
    header.append("note")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for case in _cases_in_order(rows):
        for row in sorted((r for r in rows if r["case"] == case), key=lambda r: r["length"]):
            cells = [
                case,
                str(row["length"]),
                _ms(row["forward_s"]),
                _ms(row["forward_backward_s"]),
                _mib(row["forward_peak_bytes"]),
                _mib(row["forward_backward_peak_bytes"]),
            ]
            if with_ratios:
                cells += [
                    _ratio(speed_ratio(rows, case, baseline, row["length"], "forward_s")),
                    _ratio(speed_ratio(rows, case, baseline, row["length"], "forward_backward_s")),
                ]
            cells.append(row["skip_reason"] or row["backward_skip_reason"] or "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_PASSES = (("forward_s", "forward"), ("forward_backward_s", "forward+backward"))


def speedup_table(rows: Sequence[dict], baseline: str, *, cases: Sequence[str] | None = None,
                  lengths: Sequence[int] | None = None) -> str:
    """One line per case (its label; ``cases``: these, in this order; default all), a column
    per length of ``lengths`` (default all) and pass (forward, forward+backward; a pass no
    chosen case measured at that length is left out): ``"time ms (ratio)"``, the ratio
    ``baseline time / case time`` (none on the baseline's own line), "—" where not measured."""
    known = _cases_in_order(rows)
    cases = list(cases) if cases else known
    lengths = list(lengths) if lengths else sorted({r["length"] for r in rows})
    for name, values, present in (("cases", cases, known), ("lengths", lengths, sorted({r["length"] for r in rows}))):
        missing = [v for v in values if v not in present]
        if missing:
            raise ValueError(f"{name} {missing} not measured; measured: {present}")
    columns = [(length, key, name) for length in lengths for key, name in _PASSES
               if any((row := find_row(rows, case, length)) and row[key] for case in cases)]
    labels = {r["case"]: r["label"] for r in rows}
    header = ["case", *(f"T={length} {name}" for length, _, name in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for case in cases:
        cells = [labels[case]]
        for length, key, _ in columns:
            row = find_row(rows, case, length)
            if row is None or not row[key]:
                cells.append("—")
                continue
            ratio = speed_ratio(rows, case, baseline, length, key)
            cells.append(f"{_ms(row[key])} ms" + ("" if case == baseline or ratio is None else f" ({_ratio(ratio)})"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


_PROFILES = (("forward_profile", "forward"), ("forward_backward_profile", "forward+backward"))


def profile_markdown(rows: Sequence[dict]) -> str:
    """Where the time goes: per (case, length, pass) the profiled operators with the most
    self time, their share of the call's total, and how often they ran."""
    sections = []
    for case in _cases_in_order(rows):
        for row in sorted((r for r in rows if r["case"] == case), key=lambda r: r["length"]):
            for key, name in _PROFILES:
                profile = row.get(key)
                if not profile:
                    continue
                sections.append(profile_section(f"{case}, T={row['length']}, {name}", profile))
    return "\n".join(sections)


def profile_section(title: str, profile: dict) -> str:
    """One ``harness.profile_call`` result as a Markdown section: ``### title: N ms profiled``
    and a table of its operators (self ms, share of the call's total, calls)."""
    lines = [
        f"### {title}: {_ms(profile['total_ms'] / 1e3)} ms profiled",
        "",
        "| operator | self ms | share | calls |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| `{op['op']}` | {_ms(op['self_ms'] / 1e3)} | {op['share']:.0%} | {op['calls']} |" for op in profile["ops"]
    ]
    return "\n".join(lines) + "\n"


def _series(rows: Sequence[dict], case: str, key: str, x: str) -> tuple[list[int], list[float]]:
    """(x values, values) of ``case`` where ``key`` was measured and is positive (log axes)."""
    points = sorted((r[x], r[key]) for r in rows if r["case"] == case and r[key])
    return [p[0] for p in points], [p[1] for p in points]


def plot_lines(axis, rows: Sequence[dict], key: str, scale: float = 1.0, *, x: str = "length",
               xlabel: str = "sequence length T") -> None:
    """Log-log: ``row[key] * scale`` against ``row[x]``, one line per ``row["case"]`` (labelled
    ``row["label"]``, the same colour for a case in every plot), the x values as ticks."""
    labels = {r["case"]: r["label"] for r in rows}
    for index, case in enumerate(_cases_in_order(rows)):
        xs, values = _series(rows, case, key, x)
        if xs:
            axis.plot(xs, [v * scale for v in values], marker="o", color=f"C{index % 10}", label=labels[case])
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    ticks = sorted({r[x] for r in rows})
    axis.set_xticks(ticks, [str(t) for t in ticks])
    axis.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    axis.set_xlabel(xlabel)
    axis.grid(True, which="both", alpha=0.3)
    if axis.lines:
        axis.legend(fontsize="small")


def write_plots(rows: Sequence[dict], out_dir: Path, *, title: str) -> list[Path]:
    """Log-log forward time, forward+backward time and peak memory against T, one line per case."""
    plt = pyplot()
    out_dir = Path(out_dir)
    paths = []
    for filename, key, ylabel, subtitle in _PLOTS:
        figure, axis = plt.subplots(figsize=(7, 5))
        plot_lines(axis, rows, key)
        axis.set_ylabel(ylabel)
        axis.set_title(f"{title}: {subtitle}")
        paths.append(save_figure(figure, out_dir / filename))
    figure, axes = plt.subplots(1, 2, figsize=(12, 5))
    for axis, (key, subtitle) in zip(axes, _MEMORY_PANELS):
        plot_lines(axis, rows, key, scale=1 / _MIB)
        axis.set_ylabel("peak extra memory (MiB)")
        axis.set_title(f"{title}: peak memory, {subtitle}")
    paths.append(save_figure(figure, out_dir / "peak_memory.png"))
    return paths
