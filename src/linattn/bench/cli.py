"""``linattn bench ...``: one subcommand per benchmark module.

A benchmark module provides ``HELP`` (one line), ``DESCRIPTION`` (a paragraph for
``--help``), ``add_arguments(parser)`` and ``run_command(args) -> int``; listing it in
``BENCHMARKS`` makes it a subcommand.
"""

from __future__ import annotations

import argparse

from . import attention, decode

BENCHMARKS = {"attention": attention, "decode": decode}


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its benchmarks to the top-level subcommands."""
    help_text = "speed and memory benchmarks"
    bench = commands.add_parser("bench", help=help_text, description=f"{help_text}, one subcommand each")
    benchmarks = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module in BENCHMARKS.items():
        parser = benchmarks.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(parser)
        parser.set_defaults(handler=module.run_command)
