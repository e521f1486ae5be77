"""Keep freed memory in the process for reuse (glibc malloc settings) in training loops.

A training step allocates the same large temporaries every time (one-hot value tensors,
feature maps, their gradients). glibc's malloc serves every block above its mmap
threshold (at most 32 MiB) with a fresh ``mmap`` and returns it with ``munmap``, so each
step page-faults its large tensors in again: the kernel zeroes every page before torch
writes it; keeping freed memory avoids those page faults (measured speed-ups:
docs/results.md). Where memory comes from changes no arithmetic: results are bit-identical.

``retain_freed_memory()`` sets, through ``mallopt`` and in ``os.environ`` (so that spawned
worker processes start with them), ``MALLOC_MMAP_MAX_=0`` (no mmap'd blocks: large blocks
come from the heap and are reused), ``MALLOC_TRIM_THRESHOLD_`` (do not hand the heap's
free top back to the system below 2 GiB) and ``MALLOC_TOP_PAD_`` (grow the heap 256 MiB
at a time). A setting the user already exported is left as it is. The memory a process
holds stays at its peak instead of shrinking between steps.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

# (environment name, mallopt parameter number, value): glibc's malloc.h.
_SETTINGS = (
    ("MALLOC_MMAP_MAX_", -4, 0),
    ("MALLOC_TRIM_THRESHOLD_", -1, 2**31 - 1),
    ("MALLOC_TOP_PAD_", -2, 2**28),
)

_applied: dict[str, int] = {}  # what retain_freed_memory set in this process


def _glibc() -> ctypes.CDLL | None:
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def retain_freed_memory() -> dict[str, str]:
    """Apply the settings above to this process and its future children; return
    :func:`malloc_settings`. A no-op (returning ``{}``) where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return {}
    for name, parameter, value in _SETTINGS:
        if name in os.environ:  # the user's choice, applied by glibc at start-up
            continue
        if libc.mallopt(ctypes.c_int(parameter), ctypes.c_int(value)) != 1:
            raise RuntimeError(f"mallopt({parameter}, {value}) failed: cannot set {name}")
        os.environ[name] = str(value)
        _applied[name] = value
    return malloc_settings()


def malloc_settings() -> dict[str, str]:
    """The glibc malloc settings in effect (for reports): each ``MALLOC_*_`` variable of
    the environment, marked ``(linattn)`` where :func:`retain_freed_memory` set it."""
    return {
        name: os.environ[name] + (" (linattn)" if name in _applied and os.environ[name] == str(_applied[name]) else "")
        for name in sorted(os.environ)
        if name.startswith("MALLOC_") and name.endswith("_")
    }
