"""The experiment framework of ``linattn repro``: one command protocol for every reproduction.

**Command.** A reproduction is an :class:`Experiment`: an :class:`ExperimentSpec` (its
subcommand name, help line, ``--help`` description, grid axes and the defaults of the shared
flags), ``add_arguments(parser)`` for its own flags and ``run(args) -> int``.
``Experiment.add_arguments`` adds the shared flags (:func:`add_shared_arguments`: ``--out``,
``--quick``, ``--jobs``, ``--threads``, ``--resume``, ``--report-only``, ``--seed``,
``--no-progress``, ``--system-malloc``); ``Experiment.run_command`` keeps freed memory in
the process for reuse (``linattn._malloc.retain_freed_memory``; bit-identical results) unless
``--system-malloc`` is given, then calls ``run``. :func:`run_options` turns the shared flags
into the keyword arguments of an experiment's ``run_experiment``.

**Grid.** A :class:`Grid` is a list of argument tuples ``runs`` for one module-level (so
picklable) ``train`` function that returns a result row (a JSON-able dict). With
``jobs == 1`` the runs go one after another in this process; with ``jobs > 1`` that many run
at once in spawned worker processes, each with ``threads`` torch threads. Runs are seeded
(:func:`seeded_generator`), so the rows do not depend on ``jobs``.

**Journal.** A :class:`RunJournal` (``<out>/runs.jsonl``) records each finished run as one
JSON line ``{"key": ..., "row": ...}`` the moment it finishes, so an interrupted grid loses
at most the runs in flight: ``--resume`` reuses every recorded run whose key (the run's
arguments and configuration) matches, and ``--report-only`` reports the recorded runs
without training (:func:`run_journaled`).

**Results.** :func:`write_results` writes ``results.json`` (rows, metadata, summary),
``results.md`` and the experiment's PNG plot into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._checks import check_int, int_at_least
from .._malloc import retain_freed_memory
from ..reporting import collect_metadata, write_json, write_markdown

JOURNAL_NAME = "runs.jsonl"

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
    of the grid's runs); ``unit`` is what one journal entry is ("runs", "mechanisms").
    """

    name: str
    help: str
    description: str
    grid_axes: tuple[str, ...]
    quick_help: str
    seed_help: str = "seed of data and initialisation (default %(default)s)"
    unit: str = "runs"
    default_threads: int | None = None
    threads_help: str = "torch intra-op CPU threads per run (default: torch's choice)"


def add_shared_arguments(parser: argparse.ArgumentParser, spec: ExperimentSpec) -> None:
    """The flags every reproduction takes (see the module docstring)."""
    parser.add_argument("--quick", action="store_true", help=spec.quick_help)
    parser.add_argument("--seed", type=int, default=0, help=spec.seed_help)
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
    and ``run_command(args) -> int``, as ``linattn._command_group`` registers it."""

    def __init__(self, spec: ExperimentSpec, *, add_arguments: Callable[[argparse.ArgumentParser], None],
                 run: Callable[[argparse.Namespace], int]):
        self.spec, self.HELP, self.DESCRIPTION = spec, spec.help, spec.description
        self._add_own_arguments, self.run = add_arguments, run

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The experiment's own flags, then the shared ones."""
        self._add_own_arguments(parser)
        add_shared_arguments(parser, self.spec)

    def run_command(self, args: argparse.Namespace) -> int:
        """Keep freed memory unless ``--system-malloc``, then run the experiment."""
        if not args.system_malloc:
            retain_freed_memory()
        return self.run(args)


def run_options(args: argparse.Namespace, spec: ExperimentSpec) -> dict:
    """The shared flags as ``run_experiment`` keywords (``out_dir``, ``command``, ``jobs``,
    ``threads``, ``progress``, ``resume``, ``report_only``); sets torch's thread count to
    ``--threads`` when it is given."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return {"out_dir": args.out, "command": getattr(args, "command_line", f"linattn repro {spec.name}"),
            "jobs": args.jobs, "threads": args.threads, "progress": not args.no_progress, "resume": args.resume,
            "report_only": args.report_only}


def print_result(result: dict) -> int:
    """Print a finished experiment's Markdown page and the files it wrote; exit code 0."""
    print(result["markdown"])
    print("wrote " + ", ".join(str(p) for p in result["files"]))
    return 0


# --- the run journal --------------------------------------------------------------------


def _canonical(key: Any) -> str:
    return json.dumps(key, sort_keys=True)


class RunJournal:
    """Finished runs of a grid, appended to ``path`` one JSON line each.

    ``resume=False`` starts an empty journal (an old one is replaced); ``resume=True``
    loads the recorded runs first. A line that does not parse (the tail of a write cut
    short by a crash) is ignored; that run is simply trained again.
    """

    def __init__(self, path: str | Path, *, resume: bool, read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        self._rows: dict[str, dict] = {}
        if (resume or read_only) and self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self._rows[_canonical(entry["key"])] = entry["row"]
                except (ValueError, KeyError, TypeError):
                    continue
        if read_only:  # e.g. an interim report while the grid's own process still appends
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Rewrite what was loaded (drops a torn last line) or start empty.
        with open(self.path, "w", encoding="utf-8") as handle:
            for key, row in self._rows.items():
                handle.write(json.dumps({"key": json.loads(key), "row": row}) + "\n")

    def __len__(self) -> int:
        return len(self._rows)

    def count(self, keys) -> int:
        """How many of ``keys`` have a recorded run."""
        return sum(self.get(key) is not None for key in keys)

    def get(self, key: Any) -> dict | None:
        """The recorded row of the run with this key, or None."""
        return self._rows.get(_canonical(key))

    def record(self, key: Any, row: dict) -> None:
        """Append one finished run and flush it to disk."""
        if self.read_only:
            raise RuntimeError(f"{self.path} was opened read-only")
        self._rows[_canonical(key)] = row
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"key": key, "row": row}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def reuse_note(reused: int, total: int, unit: str = "runs") -> str:
    """The report's clause on runs taken from the journal ('' when there were none)."""
    if not reused:
        return ""
    return (f"{reused} of {total} {unit} were reused from {JOURNAL_NAME} (--resume): their CPU time is included"
            + (", the wall time is this invocation's" if reused < total else ""))


def interim_note(recorded: int, total: int, unit: str = "runs") -> str:
    """The report's sentence on a ``--report-only`` page."""
    return (f"Interim report (--report-only): {recorded} of the grid's {total} {unit} are recorded;"
            " empty cells are not run yet.")


# --- the worker pool --------------------------------------------------------------------


class _ReportToParent:
    """A worker run's progress callback: sends ``(run index, callback args)`` to the parent."""

    def __init__(self, queue, index: int):
        self.queue, self.index = queue, index

    def __call__(self, *args) -> None:
        self.queue.put((self.index, args))


def _run_in_worker(job: tuple) -> Any:
    train, args, threads, progress_kwarg, queue, index = job
    torch.set_num_threads(threads)
    kwargs = {progress_kwarg: _ReportToParent(queue, index)} if queue is not None else {}
    return train(*args, **kwargs)


def map_runs(
    train: Callable[..., dict],
    grid: Sequence[tuple],
    *,
    jobs: int,
    threads: int,
    bar,
    describe: Callable[[dict], str],
    progress_kwarg: str | None = None,
    show_progress: Callable[[tuple], Callable] | None = None,
    journal: RunJournal | None = None,
    run_key: Callable[[tuple], Any] | None = None,
    only_recorded: bool = False,
) -> list[dict]:
    """``[train(*args) for args in grid]`` in grid order, advancing the tqdm ``bar`` per run.

    ``describe(row)`` is shown on the bar when a run finishes. With ``progress_kwarg`` and
    ``show_progress``, every run also gets a per-step callback as ``train(*args,
    **{progress_kwarg: callback})``: in-process (``jobs == 1``) it is
    ``show_progress(args)`` itself; in a worker it sends its arguments to this process,
    which passes them to ``show_progress(args)`` (so the bar shows the steps of every run).
    With a ``journal``, runs whose ``run_key(args)`` it holds are not trained again and every
    newly finished run is recorded in it at once (``run_key`` is unused without one).
    ``only_recorded=True`` trains nothing and returns just the journal's rows, in grid order.
    ``jobs`` and ``threads`` must be ints >= 1 (a ValueError naming the argument otherwise).
    """
    check_int("jobs", jobs)
    check_int("threads", threads)
    if journal is not None and run_key is None:
        raise ValueError("journal and run_key go together: a journal needs run_key (what identifies a run in it)")
    done: dict[int, dict] = {}
    if journal is not None:
        for i, args in enumerate(grid):
            row = journal.get(run_key(args))
            if row is not None:
                done[i] = row
        if done:
            bar.update(len(done))
    if only_recorded:
        if journal is None:
            raise ValueError("only_recorded needs a journal (the runs to report)")
        return [done[i] for i in sorted(done)]
    todo = [i for i in range(len(grid)) if i not in done]
    reporting = bool(progress_kwarg and show_progress)

    def finish(i: int, row: dict) -> None:
        done[i] = row
        if journal is not None:
            journal.record(run_key(grid[i]), row)
        bar.set_postfix_str(describe(row))
        bar.update(1)

    if jobs == 1 or len(todo) <= 1:
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for i in todo:
                kwargs = {progress_kwarg: show_progress(grid[i])} if reporting else {}
                finish(i, train(*grid[i], **kwargs))
        finally:
            torch.set_num_threads(torch_threads)
        return [done[i] for i in range(len(grid))]
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    context = multiprocessing.get_context("spawn")
    manager = context.Manager() if reporting else None
    queue = manager.Queue() if reporting else None

    def relay_progress() -> None:
        while queue is not None and not queue.empty():
            index, args = queue.get()
            show_progress(grid[index])(*args)

    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=context) as pool:
            futures = {
                pool.submit(_run_in_worker, (train, grid[i], threads, progress_kwarg, queue, i)): i for i in todo
            }
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                relay_progress()  # a worker's messages are queued before its run returns
                for future in finished:
                    finish(futures[future], future.result())
    finally:
        if manager is not None:
            manager.shutdown()
    return [done[i] for i in range(len(grid))]


# --- grids ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """The runs of one invocation: ``train(*run)`` for each ``run`` of ``runs``, in order.

    ``run_key(run)``: what identifies the run in the journal (its arguments and configuration).
    ``describe(row)``: the progress bar's text when a run finishes. With ``progress_kwarg``,
    ``train`` takes a per-step callback under that name, and ``step_text(run, *callback
    args)`` is the bar's text for it. ``label`` and ``unit`` name the bar and its steps.
    """

    train: Callable[..., dict]
    runs: list[tuple]
    run_key: Callable[[tuple], Any]
    describe: Callable[[dict], str]
    label: str
    unit: str = "run"
    progress_kwarg: str | None = None
    step_text: Callable[..., str] | None = None


def run_grid(grid: Grid, *, jobs: int = 1, threads: int | None = None, progress: bool = True,
             journal: RunJournal | None = None, only_recorded: bool = False) -> list[dict]:
    """Every run of ``grid`` (``map_runs``) under a tqdm bar; ``threads=None`` keeps torch's
    current thread count for the runs."""
    from tqdm.auto import tqdm

    with tqdm(total=len(grid.runs), desc=grid.label, unit=grid.unit, disable=not progress) as bar:
        show_progress = None
        if grid.progress_kwarg and grid.step_text is not None:
            def show_progress(run: tuple) -> Callable:
                return lambda *args: bar.set_postfix_str(grid.step_text(run, *args))

        return map_runs(grid.train, grid.runs, jobs=jobs,
                        threads=torch.get_num_threads() if threads is None else threads,
                        bar=bar, describe=grid.describe, progress_kwarg=grid.progress_kwarg,
                        show_progress=show_progress, journal=journal, run_key=grid.run_key,
                        only_recorded=only_recorded)


@dataclass(frozen=True)
class GridOutcome:
    """The rows of a journaled grid and how they came about."""

    rows: list[dict]
    reused: int  # rows taken from the journal
    total: int  # runs in the grid
    seconds: float  # wall time of this invocation

    @property
    def trained(self) -> int:
        """Rows trained by this invocation."""
        return len(self.rows) - self.reused


def run_journaled(grid: Grid, out_dir: Path, *, spec: ExperimentSpec, jobs: int = 1, threads: int | None = None,
                  progress: bool = True, resume: bool = False, report_only: bool = False) -> GridOutcome:
    """Run ``grid`` with its journal ``out_dir/runs.jsonl``: each finished run is recorded at
    once; ``resume=True`` reuses the runs recorded there (same key) instead of training them;
    ``report_only=True`` trains nothing and returns the grid's recorded runs (the journal is
    only read, so the grid's own process may still be appending to it; a ValueError when it
    holds none of them)."""
    journal = RunJournal(Path(out_dir) / JOURNAL_NAME, resume=resume, read_only=report_only)
    reused = journal.count(grid.run_key(run) for run in grid.runs)
    if report_only and not reused:
        raise ValueError(f"--report-only: {journal.path} holds none of this grid's {spec.unit} "
                         f"(same {', '.join(spec.grid_axes)} and training settings)")
    started = time.perf_counter()
    rows = run_grid(grid, jobs=jobs, threads=threads, progress=progress, journal=journal, only_recorded=report_only)
    return GridOutcome(rows=rows, reused=reused, total=len(grid.runs), seconds=time.perf_counter() - started)


# --- results ----------------------------------------------------------------------------


def experiment_metadata(*, device: str, command: str, shapes: dict, **fields) -> dict:
    """``linattn.reporting.collect_metadata`` followed by the experiment's own ``fields``."""
    metadata = collect_metadata(device=device, command=command, shapes=shapes)
    metadata.update(fields)
    return metadata


def write_results(out_dir: Path, *, rows: Sequence[dict], metadata: dict, markdown: str,
                  plot: Callable[[Path], Path], plot_name: str, summary: dict | None = None) -> list[Path]:
    """Write ``results.json``, ``results.md`` and ``plot(out_dir / plot_name)``; their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [write_json(out_dir / "results.json", rows=rows, metadata=metadata, summary=summary),
            write_markdown(out_dir / "results.md", markdown), plot(out_dir / plot_name)]
