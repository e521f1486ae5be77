"""What the trainer reads: token data from a corpus (byte tokens) or a shard folder.

``open_data(spec)`` returns a ``Shards`` for a folder written by ``linattn data prepare``
and a ``Corpus`` (``load_corpus``) for anything else. Both have the interface
``TokenData``; the trainer, ``linattn eval`` and ``linattn generate`` know nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch

from .corpus import Corpus, load_corpus
from .hf_tokenizer import HFTokenizer
from .shards import Shards, is_shard_folder
from .streams import TokenStreams
from .tokenizer import ByteTokenizer


class TokenData(Protocol):
    """Token ids per split with the tokenizer that made them."""

    name: str
    vocab_size: int
    documents: dict[str, list[str]]

    def tokens(self, split: str) -> torch.Tensor:
        """The ids of ``split`` (``train``, ``validation``, ``test``), a 1-D integer tensor."""

    def byte_count(self, split: str) -> int:
        """The bytes of text of ``split``."""

    def largest_token_id(self, split: str) -> int | None:
        """The largest id of ``split``, None when it is empty."""

    @property
    def tokenizer(self) -> ByteTokenizer | HFTokenizer:
        """encode / decode / stream_decoder / token_bytes of these ids."""

    def tokenizer_record(self) -> dict[str, Any]:
        """``{"kind": "bytes"}`` or the tokenizer's kind, vocab_size and sha256 (what a run records)."""


def open_data(spec: str | Path, *, cache_dir: str | Path | None = None,
              archive: str | Path | None = None) -> Corpus | Shards:
    """``Shards(spec)`` if ``spec`` is a prepared shard folder, else ``load_corpus(spec)``."""
    return open_shards(spec) or load_corpus(spec, cache_dir=cache_dir, archive=archive)


def open_shards(spec: str | Path) -> Shards | None:
    """``Shards(spec)`` if ``spec`` is a prepared shard folder, else None."""
    if isinstance(spec, str) and spec == "shakespeare":
        return None
    return Shards(spec) if is_shard_folder(spec) else None


def data_vocab_size(spec: str | Path) -> int | None:
    """The vocabulary of a shard folder (read from its ``meta.json``), None for a corpus of
    bytes (whose tokens need no vocabulary beyond the model's)."""
    shards = open_shards(spec)
    return None if shards is None else shards.vocab_size


def check_vocabulary(data: Corpus | Shards, splits: Iterable[str], vocab_size: int, *, spec: str | Path) -> None:
    """Every id of the ``splits`` of ``data`` (opened from ``spec``) lies in the model's
    vocabulary of ``vocab_size`` tokens; else a ValueError naming the file (for a byte corpus,
    the split of ``spec``), its largest id and the vocabulary, before a model reads an id.

    Nothing is read when the ids' dtype cannot exceed the vocabulary (bytes and 256 tokens),
    nor for shards whose file ``Shards.content_sha256`` checked (the id ``meta.json`` records);
    else the split is read once, in pieces.
    """
    for split in splits:
        tokens = data.tokens(split)
        if torch.iinfo(tokens.dtype).max < vocab_size:
            continue
        largest = data.largest_token_id(split)
        if largest is None or largest < vocab_size:
            continue
        if isinstance(data, Shards):
            where = data.split_file(split)
            fix = (f"its folder's tokenizer has {data.vocab_size} tokens and did not write it: prepare the folder again"
                   if largest >= data.vocab_size else f"use the folder's vocabulary of {data.vocab_size} tokens")
        else:
            where, fix = f"the {split} split of {spec}", "byte data needs vocab_size 256"
        raise ValueError(f"data: {where} holds token id {largest}, but the model's vocabulary has {vocab_size} "
                         f"tokens (ids 0 to {vocab_size - 1}); {fix}")


def bits_per_byte(result: dict[str, float], n_bytes: int) -> float:
    """Bits per byte from an evaluation in bits per token: ``bpb * tokens / bytes``
    (the total nats over the bytes those tokens stand for, over ln 2)."""
    if n_bytes <= 0:
        raise ValueError(f"n_bytes: expected a positive byte count, got {n_bytes}")
    return result["bpb"] * result["tokens"] / n_bytes


def evaluated_bytes(data: Corpus | Shards, tokens: torch.Tensor, *, context: int, n_streams: int) -> int | None:
    """The text bytes of the targets ``evaluate_bpb`` scores when it reads ``tokens`` in
    ``n_streams`` streams (all processes together) of windows of ``context``; None when
    the tokens are bytes (bits per token are then bits per byte)."""
    if data.tokenizer_record().get("sha256") is None:
        return None
    streams = TokenStreams(tokens, batch_size=n_streams, context=context, drop_last=False)
    return streams.target_bytes(data.tokenizer.token_bytes())
