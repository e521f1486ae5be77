"""``linattn repro long-range``: recall of facts placed d tokens before their question, d past training.

**Claim under test** (the efficient-attention survey, seed 004): Transformer-VQ has no
explicit long-range decay, so it should hold long context better than RetNet, and its keys,
quantized to a finite set, should let it extrapolate better.

**Task** (``make_long_range_batch``). Vocabulary ``V`` (default 64) split in three disjoint
ranges: keys ``[0, K)``, values ``[K, 2K)`` and filler ``[2K, V)``, ``K = V // 4``. A
sequence of length ``T`` holds ``N`` facts (default 4) and their ``N`` questions, each
question exactly ``d`` tokens after its fact's value:

- the ``N`` keys of a sequence are distinct, and so are its ``N`` values (uniformly random
  subsets in random order);
- fact ``i`` (``i = 0 .. N-1``) is key ``k_i`` at position ``p + 2i`` and value ``v_i`` at
  ``p + 2i + 1``: the facts form one block ``k_0 v_0 k_1 v_1 ... k_{N-1} v_{N-1}``;
- question ``i`` is ``k_i`` again, at position ``q_i = p + 2i + d + 2``: ``d`` tokens lie
  between ``v_i`` and its question (``v_i`` is ``d + 1`` positions before ``q_i``, ``k_i``
  ``d + 2``). The questions come in the facts' order, two positions apart, so every
  question is at the same distance and the later facts sit between a fact and its question
  (the state must hold all ``N`` facts and retrieve by key);
- the target of ``q_i`` -- the next-token prediction made there -- is ``v_i``; every other
  position has target -100 (ignored): only the ``N`` answers are scored, accuracy =
  ``argmax over the whole vocabulary == v_i``; chance is about ``1 / K``;
- every other position holds a filler token, uniform over ``[2K, V)``, so a key occurs
  nowhere but in its fact and its question;
- ``p`` is uniform over ``[0, T - 2N - d - 1]`` (the last question is at most the last
  position), so ``2N - 2 <= d <= T - 2N - 1`` (a question never comes before the last value).

**Training.** One model per (mechanism, seed): sequences of ``T_train`` (default 128) with
``d`` drawn per sequence uniformly from ``[d_min, D_train]`` (default 8..96), a fresh batch
every step (default 16 sequences, 6000 steps) from a generator seeded by the seed alone, so
every mechanism sees the same data at a seed. ``query_task.fit_queries``: AdamW, peak lr 3e-3
(warm-up 10 %, cosine to 10 %), weight decay 0.1 on matrices and the embedding, gradient
clipping at 1.0, loss = cross-entropy at the answer positions (+ VQ commitment). The
defaults are the smallest budget of those tried at which the exact-softmax control learns
the task inside its training distances (the probes are in docs/results.md, "Long-range
recall").

**Evaluation.** The trained model at every ``d`` of the grid (default 16, 64, 128, 256, 512,
1024, 2048, 4096: 16 within the local control's reach; from 64 on the sequences are longer
than ``T_train``, from 128 on ``d`` is past ``D_train``): ``--eval-sequences``
(default 64) sequences per ``d`` of length ``T(d) = d + 2N + M`` (``M = --eval-margin``,
default 64, so ``p`` is uniform over ``[0, M - 1]``), from a generator seeded by (seed, d),
the same for every mechanism. Each sequence is read whole in one forward pass from an empty
state (no chunks, no carried state), ``--eval-batch-size`` sequences at a time, every
mechanism the same way. Reported per ``d``: accuracy over the ``N`` answers of every sequence.

**Models.** A ``linattn.models.LM`` (default 2 layers, d_model 64, 2 heads, vocabulary V,
tied embeddings) per mechanism of ``LONG_RANGE_SPECS``: ``vq`` (Transformer-VQ GAU pairs;
codebook 64, block 32, d_k 64, k-means init, dead-code restart), ``delta`` (DeltaNet),
``softmax`` (exact, rotary positions) and ``local`` (sliding-window softmax, window 32: with
L layers its answer depends only on the last ``L (W - 1)`` tokens, 62 by default, so it
cannot answer at ``d >= 62``: a control that must sit at chance there). Equal parameter
counts: d_model, depth and heads are the same for all; each model's inner width (the
SwiGLU hidden width of attention blocks, the GAU value width ``d_v`` of VQ layers; a multiple
of 4) is chosen so its parameter count is nearest that of the ``softmax`` model at the
default SwiGLU width (``matched_model_config``); the counts are reported. A mechanism is one
line of ``LONG_RANGE_SPECS``: any layer kind whose parameter count grows with ``ffn_hidden``
or ``gau_d_v`` is matched the same way.

**Budget.** The softmax control trained 6000 steps of 16 x 128 tokens in 381 s at one
thread on the 2-core machine (0.064 s a step); a grid of seven mechanisms at 3 seeds is
several CPU-hours, ``--jobs 2 --threads 1``. ``--quick`` (8 steps of 8 x 48 tokens,
distances 16 and 64, 8 sequences each, one seed) is a smoke test of seconds that learns
nothing. Report: ``long_range_report``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

from .._checks import check_fraction, check_int, check_positive_number, int_at_least, positive_float
from ..models import LM, LMConfig, sizes, uses_heads
from . import framework, grids, spread
from .framework import Experiment, ExperimentSpec, seeded_generator
from .grids import Grid
from .journal import metadata_interim_note
from .long_range_report import markdown_report, write_plot
from .query_task import IGNORE, evaluate_queries, fit_queries

# CLI name -> LMConfig attention spec (one line per mechanism; "local" takes LMConfig.local_window).
LONG_RANGE_SPECS = {
    "vq": "vq",
    "delta": "delta",
    "softmax": "softmax",
    "local": "local",
    "retnet": "retnet",
    "gla": "gla",
    "gated-delta": "gated-delta",
}
REFERENCE = "softmax"  # the parameter count every model is matched to (default SwiGLU width)
WIDTH_STEP = 4  # inner widths are multiples of this

DEFAULT_DISTANCES = (16, 64, 128, 256, 512, 1024, 2048, 4096)
QUICK_DISTANCES = (16, 64)
QUICK = dict(steps=8, batch_size=8, seq_len=48, min_distance=6, max_distance=24, eval_sequences=8)


# --- task ---------------------------------------------------------------------------


def _key_count(vocab_size: int) -> int:
    return vocab_size // 4


def distance_range(seq_len: int, num_facts: int) -> tuple[int, int]:
    """The distances a sequence of ``seq_len`` with ``num_facts`` facts can hold:
    ``(2N - 2, T - 2N - 1)``."""
    return 2 * num_facts - 2, seq_len - 2 * num_facts - 1


def make_long_range_batch(
    batch_size: int,
    seq_len: int,
    distances: int | torch.Tensor,
    num_facts: int = 4,
    vocab_size: int = 256,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of the task (see the module docstring for the layout).

    ``distances``: one ``d`` for every row, or an int64 tensor ``[batch_size]`` of one per
    row. Returns ``(inputs [B, T] int64, targets [B, T] int64)``; ``targets`` is -100 except
    at the ``num_facts`` question positions of each row, where it is the fact's value.
    ``generator`` (a CPU ``torch.Generator``) makes it reproducible.
    """
    check_int("batch_size", batch_size)
    check_int("num_facts", num_facts)
    check_int("seq_len", seq_len)
    check_int("vocab_size", vocab_size, minimum=4)
    keys_available = _key_count(vocab_size)
    if num_facts > keys_available:
        raise ValueError(f"vocab_size={vocab_size} has {keys_available} key ids and {keys_available} value ids "
                         f"(V // 4 each); too few for num_facts={num_facts} distinct facts")
    if isinstance(distances, torch.Tensor):
        if distances.shape != (batch_size,) or distances.dtype != torch.int64:
            raise ValueError(f"distances must be an int or an int64 tensor of shape [{batch_size}], got "
                             f"{distances.dtype} of shape {list(distances.shape)}")
        d = distances.clone()
    else:
        check_int("distances", distances, minimum=0)
        d = torch.full((batch_size,), distances, dtype=torch.long)
    low, high = distance_range(seq_len, num_facts)
    if d.numel() and (int(d.min()) < low or int(d.max()) > high):
        raise ValueError(f"distances must be in [2 * num_facts - 2, seq_len - 2 * num_facts - 1] = [{low}, {high}] "
                         f"(seq_len={seq_len}, num_facts={num_facts}), got {int(d.min())}..{int(d.max())}")

    B, T, N, K = batch_size, seq_len, num_facts, keys_available
    keys = torch.rand(B, K, generator=generator).topk(N, dim=1).indices  # distinct, random order
    values = K + torch.rand(B, K, generator=generator).topk(N, dim=1).indices
    inputs = 2 * K + torch.randint(vocab_size - 2 * K, (B, T), generator=generator)  # filler
    starts = (torch.rand(B, generator=generator, dtype=torch.float64) * (T - 2 * N - d)).long()  # p
    key_positions = starts[:, None] + 2 * torch.arange(N)
    questions = key_positions + d[:, None] + 2
    inputs.scatter_(1, key_positions, keys)
    inputs.scatter_(1, key_positions + 1, values)
    inputs.scatter_(1, questions, keys)
    targets = torch.full((B, T), IGNORE, dtype=torch.long)
    targets.scatter_(1, questions, values)
    return inputs, targets


def local_reach(n_layers: int, window: int) -> int:
    """How far back ``n_layers`` sliding-window layers of ``window`` keys see: ``L (W - 1)``
    tokens (each layer moves information at most ``W - 1`` positions). A question whose value
    is further back (``d + 1`` > reach, i.e. ``d >= L (W - 1)``) cannot be answered."""
    return n_layers * (window - 1)


# --- settings -----------------------------------------------------------------------


@dataclass(frozen=True)
class LongRangeConfig:
    """The settings shared by every run of an invocation (the seed among them)."""

    steps: int = 6000
    batch_size: int = 16
    seq_len: int = 128
    min_distance: int = 8
    max_distance: int = 96  # D_train
    num_facts: int = 4
    vocab_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_fraction: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    window: int = 32
    codebook_size: int = 64
    block_size: int = 32
    gau_d_k: int = 64
    eval_sequences: int = 64
    eval_batch_size: int = 16
    eval_margin: int = 64
    seed: int = 0


# config field -> the flag that sets it (errors name the flag)
_FLAGS = {"steps": "--steps", "batch_size": "--batch-size", "seq_len": "--seq-len", "num_facts": "--facts",
          "vocab_size": "--vocab-size", "lr": "--lr", "grad_clip": "grad_clip", "d_model": "--d-model",
          "n_layers": "--n-layers", "n_heads": "--n-heads", "window": "--window",
          "codebook_size": "--codebook-size", "block_size": "--block-size", "gau_d_k": "--gau-d-k",
          "eval_sequences": "--eval-sequences", "eval_batch_size": "--eval-batch-size",
          "eval_margin": "--eval-margin", "weight_decay": "weight_decay", "warmup_fraction": "warmup_fraction",
          "min_lr_ratio": "min_lr_ratio"}


def check_settings(mechanisms: Sequence[str], distances: Sequence[int], config: LongRangeConfig) -> None:
    """Every setting of an invocation, before anything is trained: a ValueError naming the
    flag (or field) otherwise."""
    if not mechanisms:
        raise ValueError("--mechanisms: need at least one mechanism")
    unknown = [m for m in mechanisms if m not in LONG_RANGE_SPECS]
    if unknown:
        raise ValueError(f"--mechanisms: unknown mechanism(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(LONG_RANGE_SPECS)}")
    for name in ("steps", "batch_size", "seq_len", "num_facts", "vocab_size", "d_model", "n_layers", "n_heads",
                 "window", "codebook_size", "block_size", "gau_d_k", "eval_sequences", "eval_batch_size",
                 "eval_margin"):
        check_int(_FLAGS[name], getattr(config, name))
    for name in ("lr", "grad_clip"):
        check_positive_number(_FLAGS[name], getattr(config, name), finite=True)
    for name in ("weight_decay", "warmup_fraction", "min_lr_ratio"):
        check_fraction(_FLAGS[name], getattr(config, name))
    if _key_count(config.vocab_size) < config.num_facts:
        raise ValueError(f"--vocab-size {config.vocab_size} has {_key_count(config.vocab_size)} key ids (V // 4); "
                         f"--facts {config.num_facts} needs at least {4 * config.num_facts}")
    low, high = distance_range(config.seq_len, config.num_facts)
    if not (isinstance(config.min_distance, int) and isinstance(config.max_distance, int)
            and low <= config.min_distance <= config.max_distance <= high):
        raise ValueError(f"--train-distances LO HI must satisfy {low} <= LO <= HI <= {high} (2 * --facts - 2 and "
                         f"--seq-len - 2 * --facts - 1 at --seq-len {config.seq_len}, --facts {config.num_facts}), "
                         f"got {config.min_distance} {config.max_distance}")
    if not distances:
        raise ValueError("--distances: need at least one distance")
    for d in distances:
        if not isinstance(d, int) or d < low:
            raise ValueError(f"--distances: every distance must be an int >= 2 * --facts - 2 = {low}, got {d!r}")
    if len(set(distances)) != len(distances):
        raise ValueError(f"--distances: repeated distance(s) in {list(distances)}")
    if config.d_model % config.n_heads or (config.d_model // config.n_heads) % 2:
        raise ValueError(f"--d-model {config.d_model} must be a multiple of 2 * --n-heads {config.n_heads} (an "
                         "even head dimension, for rotary positions)")


# --- models -------------------------------------------------------------------------


def base_model_config(mechanism: str, config: LongRangeConfig, **fields) -> LMConfig:
    """The ``LM`` of ``mechanism`` at the experiment's size; ``fields``: further ``LMConfig`` fields."""
    if mechanism not in LONG_RANGE_SPECS:
        raise ValueError(f"unknown mechanism {mechanism!r}; choose from {', '.join(LONG_RANGE_SPECS)}")
    spec = LONG_RANGE_SPECS[mechanism]
    return LMConfig(
        vocab_size=config.vocab_size, d_model=config.d_model, n_layers=config.n_layers, attention=spec,
        n_heads=config.n_heads if uses_heads(spec) else None, local_window=config.window,
        codebook_size=config.codebook_size, block_size=config.block_size, gau_d_k=config.gau_d_k,
        kmeans_init=True, dead_code_threshold=0.5, chunk_size=32, **fields,
    )


def count_parameters(config: LMConfig) -> int:
    """The parameter count of ``LM(config)`` (``models.sizes.count_parameters``)."""
    return sizes.count_parameters(config)


def matched_model_config(mechanism: str, config: LongRangeConfig) -> tuple[LMConfig, int]:
    """``(model config, target parameter count)``: the model of ``mechanism`` whose inner
    width ``w`` (``ffn_hidden = gau_d_v = w``, a multiple of ``WIDTH_STEP``: the SwiGLU width
    of attention blocks, the value width of GAU units) gives the parameter count nearest the
    target, the ``REFERENCE`` model's at its default SwiGLU width. The count is affine in
    ``w``; a mechanism whose count does not change with ``w`` is a ValueError."""
    target = count_parameters(base_model_config(REFERENCE, config))

    def at(width: int) -> LMConfig:
        return base_model_config(mechanism, config, ffn_hidden=width, gau_d_v=width)

    try:
        width = sizes.matched_width(at, target, WIDTH_STEP, count=count_parameters)
    except ValueError as error:
        raise ValueError(f"mechanism {mechanism!r} (spec {LONG_RANGE_SPECS[mechanism]!r}): {error}") from None
    return at(width), target


# --- one run ------------------------------------------------------------------------


def _train_batch(config: LongRangeConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    distances = torch.randint(config.min_distance, config.max_distance + 1, (config.batch_size,), generator=generator)
    return make_long_range_batch(config.batch_size, config.seq_len, distances, config.num_facts, config.vocab_size,
                                 generator)


def eval_length(distance: int, config: LongRangeConfig) -> int:
    """The evaluation sequence length at ``distance``: ``d + 2N + M``."""
    return distance + 2 * config.num_facts + config.eval_margin


def _eval_batches(distance: int, config: LongRangeConfig):
    generator = seeded_generator(config.seed, 3, distance)
    left = config.eval_sequences
    while left:
        size = min(left, config.eval_batch_size)
        left -= size
        yield make_long_range_batch(size, eval_length(distance, config), distance, config.num_facts,
                                    config.vocab_size, generator)


def train_run(mechanism: str, distances: Sequence[int], config: LongRangeConfig, *,
              on_step: Callable[[int, float], None] | None = None) -> dict:
    """Train the model of ``mechanism`` at ``config`` (its seed among them), evaluate it at
    every distance; its result row."""
    model_config, target = matched_model_config(mechanism, config)
    torch.manual_seed(seeded_generator(config.seed, 1).initial_seed())
    model = LM(model_config)
    train_data = seeded_generator(config.seed, 2)
    fit = fit_queries(model, partial(_train_batch, config, train_data), steps=config.steps, lr=config.lr,
                      weight_decay=config.weight_decay, warmup_fraction=config.warmup_fraction,
                      min_lr_ratio=config.min_lr_ratio, grad_clip=config.grad_clip, on_step=on_step)
    status = fit["status"]
    accuracy, loss, queries = {}, {}, {}
    for d in distances:
        result = evaluate_queries(model, _eval_batches(d, config)) if status == "ok" else None
        # A diverged run scores 0 and has no evaluation loss (None keeps results.json strict JSON).
        if result is None or not math.isfinite(result["loss"]):
            status = "non_finite"
            result = {"accuracy": 0.0, "loss": None, "queries": 0 if result is None else result["queries"]}
        accuracy[str(d)], loss[str(d)], queries[str(d)] = result["accuracy"], result["loss"], result["queries"]
    usage = model.codebook_usage()
    if usage is not None and not math.isfinite(usage["perplexity"]):
        usage["perplexity"] = None
    return {
        "mechanism": mechanism, "spec": LONG_RANGE_SPECS[mechanism], "width": model_config.ffn_hidden,
        "parameters": model.num_parameters(), "target_parameters": target,
        "accuracy": accuracy, "eval_loss": loss, "eval_queries": queries,
        "final_loss": fit["final_loss"], "steps": fit["steps"], "status": status,
        "train_seconds": fit["train_seconds"], "codebook_usage": usage, "loss_curve": fit["loss_curve"],
    }


# --- the grid -----------------------------------------------------------------------


ROW_IDENTITY = ("mechanism",)


def accuracy_metrics(run: dict) -> dict[str, float]:
    """A run's accuracy per distance as aggregated metrics ``accuracy@d``."""
    return {f"accuracy@{d}": value for d, value in run["accuracy"].items()}


def _run_key(run: tuple) -> dict:
    mechanism, distances, config = run
    return {"mechanism": mechanism, "distances": list(distances), "config": asdict(config)}


def _describe(row: dict) -> str:
    longest = list(row["accuracy"])[-1]
    return f"{row['mechanism']} acc@{longest} {row['accuracy'][longest]:.3f}"


def _step_text(run: tuple, step: int, loss: float) -> str:
    return f"{run[0]} seed {run[2].seed} step {step} loss {loss:.3f}"


def run_experiment(mechanisms: Sequence[str], distances: Sequence[int], config: LongRangeConfig, *,
                   seeds: Sequence[int], out_dir: Path, command: str, jobs: int = 1, threads: int | None = 1,
                   progress: bool = True, resume: bool = False, report_only: bool = False) -> dict:
    """Train every mechanism at every seed, evaluate at every distance, and write
    ``results.json`` (rows aggregated over the seeds, the per-seed runs), ``results.md`` and
    ``accuracy_vs_distance.png`` into ``out_dir``; journaled per (mechanism, seed)."""
    seeds = list(seeds)
    for seed in seeds:
        check_settings(mechanisms, distances, replace(config, seed=seed))
    distances = sorted(distances)
    runs = [(name, tuple(distances), replace(config, seed=seed)) for seed in seeds for name in mechanisms]
    grid = Grid(train=train_run, runs=runs, run_key=_run_key, seed_of=lambda run: run[2].seed, describe=_describe,
                label="repro long-range", progress_kwarg="on_step", step_text=_step_text)
    outcome = grids.run_journaled(grid, out_dir, spec=SPEC, jobs=jobs, threads=threads, progress=progress,
                                  resume=resume, report_only=report_only)
    settings = {key: value for key, value in asdict(config).items() if key != "seed"}
    metadata = framework.experiment_metadata(
        device="cpu", command=command, seconds=outcome.seconds, seeds=seeds, config=settings,
        distances=distances, mechanisms=list(mechanisms), jobs=jobs, threads=threads, reused_runs=outcome.reused,
        grid_runs=outcome.total, report_only=report_only, local_reach=local_reach(config.n_layers, config.window),
        shapes={"n_layers": config.n_layers, "d_model": config.d_model, "vocab_size": config.vocab_size,
                "train_seq_len": config.seq_len, "eval_seq_lens": [eval_length(d, config) for d in distances]})
    rows = spread.aggregate(outcome.rows, identity=ROW_IDENTITY, metrics=accuracy_metrics)
    markdown = page({"metadata": metadata, "rows": rows, "runs": outcome.rows})
    files = framework.write_results(out_dir, rows=rows, runs=outcome.rows, metadata=metadata, markdown=markdown,
                                    plot=partial(write_plot, outcome.rows, distances=distances, config=config,
                                                 local_reach=metadata["local_reach"]),
                                    plot_name="accuracy_vs_distance.png")
    return {"metadata": metadata, "rows": rows, "runs": outcome.rows, "markdown": markdown, "files": files}


# --- command line -------------------------------------------------------------------


SPEC = ExperimentSpec(
    name="long-range",
    help="recall of facts d tokens before their question, d from 16 to 4096 (past the training distance)",
    description=__doc__.split("\n\n", 1)[1],
    grid_axes=("mechanisms", "distances"),
    quick_help=(f"seconds: {QUICK['steps']} steps of {QUICK['batch_size']} x {QUICK['seq_len']} tokens, d "
                f"{QUICK['min_distance']}..{QUICK['max_distance']} in training, distances "
                f"{' '.join(map(str, QUICK_DISTANCES))}, {QUICK['eval_sequences']} sequences each, one seed "
                "(each unless given explicitly)"),
    seed_help="seed of data and initialisation (default %(default)s)",
    row="mechanism",
    default_threads=1,
    threads_help="torch intra-op CPU threads per run (default %(default)s)",
)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    d = LongRangeConfig()
    positive = int_at_least(1, "a positive integer")
    parser.add_argument("--mechanisms", nargs="+", choices=list(LONG_RANGE_SPECS), metavar="NAME",
                        help=f"mechanisms (default all: {' '.join(LONG_RANGE_SPECS)})")
    parser.add_argument("--distances", nargs="+", type=positive, metavar="D",
                        help=f"evaluation distances (default {' '.join(map(str, DEFAULT_DISTANCES))}; --quick "
                             f"{' '.join(map(str, QUICK_DISTANCES))})")
    parser.add_argument("--train-distances", nargs=2, type=int_at_least(0, "a distance"), metavar=("LO", "HI"),
                        help=f"training distances, uniform over LO..HI (default {d.min_distance} {d.max_distance}; "
                             f"--quick {QUICK['min_distance']} {QUICK['max_distance']})")
    parser.add_argument("--seq-len", type=positive,
                        help=f"training sequence length (default {d.seq_len}; --quick {QUICK['seq_len']})")
    parser.add_argument("--steps", type=positive, help=f"training steps (default {d.steps}; --quick {QUICK['steps']})")
    parser.add_argument("--batch-size", type=positive,
                        help=f"sequences per step (default {d.batch_size}; --quick {QUICK['batch_size']})")
    parser.add_argument("--facts", type=positive, default=d.num_facts,
                        help="facts (and questions) per sequence (default %(default)s)")
    parser.add_argument("--vocab-size", type=int_at_least(4, "a vocabulary size"), default=d.vocab_size,
                        help="keys [0, V/4), values [V/4, V/2), filler [V/2, V) (default %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=d.lr,
                        help="peak AdamW learning rate (default %(default)s)")
    parser.add_argument("--d-model", type=positive, default=d.d_model, help="model width (default %(default)s)")
    parser.add_argument("--n-layers", type=positive, default=d.n_layers, help="layers (default %(default)s)")
    framework.add_lm_arguments(parser, n_heads=d.n_heads, window=d.window, favor_features=None,
                               codebook_size=d.codebook_size, block_size=d.block_size, gau_d_k=d.gau_d_k)
    parser.add_argument("--eval-sequences", type=positive,
                        help=f"sequences per evaluation distance (default {d.eval_sequences}; --quick "
                             f"{QUICK['eval_sequences']})")
    parser.add_argument("--eval-batch-size", type=positive, default=d.eval_batch_size,
                        help="evaluation sequences per forward pass (default %(default)s)")
    parser.add_argument("--eval-margin", type=positive, default=d.eval_margin,
                        help="evaluation sequences are d + 2 * facts + this long; the facts start uniformly in "
                             "[0, this) (default %(default)s)")


def page(results: dict) -> str:
    """The page of ``results.json``'s contents: :func:`markdown_report` of its rows and runs,
    with the distances and ``LongRangeConfig`` its metadata records."""
    metadata, runs = results["metadata"], results["runs"]
    config = LongRangeConfig(**metadata["config"], seed=metadata["seeds"][0])
    return markdown_report(results["rows"], runs, distances=metadata["distances"], config=config, metadata=metadata,
                           note=metadata_interim_note(metadata, len(runs)))


def config_from_args(args: argparse.Namespace) -> LongRangeConfig:
    """The run settings of the command line (``--quick`` fills the flags not given)."""
    defaults = {**asdict(LongRangeConfig()), **(QUICK if args.quick else {})}

    def pick(name: str, value):
        return defaults[name] if value is None else value

    low, high = args.train_distances or (defaults["min_distance"], defaults["max_distance"])
    return LongRangeConfig(
        steps=pick("steps", args.steps), batch_size=pick("batch_size", args.batch_size),
        seq_len=pick("seq_len", args.seq_len), min_distance=low, max_distance=high, num_facts=args.facts,
        vocab_size=args.vocab_size, lr=args.lr, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
        window=args.window, codebook_size=args.codebook_size, block_size=args.block_size, gau_d_k=args.gau_d_k,
        eval_sequences=pick("eval_sequences", args.eval_sequences), eval_batch_size=args.eval_batch_size,
        eval_margin=args.eval_margin, seed=args.seed)


def _run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    mechanisms = list(dict.fromkeys(args.mechanisms or LONG_RANGE_SPECS))
    distances = list(args.distances or (QUICK_DISTANCES if args.quick else DEFAULT_DISTANCES))
    check_settings(mechanisms, distances, config)
    options = framework.run_options(args, SPEC)
    result = run_experiment(mechanisms, distances, config, **options)
    return framework.print_result(result)


command = Experiment(SPEC, add_arguments=_add_arguments, run=_run, page=page)
