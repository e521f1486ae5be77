"""The checks of the documentation runner (``tools/doc_snippets.py``): a block checked
without running it (Python compiled, shell through ``bash -n``, every ``linattn`` command
through the real argument parser, every ``make`` target against the Makefile), with the
static reading of a shell script into its simple commands that the checks need."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

from doc_snippets_pages import ROOT, Block, SnippetError, display


# ---------------------------------------------------------------------------------------- checks

def check_block(block: Block, parser: argparse.ArgumentParser | None = None,
                makefile: Path = ROOT / "Makefile") -> None:
    """Check ``block`` without running it (see the module docstring); raise ``SnippetError``.

    ``parser``: the ``linattn`` parser (built from the tree's ``linattn.cli`` if None)."""
    script = block.script()
    if block.kind == "python":
        try:
            compile(script, str(block.page), "exec")
        except SyntaxError as error:
            raise SnippetError(f"{display(block.page)}:{error.lineno}: {error.msg} (python block at "
                               f"{block.where})") from None
    elif block.kind == "shell":
        result = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
        if result.returncode != 0:
            raise SnippetError(f"{block.where}: bash -n: {result.stderr.strip()}")
        for argv in linattn_commands(script):
            _check_linattn_argv(block, argv, parser)
        targets = make_targets(makefile)
        for argv in shell_commands(script):
            if argv and argv[0] == "make":
                for target in _make_goals(argv[1:]):
                    if target not in targets:
                        raise SnippetError(f"{block.where}: make {target}: no such target in "
                                           f"{display(makefile)} (targets: {', '.join(sorted(targets))})")
    elif block.language == "toml":
        try:
            tomllib.loads(block.code)
        except tomllib.TOMLDecodeError as error:
            raise SnippetError(f"{block.where}: toml: {error}") from None
    elif block.language == "json":
        try:
            json.loads(block.code)
        except json.JSONDecodeError as error:
            raise SnippetError(f"{block.where}: json: {error}") from None


def _check_linattn_argv(block: Block, argv: list[str], parser: argparse.ArgumentParser | None) -> None:
    if parser is None:
        from linattn.cli import build_parser

        parser = build_parser()
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as exit_request:
            if exit_request.code not in (0, None):
                message = errors.getvalue().strip().splitlines()
                raise SnippetError(f"{block.where}: `{shlex.join(['linattn', *argv])}`: "
                                   f"{message[-1] if message else 'refused by the argument parser'}") from None


def make_targets(makefile: Path) -> set[str]:
    """The targets of ``makefile``: rule names and ``.PHONY`` names."""
    targets: set[str] = set()
    for line in makefile.read_text(encoding="utf-8").splitlines():
        rule = re.match(r"^([A-Za-z0-9_.$()/ -]+?)\s*:(?!=)(.*)$", line)
        if rule is None or line.startswith("\t"):
            continue
        if rule[1] == ".PHONY":
            targets.update(rule[2].split())
        else:
            targets.update(rule[1].split())
    return targets


def _make_goals(words: list[str]) -> list[str]:
    goals, skip_next = [], False
    for word in words:
        if skip_next:
            skip_next = False
        elif word in ("-C", "-f", "-j", "-I", "-o", "-W"):
            skip_next = True
        elif not word.startswith("-") and "=" not in word:
            goals.append(word)
    return goals


def linattn_commands(script: str) -> list[list[str]]:
    """The arguments of every ``linattn`` command in the shell ``script``: the words after
    ``linattn`` (``$(which linattn)`` counts as ``linattn``, e.g. under ``torchrun``) in each
    simple command; ``python -m linattn.cli`` too."""
    found = []
    for words in shell_commands(script):
        for i, word in enumerate(words):
            if word == "linattn" or word.endswith("/linattn"):
                found.append(words[i + 1:])
                break
            if word == "-m" and i + 1 < len(words) and words[i + 1] in ("linattn", "linattn.cli"):
                found.append(words[i + 2:])
                break
    return found


_SEPARATORS = ";|&()\n"


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell ``script`` as word lists, without running anything.

    Quotes and backslashes are removed as the shell would; comments, here-document bodies and
    redirections (with their targets) are dropped; commands are split at ``;``, ``|``, ``&``,
    ``&&``, ``||``, parentheses and newlines. An expansion (``$(...)``, backquotes, ``$VAR``,
    ``${...}``) becomes the word ``1``, except ``$(which linattn)`` and ``$(command -v linattn)``,
    which become ``linattn``, and ``$(seq ...)``, ``$(echo ...)``, ``$(printf ...)`` of plain
    words, which are run (unquoted, their output is split into words)."""
    commands: list[list[str]] = []
    words: list[str] = []
    word: str | None = None
    redirect = False
    heredocs: list[str] = []
    i, n = 0, len(script)

    def end_word() -> None:
        nonlocal word, redirect
        if word is not None:
            if not redirect:
                words.append(word)
            redirect = False
        word = None

    def end_command() -> None:
        nonlocal words
        end_word()
        if words:
            commands.append(words)
        words = []

    while i < n:
        c = script[i]
        if c == "\\" and i + 1 < n:
            if script[i + 1] != "\n":
                word = (word or "") + script[i + 1]
            i += 2
        elif c == "\n":
            end_command()
            i += 1
            for delimiter in heredocs:  # skip each here-document body, in order
                while i < n:
                    end = script.find("\n", i)
                    end = n if end < 0 else end
                    line, i = script[i:end], end + 1
                    if line.strip("\t") == delimiter:
                        break
            heredocs = []
        elif c in " \t":
            end_word()
            i += 1
        elif c == "#" and word is None:
            end = script.find("\n", i)
            i = n if end < 0 else end
        elif c == "'":
            end = script.find("'", i + 1)
            end = n if end < 0 else end
            word = (word or "") + script[i + 1:end]
            i = end + 1
        elif c == '"':
            i += 1
            text = ""
            while i < n and script[i] != '"':
                if script[i] == "\\" and i + 1 < n and script[i + 1] in '"\\$`\n':
                    text += script[i + 1] if script[i + 1] != "\n" else ""
                    i += 2
                elif script[i] in "$`":
                    value, i = _expansion(script, i)
                    text += value
                else:
                    text += script[i]
                    i += 1
            word = (word or "") + text
            i += 1
        elif c in "$`":
            value, i = _expansion(script, i)
            parts = value.split()  # an unquoted expansion is split into words
            if value[:1].isspace() or not parts:
                end_word()
            for k, part in enumerate(parts):
                word = (word or "") + part
                if k < len(parts) - 1 or value[-1:].isspace():
                    end_word()
        elif c in "<>" or (c == "&" and script[i + 1:i + 2] == ">"):
            if word is not None and word.isdigit():
                word = None  # the file descriptor of 2>, 1>&2
            end_word()
            j = i + 1
            while j < n and script[j] in "<>&|-":
                j += 1
            operator = script[i:j]
            i = j
            if operator.startswith("<<") and not operator.startswith("<<<"):
                while i < n and script[i] in " \t":
                    i += 1
                match = re.match(r"""(['"]?)([A-Za-z0-9_]+)\1""", script[i:])
                if match:
                    heredocs.append(match[2])
                    i += match.end()
                continue
            if operator.endswith("&") and i < n and (script[i].isdigit() or script[i] == "-"):
                i += 1  # >&2, <&-
                continue
            redirect = True
            while i < n and script[i] in " \t":
                i += 1
            word = None
        elif c in _SEPARATORS:
            end_command()
            i += 1
        else:
            word = (word or "") + c
            i += 1
    end_command()
    return commands


def _expansion(script: str, i: int) -> tuple[str, int]:
    """The placeholder of the expansion at ``script[i]`` (``$`` or a backquote) and the index after it."""
    if script[i] == "`":
        end = script.find("`", i + 1)
        end = len(script) if end < 0 else end
        return _substitution(script[i + 1:end]), end + 1
    if script.startswith("$((", i) or script.startswith("$(", i) or script.startswith("${", i):
        opening = script[i + 1]
        closing = ")" if opening == "(" else "}"
        depth, j = 0, i + 1
        while j < len(script):
            if script[j] == opening:
                depth += 1
            elif script[j] == closing:
                depth -= 1
                if depth == 0:
                    break
            j += 1
        inner = script[i + 2:j]
        return (_substitution(inner) if opening == "(" else "1"), j + 1
    match = re.match(r"\$([A-Za-z_][A-Za-z0-9_]*|[0-9@*#?$!-])", script[i:])
    if match:
        return "1", i + match.end()
    return "$", i + 1


_PURE_COMMANDS = ("seq", "echo", "printf")


def _substitution(command: str) -> str:
    """``linattn`` for ``which linattn``; the output of a ``seq``, ``echo`` or ``printf`` of
    plain words (run here); else ``1``."""
    if command.split() in (["which", "linattn"], ["command", "-v", "linattn"]):
        return "linattn"
    words = command.split()
    if words and words[0] in _PURE_COMMANDS and not re.search(r"[$`;|&<>(){}\\'\"*?]", command):
        result = subprocess.run(words, capture_output=True, text=True, timeout=10)
        if result.returncode == 0:
            return result.stdout.rstrip("\n")
    return "1"
