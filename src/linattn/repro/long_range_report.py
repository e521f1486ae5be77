"""The report of ``linattn repro long-range``: accuracy against the distance d, its plot, the runs.

``rows`` are aggregated over the seeds (``spread.aggregate`` with the metrics
``accuracy@d``), ``runs`` are ``long_range.train_run``'s rows, one per (mechanism, seed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..reporting import markdown_table_lines, pyplot, save_figure
from . import spread
from .journal import closing_note

if TYPE_CHECKING:
    from .long_range import LongRangeConfig

CLAIM = ("Transformer-VQ, having no explicit long-range decay, should hold long context better than RetNet, and "
         "its finite key set should extrapolate better (the efficient-attention survey, seed 004).")


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _column(d: int, config: LongRangeConfig, reach: int | None) -> str:
    marks = ("†" if d > config.max_distance else "") + ("‡" if reach is not None and d >= reach else "")
    return f"d={d}{marks}"


def markdown_report(rows: Sequence[dict], runs: Sequence[dict], *, distances: Sequence[int], config: LongRangeConfig,
                    metadata: dict, note: str = "") -> str:
    """Accuracy per mechanism and distance over the seeds, the differences at the longest
    distance, the per-seed runs. ``metadata``: the experiment's (its ``local_reach`` and
    ``shapes.eval_seq_lens`` among them); ``note`` (an interim report's sentence) replaces
    the clause on reused runs."""
    reach = metadata["local_reach"] if any(r["mechanism"] == "local" for r in rows) else None
    keys = config.vocab_size // 4
    longest = max(distances)
    stats = spread.stats_of
    lines = [
        "# repro long-range: recall of a fact d tokens before its question", "",
        f"Command: `{metadata['command']}`  ", f"Date: {metadata['date']}; device: {metadata['device_name']}, "
        f"{metadata['threads']} threads; torch {metadata['torch_version']}.", "",
        f"Claim under test: {CLAIM}", "",
        f"Task: {config.num_facts} facts (key, value) per sequence, each asked again (its key) exactly d tokens "
        f"after its value; vocabulary {config.vocab_size}: {keys} keys, {keys} values, "
        f"{config.vocab_size - 2 * keys} filler tokens; only the answers are scored (argmax == value; chance "
        f"~ 1/{keys}). Training: {config.steps} steps of {config.batch_size} sequences of {config.seq_len} tokens, "
        f"d uniform in {config.min_distance}..{config.max_distance} (D_train = {config.max_distance}), AdamW lr "
        f"{config.lr:g} (warm-up {config.warmup_fraction:.0%}, cosine to {config.min_lr_ratio:g}x), weight decay "
        f"{config.weight_decay:g}. Evaluation: {config.eval_sequences} sequences per d of length d + "
        f"{2 * config.num_facts + config.eval_margin} ({metadata['shapes']['eval_seq_lens'][-1]} at d = {longest}), "
        "each read whole in one forward pass from an empty state, every mechanism alike.", "",
        f"Models: {config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads; VQ codebook "
        f"{config.codebook_size}, block {config.block_size}, d_k {config.gau_d_k}; local window {config.window}. "
        f"Parameter counts matched to the `softmax` model ({_target(runs)}) by the inner width (SwiGLU hidden width; "
        "GAU value width for `vq`).", "",
        spread.seeds_text(rows), "",
        "## Accuracy against d", "",
        *markdown_table_lines(
            ["mechanism", "spec", "width", "parameters", "n", *(_column(d, config, reach) for d in distances)],
            [[r["mechanism"], f"`{r['spec']}`", spread.format_mean(stats(r, "width"), ".0f"),
              spread.format_mean(stats(r, "parameters"), ",.0f"), str(r["n"]),
              *(spread.format_stats(stats(r, f"accuracy@{d}")) for d in distances)] for r in rows]), "",
        f"†: past the training distances (d > {config.max_distance})."
        + (f" ‡: past the reach of `local` ({config.n_layers} layers of window {config.window} see "
           f"{reach} tokens back; the value is d + 1 back), where it must be at chance." if reach is not None else ""),
        "",
        *spread.differences_lines([(f"Accuracy at d = {longest} (higher is better):", spread.difference_matrix(
            rows, lambda r: stats(r, f"accuracy@{longest}"), lambda r: r["mechanism"]))]),
        "", "## Runs", "",
        *markdown_table_lines(
            ["mechanism", "seed", "width", "parameters", "final train loss", "steps", "status", "train seconds"],
            [[r["mechanism"], str(r["seed"]), str(r["width"]), f"{r['parameters']:,}", _number(r["final_loss"]),
              str(r["steps"]), r["status"], f"{r['train_seconds']:.0f}"] for r in runs]),
    ]
    return "\n".join([*lines, "", closing_note(metadata, len(runs), note)]) + "\n"


def _target(runs: Sequence[dict]) -> str:
    targets = sorted({r["target_parameters"] for r in runs})
    return ", ".join(f"{t:,}" for t in targets) + " parameters"


def write_plot(runs: Sequence[dict], path: Path, *, distances: Sequence[int], config: LongRangeConfig,
               local_reach: int | None = None) -> Path:
    """Accuracy against d (log2 axis), one line per mechanism: the mean over the seeds with
    its min–max band; the largest training distance, chance and (``local_reach``, when given
    and ``local`` is among the runs) the reach of the local control marked."""
    figure, axis = pyplot().subplots(figsize=(7.5, 4.5))
    names = list(dict.fromkeys(r["mechanism"] for r in runs))
    for index, name in enumerate(names):
        curves = [[(int(d), value) for d, value in run["accuracy"].items()] for run in runs if run["mechanism"] == name]
        spread.plot_band(axis, curves, color=f"C{index % 10}", marker="o", label=name)
        if name == "local" and local_reach is not None:
            axis.axvline(local_reach, color=f"C{index % 10}", linestyle=":", linewidth=1,
                         label=f"reach of local ({local_reach})")
    axis.axvline(config.max_distance, color="gray", linestyle="--", linewidth=1,
                 label=f"largest training d ({config.max_distance})")
    axis.axhline(1 / (config.vocab_size // 4), color="gray", linestyle=":", linewidth=1, label="chance")
    axis.set_xscale("log", base=2)
    axis.set_xticks(list(distances), [str(d) for d in distances])
    axis.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    axis.set_ylim(-0.03, 1.03)
    axis.set(xlabel="distance d (tokens between a fact's value and its question)", ylabel="answer accuracy",
             title="Recall of a fact d tokens back" + (" (mean, band: min–max over seeds)"
                                                       if len(runs) > len(names) else ""))
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize="small")
    return save_figure(figure, path)
