"""``linattn repro ...``: one subcommand per paper reproduction, and ``report``.

Every reproduction is a ``framework.Experiment`` (its spec, its own flags, ``run(args)``,
``page(results)``); listing it in ``REPRODUCTIONS`` makes it a subcommand, with the shared
flags of ``framework.add_shared_arguments``. ``linattn repro report DIR`` prints the page of
the experiment that wrote ``DIR/results.json`` (:func:`report_page`), training nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .._command_group import ReportCommand, add_command_group
from ..reporting import results_page
from . import conversion, demo, fwp_retrieval, length_extrapolation, linearize, lm_quality, long_range, mqar
from .framework import Experiment

REPRODUCTIONS: dict[str, Experiment] = {
    command.spec.name: command
    for command in (fwp_retrieval.capacity_command, fwp_retrieval.update_rule_command, mqar.command, lm_quality.command,
                    conversion.command, length_extrapolation.command, demo.command, long_range.command,
                    linearize.command)
}


def report_page(out_dir: str | Path) -> str:
    """The Markdown page of the experiment whose ``results.json`` is in ``out_dir`` (named by its
    ``metadata.command``, ``linattn repro EXPERIMENT ...``), made from that file alone."""
    return results_page(out_dir, "repro", {name: command.page for name, command in REPRODUCTIONS.items()})


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``repro`` and its subcommands to the top-level subcommands."""
    add_command_group(commands, "repro", "reproductions of the seed papers' experiments", dest="experiment",
                      metavar="EXPERIMENT", registry={**REPRODUCTIONS, "report": ReportCommand("repro", report_page)})
