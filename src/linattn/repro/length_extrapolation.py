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
(``local``, window ``--window``), Transformer-VQ, the delta rule and linear attention (elu+1),
and ReRoPE (seed 004: rotary positions inside a window of ``--rerope-window`` positions, every
key further back at that distance, so no relative position beyond the window is ever seen):
``softmax-rerope`` is the rotary ``softmax`` model, trained as it is, read with ReRoPE at
evaluation (ReRoPE's claim: length extrapolation without training); ``softmax-rerope-trained``
is trained and read with it (``softmax:rerope=W``).

A variant extrapolates when its bpb at every evaluation context longer than the training one
is at most ``--tolerance`` above its bpb at the training context, at every seed (``--seeds``,
default 3).
"""

from __future__ import annotations

import argparse
import math
from functools import partial
from pathlib import Path

import torch

from .._checks import int_at_least, non_negative_int, positive_float
from ..data import load_corpus
from ..models import LM
from ..reporting import markdown_table_lines, pyplot, save_figure
from ..train import evaluate_bpb
from . import framework, grids, spread
from .framework import Experiment, ExperimentSpec
from .grids import Grid
from .journal import metadata_interim_note, reuse_note
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
    "retnet": "retnet",
    "gla": "gla",
    "gated-delta": "gated-delta",
    "softmax-rerope": "softmax",  # read with ReRoPE (EVALUATED_WITH_REROPE)
    "softmax-rerope-trained": None,
}
# Variants trained with one spec and evaluated with ReRoPE: the trained weights in a
# ``softmax:rerope=W`` model (rotary positions have no parameters, so they load as they are).
EVALUATED_WITH_REROPE = ("softmax-rerope",)
REROPE_VARIANTS = ("softmax-rerope", "softmax-rerope-trained")
DEFAULT_EVAL_CONTEXTS = (256, 512, 1024, 2048, 4096)
QUICK_EVAL_CONTEXTS = (32, 64, 128)


def hybrid_spec(n_layers: int, window: int) -> str:
    """``local:W`` for every layer but the last, then ``softmax:nope:entropy``."""
    if n_layers < 2:
        raise ValueError(f"the hybrid variant needs --n-layers >= 2 (local layers, then a global one), got {n_layers}")
    return ",".join([f"local:{window}"] * (n_layers - 1) + ["softmax:nope:entropy"])


def variant_spec(name: str, args: argparse.Namespace) -> str:
    """The attention spec the variant ``name`` trains with at the size of ``args``."""
    if name == "hybrid":
        return hybrid_spec(args.n_layers, args.window)
    if name == "softmax-rerope-trained":
        return f"softmax:rerope={args.rerope_window}"
    return VARIANTS[name]


def evaluation_spec(name: str, args: argparse.Namespace) -> str:
    """The attention spec the variant ``name`` is evaluated with (its training spec, or ReRoPE's)."""
    return f"softmax:rerope={args.rerope_window}" if name in EVALUATED_WITH_REROPE else variant_spec(name, args)


def evaluated_model(model: LM, spec: str, args: argparse.Namespace) -> LM:
    """``model`` itself when ``spec`` is its own; else a model of ``spec`` at the size of ``args``
    holding ``model``'s weights (every one: the load is strict), in eval mode."""
    if spec == model.config.attention:
        return model
    reader = LM(model_config(spec, args))
    reader.load_state_dict(model.state_dict(), strict=True)
    return reader.eval()


def eval_contexts(args: argparse.Namespace) -> list[int]:
    """The evaluation contexts, with the training context among them, ascending."""
    return sorted(set(args.eval_contexts) | {args.context})


def run_variant(name: str, args: argparse.Namespace, run_dir: Path, test_tokens: torch.Tensor) -> dict:
    """Train the variant ``name`` at ``args`` (its seed among them) in ``run_dir``, then evaluate
    it at every evaluation context (one run's row)."""
    spec, read_as = variant_spec(name, args), evaluation_spec(name, args)
    summary, _, curves = train_model(model_config(spec, args), args, run_dir)
    model = evaluated_model(summary["model"], read_as, args)
    evaluate = partial(evaluate_bpb, model, test_tokens, batch_size=1, max_tokens=args.test_tokens)
    test = [{"context": context, **evaluate(context=context, carry_state=False)} for context in eval_contexts(args)]
    recurrent = not model.has_growing_cache
    carried = evaluate(context=args.context, carry_state=True) if recurrent else None
    return {
        "variant": name, "spec": spec, "evaluation_spec": read_as, "parameters": model.num_parameters(),
        "recurrent": recurrent,
        "train_context": args.context, "validation_bpb": summary["final_bpb"], "test_bpb": test,
        "test_bpb_carried": None if carried is None else carried["bpb"], "test_tokens": test[0]["tokens"],
        "train_tokens_per_second": curves["train_tokens_per_second"], "train_seconds": summary["elapsed"],
        "loss_curve": curves["loss_curve"], "validation_curve": curves["validation_curve"],
    }


# --- summary and report ---------------------------------------------------------------------


# A row of the report: one variant over its seeds; what describes it rather than results.
ROW_IDENTITY = ("variant",)
ROW_CONSTANTS = ("parameters", "train_context", "test_tokens")


def _bpb(run: dict) -> dict[int, float]:
    return {entry["context"]: entry["bpb"] for entry in run["test_bpb"]}


def _rise(run: dict) -> float | None:
    """Largest bpb at a context above the training one minus the bpb at the training context
    (None without a longer context)."""
    bpb = _bpb(run)
    longer = [value - bpb[run["train_context"]] for context, value in bpb.items() if context > run["train_context"]]
    return max(longer) if longer else None


def run_metrics(run: dict) -> dict[str, float | None]:
    """The metrics of a run besides its top-level numbers: ``bpb_at_C`` per evaluation context
    and the ``rise`` (aggregated over the seeds by ``spread.aggregate``)."""
    return {**{f"bpb_at_{context}": value for context, value in _bpb(run).items()}, "rise": _rise(run)}


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per variant over its seeds (``spread.aggregate`` with :func:`run_metrics`)."""
    return spread.aggregate(runs, identity=ROW_IDENTITY, metrics=run_metrics, constants=ROW_CONSTANTS)


def _contexts(rows: list[dict]) -> list[int]:
    return sorted({int(key.removeprefix("bpb_at_")) for row in rows for key in row["metrics"]
                   if key.startswith("bpb_at_")})


def summarize(rows: list[dict], runs: list[dict], tolerance: float) -> dict:
    """Per variant (``rows`` aggregated over the seeds, ``runs`` per seed): ``rise`` (stats over
    the seeds of the largest bpb at a context above the training one minus the bpb at the
    training context), ``extrapolating_seeds`` (seeds whose rise <= tolerance) and
    ``extrapolates`` (at every seed; None without a longer context), the stats of bpb at the
    longest and at the training context; ``entropy_scale``: per context, the mean bpb of
    ``softmax`` minus that of ``softmax-entropy`` (> 0: the scale helps) and whether the
    difference is resolved (``spread.resolved``), when both were run; ``rerope``: the same for
    ``softmax-rerope`` (the same trained model read with ReRoPE)."""
    variants = {}
    for row in rows:
        rises = [_rise(run) for run in runs if run["variant"] == row["variant"]]
        measured = [rise for rise in rises if rise is not None]
        longest = max(c for c in _contexts([row]))
        variants[row["variant"]] = {
            "n": row["n"], "rise": spread.stats_of(row, "rise"),
            "extrapolating_seeds": sum(rise <= tolerance for rise in measured) if measured else None,
            "extrapolates": all(rise <= tolerance for rise in measured) if measured else None,
            "longest_context": longest, "bpb_at_longest": spread.stats_of(row, f"bpb_at_{longest}"),
            "bpb_at_train_context": spread.stats_of(row, f"bpb_at_{row['train_context']}")}
    summary = {"train_context": rows[0]["train_context"] if rows else None, "tolerance": tolerance,
               "variants": variants}
    by_name = {row["variant"]: row for row in rows}
    for key, name in (("entropy_scale", "softmax-entropy"), ("rerope", "softmax-rerope")):
        if "softmax" in by_name and name in by_name:
            summary[key] = _gains(by_name["softmax"], by_name[name])
    return summary


def _gains(plain: dict, other: dict) -> dict[str, dict]:
    """Per context: the mean bpb of ``plain`` minus that of ``other`` (> 0: ``other`` is better)
    and whether the difference is resolved (``spread.resolved``)."""
    gains = {}
    for context in _contexts([plain]):
        a, b = spread.stats_of(plain, f"bpb_at_{context}"), spread.stats_of(other, f"bpb_at_{context}")
        if a is not None and b is not None:
            gains[str(context)] = {"gain": a["mean"] - b["mean"], "resolved": spread.resolved(a, b)}
    return gains


def _spread_word(is_resolved: bool) -> str:
    return "resolved" if is_resolved else "within the spread"


def conclusions(rows: list[dict], summary: dict) -> str:
    """The paragraph docs/results.md quotes, written from the numbers (means over the seeds)."""
    variants, train_context = summary["variants"], summary["train_context"]
    measured = {name: v for name, v in variants.items() if v["rise"] is not None}
    if not measured:
        return f"No evaluation context is longer than the training context {train_context}: nothing to conclude."
    longest = max(v["longest_context"] for v in measured.values())
    several = any(v["n"] > 1 for v in measured.values())
    holds = [name for name, v in measured.items() if v["extrapolates"]]
    fails = [f"{name} ({v['rise']['mean']:+.3f}" + (f"; extrapolates at {v['extrapolating_seeds']} of {v['n']} seeds"
                                                     if v["extrapolating_seeds"] else "") + ")"
             for name, v in measured.items() if not v["extrapolates"]]
    text = [f"Extrapolate (test bpb at every context up to {longest} at most {summary['tolerance']:g} above the "
            f"bpb at the training context {train_context}" + (", at every seed" if several else "") + "): "
            f"{', '.join(holds) or 'none'}. Do not (largest rise" + (", mean over the seeds" if several else "")
            + f"): {', '.join(fails) or 'none'}."]
    comparisons = (
        ("entropy_scale", "softmax-entropy", "The entropy-invariant scale {verdict} rotary softmax", "with it"),
        ("rerope", "softmax-rerope", "ReRoPE at evaluation {verdict} the rotary softmax model", "read with it"),
    )
    for key, name, subject, reading in comparisons:
        if summary.get(key):
            text.append(_gain_sentence(summary[key], variants, name, subject, reading, train_context))
    if "softmax-nope-entropy" in variants:
        v = variants["softmax-nope-entropy"]
        text.append(f"Without positions (softmax:nope:entropy): {v['bpb_at_train_context']['mean']:.3f} at "
                    f"{train_context}, {v['bpb_at_longest']['mean']:.3f} at {v['longest_context']}.")
    carried = [f"{r['variant']} {spread.mean_of(r, 'test_bpb_carried'):.3f} (reset every {train_context}: "
               f"{spread.mean_of(r, f'bpb_at_{train_context}'):.3f})" for r in rows
               if spread.stats_of(r, "test_bpb_carried") is not None]
    if carried:
        text.append("State carried across the whole stream: " + ", ".join(carried) + ".")
    return " ".join(text)


def _gain_sentence(gain: dict, variants: dict, name: str, subject: str, reading: str, train_context: int) -> str:
    """The sentence on ``name`` against ``softmax`` from their per-context ``gain`` (``_gains``):
    ``subject`` (with ``{verdict}``) at the longest context, both means, the gain there and at
    the training context, each resolved or within the spread."""
    last = str(max(int(c) for c in gain))
    verdict = "helps" if gain[last]["gain"] > 0 else "does not help"
    at_train = gain.get(str(train_context))
    return (f"{subject.format(verdict=verdict)} at C={last}: {variants[name]['bpb_at_longest']['mean']:.3f} bpb "
            f"{reading} against {variants['softmax']['bpb_at_longest']['mean']:.3f} without "
            f"({gain[last]['gain']:+.3f} in its favour, {_spread_word(gain[last]['resolved'])}"
            + (f"; {at_train['gain']:+.3f} at the training context, {_spread_word(at_train['resolved'])}"
               if at_train else "") + ").")


def _extrapolates_cell(v: dict) -> str:
    if v["extrapolates"] is None:
        return "—"
    if v["extrapolates"]:
        return "yes"
    rise = f"{v['rise']['mean']:+.3f}"
    if not v["extrapolating_seeds"]:
        return f"no ({rise})"
    return f"at {v['extrapolating_seeds']} of {v['n']} seeds (mean rise {rise})"


def markdown(rows: list[dict], metadata: dict, summary: dict, *, runs: int, note: str = "") -> str:
    """The table of bpb against the evaluation context over the seeds, the differences at the
    longest and at the training context, and the conclusions; ``runs``: the per-seed runs."""
    contexts = _contexts(rows)
    train_context = summary["train_context"]
    stats = spread.format_stats
    header = ["variant", "spec", "parameters", "n", "validation bpb",
              *[f"C={c}" + (" (trained)" if c == train_context else "") for c in contexts],
              "state carried across the stream", "extrapolates"]
    cells = []
    for row in rows:
        v = summary["variants"][row["variant"]]
        read_as = row.get("evaluation_spec", row["spec"])
        spec = f"`{row['spec']}`" + (f", read as `{read_as}`" if read_as != row["spec"] else "")
        cells.append([row["variant"], spec, f"{row['parameters']:,}", str(row["n"]),
                      stats(spread.stats_of(row, "validation_bpb")),
                      *[stats(spread.stats_of(row, f"bpb_at_{c}")) for c in contexts],
                      stats(spread.stats_of(row, "test_bpb_carried")), _extrapolates_cell(v)])
    longest = contexts[-1]
    lines = [
        "# Length extrapolation: trained at one context, evaluated at longer ones", "",
        f"Command: `{metadata['command']}`  ", f"Date: {metadata['date']}; device: {metadata['device_name']}, "
        f"{metadata['threads']} threads; torch {metadata['torch_version']}.", "",
        spread.seeds_text(rows), "",
        *markdown_table_lines(header, cells), "",
        f"Test bpb on the first {rows[0]['test_tokens']:,} predicted bytes of the test split, read as one stream in "
        f"windows of C with the state reset at every window; every model was trained at C={train_context}. "
        "The recurrent variants are also read with the state carried across the whole stream.", "",
        conclusions(rows, summary), "",
        *spread.differences_lines([
            (f"Test bpb at C={longest}, the longest context (lower is better):", spread.difference_matrix(
                rows, lambda r: spread.stats_of(r, f"bpb_at_{longest}"), _name)),
            (f"Test bpb at C={train_context}, the training context (lower is better):", spread.difference_matrix(
                rows, lambda r: spread.stats_of(r, f"bpb_at_{train_context}"), _name)),
        ][: 1 if longest == train_context else 2]),
    ]
    if note:
        lines += ["", note]
    elif metadata.get("reused_runs"):
        lines += ["", reuse_note(metadata["reused_runs"], runs) + "."]
    return "\n".join(lines) + "\n"


def page(results: dict) -> str:
    """The page of ``results.json``'s contents: :func:`markdown` of its rows, metadata and summary."""
    metadata, runs = results["metadata"], len(results["runs"])
    return markdown(results["rows"], metadata, results["summary"], runs=runs,
                    note=metadata_interim_note(metadata, runs))


def _name(row: dict) -> str:
    return row["variant"]


def write_plot(rows: list[dict], runs: list[dict], train_context: int, path: Path) -> Path:
    """Test bpb against the evaluation context (mean over the seeds, min–max error bars; carried
    states dotted) and the training loss (mean, min–max band)."""
    figure, (left, right) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    contexts = _contexts(rows)
    for index, row in enumerate(rows):
        color = f"C{index % 10}"
        mine = [c for c in contexts if spread.stats_of(row, f"bpb_at_{c}") is not None]
        spread.plot_spread(left, mine, [spread.stats_of(row, f"bpb_at_{c}") for c in mine], marker="o",
                           color=color, label=row["variant"])
        carried = spread.mean_of(row, "test_bpb_carried")
        if carried is not None:
            left.axhline(carried, color=color, linestyle=":", linewidth=1)
        spread.plot_band(right, [run["loss_curve"] for run in runs if run["variant"] == row["variant"]],
                         scale=1 / math.log(2), color=color, label=row["variant"])
    left.axvline(train_context, color="grey", linestyle="--", linewidth=1)
    left.set_xscale("log", base=2)
    left.set_xticks(contexts, [str(c) for c in contexts])
    left.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    several = " (mean over the seeds, bars/band: min–max)" if any(row["n"] > 1 for row in rows) else ""
    left.set(xlabel="evaluation context (state reset every window)", ylabel="test bpb",
             title=f"trained at {train_context} (dashed); dotted: state carried")
    right.set(xlabel="step", ylabel="training loss (bits per byte)", title="training loss" + several)
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    return save_figure(figure, path)


# --- the command ----------------------------------------------------------------------------


SPEC = ExperimentSpec(
    name="length-extrapolation",
    help="train at context 256, evaluate test bpb at 256..4096 (entropy scale, NoPE, window + global hybrid, "
         "ReRoPE)",
    description=__doc__.split("\n\n", 1)[1],
    grid_axes=("variants",),
    row="variant",
    quick_help=f"a tiny model, 20 steps at context 32, evaluated at {' '.join(map(str, QUICK_EVAL_CONTEXTS))}, "
               "one seed (for tests); flags given with other values than their defaults still apply",
    threads_help="torch CPU threads (default: torch's choice)",
)


# Defaults of the flags --quick changes, and their --quick values.
_DEFAULTS = dict(steps=1000, batch_size=8, context=256, eval_contexts=list(DEFAULT_EVAL_CONTEXTS), d_model=128,
                 n_heads=4, window=128, codebook_size=64, block_size=64, gau_d_k=64, eval_every=250,
                 eval_tokens=32768, test_tokens=131072, rerope_window=128)
_QUICK = dict(steps=20, batch_size=4, context=32, eval_contexts=list(QUICK_EVAL_CONTEXTS), d_model=32, n_heads=2,
              window=16, codebook_size=16, block_size=8, gau_d_k=16, eval_every=10, eval_tokens=2048,
              test_tokens=4096, rerope_window=16)


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
    parser.add_argument("--rerope-window", type=positive, default=d["rerope_window"],
                        help="ReRoPE's window w of the softmax-rerope variants: rotary positions up to w, every key "
                             "further back at distance w (default %(default)s, half the training context)")
    parser.add_argument("--tolerance", type=positive_float, default=0.01,
                        help="bpb a variant may rise past the training context and still extrapolate (default 0.01)")


# What a finished variant's row depends on (the journal key besides its name).
_RUN_SETTINGS = ("data", "steps", "batch_size", "context", "eval_contexts", "lr", "d_model", "n_layers", "n_heads",
                 "window", "codebook_size", "block_size", "gau_d_k", "eval_every", "eval_tokens", "test_tokens", "seed")


def _run_key(run: tuple) -> dict:
    name, args, _, _ = run
    settings = {key: getattr(args, key) for key in _RUN_SETTINGS}
    if name in REROPE_VARIANTS:  # the other variants' keys stay those of journals written before this flag
        settings["rerope_window"] = args.rerope_window
    return {"variant": name, "settings": settings}


def _seed_of(run: tuple) -> int:
    return run[1].seed


def _describe(row: dict) -> str:
    return f"{row['variant']} val {row['validation_bpb']:.3f} bpb"


_POSITIVE = ("steps", "batch_size", "context", "d_model", "n_layers", "n_heads", "window", "codebook_size",
             "block_size", "gau_d_k", "eval_every", "eval_tokens", "rerope_window")


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
        model_config(evaluation_spec(name, args), args)
    options = framework.run_options(args, SPEC)
    out_dir, command, seeds = options.pop("out_dir"), options.pop("command"), options.pop("seeds")
    test_tokens = None if args.report_only else load_corpus(args.data, cache_dir=args.cache_dir).tokens("test")
    metadata = framework.experiment_metadata(device="cpu", command=command, shapes={
        "d_model": args.d_model, "n_layers": args.n_layers, "context": args.context,
        "eval_contexts": args.eval_contexts, "batch_size": args.batch_size, "steps": args.steps, "data": args.data},
        tolerance=args.tolerance, seeds=seeds)
    runs = [(name, framework.with_seed(args, seed), framework.run_folder(out_dir, name, seed), test_tokens)
            for seed in seeds for name in args.variants]
    grid = Grid(train=run_variant, runs=runs, run_key=_run_key, seed_of=_seed_of, describe=_describe,
                label="repro length-extrapolation", unit="run")
    outcome = grids.run_journaled(grid, out_dir, spec=SPEC, **options)
    metadata.update(seconds=outcome.seconds, reused_runs=outcome.reused, grid_runs=outcome.total,
                    report_only=args.report_only)
    rows = aggregate(outcome.rows)
    summary = summarize(rows, outcome.rows, args.tolerance)
    text = page({"metadata": metadata, "rows": rows, "runs": outcome.rows, "summary": summary})
    files = framework.write_results(out_dir, rows=rows, runs=outcome.rows, metadata=metadata, markdown=text,
                                    summary=summary, plot=partial(write_plot, rows, outcome.rows, args.context),
                                    plot_name="bpb_vs_context.png")
    return framework.print_result({"markdown": text, "files": files})


command = Experiment(SPEC, add_arguments=_add_arguments, run=_run, page=page)
