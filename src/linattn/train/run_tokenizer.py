"""The tokenizer of a run, kept in the run folder so the run is self-contained.

A fresh run copies its data's ``tokenizer.json`` (and the shard folder's ``meta.json``, as
``data.json``) into the run folder; every checkpoint's ``meta.json`` records the
tokenizer (``{"kind": "bytes"}`` or its kind, vocabulary size and SHA-256). ``eval``,
``generate`` and ``export`` read ``<run>/tokenizer.json`` next to ``checkpoints/`` and
check its SHA-256 against the checkpoint's; checkpoints without a record (older runs)
are byte runs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from .._files import write_text_atomic
from ..data import ByteTokenizer, HFTokenizer, Shards
from .checkpoint import Checkpoint

TOKENIZER_FILE = "tokenizer.json"
DATA_META_FILE = "data.json"


def copy_tokenizer(data, run_dir: str | Path) -> None:
    """Put the tokenizer of ``data`` (a ``Corpus`` or ``Shards``) into ``run_dir``."""
    if not isinstance(data, Shards) or data.tokenizer_file() is None:
        return
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    temporary = run_dir / f".{TOKENIZER_FILE}.tmp"
    shutil.copyfile(data.tokenizer_file(), temporary)
    temporary.replace(run_dir / TOKENIZER_FILE)
    write_text_atomic(run_dir / DATA_META_FILE, json.dumps({"folder": str(data.folder), **data.meta}, indent=1))


def check_run_tokenizer(data, vocab_size: int, checkpoint: Checkpoint | None) -> dict[str, Any]:
    """Check that ``data`` fits the model (``vocab_size``) and, when resuming, that it is
    tokenized as the checkpoint recorded. Returns the record each checkpoint stores (a fresh
    run copies the tokenizer itself, ``copy_tokenizer``, once all its inputs are checked).

    Shard data needs ``vocab_size`` equal to its tokenizer's (``linattn train`` sets it) in a
    fresh run, and at least as large when resuming (a run imported from a Hugging Face
    checkpoint keeps the checkpoint's vocabulary, which may have rows past its tokenizer's, as
    Qwen2's has); a byte corpus keeps accepting any model vocabulary, as before shards existed.
    """
    fits = vocab_size >= data.vocab_size if checkpoint is not None else vocab_size == data.vocab_size
    if isinstance(data, Shards) and not fits:
        raise ValueError(f"model.vocab_size: the data {data.folder} has a tokenizer of {data.vocab_size} tokens but "
                         f"the model has vocab_size={vocab_size}; set vocab_size={data.vocab_size} or leave it out "
                         f"(linattn train then takes it from the data)")
    if checkpoint is not None:
        check_same_tokenizer(checkpoint.meta.get("tokenizer"), data, what="--resume")
    return data.tokenizer_record()


def check_same_tokenizer(record: dict[str, Any] | None, data, *, what: str) -> None:
    """Refuse ``data`` whose tokenizer is not the one a checkpoint recorded (``record``)."""
    expected = record or {"kind": "bytes"}
    seen = data.tokenizer_record()
    if expected.get("sha256") != seen.get("sha256"):
        raise ValueError(f"{what}: the data's tokenizer ({_describe(seen)}) is not the run's ({_describe(expected)}); "
                         f"use data tokenized with the run's tokenizer.json "
                         f"(linattn data prepare --tokenizer RUN_DIR/tokenizer.json ...)")


def load_run_tokenizer(checkpoint: Checkpoint) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a checkpoint was trained with (``<run>/tokenizer.json``, checked)."""
    record = checkpoint.meta.get("tokenizer") or {"kind": "bytes"}
    if record.get("sha256") is None:
        return ByteTokenizer()
    path = checkpoint.path.parent.parent / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(f"{checkpoint.path} was trained with a {record['kind']} tokenizer of {record['vocab_size']} "
                         f"tokens, but {path} is missing; copy the data's tokenizer.json there")
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if digest != record["sha256"]:
        raise ValueError(f"{path} is not the tokenizer {checkpoint.path} was trained with (SHA-256 differs)")
    return HFTokenizer.from_file(path)


def _describe(record: dict[str, Any]) -> str:
    if record.get("sha256") is None:
        return "bytes"
    return f"{record['kind']}, {record['vocab_size']} tokens, sha256 {record['sha256'][:12]}"
