"""``linattn repro length-extrapolation``: train at one context, read longer ones (seed 003).

Every variant is trained as ``linattn repro lm`` trains a mechanism, with the same budget
(width, depth, steps, batch, learning rate, data order, seed; Shakespeare by default) at the
training context (default 256). Then test bpb is measured at every evaluation context C
(default 256, 512, 1024, 2048, 4096; the training context is always among them): the test
split is read as one stream in windows of C with the state reset at every window, so the
byte at position i of a window is predicted from the i bytes before it and the context
really is C long. The recurrent variants (a state of constant size) are also read with the
state carried across the whole stream.

Variants: exact softmax with rotary positions (``softmax``), the same with the
entropy-invariant scale ``log_512(n)/sqrt(d)`` (``softmax:entropy``), without positions and
with that scale (``softmax:nope:entropy``), the window + global hybrid (rotary local layers of
window ``--window``, then a global NoPE layer with the entropy scale:
``local:W,...,local:W,softmax:nope:entropy`` over the layers), sliding-window attention
(``local``, window ``--window``), Transformer-VQ, the delta rule and linear attention (elu+1).

A variant extrapolates when its bpb at every evaluation context longer than the training one
is at most ``--tolerance`` above its bpb at the training context.
"""

from __future__ import annotations

import argparse
import math
from functools import partial
from pathlib import Path

import torch

from .._checks import int_at_least, non_negative_int, positive_float
from ..data import load_corpus
from ..reporting import markdown_table_lines, pyplot, save_figure
from ..train import evaluate_bpb
from . import framework
from .framework import Experiment, ExperimentSpec, Grid, reuse_note
from .lm_quality import model_config, train_model

# CLI name -> LMConfig attention spec; the hybrid's is built from --n-layers and --window.
VARIANTS = {
    "softmax": "softmax",
    "softmax-entropy": "softmax:entropy",
    "softmax-nope-entropy": "softmax:nope:entropy",
    "hybrid": None,
    "local": "local",
    "vq": "vq",
    "delta": "delta",
    "linear-elu": "linear:elu",
}
DEFAULT_EVAL_CONTEXTS = (256, 512, 1024, 2048, 4096)
QUICK_EVAL_CONTEXTS = (32, 64, 128)


def hybrid_spec(n_layers: int, window: int) -> str:
    """``local:W`` for every layer but the last, then ``softmax:nope:entropy``."""
    if n_layers < 2:
        raise ValueError(f"the hybrid variant needs --n-layers >= 2 (local layers, then a global one), got {n_layers}")
    return ",".join([f"local:{window}"] * (n_layers - 1) + ["softmax:nope:entropy"])


def variant_spec(name: str, args: argparse.Namespace) -> str:
    """The attention spec of the variant ``name`` at the size of ``args``."""
    return hybrid_spec(args.n_layers, args.window) if name == "hybrid" else VARIANTS[name]


def eval_contexts(args: argparse.Namespace) -> list[int]:
    """The evaluation contexts, with the training context among them, ascending."""
    return sorted(set(args.eval_contexts) | {args.context})


def run_variant(name: str, args: argparse.Namespace, out_dir: Path, test_tokens: torch.Tensor) -> dict:
    """Train the variant ``name``, then evaluate it at every evaluation context (one row)."""
    spec = variant_spec(name, args)
    summary, _, curves = train_model(model_config(spec, args), args, out_dir / "runs" / name)
    model = summary["model"]
    evaluate = partial(evaluate_bpb, model, test_tokens, batch_size=1, max_tokens=args.test_tokens)
    test = [{"context": context, **evaluate(context=context, carry_state=False)} for context in eval_contexts(args)]
    recurrent = not model.has_growing_cache
    carried = evaluate(context=args.context, carry_state=True) if recurrent else None
    return {
        "variant": name, "spec": spec, "parameters": model.num_parameters(), "recurrent": recurrent,
        "train_context": args.context, "validation_bpb": summary["final_bpb"], "test_bpb": test,
        "test_bpb_carried": None if carried is None else carried["bpb"], "test_tokens": test[0]["tokens"],
        "train_tokens_per_second": curves["train_tokens_per_second"], "train_seconds": summary["elapsed"],
        "loss_curve": curves["loss_curve"], "validation_curve": curves["validation_curve"],
    }


# --- summary and report ---------------------------------------------------------------------


def _bpb(row: dict) -> dict[int, float]:
    return {entry["context"]: entry["bpb"] for entry in row["test_bpb"]}


def summarize(rows: list[dict], tolerance: float) -> dict:
    """Per variant: ``rise`` (largest bpb at a context above the training one minus the bpb
    at the training context; None without a longer context) and ``extrapolates`` (rise <=
    tolerance); ``entropy_scale``: per context, bpb of ``softmax`` minus bpb of
    ``softmax-entropy`` (> 0: the scale helps), when both were run."""
    variants = {}
    for row in rows:
        bpb = _bpb(row)
        base = bpb[row["train_context"]]
        longer = [value - base for context, value in bpb.items() if context > row["train_context"]]
        rise = max(longer) if longer else None
        variants[row["variant"]] = {"rise": rise, "extrapolates": None if rise is None else rise <= tolerance,
                                    "longest_context": max(bpb), "bpb_at_longest": bpb[max(bpb)],
                                    "bpb_at_train_context": base}
    summary = {"train_context": rows[0]["train_context"] if rows else None, "tolerance": tolerance,
               "variants": variants}
    by_name = {row["variant"]: _bpb(row) for row in rows}
    if "softmax" in by_name and "softmax-entropy" in by_name:
        summary["entropy_scale"] = {str(c): by_name["softmax"][c] - by_name["softmax-entropy"][c]
                                    for c in by_name["softmax"] if c in by_name["softmax-entropy"]}
    return summary


def conclusions(rows: list[dict], summary: dict) -> str:
    """The paragraph docs/results.md quotes, written from the numbers."""
    variants, train_context = summary["variants"], summary["train_context"]
    measured = {name: v for name, v in variants.items() if v["rise"] is not None}
    if not measured:
        return f"No evaluation context is longer than the training context {train_context}: nothing to conclude."
    longest = max(v["longest_context"] for v in measured.values())
    holds = [name for name, v in measured.items() if v["extrapolates"]]
    fails = [f"{name} (+{v['rise']:.3f})" for name, v in measured.items() if not v["extrapolates"]]
    text = [f"Extrapolate (test bpb at every context up to {longest} at most {summary['tolerance']:g} above the "
            f"bpb at the training context {train_context}): {', '.join(holds) or 'none'}. "
            f"Do not (largest rise): {', '.join(fails) or 'none'}."]
    if "entropy_scale" in summary:
        gain = summary["entropy_scale"]
        last = str(max(int(c) for c in gain))
        verdict = "helps" if gain[last] > 0 else "does not help"
        text.append(f"The entropy-invariant scale {verdict} rotary softmax at C={last}: "
                    f"{variants['softmax-entropy']['bpb_at_longest']:.3f} bpb with it against "
                    f"{variants['softmax']['bpb_at_longest']:.3f} without ({gain[last]:+.3f} in its favour; "
                    f"{gain[str(train_context)]:+.3f} at the training context).")
    if "softmax-nope-entropy" in variants:
        v = variants["softmax-nope-entropy"]
        text.append(f"Without positions (softmax:nope:entropy): {v['bpb_at_train_context']:.3f} at "
                    f"{train_context}, {v['bpb_at_longest']:.3f} at {v['longest_context']}.")
    carried = [f"{r['variant']} {r['test_bpb_carried']:.3f} (reset every {train_context}: "
               f"{_bpb(r)[train_context]:.3f})" for r in rows if r["test_bpb_carried"] is not None]
    if carried:
        text.append("State carried across the whole stream: " + ", ".join(carried) + ".")
    return " ".join(text)


def markdown(rows: list[dict], metadata: dict, summary: dict, note: str = "") -> str:
    """The table of bpb against the evaluation context and the conclusions."""
    contexts = sorted({entry["context"] for row in rows for entry in row["test_bpb"]})
    train_context = summary["train_context"]
    header = ["variant", "spec", "parameters", "validation bpb",
              *[f"C={c}" + (" (trained)" if c == train_context else "") for c in contexts],
              "state carried across the stream", "extrapolates"]
    cells = []
    for row in rows:
        bpb, v = _bpb(row), summary["variants"][row["variant"]]
        cells.append([row["variant"], f"`{row['spec']}`", f"{row['parameters']:,}", f"{row['validation_bpb']:.3f}",
                      *[f"{bpb[c]:.3f}" if c in bpb else "—" for c in contexts],
                      "—" if row["test_bpb_carried"] is None else f"{row['test_bpb_carried']:.3f}",
                      "—" if v["extrapolates"] is None else "yes" if v["extrapolates"] else f"no (+{v['rise']:.3f})"])
    lines = [
        "# Length extrapolation: trained at one context, evaluated at longer ones", "",
        f"Command: `{metadata['command']}`  ", f"Date: {metadata['date']}; device: {metadata['device_name']}, "
        f"{metadata['threads']} threads; torch {metadata['torch_version']}.", "",
        *markdown_table_lines(header, cells), "",
        f"Test bpb on the first {rows[0]['test_tokens']:,} predicted bytes of the test split, read as one stream in "
        f"windows of C with the state reset at every window; every model was trained at C={train_context}. "
        "The recurrent variants are also read with the state carried across the whole stream.", "",
        conclusions(rows, summary),
    ]
    if note:
        lines += ["", note]
    elif metadata.get("reused_runs"):
        lines += ["", reuse_note(metadata["reused_runs"], len(rows), "variants") + "."]
    return "\n".join(lines) + "\n"


def write_plot(rows: list[dict], train_context: int, path: Path) -> Path:
    """Test bpb against the evaluation context (carried states dotted) and the training loss."""
    figure, (left, right) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    for index, row in enumerate(rows):
        color = f"C{index % 10}"
        bpb = sorted(_bpb(row).items())
        left.plot([c for c, _ in bpb], [b for _, b in bpb], marker="o", color=color, label=row["variant"])
        if row["test_bpb_carried"] is not None:
            left.axhline(row["test_bpb_carried"], color=color, linestyle=":", linewidth=1)
        steps, losses = zip(*row["loss_curve"])
        right.plot(steps, [loss / math.log(2) for loss in losses], color=color, label=row["variant"])
    contexts = sorted({c for row in rows for c in _bpb(row)})
    left.axvline(train_context, color="grey", linestyle="--", linewidth=1)
    left.set_xscale("log", base=2)
    left.set_xticks(contexts, [str(c) for c in contexts])
    left.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    left.set(xlabel="evaluation context (state reset every window)", ylabel="test bpb",
             title=f"trained at {train_context} (dashed); dotted: state carried")
    right.set(xlabel="step", ylabel="training loss (bits per byte)", title="training loss")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    return save_figure(figure, path)


# --- the command ----------------------------------------------------------------------------


SPEC = ExperimentSpec(
    name="length-extrapolation",
    help="train at context 256, evaluate test bpb at 256..4096 (entropy scale, NoPE, window + global hybrid)",
    description=__doc__.split("\n\n", 1)[1],
    grid_axes=("variants",),
    unit="variants",
    default_seeds=1,
    quick_help=f"a tiny model, 20 steps at context 32, evaluated at {' '.join(map(str, QUICK_EVAL_CONTEXTS))} "
               "(for tests); flags given with other values than their defaults still apply",
    threads_help="torch CPU threads (default: torch's choice)",
)


# Defaults of the flags --quick changes, and their --quick values.
_DEFAULTS = dict(steps=1000, batch_size=8, context=256, eval_contexts=list(DEFAULT_EVAL_CONTEXTS), d_model=128,
                 n_heads=4, window=128, codebook_size=64, block_size=64, gau_d_k=64, eval_every=250,
                 eval_tokens=32768, test_tokens=131072)
_QUICK = dict(steps=20, batch_size=4, context=32, eval_contexts=list(QUICK_EVAL_CONTEXTS), d_model=32, n_heads=2,
              window=16, codebook_size=16, block_size=8, gau_d_k=16, eval_every=10, eval_tokens=2048,
              test_tokens=4096)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    positive = int_at_least(1, "a positive integer")
    d = _DEFAULTS
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--data", default="shakespeare")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--steps", type=positive, default=d["steps"])
    parser.add_argument("--batch-size", type=positive, default=d["batch_size"])
    parser.add_argument("--context", type=positive, default=d["context"], help="training context (default %(default)s)")
    parser.add_argument("--eval-contexts", nargs="+", type=positive, default=d["eval_contexts"], metavar="C",
                        help="evaluation contexts (default %(default)s; the training context is added)")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--d-model", type=positive, default=d["d_model"])
    parser.add_argument("--n-layers", type=positive, default=3)
    framework.add_lm_arguments(parser, n_heads=d["n_heads"], window=d["window"], favor_features=None,
                               codebook_size=d["codebook_size"], block_size=d["block_size"], gau_d_k=d["gau_d_k"])
    parser.add_argument("--eval-every", type=positive, default=d["eval_every"])
    parser.add_argument("--eval-tokens", type=positive, default=d["eval_tokens"],
                        help="validation bytes per evaluation")
    parser.add_argument("--test-tokens", type=non_negative_int, default=d["test_tokens"],
                        help="test bytes read at every evaluation context (default %(default)s; 0 = the whole split)")
    parser.add_argument("--tolerance", type=positive_float, default=0.01,
                        help="bpb a variant may rise past the training context and still extrapolate (default 0.01)")


# What a finished variant's row depends on (the journal key besides its name).
_RUN_SETTINGS = ("data", "steps", "batch_size", "context", "eval_contexts", "lr", "d_model", "n_layers", "n_heads",
                 "window", "codebook_size", "block_size", "gau_d_k", "eval_every", "eval_tokens", "test_tokens", "seed")


def _run_key(run: tuple) -> dict:
    name, args, _, _ = run
    return {"variant": name, "settings": {key: getattr(args, key) for key in _RUN_SETTINGS}}


def _describe(row: dict) -> str:
    return f"{row['variant']} val {row['validation_bpb']:.3f} bpb"


_POSITIVE = ("steps", "batch_size", "context", "d_model", "n_layers", "n_heads", "window", "codebook_size",
             "block_size", "gau_d_k", "eval_every", "eval_tokens")


def _run(args: argparse.Namespace) -> int:
    if args.quick:  # the flags left at their defaults take the --quick values
        for name, value in _QUICK.items():
            if getattr(args, name) == _DEFAULTS[name]:
                setattr(args, name, value)
    for name in _POSITIVE:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.eval_contexts or min(args.eval_contexts) < 1:
        raise ValueError(f"--eval-contexts must be positive context lengths, got {args.eval_contexts}")
    args.eval_contexts = eval_contexts(args)
    if "hybrid" in args.variants:
        hybrid_spec(args.n_layers, args.window)
    if args.test_tokens == 0:
        args.test_tokens = None
    for name in args.variants:  # every model is checked before the first one trains
        model_config(variant_spec(name, args), args)
    options = framework.run_options(args, SPEC)
    seeds = options.pop("seeds")
    if len(seeds) > 1:
        raise ValueError(f"--seeds {len(seeds)}: repro length-extrapolation trains one seed per row so far (--seeds 1)")
    out_dir, command = options.pop("out_dir"), options.pop("command")
    test_tokens = None if args.report_only else load_corpus(args.data, cache_dir=args.cache_dir).tokens("test")
    metadata = framework.experiment_metadata(device="cpu", command=command, shapes={
        "d_model": args.d_model, "n_layers": args.n_layers, "context": args.context,
        "eval_contexts": args.eval_contexts, "batch_size": args.batch_size, "steps": args.steps, "data": args.data},
        tolerance=args.tolerance)
    grid = Grid(train=run_variant, runs=[(name, args, out_dir, test_tokens) for name in args.variants],
                run_key=_run_key, describe=_describe, label="repro length-extrapolation", unit="variant",
                seed_of=lambda run: run[1].seed)
    outcome = framework.run_journaled(grid, out_dir, spec=SPEC, **options)
    metadata.update(seconds=outcome.seconds, reused_runs=outcome.reused)
    summary = summarize(outcome.rows, args.tolerance)
    note = framework.interim_note(len(outcome.rows), outcome.total, "variants") if args.report_only else ""
    text = markdown(outcome.rows, metadata, summary, note=note)
    files = framework.write_results(out_dir, rows=outcome.rows, runs=outcome.rows, metadata=metadata, markdown=text,
                                    summary=summary,
                                    plot=partial(write_plot, outcome.rows, args.context),
                                    plot_name="bpb_vs_context.png")
    return framework.print_result({"markdown": text, "files": files})


command = Experiment(SPEC, add_arguments=_add_arguments, run=_run)
