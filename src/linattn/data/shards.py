"""Token shards on disk: a corpus tokenized once, read back through ``numpy.memmap``.

``prepare_shards(source, tokenizer, out)`` (``linattn data prepare``) loads any corpus
``load_corpus`` reads, tokenizes its train / validation / test splits and writes into
the folder ``out``:

- ``train.bin``, ``validation.bin``, ``test.bin``: the token ids of each split, one flat
  array, little-endian ``uint8`` (vocabulary <= 256), ``uint16`` (<= 65536) or ``uint32``;
- ``tokenizer.json``: the Hugging Face tokenizer (absent for byte tokens);
- ``meta.json``: format tag, the source, its encoding (``"utf-8"``, or ``"bytes"`` for text
  read byte for byte), the tokenizer (kind, vocabulary size, SHA-256 of ``tokenizer.json``),
  the dtype, per split its file, token count, byte count, documents, the SHA-256 of its
  ``.bin`` file (``sha256``) and its largest token id (``max_token_id``), the split rule, and
  the size and SHA-256 of every source file.

Tokenizers (``tokenizer=``): ``"bytes"`` (ids are the UTF-8 bytes, as byte-level runs read
them), ``"bpe:VOCAB"`` (a byte-level BPE of VOCAB tokens learned from the train split
alone, ``hf_tokenizer.train_bpe``) or the path of a ``tokenizer.json``. Text goes to the
tokenizer in pieces of about 64 KiB, cut just before a ``\\n`` that is followed by a
printable ASCII character; for the GPT-2 word rule of byte-level BPE every such cut is a
word boundary, so the ids are those of the whole split encoded at once (other
pre-tokenizers see the pieces). Bytes that are not valid UTF-8 reach the tokenizer as
U+FFFD; the byte counts in ``meta.json`` are those of the split itself.

The folder is written under a temporary name and renamed into place, so an interrupted
``prepare`` never leaves a folder that looks complete. ``Shards(out)`` opens it: the
interface of ``Corpus`` (``tokens(split)``, ``byte_count(split)``, ``vocab_size``,
``tokenizer``), with ``tokens(split)`` a tensor over a read-only memory map of the file,
so a split is never read into memory as a whole.

Opening checks sizes (and the tokenizer's SHA-256), not the tokens: ``content_sha256(split)``
reads a split's file (in pieces) and refuses one whose SHA-256 is not the one ``meta.json``
records; the fingerprint of a run's data (``fingerprint.py``) calls it for every split.
Folders written before the hashes were recorded (no ``sha256``/``max_token_id``) still open.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .._checks import is_int, token_id_range
from .._files import sha256_file
from .corpus import Corpus, load_corpus
from .hf_tokenizer import MIN_BPE_VOCAB, HFTokenizer, train_bpe
from .shakespeare import SPLITS
from .tokenizer import ByteTokenizer

FORMAT = "linattn-shards"
VERSION = 1
META = "meta.json"
TOKENIZER = "tokenizer.json"
PIECE_BYTES = 1 << 16
_PIECES_PER_BATCH = 256
_DTYPES = {"uint8": 1 << 8, "uint16": 1 << 16, "uint32": 1 << 32}
_NEWLINE = 10
_PRINTABLE = (33, 126)  # ASCII '!' .. '~'
_SHA256 = re.compile("[0-9a-f]{64}")


def dtype_for(vocab_size: int) -> str:
    """The smallest of ``uint8`` / ``uint16`` / ``uint32`` that holds ids ``< vocab_size``."""
    for name, limit in _DTYPES.items():
        if vocab_size <= limit:
            return name
    raise ValueError(f"vocab_size: expected at most {1 << 32} tokens, got {vocab_size}")


def parse_tokenizer(spec: str) -> tuple[str, int | Path | None]:
    """``"bytes"`` -> ``("bytes", None)``, ``"bpe:VOCAB"`` -> ``("bpe", VOCAB)``, a path ->
    ``("file", path)``."""
    text = str(spec).strip()
    if text == "bytes":
        return "bytes", None
    if text.startswith("bpe:"):
        size = text[4:]
        if not size.isdigit() or int(size) < MIN_BPE_VOCAB:
            raise ValueError(f"--tokenizer {spec}: expected bpe:VOCAB with VOCAB an integer >= {MIN_BPE_VOCAB} "
                             f"(the 256 bytes plus merges), e.g. bpe:2048")
        return "bpe", int(size)
    path = Path(text).expanduser()
    if path.is_file():
        return "file", path
    raise ValueError(f"--tokenizer {spec}: expected 'bytes', 'bpe:VOCAB' or the path of a tokenizer.json "
                     f"({path} is not a file)")


def text_pieces(data: torch.Tensor, piece_bytes: int = PIECE_BYTES) -> Iterator[str]:
    """The UTF-8 text of the uint8 tensor ``data`` in pieces of at least ``piece_bytes``
    bytes (but the last), each cut just before a ``\\n`` followed by printable ASCII.

    Invalid UTF-8 decodes to U+FFFD; cuts fall before ASCII bytes, never inside a character.
    """
    for piece, _ in _sized_pieces(data, piece_bytes):
        yield piece


def _sized_pieces(data: torch.Tensor, piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[str, int]]:
    """``text_pieces`` with the number of bytes of ``data`` each piece decodes."""
    values = data.numpy()
    n, start = len(values), 0
    while start < n:
        end = _next_cut(values, start + max(1, piece_bytes))
        yield bytes(values[start:end]).decode("utf-8", errors="replace"), end - start
        start = end


def _next_cut(values: np.ndarray, position: int) -> int:
    """The first ``j >= position`` with ``values[j] == '\\n'`` and ``values[j + 1]``
    printable ASCII, or ``len(values)``."""
    n, window = len(values), 1 << 16
    while position < n - 1:
        stop = min(n - 1, position + window)
        here = values[position:stop]
        after = values[position + 1:stop + 1]
        hits = np.flatnonzero((here == _NEWLINE) & (after >= _PRINTABLE[0]) & (after <= _PRINTABLE[1]))
        if hits.size:
            return position + int(hits[0])
        position = stop
    return n


def prepare_shards(source: str | Path, tokenizer: str, out: str | Path, *, cache_dir: str | Path | None = None,
                   archive: str | Path | None = None, echo: Callable[[str], None] = print,
                   progress: bool = False, encoding: str = "utf-8") -> Path:
    """Tokenize the corpus ``source`` with ``tokenizer`` into the shard folder ``out``
    (layout in the module docstring); returns ``out``. ``out`` must not exist or be empty.
    ``progress``: tqdm bars on stderr while a BPE is learned and while each split is
    tokenized (bytes of the split). ``encoding="bytes"`` reads text that is not UTF-8 byte for
    byte (``load_corpus``), for ``tokenizer="bytes"`` only."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} already exists and is not an empty folder; remove it or choose another")
    kind, argument = parse_tokenizer(tokenizer)
    if encoding == "bytes" and kind != "bytes":
        raise ValueError(f"--encoding bytes reads text that is not UTF-8 byte for byte, for --tokenizer bytes only "
                         f"(got --tokenizer {tokenizer}): a BPE reads text, and bytes that are not UTF-8 would reach "
                         f"it as U+FFFD")
    corpus = load_corpus(source, cache_dir=cache_dir, archive=archive, encoding=encoding)
    tok = _build_tokenizer(kind, argument, corpus, echo, progress)
    vocab_size = ByteTokenizer.vocab_size if tok is None else tok.vocab_size
    dtype = dtype_for(vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        splits = {}
        for split in SPLITS:
            file = f"{split}.bin"
            count, largest = _write_split(corpus.tokens(split), tok, np.dtype(dtype).newbyteorder("<"),
                                          staging / file, progress=progress and tok is not None, name=split)
            splits[split] = {"file": file, "tokens": count, "bytes": corpus.byte_count(split),
                             "documents": corpus.documents[split], "sha256": sha256_file(staging / file),
                             "max_token_id": largest}
            echo(f"{split}: {corpus.byte_count(split):,} bytes -> {count:,} tokens")
        record: dict[str, Any] = {"kind": kind, "vocab_size": vocab_size}
        if tok is not None:
            tok.save(staging / TOKENIZER)
            record.update(file=TOKENIZER, sha256=sha256_file(staging / TOKENIZER))
            if kind == "bpe":
                record.update(requested_vocab_size=argument, trained_on="train")
            else:
                record.update(source=str(argument))
        meta = {"format": FORMAT, "version": VERSION, "source": str(source), "corpus": corpus.name,
                "encoding": encoding, "tokenizer": record, "vocab_size": vocab_size, "dtype": dtype,
                "byte_order": "little", "splits": splits, "split_rule": corpus.split_rule,
                "sources": _source_hashes(corpus)}
        (staging / META).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def _build_tokenizer(kind: str, argument, corpus: Corpus, echo, progress: bool = False) -> HFTokenizer | None:
    if kind == "bytes":
        return None
    if kind == "file":
        return HFTokenizer.from_file(argument)
    train = corpus.tokens("train")
    tok = train_bpe(text_pieces(train), argument, progress=progress, total_bytes=train.numel())
    if tok.vocab_size < argument:
        echo(f"the train split has too few distinct pairs for {argument} tokens: the BPE has {tok.vocab_size}")
    return tok


def _write_split(data: torch.Tensor, tok: HFTokenizer | None, dtype: np.dtype, path: Path, *,
                 progress: bool = False, name: str = "") -> tuple[int, int | None]:
    """Write the ids of the uint8 split ``data`` to ``path`` as ``dtype``; return their count
    and the largest of them (None for no ids). ``progress``: a bar of the split's bytes
    tokenized, labelled ``name``."""
    with open(path, "wb") as handle:
        if tok is None:
            data.numpy().astype(dtype).tofile(handle)
            count, largest = data.numel(), (int(data.max()) if data.numel() else None)
        else:
            count, largest = 0, None
            batch: list[str] = []
            batch_bytes = 0
            with tqdm(total=data.numel(), disable=not progress, desc=f"tokenizing {name}", unit="B",
                      unit_scale=True, dynamic_ncols=True) as bar:
                for piece, size in _sized_pieces(data):
                    batch.append(piece)
                    batch_bytes += size
                    if len(batch) == _PIECES_PER_BATCH:
                        count, largest = _add_written(_write_ids(tok, batch, dtype, handle), count, largest)
                        bar.update(batch_bytes)
                        batch, batch_bytes = [], 0
                count, largest = _add_written(_write_ids(tok, batch, dtype, handle), count, largest)
                bar.update(batch_bytes)
        handle.flush()
        os.fsync(handle.fileno())
    return count, largest


def _write_ids(tok: HFTokenizer, pieces: list[str], dtype: np.dtype, handle) -> np.ndarray:
    """Encode ``pieces`` and write their ids to ``handle`` as ``dtype``; return the ids."""
    if not pieces:
        return np.empty(0, dtype=np.int64)
    ids = np.concatenate([np.asarray(row, dtype=np.int64) for row in tok.encode_batch(pieces)])
    ids.astype(dtype).tofile(handle)
    return ids


def _add_written(ids: np.ndarray, count: int, largest: int | None) -> tuple[int, int | None]:
    """The count and the largest id written so far, once ``ids`` are written too."""
    if not ids.size:
        return count, largest
    top = int(ids.max())
    return count + ids.size, top if largest is None else max(largest, top)


def _source_hashes(corpus: Corpus) -> dict[str, dict[str, Any]]:
    return {name: {"bytes": path.stat().st_size, "sha256": sha256_file(path)} for name, path in corpus.sources.items()}


def is_shard_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder with a ``meta.json`` of this format."""
    meta = Path(path).expanduser() / META
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text(encoding="utf-8")).get("format") == FORMAT
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False


class Shards:
    """A prepared shard folder, read through memory maps (see the module docstring).

    Attributes: ``folder``, ``meta`` (the ``meta.json`` dict), ``name``, ``vocab_size``,
    ``documents`` (per split). Opening checks the format, that every file has the size
    ``meta.json`` gives and that its recorded largest ids lie in its vocabulary; it reads no
    token (``content_sha256`` does).
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser()
        path = self.folder / META
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"data: cannot read {path} ({error}); prepare the folder with linattn data prepare") \
                from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"data: {path} is not a linattn shard folder (format {FORMAT!r} version {VERSION})")
        try:
            self.meta = meta
            self.name = meta["corpus"]
            self.vocab_size = int(meta["vocab_size"])
            self.documents = {split: meta["splits"][split]["documents"] for split in SPLITS}
            self._files = {split: self.folder / meta["splits"][split]["file"] for split in SPLITS}
            self._dtype = np.dtype(meta["dtype"]).newbyteorder("<")
            limit = _DTYPES[meta["dtype"]]
            sizes = {split: int(meta["splits"][split]["tokens"]) * self._dtype.itemsize for split in SPLITS}
            record = meta["tokenizer"]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"data: {path} lacks or garbles the field {error}; prepare the folder again") from None
        if limit < self.vocab_size:
            raise ValueError(f"data: {path} stores {self.vocab_size} token ids as {meta['dtype']}")
        for split in SPLITS:
            self._check_recorded(split)
        for split, file in self._files.items():
            size = file.stat().st_size if file.is_file() else None
            if size != sizes[split]:
                raise ValueError(f"data: {file} has {size} bytes; {path} expects {sizes[split]} "
                                 f"({meta['splits'][split]['tokens']} {meta['dtype']} tokens); prepare it again")
        if record.get("file") is not None:
            file = self.folder / record["file"]
            if not file.is_file() or sha256_file(file) != record["sha256"]:
                raise ValueError(f"data: {file} is missing or not the tokenizer {path} was written with "
                                 f"(SHA-256 differs); prepare the folder again")
        self._tokens: dict[str, torch.Tensor] = {}
        self._tokenizer: ByteTokenizer | HFTokenizer | None = None
        self._checked: set[str] = set()  # splits whose file content_sha256 has read

    def _check_recorded(self, split: str) -> None:
        """The split's ``sha256`` and ``max_token_id`` in meta.json, where recorded, are a hex
        digest and an id of the vocabulary."""
        record, path, name = self.meta["splits"][split], self.folder / META, self._files[split].name
        digest, largest = record.get("sha256"), record.get("max_token_id")
        if digest is not None and not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            raise ValueError(f"data: {path} garbles the SHA-256 of {name} ({digest!r}); prepare the folder again")
        if largest is not None and not (is_int(largest) and 0 <= largest < self.vocab_size):
            raise ValueError(f"data: {path} records token id {largest!r} in {name}, outside its vocabulary of "
                             f"{self.vocab_size} tokens; prepare the folder again")

    def split_file(self, split: str) -> Path:
        """The ``.bin`` file of ``split``."""
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {list(SPLITS)}, got {split!r}")
        return self._files[split]

    def content_sha256(self, split: str) -> str:
        """The SHA-256 of ``split``'s file, read in pieces (docs/guide/scale.md says what it
        costs); a ValueError naming the file when ``meta.json`` records another (the file was
        changed after ``linattn data prepare``)."""
        file = self.split_file(split)
        digest, recorded = sha256_file(file), self.meta["splits"][split].get("sha256")
        if recorded is not None and digest != recorded:
            raise ValueError(f"data: {file} does not hold the tokens {self.folder / META} records: SHA-256 "
                             f"{digest[:12]}, recorded {recorded[:12]} (changed after linattn data prepare); prepare "
                             f"the folder again")
        self._checked.add(split)
        return digest

    def largest_token_id(self, split: str) -> int | None:
        """The largest id of ``split`` (None when it is empty): the one ``meta.json`` records
        once ``content_sha256(split)`` has checked the file, else read from the file."""
        tokens = self.tokens(split)
        recorded = self.meta["splits"][split].get("max_token_id")
        if split in self._checked and recorded is not None:
            return int(recorded)
        return token_id_range(tokens)[1] if tokens.numel() else None

    def tokens(self, split: str) -> torch.Tensor:
        """The ids of ``split``: a 1-D integer tensor over a read-only memory map of its file
        (write nothing into it)."""
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {list(SPLITS)}, got {split!r}")
        if split not in self._tokens:
            array = np.memmap(self.split_file(split), dtype=self._dtype, mode="r")
            with warnings.catch_warnings():  # torch warns that the mapping is read-only; nothing writes to it
                warnings.simplefilter("ignore", UserWarning)
                self._tokens[split] = torch.from_numpy(array)
        return self._tokens[split]

    def byte_count(self, split: str) -> int:
        """The bytes of text of ``split`` (from ``meta.json``)."""
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {list(SPLITS)}, got {split!r}")
        return int(self.meta["splits"][split]["bytes"])

    @property
    def tokenizer(self) -> ByteTokenizer | HFTokenizer:
        if self._tokenizer is None:
            file = self.meta["tokenizer"].get("file")
            self._tokenizer = ByteTokenizer() if file is None else HFTokenizer.from_file(self.folder / file)
        return self._tokenizer

    def tokenizer_file(self) -> Path | None:
        """The folder's ``tokenizer.json``, None for byte tokens."""
        file = self.meta["tokenizer"].get("file")
        return None if file is None else self.folder / file

    def tokenizer_record(self) -> dict[str, Any]:
        """What a run records about its tokenizer: ``{"kind": "bytes"}``, or the kind,
        vocabulary size and SHA-256 of ``tokenizer.json``."""
        record = self.meta["tokenizer"]
        if record.get("file") is None:
            return {"kind": "bytes"}
        return {"kind": record["kind"], "vocab_size": self.vocab_size, "sha256": record["sha256"]}

    def __repr__(self) -> str:
        counts = ", ".join(f"{s}={self.meta['splits'][s]['tokens']}" for s in SPLITS)
        return f"Shards({str(self.folder)!r}, vocab_size={self.vocab_size}, {self.meta['dtype']}, {counts})"
