"""The native VQ decoding step on CPUs: compiled at first use, checked before it is trusted.

``vq_decode_step`` spends almost nothing on arithmetic (one key and a few queries against
S codes, one softmax over 2L + S columns) and most of its time in the ~30 operator calls of
the torch form (``_vq_resident.quantize_and_decode``). ``_native/vq_decode_step.cpp`` is
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

**Self-check.** The first time a process would run the native step in a dtype, it runs
a short decoding sequence both ways (``_SHAPE``: two kv heads of two queries, bias and
position keys, three blocks) and compares outputs (``max |native - torch| <= RTOL *
max |torch|``: 1e-12 in float64, 1e-5 in float32) and codes (equal). A build that fails or a
check that fails is the verdict for the rest of the process: ``impl="auto"`` warns once,
naming it, and runs the torch form from then on; ``impl="native"`` raises ``RuntimeError``.

``LINATTN_VQ_STEP_IMPL``: ``torch`` or ``native`` replaces what ``impl="auto"`` chooses (an
explicit ``impl=`` argument wins). ``native`` for tensors that are not on the CPU is a
``ValueError`` naming the variable. Half-precision inputs are computed in float32 (as the
torch form computes them), so they take the native step too.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

ENV = "LINATTN_VQ_STEP_IMPL"
IMPLS = ("auto", "torch", "native")
SOURCE = Path(__file__).parent / "_native" / "vq_decode_step.cpp"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp")
DTYPES = (torch.float32, torch.float64)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
_SHAPE = dict(B=2, H=4, Hkv=2, L=4, S=8, Dk=8, Dv=6, steps=11)

_module = None
_build_error: str | None = None
_verdicts: dict[torch.dtype, str | None] = {}  # None: passed; else what failed
_warned: set[torch.dtype] = set()


def forced_impl() -> str | None:
    """``LINATTN_VQ_STEP_IMPL`` (``"torch"`` or ``"native"``), None when unset or empty;
    another value is a ValueError naming the variable and the values it takes."""
    value = os.environ.get(ENV, "")
    if value == "":
        return None
    if value not in ("torch", "native"):
        raise ValueError(f"{ENV} must be 'torch' or 'native' (or unset: impl='auto' chooses), got {value!r}")
    return value


def reset() -> None:
    """Forget the self-check's verdicts and warnings (tests); the built library stays loaded."""
    _verdicts.clear()
    _warned.clear()


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


def unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the native step does not apply to ``device`` and ``dtype`` (None when it does)."""
    if device.type != "cpu":
        return f"runs on CPU tensors, got {device.type}"
    if dtype not in DTYPES:
        return f"computes in float32 or float64, got {dtype}"
    return None


def verdict(dtype: torch.dtype) -> str | None:
    """None when the native step builds and agrees with the torch form in ``dtype``, else
    what failed; the check runs at the first ask per dtype."""
    if dtype not in _verdicts:
        _verdicts[dtype] = None  # the check's own native calls
        try:
            extension()
            _verdicts[dtype] = _run_check(dtype)
        except Exception as error:  # the build's RuntimeError, or the kernel raising on the check
            _verdicts[dtype] = " ".join(str(error).split())[:500]
    return _verdicts[dtype]


def use_native(impl: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``vq_decode_step(impl=...)`` runs the native step for inputs on ``device``
    computed in ``dtype`` (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    forced = forced_impl() if impl == "auto" else None
    impl = forced or impl
    if impl == "torch":
        return False
    strict = impl == "native"
    reason = unsupported(device, dtype)
    if reason is not None:
        if strict:
            source = f"{ENV}=native" if forced else "impl='native'"
            raise ValueError(f"{source}: the native VQ decoding step {reason}; use impl='torch' or 'auto'")
        return False
    failure = verdict(dtype)
    if failure is None:
        return True
    message = f"the native VQ decoding step failed in {dtype}: {failure}"
    if strict:
        raise RuntimeError(f"{message}. Use impl='torch' (or impl='auto' without {ENV}=native)")
    if dtype not in _warned:
        _warned.add(dtype)
        warnings.warn(f"{message}; vq_decode_step uses the torch form in {dtype} from now on", RuntimeWarning,
                      stacklevel=3)
    return False


def choice(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """What ``vq_decode_step(impl="auto")`` runs on ``device`` in ``dtype``, and why (for
    ``linattn doctor``); builds and checks the native step where it would run it."""
    try:
        forced = forced_impl()
    except ValueError as error:
        return "error", str(error)
    if forced == "torch":
        return "torch", f"{ENV}=torch"
    reason = unsupported(device, dtype)
    if reason is not None:
        if forced:
            return "error", f"{ENV}=native, but the native step {reason}"
        return "torch", f"the native step {reason}"
    failure = verdict(dtype)
    if failure is not None:
        return ("error" if forced else "torch"), f"the native step failed: {failure}"
    return "native", (f"{ENV}=native" if forced else "compiled for this CPU and agrees with the torch form") + (
        f" ({build_directory()})")


def _run_check(dtype: torch.dtype) -> str | None:
    """One decoding sequence with the native step and with the torch form: None when they
    agree (module docstring), else the first difference."""
    from .vq_step import vq_decode_step

    s = _SHAPE
    g = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    codebook = draw(s["Hkv"], s["S"], s["Dk"])
    bias, position_keys = draw(s["H"], s["L"] + 1), 0.5 * draw(s["H"], s["L"] + 1, s["Dk"])
    inputs = [(draw(s["B"], s["H"], 1, s["Dk"]), draw(s["B"], s["Hkv"], 1, s["Dk"]), draw(s["B"], s["Hkv"], 1, s["Dv"]))
              for _ in range(s["steps"])]
    results = {}
    with torch.no_grad():
        for impl in ("native", "torch"):
            state, outs = None, []
            for q, k, v in inputs:
                out, codes, state = vq_decode_step(q, k, v, codebook, state, block_size=s["L"], bias=bias,
                                                   position_keys=position_keys, impl=impl)
                outs.append((out, codes))
            results[impl] = outs
    for step, ((out, codes), (want, want_codes)) in enumerate(zip(results["native"], results["torch"])):
        if not torch.equal(codes, want_codes):
            return f"step {step}: codes {codes.flatten().tolist()}, the torch form's {want_codes.flatten().tolist()}"
        if not bool(torch.isfinite(out).all()):
            return f"step {step}: the output has non-finite values"
        error = float((out - want).abs().max()) / max(float(want.abs().max()), 1e-30)
        if not error <= RTOL[dtype]:
            return f"step {step}: the output differs by {error:.3g} of its largest value (tolerance {RTOL[dtype]:g})"
    return None
