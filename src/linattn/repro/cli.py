"""``linattn repro ...``: one subcommand per paper reproduction.

A reproduction provides ``HELP`` (one line), ``DESCRIPTION`` (a paragraph for ``--help``),
``add_arguments(parser)`` and ``run_command(args) -> int`` (a module or an object);
listing it in ``REPRODUCTIONS`` makes it a subcommand.
"""

from __future__ import annotations

import argparse

from .._arguments import add_command_group
from . import fwp_retrieval, lm_quality, mqar

REPRODUCTIONS = {
    "fwp-capacity": fwp_retrieval.capacity_command,
    "fwp-update-rule": fwp_retrieval.update_rule_command,
    "mqar": mqar,
    "lm": lm_quality,
}


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``repro`` and its subcommands to the top-level subcommands."""
    add_command_group(commands, "repro", "reproductions of the seed papers' experiments", dest="experiment",
                      metavar="EXPERIMENT", registry=REPRODUCTIONS)
