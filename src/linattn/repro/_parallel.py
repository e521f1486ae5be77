"""Independent training runs of a reproduction grid, one process or several, resumable.

A grid is a list of argument tuples for one module-level ``train`` function. With
``jobs == 1`` the runs go one after another in this process (with a live progress
callback); with ``jobs > 1`` that many run at once in spawned worker processes, each with
``threads`` torch threads. Runs are seeded, so the results do not depend on ``jobs``.

A ``RunJournal`` (``<out>/runs.jsonl``) records each finished run as one JSON line
``{"key": ..., "row": ...}`` the moment it finishes, so a grid of many CPU-hours that is
interrupted (or run in parts) loses at most the runs in flight: ``--resume`` reuses every
recorded run whose key (the run's arguments and configuration) matches.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

JOURNAL_NAME = "runs.jsonl"


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
    for name, value in (("jobs", jobs), ("threads", threads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
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
