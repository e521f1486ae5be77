"""Shared fixtures."""

import pytest

import linattn.repro.framework


@pytest.fixture(autouse=True)
def retained_memory_calls(monkeypatch) -> list:
    """In-process ``linattn repro`` calls record that they would keep freed memory instead
    of changing the test process's malloc (tests/test_malloc.py checks the real effect in
    subprocesses)."""
    calls: list = []
    monkeypatch.setattr(linattn.repro.framework, "retain_freed_memory", lambda: calls.append(True) or {})
    return calls
