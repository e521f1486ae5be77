"""``linattn bench ...``: one subcommand per benchmark module, and ``report``.

A benchmark module provides ``HELP`` (one line), ``DESCRIPTION`` (a paragraph for
``--help``), ``add_arguments(parser)``, ``run_command(args) -> int`` and ``page(results) ->
str`` (its ``results.md`` from the contents of its ``results.json``); listing it in
``BENCHMARKS`` makes it a subcommand. ``linattn bench report DIR`` prints the page of the
benchmark that wrote ``DIR/results.json`` (:func:`report_page`), measuring nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .._command_group import ReportCommand, add_command_group
from ..reporting import results_page
from . import attention, decode, lm, serve, train_speed

BENCHMARKS = {"attention": attention, "decode": decode, "lm": lm, "train": train_speed, "serve": serve}


def report_page(out_dir: str | Path) -> str:
    """The Markdown page of the benchmark whose ``results.json`` is in ``out_dir`` (named by its
    ``metadata.command``, ``linattn bench NAME ...``), made from that file alone."""
    return results_page(out_dir, "bench", {name: module.page for name, module in BENCHMARKS.items()})


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its subcommands to the top-level subcommands."""
    add_command_group(commands, "bench", "speed and memory benchmarks", dest="benchmark", metavar="BENCHMARK",
                      registry={**BENCHMARKS, "report": ReportCommand("bench", report_page)})
