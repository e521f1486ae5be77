"""One writer per run folder, and no run folder reused by accident.

A run folder (``linattn train --out R``) is claimed before anything is written to it:

- **Lock.** The writer holds an exclusive OS lock on the folder itself for as long as it
  runs: ``fcntl.flock`` on the folder's own directory descriptor (on Windows, where a folder
  cannot be locked, ``msvcrt.locking`` on ``R/.lock``, a file Windows does not let anyone
  delete while it is open; and on a filesystem that cannot lock a folder, such as NFS, where
  deleting it would let a second writer in). Elsewhere nothing a clean-up can delete defeats it, and
  the kernel releases it when the process ends, however it ends, so a crash never leaves a
  stale lock. ``R/.lock`` describes the holder (its PID and command) for a second writer's
  error; deleting it only loses that description (on Linux the holder is then found in
  ``/proc/locks``). Under ``torchrun`` rank 0 (the only writer) takes it and the other ranks
  learn the outcome.
- **Reuse.** A fresh ``train`` into a folder that already holds a run's files
  (``RUN_FILES``: metrics, checkpoints, TensorBoard events, the run's tokenizer) is refused
  with the command that resumes it; ``overwrite`` moves the old run aside to
  ``R.old-N`` (the first free N) instead, and deletes nothing.
- **Failed starts.** A claim that fails, or a start that fails before it wrote anything
  (``RunLock.release(discard=True)``), removes what claiming created: ``R/.lock`` and the
  folders that did not exist, so a retry finds the folder as it was.
- **Leftovers.** Temporary checkpoint folders and files (``.tmp-*``, ``.old-*`` and
  ``.NAME.tmp-PID``) that a killed or failed writer left behind, in ``R`` and in
  ``R/checkpoints``, are removed when the run is next claimed, unless their PID is a live
  process's.
- **Written elsewhere.** A command that writes a whole new run folder (``convert``) builds
  it as ``.NAME.tmp-PID`` beside it and renames it into place (``new_run_folder``), so a
  kill leaves no half-written run at ``R``, and the retry removes the dead one's temporary.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from .._files import write_text_atomic
from .run_tokenizer import DATA_META_FILE, TOKENIZER_FILE

LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"
RUN_FILES = (METRICS_FILE, "checkpoints", "tensorboard", TOKENIZER_FILE, DATA_META_FILE)
_TEMPORARY = re.compile(r"^\.(?:tmp-step-\d+|old-step-\d+|.+\.tmp)-(\d+)$")
_WINDOWS = sys.platform == "win32"


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


# -- the OS lock ------------------------------------------------------------------------------


def _lock_targets(folder: Path) -> tuple[Path, ...]:
    """What may be locked, in order of preference: the folder itself, which no deletion can
    defeat; its ``.lock`` file where the folder cannot be locked (Windows; a filesystem such as
    NFS, which takes ``flock`` as a byte-range lock that a folder opened for reading cannot
    hold), where deleting ``.lock`` would let a second writer in."""
    return (folder / LOCK_FILE,) if _WINDOWS else (folder, folder / LOCK_FILE)


def _open(target: Path) -> int:
    if target.name == LOCK_FILE:
        return os.open(target, os.O_RDWR | os.O_CREAT)
    return os.open(target, os.O_RDONLY)


def _lock(folder: Path, *, create: bool = True) -> tuple[int, Path] | None:
    """Lock ``folder`` for this process (``_lock_targets``): ``(descriptor, the path locked)``,
    or None when another process holds it. OSError if it cannot be opened or locked at all, and,
    without ``create``, FileNotFoundError where only a ``.lock`` file could be locked and there
    is none (so no writer holds the folder)."""
    targets = _lock_targets(folder)
    for target in targets:
        if not create and target.name == LOCK_FILE and not target.exists():
            raise FileNotFoundError(target)
        descriptor = _open(target)
        try:
            if _try_lock(descriptor):
                return descriptor, target
        except OSError:  # this filesystem cannot lock a folder: the next target
            os.close(descriptor)
            if target == targets[-1]:
                raise
            continue
        os.close(descriptor)
        return None
    raise AssertionError("unreachable")


def _try_lock(descriptor: int) -> bool:
    """Take an exclusive, non-blocking lock on ``descriptor``; False if another holds it."""
    if _WINDOWS:
        import msvcrt

        try:
            os.lseek(descriptor, 0, os.SEEK_SET)
            msvcrt.locking(descriptor, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    import fcntl

    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _same_file(descriptor: int, path: Path) -> bool:
    """Whether ``path`` is still the file or folder ``descriptor`` was opened on."""
    try:
        on_disk, held = os.stat(path), os.fstat(descriptor)
    except OSError:
        return False
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def _flock_holder(folder: Path) -> int | None:
    """The PID holding a ``flock`` on ``folder``, from ``/proc/locks`` (Linux; None elsewhere or
    when none is listed)."""
    try:
        status = os.stat(folder)
        with open("/proc/locks", encoding="ascii") as handle:
            table = handle.read().splitlines()
    except OSError:
        return None
    device = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    for line in table:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device and fields[4].isdigit():
            return int(fields[4])
    return None


def _command_of(pid: int) -> str | None:
    """Process ``pid``'s command line from ``/proc`` (Linux), shortened to one line."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    words = " ".join(raw.decode("utf-8", "replace").replace("\0", " ").split())
    return words if len(words) <= 160 else words[:157] + "..."


def _describe_holder(folder: Path) -> str:
    """``PID N (command)`` of the process that holds ``folder``'s lock, from ``.lock`` or, when
    that description is missing or names another process, from the OS."""
    try:
        text = (folder / LOCK_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        text = ""
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    holder = None if _WINDOWS else _flock_holder(folder)
    if holder is not None and fields.get("pid") != str(holder):
        command = _command_of(holder)
        return f"PID {holder}" + (f" ({command})" if command else "")
    if not fields:
        return f"PID unknown ({folder / LOCK_FILE}, which names the holder, is missing or empty)"
    command = fields.get("command")
    return f"PID {fields.get('pid', 'unknown')}" + (f" ({command})" if command else "")


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist, innermost first."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    return missing


class RunLock:
    """The exclusive lock on a run folder, held from ``acquire`` until ``release`` (or the
    process's end). ``with RunLock.acquire(folder, what=...):`` releases it on leaving."""

    def __init__(self, folder: Path, descriptor: int, target: Path, created: list[Path]) -> None:
        self.folder, self._descriptor, self._created = folder, descriptor, created
        self._holds_description = target.name == LOCK_FILE  # the locked file is .lock itself

    @classmethod
    def acquire(cls, folder: str | Path, *, what: str, command: str = "") -> "RunLock":
        """Lock ``folder`` (created if missing) for this process and describe this process in
        its ``.lock``; ``RunFolderError`` naming the holder's PID if another process holds it
        (then nothing is created). ``what`` says who asks (``train``)."""
        folder = Path(folder)
        for _ in range(3):  # the folder can be renamed away (--overwrite) between open and lock: retry
            missing = _missing_folders(folder)
            try:
                folder.mkdir(parents=True, exist_ok=True)
                had_description = (folder / LOCK_FILE).exists()
                locked = _lock(folder)
            except OSError as error:
                raise RunFolderError(f"{what}: cannot create, open or lock the run folder {folder}: {error}") from None
            if locked is None:
                raise RunFolderError(
                    f"{what}: {folder} is in use by another writer, {_describe_holder(folder)}; two writers in one "
                    f"run folder would replace each other's checkpoints and interleave their metrics. Wait for it "
                    f"to finish (or stop it), or choose another --out")
            descriptor, target = locked
            if _same_file(descriptor, target):
                created = [folder / LOCK_FILE] * (not had_description) + missing
                lock = cls(folder, descriptor, target, created)
                lock._describe(command or what)
                return lock
            os.close(descriptor)
        raise RunFolderError(f"{what}: {folder} was replaced while it was being locked (three times); try again")

    def _describe(self, command: str) -> None:
        text = f"pid={os.getpid()}\ncommand={command}\n"
        if self._holds_description:  # written in place: replacing the locked file would drop the lock
            os.lseek(self._descriptor, 0, os.SEEK_SET)
            os.ftruncate(self._descriptor, 0)
            os.write(self._descriptor, text.encode("utf-8"))
        else:
            write_text_atomic(self.folder / LOCK_FILE, text)

    def release(self, *, discard: bool = False) -> None:
        """Drop the lock. ``discard`` (a start that failed): also remove what ``acquire``
        created (the ``.lock`` description and the folders that did not exist) if the folder
        holds nothing else; a folder where anything else was written is left as it is."""
        if self._descriptor is None:
            return
        unused = discard and all(entry in self._created for entry in self.folder.iterdir())
        if unused and not _WINDOWS:  # removed while still held
            self._remove_created()
        os.close(self._descriptor)  # closing the descriptor drops the lock
        self._descriptor = None
        if unused and _WINDOWS:  # an open file cannot be deleted there
            self._remove_created()

    def _remove_created(self) -> None:
        try:
            for path in self._created:  # the description, then the folders innermost first
                if path.name == LOCK_FILE:
                    path.unlink(missing_ok=True)
                else:
                    path.rmdir()
        except OSError:  # no longer empty: someone else's now
            pass

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_not_in_use(folder: str | Path, *, what: str) -> None:
    """``RunFolderError`` if a live process holds ``folder``'s run lock (nothing is created)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    try:
        locked = _lock(folder, create=False)
    except OSError:
        return
    if locked is None:
        raise RunFolderError(f"{what}: {folder} is in use by a training run, {_describe_holder(folder)}; "
                             f"wait for it to finish or choose another folder")
    os.close(locked[0])


def check_free_output(folder: str | Path, *, what: str) -> None:
    """``folder``, the output of ``what`` (``convert``, ``export``), is not a training run's:
    ``RunFolderError`` if it holds a run's files or a live writer holds it."""
    present = run_files(folder)
    if present:
        raise RunFolderError(f"{what}: --out {folder} already holds a run ({', '.join(present)}): it is a training "
                             f"run's folder; choose another folder")
    check_not_in_use(folder, what=what)


def run_files(folder: str | Path) -> list[str]:
    """The names of ``RUN_FILES`` present in ``folder`` (a run lives there if any is)."""
    folder = Path(folder)
    return [name for name in RUN_FILES if (folder / name).exists()]


def start_instead(folder: str | Path) -> str:
    """The command that starts a run in ``folder``, which holds no checkpoint to resume: a
    fresh start, with ``--overwrite`` when files of a run that stopped before its first
    checkpoint are there (they are moved aside, not deleted)."""
    folder = Path(folder)
    present = run_files(folder)
    if not present:
        return f"start a run there with: linattn train --out {folder} (and the run's settings)"
    return (f"it holds only {', '.join(present)}: the run stopped before its first checkpoint. Start it again with "
            f"--overwrite, which moves these files aside to {_aside_name(folder).name} (nothing is deleted): "
            f"linattn train --out {folder} --overwrite (and the run's settings)")


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
    removed (``remove_stale_temporaries``). A refusal removes what the claim created.
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
        remove_stale_temporaries(folder)
        remove_stale_temporaries(folder / "checkpoints")
    except BaseException:
        lock.release(discard=True)
        raise
    return lock


def remove_stale_temporaries(root: str | Path, *, of: str | None = None) -> list[Path]:
    """Remove the temporaries in the folder ``root`` (a run folder or its checkpoints) whose
    writer is dead: ``.tmp-step-N-PID`` and ``.old-step-N-PID`` folders and ``.NAME.tmp-PID``
    files or folders (only those of ``NAME == of`` when given), never one that ``latest``
    names or whose PID is alive. Returns what was removed."""
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
        if of is not None and entry.name != f".{of}.tmp-{match.group(1)}":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


@contextmanager
def new_run_folder(out: str | Path, *, what: str):
    """``with new_run_folder(out, what="convert") as folder:`` write a whole new run into
    ``folder``, a temporary ``.NAME.tmp-PID`` beside ``out``, which is renamed to ``out`` when
    the block ends without an error (and removed when it raises). ``out`` must be free then
    (missing or an empty folder; ``check_free_output``); temporaries that dead writers left
    for ``out`` are removed first, so a command killed while writing can simply be run again."""
    out = Path(os.path.abspath(out))
    check_free_output(out, what=what)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent, of=out.name)
    temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        yield temporary
        check_free_output(out, what=what)
        if out.is_dir() and {entry.name for entry in out.iterdir()} <= {LOCK_FILE}:  # free: at most a past lock
            (out / LOCK_FILE).unlink(missing_ok=True)
            out.rmdir()
        try:
            os.rename(temporary, out)
        except OSError as error:
            raise RunFolderError(f"{what}: cannot move the new run into --out {out}: {error} (something was written "
                                 f"there meanwhile); choose another folder") from None
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
