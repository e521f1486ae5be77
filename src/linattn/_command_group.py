"""``linattn <group> <sub>``: a command group built from a registry of subcommand modules."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


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


class ReportCommand:
    """``linattn <group> report DIR``: print ``report_page(DIR)``, the Markdown page of a
    results directory made from its ``results.json`` alone (nothing is measured or trained)."""

    def __init__(self, group: str, report_page: Callable[[Path], str]):
        self.HELP = f"print the report (Markdown) of a `linattn {group}` results directory, from its results.json"
        self.DESCRIPTION = (f"Reads DIR/results.json, written by `linattn {group} NAME --out DIR`, and prints the "
                            "Markdown page that command wrote as results.md, made from that file alone (nothing "
                            "runs): after a change to a report's format, or to quote its tables in the documentation.")
        self._report_page = report_page

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The one argument: DIR."""
        parser.add_argument("dir", type=Path, metavar="DIR", help="the --out directory of the run")

    def run_command(self, args: argparse.Namespace) -> int:
        """Print the page; exit code 0."""
        print(self._report_page(args.dir), end="")
        return 0
