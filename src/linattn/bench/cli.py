"""``linattn bench ...``: one subcommand per benchmark module.

A benchmark module provides ``HELP`` (one line), ``DESCRIPTION`` (a paragraph for
``--help``), ``add_arguments(parser)`` and ``run_command(args) -> int``; listing it in
``BENCHMARKS`` makes it a subcommand.
"""

from __future__ import annotations

import argparse

from .._command_group import add_command_group
from . import attention, decode, lm, train_speed

BENCHMARKS = {"attention": attention, "decode": decode, "lm": lm, "train": train_speed}


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its subcommands to the top-level subcommands."""
    add_command_group(commands, "bench", "speed and memory benchmarks", dest="benchmark", metavar="BENCHMARK",
                      registry=BENCHMARKS)
