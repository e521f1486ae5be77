"""tools/_mutation_runner.py: which tests run each line, and the forked pytest runs of
`make mutate` (a mutant judged by too few tests would be reported as a survivor)."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("_mutation_runner", ROOT / "tools" / "_mutation_runner.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


SOURCE = textwrap.dedent('''\
    import functools

    LIMIT = 3 + 4


    @functools.cache
    def table(n):
        return [i * 2
                for i in range(n)]


    def pick(x,
             y):
        if (x > 0
                and y > 0):
            return x
        return y
''')


def test_statements_span_their_lines_and_compound_headers_only(runner):
    spans = runner.statement_lines(SOURCE)
    assert spans[3] == range(3, 4)
    assert spans[6] == spans[7] == range(6, 8)  # the decorator belongs to its def
    assert spans[8] == spans[9] == range(8, 10)  # a statement over two lines
    assert spans[12] == spans[13] == range(12, 14)
    assert spans[14] == spans[15] == range(14, 16)  # the if's header, not its body
    assert spans[16] == range(16, 17)
    assert spans[17] == range(17, 18)


def test_a_statement_is_judged_by_every_test_that_runs_any_of_its_lines(runner):
    spans = runner.statement_lines(SOURCE)
    outside = runner.OUTSIDE_TESTS
    lines = {3: {outside}, 8: {"tests/test_a.py::test_one"}, 9: {"tests/test_b.py::test_two"},
             14: {"tests/test_a.py::test_one"}, 15: {"tests/test_a.py", "tests/test_a.py::test_three",
                                                     "tests/test_b.py::test_four"}}
    assert runner.tests_for(9, spans, lines) == ["tests/test_a.py::test_one", "tests/test_b.py::test_two"]
    # a whole test file (lines run by its fixtures) stands for its tests
    assert runner.tests_for(14, spans, lines) == ["tests/test_a.py", "tests/test_b.py::test_four"]
    assert runner.tests_for(3, spans, lines) is None  # run at import time: the whole tests
    assert runner.tests_for(17, spans, lines) is None  # run by no recorded test: the whole tests


def _project(tmp_path: Path, *, broken: bool = False) -> Path:
    package = tmp_path / "src" / "probe_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(textwrap.dedent(f'''\
        import time

        SCALE = 2


        def double(x):
            return x * SCALE {"+ 1" if broken else ""}


        def built_once():
            return [1, 2, 3]


        def slow():
            time.sleep(30)
    '''))
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_double.py").write_text(textwrap.dedent('''\
        from probe_pkg.mod import double


        def test_double():
            assert double(3) == 6
    '''))
    (tests / "test_shared.py").write_text(textwrap.dedent('''\
        import pytest

        from probe_pkg.mod import built_once


        @pytest.fixture(scope="module")
        def shared():
            return built_once()


        def test_first(shared):
            assert shared[0] == 1


        def test_second(shared):
            assert len(shared) == 3
    '''))
    return tmp_path


def test_baseline_records_the_tests_of_each_line_in_a_forked_child(runner, tmp_path):
    stage = _project(tmp_path)
    out = tmp_path / "lines.json"
    recorder = runner.LineRecorder(stage / "src" / "probe_pkg" / "mod.py", out)
    code, output = runner.run_pytest(["-q", "-p", "no:cacheprovider", "tests"], stage=stage, timeout=120,
                                     log=tmp_path / "log", plugins=(recorder,))
    assert code == 0, output
    assert "3 passed" in output
    assert "probe_pkg" not in sys.modules  # imported by the child only
    lines = runner.LineRecorder.read(out)
    assert lines[3] == {runner.OUTSIDE_TESTS}  # module level: at import
    assert lines[7] == {"tests/test_double.py::test_double"}
    # built by a module-scoped fixture during the first test's setup: the whole file
    assert lines[11] == {"tests/test_shared.py"}
    assert 15 not in lines


def test_a_failing_test_and_a_timeout_are_reported(runner, tmp_path):
    stage = _project(tmp_path, broken=True)
    code, output = runner.run_pytest(["-q", "-p", "no:cacheprovider", "tests/test_double.py::test_double"],
                                     stage=stage, timeout=120, log=tmp_path / "log")
    assert code == 1 and "1 failed" in output
    (stage / "tests" / "test_slow.py").write_text("from probe_pkg.mod import slow\n\n\ndef test_slow():\n"
                                                 "    slow()\n")
    assert runner.run_pytest(["-q", "-p", "no:cacheprovider", "tests/test_slow.py"], stage=stage, timeout=3,
                             log=tmp_path / "log") == (None, "timeout")


@pytest.fixture()
def mutate(runner, monkeypatch, tmp_path):
    """tools/mutate.py with its tree (stages, results) under ``tmp_path``."""
    spec = importlib.util.spec_from_file_location("_mutate_under_test", ROOT / "tools" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "WORK", tmp_path / "build" / "mutate")
    monkeypatch.setattr(module, "RESULTS", tmp_path / "results" / "mutation")
    return module


def test_summary_is_assembled_from_the_stored_results_without_running(mutate):
    """``--summary`` reads each module's stored ``result.json`` (a module never run is 'no result')
    and writes the summary with the timeouts counted among the kills and shown apart."""
    first, second = mutate.TARGETS[:2]
    stage = mutate.WORK / first.name
    stage.mkdir(parents=True)
    counts = {"killed": 5, "timeout": 1, "survived": 2, "incompetent": 0, "not_reached": 0, "left_out": 9}
    survivor = {"line": 3, "operator": "core/AddNot", "occurrence": 0, "diff": "-a\n+b", "whole_tests": True}
    (stage / "result.json").write_text(json.dumps({"module": first.module, "tests": list(first.tests),
                                                   "status": "ok", "counts": counts, "survivors": [survivor]}))
    assert mutate.main(["--summary", "--only", first.module, second.module]) == 0
    text = (mutate.RESULTS / "summary.md").read_text()
    assert text.splitlines()[2].startswith("Assembled by `tools/mutate.py --summary`")
    assert f"| {first.module} | {', '.join(first.tests)} | 8 | 8 | 6 | 1 | 2 | 0 | 75% | ok |" in text
    assert f"| {second.module} | {', '.join(second.tests)} | | | | | | | | no result |" in text
    assert f"### {first.module}:3 (core/AddNot)" in text
    assert json.loads((mutate.RESULTS / "summary.json").read_text())["seconds"] is None
