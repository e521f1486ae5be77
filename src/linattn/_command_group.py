"""``linattn <group> <sub>``: a command group built from a registry of subcommand modules."""

from __future__ import annotations

import argparse


def add_command_group(commands: argparse._SubParsersAction, name: str, help_text: str, *, dest: str,
                      metavar: str, registry: dict) -> None:
    """Add ``linattn <name> <sub>`` with one subcommand per ``registry`` entry, each an object
    with ``HELP``, ``DESCRIPTION``, ``add_arguments(parser)`` and ``run_command(args) -> int``."""
    group = commands.add_parser(name, help=help_text, description=f"{help_text}, one subcommand each")
    subcommands = group.add_subparsers(dest=dest, metavar=metavar, required=True)
    for sub_name, command in registry.items():
        parser = subcommands.add_parser(sub_name, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(parser)
        parser.set_defaults(handler=command.run_command)
