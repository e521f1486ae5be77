"""linattn's native kernels on CPUs, one extension compiled at first use from the sources of
each family's ``_native`` folder and the shared headers of ``common/_native``.

The VQ family's (``ops/vq/_native``): the decoding step (alone, inside a gated attention unit
and inside a whole model), the block form with its gradients and the nearest-code search
(``vq/native_choice.py``, ``vq/native_block_check.py`` and ``vq/nearest.py`` check each before
it is trusted). ``vq_decode_step`` spends almost nothing on arithmetic (one key and a few
queries against S codes, one softmax over 2L + S columns) and most of its time in the ~30
operator calls of the torch form (``vq/resident.quantize_and_decode``);
``vq_decode_step.cpp`` is the same step as one C++ function, rows spread over the intra-op
threads (a row is one thread's, so results do not depend on the thread count).
``vq_block_forward.cpp`` is the block form for hard codes (``vq/running.py``'s schedule) with a
block's window, cache and softmax in one pass per block; ``vq_block_backward.cpp`` its gradients
(grad_scope "cache" and "state"), the block's softmax recomputed from the forward's row
log-sum-exp. ``vq_codes.cpp`` is the quantizer's nearest-code search and the check that keys
are their codes. ``vq_gau_step.cpp`` is one token through a whole gated attention unit
(``nn/_gau_decode.py``), ``vq_model_step.cpp`` (``vq_model_step.h``) a whole VQ model's token
as one call of an object that holds the constants and buffers (``models/_vq_generation.py``);
``vq_kernels.h`` declares the VQ entry points, ``vq_block_inputs.h`` checks the block form's
inputs, ``vq_cache_scan.h`` gives the cache at the start of each segment of a row.

Kernel attention's (``ops/kernel/_native``, ``kernel/native_scan.py`` checks them):
``linear_scan.cpp``, the causal chunk form with its gradients, and ``decayed_scan.cpp``, the
decayed chunk form without gradients (``linear_scan.h`` declares both, ``scan_problem.h`` holds
what they share: the sizes, the feature maps they make, the division).

The delta rule's (``ops/delta/_native``, ``delta/native_chunk.py`` checks it): ``delta_scan.cpp``
(``delta_scan.h``), the chunk form of the delta rule and the gated delta rule without gradients.

The shared ones (``ops/common/_native``): ``block_model_step.cpp`` (``block_model_step.h``), a
whole token of a model of pre-norm blocks (the softmax, sliding-window, kernel attention,
retention, GLA, delta-rule and gated delta-rule layers) as one call (``models/_block_generation.py``),
built and checked by ``block_model_setup.cpp``, its feature maps in ``block_features.h``;
``lm_ends.h``, a model's embedding and final norm and head; ``lane_dot.h``, the steps' dot product
over a key row; ``rotation.h``, rotary turns;
``row_products.h``, the small matrix products of the steps (a few rows against a matrix read
once, in a fixed order of terms); ``tile_products.h``, those of the chunk kernels (tiles that fit
the first cache, sums kept in registers); ``chunk_decays.h``, the decay sums and decayed scores of
the chunk kernels with log decays; ``fast_exp.h``, the float32 exp of the softmax passes and the
SiLU; ``native_checks.h``, the check of a tensor a kernel writes through; ``module.cpp``, the
Python module of all of them.

**Build.** ``torch.utils.cpp_extension.load`` with ``-O3 -march=native -mprefer-vector-width=512 -fopenmp`` (the
vector width of the machine; OpenMP is torch's own runtime, so ``torch.set_num_threads``
governs it; ``ninja``, pinned in requirements.lock, drives the compiler), into
``<torch extensions root>/linattn/<name>`` (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``). The name hashes every input of the build
(``build_inputs``: the sources' texts and paths, the compiler and its version, the flags, the
CPU, the include and library folders of this torch and this Python, their versions), so
installations, compilers and machines never share a folder and ninja never rebuilds in one
(a change of any input builds anew, in a folder of its own). The first build takes about a
minute and says so on stderr; later processes load the cached library. ``linattn doctor
--build`` builds ahead of time.

**Lock.** A process builds (or loads) holding ``build_lock``: an exclusive ``flock`` on
``<folder>/linattn.lock``, which records its process id and host. The kernel releases a
flock when its process dies, so the lock is never stale; another process waits for it at
most ``BUILD_WAIT_SECONDS`` (saying so on stderr), then gives up naming the holder. Inside
it, torch's own lock (``<folder>/lock``, which torch's builder waits on without a timeout)
can only be one left by a build that was killed (SIGKILL, out of memory): that stale lock
is named and not waited on. Either way the build fails (``extension`` raises, and
``native_choice`` runs the torch form with a warning naming the lock and
``LINATTN_VQ_STEP_IMPL``); no lock is ever deleted for its holder. A folder that holds its
library already is imported from it without torch's builder, which would take its lock and
run ninja at every process's first use: a process killed in that window (a server's worker
stopped with SIGKILL) left a stale lock before a library that was complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..._checks import env_choice

_SHARED = Path(__file__).parent / "_native"
_VQ = Path(__file__).parents[1] / "vq" / "_native"
_KERNEL = Path(__file__).parents[1] / "kernel" / "_native"
_DELTA = Path(__file__).parents[1] / "delta" / "_native"
SOURCES = (_SHARED / "module.cpp", _SHARED / "block_model_step.cpp", _SHARED / "block_model_setup.cpp",
           _KERNEL / "linear_scan.cpp",
           _KERNEL / "decayed_scan.cpp", _DELTA / "delta_scan.cpp",
           _VQ / "vq_decode_step.cpp",
           _VQ / "vq_block_forward.cpp", _VQ / "vq_block_backward.cpp", _VQ / "vq_codes.cpp", _VQ / "vq_gau_step.cpp",
           _VQ / "vq_model_step.cpp")
# included by the sources (from these folders): part of the build's inputs
INCLUDES = (_SHARED, _VQ, _KERNEL, _DELTA)
HEADERS = (_SHARED / "fast_exp.h", _SHARED / "row_products.h", _SHARED / "tile_products.h", _SHARED / "chunk_decays.h",
           _SHARED / "native_checks.h", _SHARED / "rotation.h", _SHARED / "lm_ends.h", _SHARED / "lane_dot.h",
           _SHARED / "block_model_step.h", _SHARED / "block_features.h",
           _VQ / "vq_block_inputs.h", _VQ / "vq_cache_scan.h", _VQ / "vq_model_step.h", _VQ / "vq_kernels.h",
           _KERNEL / "linear_scan.h", _KERNEL / "scan_problem.h", _DELTA / "delta_scan.h")
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_WAIT_SECONDS = 300.0  # how long a process waits for another one's build (module docstring)
_LOCK_NAME = "linattn.lock"
_TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in the build folder
_POLL_SECONDS = 0.2
_module = None
_build_error: str | None = None


class BuildLocked(RuntimeError):
    """The build folder is locked by another process that does not finish, or by a stale lock."""


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags where Linux
    reports them, else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = [line for line in info if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _compiler_identity() -> str:
    """The compiler torch's builder runs (``CXX``, else ``c++``), where ``PATH`` finds it, and
    what its ``--version`` prints."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    found = shutil.which(compiler) or compiler
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:  # no compiler: the build fails, naming it
        version = f"not runnable ({type(error).__name__})"
    return f"{compiler} = {found}: {version}"


def build_inputs() -> dict[str, str]:
    """Everything the build's result depends on, by name: what torch's builder writes into
    ``build.ninja`` (the compiler, the flags, the include and library folders of this torch
    and this Python, the sources' paths) and what those do not show (the sources' texts, the
    compiler's version, the CPU behind ``-march=native``, the versions of torch and Python)."""
    from torch.utils import cpp_extension

    return {
        "sources": " ".join(hashlib.sha256(source.read_bytes()).hexdigest() for source in SOURCES + HEADERS),
        "source paths": " ".join(os.path.abspath(source) for source in SOURCES),
        "include folders": " ".join(os.path.abspath(folder) for folder in INCLUDES),
        "compiler": _compiler_identity(),
        "flags": " ".join(FLAGS),
        "link flags": " ".join(LDFLAGS),
        "cpu": _cpu_identity(),
        "torch": f"{torch.__version__} ({torch.version.git_version})",
        "torch folders": " ".join(cpp_extension.include_paths("cpu") + cpp_extension.library_paths("cpu")),
        "python": f"{sys.version} {sysconfig.get_config_var('SOABI')}",
        "python include": sysconfig.get_path("include", scheme="nt" if os.name == "nt" else "posix_prefix") or "",
    }


def extension_name() -> str:
    """The build's name: one per set of ``build_inputs``."""
    digest = hashlib.sha256(json.dumps(build_inputs(), sort_keys=True).encode())
    return f"linattn_native_{digest.hexdigest()[:16]}"


def build_directory() -> Path:
    """``<TORCH_EXTENSIONS_DIR, else torch's default root>/linattn/<extension_name()>``."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / "linattn" / extension_name()


def build_lock_path(directory: Path) -> Path:
    """The file whose ``flock`` a process holds while it builds in ``directory``."""
    return Path(directory) / _LOCK_NAME


def _holder(path: Path) -> str:
    """Who holds (or last held) the lock ``path``, as it records itself."""
    try:
        pid, host = path.read_text().split()
    except (OSError, ValueError):
        return "another process"
    return f"process {pid} on {host}"


@contextlib.contextmanager
def build_lock(directory: Path, wait_seconds: float | None = None, built: Path | None = None) -> Iterator[None]:
    """Hold ``directory``'s build lock for the block (module docstring), recording this
    process's id and host in it. Another holder is waited for at most ``wait_seconds``
    (default ``BUILD_WAIT_SECONDS``), then ``BuildLocked`` names it; a torch lock found
    inside (one no build holds: stale) is ``BuildLocked`` at once, unless the library
    ``built`` exists (then nothing is built and torch's builder is not run)."""
    import fcntl

    path = build_lock_path(directory)
    wait_seconds = BUILD_WAIT_SECONDS if wait_seconds is None else wait_seconds
    with open(path, "a+") as handle:
        _take(handle, fcntl, path, wait_seconds)
        last = _holder(path)
        handle.truncate(0)
        handle.write(f"{os.getpid()} {socket.gethostname()}\n")
        handle.flush()
        stale = Path(directory) / _TORCH_LOCK_NAME
        if stale.exists() and not (built is not None and built.exists()):
            raise BuildLocked(f"{stale} is stale: no process builds in its folder (the last build there, by {last}, "
                              "did not finish); delete it to build again")
        yield


def _take(handle, fcntl, path: Path, wait_seconds: float) -> None:
    """The exclusive flock of ``handle``, waiting at most ``wait_seconds`` (said on stderr)."""
    deadline = time.monotonic() + wait_seconds
    waiting = False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BuildLocked(f"{path} is held by {_holder(path)}, still building after {wait_seconds:g} s")
        if not waiting:
            print(f"linattn: waiting for {_holder(path)} to build the native kernels (lock {path}; at most "
                  f"{wait_seconds:g} s)", file=sys.stderr, flush=True)
            waiting = True
        time.sleep(min(_POLL_SECONDS, remaining))


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
    """Compile (or load the cached build of) the extension module, holding the folder's lock."""
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    directory = build_directory()
    name = directory.name
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{name}.so"
    with build_lock(directory, built=library):
        fresh = not library.exists()
        if not fresh:  # built: imported as it is (torch's builder would take its lock and run ninja)
            return _import_library(name, library)
        print(f"linattn: compiling the native kernels for this CPU (once; about a minute), into "
              f"{directory}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        module = load(name, [str(source) for source in SOURCES], extra_cflags=list(FLAGS), extra_ldflags=list(LDFLAGS),
                      extra_include_paths=[str(folder) for folder in INCLUDES],
                      build_directory=str(directory), verbose=False)
    if fresh:
        print(f"linattn: built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return module


def _import_library(name: str, library: Path):
    """The Python module in the built ``library`` (its folder's name hashes every build input,
    so a library there was built from these sources, flags and compiler)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
        raise RuntimeError(f"the native kernels could not be built: {_build_error}")
    return _module


def tracing() -> bool:
    """Whether torch.compile or torch.export is tracing: the native kernels read their tensors'
    data, which traced (fake) tensors do not hold, so the torch forms run there."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def unsupported_tensors(device: torch.device, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...]) -> str | None:
    """Why a kernel that reads its tensors' data does not run on tensors on ``device`` computed in
    ``dtype`` (None when it may): not a CPU, under ``torch.compile`` or ``torch.export``, or a dtype
    outside ``dtypes``."""
    if device.type != "cpu":
        return f"runs on CPU tensors, got {device.type}"
    if tracing():
        return "does not run under torch.compile or torch.export (it reads the tensors' data)"
    if dtype not in dtypes:
        return f"computes in {' or '.join(str(d).replace('torch.', '') for d in dtypes)}, got {dtype}"
    return None


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|``: how a self-check compares a kernel's result with the torch form's."""
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def first_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tolerance: float,
                     suffix: str = "") -> str | None:
    """None when every tensor of ``got`` is finite and within ``tolerance`` of ``want``'s by
    ``relative_error``, else what differs first (its name and ``suffix``)."""
    for name, value in got.items():
        if not bool(torch.isfinite(value).all()):
            return f"{name}{suffix}: non-finite values"
        error = relative_error(value, want[name])
        if not error <= tolerance:
            return f"{name}{suffix}: differs by {error:.3g} of its largest value (tolerance {tolerance:g})"
    return None


class Trust:
    """A native kernel's self-check (``check(key) -> None`` when it agrees with the torch form,
    else what differs), run after the build at the first ask per ``key`` (a dtype, or None) in a
    process, with CPU autocast off (the torch form is the reference in the dtype asked, whatever
    region the first ask comes from); a failure (of the build, of the check, or the kernel raising) is the verdict for
    the rest of the process, and is warned of once per key."""

    def __init__(self, check: Callable[[Any], str | None]):
        self._check = check
        self.verdicts: dict[Any, str | None] = {}  # None: passed; else what failed
        self.warned: set[Any] = set()

    def reset(self) -> None:
        """Forget the verdicts and warnings (tests); the built library stays loaded."""
        self.verdicts.clear()
        self.warned.clear()

    def verdict(self, key: Any = None) -> str | None:
        """None when the kernel builds and agrees with the torch form for ``key``, else what failed."""
        if key not in self.verdicts:
            self.verdicts[key] = None  # the check's own native calls
            try:
                extension()
                with torch.autocast("cpu", enabled=False):  # a first ask inside an autocast region
                    self.verdicts[key] = self._check(key)
            except Exception as error:  # the build's RuntimeError, or the kernel raising on the check
                self.verdicts[key] = " ".join(str(error).split())[:500]
        return self.verdicts[key]

    def choose(self, impl: str, variable: str, reason: str | None, key: Any, kernel: str, fallback: str) -> bool:
        """Whether a call asking for ``impl`` (``"auto"``, ``"torch"`` or ``"native"``) runs the
        kernel: ``variable`` (``torch`` or ``native``, read only for ``"auto"``) replaces the choice;
        ``"torch"`` never runs it; otherwise it runs when ``reason`` (why it does not compute the
        call) is None and its self-check for ``key`` passed. Asked for (``"native"``, or the variable
        set to it), a reason is a ValueError and a failed check a RuntimeError, each naming the
        ``kernel``; under ``"auto"`` the torch form runs, a failed check warned once with ``fallback``."""
        forced = env_choice(variable, ("torch", "native")) if impl == "auto" else None
        impl = forced or impl
        if impl == "torch":
            return False
        strict = impl == "native"
        if reason is not None:
            if strict:
                source = f"{variable}=native" if forced else "impl='native'"
                raise ValueError(f"{source}: the native {kernel} {reason}; use impl='torch' or 'auto'")
            return False
        return self.trusted(key, strict, f"the native {kernel} failed in {key}",
                            f"Use impl='torch' (or impl='auto' without {variable}=native)", fallback)

    def trusted(self, key: Any, strict: bool, failed: str, strict_hint: str, fallback: str) -> bool:
        """Whether the kernel may run for ``key``: True when its verdict passed; else, ``strict``
        (it was asked for), a RuntimeError "``failed``: verdict. ``strict_hint``", otherwise one
        RuntimeWarning per key, "``failed``: verdict; ``fallback``", and False."""
        failure = self.verdict(key)
        if failure is None:
            return True
        message = f"{failed}: {failure}"
        if strict:
            raise RuntimeError(f"{message}. {strict_hint}")
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(f"{message}; {fallback}", RuntimeWarning, stacklevel=4)
        return False
