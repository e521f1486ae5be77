"""``linattn repro ...``: one subcommand per paper reproduction.

Every reproduction is a ``framework.Experiment`` (its spec, its own flags, ``run(args)``);
listing it in ``REPRODUCTIONS`` makes it a subcommand, with the shared flags of
``framework.add_shared_arguments``.
"""

from __future__ import annotations

import argparse

from .._command_group import add_command_group
from . import conversion, demo, fwp_retrieval, length_extrapolation, lm_quality, long_range, mqar
from .framework import Experiment

REPRODUCTIONS: dict[str, Experiment] = {
    command.spec.name: command
    for command in (fwp_retrieval.capacity_command, fwp_retrieval.update_rule_command, mqar.command, lm_quality.command,
                    conversion.command, length_extrapolation.command, demo.command, long_range.command)
}


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``repro`` and its subcommands to the top-level subcommands."""
    add_command_group(commands, "repro", "reproductions of the seed papers' experiments", dest="experiment",
                      metavar="EXPERIMENT", registry=REPRODUCTIONS)
