"""Tokenizers stored as a Hugging Face ``tokenizer.json``: a byte-level BPE trained on a
corpus, or any tokenizer file a user brings. ``tokenizers`` is imported only here, when
one is built or loaded, so byte-level runs do not need it.

``train_bpe(texts, vocab_size)`` learns a byte-level BPE: text is cut into words by the
GPT-2 rule (``ByteLevel`` pre-tokenizer with its regex, no prefix space), the 256 byte
symbols are the initial alphabet (every text encodes, there is no unknown token and no
special token), and merges are added, most frequent pair first, until ``vocab_size``
tokens (fewer when the text runs out of pairs). The trainer is deterministic: pair counts
are integer sums, the alphabet is sorted, and ties between pairs of equal count go to the
smaller token ids, so neither the process nor the thread count (``RAYON_NUM_THREADS``)
changes ``tokenizer.json`` (tests/test_shards.py trains with 1 and 2 threads).

``HFTokenizer`` gives such a file the interface of ``ByteTokenizer``: ``encode(text) ->
[T] int64``, ``decode(ids)``, ``stream_decoder()`` and ``vocab_size``; ``token_bytes()``
is the number of text bytes each token stands for (what bits per *byte* divide by).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from .tokenizer import _as_int_list, _check_integer

MIN_BPE_VOCAB = 256
_INSTALL_HINT = "pip install tokenizers==0.23.3 (or pip install 'linattn[hf]')"


def _tokenizers():
    try:
        import tokenizers
    except ImportError as error:
        raise ValueError(f"tokenizer files need the Hugging Face tokenizers library: {_INSTALL_HINT}") from error
    return tokenizers


def train_bpe(texts: Iterable[str], vocab_size: int, *, progress: bool = False,
              total_bytes: int | None = None) -> "HFTokenizer":
    """A byte-level BPE of ``vocab_size`` tokens (at most) learned from ``texts``.

    ``progress``: a tqdm bar on stderr while it learns: the UTF-8 bytes of the texts read so
    far (of ``total_bytes``, when given), then, once every text is read, the merges, which the
    ``tokenizers`` library computes without reporting how far it is: the bar names that phase
    and its clock keeps running until the BPE is complete.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"vocab_size: expected an int >= {MIN_BPE_VOCAB} (the 256 bytes plus merges), "
                         f"got {vocab_size!r}")
    tk = _tokenizers()
    core = tk.Tokenizer(tk.models.BPE())
    core.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    with tqdm(total=total_bytes, disable=not progress, desc="learning BPE: reading", unit="B", unit_scale=True,
              dynamic_ncols=True) as bar:

        def read() -> Iterator[str]:
            for text in texts:
                yield text
                bar.update(len(text.encode("utf-8", errors="replace")))
            bar.total = bar.n  # every text read (U+FFFD may stand for one invalid byte in total_bytes)
            bar.set_description(f"learning BPE: merging to {vocab_size} tokens", refresh=True)

        with _clock_running(bar):
            core.train_from_iterator(read(), trainer)
    return HFTokenizer(core)


@contextmanager
def _clock_running(bar: tqdm, interval: float = 1.0) -> Iterator[None]:
    """Within: ``bar`` is redrawn every ``interval`` seconds (its elapsed time moves while a
    long call reports nothing; ``tokenizers`` releases the GIL while it learns)."""
    if bar.disable:
        yield
        return
    done = threading.Event()

    def redraw() -> None:
        while not done.wait(interval):
            bar.refresh()

    ticker = threading.Thread(target=redraw, name="bpe-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


class HFStreamDecoder:
    """Incremental decoding of token ids: ``feed(id)`` returns the text that id completes
    ("" while a character is still open), ``flush()`` the rest.

    Each call decodes only the ids since the last complete character (plus that
    character's ids, as context for decoders that treat the first token specially), and
    emits what that adds; text that ends in U+FFFD waits for the next id.
    """

    def __init__(self, tokenizer: "HFTokenizer") -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the ids decoded as context
        self._read = 0  # end of the ids already emitted

    def feed(self, token_id: int) -> str:
        """Add one token id; return the text it completes."""
        self._ids.append(self._tokenizer._check_id(_check_integer(token_id)))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return the text of any unfinished character and reset."""
        text = self._emit(final=True)
        self._ids, self._prefix, self._read = [], 0, 0
        return text

    def _emit(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        done = decode(self._ids[self._prefix:self._read])
        text = decode(self._ids[self._prefix:])
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the ``ByteTokenizer`` interface.

    ``vocab_size`` counts every id (added tokens included); ``to_json()`` is the exact
    text of its ``tokenizer.json``.
    """

    def __init__(self, core) -> None:
        self.core = core
        self.vocab_size = int(core.get_vocab_size(with_added_tokens=True))
        self._token_bytes: torch.Tensor | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> "HFTokenizer":
        """Load a ``tokenizer.json``; an unreadable file is a ``ValueError`` naming it."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer: {path} does not exist; expected a Hugging Face tokenizer.json")
        try:
            core = _tokenizers().Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust side raises a bare Exception
            raise ValueError(f"tokenizer: cannot read {path} as a Hugging Face tokenizer.json ({error})") from None
        return cls(core)

    def to_json(self) -> str:
        return self.core.to_str(pretty=True)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    def encode(self, text: str) -> torch.Tensor:
        """The ids of ``text`` as a 1-D int64 tensor ``[T]``."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        return torch.tensor(self.core.encode(text, add_special_tokens=False).ids, dtype=torch.int64)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text (encoded in parallel; the same ids as one ``encode`` each)."""
        return [e.ids for e in self.core.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: torch.Tensor | Iterable[int] | int) -> str:
        """Text of ids (a tensor of any shape, flattened; a list; or one int).

        Byte sequences that are not valid UTF-8 become U+FFFD; an id outside
        ``[0, vocab_size)`` is a ``ValueError``.
        """
        values = [self._check_id(i) for i in _as_int_list(ids)]
        return self.core.decode(values, skip_special_tokens=False)

    def stream_decoder(self) -> HFStreamDecoder:
        """A fresh incremental decoder for streaming generation."""
        return HFStreamDecoder(self)

    def token_bytes(self) -> torch.Tensor:
        """``[vocab_size]`` int64: the UTF-8 bytes each token stands for.

        Exact for byte-level tokenizers (a token is a string of byte symbols, one per
        byte); for others, the bytes of the token decoded alone.
        """
        if self._token_bytes is None:
            byte_level = (json.loads(self.core.to_str()).get("decoder") or {}).get("type") == "ByteLevel"
            lengths = []
            for i in range(self.vocab_size):
                token = self.core.id_to_token(i)
                if byte_level and token is not None:
                    lengths.append(len(token))
                else:
                    lengths.append(len(self.core.decode([i], skip_special_tokens=False).encode("utf-8")))
            self._token_bytes = torch.tensor(lengths, dtype=torch.int64)
        return self._token_bytes

    def _check_id(self, token_id: int) -> int:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id: expected an id in [0, {self.vocab_size}), got {token_id}")
        return token_id

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size})"
