"""Byte-level tokenizer: a token is one byte of the UTF-8 encoding (vocabulary 256).

Every string round-trips exactly; ids that are not valid UTF-8 (e.g. sampled by a model)
decode with U+FFFD replacement characters. ``stream_decoder()`` turns a stream of byte
ids into text as soon as each character is complete, so multi-byte characters print
correctly during streaming generation.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

import torch

from .._checks import is_integer_id


class ByteStreamDecoder:
    """Incremental UTF-8 decoder over byte ids (``errors="replace"``).

    ``feed(id)`` returns the text completed by that byte ("" while a multi-byte character
    is still open); ``flush()`` returns what is left (a replacement character for an
    unfinished sequence) and resets the decoder.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one byte id in ``[0, 256)``; return the text it completes."""
        return self._decoder.decode(bytes([_check_byte(_check_integer(token_id))]), final=False)

    def flush(self) -> str:
        """Return the text of any unfinished sequence and reset."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``encode(text) -> [T] int64``, ``decode(ids) -> str``."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        """The UTF-8 bytes of ``text`` as a 1-D int64 tensor ``[len(text.encode())]``."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        data = text.encode("utf-8")
        return torch.tensor(list(data), dtype=torch.int64)

    def decode(self, ids: torch.Tensor | Iterable[int] | int) -> str:
        """Text of byte ids (a tensor of any shape, flattened; a list; or one int).

        Invalid UTF-8 becomes U+FFFD; an id outside ``[0, 256)`` is a ``ValueError``.
        """
        return bytes(_check_byte(i) for i in _as_int_list(ids)).decode("utf-8", errors="replace")

    def stream_decoder(self) -> ByteStreamDecoder:
        """A fresh incremental decoder for streaming generation."""
        return ByteStreamDecoder()


def _as_int_list(ids: torch.Tensor | Iterable[int] | int) -> list[int]:
    """Token ids as Python ints; floats and bools (tensors of them too) are a TypeError, never
    truncated to ids."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"ids: expected an integer tensor, got dtype {ids.dtype}")
        return [int(i) for i in ids.reshape(-1).tolist()]
    if not isinstance(ids, Iterable):
        return [_check_integer(ids)]
    values = list(ids)
    for value in values:
        _check_integer(value)
    return [int(i) for i in values]


def _check_integer(token_id: object) -> int:
    """``token_id`` is an integer (Python, NumPy, or a one-element integer tensor), not a bool or a float."""
    if isinstance(token_id, torch.Tensor) and token_id.numel() == 1 and not (
            token_id.is_floating_point() or token_id.is_complex() or token_id.dtype == torch.bool):
        return int(token_id)
    if not is_integer_id(token_id):
        raise TypeError(f"token id: expected an integer, got {type(token_id).__name__} {token_id!r}")
    return int(token_id)


def _check_byte(token_id: int) -> int:
    if not 0 <= token_id < 256:
        raise ValueError(f"token id: expected a byte in [0, 256), got {token_id}")
    return token_id
