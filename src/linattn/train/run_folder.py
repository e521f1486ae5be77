"""One writer per run folder, and no run folder reused by accident.

A run folder (``linattn train --out R``) is claimed before anything is written to it:

- **Lock.** The writer holds an exclusive OS lock (``fcntl.flock``; ``msvcrt.locking`` on
  Windows) on ``R/.lock`` for as long as it runs; the kernel releases it when the process
  ends, however it ends, so a crash never leaves a stale lock. The file holds the holder's
  PID and command, which a second writer's error names. Under ``torchrun`` rank 0 (the
  only writer) takes it and the other ranks learn the outcome.
- **Reuse.** A fresh ``train`` into a folder that already holds a run's files
  (``RUN_FILES``: metrics, checkpoints, TensorBoard events, the run's tokenizer) is refused
  with the command that resumes it; ``overwrite`` moves the old run aside to
  ``R.old-N`` (the first free N) instead, and deletes nothing.
- **Leftovers.** Temporary checkpoint folders and files (``.tmp-*``, ``.old-*`` and
  ``.NAME.tmp-PID``) that a killed or failed writer left behind are removed when the run is
  next claimed, unless their PID is a live process's.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from .run_tokenizer import DATA_META_FILE, TOKENIZER_FILE

LOCK_FILE = ".lock"
RUN_FILES = ("metrics.jsonl", "checkpoints", "tensorboard", TOKENIZER_FILE, DATA_META_FILE)
_TEMPORARY = re.compile(r"^\.(?:tmp-step-\d+|old-step-\d+|.+\.tmp)-(\d+)$")


class RunFolderError(ValueError):
    """A run folder that is in use by another writer, or that holds a run a fresh start would replace."""


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (one owned by another user counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _try_lock(handle) -> bool:
    """Take an exclusive, non-blocking lock on the open file ``handle``; False if another holds it."""
    if sys.platform == "win32":
        import msvcrt

        try:
            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl

    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _describe_holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError:
        text = ""
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    pid = fields.get("pid", "unknown")
    command = fields.get("command")
    return f"PID {pid}" + (f" ({command})" if command else "")


class RunLock:
    """The exclusive lock on a run folder, held from ``acquire`` until ``release`` (or the
    process's end). ``with RunLock.acquire(folder, what=...):`` releases it on leaving."""

    def __init__(self, folder: Path, handle) -> None:
        self.folder, self._handle = folder, handle

    @classmethod
    def acquire(cls, folder: str | Path, *, what: str, command: str = "") -> "RunLock":
        """Lock ``folder`` (created if missing) for this process; ``RunFolderError`` naming
        the holder's PID if another process holds it. ``what`` says who asks (``train``)."""
        folder = Path(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            handle = open(folder / LOCK_FILE, "a+", encoding="utf-8")
        except OSError as error:
            raise RunFolderError(f"{what}: cannot create the run folder's lock {folder / LOCK_FILE}: {error}") from None
        if not _try_lock(handle):
            handle.close()
            raise RunFolderError(
                f"{what}: {folder} is in use by another writer, {_describe_holder(folder / LOCK_FILE)}; two writers "
                f"in one run folder would replace each other's checkpoints and interleave their metrics. Wait for "
                f"it to finish (or stop it), or choose another --out")
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid={os.getpid()}\ncommand={command or what}\n")
        handle.flush()
        return cls(folder, handle)

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the descriptor drops the lock
            self._handle = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_not_in_use(folder: str | Path, *, what: str) -> None:
    """``RunFolderError`` if a live process holds ``folder``'s run lock (nothing is created)."""
    path = Path(folder) / LOCK_FILE
    if not path.is_file():
        return
    with open(path, "a+", encoding="utf-8") as handle:
        if not _try_lock(handle):
            raise RunFolderError(f"{what}: {folder} is in use by a training run, {_describe_holder(path)}; "
                                 f"wait for it to finish or choose another folder")


def check_free_output(folder: str | Path, *, what: str, locked: bool = False) -> None:
    """``folder``, the output of ``what`` (``convert``, ``export``), is not a training run's:
    ``RunFolderError`` if it holds a run's files, or (unless this process holds its lock:
    ``locked``) a live writer holds it."""
    present = run_files(folder)
    if present:
        raise RunFolderError(f"{what}: --out {folder} already holds a run ({', '.join(present)}): it is a training "
                             f"run's folder; choose another folder")
    if not locked:
        check_not_in_use(folder, what=what)


def run_files(folder: str | Path) -> list[str]:
    """The names of ``RUN_FILES`` present in ``folder`` (a run lives there if any is)."""
    folder = Path(folder)
    return [name for name in RUN_FILES if (folder / name).exists()]


def _aside_name(folder: Path) -> Path:
    n = 1
    while folder.with_name(f"{folder.name}.old-{n}").exists():
        n += 1
    return folder.with_name(f"{folder.name}.old-{n}")


def claim_run_folder(folder: str | Path, *, fresh: bool, overwrite: bool = False, command: str = "",
                     echo=print) -> RunLock:
    """Lock ``folder`` for a training run and return the lock.

    ``fresh`` (a new run, not ``--resume``): a folder holding a run's files is refused with
    the command that continues it, or, with ``overwrite``, moved aside to ``FOLDER.old-N``
    (``echo`` says where) and started empty. Then stale temporaries of dead writers are
    removed (``remove_stale_temporaries``).
    """
    folder = Path(folder)
    lock = RunLock.acquire(folder, what="train", command=command)
    try:
        present = run_files(folder) if fresh else []
        if present and not overwrite:
            raise RunFolderError(
                f"--out {folder} already holds a run ({', '.join(present)}); a new run there would replace it. "
                f"Continue it with: linattn train --resume --out {folder}; or pass --overwrite to move it aside "
                f"to {_aside_name(folder).name} (nothing is deleted); or choose another --out")
        if present:
            aside = _aside_name(folder)
            os.rename(folder, aside)  # the lock we hold moves with it: nobody can claim the old run meanwhile
            old = lock
            lock = RunLock.acquire(folder, what="train", command=command)
            old.release()
            echo(f"--overwrite: moved the previous run in {folder} to {aside}")
        remove_stale_temporaries(folder / "checkpoints")
    except BaseException:
        lock.release()
        raise
    return lock


def remove_stale_temporaries(root: str | Path) -> list[Path]:
    """Remove the temporaries under ``root`` (a checkpoints folder) whose writer is dead:
    ``.tmp-step-N-PID`` and ``.old-step-N-PID`` folders and ``.NAME.tmp-PID`` files, never
    one that ``latest`` names or whose PID is alive. Returns what was removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    pointer = root / "latest"
    latest = pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None
    removed = []
    for entry in root.iterdir():
        match = _TEMPORARY.match(entry.name)
        if match is None or entry.name == latest or _pid_alive(int(match.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed
