"""The ``linattn`` command: ``train``, ``eval``, ``generate``, ``plot``, ``data``, ``export``,
``lm-eval``, ``serve``, ``convert``, ``inspect``, ``bench``, ``doctor`` (and ``repro``).

Each command group lives in the package it drives and provides
``register(commands)``, which adds its subparser and sets ``handler(args) -> int`` as
the parser default; listing the module in ``_COMMAND_GROUPS`` wires it in (``train``,
``eval``, ``generate``, ``data``, ``repro`` follow the same pattern).

Exit codes: 0 success, 1 a ``doctor`` self-test check that failed, 2 bad arguments
(argparse) or invalid values rejected by the library (``ValueError``/``TypeError``, printed
as ``linattn: error: ...``), 3 a training run that diverged (``TrainingDiverged``: a
non-finite loss or gradient), 130 on Ctrl-C.

Under ``torchrun`` every process runs the command, and rank 0 alone speaks of the run: the
others run with their ``sys.stdout`` and ``sys.stderr`` sent to ``os.devnull`` (no progress,
summary or warning) and return the same exit code, since every error a run can meet on one
process is shared with the others before anything trains (``train/startup.py``). Errors get
through: another process prints the ``linattn: error`` line of an error it met itself
(an argument it could not parse, a run folder or data it cannot see, settings that disagree),
prefixed with its rank (``linattn: error: rank 1: ...``), so that the node where it ran says
why; an error it only learned from another process (``startup.RelayedError``) is printed by
rank 0 and by the first process of each node (``LOCAL_RANK`` 0). An unexpected exception
still prints its traceback on every rank: it leaves the silenced block before Python reports it.

A process of a multi-process run (``WORLD_SIZE`` > 1) that started as the program
(``entry``: the ``linattn`` script, ``python -m linattn.cli``) leaves by ``os._exit`` once its
output is flushed, skipping the interpreter's shutdown: there the garbage collector could
destroy a gloo process group (still held by a DDP model in an error's traceback) while the
group's worker thread waited for the GIL to release a finished collective, and the process
never exited (2 runs of 15 of the missing-data error under ``torchrun``, on a loaded
machine). Files, checkpoints and the run folder's lock are closed before that point.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext, redirect_stderr, redirect_stdout
from typing import TextIO

from . import __version__
from .bench import cli as bench_cli
from .data import cli as data_cli
from . import convert, doctor, hf_cli, inspector
from .repro import cli as repro_cli
from .serve import cli as serve_cli
from .train import cli as train_cli
from .train.distributed import env_local_rank, env_rank, env_world_size
from .train.divergence import TrainingDiverged
from .train.startup import RelayedError

_COMMAND_GROUPS = (train_cli, data_cli, hf_cli, serve_cli, convert, inspector, bench_cli, doctor, repro_cli)


_MARKUP = re.compile(r"``(.+?)``|\*\*(.+?)\*\*", re.DOTALL)


def plain_text(text: str) -> str:
    """``text`` (help written as a docstring) with its reStructuredText markup taken out:
    ````code```` and ``**bold**`` become their words."""
    return _MARKUP.sub(lambda match: match.group(1) or match.group(2), text)


class _PlainTextHelp(argparse.HelpFormatter):
    """Descriptions, epilogs and argument help as plain text (``plain_text``)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(plain_text(text), width, indent)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return super()._split_lines(plain_text(text), width)


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose help reads as plain text; its subcommands' parsers are too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _PlainTextHelp)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The full ``linattn`` argument parser (help of every command as plain text)."""
    parser = _Parser(prog="linattn", description="Linear-time Transformers for PyTorch.")
    parser.add_argument("--version", action="version", version=f"linattn {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in _COMMAND_GROUPS:
        group.register(commands)
    return parser


@contextmanager
def _speaking(rank: int) -> Iterator[TextIO]:
    """Within: this process's output as is on rank 0, else ``sys.stdout``/``sys.stderr`` go
    to ``os.devnull`` (under ``torchrun`` rank 0 alone speaks); yields the stream its errors
    go to (its real ``sys.stderr``)."""
    errors = sys.stderr
    if rank == 0:
        yield errors
        return
    with open(os.devnull, "w", encoding="utf-8") as sink, redirect_stdout(sink), redirect_stderr(sink):
        yield errors


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``linattn`` with ``argv`` (default ``sys.argv[1:]``); return the exit code. Under
    ``torchrun`` only rank 0 prints, and the others their errors (see the module docstring)."""
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    with _speaking(env_rank()) as errors:
        return _run(argv, errors)


def _report(error: BaseException | str, errors: TextIO) -> None:
    """Print ``error`` as one ``linattn: error:`` line on ``errors``: as it is on rank 0; on
    another rank prefixed with it, unless the error is another process's (``RelayedError``)
    and this process is not the first of its node."""
    rank = env_rank()
    if rank == 0:
        print(f"linattn: error: {error}", file=errors)
    elif not isinstance(error, RelayedError) or env_local_rank() == 0:
        print(f"linattn: error: rank {rank}: {error}", file=errors)


def _parse(argv: list[str], errors: TextIO) -> argparse.Namespace | int:
    """The parsed arguments, or the exit code of ``--help``, ``--version`` or an argparse
    error (on a rank other than 0, whose output is silenced, the error's line is reported)."""
    captured = io.StringIO()
    try:
        with redirect_stderr(captured) if env_rank() != 0 else nullcontext():
            return build_parser().parse_args(argv)
    except SystemExit as exit_request:  # --help, --version, or an argparse error (code 2)
        lines = captured.getvalue().strip().splitlines()
        if exit_request.code and lines:
            _report(lines[-1], errors)
        return int(exit_request.code or 0)


def _run(argv: list[str], errors: TextIO) -> int:
    args = _parse(argv, errors)
    if isinstance(args, int):
        return args
    args.command_line = shlex.join(["linattn", *argv])
    try:
        return args.handler(args)
    except TrainingDiverged as error:
        _report(error, errors)
        return 3
    except (ValueError, TypeError) as error:
        _report(error, errors)
        return 2
    except KeyboardInterrupt:
        print("linattn: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The program: ``main()``, then exit with its code (in a multi-process run by
    ``os._exit`` after flushing the output; see the module docstring)."""
    code = main()
    if env_world_size() > 1:
        _leave(code)
    sys.exit(code)


def _leave(code: int) -> None:
    """Flush stdout and stderr, then end the process with ``code`` at once."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to keep
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
