"""``linattn repro ...``: one subcommand per paper reproduction.

A reproduction provides ``HELP`` (one line), ``DESCRIPTION`` (a paragraph for ``--help``),
``add_arguments(parser)`` and ``run_command(args) -> int`` (a module or an object);
listing it in ``REPRODUCTIONS`` makes it a subcommand.
"""

from __future__ import annotations

import argparse

from . import fwp_retrieval, lm_quality, mqar

REPRODUCTIONS = {
    "fwp-capacity": fwp_retrieval.capacity_command,
    "fwp-update-rule": fwp_retrieval.update_rule_command,
    "mqar": mqar,
    "lm": lm_quality,
}


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``repro`` and its reproductions to the top-level subcommands."""
    help_text = "reproductions of the seed papers' experiments"
    repro = commands.add_parser("repro", help=help_text, description=f"{help_text}, one subcommand each")
    experiments = repro.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    for name, command in REPRODUCTIONS.items():
        parser = experiments.add_parser(name, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(parser)
        parser.set_defaults(handler=command.run_command)
