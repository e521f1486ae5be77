"""``linattn repro lm``: byte-level language-model quality per mechanism at an equal budget.

Every mechanism gets the same model width, depth, context, batch, steps, learning-rate
schedule, data order and seed (Shakespeare by default). Transformer-VQ layers are pairs of
gated attention units; their value width is chosen so a pair has about the parameters of
one attention + SwiGLU block (the parameter counts are reported). Measured per mechanism:
validation bpb during training (the loss curves), test bpb with the state reset at every
window and with the state carried across the whole test split (one stream), training
tokens per second, and the peak memory of one training step; each at ``--seeds`` seeds
(default 3), reported as mean ± std (min–max) over them.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from .._checks import int_at_least, non_negative_int, positive_float
from ..data import load_corpus
from ..models import LMConfig, uses_heads
from ..models.config import matched_gau_value_width
from ..reporting import markdown_table_lines, peak_memory, pyplot, save_figure
from ..train import TrainConfig, evaluate_bpb, train
from . import framework, grids, spread
from .framework import Experiment, ExperimentSpec
from .grids import Grid
from .journal import metadata_interim_note, reuse_note

# CLI name -> LMConfig attention spec.
LM_QUALITY_SPECS = {
    "softmax": "softmax",
    "vq": "vq",
    "delta": "delta",
    "linear-elu": "linear:elu",
    "dpfp": "linear:dpfp",
    "favor": "favor",
    "local": "local",
    "vq-paper": "vq",
    "vq-fsq": "vq-fsq",
    "retnet": "retnet",
    "gla": "gla",
    "gated-delta": "gated-delta",
}
# Further LMConfig settings of a row: the official Transformer-VQ's GAU and training.
LM_QUALITY_OPTIONS = {"vq-paper": {"gau_variant": "paper"}}


def model_config(spec: str, args: argparse.Namespace, **options) -> LMConfig:
    """The model of ``spec`` at the size of ``args`` (``--d-model``, ``--n-layers`` and
    ``framework.add_lm_arguments``'s flags but ``--favor-features``), VQ value width matched
    to an attention + SwiGLU block, k-means codebooks; ``options``: further ``LMConfig`` fields."""
    d = args.d_model
    common = dict(d_model=d, n_layers=args.n_layers, n_heads=args.n_heads if uses_heads(spec) else None,
                  local_window=args.window,
                  codebook_size=args.codebook_size, block_size=args.block_size, gau_d_k=args.gau_d_k,
                  kmeans_init=True)
    return LMConfig(attention=spec, gau_d_v=matched_gau_value_width(d, args.gau_d_k), **common, **options)


def _spec_label(name: str) -> str:
    options = "".join(f", {key}={value}" for key, value in LM_QUALITY_OPTIONS.get(name, {}).items())
    return LM_QUALITY_SPECS[name] + options


def _step_memory(model, args: argparse.Namespace) -> int | None:
    ids = torch.randint(0, 256, (args.batch_size, args.context + 1), generator=torch.Generator().manual_seed(0))

    def step():
        logits, _, aux = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) + aux["commit_loss"]
        loss.backward()
        model.zero_grad(set_to_none=True)

    # eval mode: the same computation (and graph) as a training step, but the quantizers
    # gather no codebook statistics from this probe
    was_training = model.training
    model.eval()
    try:
        return peak_memory(step, "cpu")
    finally:
        model.train(was_training)


def train_model(config: LMConfig, args: argparse.Namespace, run_dir: Path) -> tuple[dict, TrainConfig, dict]:
    """Train ``config`` with the experiment's budget, the same for every model: ``args.data``,
    ``steps``, ``batch_size``, ``context``, ``lr`` (10% warm-up, cosine), ``eval_every``,
    ``eval_tokens``, ``seed``, ``cache_dir``; in ``run_dir``, emptied first.

    Returns the trainer's summary (``model``, ``final_bpb``, ``elapsed``, ...), the
    ``TrainConfig`` and the curves: ``loss_curve`` [(step, loss in nats)],
    ``validation_curve`` [(step, bpb)], ``train_tokens_per_second`` (the mean over the
    logged intervals but the first; None when there is only one).
    """
    train_config = TrainConfig(
        data=args.data, out=str(run_dir), steps=args.steps, batch_size=args.batch_size, context=args.context,
        lr=args.lr, warmup_steps=max(1, args.steps // 10), eval_every=args.eval_every, eval_tokens=args.eval_tokens,
        eval_batch_size=1,
        checkpoint_every=0, log_every=max(1, args.steps // 50), seed=args.seed, cache_dir=args.cache_dir,
    )
    if run_dir.exists():  # a fresh run each time
        shutil.rmtree(run_dir)
    summary = train(config, train_config, progress=False, echo=lambda *a: None)
    if summary["interrupted"]:
        raise KeyboardInterrupt(f"stopped by {summary['interrupted']}")
    return summary, train_config, run_curves(run_dir)


def run_curves(run_dir: Path) -> dict:
    """A finished run's curves from its ``metrics.jsonl``: ``loss_curve`` [(step, loss in
    nats)], ``validation_curve`` [(step, bpb)], ``train_tokens_per_second`` (the mean over the
    logged intervals but the first; None when there is only one)."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_second"] for r in records if "tokens_per_second" in r][1:]
    return {"loss_curve": [(r["step"], r["loss"]) for r in records if "loss" in r],
            "validation_curve": [(r["step"], r["bpb"]) for r in records if r.get("split") == "validation"],
            "train_tokens_per_second": sum(speeds) / len(speeds) if speeds else None}


def run_mechanism(name: str, args: argparse.Namespace, run_dir: Path, test_tokens: torch.Tensor) -> dict:
    """Train the mechanism ``name`` at ``args`` (its seed among them) in ``run_dir`` and
    evaluate it: one run's row."""
    config = model_config(LM_QUALITY_SPECS[name], args, favor_features=args.favor_features,
                          **LM_QUALITY_OPTIONS.get(name, {}))
    summary, train_config, curves = train_model(config, args, run_dir)
    model = summary["model"]
    evaluate = dict(context=args.context, max_tokens=args.test_tokens)
    reset = evaluate_bpb(model, test_tokens, batch_size=1, carry_state=False, **evaluate)
    schedule = evaluate_bpb(model, test_tokens, batch_size=1, reset_every=train_config.carry_windows, **evaluate)
    carried = evaluate_bpb(model, test_tokens, batch_size=1, carry_state=True, **evaluate)
    return {
        "mechanism": name, "spec": _spec_label(name), "parameters": model.num_parameters(),
        "validation_bpb": summary["final_bpb"], "test_bpb_reset": reset["bpb"],
        "test_bpb_schedule": schedule["bpb"], "test_bpb_carried": carried["bpb"],
        "carry_windows": train_config.carry_windows,
        "test_tokens": carried["tokens"], "train_tokens_per_second": curves["train_tokens_per_second"],
        "step_peak_bytes": _step_memory(model, args), "train_seconds": summary["elapsed"],
        "loss_curve": curves["loss_curve"], "validation_curve": curves["validation_curve"],
        "codebook_usage": model.codebook_usage(), "test_code_perplexity": _code_perplexity(model, test_tokens, args),
    }


def _code_perplexity(model, tokens: torch.Tensor, args: argparse.Namespace) -> float | None:
    """Code use of the quantized layers (vq, vq-fsq) on the first test window: ``exp`` of the
    entropy of their code histogram, averaged over units (None without such layers)."""
    with torch.no_grad():
        _, _, aux = model.eval()(tokens[: args.context].long().unsqueeze(0))
    perplexity = aux.get("codebook_perplexity")
    return None if perplexity is None else float(perplexity)


def markdown(rows: list[dict], runs: list[dict], metadata: dict, note: str = "") -> str:
    """The results table (``rows``: aggregated over the seeds; ``runs``: per seed), the
    differences of validation bpb; ``note`` (an interim report's sentence) replaces the clause
    on reused runs."""
    first = runs[0]
    stats = spread.format_stats
    lines = [
        "# Byte-level LM quality per mechanism (equal budget)", "",
        f"Command: `{metadata['command']}`  ", f"Date: {metadata['date']}; device: {metadata['device_name']}, "
        f"{metadata['threads']} threads; torch {metadata['torch_version']}.", "",
        spread.seeds_text(rows), "",
        *markdown_table_lines(
            ["mechanism", "spec", "parameters", "n", "validation bpb", "test bpb, state reset every window",
             f"test bpb, state carried {first['carry_windows']} windows (as trained)",
             "test bpb, state carried across the whole stream", "train tokens/s (mean)", "step peak memory (mean)"],
            [[r["mechanism"], f"`{r['spec']}`", f"{r['parameters']:,}", str(r["n"]),
              *(stats(spread.stats_of(r, key)) for key in ("validation_bpb", "test_bpb_reset", "test_bpb_schedule",
                                                           "test_bpb_carried")),
              spread.format_mean(spread.stats_of(r, "train_tokens_per_second"), ",.0f"),
              _mebibytes(spread.mean_of(r, "step_peak_bytes"))] for r in rows]),
    ]
    lines += ["", "Test bpb is measured on the first "
              f"{first['test_tokens']:,} bytes of the test split read as one stream in windows of the training "
              "context. Training carries each window's recurrent state (detached) to the next for "
              f"{first['carry_windows']} windows, then resets it; the three columns reset it every window, on that "
              "schedule, or never. Exact softmax keeps no memory across windows (`softmax_memory = 0`), so its "
              "columns agree. Validation bpb: the first `--eval-tokens` validation bytes, one stream, "
              "training schedule.", ""]
    lines += spread.differences_lines([("Validation bpb (lower is better):", spread.difference_matrix(
        rows, lambda r: spread.stats_of(r, "validation_bpb"), lambda r: r["mechanism"]))])
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


def _mebibytes(value: float | None) -> str:
    return "—" if not value else f"{value / 2**20:,.0f} MiB"


def write_plot(rows: list[dict], runs: list[dict], path: Path) -> Path:
    """Training loss (bits per byte) and validation bpb against the step, one line per
    mechanism: the mean over the seeds with its min–max band."""
    figure, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4))
    for index, r in enumerate(rows):
        mine = [run for run in runs if run["mechanism"] == r["mechanism"]]
        color = f"C{index % 10}"
        spread.plot_band(left, [run["loss_curve"] for run in mine], scale=1 / math.log(2), color=color,
                         label=r["mechanism"])
        if all(run["validation_curve"] for run in mine):
            spread.plot_band(right, [run["validation_curve"] for run in mine], color=color, marker="o",
                             label=r["mechanism"])
    left.set(xlabel="step", ylabel="training loss (bits per byte)", title="training loss")
    right.set(xlabel="step", ylabel="validation bpb", title="validation")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    if any(r["n"] > 1 for r in rows):
        figure.suptitle("mean over the seeds, band: min–max")
    return save_figure(figure, path)


SPEC = ExperimentSpec(
    name="lm",
    help="byte-level LM quality per mechanism at equal budget (bpb, tokens/s, memory)",
    description=__doc__.split("\n\n", 1)[1],
    grid_axes=("mechanisms",),
    row="mechanism",
    quick_help="a few minutes: 60 steps, 8k-byte evaluations, one seed",
    threads_help="torch CPU threads (default: torch's choice)",
)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    positive = int_at_least(1, "a positive integer")
    parser.add_argument("--mechanisms", nargs="+", choices=list(LM_QUALITY_SPECS), default=list(LM_QUALITY_SPECS))
    parser.add_argument("--data", default="shakespeare")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--steps", type=positive, default=300)
    parser.add_argument("--batch-size", type=positive, default=8)
    parser.add_argument("--context", type=positive, default=256)
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--d-model", type=positive, default=128)
    parser.add_argument("--n-layers", type=positive, default=2)
    framework.add_lm_arguments(parser, n_heads=4, window=64, favor_features=64, codebook_size=64, block_size=64,
                               gau_d_k=64)
    parser.add_argument("--eval-every", type=positive, default=100)
    parser.add_argument("--eval-tokens", type=positive, default=32768, help="validation bytes per evaluation")
    parser.add_argument("--test-tokens", type=non_negative_int, default=131072,
                        help="test bytes evaluated as one stream (default 131072; 0 = the whole split)")


# What a finished mechanism's row depends on (the journal key besides its name).
_RUN_SETTINGS = ("data", "steps", "batch_size", "context", "lr", "d_model", "n_layers", "n_heads", "window",
                 "favor_features", "codebook_size", "block_size", "gau_d_k", "eval_every", "eval_tokens",
                 "test_tokens", "seed")


def _run_key(run: tuple) -> dict:
    name, args, _, _ = run
    return {"mechanism": name, "settings": {key: getattr(args, key) for key in _RUN_SETTINGS}}


def _seed_of(run: tuple) -> int:
    return run[1].seed


def _describe(row: dict) -> str:
    return f"{row['mechanism']} val {row['validation_bpb']:.3f} bpb"


def _run(args: argparse.Namespace) -> int:
    if args.quick:
        args.steps, args.eval_every, args.eval_tokens, args.test_tokens = 60, 30, 8192, 16384
    if args.test_tokens == 0:
        args.test_tokens = None
    options = framework.run_options(args, SPEC)
    for name in ("steps", "batch_size", "context", "d_model", "n_layers", "n_heads", "window", "favor_features",
                 "codebook_size", "block_size", "gau_d_k"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out_dir, command, seeds = options.pop("out_dir"), options.pop("command"), options.pop("seeds")
    test_tokens = None if args.report_only else load_corpus(args.data, cache_dir=args.cache_dir).tokens("test")
    metadata = framework.experiment_metadata(device="cpu", command=command, shapes={
        "d_model": args.d_model, "n_layers": args.n_layers, "context": args.context,
        "batch_size": args.batch_size, "steps": args.steps, "data": args.data}, seeds=seeds)
    runs = [(name, framework.with_seed(args, seed), framework.run_folder(out_dir, name, seed), test_tokens)
            for seed in seeds for name in args.mechanisms]
    grid = Grid(train=run_mechanism, runs=runs, run_key=_run_key, seed_of=_seed_of, describe=_describe,
                label="repro lm", unit="run")
    outcome = grids.run_journaled(grid, out_dir, spec=SPEC, **options)
    metadata.update(seconds=outcome.seconds, reused_runs=outcome.reused, grid_runs=outcome.total,
                    report_only=args.report_only)
    rows = spread.aggregate(outcome.rows, identity=("mechanism",),
                            constants=("parameters", "carry_windows", "test_tokens"))
    text = page({"metadata": metadata, "rows": rows, "runs": outcome.rows})
    files = framework.write_results(out_dir, rows=rows, runs=outcome.rows, metadata=metadata, markdown=text,
                                    plot=partial(write_plot, rows, outcome.rows), plot_name="loss_curves.png")
    return framework.print_result({"markdown": text, "files": files})


command = Experiment(SPEC, add_arguments=_add_arguments, run=_run, page=page)
