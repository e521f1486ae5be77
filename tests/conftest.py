"""Shared fixtures, and the Triton interpreter for this process on machines without CUDA.

Triton decides at import whether its functions are interpreted, and tests collected
before tests/test_vq_triton.py import it (torch._dynamo does), so ``TRITON_INTERPRET=1``
is set here, before any test module is imported. Nothing but the VQ kernels uses Triton.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import linattn.repro.framework


@pytest.fixture(autouse=True)
def retained_memory_calls(monkeypatch) -> list:
    """In-process ``linattn repro`` calls record that they would keep freed memory instead
    of changing the test process's malloc (tests/test_malloc.py checks the real effect in
    subprocesses)."""
    calls: list = []
    monkeypatch.setattr(linattn.repro.framework, "retain_freed_memory", lambda: calls.append(True) or {})
    return calls
