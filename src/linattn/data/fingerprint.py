"""What identifies the data a run trained on, so a resume or an evaluation can tell that it changed.

``data_fingerprint(data)`` describes opened token data by its files:

- a byte ``Corpus`` (a text file, a folder of ``.txt`` files, a ``.zip``, ``"shakespeare"``):
  the size and SHA-256 of every source file (``Corpus.sources``), by its name in the corpus;
- ``Shards``: the size and SHA-256 of the folder's ``meta.json`` (which records the token
  count of every split and the size and SHA-256 of every source file) and of each split's
  ``.bin`` file, read in pieces (``Shards.content_sha256``: a ``.bin`` whose SHA-256 is not
  the one ``meta.json`` records is a ValueError naming it, whatever a checkpoint recorded).

The result is a JSON-ready dict ``{"kind": "corpus" | "shards", "files": {name: {"bytes": n,
"sha256": hex}}}``, which a checkpoint stores as ``data_fingerprint``.
``fingerprint_changes(recorded, current)`` says in words what differs (a file changed, with
both sizes and hashes; a file missing; a new file; another kind of data), or returns None
when nothing does; a file recorded by its size alone (the ``.bin`` files of an older
linattn's checkpoints) is compared by size. ``fingerprint_fields(fingerprint)`` is the same
content as flat ``{"data kind": ..., "data file NAME": "N bytes, SHA-256 ..."}`` entries, the
form in which the processes of a multi-process run compare their data (``train/startup.py``).
Computing a fingerprint reads every file once
(docs/guide/scale.md says what that costs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._files import sha256_file
from .corpus import Corpus
from .shakespeare import SPLITS
from .shards import META, Shards

_KINDS = {"corpus": "a byte corpus", "shards": "a shard folder"}
_LISTED_CHANGES = 8


def _file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def data_fingerprint(data: Corpus | Shards) -> dict[str, Any]:
    """The fingerprint of opened token data (see the module docstring): a byte corpus by the
    size and SHA-256 of each source file, a shard folder by those of its ``meta.json`` and of
    each ``.bin`` file (checked against ``meta.json``)."""
    if isinstance(data, Shards):
        files = {META: _file_record(data.folder / META)}
        for split in SPLITS:
            name = data.meta["splits"][split]["file"]
            files[name] = {"bytes": data.split_file(split).stat().st_size, "sha256": data.content_sha256(split)}
        return {"kind": "shards", "files": files}
    if isinstance(data, Corpus):
        return {"kind": "corpus", "files": {name: _file_record(Path(path)) for name, path in data.sources.items()}}
    raise TypeError(f"data: expected a Corpus or Shards (linattn.data.open_data), got {type(data).__name__}")


def _describe(record: dict[str, Any]) -> str:
    text = f"{record.get('bytes')} bytes"
    return f"{text}, SHA-256 {record['sha256'][:12]}" if record.get("sha256") else text


def _same_file(recorded: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether two records of a file agree: by size and SHA-256, or by size alone when either
    has no SHA-256."""
    if recorded.get("sha256") is None or current.get("sha256") is None:
        return recorded.get("bytes") == current.get("bytes")
    return recorded.get("bytes") == current.get("bytes") and recorded["sha256"] == current["sha256"]


def fingerprint_fields(fingerprint: dict[str, Any]) -> dict[str, str]:
    """A fingerprint as flat named fields: ``"data kind"`` (a byte corpus or a shard folder) and
    one ``"data file NAME"`` per file (its size and the first 12 digits of its SHA-256)."""
    kind = fingerprint.get("kind")
    fields = {"data kind": _KINDS.get(kind, repr(kind))}
    fields.update({f"data file {name}": _describe(record) for name, record in fingerprint.get("files", {}).items()})
    return fields


def fingerprint_changes(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What differs between a ``recorded`` fingerprint and the ``current`` one, in words
    (``"data.txt changed: recorded 8000 bytes, SHA-256 ..., now ..."``, ``"b.txt is
    missing"``, ``"c.txt is new"``, joined by ``"; "``), or None when they match."""
    if recorded.get("kind") != current.get("kind"):
        was = _KINDS.get(recorded.get("kind"), repr(recorded.get("kind")))
        now = _KINDS.get(current.get("kind"), repr(current.get("kind")))
        return f"it was {was}, now it is {now}"
    before, after = recorded.get("files", {}), current.get("files", {})
    changes = []
    for name in sorted(before.keys() | after.keys()):
        if name not in after:
            changes.append(f"{name} is missing (recorded {_describe(before[name])})")
        elif name not in before:
            changes.append(f"{name} is new ({_describe(after[name])})")
        elif not _same_file(before[name], after[name]):
            changes.append(f"{name} changed: recorded {_describe(before[name])}, now {_describe(after[name])}")
    if not changes:
        return None
    if len(changes) > _LISTED_CHANGES:
        changes = changes[:_LISTED_CHANGES] + [f"and {len(changes) - _LISTED_CHANGES} more files"]
    return "; ".join(changes)
