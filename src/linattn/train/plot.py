"""``linattn plot``: the training loss and validation bits per byte of one or more runs,
read from each run's ``metrics.jsonl``, drawn side by side into one PNG.

Left: the training loss (cross-entropy in nats per token, the ``loss`` of each logged
step) against the step. Right: the validation ``bpb`` (bits per byte, also for token
shards) against the step. One line per run in both, labelled with the run folder's name
(its path when two names are equal).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..reporting import pyplot, save_figure
from .metrics import read_metrics
from .run_folder import METRICS_FILE


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


@dataclass
class RunCurves:
    """The curves of one run: ``train_steps``/``train_loss`` and
    ``validation_steps``/``validation_bpb``."""

    label: str
    train_steps: list[int]
    train_loss: list[float]
    validation_steps: list[int]
    validation_bpb: list[float]


def read_curves(run_dir: str | Path, label: str | None = None, *,
                echo: Callable[[str], None] = _to_stderr) -> RunCurves:
    """The curves in ``run_dir/metrics.jsonl``: a ``ValueError`` names a missing file, or a line
    that is not a record (``metrics.read_metrics``; ``echo`` notes a last line cut short)."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"run: {run_dir} has no metrics.jsonl; expected a folder written by linattn train --out")
    curves = RunCurves(label or run_dir.name, [], [], [], [])
    for _, record in read_metrics(path, echo=echo):
        if record.get("split") == "validation":
            curves.validation_steps.append(record["step"])
            curves.validation_bpb.append(record["bpb"])
        elif "loss" in record:
            curves.train_steps.append(record["step"])
            curves.train_loss.append(record["loss"])
    if not curves.train_steps and not curves.validation_steps:
        raise ValueError(f"run: {path} holds no training or validation records")
    return curves


def plot_runs(run_dirs: list[str | Path], out: str | Path):
    """Draw the runs' curves into the PNG ``out``; returns the (closed) matplotlib figure,
    whose two axes hold one line per run in the order given."""
    if not run_dirs:
        raise ValueError("runs: expected at least one run folder")
    names = [Path(run).name for run in run_dirs]
    curves = [read_curves(run, label=str(run) if names.count(Path(run).name) > 1 else None) for run in run_dirs]
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ValueError(f"--out {out}: expected a .png file name")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure, (loss_axis, bpb_axis) = pyplot().subplots(1, 2, figsize=(11, 4))
    for run in curves:
        loss_axis.plot(run.train_steps, run.train_loss, label=run.label)
        bpb_axis.plot(run.validation_steps, run.validation_bpb, marker="o", markersize=3, label=run.label)
    loss_axis.set(xlabel="step", ylabel="loss (nats per token)", title="training loss")
    bpb_axis.set(xlabel="step", ylabel="bits per byte", title="validation bpb")
    for axis in (loss_axis, bpb_axis):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    save_figure(figure, out)
    return figure
