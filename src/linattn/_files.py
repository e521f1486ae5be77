"""Crash-safe file writes shared by checkpoints, reports and run journals, and the SHA-256 of a file."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def fsync_file(path: Path) -> None:
    """Flush ``path``'s contents to disk."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a crash leaves either the old file or the new one (a
    killed writer may leave its temporary ``.NAME.tmp-PID`` beside it; one that fails removes it)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(text, encoding="utf-8")
        fsync_file(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def sha256_json(value: Any, default: Callable[[Any], Any] | None = None) -> str:
    """The SHA-256 (hex) of ``json.dumps(value, sort_keys=True)`` in UTF-8 (``default``: as
    ``json.dumps`` takes it, for values JSON has no form of)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=default).encode("utf-8")).hexdigest()


def sha256_file(path: Path) -> str:
    """The SHA-256 (hex) of ``path``'s bytes, read in pieces: a file of any size needs no more memory."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
