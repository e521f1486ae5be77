"""What a decoding step's arithmetic costs on its own: its products, each measured alone.

``products_s(step)`` runs ``step()`` once under a dispatch mode that records every matrix
product and attention kernel it calls (``PRODUCTS``: mm, addmm, bmm, baddbmm, matrix-vector,
convolution, SDPA's CPU kernel), then times each recorded call by itself on the same tensors
(median of ``repeats`` after ``warmup`` calls, from warm caches) and returns the sum. A model's
time per generated token over this sum is what the rest costs: Python, operator dispatch, the
elementwise passes, and the memory traffic of reading every layer's weights and state again
(the products measured alone find theirs in the cache).

A native kernel called from Python is invisible to the dispatch mode: record a step through
its torch form (for VQ models, ``LINATTN_VQ_STEP_IMPL=torch``, whose products are the same
arithmetic as the native step's).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..ops.vq.native_choice import ENV

aten = torch.ops.aten
PRODUCTS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.mv, aten.addmv, aten.dot, aten.convolution,
                      aten._scaled_dot_product_flash_attention_for_cpu})


class _Recorder(TorchDispatchMode):
    """Keeps ``(op, args, kwargs)`` of every call in ``PRODUCTS`` (the tensors themselves, not copies)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in PRODUCTS:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def recorded_products(step: Callable[[], object]) -> list[tuple]:
    """``(op, args, kwargs)`` of the products ``step()`` calls, in order (without gradients; the
    second of two calls is recorded: a first call may build or self-check a kernel)."""
    with torch.no_grad():
        step()
        with _Recorder() as recorder:
            step()
    return recorder.calls


def products_s(step: Callable[[], object], *, repeats: int = 21, warmup: int = 3) -> float:
    """Seconds of ``step()``'s products each run alone (module docstring), summed."""
    total = 0.0
    with torch.no_grad():
        for func, args, kwargs in recorded_products(step):
            times = []
            for index in range(warmup + repeats):
                start = time.perf_counter()
                func(*args, **kwargs)
                if index >= warmup:
                    times.append(time.perf_counter() - start)
            total += statistics.median(times)
    return total


@contextmanager
def torch_vq_steps() -> Iterator[None]:
    """VQ decoding steps in their torch form inside the block (``LINATTN_VQ_STEP_IMPL=torch``), restored after."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "torch"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before
