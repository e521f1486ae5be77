"""The native VQ decoding step on CPUs, compiled at first use (``native_choice.py`` checks it
before it is trusted).

``vq_decode_step`` spends almost nothing on arithmetic (one key and a few queries against
S codes, one softmax over 2L + S columns) and most of its time in the ~30 operator calls of
the torch form (``resident.quantize_and_decode``). ``_native/vq_decode_step.cpp`` is
the same step as one C++ function: the nearest code, the buffer writes, the scores, the
softmax and the weighted sum for every (batch, kv head) row, rows spread over the intra-op
threads (a row is one thread's, so results do not depend on the thread count).

**Build.** ``torch.utils.cpp_extension.load`` with ``-O3 -march=native -fopenmp`` (the
vector width of the machine; OpenMP is torch's own runtime, so ``torch.set_num_threads``
governs it; ``ninja``, pinned in requirements.lock, drives the compiler), into
``<torch extensions root>/linattn/<name>`` (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``), where the name hashes the source, the torch version
and the CPU, so a change of any of them builds anew. The first build takes about a minute
and says so on stderr; later processes load the cached library.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "_native" / "vq_decode_step.cpp"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp")
_module = None
_build_error: str | None = None


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags where Linux
    reports them, else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def extension_name() -> str:
    """The build's name: one per source text, torch version and CPU."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), _cpu_identity().encode(), " ".join(FLAGS).encode()):
        digest.update(part)
    return f"linattn_vq_step_{digest.hexdigest()[:16]}"


def build_directory() -> Path:
    """``<TORCH_EXTENSIONS_DIR, else torch's default root>/linattn/<extension_name()>``."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / "linattn" / extension_name()


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from ``PATH``; without one there, the pinned ``ninja``
    package's (beside the interpreter of a virtual environment that is not activated)."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:  # the build then fails, naming ninja, and that is the verdict
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build():
    """Compile (or load the cached build of) the extension module."""
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    name, directory = extension_name(), build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    fresh = not (directory / f"{name}.so").exists()
    if fresh:
        print(f"linattn: compiling the native VQ decoding step for this CPU (once; about a minute), into {directory}",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    module = load(name, [str(SOURCE)], extra_cflags=list(FLAGS), extra_ldflags=["-fopenmp"],
                  build_directory=str(directory), verbose=False)
    if fresh:
        print(f"linattn: built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return module


def extension():
    """The compiled module, built at the first call; a RuntimeError naming the failure when it
    cannot be built (the failure is kept: a process tries once)."""
    global _module, _build_error
    if _module is None and _build_error is None:
        try:
            _module = _build()
        except Exception as error:  # a missing compiler, a compile error, a load error: all are the verdict
            text = " ".join(str(error).split())
            _build_error = f"{type(error).__name__}: {text[:500]}"
    if _module is None:
        raise RuntimeError(f"the native VQ decoding step could not be built: {_build_error}")
    return _module
