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

**Grid.** A :class:`Grid` is a list of argument tuples ``runs`` (every row at every seed)
for one module-level (so picklable) ``train`` function that returns a result row (a JSON-able
dict). With ``jobs == 1`` the runs go one after another in this process; with ``jobs > 1``
that many run at once in spawned worker processes, each with ``threads`` torch threads. Runs
are seeded (:func:`seeded_generator`), so the rows do not depend on ``jobs``.

**Journal.** A :class:`RunJournal` (``<out>/runs.jsonl``) records each finished run as one
JSON line ``{"key": ..., "row": ...}`` the moment it finishes, so an interrupted grid loses
at most the runs in flight: ``--resume`` reuses every recorded run whose key (the run's
arguments and configuration) matches, and ``--report-only`` reports the recorded runs
without training (:func:`run_journaled`).

**Spread.** :func:`aggregate` groups the per-seed rows by their row identity and gives each
numeric metric's n, mean, sample standard deviation, min and max (:func:`metric_stats`);
:func:`resolved` is the one rule for when a difference between two rows is real
(:data:`RESOLVED_RULE`), and :func:`differences_lines` the reports' "Differences" section.

**Results.** :func:`write_results` writes ``results.json`` (the aggregated rows, the per-seed
``runs``, metadata, summary), ``results.md`` and the experiment's PNG plot into ``--out``. The
page is the experiment's ``page(results)`` of what ``results.json`` holds, so ``linattn repro
report DIR`` (``repro.cli.report_page``) writes it again from the JSON alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._checks import check_int, int_at_least, is_int
from .._malloc import retain_freed_memory
from ..reporting import collect_metadata, markdown_table_lines, write_json, write_markdown

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

    def entries(self) -> list[dict]:
        """Every recorded run as ``{"key": ..., "row": ...}``, in the order they were recorded."""
        return [{"key": json.loads(key), "row": row} for key, row in self._rows.items()]

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


def closing_note(metadata: dict, runs: int, note: str = "") -> str:
    """A report's last sentence: the invocation's wall time on its device and processes (only
    when it trained some of the ``runs``), then ``note`` (an interim report's sentence) or the
    clause on runs reused from the journal."""
    reused = metadata.get("reused_runs", 0)
    closing = (f"Wall time: {metadata.get('seconds', 0):.0f} s on {metadata['device_name']} "
               f"({metadata.get('jobs', 1)} process(es) x {metadata['threads']} thread(s))."
               if reused < runs else f"Runs on {metadata['device_name']}.")
    if note:
        return f"{closing} {note}"
    return f"{closing} {reuse_note(reused, runs)}." if reused else closing


def interim_note(recorded: int, total: int, unit: str = "runs") -> str:
    """The report's sentence on a ``--report-only`` page."""
    return (f"Interim report (--report-only): {recorded} of the grid's {total} {unit} are recorded;"
            " empty cells are not run yet.")


def metadata_interim_note(metadata: dict, recorded: int, unit: str = "runs") -> str:
    """:func:`interim_note` of a page whose ``metadata`` says ``report_only`` (with the
    grid's size ``grid_runs``); '' for a page of a run that trained."""
    return interim_note(recorded, metadata["grid_runs"], unit) if metadata.get("report_only") else ""


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

    ``run_key(run)``: what identifies the run in the journal (its arguments and configuration,
    the seed among them). ``seed_of(run)``: the seed the run trains with (added to its row as
    ``"seed"``). ``describe(row)``: the progress bar's text when a run finishes. With
    ``progress_kwarg``, ``train`` takes a per-step callback under that name, and
    ``step_text(run, *callback args)`` is the bar's text for it. ``label`` and ``unit`` name
    the bar and its steps.
    """

    train: Callable[..., dict]
    runs: list[tuple]
    run_key: Callable[[tuple], Any]
    describe: Callable[[dict], str]
    label: str
    seed_of: Callable[[tuple], int]
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
    """The rows of a journaled grid (one per run: a row at a seed, with its ``"seed"``) and how
    they came about."""

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
    once; ``resume=True`` reuses the runs recorded there (same key: the same row at the same
    seed) instead of training them; ``report_only=True`` trains nothing and returns the grid's
    recorded runs (the journal is only read, so the grid's own process may still be appending
    to it; a ValueError when it holds none of them). Every row gets its run's ``"seed"``.
    Two runs of the grid with one key (e.g. a key without the seed) are a ValueError."""
    keys = [grid.run_key(run) for run in grid.runs]
    if len({_canonical(key) for key in keys}) != len(keys):
        raise ValueError(f"{grid.label}: two runs of the grid have the same journal key; a key must tell every "
                         "row at every seed apart")
    journal = RunJournal(Path(out_dir) / JOURNAL_NAME, resume=resume, read_only=report_only)
    recorded = [journal.get(key) is not None for key in keys]
    reused = sum(recorded)
    if report_only and not reused:
        raise ValueError(f"--report-only: {journal.path} holds none of this grid's {spec.unit} "
                         f"(same {', '.join(spec.grid_axes)}, seeds and training settings)")
    started = time.perf_counter()
    rows = run_grid(grid, jobs=jobs, threads=threads, progress=progress, journal=journal, only_recorded=report_only)
    runs = [run for run, done in zip(grid.runs, recorded) if done] if report_only else grid.runs
    rows = [{**row, "seed": grid.seed_of(run)} for run, row in zip(runs, rows, strict=True)]
    return GridOutcome(rows=rows, reused=reused, total=len(grid.runs), seconds=time.perf_counter() - started)


# --- the spread over seeds --------------------------------------------------------------

RESOLVED_RULE = ("A difference between two rows is *resolved* when their min–max ranges over the seeds do not "
                 "overlap, each row with n >= 2 seeds; otherwise it is *within the spread* (with n = 1 nothing is "
                 "resolved).")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric_stats(values: Sequence[float | None]) -> dict:
    """``{"n", "mean", "std", "min", "max"}`` of the finite numbers among ``values`` (None and
    NaN/inf are left out; n counts the rest): ``std`` is the sample standard deviation
    ``sqrt(sum (x - mean)^2 / (n - 1))``, None when n < 2; mean, min and max are None when n = 0."""
    finite = [float(v) for v in values if _is_number(v) and math.isfinite(v)]
    n = len(finite)
    if not n:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    mean = math.fsum(finite) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / (n - 1)) if n > 1 else None
    return {"n": n, "mean": mean, "std": std, "min": min(finite), "max": max(finite)}


def aggregate(runs: Sequence[dict], identity: Sequence[str], *,
              metrics: Callable[[dict], dict[str, float | None]] | None = None,
              constants: Sequence[str] = ()) -> list[dict]:
    """One row per row identity (the values of the ``identity`` fields), in order of first
    appearance, from the per-seed ``runs`` (each with its ``"seed"``):

    - the identity fields; ``"seeds"``: the seeds of its runs, in run order; ``"n"``: their count;
    - the ``constants`` (fields that describe the row, not a result: a width, a parameter
      count), which must be equal at every seed (a ValueError otherwise), as they are;
    - every other field that is a string or a bool with the same value at every seed (a spec,
      a label), as it is;
    - ``"metrics"``: for every other numeric top-level field (bools are not numbers) and every
      entry of ``metrics(run)`` (derived or nested metrics), :func:`metric_stats` over the seeds.
    """
    groups: dict[str, list[dict]] = {}
    for run in runs:
        missing = [name for name in (*identity, "seed") if name not in run]
        if missing:
            raise ValueError(f"a run row lacks the field(s) {missing} (identity {list(identity)} and seed)")
        groups.setdefault(_canonical([run[name] for name in identity]), []).append(run)
    rows = []
    for members in groups.values():
        row = {name: members[0][name] for name in identity}
        row.update(seeds=[run["seed"] for run in members], n=len(members))
        for name in constants:
            column = [run.get(name) for run in members]
            if any(value != column[0] for value in column):
                raise ValueError(f"{name} differs between the seeds of the row {[row[key] for key in identity]}: "
                                 f"{column}")
            row[name] = column[0]
        fields = dict.fromkeys(key for run in members for key in run if key not in row and key != "seed")
        values: dict[str, list] = {}
        for key in fields:
            column = [run.get(key) for run in members]
            if any(_is_number(v) for v in column):
                values[key] = column
            elif all(isinstance(v, (str, bool)) and v == column[0] for v in column):
                row[key] = column[0]
        for run_index, run in enumerate(members):
            for key, value in (metrics(run) if metrics else {}).items():
                values.setdefault(key, [None] * len(members))[run_index] = value
        row["metrics"] = {key: metric_stats(column) for key, column in values.items()}
        rows.append(row)
    return rows


def stats_of(row: dict, metric: str) -> dict | None:
    """The stats of ``metric`` in an aggregated row, or None when no seed had a number for it."""
    stats = row["metrics"].get(metric)
    return stats if stats and stats["n"] else None


def mean_of(row: dict, metric: str) -> float | None:
    """The mean of ``metric`` over an aggregated row's seeds (None without a number)."""
    stats = stats_of(row, metric)
    return None if stats is None else stats["mean"]


def resolved(a: dict | None, b: dict | None) -> bool:
    """The rule of :data:`RESOLVED_RULE` for two metrics' stats (:func:`metric_stats`): both
    with n >= 2 and ``a.max < b.min`` or ``b.max < a.min`` (ranges that touch overlap)."""
    if a is None or b is None or a["n"] < 2 or b["n"] < 2:
        return False
    return a["max"] < b["min"] or b["max"] < a["min"]


def format_stats(stats: dict | None, spec: str = ".3f", *, bare_single: bool = False) -> str:
    """``"mean ± std (min–max)"``; with n = 1 ``"mean ± —"`` (``bare_single``: the mean
    alone); ``"—"`` without a number."""
    if stats is None or not stats["n"]:
        return "—"
    mean = format(stats["mean"], spec)
    if stats["n"] == 1:
        return mean if bare_single else f"{mean} ± —"
    return f"{mean} ± {format(stats['std'], spec)} ({format(stats['min'], spec)}–{format(stats['max'], spec)})"


def format_mean(stats: dict | None, spec: str = ".3f") -> str:
    """The mean alone (throughput, memory: no spread shown); ``"—"`` without a number."""
    return "—" if stats is None or not stats["n"] else format(stats["mean"], spec)


def seeds_text(rows: Sequence[dict], *, cells: bool = True) -> str:
    """The report's sentence on the seeds behind its aggregated rows, e.g. "n = 3 seeds per row
    (0, 1, 2)", and with ``cells`` how a cell with a spread reads (:func:`format_stats`)."""
    seeds = sorted({seed for row in rows for seed in row["seeds"]})
    counts = sorted({row["n"] for row in rows}) or [0]
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    text = f"n = {n} seed{'' if counts[-1] == 1 else 's'} per row ({', '.join(map(str, seeds))})."
    if cells:
        text += (" A cell over the seeds reads mean ± sample standard deviation (min–max); with n = 1, "
                 "mean ± — (no spread).")
    return text


def difference_matrix(rows: Sequence[dict], value: Callable[[dict], dict | None], name: Callable[[dict], str],
                      spec: str = "+.3f") -> list[str]:
    """A Markdown table: cell (i, j) is mean_i - mean_j of the stats ``value(row)`` (rows
    without them are left out), marked ``✓`` when :func:`resolved`."""
    present = [(row, value(row)) for row in rows]
    present = [(row, stats) for row, stats in present if stats is not None and stats["n"]]
    header = ["row − column", *(name(row) for row, _ in present)]
    cells = []
    for row, a in present:
        line = [name(row)]
        for other, b in present:
            if other is row:
                line.append("")
            else:
                text = format(a["mean"] - b["mean"], spec)
                if float(text) == 0:  # no "-0.000"
                    text = format(0.0, spec)
                line.append(text + (" ✓" if resolved(a, b) else ""))
        cells.append(line)
    return markdown_table_lines(header, cells)


def differences_lines(tables: Sequence[tuple[str, list[str]]]) -> list[str]:
    """The "Differences" section of a report: the rule, then each ``(caption, table lines)``
    (:func:`difference_matrix`)."""
    lines = ["## Differences", "",
             RESOLVED_RULE + " Each table: row minus column, difference of the means over the seeds; ✓: resolved, "
             "no mark: within the spread."]
    for caption, table in tables:
        lines += ["", caption, "", *table]
    return lines


def curve_band(curves: Sequence[Sequence[Sequence[float]]]) -> tuple[list[float], list[float], list[float],
                                                                     list[float]]:
    """``(x, mean, min, max)`` over the seeds' curves ``[(x, y), ...]`` at the x's every curve
    has (seeds of one row log at the same steps)."""
    common = set.intersection(*({x for x, _ in curve} for curve in curves)) if curves else set()
    xs = sorted(common)
    at = [dict((x, y) for x, y in curve) for curve in curves]
    ys = [[values[x] for values in at] for x in xs]
    return xs, [math.fsum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def plot_band(axis, curves: Sequence[Sequence[Sequence[float]]], *, scale: float = 1.0, **style) -> None:
    """The mean curve of ``curves`` (times ``scale``) with its min–max band over the seeds."""
    xs, mean, low, high = curve_band(curves)
    if not xs:
        return
    (line,) = axis.plot(xs, [y * scale for y in mean], **style)
    if len(curves) > 1:
        axis.fill_between(xs, [y * scale for y in low], [y * scale for y in high], color=line.get_color(),
                          alpha=0.2, linewidth=0)


def plot_spread(axis, xs: Sequence[float], stats: Sequence[dict | None], *, scale: float = 1.0, **style) -> None:
    """Means at ``xs`` with min–max error bars over the seeds (points without a number left out)."""
    points = [(x, s) for x, s in zip(xs, stats) if s is not None and s["n"]]
    if not points:
        return
    means = [s["mean"] * scale for _, s in points]
    below = [(s["mean"] - s["min"]) * scale for _, s in points]
    above = [(s["max"] - s["mean"]) * scale for _, s in points]
    axis.errorbar([x for x, _ in points], means, yerr=[below, above], capsize=3, **style)


# --- results ----------------------------------------------------------------------------


def experiment_metadata(*, device: str, command: str, shapes: dict, **fields) -> dict:
    """``linattn.reporting.collect_metadata`` followed by the experiment's own ``fields``."""
    metadata = collect_metadata(device=device, command=command, shapes=shapes)
    metadata.update(fields)
    return metadata


def write_results(out_dir: Path, *, rows: Sequence[dict], runs: Sequence[dict], metadata: dict, markdown: str,
                  plot: Callable[[Path], Path], plot_name: str, summary: dict | None = None) -> list[Path]:
    """Write ``results.json`` (``rows``: aggregated over the seeds, :func:`aggregate`;
    ``runs``: one row per seed), ``results.md`` and ``plot(out_dir / plot_name)``; their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [write_json(out_dir / "results.json", rows=rows, runs=runs, metadata=metadata, summary=summary),
            write_markdown(out_dir / "results.md", markdown), plot(out_dir / plot_name)]
