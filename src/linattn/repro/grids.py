"""The runs of a ``linattn repro`` invocation: a :class:`Grid`, the worker pool that trains
it, and the journaled run of it.

A :class:`Grid` is a list of argument tuples ``runs`` (every row at every seed)
for one module-level (so picklable) ``train`` function that returns a result row (a JSON-able
dict). With ``jobs == 1`` the runs go one after another in this process; with ``jobs > 1``
that many run at once in spawned worker processes, each with ``threads`` torch threads
(:func:`map_runs`). Runs are seeded (``repro.framework.seeded_generator``), so the rows do
not depend on ``jobs``. :func:`run_journaled` records every finished run in the grid's run
journal (``repro.journal``) and reuses (``--resume``) or only reports (``--report-only``) the
runs recorded there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._checks import check_int
from .framework import ExperimentSpec
from .journal import JOURNAL_NAME, RunJournal, canonical_key


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
    if len({canonical_key(key) for key in keys}) != len(keys):
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
