"""The crash-safe run journal of ``linattn repro`` and the report sentences on its runs.

A :class:`RunJournal` (``<out>/runs.jsonl``) records each finished run as one
JSON line ``{"key": ..., "row": ...}`` the moment it finishes, so an interrupted grid loses
at most the runs in flight: ``--resume`` reuses every recorded run whose key (the run's
arguments and configuration) matches, and ``--report-only`` reports the recorded runs
without training (``repro.grids.run_journaled``). Several processes may share one journal (one
seed each, say): each holds an exclusive ``flock`` on ``<journal>.lock`` while it loads and
rewrites the file and while it appends, so none rewrites the file from a read that another
process's rewrite had cut short. :func:`reuse_note`, :func:`closing_note`,
:func:`interim_note` and :func:`metadata_interim_note` are the reports' sentences on the runs
taken from the journal and on interim (``--report-only``) pages.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

JOURNAL_NAME = "runs.jsonl"


def canonical_key(key: Any) -> str:
    """``key`` (any JSON-able value) as text that is equal exactly when the values are: JSON
    with sorted object keys (how the journal, the grid and the aggregation tell keys apart)."""
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
        if read_only:  # e.g. an interim report while the grid's own process still appends
            self._load()
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            if resume:
                self._load()
            # Rewrite what was loaded (drops a torn last line) or start empty.
            with open(self.path, "w", encoding="utf-8") as handle:
                for key, row in self._rows.items():
                    handle.write(json.dumps({"key": json.loads(key), "row": row}) + "\n")

    def _load(self) -> None:
        """Read the recorded runs (a line that does not parse is skipped)."""
        if not self.path.exists():
            return
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
                self._rows[canonical_key(entry["key"])] = entry["row"]
            except (ValueError, KeyError, TypeError):
                continue

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the journal's lock (``<journal>.lock``, an exclusive flock; the kernel releases it
        when the process dies, so it is never stale)."""
        with open(self.path.with_name(self.path.name + ".lock"), "a", encoding="utf-8") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

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
        return self._rows.get(canonical_key(key))

    def record(self, key: Any, row: dict) -> None:
        """Append one finished run and flush it to disk."""
        if self.read_only:
            raise RuntimeError(f"{self.path} was opened read-only")
        self._rows[canonical_key(key)] = row
        with self._locked(), open(self.path, "a", encoding="utf-8") as handle:
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
