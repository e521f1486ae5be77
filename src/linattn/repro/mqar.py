"""``linattn repro mqar``: multi-query associative recall (Zoology, Arora et al. 2023) per mechanism.

**Task** (``make_mqar_batch``; Zoology's ``multiquery_ar`` generator, same conventions).
Vocabulary ``V`` (default 8192), split in two: keys are drawn from ``[1, V/2)`` (id 0 is
left out, as Zoology reserves it as its "empty" marker before filling), values from
``[V/2, V)``; within a sequence the ``N`` keys are distinct, and so are the ``N`` values.
The first ``2N`` positions hold ``k1 v1 k2 v2 ... kN vN``. Each key is then asked once in
the remaining ``T - 2N`` positions: with ``space = (T - 2N) // 2`` slots at the even offsets
``2N + 2g`` (``g = 0 .. space-1``), the ``N`` slots are drawn without replacement with
probability proportional to ``(g + 1)^(a - 1)`` (``a = power_a``, default 0.01: a power law,
so most queries come soon after the pairs and a few far later), and the keys are assigned
to the drawn slots in random order. At a query position the input is the key and the
target -- the next-token prediction made there -- is the value paired with it; every other
position has target -100 (ignored). All non-pair, non-query positions are filler tokens
drawn uniformly from the whole vocabulary ``[0, V)`` (Zoology's ``random_non_queries=True``;
a filler token may therefore equal a key or a value, which only makes the task a little
noisier). ``T >= 4N`` is required (so that ``space >= N``), as in Zoology.

**Models.** A 2-layer ``linattn.models.LM`` (vocab ``V``, tied embeddings) per mechanism:
``softmax``, ``vq`` (Transformer-VQ GAU pairs; k-means codebook init, dead-code restart
below an EMA count of 0.5), ``delta`` (DeltaNet), ``linear-elu`` (kernel attention with
elu+1), ``favor`` (FAVOR+, fixed random features) and ``local`` (sliding-window softmax;
its window, default 32, is smaller than the sequences, so it must fail on long gaps). Widths
``d_model`` from a grid. Only the query positions are scored, so the model's output
projection is applied at those positions only (``query_logits``; the hidden states of every
position are still computed by ``LM.forward``) -- the full ``[B, T, V]`` logits would cost
more than the rest of the model.

**Training.** One model per (mechanism, d_model, (T, N)) and seed (``--seeds``, default 3):
AdamW (peak lr 1e-2, weight decay 0.1 on matrices and the embedding, betas 0.9/0.98), batch
64, a fixed number of steps (default 3000) with linear warm-up over the first 10 % and cosine
decay to 10 % of the peak, gradient clipping at 1.0, a fresh batch every step from a
generator seeded by (seed, T, N) --
every mechanism and width sees the same data at the same (T, N). Loss: cross-entropy over
the query positions plus the VQ commitment loss; ``update_codebooks()`` after every optimizer
step. Evaluation: accuracy (argmax over the whole vocabulary) on the query positions of fresh
held-out batches from a differently seeded generator. Chance is about 1 / (V/2). The lr is
one documented choice, not a sweep (docs/results.md).

**Grids.** The default grid is the one whose results are published (docs/results.md):
d_model 64, (T, N) in {(64, 4), (128, 8)}, 3000 steps. ``--quick`` is d_model 64, (64, 4),
300 steps, a smoke test. ``--resume`` continues an interrupted grid; the Zoology-sized grid
is ``--d-models 64 128 --lengths 64 128 256``. Every run is trained at ``--seeds`` seeds
(default 3; ``--quick`` 1). Report: ``mqar_report``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

from .._checks import check_fraction, check_int, check_positive_number, int_at_least, int_between, is_int
from .._checks import positive_float
from ..models import LM, LMConfig, uses_heads
from . import framework, grids, spread
from .framework import Experiment, ExperimentSpec, seeded_generator
from .grids import Grid
from .journal import RunJournal, metadata_interim_note
from .mqar_report import markdown_report, write_plot
from .query_task import IGNORE, evaluate_queries, fit_queries, query_logits, query_positions  # noqa: F401

# CLI name -> LMConfig attention spec ("local" gets its window appended).
MQAR_LAYER_SPECS = {
    "softmax": "softmax",
    "vq": "vq",
    "delta": "delta",
    "linear-elu": "linear:elu",
    "favor": "favor",
    "local": "local",
    "retnet": "retnet",
    "gla": "gla",
    "gated-delta": "gated-delta",
}

DEFAULT_LENGTHS = (64, 128)
DEFAULT_D_MODELS = (64,)
QUICK_LENGTHS = (64,)
QUICK_D_MODELS = (64,)
QUICK_STEPS = 300
D_MODEL_RANGE = (16, 256)  # the documented grid uses 64..256; smaller widths are for smoke tests


# --- task ---------------------------------------------------------------------------


def make_mqar_batch(
    batch_size: int,
    seq_len: int,
    num_pairs: int,
    vocab_size: int = 8192,
    power_a: float = 0.01,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MQAR batch (see the module docstring for the layout).

    Returns ``(inputs [B, T] int64, targets [B, T] int64)``; ``targets`` is -100 except at
    the ``num_pairs`` query positions of each row, where it is the value paired with the key
    at that position. ``generator`` (a CPU ``torch.Generator``) makes it reproducible.
    """
    check_int("batch_size", batch_size)
    check_int("num_pairs", num_pairs)
    check_int("seq_len", seq_len, minimum=4)
    check_int("vocab_size", vocab_size, minimum=4)
    if seq_len < 4 * num_pairs:
        raise ValueError(f"seq_len must be >= 4 * num_pairs (the pairs, and a query slot for each key at an even "
                         f"offset after them); got seq_len={seq_len}, num_pairs={num_pairs} "
                         f"(needs seq_len >= {4 * num_pairs})")
    half = vocab_size // 2
    if num_pairs > min(half - 1, vocab_size - half):
        raise ValueError(f"vocab_size={vocab_size} has {half - 1} key ids [1, {half}) and {vocab_size - half} value "
                         f"ids [{half}, {vocab_size}); too few for {num_pairs} distinct pairs")
    check_positive_number("power_a", power_a, finite=True)

    B, T, N = batch_size, seq_len, num_pairs
    # Distinct keys in [1, half) and distinct values in [half, V) per row.
    # (the N largest of i.i.d. uniforms: a uniformly random N-subset in uniformly random order)
    keys = 1 + torch.rand(B, half - 1, generator=generator).topk(N, dim=1).indices
    values = half + torch.rand(B, vocab_size - half, generator=generator).topk(N, dim=1).indices
    inputs = torch.randint(vocab_size, (B, T), generator=generator)  # filler
    inputs[:, 0 : 2 * N : 2] = keys
    inputs[:, 1 : 2 * N : 2] = values
    # Query slots: offsets 2N + 2g, g drawn without replacement with p(g) ∝ (g+1)^(a-1).
    space = (T - 2 * N) // 2
    weights = torch.arange(1, space + 1, dtype=torch.float64).pow(power_a - 1)
    gaps = torch.multinomial(weights.expand(B, space), N, replacement=False, generator=generator)
    positions = 2 * N + 2 * gaps  # [B, N]; key i is asked at positions[:, i]
    inputs.scatter_(1, positions, keys)
    targets = torch.full((B, T), IGNORE, dtype=torch.long)
    targets.scatter_(1, positions, values)
    return inputs, targets


# --- models and training ------------------------------------------------------------


@dataclass(frozen=True)
class MQARConfig:
    """Hyper-parameters shared by every run of a grid."""

    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-2
    weight_decay: float = 0.1
    warmup_fraction: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_batches: int = 4
    vocab_size: int = 8192
    power_a: float = 0.01
    n_heads: int = 2
    window: int = 32
    favor_features: int = 64
    codebook_size: int = 64
    block_size: int = 32
    gau_d_k: int = 64
    seed: int = 0

    def validate(self) -> None:
        for name in ("steps", "batch_size", "eval_batches", "vocab_size", "n_heads", "window", "favor_features",
                     "codebook_size", "block_size", "gau_d_k"):
            check_int(name, getattr(self, name))
        for name in ("lr", "power_a", "grad_clip"):
            check_positive_number(name, getattr(self, name), finite=True)
        for name in ("weight_decay", "warmup_fraction", "min_lr_ratio"):
            check_fraction(name, getattr(self, name))


def attention_spec(mechanism: str, config: MQARConfig) -> str:
    """The ``LMConfig.attention`` spec of a mechanism name (``local`` -> ``local:WINDOW``)."""
    if mechanism not in MQAR_LAYER_SPECS:
        raise ValueError(f"unknown mechanism {mechanism!r}; choose from {', '.join(MQAR_LAYER_SPECS)}")
    spec = MQAR_LAYER_SPECS[mechanism]
    return f"local:{config.window}" if spec == "local" else spec


def model_config(mechanism: str, d_model: int, config: MQARConfig) -> LMConfig:
    """The 2-layer LM of one run."""
    check_int("d_model", d_model)
    if d_model % config.n_heads:
        raise ValueError(f"d_model={d_model} must be divisible by n_heads={config.n_heads}")
    spec = attention_spec(mechanism, config)
    return LMConfig(
        vocab_size=config.vocab_size, d_model=d_model, n_layers=2, attention=spec,
        n_heads=config.n_heads if uses_heads(spec) else None, favor_features=config.favor_features,
        feature_seed=config.seed,
        codebook_size=config.codebook_size, block_size=config.block_size, gau_d_k=config.gau_d_k,
        kmeans_init=True, dead_code_threshold=0.5, chunk_size=32,
    )


def default_pairs(seq_len: int) -> int:
    """Pairs for a length when ``--pairs`` is not given: ``T / 16`` (at least 1)."""
    return max(1, seq_len // 16)


def evaluate(model: LM, seq_len: int, num_pairs: int, config: MQARConfig, generator: torch.Generator) -> dict:
    """Accuracy and mean cross-entropy on the query positions of ``eval_batches`` fresh batches."""
    return evaluate_queries(model, (make_mqar_batch(config.batch_size, seq_len, num_pairs, config.vocab_size,
                                                    config.power_a, generator) for _ in range(config.eval_batches)))


def train_run(
    mechanism: str,
    d_model: int,
    seq_len: int,
    num_pairs: int,
    config: MQARConfig,
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> dict:
    """Train one model for ``config.steps`` steps, evaluate it, return its result row."""
    model_cfg = model_config(mechanism, d_model, config)
    make_mqar_batch(1, seq_len, num_pairs, config.vocab_size, config.power_a)  # validate the sizes up front
    torch.manual_seed(seeded_generator(config.seed, d_model, seq_len, num_pairs, 1).initial_seed())
    model = LM(model_cfg)
    train_data = seeded_generator(config.seed, seq_len, num_pairs, 2)
    eval_data = seeded_generator(config.seed, seq_len, num_pairs, 3)
    start = time.perf_counter()
    # Matrices and the embedding decay (the published MQAR runs were trained so); norms, biases not.
    fit = fit_queries(model, lambda: make_mqar_batch(config.batch_size, seq_len, num_pairs, config.vocab_size,
                                                     config.power_a, train_data),
                      steps=config.steps, lr=config.lr, weight_decay=config.weight_decay,
                      warmup_fraction=config.warmup_fraction, min_lr_ratio=config.min_lr_ratio,
                      grad_clip=config.grad_clip, on_step=on_step)
    status = fit["status"]
    # A diverged run scores 0 and has no evaluation loss (None keeps results.json strict JSON).
    result = evaluate(model, seq_len, num_pairs, config, eval_data) if status == "ok" else None
    if result is None or not math.isfinite(result["loss"]):
        status = "non_finite"
        result = {"accuracy": 0.0, "loss": None, "queries": 0 if result is None else result["queries"]}
    usage = model.codebook_usage()
    if usage is not None and not math.isfinite(usage["perplexity"]):
        usage["perplexity"] = None
    return {
        "mechanism": mechanism,
        "spec": model_cfg.attention,
        "d_model": d_model,
        "seq_len": seq_len,
        "num_pairs": num_pairs,
        "accuracy": result["accuracy"],
        "eval_loss": result["loss"],
        "eval_queries": result["queries"],
        "final_loss": fit["final_loss"],  # mean train CE of the last 20 steps
        "steps": fit["steps"],
        "status": status,
        "seconds": time.perf_counter() - start,
        "train_seconds": fit["train_seconds"],
        "parameters": model.num_parameters(),
        "codebook_usage": usage,
        "loss_curve": fit["loss_curve"],
    }


# --- grids --------------------------------------------------------------------------


def _run_key(run: tuple) -> dict:
    """What identifies a run of the grid in the journal: its arguments and configuration."""
    mechanism, d_model, seq_len, num_pairs, config = run
    return {"mechanism": mechanism, "d_model": d_model, "seq_len": seq_len, "num_pairs": num_pairs,
            "config": asdict(config)}


def _describe(row: dict) -> str:
    return f"{row['mechanism']} d={row['d_model']} T={row['seq_len']} N={row['num_pairs']} acc {row['accuracy']:.3f}"


def _step_text(run: tuple, step: int, loss: float) -> str:
    name, d_model, seq_len, num_pairs, _ = run
    return f"{name} d={d_model} T={seq_len} N={num_pairs} step {step} loss {loss:.3f}"


def check_grid(mechanisms: Sequence[str], d_models: Sequence[int], tasks: Sequence[tuple[int, int]],
               config: MQARConfig) -> None:
    """Every value of the grid, before anything is trained: a clear ValueError otherwise."""
    if not mechanisms or not d_models or not tasks:
        raise ValueError("need at least one mechanism, one d_model and one sequence length")
    unknown = [m for m in mechanisms if m not in MQAR_LAYER_SPECS]
    if unknown:
        raise ValueError(f"unknown mechanism(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(MQAR_LAYER_SPECS)}")
    config.validate()
    low, high = D_MODEL_RANGE
    for d in d_models:
        if not is_int(d) or not low <= d <= high:
            raise ValueError(f"d_model must be an int in [{low}, {high}], got {d!r}")
        if d % config.n_heads:
            raise ValueError(f"d_model={d} must be divisible by n_heads={config.n_heads}")
    for seq_len, num_pairs in tasks:
        make_mqar_batch(1, seq_len, num_pairs, config.vocab_size, config.power_a)


# A row of the report: one (mechanism, d_model, (T, N)), over its seeds.
ROW_IDENTITY = ("mechanism", "d_model", "seq_len", "num_pairs")


def _seed_of(run: tuple) -> int:
    return run[4].seed


def _grid(mechanisms: Sequence[str], d_models: Sequence[int], tasks: Sequence[tuple[int, int]],
          config: MQARConfig, seeds: Sequence[int]) -> Grid:
    """Every (mechanism, d_model, (T, N)) run at every seed: seeds outer, then that nesting
    order; a seed's runs use ``config`` with that seed."""
    return Grid(train=train_run,
                runs=[(name, d, t, n, replace(config, seed=seed)) for seed in seeds for name in mechanisms
                      for d in d_models for t, n in tasks],
                run_key=_run_key, seed_of=_seed_of, describe=_describe, label="repro mqar", progress_kwarg="on_step",
                step_text=_step_text)


def _seeds(config: MQARConfig, seeds: Sequence[int] | None) -> list[int]:
    seeds = [config.seed] if seeds is None else list(seeds)
    if not seeds or not all(is_int(seed) for seed in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct ints (at least one), got {seeds!r}")
    return seeds


def run_grid(mechanisms: Sequence[str], d_models: Sequence[int], tasks: Sequence[tuple[int, int]],
             config: MQARConfig, *, seeds: Sequence[int] | None = None, jobs: int = 1, threads: int = 1,
             progress: bool = True, journal: RunJournal | None = None) -> list[dict]:
    """Every (mechanism, d_model, (T, N)) run at every seed (default ``[config.seed]``), in
    grid order, with a tqdm bar over runs.

    ``jobs > 1`` trains that many runs at once in worker processes (spawned, ``threads``
    torch threads each). Runs are independent and seeded, so the rows do not depend on
    ``jobs``. With a ``journal``, runs recorded there are reused and new ones recorded.
    """
    check_grid(mechanisms, d_models, tasks, config)
    return grids.run_grid(_grid(mechanisms, d_models, tasks, config, _seeds(config, seeds)), jobs=jobs,
                          threads=threads, progress=progress, journal=journal)


def run_experiment(mechanisms: Sequence[str], d_models: Sequence[int], tasks: Sequence[tuple[int, int]],
                   config: MQARConfig, *, out_dir: Path, command: str, seeds: Sequence[int] | None = None,
                   jobs: int = 1, threads: int = 1, progress: bool = True, resume: bool = False,
                   report_only: bool = False) -> dict:
    """Run the grid at every seed (default ``[config.seed]``) and write ``results.json`` (rows
    aggregated over the seeds, and the per-seed runs), ``results.md`` and ``mqar_accuracy.png``
    into ``out_dir``.

    Each finished run is recorded in ``out_dir/runs.jsonl`` at once; ``resume=True`` reuses
    the runs recorded there (same mechanism, d_model, task, seed and configuration);
    ``report_only=True`` trains nothing and reports the grid's runs recorded so far.
    """
    check_grid(mechanisms, d_models, tasks, config)
    seeds = _seeds(config, seeds)
    outcome = grids.run_journaled(_grid(mechanisms, d_models, tasks, config, seeds), out_dir, spec=SPEC,
                                  jobs=jobs, threads=threads, progress=progress, resume=resume,
                                  report_only=report_only)
    shapes = {"n_layers": 2, "vocab_size": config.vocab_size, "d_models": list(d_models),
              "tasks": [{"seq_len": t, "num_pairs": n} for t, n in tasks]}
    metadata = framework.experiment_metadata(
        device="cpu", command=command, shapes=shapes, seconds=outcome.seconds, config=asdict(config), seeds=seeds,
        mechanisms=list(mechanisms), jobs=jobs, threads=threads, reused_runs=outcome.reused,
        grid_runs=outcome.total, report_only=report_only,
        paper="Arora et al. 2023, Zoology: Measuring and Improving Recall in Efficient Language Models")
    rows = spread.aggregate(outcome.rows, identity=ROW_IDENTITY)
    markdown = page({"metadata": metadata, "rows": rows, "runs": outcome.rows})
    files = framework.write_results(out_dir, rows=rows, runs=outcome.rows, metadata=metadata, markdown=markdown,
                                    plot=partial(write_plot, rows), plot_name="mqar_accuracy.png")
    return {"metadata": metadata, "rows": rows, "runs": outcome.rows, "markdown": markdown, "files": files}


def page(results: dict) -> str:
    """The page of ``results.json``'s contents: :func:`markdown_report` of its rows and runs,
    with the command and ``MQARConfig`` its metadata records."""
    metadata, runs = results["metadata"], results["runs"]
    return markdown_report(results["rows"], runs, command=metadata["command"], config=MQARConfig(**metadata["config"]),
                           metadata=metadata, note=metadata_interim_note(metadata, len(runs)))


# --- command line -------------------------------------------------------------------


SPEC = ExperimentSpec(
    name="mqar",
    help="multi-query associative recall (Zoology): accuracy per mechanism, width and sequence length",
    description=__doc__.split("\n\n", 1)[1],
    grid_axes=("mechanisms", "widths", "(T, N) tasks"),
    quick_help=(f"a few minutes: d_model {' '.join(map(str, QUICK_D_MODELS))}, T "
                f"{' '.join(map(str, QUICK_LENGTHS))}, {QUICK_STEPS} steps, one seed (each unless given explicitly)"),
    seed_help="seed of data, initialisation and features (default %(default)s)",
    default_threads=1,
    row="(mechanism, width, task)",
    threads_help="torch intra-op CPU threads per run (default %(default)s)",
)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MQARConfig()
    parser.add_argument("--mechanisms", nargs="+", choices=list(MQAR_LAYER_SPECS), metavar="NAME",
                        help=f"mechanisms (default all: {' '.join(MQAR_LAYER_SPECS)})")
    parser.add_argument("--d-models", nargs="+", type=int_between(*D_MODEL_RANGE, "a d_model"), metavar="D",
                        help=f"model widths (default {' '.join(map(str, DEFAULT_D_MODELS))}; --quick "
                             f"{' '.join(map(str, QUICK_D_MODELS))})")
    parser.add_argument("--lengths", nargs="+", type=int_at_least(4, "a sequence length"), metavar="T",
                        help=f"sequence lengths (default {' '.join(map(str, DEFAULT_LENGTHS))}; --quick "
                             f"{' '.join(map(str, QUICK_LENGTHS))})")
    parser.add_argument("--pairs", nargs="+", type=int_at_least(1, "a number of pairs"), metavar="N",
                        help="key-value pairs per length (one per --lengths entry, or one for all; default T/16)")
    parser.add_argument("--steps", type=int_at_least(1, "a step count"),
                        help=f"training steps per run (default {d.steps}; --quick {QUICK_STEPS})")
    parser.add_argument("--batch-size", type=int_at_least(1, "a batch size"), default=d.batch_size,
                        help="sequences per training step (default %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=d.lr,
                        help="peak AdamW learning rate (default %(default)s)")
    parser.add_argument("--eval-batches", type=int_at_least(1, "a count"), default=d.eval_batches,
                        help="held-out batches (of --batch-size sequences) for the accuracy (default %(default)s)")
    parser.add_argument("--vocab-size", type=int_at_least(4, "a vocabulary size"), default=d.vocab_size,
                        help="keys from [1, V/2), values from [V/2, V) (default %(default)s, as Zoology)")
    parser.add_argument("--power-a", type=positive_float, default=d.power_a,
                        help="power-law exponent a of the query gaps (p ∝ gap^(a-1); default %(default)s)")
    framework.add_lm_arguments(parser, n_heads=d.n_heads, window=d.window, favor_features=d.favor_features,
                               codebook_size=d.codebook_size, block_size=d.block_size, gau_d_k=d.gau_d_k)


def resolve_tasks(lengths: Sequence[int], pairs: Sequence[int] | None) -> list[tuple[int, int]]:
    """(T, N) per length: ``pairs`` has one entry per length, a single entry for all, or None (T/16)."""
    if pairs is None:
        return [(t, default_pairs(t)) for t in lengths]
    if len(pairs) == 1:
        pairs = list(pairs) * len(lengths)
    if len(pairs) != len(lengths):
        raise ValueError(f"--pairs needs one value or one per length ({len(lengths)}), got {len(pairs)}")
    return list(dict.fromkeys(zip(lengths, pairs)))


def _run(args: argparse.Namespace) -> int:
    options = framework.run_options(args, SPEC)
    mechanisms = list(dict.fromkeys(args.mechanisms or MQAR_LAYER_SPECS))
    d_models = list(dict.fromkeys(args.d_models or (QUICK_D_MODELS if args.quick else DEFAULT_D_MODELS)))
    tasks = resolve_tasks(list(args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)), args.pairs)
    config = MQARConfig(
        steps=args.steps or (QUICK_STEPS if args.quick else MQARConfig().steps), batch_size=args.batch_size,
        lr=args.lr, eval_batches=args.eval_batches, vocab_size=args.vocab_size, power_a=args.power_a,
        n_heads=args.n_heads, window=args.window, favor_features=args.favor_features,
        codebook_size=args.codebook_size, block_size=args.block_size, gau_d_k=args.gau_d_k, seed=args.seed,
    )
    return framework.print_result(run_experiment(mechanisms, d_models, tasks, config, **options))


command = Experiment(SPEC, add_arguments=_add_arguments, run=_run, page=page)
