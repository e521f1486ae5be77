"""``linattn repro demo``: the model ``make demo`` trains, at several seeds.

Each seed's run is ``linattn train --config configs/demo.toml`` (the run file ``make demo``
trains; ``--config`` names another) with ``train.seed`` set to the seed and its own run
folder (``--out``/runs/seed-S/demo); nothing else changes. Reported: the final validation
bpb of every seed and its mean, sample standard deviation and min–max over the seeds, the
bpb before training, and the training loss and validation curves (mean with a min–max band).
"""

from __future__ import annotations

import argparse
import math
import shutil
from functools import partial
from pathlib import Path

from ..reporting import markdown_table_lines, pyplot, save_figure
from ..train import TrainConfig, train
from ..train.cli import _vocab_from_data
from ..train.config import build_configs, load_run_file
from . import framework, grids, spread
from .framework import Experiment, ExperimentSpec
from .grids import Grid
from .journal import metadata_interim_note, reuse_note
from .lm_quality import run_curves

DEFAULT_CONFIG = Path("configs/demo.toml")


def run_file_values(path: Path, seed: int) -> tuple[dict, dict]:
    """``(model values, train values)`` of the run file ``path`` as ``linattn train --config``
    reads them (the vocabulary follows a shard folder's tokenizer), ``train.seed`` = ``seed``;
    checked by building the configs (a ValueError naming the bad key)."""
    model_values, train_values = load_run_file(path)
    train_values["seed"] = seed
    data = train_values.get("data", TrainConfig.data)
    if isinstance(data, str) and data.strip():
        _vocab_from_data(model_values, data)
    build_configs(model_values, train_values)
    return model_values, train_values


def train_seed(model_values: dict, train_values: dict, run_dir: Path) -> dict:
    """One seed's run: ``linattn train`` on the values in ``run_dir`` (emptied first); its row."""
    if run_dir.exists():  # a fresh run each time
        shutil.rmtree(run_dir)
    model_config, train_config = build_configs(dict(model_values), dict(train_values))
    summary = train(model_config, train_config, out=run_dir, progress=False, echo=lambda *a: None)
    if summary["interrupted"]:
        raise KeyboardInterrupt(f"stopped by {summary['interrupted']}")
    curves = run_curves(run_dir)
    return {"run": "demo", "validation_bpb": summary["final_bpb"], "validation_bpb_step": summary["final_bpb_step"],
            "initial_bpb": summary["initial_bpb"], "steps": summary["step"],
            "parameters": summary["model"].num_parameters(),
            "train_seconds": summary["elapsed"], "train_tokens_per_second": curves["train_tokens_per_second"],
            "loss_curve": curves["loss_curve"], "validation_curve": curves["validation_curve"]}


def markdown(rows: list[dict], runs: list[dict], metadata: dict, note: str = "") -> str:
    """Final validation bpb per seed and its spread over the seeds."""
    lines = [
        "# make demo at several seeds", "",
        f"Command: `{metadata['command']}`  ", f"Date: {metadata['date']}; device: {metadata['device_name']}, "
        f"{metadata['threads']} threads; torch {metadata['torch_version']}.", "",
        f"Run file `{metadata['config']}`" + (" (what `make demo` trains)" if Path(metadata["config"]) == DEFAULT_CONFIG
                                             else "") + f" with `train.seed` set per seed; "
        f"{spread.seeds_text(rows, cells=False)}", "",
        *markdown_table_lines(
            ["seed", "final validation bpb", "at step", "bpb before training", "train seconds"],
            [[str(r["seed"]), _number(r["validation_bpb"]), str(r["validation_bpb_step"]), _number(r["initial_bpb"]),
              f"{r['train_seconds']:.0f}"] for r in runs]), "",
        "Final validation bpb over the seeds:", "",
        *markdown_table_lines(["n", "mean", "std", "min–max"], [_spread(r) for r in rows]), "",
        "Validation bpb: the run file's `eval_tokens` validation bytes at its last evaluation (the step shown). "
        f"{spread.RESOLVED_RULE} A difference between two demo configurations is real by that rule when their "
        "ranges here do not overlap.",
    ]
    if note:
        lines += ["", note]
    elif metadata.get("reused_runs"):
        lines += ["", reuse_note(metadata["reused_runs"], len(runs)) + "."]
    return "\n".join(lines) + "\n"


def page(results: dict) -> str:
    """The page of ``results.json``'s contents: :func:`markdown` of its rows, runs and metadata."""
    metadata = results["metadata"]
    return markdown(results["rows"], results["runs"], metadata,
                    note=metadata_interim_note(metadata, len(results["runs"])))


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _spread(row: dict) -> list[str]:
    stats = spread.stats_of(row, "validation_bpb")
    if stats is None:
        return [str(row["n"]), "—", "—", "—"]
    std = "—" if stats["std"] is None else f"{stats['std']:.3f}"
    return [str(stats["n"]), f"{stats['mean']:.3f}", std, f"{stats['min']:.3f}–{stats['max']:.3f}"]


def write_plot(runs: list[dict], path: Path) -> Path:
    """Training loss (bits per byte) and validation bpb against the step: the mean over the
    seeds with its min–max band."""
    figure, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4))
    spread.plot_band(left, [run["loss_curve"] for run in runs], scale=1 / math.log(2), color="C0")
    if all(run["validation_curve"] for run in runs):
        spread.plot_band(right, [run["validation_curve"] for run in runs], color="C0", marker="o")
    left.set(xlabel="step", ylabel="training loss (bits per byte)", title="training loss")
    right.set(xlabel="step", ylabel="validation bpb", title="validation")
    for axis in (left, right):
        axis.grid(alpha=0.3)
    figure.suptitle(f"make demo, {len(runs)} seed(s): mean, band min–max")
    return save_figure(figure, path)


SPEC = ExperimentSpec(
    name="demo",
    help="the make demo model at several seeds: final validation bpb per seed, mean, std, min–max",
    description=__doc__.split("\n\n", 1)[1],
    grid_axes=("seeds",),
    row="run",
    quick_help="one seed (the make demo run itself), unless --seeds is given",
    seed_help="train.seed of the first run (default %(default)s)",
    threads_help="torch CPU threads per run (default: torch's choice)",
)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, metavar="FILE.toml",
                        help="the run file (default %(default)s, what make demo trains; relative to the working "
                             "directory)")


def _run_key(run: tuple) -> dict:
    model_values, train_values, _ = run
    return {"model": model_values, "train": train_values}


def _seed_of(run: tuple) -> int:
    return run[1]["seed"]


def _describe(row: dict) -> str:
    return f"val {row['validation_bpb']:.3f} bpb"


def _run(args: argparse.Namespace) -> int:
    options = framework.run_options(args, SPEC)
    out_dir, command, seeds = options.pop("out_dir"), options.pop("command"), options.pop("seeds")
    runs = [(*run_file_values(args.config, seed), framework.run_folder(out_dir, "demo", seed)) for seed in seeds]
    metadata = framework.experiment_metadata(device="cpu", command=command, shapes=runs[0][0], seeds=seeds,
                                             config=str(args.config),
                                             run_file={"model": runs[0][0], "train": runs[0][1]})
    grid = Grid(train=train_seed, runs=runs, run_key=_run_key, seed_of=_seed_of, describe=_describe,
                label="repro demo", unit="run")
    outcome = grids.run_journaled(grid, out_dir, spec=SPEC, **options)
    metadata.update(seconds=outcome.seconds, reused_runs=outcome.reused, grid_runs=outcome.total,
                    report_only=args.report_only)
    rows = spread.aggregate(outcome.rows, identity=("run",), constants=("parameters",))
    text = page({"metadata": metadata, "rows": rows, "runs": outcome.rows})
    files = framework.write_results(out_dir, rows=rows, runs=outcome.rows, metadata=metadata, markdown=text,
                                    plot=partial(write_plot, outcome.rows), plot_name="validation_bpb.png")
    return framework.print_result({"markdown": text, "files": files})


command = Experiment(SPEC, add_arguments=_add_arguments, run=_run, page=page)
