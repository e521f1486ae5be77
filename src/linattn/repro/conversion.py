"""``linattn repro convert``: does converting a trained softmax model to Transformer-VQ beat
training Transformer-VQ from scratch?

A ``gau-softmax`` LM (the GAU's exact twin) is trained for ``--steps`` steps; for every
codebook size S of ``--sizes`` it is converted (``linattn convert``: same weights, codebooks
by k-means on ``--calibration-tokens`` training tokens) and evaluated at once, then fine-tuned
for ``--finetune-fraction`` more steps (a fresh optimizer, the source's schedule continued at
its floor learning rate) and evaluated again; a ``vq`` model of the same shape is trained from
scratch for the same total number of steps. Every model: the same data order, seed and
evaluation (test bpb on the first ``--test-tokens`` bytes as one stream, the state carried as
in training; validation bpb on ``--eval-tokens``). All of it is repeated at every seed
(``--seeds``, default 3): each seed trains its own source, conversions and scratch model.
"""

from __future__ import annotations

import argparse
import shutil
from functools import partial
from pathlib import Path

from .._checks import int_at_least, positive_float
from ..convert import convert_run
from ..data import open_data
from ..models import LMConfig
from ..models.config import matched_gau_value_width
from ..reporting import markdown_table_lines, pyplot, save_figure
from ..train import TrainConfig, evaluate_bpb, load_model, train
from . import framework, grids, spread
from .framework import Experiment, ExperimentSpec
from .grids import Grid
from .journal import metadata_interim_note, reuse_note


def _config(attention: str, args: argparse.Namespace) -> LMConfig:
    return LMConfig(attention=attention, d_model=args.d_model, n_layers=args.n_layers, gau_d_k=args.gau_d_k,
                    gau_d_v=matched_gau_value_width(args.d_model, args.gau_d_k), block_size=args.block_size,
                    codebook_size=args.codebook_size, kmeans_init=True)


def _train_config(args: argparse.Namespace, out: Path, steps: int) -> TrainConfig:
    return TrainConfig(data=args.data, out=str(out), steps=steps, decay_steps=args.steps, batch_size=args.batch_size,
                       context=args.context, lr=args.lr, warmup_steps=max(1, args.steps // 10),
                       eval_every=0, eval_tokens=args.eval_tokens, eval_batch_size=1, checkpoint_every=steps,
                       log_every=max(1, steps // 50), seed=args.seed, cache_dir=args.cache_dir)


def _finetune_steps(args: argparse.Namespace) -> int:
    return args.steps + max(1, round(args.steps * args.finetune_fraction))


def _scores(run_dir: Path, args: argparse.Namespace, data) -> dict:
    model, checkpoint = load_model(run_dir)
    common = dict(context=args.context, batch_size=1)
    test = evaluate_bpb(model, data.tokens("test"), max_tokens=args.test_tokens, reset_every=8, **common)
    validation = evaluate_bpb(model, data.tokens("validation"), max_tokens=args.eval_tokens, reset_every=8, **common)
    return {"step": checkpoint.step, "test_bpb": test["bpb"], "validation_bpb": validation["bpb"],
            "parameters": model.num_parameters()}


def _source(args: argparse.Namespace, out_dir: Path) -> Path:
    """The trained gau-softmax run of ``args.seed`` (trained here the first time it is needed)."""
    run_dir = framework.run_folder(out_dir, "gau-softmax", args.seed)
    if not (run_dir / "checkpoints" / "latest").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        summary = train(_config("gau-softmax", args), _train_config(args, run_dir, args.steps), progress=False,
                        echo=lambda *a: None)
        if summary["interrupted"]:
            raise KeyboardInterrupt(f"stopped by {summary['interrupted']}")
    return run_dir


def run_case(case: str, size: int | None, args: argparse.Namespace, out_dir: Path) -> dict:
    """One row at ``args.seed``: ``"softmax"`` (the source), ``"converted"`` (codebook ``size``) or
    ``"scratch"``; the runs in ``out_dir/runs/seed-<seed>/``."""
    data = open_data(args.data, cache_dir=args.cache_dir)
    if case == "softmax":
        return {"case": case, "codebook_size": None, **_scores(_source(args, out_dir), args, data)}
    if case == "scratch":
        run_dir = framework.run_folder(out_dir, "vq-scratch", args.seed)
        shutil.rmtree(run_dir, ignore_errors=True)
        config = _config("vq", args)
        summary = train(config, _train_config(args, run_dir, _finetune_steps(args)), progress=False,
                        echo=lambda *a: None)
        if summary["interrupted"]:
            raise KeyboardInterrupt(f"stopped by {summary['interrupted']}")
        return {"case": case, "codebook_size": args.codebook_size, **_scores(run_dir, args, data)}
    run_dir = framework.run_folder(out_dir, f"converted-{size}", args.seed)
    shutil.rmtree(run_dir, ignore_errors=True)
    convert_run(_source(args, out_dir), run_dir, to="vq", codebook_size=size,
                calibration_tokens=args.calibration_tokens, seed=args.seed, echo=lambda *a: None)
    before = _scores(run_dir, args, data)
    summary = train(None, None, resume=True, out=run_dir, steps=_finetune_steps(args), progress=False,
                    echo=lambda *a: None)
    if summary["interrupted"]:
        raise KeyboardInterrupt(f"stopped by {summary['interrupted']}")
    after = _scores(run_dir, args, data)
    return {"case": case, "codebook_size": size, "parameters": after["parameters"], "step": after["step"],
            "test_bpb_converted": before["test_bpb"], "validation_bpb_converted": before["validation_bpb"],
            "test_bpb": after["test_bpb"], "validation_bpb": after["validation_bpb"]}


# A row of the report: one case (and codebook size) over its seeds; what describes it rather than results.
ROW_IDENTITY = ("case", "codebook_size")
ROW_CONSTANTS = ("parameters", "step")


def _model_name(row: dict) -> str:
    names = {"softmax": "gau-softmax (source)", "scratch": f"vq from scratch (S = {row['codebook_size']})"}
    return names.get(row["case"], f"converted, S = {row['codebook_size']}")


def _short_name(row: dict) -> str:
    return {"softmax": "source", "scratch": "scratch"}.get(row["case"], f"S = {row['codebook_size']}")


def _right_after_conversion(row: dict) -> dict | None:
    """Test bpb before any fine-tuning: the source's own, a conversion's right after it."""
    if row["case"] == "scratch":
        return None
    return spread.stats_of(row, "test_bpb" if row["case"] == "softmax" else "test_bpb_converted")


def markdown(rows: list[dict], metadata: dict, *, runs: int, note: str = "") -> str:
    """The table over the seeds and the differences of test bpb (after fine-tuning, and right
    after conversion against the source); ``runs``: the number of per-seed runs."""
    stats = spread.format_stats
    cells = [[_model_name(r), f"{r['parameters']:,}", str(r["step"]), str(r["n"]),
              stats(spread.stats_of(r, "test_bpb_converted")), stats(spread.stats_of(r, "test_bpb")),
              stats(spread.stats_of(r, "validation_bpb"))] for r in rows]
    lines = ["# Softmax to Transformer-VQ: conversion against training from scratch", "",
             f"Command: `{metadata['command']}`  ",
             f"Date: {metadata['date']}; device: {metadata['device_name']}, {metadata['threads']} threads; "
             f"torch {metadata['torch_version']}.", "",
             spread.seeds_text(rows), "",
             *markdown_table_lines(["model", "parameters", "steps", "n", "test bpb right after conversion",
                                    "test bpb (after fine-tuning)", "validation bpb"], cells), "",
             "Test bpb: the first test bytes as one stream, the state carried as in training (reset every 8 "
             "windows). The converted models fine-tune from the source's last step with a fresh optimizer; the "
             "from-scratch VQ model trains for the same total steps. Each seed has its own source.", "",
             *spread.differences_lines([
                 ("Test bpb after fine-tuning (the source: as trained; lower is better):",
                  spread.difference_matrix(rows, lambda r: spread.stats_of(r, "test_bpb"), _short_name)),
                 ("Test bpb right after conversion, before fine-tuning, against the source (lower is better):",
                  spread.difference_matrix(rows, _right_after_conversion, _short_name)),
             ])]
    if note:
        lines += ["", note]
    elif metadata.get("reused_runs"):
        lines += ["", reuse_note(metadata["reused_runs"], runs) + "."]
    return "\n".join(lines) + "\n"


def page(results: dict) -> str:
    """The page of ``results.json``'s contents: :func:`markdown` of its rows and metadata."""
    metadata, runs = results["metadata"], len(results["runs"])
    return markdown(results["rows"], metadata, runs=runs, note=metadata_interim_note(metadata, runs))


def write_plot(rows: list[dict], path: Path) -> Path:
    """Test bpb against the codebook size (mean over the seeds, min–max error bars); the source
    and the scratch model as horizontal lines (mean) with their min–max bands."""
    figure, axis = pyplot().subplots(figsize=(6.5, 4))
    converted = sorted((r for r in rows if r["case"] == "converted"), key=lambda r: r["codebook_size"])
    if converted:
        sizes = [r["codebook_size"] for r in converted]
        spread.plot_spread(axis, sizes, [spread.stats_of(r, "test_bpb_converted") for r in converted],
                           marker="o", label="converted")
        spread.plot_spread(axis, sizes, [spread.stats_of(r, "test_bpb") for r in converted], marker="o",
                           label="converted + fine-tuned")
    for r in rows:
        bpb = spread.stats_of(r, "test_bpb")
        if r["case"] != "converted" and bpb is not None:
            color = "gray" if r["case"] == "softmax" else "black"
            axis.axhline(bpb["mean"], linestyle="--", color=color, label=_model_name(r))
            if r["n"] > 1:
                axis.axhspan(bpb["min"], bpb["max"], color=color, alpha=0.15, linewidth=0)
    several = any(r["n"] > 1 for r in rows)
    axis.set(xscale="log", xlabel="codebook size S", ylabel="test bpb",
             title="softmax -> Transformer-VQ" + (" (mean, min–max over the seeds)" if several else ""))
    axis.grid(alpha=0.3)
    axis.legend()
    return save_figure(figure, path)


SPEC = ExperimentSpec(
    name="convert",
    help="convert a trained gau-softmax LM to Transformer-VQ vs train VQ from scratch (bpb per codebook size)",
    description=__doc__.split("\n\n", 1)[1],
    grid_axes=("cases",),
    quick_help="a few minutes: 40 steps, small codebooks, one seed",
    row="model",
    threads_help="torch CPU threads (default: torch's choice)",
)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    positive = int_at_least(1, "a positive integer")
    parser.add_argument("--data", default="shakespeare")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--steps", type=positive, default=600, help="training steps of the softmax source")
    parser.add_argument("--sizes", type=positive, nargs="+", default=[64, 256, 1024], help="codebook sizes S")
    parser.add_argument("--finetune-fraction", type=positive_float, default=0.1)
    parser.add_argument("--calibration-tokens", type=positive, default=65536)
    parser.add_argument("--batch-size", type=positive, default=8)
    parser.add_argument("--context", type=positive, default=256)
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--d-model", type=positive, default=128)
    parser.add_argument("--n-layers", type=positive, default=2)
    parser.add_argument("--gau-d-k", type=positive, default=64)
    parser.add_argument("--block-size", type=positive, default=64)
    parser.add_argument("--codebook-size", type=positive, default=256, help="S of the from-scratch VQ model")
    parser.add_argument("--eval-tokens", type=positive, default=32768)
    parser.add_argument("--test-tokens", type=positive, default=131072)


_SETTINGS = ("data", "steps", "finetune_fraction", "calibration_tokens", "batch_size", "context", "lr", "d_model",
             "n_layers", "gau_d_k", "block_size", "codebook_size", "eval_tokens", "test_tokens", "seed")


def _run(args: argparse.Namespace) -> int:
    if args.quick:
        args.steps, args.sizes, args.calibration_tokens = 40, [8, 32], 4096
        args.eval_tokens, args.test_tokens, args.codebook_size = 4096, 8192, 32
    if args.jobs != 1:
        raise ValueError("--jobs must be 1: the conversions read the source run the first of them trains")
    options = framework.run_options(args, SPEC)
    out_dir, command, seeds = options.pop("out_dir"), options.pop("command"), options.pop("seeds")
    metadata = framework.experiment_metadata(device="cpu", command=command, shapes={
        "d_model": args.d_model, "n_layers": args.n_layers, "context": args.context, "steps": args.steps},
        seeds=seeds)
    runs = []
    for seed in seeds:  # a seed's source is trained by its first case, before its conversions
        seeded = framework.with_seed(args, seed)
        runs += [("softmax", None, seeded, out_dir), *(("converted", size, seeded, out_dir) for size in args.sizes),
                 ("scratch", None, seeded, out_dir)]
    grid = Grid(train=run_case, runs=runs,
                run_key=lambda run: {"case": run[0], "size": run[1],
                                     "settings": {key: getattr(run[2], key) for key in _SETTINGS}},
                seed_of=lambda run: run[2].seed,
                describe=lambda row: f"{row['case']} {row['test_bpb']:.3f} bpb", label="repro convert", unit="case")
    outcome = grids.run_journaled(grid, out_dir, spec=SPEC, **options)
    metadata.update(seconds=outcome.seconds, reused_runs=outcome.reused, grid_runs=outcome.total,
                    report_only=args.report_only)
    rows = spread.aggregate(outcome.rows, identity=ROW_IDENTITY, constants=ROW_CONSTANTS)
    text = page({"metadata": metadata, "rows": rows, "runs": outcome.rows})
    files = framework.write_results(out_dir, rows=rows, runs=outcome.rows, metadata=metadata, markdown=text,
                                    plot=partial(write_plot, rows), plot_name="conversion.png")
    return framework.print_result({"markdown": text, "files": files})


command = Experiment(SPEC, add_arguments=_add_arguments, run=_run, page=page)
