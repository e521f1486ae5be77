"""Synthetic associative retrieval of "Linear Transformers Are Secretly Fast Weight Programmers"
(Schlag, Irie & Schmidhuber 2021; seed 001, Sec. 6.1), on top of ``linattn``'s ops:
``linattn repro fwp-capacity`` and ``linattn repro fwp-update-rule``.

**Task.** ``S`` keys and ``S`` values. The input is a sequence of ``L`` (key, value) pairs
followed by a query, one of the keys in the sequence; the target is the value paired with
it. Values are fixed one-hot vectors in ``R^S``; keys are learned embeddings ``e(key)``.

- Setting 1 (capacity, ``make_capacity_batch``): ``L = S``, keys and values drawn *without*
  replacement, so each sequence is a random one-to-one pairing of all S keys with all S
  values. A kernel's memory holds ``d_dot`` orthogonal keys: retrieval should fail once S
  exceeds ``d_dot``; softmax attention keeps every pair and holds far longer.
- Setting 2 (update rules, ``make_update_rule_batch``): ``L = 2S``, keys and values drawn
  *with* replacement; the target of a query is the value of the key's *last* occurrence,
  so the memory must overwrite associations. Only the delta rule can.

**Model**: ``fwp_model`` (one single-head attention layer; the mechanisms of
``RETRIEVAL_MECHANISMS``). Loss ``retrieval_loss``: ``1/2 sum_j (onehot(v*)_j - v_hat_j)^2``,
mean over queries. Report tables and plot: ``fwp_report``.

**Training** (as in the official code): Adam, lr 1e-3, batch 32; every 100 steps an
evaluation on fresh sequences asking every key (Setting 2: every distinct key in the
sequence); stop when the evaluation loss is <= 1e-3, after ``patience`` evaluations without
improvement, or at ``max_steps``. The reported loss is that of the last evaluation. Each
(mechanism, S) is trained at ``--seeds`` seeds, default 1: the verdicts are thresholds, and
with several seeds a size counts as solved only when every seed solved it (``fwp_report``).
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
import torch.nn.functional as F

from .._checks import check_cuda_available, check_int, check_positive_number, int_at_least, is_int, positive_float
from ..train.optim import parameter_groups
from . import framework, grids, spread
from .framework import Experiment, ExperimentSpec, seeded_generator
from .fwp_model import RETRIEVAL_MECHANISMS, RetrievalMechanism, RetrievalModel
from .fwp_report import markdown_report, summarize, write_plot
from .grids import Grid
from .journal import RunJournal, interim_note, reuse_note

# --- task ---------------------------------------------------------------------------


@dataclass
class RetrievalBatch:
    """One batch of retrieval problems.

    ``keys``, ``values``: ``[B, L]`` ids in ``[0, S)`` of the written pairs.
    ``queries``: ``[B, Q]`` key ids asked after the pairs; ``targets``: ``[B, Q]`` value ids
    expected; ``mask``: ``[B, Q]`` which queries count (padding is False).
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor

    def to(self, device) -> "RetrievalBatch":
        return RetrievalBatch(*(getattr(self, f).to(device) for f in ("keys", "values", "queries", "targets", "mask")))


def _check_sizes(batch_size: int, num_keys: int, seq_len: int, num_queries: int | None) -> None:
    check_int("batch_size", batch_size)
    check_int("num_keys", num_keys, minimum=2)
    check_int("seq_len", seq_len)
    check_int("num_queries", num_queries, optional=True)  # None: every key


def make_capacity_batch(
    batch_size: int,
    num_keys: int,
    *,
    num_queries: int | None = 1,
    seq_len: int | None = None,
    generator: torch.Generator | None = None,
) -> RetrievalBatch:
    """Setting 1: ``seq_len`` (default ``num_keys``) pairs drawn without replacement.

    Each sequence pairs distinct keys with distinct values (the first ``seq_len`` entries of
    two independent random permutations of ``[0, S)``). ``num_queries=None`` asks every key
    of the sequence (in random order); an int asks that many distinct keys of it.
    """
    seq_len = num_keys if seq_len is None else seq_len
    _check_sizes(batch_size, num_keys, seq_len, num_queries)
    if seq_len > num_keys:
        raise ValueError(f"without replacement seq_len ({seq_len}) cannot exceed num_keys ({num_keys})")
    n = seq_len if num_queries is None else num_queries
    if n > seq_len:
        raise ValueError(f"num_queries ({n}) cannot exceed the {seq_len} distinct keys of a sequence")
    keys = torch.stack([torch.randperm(num_keys, generator=generator)[:seq_len] for _ in range(batch_size)])
    values = torch.stack([torch.randperm(num_keys, generator=generator)[:seq_len] for _ in range(batch_size)])
    positions = torch.stack([torch.randperm(seq_len, generator=generator)[:n] for _ in range(batch_size)])
    return RetrievalBatch(
        keys=keys,
        values=values,
        queries=keys.gather(1, positions),
        targets=values.gather(1, positions),
        mask=torch.ones(batch_size, n, dtype=torch.bool),
    )


def last_occurrence(keys: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[B, S]``: position of the last occurrence of each key id in ``keys [B, L]`` (-1 if absent)."""
    positions = torch.arange(keys.shape[1]).expand_as(keys)
    last = torch.full((keys.shape[0], num_keys), -1, dtype=torch.long)
    return last.scatter_reduce(1, keys, positions, reduce="amax", include_self=True)


def make_update_rule_batch(
    batch_size: int,
    num_keys: int,
    *,
    num_queries: int | None = 1,
    seq_len: int | None = None,
    generator: torch.Generator | None = None,
) -> RetrievalBatch:
    """Setting 2: ``seq_len`` (default ``2 * num_keys``) pairs drawn with replacement.

    The target of a query is the value at the key's *last* occurrence. ``num_queries=1``
    (or any int) draws query positions uniformly, as the official code does (frequent keys
    are asked more often); ``None`` asks every key that occurs, once: ``queries`` is then
    ``[B, S]`` (key id order) with ``mask`` False for the keys absent from the sequence.
    """
    seq_len = 2 * num_keys if seq_len is None else seq_len
    _check_sizes(batch_size, num_keys, seq_len, num_queries)
    keys = torch.randint(num_keys, (batch_size, seq_len), generator=generator)
    values = torch.randint(num_keys, (batch_size, seq_len), generator=generator)
    last = last_occurrence(keys, num_keys)
    if num_queries is None:
        queries = torch.arange(num_keys).expand(batch_size, num_keys).clone()
        mask = last >= 0
        targets = torch.where(mask, values.gather(1, last.clamp(min=0)), torch.zeros_like(last))
        return RetrievalBatch(keys, values, queries, targets, mask)
    positions = torch.randint(seq_len, (batch_size, num_queries), generator=generator)
    queries = keys.gather(1, positions)
    targets = values.gather(1, last.gather(1, queries))
    return RetrievalBatch(keys, values, queries, targets, torch.ones(batch_size, num_queries, dtype=torch.bool))


def retrieval_loss(pred: torch.Tensor, batch: RetrievalBatch) -> torch.Tensor:
    """``1/2 sum_j (onehot(target)_j - pred_j)^2``, mean over the masked-in queries."""
    target = F.one_hot(batch.targets, pred.shape[-1]).to(pred.dtype)
    per_query = 0.5 * (target - pred).pow(2).sum(-1)
    mask = batch.mask.to(pred.dtype)
    return (per_query * mask).sum() / mask.sum()


# --- training -----------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One of the paper's two settings: its data generator and its sequence length."""

    name: str
    title: str
    make_batch: Callable[..., RetrievalBatch]
    seq_len: Callable[[int], int]


SETTINGS = {
    "capacity": Setting("capacity", "Setting 1: capacity (L = S, without replacement)", make_capacity_batch,
                        lambda s: s),
    "update-rule": Setting("update-rule", "Setting 2: update rules (L = 2S, with replacement, last value wins)",
                           make_update_rule_batch, lambda s: 2 * s),
}


@dataclass(frozen=True)
class RetrievalTrainConfig:
    """Hyper-parameters of every run (defaults: the paper's official code, except max_steps)."""

    key_dim: int = 64
    emb_dim: int | None = None  # None: int(1.1 * 2S)
    batch_size: int = 32
    lr: float = 1e-3
    max_steps: int = 20000
    eval_every: int = 100
    eval_sequences: int = 20
    patience: int = 10
    target_loss: float = 1e-3
    seed: int = 0
    device: str = "cpu"

    def validate(self) -> None:
        for name in ("key_dim", "batch_size", "max_steps", "eval_every", "eval_sequences", "patience"):
            check_int(name, getattr(self, name))
        check_int("emb_dim", self.emb_dim, optional=True)
        for name in ("lr", "target_loss"):
            check_positive_number(name, getattr(self, name), finite=True)
        check_cuda_available("device", self.device)


@torch.no_grad()
def evaluate(model: RetrievalModel, setting: Setting, config: RetrievalTrainConfig,
             generator: torch.Generator) -> tuple[float, float]:
    """(loss, accuracy of argmax retrieval) on ``eval_sequences`` fresh sequences, every key asked."""
    model.eval()
    batch = setting.make_batch(config.eval_sequences, model.num_keys, num_queries=None, generator=generator)
    batch = batch.to(config.device)
    pred = model(batch.keys, batch.values, batch.queries)
    loss = retrieval_loss(pred, batch).item()
    hits = (pred.argmax(-1) == batch.targets) & batch.mask
    model.train()
    return loss, (hits.sum() / batch.mask.sum()).item()


def train_run(setting: Setting, mechanism: RetrievalMechanism, num_keys: int, config: RetrievalTrainConfig, *,
              on_eval: Callable[[int, float], None] | None = None) -> dict:
    """Train one model on one size S until the stop criterion; return its result row.

    Data, initialisation and FAVOR+ projection depend on (seed, S) only, so every mechanism
    sees the same sequences at the same S. Adam without weight decay, as the paper's code
    (``parameter_groups`` with decay 0: the groups change no update).
    """
    check_int("the number of keys S", num_keys, minimum=2)
    torch.manual_seed(seeded_generator(config.seed, num_keys, 1).initial_seed())
    model = RetrievalModel(num_keys, mechanism, key_dim=config.key_dim, emb_dim=config.emb_dim,
                           feature_seed=config.seed * 7919 + num_keys).to(config.device)
    optimizer = torch.optim.Adam(parameter_groups(model, 0.0), lr=config.lr)
    train_data = seeded_generator(config.seed, num_keys, 2)
    eval_data = seeded_generator(config.seed, num_keys, 3)

    curve: list[list[float]] = []
    best, since_best, stop_reason = math.inf, 0, "max_steps"
    accuracy = math.nan
    start, cpu_start = time.perf_counter(), time.process_time()
    step = 0
    for step in range(1, config.max_steps + 1):
        batch = setting.make_batch(config.batch_size, num_keys, num_queries=1, generator=train_data).to(config.device)
        loss = retrieval_loss(model(batch.keys, batch.values, batch.queries), batch)
        if not torch.isfinite(loss):
            stop_reason = "non_finite"
            curve.append([step, math.nan])
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % config.eval_every and step != config.max_steps:
            continue
        eval_loss, accuracy = evaluate(model, setting, config, eval_data)
        curve.append([step, eval_loss])
        if on_eval is not None:
            on_eval(step, eval_loss)
        if eval_loss < best:
            best, since_best = eval_loss, 0
        else:
            since_best += 1
        if eval_loss <= config.target_loss:
            stop_reason = "target"
            break
        if since_best >= config.patience:
            stop_reason = "plateau"
            break
    final = curve[-1][1] if curve else math.nan
    return {
        "mechanism": mechanism.name,
        "label": mechanism.label,
        "rule": mechanism.rule,
        "feature_map": mechanism.feature_map,
        "normalize": mechanism.normalize,
        "d_dot": mechanism.d_dot(config.key_dim),
        "size": num_keys,
        "seq_len": setting.seq_len(num_keys),
        "emb_dim": model.emb_dim,
        "final_eval_loss": final,
        "best_eval_loss": best if math.isfinite(best) else None,
        "final_eval_accuracy": accuracy,
        "steps": step,
        "evaluations": len(curve),
        "stop_reason": stop_reason,
        "train_seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,  # this process, all threads
        "curve": curve,
    }


# --- grids --------------------------------------------------------------------------


def _train_named(setting_name: str, mechanism: str, num_keys: int, config: RetrievalTrainConfig,
                 on_eval: Callable[[int, float], None] | None = None) -> dict:
    """``train_run`` by names (picklable for worker processes)."""
    return train_run(SETTINGS[setting_name], RETRIEVAL_MECHANISMS[mechanism], num_keys, config, on_eval=on_eval)


def _run_key(run: tuple) -> dict:
    """What identifies a run of the grid in the journal: its arguments and configuration."""
    setting_name, mechanism, size, config = run
    return {"setting": setting_name, "mechanism": mechanism, "size": size, "config": asdict(config)}


def _describe(row: dict) -> str:
    return f"{row['mechanism']} S={row['size']} loss {row['final_eval_loss']:.2e}"


def _eval_text(run: tuple, step: int, loss: float) -> str:
    _, name, size, _ = run
    return f"{name} S={size} step {step} loss {loss:.2e}"


def check_grid(mechanisms: Sequence[str], sizes: Sequence[int], config: RetrievalTrainConfig) -> None:
    """Every value of the grid, before anything is trained or written: a ValueError otherwise."""
    unknown = [m for m in mechanisms if m not in RETRIEVAL_MECHANISMS]
    if unknown:
        raise ValueError(f"unknown mechanism(s) {', '.join(unknown)}; choose from {', '.join(RETRIEVAL_MECHANISMS)}")
    bad = [s for s in sizes if not is_int(s) or s < 2]
    if bad:
        raise ValueError(f"sizes S must be ints >= 2, got {bad}")
    if not mechanisms or not sizes:
        raise ValueError("need at least one mechanism and one size")
    config.validate()


# A row of the report: one (mechanism, S), over its seeds; what describes it rather than results.
ROW_IDENTITY = ("mechanism", "size")
ROW_CONSTANTS = ("label", "rule", "feature_map", "normalize", "d_dot", "seq_len", "emb_dim")


def _seed_of(run: tuple) -> int:
    return run[3].seed


def _seeds(config: RetrievalTrainConfig, seeds: Sequence[int] | None) -> list[int]:
    seeds = [config.seed] if seeds is None else list(seeds)
    if not seeds or not all(is_int(seed) for seed in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct ints (at least one), got {seeds!r}")
    return seeds


def _grid(setting: Setting, mechanisms: Sequence[str], sizes: Sequence[int], config: RetrievalTrainConfig,
          seeds: Sequence[int]) -> Grid:
    """Every (mechanism, S) run at every seed: seeds outer, then mechanisms; a seed's runs use
    ``config`` with that seed."""
    return Grid(train=_train_named, runs=[(setting.name, name, size, replace(config, seed=seed)) for seed in seeds
                                          for name in mechanisms for size in sizes],
                run_key=_run_key, seed_of=_seed_of, describe=_describe, label=f"fwp {setting.name}",
                progress_kwarg="on_eval", step_text=_eval_text)


def run_grid(setting: Setting, mechanisms: Sequence[str], sizes: Sequence[int], config: RetrievalTrainConfig, *,
             seeds: Sequence[int] | None = None, jobs: int = 1, threads: int | None = None, progress: bool = True,
             journal: RunJournal | None = None, only_recorded: bool = False) -> list[dict]:
    """Every (mechanism, S) run at every seed (default ``[config.seed]``), mechanisms outer,
    with a tqdm bar over runs; ``jobs > 1`` trains that many at once in worker processes with
    ``threads`` torch threads each. With a ``journal``, runs recorded there are reused and new
    ones recorded; ``only_recorded=True`` returns just the recorded ones, training nothing."""
    check_grid(mechanisms, sizes, config)
    return grids.run_grid(_grid(setting, mechanisms, sizes, config, _seeds(config, seeds)), jobs=jobs,
                          threads=threads, progress=progress, journal=journal, only_recorded=only_recorded)


# --- experiments --------------------------------------------------------------------


@dataclass(frozen=True)
class RetrievalSpec:
    """A command's defaults: its subcommand, setting, grid, mechanisms and plot."""

    command: str
    help: str
    description: str
    setting: str
    default_sizes: tuple[int, ...]
    quick_sizes: tuple[int, ...]
    default_mechanisms: tuple[str, ...]
    quick_mechanisms: tuple[str, ...]
    default_max_steps: int
    quick_max_steps: int
    plot_name: str
    mark_d_dot: bool

    @property
    def experiment(self) -> ExperimentSpec:
        """The subcommand and its shared flags."""
        quick = (f"a few-minute preview: S = {' '.join(map(str, self.quick_sizes))}, mechanisms "
                 f"{' '.join(self.quick_mechanisms)}, at most {self.quick_max_steps} steps per run "
                 "(each unless given explicitly)")
        return ExperimentSpec(self.command, self.help, self.description, grid_axes=("mechanisms", "sizes"),
                              quick_help=quick,
                              seed_help="seed of data, initialisation and FAVOR+ projections (default %(default)s)",
                              row="(mechanism, S)", default_seeds=1)


CAPACITY = RetrievalSpec(
    command="fwp-capacity",
    help="FWP paper Setting 1: retrieval loss vs number of keys S per kernel (capacity ~ d_dot)",
    description=(
        "Reproduces Setting 1 of 'Linear Transformers Are Secretly Fast Weight Programmers' (seed 001): one "
        "attention layer (d_key 64) reads S one-to-one key/value pairs (L = S, without replacement) and retrieves "
        "the value of a queried key. Trains one model per (mechanism, S) with Adam until the evaluation loss is "
        "<= 1e-3 or stops improving, and writes the final losses and accuracies (results.json, results.md, and "
        "fwp_capacity.png: both against S) to --out. Expected: each kernel fails once S exceeds its d_dot; "
        "softmax holds far longer."),
    setting="capacity",
    default_sizes=tuple(range(20, 601, 20)),
    quick_sizes=(40, 80, 160),
    default_mechanisms=("linear-elu", "dpfp-1", "dpfp-2", "dpfp-3", "favor-64", "favor-128", "favor-512", "softmax"),
    quick_mechanisms=("linear-elu", "dpfp-1", "dpfp-2", "favor-128", "softmax"),
    default_max_steps=20000,
    quick_max_steps=1000,
    plot_name="fwp_capacity.png",
    mark_d_dot=True,
)

UPDATE_RULE = RetrievalSpec(
    command="fwp-update-rule",
    help="FWP paper Setting 2: sum rule vs delta rule when keys repeat (L = 2S, last value wins)",
    description=(
        "Reproduces Setting 2 of 'Linear Transformers Are Secretly Fast Weight Programmers' (seed 001): L = 2S "
        "pairs drawn with replacement, the target is the value at the queried key's last occurrence. Compares the "
        "sum update rule of linear attention (sum-dpfp-1) with the delta rule (delta-dpfp-1, delta-dpfp-2, "
        "delta-linear); writes results.json, results.md and fwp_update_rule.png to --out. Expected: only the delta "
        "rule solves it."),
    setting="update-rule",
    default_sizes=tuple(range(20, 201, 20)),
    quick_sizes=(20, 40, 60),
    default_mechanisms=("sum-dpfp-1", "delta-dpfp-1", "delta-dpfp-2", "delta-linear"),
    quick_mechanisms=("sum-dpfp-1", "delta-dpfp-1", "delta-linear"),
    default_max_steps=20000,
    quick_max_steps=1000,
    plot_name="fwp_update_rule.png",
    mark_d_dot=False,
)


def run_experiment(spec: RetrievalSpec, *, mechanisms: Sequence[str], sizes: Sequence[int],
                   config: RetrievalTrainConfig, out_dir: Path, command: str, seeds: Sequence[int] | None = None,
                   jobs: int = 1, threads: int | None = None, progress: bool = True, resume: bool = False,
                   report_only: bool = False) -> dict:
    """Run the grid at every seed (default ``[config.seed]``) and write ``results.json`` (rows
    aggregated over the seeds, and the per-seed runs), ``results.md`` and the PNG into ``out_dir``.

    Each finished run is recorded in ``out_dir/runs.jsonl`` at once; ``resume=True`` reuses
    the runs recorded there (same mechanism, S, seed and configuration) instead of training
    them. ``report_only=True`` trains nothing: the report covers the grid's runs recorded so
    far (the journal is only read, so the grid's own process may still be appending to it).
    """
    setting = SETTINGS[spec.setting]
    check_grid(mechanisms, sizes, config)
    seeds = _seeds(config, seeds)
    outcome = grids.run_journaled(_grid(setting, mechanisms, sizes, config, seeds), out_dir,
                                  spec=spec.experiment, jobs=jobs, threads=threads, progress=progress,
                                  resume=resume, report_only=report_only)
    runs = outcome.rows
    rows = spread.aggregate(runs, identity=ROW_IDENTITY, constants=ROW_CONSTANTS)
    cpu = sum(run["cpu_seconds"] for run in runs)  # each run's own process, workers included
    shapes = {"setting": spec.setting, "sizes": list(sizes), "seq_len": [setting.seq_len(s) for s in sizes],
              "key_dim": config.key_dim, "heads": 1}
    metadata = framework.experiment_metadata(
        device=config.device, command=command, shapes=shapes, config=asdict(config), seeds=seeds,
        mechanisms=list(mechanisms),
        wall_seconds=outcome.seconds, cpu_seconds=cpu, jobs=jobs, threads=threads or torch.get_num_threads(),
        reused_runs=outcome.reused, grid_runs=outcome.total, report_only=report_only,
        paper="Schlag, Irie & Schmidhuber 2021, Linear Transformers Are Secretly Fast Weight Programmers")
    summary = summarize(rows, target_loss=config.target_loss)
    markdown = page(spec, {"metadata": metadata, "rows": rows, "runs": runs, "summary": summary})
    plot = partial(write_plot, rows, title=setting.title, target_loss=config.target_loss, mark_d_dot=spec.mark_d_dot)
    files = framework.write_results(out_dir, rows=rows, runs=runs, metadata=metadata, summary=summary,
                                    markdown=markdown, plot=plot, plot_name=spec.plot_name)
    return {"metadata": metadata, "rows": rows, "runs": runs, "summary": summary, "markdown": markdown,
            "files": files}


def page(spec: RetrievalSpec, results: dict) -> str:
    """The page of ``results.json``'s contents: :func:`markdown_report` of its rows, runs and
    summary with the setting and ``RetrievalTrainConfig`` its metadata records, then the
    times (the wall time and processes only when the invocation trained runs)."""
    metadata, runs = results["metadata"], results["runs"]
    config = RetrievalTrainConfig(**metadata["config"])
    markdown = markdown_report(results["rows"], runs, title=f"repro {spec.command}", command=metadata["command"],
                               setting=SETTINGS[metadata["shapes"]["setting"]], config=config,
                               summary=results["summary"])
    report_only, reused = metadata.get("report_only", False), metadata["reused_runs"]
    trained_here = 0 if report_only else len(runs) - reused
    return markdown + (
        (f"\nWall time {metadata['wall_seconds']:.0f} s ({metadata['jobs']} process(es) x {metadata['threads']} "
         "thread(s)), " if trained_here else "\n")
        + f"CPU time of the runs {metadata['cpu_seconds']:.0f} s, on {metadata['device_name']}."
        + (f" {reuse_note(reused, len(runs))}." if reused and not report_only else "")
        + (f" {interim_note(len(runs), metadata['grid_runs'])}" if report_only else "") + "\n")


# --- command line -------------------------------------------------------------------


def _add_arguments(spec: RetrievalSpec, parser: argparse.ArgumentParser) -> None:
    defaults, sizes = RetrievalTrainConfig(), spec.default_sizes
    parser.add_argument("--sizes", nargs="+", type=int_at_least(2, "a number of keys S"), metavar="S",
                        help=f"numbers of unique keys S (default {sizes[0]} to {sizes[-1]} step {sizes[1] - sizes[0]}; "
                             f"--quick: {' '.join(map(str, spec.quick_sizes))})")
    parser.add_argument("--mechanisms", nargs="+", choices=list(RETRIEVAL_MECHANISMS), metavar="NAME",
                        help=f"mechanisms to train (default {' '.join(spec.default_mechanisms)}; "
                             f"any of {' '.join(RETRIEVAL_MECHANISMS)})")
    parser.add_argument("--max-steps", type=int_at_least(1, "a step count"),
                        help=f"step cap per run (default {spec.default_max_steps}, --quick {spec.quick_max_steps})")
    parser.add_argument("--eval-every", type=int_at_least(1, "a step count"), default=defaults.eval_every,
                        help="training steps between evaluations")
    parser.add_argument("--eval-sequences", type=int_at_least(1, "a count"), default=defaults.eval_sequences,
                        help="fresh sequences per evaluation, every key of each asked")
    parser.add_argument("--patience", type=int_at_least(1, "a count"), default=defaults.patience,
                        help="stop after this many evaluations without improvement")
    parser.add_argument("--target-loss", type=positive_float, default=defaults.target_loss,
                        help="stop once the evaluation loss is at most this")
    parser.add_argument("--batch-size", type=int_at_least(1, "a batch size"), default=defaults.batch_size)
    parser.add_argument("--lr", type=positive_float, default=defaults.lr, help="Adam learning rate")
    parser.add_argument("--key-dim", type=int_at_least(1, "a dimension"), default=defaults.key_dim,
                        help="d_key, the dimension of keys and queries before the feature map")
    parser.add_argument("--emb-dim", type=int_at_least(1, "a dimension"),
                        help="key embedding size (default int(1.1 * 2S), as the paper's code)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=defaults.device)


def _run(spec: RetrievalSpec, args: argparse.Namespace) -> int:
    options = framework.run_options(args, spec.experiment)
    quick = args.quick
    sizes = tuple(sorted(set(args.sizes or (spec.quick_sizes if quick else spec.default_sizes))))
    mechanisms = tuple(dict.fromkeys(args.mechanisms or (spec.quick_mechanisms if quick else spec.default_mechanisms)))
    config = RetrievalTrainConfig(
        key_dim=args.key_dim, emb_dim=args.emb_dim, batch_size=args.batch_size, lr=args.lr,
        max_steps=args.max_steps or (spec.quick_max_steps if quick else spec.default_max_steps),
        eval_every=args.eval_every, eval_sequences=args.eval_sequences, patience=args.patience,
        target_loss=args.target_loss, seed=args.seed, device=args.device,
    )
    return framework.print_result(run_experiment(spec, mechanisms=mechanisms, sizes=sizes, config=config, **options))


def _command(spec: RetrievalSpec) -> Experiment:
    return Experiment(spec.experiment, add_arguments=partial(_add_arguments, spec), run=partial(_run, spec),
                      page=partial(page, spec))


capacity_command = _command(CAPACITY)
update_rule_command = _command(UPDATE_RULE)
