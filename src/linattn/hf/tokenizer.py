"""A byte-level Hugging Face tokenizer whose ids are the UTF-8 bytes (linattn's byte vocabulary).

The ``tokenizer.json`` it saves is complete on its own: ``AutoTokenizer`` gives the same ids,
padding and decoding with or without ``import linattn.hf`` (which only picks the class
``LinattnByteTokenizer`` over the generic ``TokenizersBackend``).

How a text becomes ids: the only added token is the NUL character ``"\\x00"`` (id 0, the pad
token, special), matched in the raw text; everything else goes through the ``ByteLevel``
pre-tokenizer, which turns each UTF-8 byte into one printable symbol (the byte-level BPE
convention), and the vocabulary maps symbol -> byte value. The vocabulary's entry for byte 0
is the NUL character itself rather than its ``ByteLevel`` symbol U+0100 ("Ā"): a NUL in the
text is the pad token and a NUL byte alike (id 0 either way), and "Ā" in a text is just the
two bytes C4 80 -- no special token's string stands for anything but its own byte. With
``split_special_tokens=True`` a NUL reaches the pre-tokenizer as U+0100, which the vocabulary
lacks; the model's unknown token is the NUL entry, so it is still id 0.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

_NUL = "\x00"
_BYTE_VOCAB_SIZE = 256
_LEGACY_PAD = "\u0100"  # the pad token older exports saved (the NUL byte's ByteLevel symbol "Ā")


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


class LinattnTokenizer(PreTrainedTokenizerFast):
    """The tokenizer of a linattn model (any ``tokenizer.json``), whose ``bos_token_id`` is, when
    it declares no BOS token, the token documents start after: the newline, when ``"\\n"`` is one
    token (linattn's corpora join documents with blank lines). That id is no special token: it is
    never added to a text nor dropped by ``skip_special_tokens``, and ``bos_token`` stays None;
    it is what lm-evaluation-harness conditions an empty context on (its prefix token) and what an
    export's ``config.bos_token_id`` names. An export's ``tokenizer_config.json`` names the
    standard ``TokenizersBackend`` as its class (it loads with any transformers, no linattn
    needed) and this class for ``trust_remote_code=True`` (``auto_map``)."""

    @property
    def bos_token_id(self) -> int | None:
        declared = self.__dict__.get("_special_tokens_map", {}).get("bos_token")
        if declared is not None:
            return self.convert_tokens_to_ids(str(declared))
        if "_document_start" not in self.__dict__:
            self.__dict__["_document_start"] = newline_token_id(self)
        return self.__dict__["_document_start"]


def newline_token_id(tokenizer: PreTrainedTokenizerFast) -> int | None:
    """The id of ``"\\n"`` when it is one token of ``tokenizer``, else None."""
    ids = tokenizer.backend_tokenizer.encode("\n", add_special_tokens=False).ids
    return ids[0] if len(ids) == 1 else None


class LinattnByteTokenizer(LinattnTokenizer):
    """Text <-> UTF-8 bytes (id = byte value, 256 ids), linattn's byte vocabulary.

    The pad token is the NUL byte (id 0), the only special token: its string is the NUL
    character, which in a text is that byte anyway, so no text encodes differently because
    of it, and ``decode(..., skip_special_tokens=True)`` drops padding (and NUL bytes).
    ``padding_side`` is left (what ``generate`` needs; linattn models accept left padding
    only). The tokenizer has no BOS/EOS token; its ``bos_token_id`` is the newline byte, the
    token documents start after (``LinattnTokenizer``), as ``config.bos_token_id`` of an export.

    The pipeline is fixed, so loading always builds it afresh (a ``tokenizer.json`` written
    by an older linattn, whose pad token was the string "Ā", loads as this one); added
    tokens of ids >= 256 saved with it are kept. Registered with ``AutoTokenizer`` by
    ``import linattn.hf``; without the import ``AutoTokenizer`` builds a ``TokenizersBackend``
    from the saved ``tokenizer.json`` that gives the same ids.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.pop("tokenizer_file", None)
        kwargs.pop("tokenizer_object", None)
        pad = kwargs.pop("pad_token", None)
        if pad is not None and str(pad) not in (_NUL, _LEGACY_PAD):
            raise ValueError(f"pad_token: the byte tokenizer pads with the NUL byte (id 0, pad_token='\\x00'), "
                             f"got {str(pad)!r}")
        saved = kwargs.pop("added_tokens_decoder", None) or {}
        kwargs["added_tokens_decoder"] = {int(i): token for i, token in saved.items() if int(i) >= _BYTE_VOCAB_SIZE}
        kwargs.setdefault("padding_side", "left")
        super().__init__(*args, tokenizer_object=_byte_core(), pad_token=_pad_token(), **kwargs)


def _pad_token() -> AddedToken:
    return AddedToken(_NUL, special=True, normalized=False)


def _byte_core() -> Tokenizer:
    """The ``tokenizers`` pipeline described in the module docstring."""
    symbols = _byte_symbols()
    symbols[0] = _NUL
    vocab = {symbol: byte for byte, symbol in enumerate(symbols)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=_NUL))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([_pad_token()])
    return core


def byte_tokenizer() -> LinattnByteTokenizer:
    """The byte tokenizer; ``save_pretrained`` writes it as ``tokenizer.json``."""
    return LinattnByteTokenizer()
