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


@pytest.fixture(params=[32, 2, 1], ids=lambda n: f"segments-of-{n}")
def segment_blocks(request, monkeypatch):
    """The native VQ kernels' blocks per task (``SEGMENT_BLOCKS`` of ``ops/vq/native_block.py``):
    one segment per row at the tests' shapes, or rows cut into segments of 2 blocks or of 1."""
    from linattn.ops.vq import native_block

    monkeypatch.setattr(native_block, "SEGMENT_BLOCKS", request.param)
    return request.param


@pytest.fixture
def fresh_block_verdicts():
    """The native VQ block form's self-check verdicts forgotten before and after the test."""
    from linattn.ops.vq import native_block_check

    native_block_check.reset()
    yield
    native_block_check.reset()


@pytest.fixture
def native_steps(monkeypatch) -> list:
    """Batch sizes of the steps of ``LM.generate``'s native token loops (``NativeGeneration.step``
    and ``step_greedy``, which every loop inherits), in order. The block loop's self-checks, which
    step a loop of their own at the first use per dtype, run before the counting starts."""
    from linattn.models import _block_generation
    from linattn.models._native_generation import NativeGeneration

    for dtype in (torch.float32, torch.float64):
        _block_generation.verdict(dtype)
    calls = []
    for name in ("step", "step_greedy"):
        original = getattr(NativeGeneration, name)

        def counting(self, ids, original=original):
            calls.append(ids.shape[0])
            return original(self, ids)

        monkeypatch.setattr(NativeGeneration, name, counting)
    return calls
