"""A byte-level Hugging Face tokenizer whose ids are the UTF-8 bytes (linattn's byte vocabulary)."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def _byte_symbols() -> list[str]:
    """One printable character per byte value (the byte-level BPE convention): printable
    Latin-1 bytes stand for themselves, the other 68 get characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[byte] for byte in range(256)]


class LinattnByteTokenizer(PreTrainedTokenizerFast):
    """Text <-> UTF-8 bytes (id = byte value, 256 ids), linattn's byte vocabulary.

    Padding uses id 0 (the NUL byte) without declaring any added token: an added token's
    string would be matched inside ordinary text (the NUL byte's symbol is the letter
    U+0100). Registered with ``AutoTokenizer`` by ``import linattn.hf``; ``padding_side``
    is left (what ``generate`` needs; linattn models accept left padding only).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.pop("pad_token", None)
        kwargs.setdefault("padding_side", "left")
        if "tokenizer_object" not in kwargs and "tokenizer_file" not in kwargs:
            kwargs["tokenizer_object"] = _byte_core()
        super().__init__(*args, **kwargs)
        self.pad_token_id = 0


def _byte_core() -> Tokenizer:
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return core


def byte_tokenizer() -> LinattnByteTokenizer:
    """The byte tokenizer; ``save_pretrained`` writes it as ``tokenizer.json``."""
    return LinattnByteTokenizer()
