"""tools/generated_blocks.py: the tables and numbers between `<!-- generated: ... -->` markers
in README.md and docs/ are what their result files give (the check over the real files), and
on a temporary copy: a changed number is found by file:line and rewritten, a bad marker is an
error naming file:line."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("_generated_blocks", ROOT / "tools" / "generated_blocks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_readme_and_docs_match_their_results(tool):
    """The drift check: every generated block of README.md and docs/**/*.md equals what its
    result files give now (`python tools/generated_blocks.py` rewrites them)."""
    drifted, count = [], {}
    for path in tool.default_files(ROOT):
        name = str(path.relative_to(ROOT))
        _, blocks = tool.process(path.read_text(encoding="utf-8"), name, ROOT)
        count[name] = len(blocks)
        drifted += [f"{b.path}:{b.line}: {b.spec}\n{b.diff()}" for b in blocks if b.differs]
    assert not drifted, "generated blocks differ from their results (run `make generated`):\n" + "\n".join(drifted)
    for page in ("README.md", "docs/results.md", "docs/benchmarks.md"):  # the check has blocks to check
        assert count[page] > 0, page


# --- a temporary repository ---------------------------------------------------------------

MEASURED = {"sdpa": {16: 0.004, 32: 0.016}, "linear-elu": {16: 0.001, 32: 0.002}}


def _write_results(root: Path) -> None:
    """docs/benchmarks/demo/results.json as `linattn bench attention` writes it (two cases,
    two lengths, forward times from MEASURED) and docs/results/runs/results.json as a
    reproduction at 3 seeds writes it (per-seed "runs", aggregated "rows" with "metrics")."""
    rows = [{"case": case, "label": case, "length": length, "forward_s": seconds, "forward_times_s": [seconds],
             "forward_peak_bytes": 2**20, "forward_backward_s": 3 * seconds, "forward_backward_times_s": [3 * seconds],
             "forward_backward_peak_bytes": 2**21, "skip_reason": None, "backward_skip_reason": None}
            for case, times in MEASURED.items() for length, seconds in times.items()]
    bench = root / "docs" / "benchmarks" / "demo"
    bench.mkdir(parents=True)
    metadata = {"command": "linattn bench attention --out docs/benchmarks/demo", "baseline": "sdpa"}
    bench.joinpath("results.json").write_text(json.dumps({"metadata": metadata, "rows": rows,
                                                          "summary": {"speedup": {"32": 8.0}}}))
    runs = root / "docs" / "results" / "runs"
    runs.mkdir(parents=True)
    seeds = [{"mechanism": "vq", "seed": s, "bpb": b} for s, b in enumerate((2.75, 2.81, 2.78))]
    runs.joinpath("results.json").write_text(json.dumps({
        "metadata": {"command": "linattn repro lm"}, "runs": seeds + [{"mechanism": "softmax", "seed": 0, "bpb": 3.0}],
        "rows": [{"mechanism": "vq", "seeds": [0, 1, 2], "n": 3,
                  "metrics": {"bpb": {"n": 3, "mean": 2.78, "std": 0.03, "min": 2.75, "max": 2.81}}}],
        "summary": {}}))


BLOCK = ('<!-- generated: bench docs/benchmarks/demo where=T=32 rows="linear-elu|sdpa" '
         'columns="case|fwd ms|sdpa/case fwd" -->')
SPEEDUP = "<!-- generated: value docs/benchmarks/demo summary.speedup.32 format=.1f -->"
RANGE = "<!-- generated: value docs/results/runs bpb from=runs mechanism=vq stat=range format=.2f -->"
PAGE = f"""# Demo

Linear attention is {SPEEDUP}?<!-- end generated -->x as fast at T=32;
VQ reaches {RANGE}?<!-- end generated --> bpb.

```markdown
A fence: text, not markers.
<!-- generated: nothing here -->
```

{BLOCK}
<!-- end generated -->

Not a marker either: `<!-- generated: nothing -->`.
"""
# The block as written out from MEASURED: ms with 3 significant digits, sdpa time / case time.
SDPA, LINEAR = MEASURED["sdpa"][32], MEASURED["linear-elu"][32]
TABLE = ["", "| case | fwd ms | sdpa/case fwd |", "| --- | --- | --- |",
         f"| linear-elu | {LINEAR * 1e3:.3g} | {SDPA / LINEAR:.2f}x |", f"| sdpa | {SDPA * 1e3:.3g} | 1.00x |", ""]


@pytest.fixture
def repo(tmp_path):
    _write_results(tmp_path)
    (tmp_path / "README.md").write_text(PAGE)
    (tmp_path / "docs" / "page.md").write_text("No markers here.\n")
    return tmp_path


def _run(tool, repo: Path, *argv: str) -> int:
    return tool.main(["--root", str(repo), *argv])


def test_refresh_writes_the_blocks_and_check_then_passes(tool, repo, capsys):
    assert _run(tool, repo, "--check") == 1  # the placeholders differ
    assert _run(tool, repo) == 0
    text = (repo / "README.md").read_text()
    lines = text.splitlines()
    start = lines.index(BLOCK)
    assert lines[start + 1:start + 1 + len(TABLE)] == TABLE
    assert lines[start + 1 + len(TABLE)] == "<!-- end generated -->"
    assert "-->8.0<!-- end generated -->x as fast" in text  # summary.speedup.32
    assert f"-->{min(2.75, 2.81, 2.78):.2f}–{max(2.75, 2.81, 2.78):.2f}<!-- end generated --> bpb." in text
    assert "<!-- generated: nothing here -->" in text and "`<!-- generated: nothing -->`" in text
    capsys.readouterr()
    assert _run(tool, repo, "--check") == 0
    assert "3 blocks checked in 2 files" in capsys.readouterr().out
    assert _run(tool, repo) == 0 and (repo / "README.md").read_text() == text  # a second refresh changes nothing


def test_a_changed_number_is_found_by_file_and_line_and_rewritten(tool, repo, capsys):
    assert _run(tool, repo) == 0
    good = (repo / "README.md").read_text()
    wrong = good.replace("| sdpa | 16 | 1.00x |", "| sdpa | 17 | 1.00x |")
    assert wrong != good
    (repo / "README.md").write_text(wrong)
    capsys.readouterr()
    assert _run(tool, repo, "--check") == 1
    out = capsys.readouterr().out
    line = good.splitlines().index(BLOCK) + 1
    assert f"README.md:{line}: generated block `bench docs/benchmarks/demo" in out
    assert "-| sdpa | 17 | 1.00x |" in out and "+| sdpa | 16 | 1.00x |" in out
    assert (repo / "README.md").read_text() == wrong  # --check rewrites nothing
    assert _run(tool, repo, str(repo / "README.md")) == 0
    assert (repo / "README.md").read_text() == good


def test_an_inline_value_that_changed_is_found(tool, repo, capsys):
    assert _run(tool, repo) == 0
    text = (repo / "README.md").read_text()
    (repo / "README.md").write_text(text.replace("-->8.0<!--", "-->8.1<!--"))
    capsys.readouterr()
    assert _run(tool, repo, "--check") == 1
    assert "README.md:3: generated block `value docs/benchmarks/demo summary.speedup.32 format=.1f`" in \
        capsys.readouterr().out


@pytest.mark.parametrize("marker, line, message", [
    ("<!-- generated: bench docs/benchmarks/missing -->\n<!-- end generated -->", 3,
     "docs/benchmarks/missing/results.json: no such file"),
    ("<!-- generated: tables docs/benchmarks/demo -->\n<!-- end generated -->", 3, "unknown source 'tables'"),
    ("<!-- generated: bench docs/benchmarks/demo -->\nno end", 3, "unclosed"),
    ("<!-- generated: bench docs/benchmarks/demo -->\n<!-- generated: bench docs/benchmarks/demo -->", 3,
     "unclosed `<!-- generated: ... -->`: another opens at line 4"),
    ("a value <!-- generated: value docs/benchmarks/demo summary.speedup.32 format=.1f --> left open", 3, "unclosed"),
    ("text\n<!-- end generated -->", 4, "without an opening"),
    ("<!-- generated: bench docs/benchmarks/demo table=5 -->\n<!-- end generated -->", 3, "table=5: expected 1 to 1"),
    ("<!-- generated: bench docs/benchmarks/demo columns=nope -->\n<!-- end generated -->", 3, "no column ['nope']"),
    ("<!-- generated: bench docs/benchmarks/demo section=Nope -->\n<!-- end generated -->", 3, "no such heading"),
    ("<!-- generated: bench docs/benchmarks/demo view=nope -->\n<!-- end generated -->", 3, "view=nope: no such view"),
    ("<!-- generated: bench docs/benchmarks/demo colour=red -->\n<!-- end generated -->", 3, "unknown option(s)"),
    ("<!-- generated: repro docs/benchmarks/demo -->\n<!-- end generated -->", 3, "is not a `linattn repro NAME"),
    ("x <!-- generated: bench docs/benchmarks/demo --><!-- end generated -->", 3, "inline values must be one line"),
    ("  <!-- generated: value docs/benchmarks/demo summary.speedup.32 format=.1f -->8.0<!-- end generated -->x", 3,
     "must follow text on its line"),
])
def test_a_bad_marker_is_an_error_naming_file_and_line(tool, repo, capsys, marker, line, message):
    (repo / "docs" / "page.md").write_text(f"# Page\n\n{marker}\n")
    capsys.readouterr()
    assert _run(tool, repo, "--check") == 2
    err = capsys.readouterr().err
    assert f"docs/page.md:{line}:" in err and message in err and "Traceback" not in err
    assert _run(tool, repo) == 2  # a refresh stops too


@pytest.mark.parametrize("spec, expected", [
    ("value docs/results/runs bpb from=runs mechanism=vq stat=range format=.2f", "2.75–2.81"),
    ("value docs/results/runs bpb from=runs mechanism=vq stat=mean format=.3f", f"{(2.75 + 2.81 + 2.78) / 3:.3f}"),
    ("value docs/results/runs bpb from=runs mechanism=vq stat=n", "3"),
    ("value docs/results/runs bpb from=runs seed=0 mechanism=softmax format=.1f", "3.0"),
    ("value docs/results/runs bpb from=runs mechanism=vq stat=max format=.2f", "2.81"),
    ("value docs/results/runs bpb from=runs mechanism=vq seed>=1 stat=range format=.2f", "2.78–2.81"),  # bounds
    ("value docs/results/runs bpb from=runs seed<=0 bpb>=2.9 format=.1f", "3.0"),
    ("value docs/results/runs bpb from=runs mechanism=vq seed>=1 seed<=1 format=.2f", "2.81"),  # both bounds
    ("value docs/results/runs metrics.bpb.mean mechanism=vq format=.2f", "2.78"),
    ("value docs/results/runs metrics.bpb.n mechanism=vq", "3"),
    ("value docs/benchmarks/demo forward_s case=sdpa T=16 scale=1000 format=.0f", None),  # T is no row field
    ("value docs/benchmarks/demo forward_s case=sdpa length=16 scale=1000 format=.0f", f"{0.004 * 1000:.0f}"),
    ("value docs/benchmarks/demo summary.speedup.32 format=.2f", "8.00"),
])
def test_values(tool, repo, spec, expected):
    if expected is None:
        with pytest.raises(ValueError, match="no field 'T'"):
            tool.render(spec, repo)
    else:
        assert tool.render(spec, repo) == expected


def test_values_from_a_run_journal(tool, repo):
    """A ``*.jsonl`` journal in place of a results directory: its rows are its recorded runs,
    key and row; a torn last line (a crash mid-write) is not a run."""
    journal = repo / "docs" / "results" / "probe.jsonl"
    lines = [{"key": {"mechanism": "softmax", "config": {"lr": 0.003, "seed": s}},
              "row": {"accuracy": {"16": 0.5 + s / 4}, "final_loss": 1.0 - s / 10}} for s in (0, 1)]
    journal.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"key": {"mech')
    assert tool.render("value docs/results/probe.jsonl row.accuracy.16 key.config.seed=1 format=.2f", repo) == "0.75"
    assert tool.render("value docs/results/probe.jsonl row.final_loss stat=range format=.1f", repo) == "0.9–1.0"
    assert tool.render("value docs/results/probe.jsonl key.config.lr stat=n", repo) == "2"
    with pytest.raises(ValueError, match="no such run journal"):
        tool.render("value docs/results/missing.jsonl row.final_loss", repo)


def test_values_from_a_named_results_file_and_list_positions(tool, repo):
    """``DIR`` may name a results file of another name (``linattn inspect``'s ``inspect.json``),
    and a number in ``PATH`` picks a list element."""
    folder = repo / "docs" / "results" / "inspect-probe"
    folder.mkdir(parents=True)
    rows = [{"module": f"layers.{i}", "heads": [{"entropy": 1.5 - i, "mass": [0.25, 0.75]}]} for i in (0, 1)]
    (folder / "inspect.json").write_text(json.dumps({"metadata": {"command": "linattn inspect"}, "rows": rows}))
    file = "docs/results/inspect-probe/inspect.json"
    assert tool.render(f"value {file} heads.0.entropy module=layers.1 format=.2f", repo) == "0.50"
    assert tool.render(f"value {file} heads.0.mass.1 stat=range format=.2f", repo) == "0.75–0.75"
    (folder / "results.json").write_text(json.dumps({"metadata": {"command": "linattn inspect"}, "rows": [],
                                                     "summary": {"at_least": {"0.9": 60, "0": 1}}}))
    assert tool.render("value docs/results/inspect-probe summary.at_least.0.9", repo) == "60"  # a key with a dot
    assert tool.render("value docs/results/inspect-probe summary.at_least.0", repo) == "1"
    with pytest.raises(ValueError, match="no field 'summary.at_least.0.5'"):
        tool.render("value docs/results/inspect-probe summary.at_least.0.5", repo)
    with pytest.raises(ValueError, match="no field 'heads.1.entropy'"):
        tool.render(f"value {file} heads.1.entropy module=layers.0 format=.2f", repo)
    with pytest.raises(ValueError, match="no such file"):
        tool.render("value docs/results/inspect-probe/missing.json heads.0.entropy", repo)


@pytest.mark.parametrize("spec, message", [
    ("value docs/results/runs bpb from=runs mechanism=vq format=.2f", "3 rows match"),
    ("value docs/results/runs bpb from=runs mechanism=vq", "3 rows match"),
    ("value docs/results/runs bpb from=runs mechanism=softmax", "is a float"),
    ("value docs/results/runs bpb from=runs mechanism=lsh stat=n", "no row of docs/results/runs runs"),
    ("value docs/results/runs mechanism from=runs seed=1", "'vq', not a number"),
    ("value docs/results/runs bpb from=nope stat=n", "has no list 'nope'"),
    ("value docs/results/runs bpb from=runs stat=median format=.2f", "stat=median: expected one of"),
    ("value docs/benchmarks/demo summary.speedup.32 stat=mean", "takes no row filters"),
    ("value docs/benchmarks/demo", "expected `value DIR PATH"),
    ("value docs/results/runs bpb from=runs seed>=one stat=n", "seed>=one: the bound must be a number"),
    ("value docs/results/runs bpb from=runs mechanism>=1 stat=n", "mechanism is 'vq', not a number"),
])
def test_bad_values_are_refused(tool, repo, spec, message):
    with pytest.raises(ValueError, match=message):
        tool.render(spec, repo)


def test_page_sections_and_tables(tool, repo, monkeypatch):
    """section= gives the text under a heading (to the next heading of its level), table= the
    N-th table; the page here is a stand-in for an experiment's report."""
    page = "\n".join(["# Title", "", "intro", "", "## Accuracy", "", "| a | b |", "| --- | --- |", "| 1 | 2 |", "",
                      "### Detail", "", "more", "", "| c |", "| --- |", "| 3 |", "", "## Runs", "", "| d |",
                      "| --- |", "| 4 |", ""])
    monkeypatch.setitem(tool.SOURCES, "page", tool._page_source(lambda out_dir: page, lambda out_dir: {}))
    assert tool.render("page x section=Accuracy", repo).splitlines() == [
        "| a | b |", "| --- | --- |", "| 1 | 2 |", "", "### Detail", "", "more", "", "| c |", "| --- |", "| 3 |"]
    assert tool.render("page x section=Accuracy table=2", repo) == "| c |\n| --- |\n| 3 |"
    assert tool.render("page x", repo) == "| a | b |\n| --- | --- |\n| 1 | 2 |"
    assert tool.render("page x table=3", repo) == "| d |\n| --- |\n| 4 |"
    assert tool.render("page x section=Accuracy columns=b|a", repo) == "| b | a |\n| --- | --- |\n| 2 | 1 |"
    with pytest.raises(ValueError, match="keeps no row"):
        tool.render("page x where=a=7", repo)


def test_schedule_grid_tables(tool, repo):
    """``schedule-grid``: the grid tool's printed lines (no-grad lines of the first file,
    fwd+bwd lines of the second) as one table, T from a line's ``T=`` (16384 in files printed
    before it was a choice), the faster schedule of each pair in bold, the batched column at
    the default budget; a later line of another budget is ignored, a file
    without the default budget or with other shapes is refused."""
    folder = repo / "docs" / "benchmarks" / "grid-probe"
    folder.mkdir(parents=True)
    (folder / "a.txt").write_text(
        "forward rows= 1 L= 64 S=128 loop    140 ms | 2^19:     52 ms (2.71x) | 2^22:    500 ms (0.28x)\n"
        "forward rows= 4 L=256 S=512 loop    389 ms | 2^19:    438 ms (0.89x)\n"
        "forward rows=64 L= 32 S= 64 T=  128 loop      4 ms | 2^19:     19 ms (0.21x)\n"
        "{\n    (False, 1, 64, 128, 256): 'batched',\n}\n")
    (folder / "b.txt").write_text(
        "forward rows= 1 L= 64 S=128 loop      1 ms | 2^19:      2 ms (0.50x)\n"
        "train   rows= 4 L=256 S=512 loop   1068 ms | 2^19:    926 ms (1.15x)\n"
        "train   rows=64 L= 32 S= 64 T=  128 loop     12 ms | 2^19:     40 ms (0.30x)\n"
        "train   rows= 1 L= 64 S=128 loop    290 ms | 2^19:     96 ms (3.02x)\n")
    table = tool.render("schedule-grid docs/benchmarks/grid-probe/a.txt docs/benchmarks/grid-probe/b.txt", repo)
    assert table.splitlines() == [
        "| rows | L | S | T | no grad: loop | batched | fwd+bwd: loop | batched |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        "| 1 | 64 | 128 | 16384 | 140 | **52** | 290 | **96** |",
        "| 4 | 256 | 512 | 16384 | **389** | 438 | 1068 | **926** |",
        "| 64 | 32 | 64 | 128 | **4** | 19 | **12** | 40 |",
    ]
    (folder / "c.txt").write_text("train   rows= 1 L= 64 S=128 loop    290 ms | 2^22:     96 ms (3.02x)\n")
    with pytest.raises(ValueError, match="no train lines with the default budget 2\\^19"):
        tool.render("schedule-grid docs/benchmarks/grid-probe/a.txt docs/benchmarks/grid-probe/c.txt", repo)
    (folder / "d.txt").write_text("train   rows= 1 L= 64 S=128 loop    290 ms | 2^19:     96 ms (3.02x)\n")
    with pytest.raises(ValueError, match="measured different shapes"):
        tool.render("schedule-grid docs/benchmarks/grid-probe/a.txt docs/benchmarks/grid-probe/d.txt", repo)
    with pytest.raises(ValueError, match="missing.txt: no such file"):
        tool.render("schedule-grid docs/benchmarks/grid-probe/missing.txt docs/benchmarks/grid-probe/b.txt", repo)
