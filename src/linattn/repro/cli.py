"""``linattn repro ...``: one subcommand per paper reproduction.

A reproduction provides ``HELP`` (one line), ``DESCRIPTION`` (a paragraph for ``--help``),
``add_arguments(parser)`` and ``run_command(args) -> int`` (a module or an object);
listing it in ``REPRODUCTIONS`` makes it a subcommand. Every subcommand also takes
``--system-malloc``; without it the process keeps freed memory for reuse
(``linattn._malloc.retain_freed_memory``: faster steps, bit-identical results).
"""

from __future__ import annotations

import argparse

from .._command_group import add_command_group
from .._malloc import retain_freed_memory
from . import fwp_retrieval, lm_quality, mqar


class _KeepsFreedMemory:
    """A reproduction whose process keeps freed memory unless ``--system-malloc`` is given."""

    def __init__(self, command):
        self.command, self.HELP, self.DESCRIPTION = command, command.HELP, command.DESCRIPTION

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        self.command.add_arguments(parser)
        parser.add_argument("--system-malloc", action="store_true",
                            help="leave glibc malloc's settings as they are (by default the process and its workers "
                                 "keep freed memory for reuse: MALLOC_MMAP_MAX_=0, no page faults on each step's large "
                                 "tensors; measured up to 1.8x faster steps, bit-identical results, memory stays at its peak)")

    def run_command(self, args: argparse.Namespace) -> int:
        if not args.system_malloc:
            retain_freed_memory()
        return self.command.run_command(args)


REPRODUCTIONS = {
    name: _KeepsFreedMemory(command)
    for name, command in {
        "fwp-capacity": fwp_retrieval.capacity_command,
        "fwp-update-rule": fwp_retrieval.update_rule_command,
        "mqar": mqar,
        "lm": lm_quality,
    }.items()
}


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``repro`` and its subcommands to the top-level subcommands."""
    add_command_group(commands, "repro", "reproductions of the seed papers' experiments", dest="experiment",
                      metavar="EXPERIMENT", registry=REPRODUCTIONS)
