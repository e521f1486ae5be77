"""The pages of the documentation runner (``tools/doc_snippets.py``): a markdown page's
fenced blocks, their languages and their ``<!-- snippet: ... -->`` directives, parsed into
:class:`Block` objects, and :class:`SnippetError`, the error of a page that cannot be checked
or run as written."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON_LANGUAGES = ("python", "py")
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
DATA_LANGUAGES = ("text", "output", "toml", "json", "jsonl", "yaml", "yml", "ini", "csv", "diff", "markdown", "md",
                  "html", "mermaid", "tex", "latex", "math")
DIRECTIVES = ("skip", "replace", "setup")


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
