"""Independent training runs of a reproduction grid, one process or several.

A grid is a list of argument tuples for one module-level ``train`` function. With
``jobs == 1`` the runs go one after another in this process (with a live progress
callback); with ``jobs > 1`` that many run at once in spawned worker processes, each with
``threads`` torch threads. Runs are seeded, so the results do not depend on ``jobs``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def _run_in_worker(job: tuple) -> Any:
    train, args, threads = job
    torch.set_num_threads(threads)
    return train(*args)


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
) -> list[dict]:
    """``[train(*args) for args in grid]`` in grid order, advancing the tqdm ``bar`` per run.

    ``describe(row)`` is shown on the bar when a run finishes. In-process runs (``jobs ==
    1``) also receive ``progress_kwarg=show_progress(args)`` for per-step updates.
    ``jobs`` and ``threads`` must be ints >= 1 (a ValueError naming the argument otherwise).
    """
    for name, value in (("jobs", jobs), ("threads", threads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if jobs == 1:
        rows = []
        for args in grid:
            kwargs = {progress_kwarg: show_progress(args)} if progress_kwarg and show_progress else {}
            rows.append(train(*args, **kwargs))
            bar.set_postfix_str(describe(rows[-1]))
            bar.update(1)
        return rows
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    context = multiprocessing.get_context("spawn")
    done: dict[int, dict] = {}
    with ProcessPoolExecutor(max_workers=min(jobs, len(grid)), mp_context=context) as pool:
        futures = {pool.submit(_run_in_worker, (train, args, threads)): i for i, args in enumerate(grid)}
        for future in as_completed(futures):
            row = future.result()
            done[futures[future]] = row
            bar.set_postfix_str(describe(row))
            bar.update(1)
    return [done[i] for i in range(len(grid))]
