"""What the processes of a multi-process run settle before anything trains: the start-up exchanges.

Every process of a ``torchrun`` launch resolves its own run: it parses its own command line,
reads its own ``--config`` file, checkpoint and data. Nothing makes them agree by itself: a
launcher that gives one process another ``--lr`` trains a run no checkpoint describes, and one
that gives it another ``--checkpoint-every`` hangs both at the first checkpoint, where one
gathers and the other does not. So before the first step the processes compare, through
``exchange``:

1. ``"configuration"``, before the process group exists (``distributed.join``): any error a
   process met on its own (the run folder, the checkpoint, the settings) and its resolved
   run (``run_record``: the ``LMConfig`` and ``TrainConfig`` as the run records them, and the
   checkpoint it resumes by folder and the SHA-256 its ``meta.json`` records);
2. ``"data"``, once each has opened the data: its error, else the data's fingerprint
   (``linattn.data.fingerprint_fields``).

Each process posts its error (or None) and a SHA-256 of its record to the rendezvous store
and waits for every other process's post; then every process raises the same way: its own
error if it met one, else a ``RelayedError`` naming the first process that did (rank and
host); and when the hashes differ, the records themselves are exchanged and every process
raises a ValueError naming each setting that differs, its values and the ranks holding each
(``disagreement``). A process that does not post within the exchange's timeout is named in an
``ExchangeTimeout`` raised on the processes that did.

Settings a process may legitimately hold its own value of, left out of the comparison:
``train.threads`` (the CPU threads of its host) and ``train.cache_dir`` (where its host keeps
a downloaded corpus; the data itself is compared by its fingerprint).

The exchanges go through the rendezvous store (``store.set``/``wait``/``get``), not the
process group's collectives: they need no device (a process that could not read the
checkpoint does not know the run's device, hence its backend), each waits for its own
timeout, and a store knows which keys are missing, i.e. which processes did not arrive.
Keys are numbered by a per-rank counter in the store, so the exchanges of several runs in one
process group (and of one launch restarted by ``torchrun``, which makes a new store) never mix.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from typing import Any

from .._files import sha256_json
from .distributed import Context

PER_PROCESS_FIELDS = ("threads", "cache_dir")  # TrainConfig fields each process may set for its own host
_PREFIX = "linattn/startup"
_ABSENT = "(not set)"
_LISTED_FIELDS = 8


class RelayedError(ValueError):
    """An error another process met, raised on this one so that every process stops (the
    ``linattn`` command prints it on rank 0 and on the first process of each node, cli.py)."""


class ExchangeTimeout(ValueError):
    """A start-up exchange that some processes did not reach in time; the message names them."""


def run_record(model_config, train_config, checkpoint=None) -> dict[str, Any]:
    """What the processes of a run must agree on: every ``model.*`` and ``train.*`` setting
    (except ``PER_PROCESS_FIELDS``) and the checkpoint resumed (``"checkpoint"``: its folder and
    the SHA-256 its ``meta.json`` records, or ``"none (a new run)"``)."""
    record = {f"model.{key}": value for key, value in model_config.to_dict().items()}
    record.update({f"train.{key}": value for key, value in train_config.to_dict().items()
                   if key not in PER_PROCESS_FIELDS})
    record["checkpoint"] = "none (a new run)" if checkpoint is None else checkpoint.identity()
    return record


def record_hash(record: dict[str, Any] | None) -> str:
    """The SHA-256 of ``record`` as sorted JSON."""
    return sha256_json(record, default=str)


def exchange(context: Context, name: str, problem: BaseException | None, record: dict[str, Any] | None,
             timeout: float | None = None) -> None:
    """The start-up exchange ``name`` (see the module docstring) among ``context``'s processes:
    returns when no process met a problem and every ``record`` is equal; else raises, on every
    process, ``problem`` itself (this process met it), a ``RelayedError`` (another did), a
    ValueError naming the settings that differ (``disagreement``), or an ``ExchangeTimeout``
    naming the processes that did not post within ``timeout`` seconds (default
    ``context.timeout``). A single process raises its ``problem`` or returns."""
    if not context.distributed:
        if problem is not None:
            raise problem
        return
    wait = context.timeout if timeout is None else timeout
    turn = context.store.add(f"{_PREFIX}/turns/{context.rank}", 1)
    key = f"{_PREFIX}/{turn}/{name}"
    post = {"host": socket.gethostname(), "problem": None if problem is None else str(problem),
            "hash": None if problem is not None else record_hash(record)}
    try:
        posts = _all_posts(context, key, post, name, wait)
    except ExchangeTimeout:
        if problem is not None:
            raise problem from None
        raise
    failure = _failure(context, posts, problem)
    if failure is None and len({p["hash"] for p in posts}) > 1:
        records = _all_posts(context, f"{key}/records", record, name, wait)
        failure = ValueError(disagreement(records, name) or f"the processes' {name} records differ")
    if failure is not None:
        _read_by_all(context, key, wait)
        raise failure


def _failure(context: Context, posts: list[dict[str, Any]], problem: BaseException | None) -> BaseException | None:
    """``problem`` itself, else a ``RelayedError`` for the first process that posted one, else None."""
    if problem is not None:
        return problem
    failed = [(rank, post) for rank, post in enumerate(posts) if post["problem"] is not None]
    if not failed:
        return None
    rank, first = failed[0]
    more = len(failed) - 1
    others = f" (and {more} more {'process' if more == 1 else 'processes'})" if more else ""
    return RelayedError(f"rank {rank} of {context.world_size} (on {first['host']}) stopped before training{others}: "
                        f"{first['problem']}")


def _read_by_all(context: Context, key: str, wait: float) -> None:
    """Before a process stops: say it has read every post, and wait until all have (when the
    store lives in rank 0's process, which takes it along when it ends)."""
    keys = [f"{key}/read/{rank}" for rank in range(context.world_size)]
    context.store.set(keys[context.rank], "1")
    try:
        context.store.wait(keys, timedelta(seconds=wait))
    except RuntimeError:
        pass  # a process that stopped answering cannot be waited for; every one has read what it needed


def _all_posts(context: Context, key: str, value: Any, name: str, wait: float) -> list[Any]:
    """Post ``value`` under ``key`` for this rank and return every rank's post, in rank order."""
    keys = [f"{key}/{rank}" for rank in range(context.world_size)]
    context.store.set(keys[context.rank], json.dumps(value, sort_keys=True, default=str))
    try:
        context.store.wait(keys, timedelta(seconds=wait))
    except RuntimeError:  # torch's DistStoreError, or a FileStore's "Wait timeout"
        raise ExchangeTimeout(_timeout_message(context, keys, name, wait)) from None
    return [json.loads(context.store.get(k)) for k in keys]


def _timeout_message(context: Context, keys: list[str], name: str, wait: float) -> str:
    try:
        missing = [rank for rank, k in enumerate(keys) if not context.store.check([k])]
        absent = f"{_ranks(missing)} of {context.world_size} did not arrive"
    except RuntimeError:  # the store itself is gone (its host, rank 0's or the agent's, ended)
        absent = "the rendezvous store stopped answering (the process or node holding it ended)"
    return (f"rank {context.rank}: the start-up exchange '{name}' timed out after {wait:g} s: {absent} (still "
            f"starting or reading, stuck, or stopped without reaching it: see their own output). "
            f"--dist-timeout SECONDS (train.dist_timeout) sets the wait")


def disagreement(records: list[dict[str, Any]], name: str = "configuration") -> str | None:
    """Each field on which the processes' ``records`` (one per rank, in rank order) differ, with
    each value and the ranks holding it (``"train.lr is 0.003 on rank 0, 0.001 on rank 1"``), as
    one message; None when they agree. A field missing from a record reads ``(not set)``."""
    fields = sorted(set().union(*records))
    differences = []
    for field in fields:
        shown = [_shown(record.get(field, _ABSENT)) for record in records]
        if len(set(shown)) == 1:
            continue
        holders: dict[str, list[int]] = {}
        for rank, value in enumerate(shown):
            holders.setdefault(value, []).append(rank)
        held = ", ".join(f"{value} on {_ranks(ranks)}" for value, ranks in holders.items())
        differences.append(f"{field} is {held}")
    if not differences:
        return None
    if len(differences) > _LISTED_FIELDS:
        differences = differences[:_LISTED_FIELDS] + [f"and {len(differences) - _LISTED_FIELDS} more"]
    return (f"the {len(records)} processes of this run disagree on its {name}: {'; '.join(differences)}. Start "
            f"every process with the same settings (command line, --config file, --set) and the same data, run "
            f"folder and checkpoint (only train.{' and train.'.join(PER_PROCESS_FIELDS)} may differ)")


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _ranks(ranks: list[int]) -> str:
    """``[0, 2, 3, 4]`` -> ``"ranks 0, 2-4"``; ``[1]`` -> ``"rank 1"``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
