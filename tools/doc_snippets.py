"""Executed documentation: the fenced code blocks of README.md and docs/**/*.md, checked and run.

    python tools/doc_snippets.py README.md docs/guide/training.md   # check and run these pages
    python tools/doc_snippets.py --check-only                       # every page, checks only

Every fenced block names its language. ``python``/``py`` blocks and ``bash``/``sh``/``shell``/
``console`` blocks are code (``console``: the lines after a ``$ `` prompt, the rest is output);
``text``, ``toml``, ``json``, ``yaml`` and the other names in ``DATA_LANGUAGES`` are data, never
run (``toml`` and ``json`` must parse). A fence without a language, or with another language,
is an error naming ``file:line``.

Each code block is checked: Python with ``compile()``, shell with ``bash -n``, every ``linattn
...`` command in it with the real argument parser (``linattn.cli.build_parser()``; a flag that
does not exist fails) and every ``make TARGET`` against the Makefile's targets. Then it runs,
unless marked skipped: the page's blocks in order, in one process forked for the page; Python
blocks share one namespace, shell blocks run with ``bash -e -o pipefail`` one by one, and all
of them in one temporary working folder holding a copy of ``configs/``, with ``$LINATTN_CACHE``
pointing to a tiny stand-in for the Shakespeare texts (``_write_tiny_shakespeare``), one torch
thread (``OMP_NUM_THREADS=1``: small work on a busy machine) and Hugging Face offline.
``linattn`` on the shell's ``PATH`` runs the tree's ``linattn.cli.main`` (see below). The
first failing block fails the page; the blocks after it are reported as not run.

Directives: HTML comments on the lines right above a fence (invisible on GitHub and in MkDocs),
no blank line between them and the fence::

    <!-- snippet: skip: REASON -->           not run: only checked (REASON is required)
    <!-- snippet: replace "OLD" "NEW" -->    every OLD in the block becomes NEW before it is
                                             checked and run (shlex quoting; OLD must occur)
    <!-- snippet: setup
    CODE
    -->                                      CODE (the block's language) runs right before the
                                             block, in its namespace or shell; not shown

Any other ``<!-- snippet...`` comment, a directive not directly above a fence, a directive on
a data block, or a ``replace`` whose OLD does not occur is an error naming ``file:line``.

A ``linattn`` command of a shell block does not start a new Python (importing torch and
linattn takes seconds per command): the shell finds a small script named ``linattn`` that
hands its arguments, working folder, environment and standard streams to a process that
imported ``linattn.cli`` once (the zygote); the zygote forks, and the fork runs
``linattn.cli.main(argv)`` and exits with its code. Pages run in forks of the same zygote, so a
snippet cannot change the caller (the test process) or another page. Environment variables
read when torch and linattn are imported are the zygote's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from doc_snippets_checks import check_block
from doc_snippets_pages import ROOT, SnippetError, display, parse_page
from doc_snippets_runner import BLOCK_TIMEOUT_S, SnippetRunner
from doc_snippets_zygote import serve


# ------------------------------------------------------------------------------------------- CLI

def default_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown file under docs/."""
    return sorted([root / "README.md", *(root / "docs").rglob("*.md")])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check and run the code blocks of markdown pages "
                                                 "(default: README.md and docs/**/*.md).")
    parser.add_argument("pages", nargs="*", type=Path, help="markdown files")
    parser.add_argument("--check-only", action="store_true", help="parse checks only, run nothing")
    parser.add_argument("--block-timeout", type=float, default=BLOCK_TIMEOUT_S, help="seconds per block")
    parser.add_argument("--outputs", action="store_true", help="show every block's output, not only a failure's")
    parser.add_argument("--zygote", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.zygote:
        serve(args.zygote)
        return 0
    sys.path.insert(0, str(ROOT / "src"))
    from linattn.cli import build_parser

    linattn_parser = build_parser()
    pages = args.pages or default_pages()
    failures = 0
    with SnippetRunner(block_timeout=args.block_timeout) as runner:
        for page in pages:
            try:
                blocks = parse_page(page)
                for block in blocks:
                    check_block(block, linattn_parser)
            except SnippetError as error:
                print(f"FAILED {error}")
                failures += 1
                continue
            if args.check_only or not any(b.kind != "data" and b.skip is None for b in blocks):
                print(f"ok {display(page)}: {len(blocks)} blocks checked")
                continue
            began = time.monotonic()
            result = runner.run_page(page)
            print(f"{'ok' if result.passed else 'FAILED'} {display(page)} ({time.monotonic() - began:.1f} s)")
            print(result.report(outputs=args.outputs))
            failures += not result.passed
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
