"""Generated blocks: tables and numbers in README.md and docs/ written from result files.

A block is the text between two HTML comments, invisible on GitHub and on the site::

    <!-- generated: SOURCE ARGS -->
    ...written by this tool...
    <!-- end generated -->

On their own lines the markers enclose a block (a table; its lines are indented as the
opening marker); on one line they enclose an inline value in a sentence
(``... at <!-- generated: ... -->2.74–2.80<!-- end generated --> bpb ...``), after some text
on that line (Python-Markdown ends a paragraph at a line that starts with a comment). Markers inside
fenced code blocks and inline code spans are text, not markers. SOURCE is one of:

- ``repro DIR [OPTIONS]``: a table of the page that ``linattn repro report DIR`` prints (the
  experiment's own report, from ``DIR/results.json``); ``bench DIR [OPTIONS]`` the same for
  ``linattn bench report DIR``. OPTIONS select it: ``section=TITLE`` (the section under that
  heading; its whole text unless ``table=`` is given), ``table=N`` (the N-th table, 1-based;
  default 1), ``columns=A|B`` (those columns, by header, in that order), ``rows=A|B`` (the
  rows whose first cell is one of these, in that order), ``where=HEADER=VALUE`` (the rows
  with that cell); ``view=NAME`` with the view's own options instead: a named table of the
  benchmark module (its ``VIEWS``), e.g. ``bench docs/benchmarks/bench-lm view=contexts
  columns=train@512,train@16384 speedup=vq/softmax``.
- ``value DIR PATH [KEY=VALUE ...] [stat=S] [format=F] [scale=X] [from=LIST]``: one number of
  ``DIR/results.json`` (or of ``DIR`` itself when it names a ``*.json`` results file, such as
  ``linattn inspect``'s ``inspect.json``): ``PATH`` is a field of the rows (dotted into nested
  objects, a number indexing a list: ``heads.0.entropy``; a key that holds dots is matched
  whole: ``summary.largest.0.9``), or
  ``summary.a.b`` / ``metadata.a.b``; ``KEY=VALUE`` keep the rows whose field KEY equals VALUE
  (compared as text), ``KEY>=N`` and ``KEY<=N`` those whose numeric field is within the bound;
  ``from=runs`` reads the list ``runs`` instead of ``rows``; without
  ``stat`` exactly one row must match, ``stat`` = ``min``, ``max``, ``mean``, ``n`` or
  ``range`` (``min–max``) over every match; ``format`` is a Python format spec (needed for a
  float, e.g. ``.3f``); ``scale`` multiplies first (e.g. 1000: seconds to ms). DIR may also be
  a run journal ``*.jsonl`` (``linattn repro``'s ``runs.jsonl``): its rows are its recorded
  runs, ``{"key": ..., "row": ...}``, so PATH reads e.g. ``row.final_loss`` or
  ``key.config.lr``.

- ``schedule-grid NO_GRAD.txt WITH_GRAD.txt``: the loop/batched table of
  ``tools/vq_schedule_grid.py``'s printed grids (the ``forward`` lines of the first file, the
  ``train`` lines of the second; the batched column at the CPU's default group budget), the
  faster of each pair in bold: the grid ``schedule="auto"`` reads.

``python tools/generated_blocks.py [FILES...]`` rewrites every block of FILES (default:
README.md and docs/**/*.md) from its source; ``--check`` rewrites nothing and exits 1
listing ``file:line`` and a short diff of each block that differs (the test
tests/test_generated_blocks.py runs it over the repository). A marker naming a missing
result file, an unknown source or option, or one left unclosed stops both with exit code 2
and ``file:line``.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib.util
import re
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from linattn.bench import cli as bench_cli
from linattn.reporting import markdown_table_lines, read_results, read_results_of
from linattn.repro import cli as repro_cli
from linattn.repro.journal import RunJournal

ROOT = Path(__file__).resolve().parent.parent
OPEN = re.compile(r"<!--\s*generated:(.*?)-->")
END = re.compile(r"<!--\s*end generated\s*-->")
END_MARKER = "<!-- end generated -->"
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


class GeneratedBlockError(ValueError):
    """A marker that cannot be rendered: unclosed, unknown source, missing result file, ..."""


# --- sources --------------------------------------------------------------------------------


def _options(words: Sequence[str], what: str) -> dict[str, str]:
    options = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise ValueError(f"{what}: expected KEY=VALUE options, got {word!r}")
        if key in options:
            raise ValueError(f"{what}: option {key} given twice")
        options[key] = value
    return options


def _tables(lines: list[str]) -> list[list[str]]:
    """The Markdown tables among ``lines``: runs of ``|`` lines whose second is a rule."""
    tables, current = [], []
    for line in [*lines, ""]:
        if line.lstrip().startswith("|"):
            current.append(line)
            continue
        if len(current) >= 2 and set(current[1].replace("|", "").strip()) <= set("-: "):
            tables.append(current)
        current = []
    return tables


def _section(lines: list[str], title: str) -> list[str]:
    """The lines under the heading ``title`` up to the next heading of its level or above."""
    for index, line in enumerate(lines):
        match = _HEADING.match(line)
        if match and match.group(2) == title:
            level, body = len(match.group(1)), []
            for rest in lines[index + 1:]:
                other = _HEADING.match(rest)
                if other and len(other.group(1)) <= level:
                    break
                body.append(rest)
            while body and not body[0].strip():
                body.pop(0)
            while body and not body[-1].strip():
                body.pop()
            return body
    headings = [m.group(2) for m in map(_HEADING.match, lines) if m]
    raise ValueError(f"section={title!r}: no such heading in the report; its headings: {headings}")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip()[1:-1].split("|")]


def _select(table: list[str], columns: str | None, rows: str | None, where: str | None) -> list[str]:
    """``table`` with only the chosen columns (by header) and rows (first cell or ``HEADER=VALUE``)."""
    if columns is None and rows is None and where is None:
        return table
    header, body = _cells(table[0]), [_cells(line) for line in table[2:]]
    if where is not None:
        name, sep, wanted = where.partition("=")
        if not sep or name not in header:
            raise ValueError(f"where={where!r}: expected HEADER=VALUE with HEADER one of {header}")
        body = [cells for cells in body if cells[header.index(name)] == wanted]
    if rows is not None:
        by_first = {cells[0]: cells for cells in body}
        missing = [name for name in rows.split("|") if name not in by_first]
        if missing:
            raise ValueError(f"rows: no row starts with {missing}; the rows: {list(by_first)}")
        body = [by_first[name] for name in rows.split("|")]
    if columns is not None:
        missing = [name for name in columns.split("|") if name not in header]
        if missing:
            raise ValueError(f"columns: no column {missing}; the columns: {header}")
        keep = [header.index(name) for name in columns.split("|")]
        header, body = [header[i] for i in keep], [[cells[i] for i in keep] for cells in body]
    if not body:
        raise ValueError("the selection keeps no row of the table")
    return markdown_table_lines(header, body)


def _page_source(report_page: Callable[[Path], str], views: Callable[[Path], dict]) -> Callable:
    def render(root: Path, words: list[str]) -> str:
        if not words:
            raise ValueError("expected a results directory after the source")
        out_dir, options = root / words[0], _options(words[1:], "options")
        if "view" in options:
            name = options.pop("view")
            known = views(out_dir)
            if name not in known:
                raise ValueError(f"view={name}: no such view of {words[0]}; its views: {', '.join(known) or 'none'}")
            try:
                return known[name](read_results(out_dir), **options)
            except TypeError as error:
                raise ValueError(f"view={name}: {error}") from None
        unknown = set(options) - {"section", "table", "columns", "rows", "where"}
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(sorted(unknown))}; expected section=, table=, "
                             "columns=, rows=, where= or view=")
        lines = report_page(out_dir).splitlines()
        if "section" in options:
            lines = _section(lines, options["section"])
            if "table" not in options and not {"columns", "rows", "where"} & set(options):
                return "\n".join(lines)
        tables, number = _tables(lines), options.get("table", "1")
        if not number.isdigit() or not 1 <= int(number) <= len(tables):
            raise ValueError(f"table={number}: expected 1 to {len(tables)} (the tables of the report)")
        table = tables[int(number) - 1]
        return "\n".join(_select(table, options.get("columns"), options.get("rows"), options.get("where")))

    return render


def _bench_views(out_dir: Path) -> dict:
    _, name = read_results_of(out_dir, "bench", list(bench_cli.BENCHMARKS))
    return getattr(bench_cli.BENCHMARKS[name], "VIEWS", {})


def _field(item, path: list[str], where: str):
    index = 0
    while index < len(path):
        key = path[index]
        if isinstance(item, list) and key.isdigit() and int(key) < len(item):
            item, index = item[int(key)], index + 1  # a list element by its position
            continue
        # a key may itself hold dots ("0.5"): the longest run of the path's parts that is one
        joined = next((n for n in range(len(path), index, -1)
                       if isinstance(item, dict) and ".".join(path[index:n]) in item), None)
        if joined is None:
            raise ValueError(f"{where}: no field {'.'.join(path)!r}")
        item, index = item[".".join(path[index:joined])], joined
    return item


def _checked_number(value, what: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is {value!r}, not a number")
    return value


def _formatted(value: int | float, fmt: str | None, what: str) -> str:
    if isinstance(value, float) and fmt is None:
        raise ValueError(f"{what} is a float ({value!r}): give format=, e.g. format=.3f")
    try:
        return format(value, fmt or "")
    except ValueError as error:
        raise ValueError(f"format={fmt}: {error}") from None


def _results_of(path: Path) -> dict:
    """``path/results.json``; a results file of another name (``*.json``, e.g. ``linattn
    inspect``'s ``inspect.json``); or a run journal ``*.jsonl`` as ``{"rows": [{"key", "row"}, ...]}``."""
    if path.suffix == ".json":
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
        return read_results(path.parent, name=path.name)
    if path.suffix != ".jsonl":
        return read_results(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such run journal")
    return {"rows": RunJournal(path, resume=True, read_only=True).entries()}


def _value(root: Path, words: list[str]) -> str:
    if len(words) < 2:
        raise ValueError("expected `value DIR PATH [KEY=VALUE ...] [stat=] [format=] [scale=] [from=]`")
    results, what = _results_of(root / words[0]), words[1]
    path, options = what.split("."), _options(words[2:], "options")
    stat, fmt, source = options.pop("stat", None), options.pop("format", None), options.pop("from", "rows")
    try:
        scale = float(options.pop("scale", "1"))
    except ValueError:
        raise ValueError("scale= must be a number") from None
    if path[0] in ("summary", "metadata"):
        if options or stat or source != "rows":
            raise ValueError(f"{what}: a {path[0]} field takes no row filters, stat= or from=")
        values = [_field(results, path, words[0])]
    else:
        if not isinstance(results.get(source), list):
            raise ValueError(f"from={source}: {words[0]}/results.json has no list {source!r}")
        matches = [row for row in results[source]
                   if all(_keeps(row, key, value, f"{words[0]} {source}") for key, value in options.items())]
        if not matches:
            raise ValueError(f"no row of {words[0]} {source} has {options}")
        values = [_field(row, path, f"{words[0]} {source}") for row in matches]
    values = [_checked_number(v, what) for v in values]
    values = [v * scale for v in values] if scale != 1 else values
    if stat is None:
        if len(values) != 1:
            raise ValueError(f"{len(values)} rows match {options}: add filters or stat=min|max|mean|n|range")
        return _formatted(values[0], fmt, what)
    if stat == "n":
        return str(len(values))
    if stat == "range":
        return f"{_formatted(min(values), fmt, what)}–{_formatted(max(values), fmt, what)}"
    if stat == "mean":
        return _formatted(statistics.fmean(values), fmt, what)
    if stat in ("min", "max"):
        return _formatted(min(values) if stat == "min" else max(values), fmt, what)
    raise ValueError(f"stat={stat}: expected one of min, max, mean, n, range")


@functools.cache
def _grid_tool():
    """``tools/vq_schedule_grid.py`` as a module (a script beside this one, not a package)."""
    spec = importlib.util.spec_from_file_location("_vq_schedule_grid", Path(__file__).with_name("vq_schedule_grid.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _schedule_grid(root: Path, words: list[str]) -> str:
    if len(words) != 2:
        raise ValueError("expected `schedule-grid NO_GRAD.txt WITH_GRAD.txt` (outputs of tools/vq_schedule_grid.py)")
    tool = _grid_tool()
    budget = tool.schedule.BATCHED_SCORES["cpu"]
    grids = []
    for name, mode in zip(words, ("forward", "train")):
        if not (root / name).is_file():
            raise ValueError(f"{name}: no such file")
        grids.append({key[1:]: times for key, times in tool.read_grid((root / name).read_text()).items()
                      if key[0] == mode})
        if not grids[-1] or any(budget not in times for times in grids[-1].values()):
            raise ValueError(f"{name}: no {mode} lines with the default budget 2^{budget.bit_length() - 1}")
    if grids[0].keys() != grids[1].keys():
        raise ValueError(f"{words[0]} and {words[1]} measured different shapes")

    def pair(times: dict) -> list[str]:
        winner = tool.faster(times["loop"], times[budget])
        return [f"**{times[key]}**" if winner == name else str(times[key]) for name, key in (("loop", "loop"),
                                                                                             ("batched", budget))]

    rows = [[str(rows), str(L), str(S), str(R * L), *pair(grids[0][rows, L, S, R]), *pair(grids[1][rows, L, S, R])]
            for rows, L, S, R in sorted(grids[0])]
    return "\n".join(markdown_table_lines(["rows", "L", "S", "T", "no grad: loop", "batched", "fwd+bwd: loop",
                                            "batched"], rows))


def _keeps(row: dict, key: str, value: str, where: str) -> bool:
    """Whether ``row`` passes the filter ``KEY=VALUE`` (the field as text equals VALUE), or
    ``KEY>=N`` / ``KEY<=N`` (split at ``=`` as ``KEY>``/``KEY<`` and N: the number is within the bound)."""
    if key[-1] in "<>":
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(f"{key}={value}: the bound must be a number") from None
        number = _checked_number(_field(row, key[:-1].split("."), where), key[:-1])
        return number >= bound if key[-1] == ">" else number <= bound
    return str(_field(row, key.split("."), where)) == value


SOURCES: dict[str, Callable[[Path, list[str]], str]] = {
    "repro": _page_source(repro_cli.report_page, lambda out_dir: {}),
    "bench": _page_source(bench_cli.report_page, _bench_views),
    "value": _value,
    "schedule-grid": _schedule_grid,
}


def render(spec: str, root: Path = ROOT) -> str:
    """The text of the block whose marker reads ``generated: spec`` (paths relative to ``root``)."""
    try:
        words = shlex.split(spec)
    except ValueError as error:
        raise ValueError(f"cannot split {spec!r}: {error}") from None
    if not words or words[0] not in SOURCES:
        raise ValueError(f"unknown source {words[0] if words else ''!r}; known: {', '.join(SOURCES)}")
    return SOURCES[words[0]](root, words[1:])


# --- markers --------------------------------------------------------------------------------


@dataclass
class Block:
    """One generated block: where its opening marker is, its spec, and its text now and
    as rendered (``lines``: the block's lines between the markers; inline: one string)."""

    path: str
    line: int
    spec: str
    inline: bool
    current: list[str]
    expected: list[str]

    @property
    def differs(self) -> bool:
        return self.current != self.expected

    def diff(self, limit: int = 12) -> str:
        lines = list(difflib.unified_diff(self.current, self.expected, "in the file", "from the results",
                                          lineterm="", n=0))
        return "\n".join(lines[:limit] + (["..."] if len(lines) > limit else []))


def _marker_spans(line: str, pattern: re.Pattern) -> list[re.Match]:
    """Matches of ``pattern`` in ``line`` outside inline code spans."""
    code = [m.span() for m in _CODE_SPAN.finditer(line)]
    return [m for m in pattern.finditer(line) if not any(a <= m.start() < b for a, b in code)]


def process(text: str, path: str, root: Path = ROOT) -> tuple[str, list[Block]]:
    """``text`` with every block rewritten from its source, and the blocks. A
    :class:`GeneratedBlockError` naming ``path:line`` for a marker that cannot be rendered."""

    def fail(number: int, message: str) -> GeneratedBlockError:
        return GeneratedBlockError(f"{path}:{number}: {message}")

    def rendered(number: int, spec: str) -> str:
        try:
            return render(spec, root)
        except ValueError as error:
            raise fail(number, f"generated: {spec.strip()}: {error}") from None

    lines, out, blocks = text.split("\n"), [], []
    fence, index = None, 0
    while index < len(lines):
        line, number = lines[index], index + 1
        index += 1
        match = _FENCE.match(line)
        if fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
            out.append(line)
            continue
        if match:
            fence = match.group(1)
            out.append(line)
            continue
        opens, ends = _marker_spans(line, OPEN), _marker_spans(line, END)
        if not opens:
            if ends:
                raise fail(number, "`<!-- end generated -->` without an opening `<!-- generated: ... -->`")
            out.append(line)
            continue
        if len(opens) == 1 and not ends and line.strip() == opens[0].group(0):
            indent, spec, body = line[:len(line) - len(line.lstrip())], opens[0].group(1), []
            while True:
                if index >= len(lines):
                    raise fail(number, "unclosed `<!-- generated: ... -->`: no `<!-- end generated -->` after it")
                following = lines[index]
                index += 1
                if _marker_spans(following, OPEN):
                    raise fail(number, f"unclosed `<!-- generated: ... -->`: another opens at line {index} "
                                       "before its `<!-- end generated -->`")
                if _marker_spans(following, END):
                    if following.strip() != END_MARKER:
                        raise fail(index, "a block's `<!-- end generated -->` must stand alone on its line")
                    break
                body.append(following)
            expected = ["", *(indent + text_line if text_line else ""
                              for text_line in rendered(number, spec).strip("\n").split("\n")), ""]
            blocks.append(Block(path, number, spec.strip(), False, body, expected))
            out += [line, *expected, following]
            continue
        # inline: each opening closes on this line, before the next opening
        if not line[:opens[0].start()].strip():
            raise fail(number, "an inline `<!-- generated: ... -->` must follow text on its line (a line that "
                               "starts with an HTML comment ends the paragraph on the site); a block's markers "
                               "stand alone on their lines")
        pieces, position = [], 0
        for k, opening in enumerate(opens):
            limit = opens[k + 1].start() if k + 1 < len(opens) else len(line)
            closing = next((e for e in ends if opening.end() <= e.start() < limit), None)
            if closing is None:
                raise fail(number, "unclosed `<!-- generated: ... -->`: a block's markers stand alone on their "
                                   "lines; an inline value closes with `<!-- end generated -->` on the same line")
            value = rendered(number, opening.group(1))
            if "\n" in value.strip("\n"):
                raise fail(number, f"generated: {opening.group(1).strip()}: gives several lines; inline "
                                   "values must be one line (put a table's markers on their own lines)")
            value = value.strip("\n")
            blocks.append(Block(path, number, opening.group(1).strip(), True,
                                [line[opening.end():closing.start()]], [value]))
            pieces += [line[position:opening.end()], value]
            position = closing.start()
        if len(ends) != len(opens):
            raise fail(number, "`<!-- end generated -->` without an opening `<!-- generated: ... -->`")
        out.append("".join(pieces) + line[position:])
    return "\n".join(out), blocks


def default_files(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README.md and docs/**/*.md)")
    parser.add_argument("--check", action="store_true",
                        help="rewrite nothing; exit 1 listing each block that differs from its results")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the repository root that result paths are relative to (default: this checkout)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    files = [f if f.is_absolute() else Path.cwd() / f for f in args.files] or default_files(root)
    drifted, count = [], 0
    try:
        for file in files:
            name = str(file.relative_to(root)) if file.is_relative_to(root) else str(file)
            text = file.read_text(encoding="utf-8")
            new, blocks = process(text, name, root)
            count += len(blocks)
            drifted += [b for b in blocks if b.differs]
            if new != text and not args.check:
                file.write_text(new, encoding="utf-8")
    except (GeneratedBlockError, OSError) as error:
        print(f"generated_blocks: error: {error}", file=sys.stderr)
        return 2
    if args.check and drifted:
        for block in drifted:
            print(f"{block.path}:{block.line}: generated block `{block.spec}` differs from its results\n"
                  f"{block.diff()}\n")
        print(f"{len(drifted)} of {count} generated blocks differ: run `python tools/generated_blocks.py` "
              "(or `make generated`) to rewrite them", file=sys.stderr)
        return 1
    verb = "checked" if args.check else "refreshed"
    print(f"generated_blocks: {count} blocks {verb} in {len(files)} files"
          + (f"; rewrote {len(drifted)}" if drifted and not args.check else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
