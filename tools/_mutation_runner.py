"""Running a module's tests once per mutant without starting Python each time.

A worker process imports torch, pytest and the other heavy third-party packages once
(``preload``), then ``fork``s a child per test run: the child imports linattn afresh from the
stage, where the mutant has just been written, and runs pytest in-process. That saves the
~5 seconds a new interpreter spends importing torch, per mutant.

The baseline run also records which tests execute each line of the mutated module
(``LineRecorder``); a mutant then runs only the tests that execute its statement
(``tests_for``), and the module's whole tests when the statement runs at import time or by
no recorded test.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

PRELOADED = ("numpy", "torch", "torch._dynamo", "torch.nn", "pytest", "hypothesis", "transformers")
# Lines run outside any test (imports, collection) stand for every test.
OUTSIDE_TESTS = ""


def preload() -> None:
    """Import the heavy third-party packages once, before the first fork (linattn itself not:
    every child imports it from the stage). One thread, no bytecode caches (a mutant written
    within the same second as the original must not be read from a stale ``.pyc``)."""
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    sys.dont_write_bytecode = True
    for name in PRELOADED:
        try:
            __import__(name)
        except ImportError:
            pass
    if any(name == "linattn" or name.startswith("linattn.") for name in sys.modules):
        raise RuntimeError("a preloaded package imported linattn: the children would not see the mutants")


class LineRecorder:
    """A pytest plugin recording, per line of one file, the tests that execute it.

    Lines run while a test's setup or teardown runs are credited to every test of that test
    file (a module-scoped fixture is built in the first test's setup and used by the rest);
    lines run in a test's call to that test; lines run outside tests to ``OUTSIDE_TESTS``.
    The plugin runs in the forked child: at the end it writes ``{line: [owners]}`` to ``out``
    (``read`` loads it).
    """

    def __init__(self, path: Path, out: Path) -> None:
        self.path = str(path)
        self.out = out
        self.lines: dict[int, set[str]] = {}
        self.current = OUTSIDE_TESTS

    def _trace(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == self.path else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.lines.setdefault(frame.f_lineno, set()).add(self.current)
        return self._line

    def pytest_sessionstart(self, session) -> None:
        sys.settrace(self._trace)
        threading.settrace(self._trace)

    def pytest_sessionfinish(self, session) -> None:
        sys.settrace(None)
        threading.settrace(None)
        self.out.write_text(json.dumps({line: sorted(owners) for line, owners in self.lines.items()}))

    @staticmethod
    def read(out: Path) -> dict[int, set[str]]:
        return {int(line): set(owners) for line, owners in json.loads(out.read_text()).items()}

    def _phase(self, owner: str):
        self.current = owner
        try:
            return (yield)
        finally:
            self.current = OUTSIDE_TESTS

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        return (yield from self._phase(item.nodeid.split("::")[0]))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        return (yield from self._phase(item.nodeid))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item):
        return (yield from self._phase(item.nodeid.split("::")[0]))


def statement_lines(source: str) -> dict[int, range]:
    """For each line, the lines of the innermost statement holding it (a compound statement's
    header only: ``if``, ``for``, ``def`` ... without their bodies)."""
    spans: dict[int, range] = {}
    nodes = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.stmt)]
    for node in sorted(nodes, key=lambda n: n.end_lineno - n.lineno, reverse=True):
        body = getattr(node, "body", None)
        last = body[0].lineno - 1 if isinstance(body, list) and body and body[0].lineno > node.lineno \
            else node.end_lineno
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.decorator_list:
            first = min(d.lineno for d in node.decorator_list)
        else:
            first = node.lineno
        span = range(first, max(last, node.lineno) + 1)
        for line in span:
            spans[line] = span
    return spans


def tests_for(line: int, spans: dict[int, range], lines: dict[int, set[str]]) -> list[str] | None:
    """The test ids (or test files) that execute the statement at ``line``; ``None`` when the
    whole tests must run (the statement runs at import time, or no recorded test runs it)."""
    owners: set[str] = set()
    for number in spans.get(line, range(line, line + 1)):
        owners |= lines.get(number, set())
    if not owners or OUTSIDE_TESTS in owners:
        return None
    files = {owner for owner in owners if "::" not in owner}
    return sorted(files | {owner for owner in owners if owner.split("::")[0] not in files})


def run_pytest(args: list[str], *, stage: Path, timeout: float, log: Path,
               plugins: tuple = ()) -> tuple[int | None, str]:
    """Run ``pytest args`` in a forked child importing linattn from ``stage/src``.

    Returns ``(exit code, last lines of the output)``; the exit code is ``None`` when the run
    took longer than ``timeout`` seconds (the child and anything it started are killed).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setpgid(0, 0)
            handle = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(handle, 1)
            os.dup2(handle, 2)
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # not an outer pytest's capture
            os.chdir(stage)
            sys.path.insert(0, str(stage / "src"))
            code = int(pytest.main(args, plugins=list(plugins)))
        except BaseException:  # noqa: BLE001 - whatever happens, the child must not return
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    status = None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
        elif time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return None, "timeout"
        else:
            time.sleep(0.02)
    text = log.read_text(errors="replace") if log.exists() else ""
    return status, text[-3000:]
