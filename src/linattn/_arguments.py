"""Argument types shared by the ``linattn`` subcommands (argparse turns their errors into exit code 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(minimum: int, what: str = "a count") -> Callable[[str], int]:
    """An argparse type accepting integers ``>= minimum``; ``what`` names the quantity in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what} (an integer >= {minimum}), got {text!r}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse type accepting finite numbers > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


positive_int = int_at_least(1, "a positive count")
non_negative_int = int_at_least(0, "a count")


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
