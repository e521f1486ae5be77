"""The experiment framework of ``linattn repro``: one command protocol for every reproduction.

**Command.** A reproduction is an :class:`Experiment`: an :class:`ExperimentSpec` (its
subcommand name, help line, ``--help`` description, grid axes and the defaults of the shared
flags), ``add_arguments(parser)`` for its own flags and ``run(args) -> int``.
``Experiment.add_arguments`` adds the shared flags (:func:`add_shared_arguments`: ``--out``,
``--quick``, ``--jobs``, ``--threads``, ``--resume``, ``--report-only``, ``--seed``,
``--seeds``, ``--no-progress``, ``--system-malloc``); ``Experiment.run_command`` keeps freed memory in
the process for reuse (``linattn._malloc.retain_freed_memory``; bit-identical results) unless
``--system-malloc`` is given, then calls ``run``. :func:`run_options` turns the shared flags
into the keyword arguments of an experiment's ``run_experiment``.

**Seeds.** Every row of a reproduction (a mechanism, a variant, a grid point) is trained at
``--seeds N`` seeds, ``--seed S`` the first: ``S, S + 1, ..., S + N - 1`` (:func:`seed_list`;
the default N is the spec's, 1 with ``--quick``). A seed's run is the run the experiment
makes with ``--seed s`` alone; the seed is part of its journal key.

**Results.** :func:`write_results` writes ``results.json`` (the aggregated rows, the per-seed
``runs``, metadata, summary), ``results.md`` and the experiment's PNG plot into ``--out``. The
page is the experiment's ``page(results)`` of what ``results.json`` holds, so ``linattn repro
report DIR`` (``repro.cli.report_page``) writes it again from the JSON alone.

The rest of the protocol has its own modules: ``repro.grids`` (a ``Grid`` of runs and the
worker pool that trains them), ``repro.journal`` (the crash-safe run journal ``runs.jsonl``
behind ``--resume`` and ``--report-only``) and ``repro.spread`` (the spread over seeds:
aggregation, the resolved rule, the "Differences" section).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .._checks import int_at_least, is_int
from .._malloc import retain_freed_memory
from ..reporting import collect_metadata, write_json, write_markdown
from .journal import JOURNAL_NAME


# --- seeds ------------------------------------------------------------------------------


def seeded_generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded by the integers ``parts`` (e.g. seed, size, purpose):
    ``seed = fold(seed * 1_000_003 + part) mod (2^63 - 1)`` from 0, so every tuple of parts
    names its own stream and equal tuples give equal streams."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


# --- the command protocol ---------------------------------------------------------------


@dataclass(frozen=True)
class ExperimentSpec:
    """What a ``linattn repro`` subcommand is, and the defaults of its shared flags.

    ``grid_axes`` names what a run of the grid varies (said when ``--report-only`` finds none
    of the grid's runs); ``unit`` is what one journal entry is ("runs"); ``row`` what a row of
    the report is ("mechanism"), each trained at ``default_seeds`` seeds unless ``--seeds``
    or ``--quick`` (1) says otherwise.
    """

    name: str
    help: str
    description: str
    grid_axes: tuple[str, ...]
    quick_help: str
    seed_help: str = "seed of data and initialisation (default %(default)s)"
    unit: str = "runs"
    row: str = "row"
    default_seeds: int = 3
    default_threads: int | None = None
    threads_help: str = "torch intra-op CPU threads per run (default: torch's choice)"


def add_shared_arguments(parser: argparse.ArgumentParser, spec: ExperimentSpec) -> None:
    """The flags every reproduction takes (see the module docstring)."""
    parser.add_argument("--quick", action="store_true", help=spec.quick_help)
    parser.add_argument("--seed", type=int, default=0, help=spec.seed_help + "; the first of --seeds")
    parser.add_argument("--seeds", type=int_at_least(1, "a seed count"), default=None, metavar="N",
                        help=f"train every {spec.row} at N seeds: --seed, --seed + 1, ..., --seed + N - 1, each "
                             f"run as --seed alone would run it (default {spec.default_seeds}; --quick: 1)")
    parser.add_argument("--threads", type=int_at_least(1, "a thread count"), default=spec.default_threads,
                        help=spec.threads_help)
    parser.add_argument("--jobs", type=int_at_least(1, "a process count"), default=1,
                        help=f"{spec.unit} trained at once in worker processes (default 1; "
                             "e.g. --jobs 2 --threads 1 on 2 cores)")
    parser.add_argument("--out", type=Path, default=Path(f"results/repro-{spec.name}"),
                        help="output directory (default %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help=f"reuse the {spec.unit} recorded in --out/{JOURNAL_NAME} by an earlier (interrupted or "
                             "partial) invocation with the same settings; without it the journal starts empty")
    parser.add_argument("--report-only", action="store_true",
                        help=f"train nothing: write the report of the grid's {spec.unit} recorded in "
                             f"--out/{JOURNAL_NAME} so far (an interim report; the journal is only read)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc malloc's settings as they are (by default the process and its workers "
                             "keep freed memory for reuse: MALLOC_MMAP_MAX_=0, no page faults on each step's large "
                             "tensors; bit-identical results, memory stays at its peak)")


def add_lm_arguments(parser: argparse.ArgumentParser, *, n_heads: int, window: int, favor_features: int | None,
                     codebook_size: int, block_size: int, gau_d_k: int) -> None:
    """The ``linattn.models.LM`` shape flags of the reproductions that train one (``mqar``,
    ``lm``, ``length-extrapolation``), with the experiment's defaults: ``--n-heads``,
    ``--window``, ``--favor-features`` (not added when ``favor_features`` is None: no FAVOR+
    model in the experiment), ``--codebook-size``, ``--block-size``, ``--gau-d-k``."""
    flags = (
        ("--n-heads", n_heads, "a head count", "heads of the attention blocks"),
        ("--window", window, "a window", "window of the local mechanism"),
        ("--favor-features", favor_features, "a feature count", "FAVOR+ random features"),
        ("--codebook-size", codebook_size, "a codebook size", "VQ codes per layer"),
        ("--block-size", block_size, "a block size", "VQ block length L"),
        ("--gau-d-k", gau_d_k, "a dimension", "key width of the VQ layers' gated attention units"),
    )
    for flag, default, what, help_text in (f for f in flags if f[1] is not None):
        parser.add_argument(flag, type=int_at_least(1, what), default=default,
                            help=f"{help_text} (default %(default)s)")


class Experiment:
    """One ``linattn repro`` subcommand: ``HELP``, ``DESCRIPTION``, ``add_arguments(parser)``
    and ``run_command(args) -> int``, as ``linattn._command_group`` registers it.

    ``page(results) -> str``: the experiment's Markdown page from the contents of its
    ``results.json`` (``{"metadata", "rows", "runs", "summary"}``); the run writes
    ``results.md`` with it and ``linattn repro report DIR`` prints it.
    """

    def __init__(self, spec: ExperimentSpec, *, add_arguments: Callable[[argparse.ArgumentParser], None],
                 run: Callable[[argparse.Namespace], int], page: Callable[[dict], str]):
        self.spec, self.HELP, self.DESCRIPTION = spec, spec.help, spec.description
        self._add_own_arguments, self.run, self.page = add_arguments, run, page

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The experiment's own flags, then the shared ones."""
        self._add_own_arguments(parser)
        add_shared_arguments(parser, self.spec)

    def run_command(self, args: argparse.Namespace) -> int:
        """Keep freed memory unless ``--system-malloc``, then run the experiment."""
        if not args.system_malloc:
            retain_freed_memory()
        return self.run(args)


def seed_list(args: argparse.Namespace, spec: ExperimentSpec) -> list[int]:
    """The seeds of an invocation: ``--seed``, ``--seed + 1``, ... (``--seeds`` of them; by
    default ``spec.default_seeds``, 1 with ``--quick``). A ``--seeds`` below 1 (a namespace
    built by hand) is a ValueError naming it."""
    count = args.seeds
    if count is None:
        count = 1 if args.quick else spec.default_seeds
    if not is_int(count) or count < 1:
        raise ValueError(f"--seeds must be an integer >= 1 (seeds per {spec.row}), got {count!r}")
    if not is_int(args.seed):
        raise ValueError(f"--seed must be an integer, got {args.seed!r}")
    return [args.seed + i for i in range(count)]


def with_seed(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """A copy of ``args`` with ``seed`` in place of ``--seed`` (one seed's run of a grid whose
    runs read their settings from the namespace)."""
    return argparse.Namespace(**{**vars(args), "seed": seed})


def run_folder(out_dir: Path, name: str, seed: int) -> Path:
    """``out_dir/runs/seed-<seed>/<name>``: the training folder of one row's run at one seed."""
    return Path(out_dir) / "runs" / f"seed-{seed}" / name


def run_options(args: argparse.Namespace, spec: ExperimentSpec) -> dict:
    """The shared flags as ``run_experiment`` keywords (``out_dir``, ``command``, ``seeds``
    (:func:`seed_list`), ``jobs``, ``threads``, ``progress``, ``resume``, ``report_only``);
    sets torch's thread count to ``--threads`` when it is given."""
    seeds = seed_list(args, spec)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return {"out_dir": args.out, "command": getattr(args, "command_line", f"linattn repro {spec.name}"),
            "seeds": seeds, "jobs": args.jobs, "threads": args.threads, "progress": not args.no_progress,
            "resume": args.resume, "report_only": args.report_only}


def print_result(result: dict) -> int:
    """Print a finished experiment's Markdown page and the files it wrote; exit code 0."""
    print(result["markdown"])
    print("wrote " + ", ".join(str(p) for p in result["files"]))
    return 0


# --- results ----------------------------------------------------------------------------


def experiment_metadata(*, device: str, command: str, shapes: dict, **fields) -> dict:
    """``linattn.reporting.collect_metadata`` followed by the experiment's own ``fields``."""
    metadata = collect_metadata(device=device, command=command, shapes=shapes)
    metadata.update(fields)
    return metadata


def write_results(out_dir: Path, *, rows: Sequence[dict], runs: Sequence[dict], metadata: dict, markdown: str,
                  plot: Callable[[Path], Path], plot_name: str, summary: dict | None = None) -> list[Path]:
    """Write ``results.json`` (``rows``: aggregated over the seeds, ``spread.aggregate``;
    ``runs``: one row per seed), ``results.md`` and ``plot(out_dir / plot_name)``; their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [write_json(out_dir / "results.json", rows=rows, runs=runs, metadata=metadata, summary=summary),
            write_markdown(out_dir / "results.md", markdown), plot(out_dir / plot_name)]
