"""The native VQ decoding step (``ops/vq/native.py``, chosen by ``ops/vq/native_choice.py``):
taken by ``impl="auto"`` on CPUs once it builds and agrees with the torch form; a build that
fails, or a step that differs, warns once and hands the work to the torch form
(``impl="native"`` raises instead); the variable
``LINATTN_VQ_STEP_IMPL`` and the kernel's own argument checks fail loudly. Its results
against the references: ``tests/test_vq_decode_step.py`` (every test there runs both forms)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import warnings

import pytest
import torch

import linattn
from linattn.ops.common import native
from linattn.ops.vq import native_choice

CPU = torch.device("cpu")
L = 4


@pytest.fixture
def fresh_verdicts(monkeypatch):
    """Forget the process's verdicts for the test, and restore them after it."""
    monkeypatch.delenv(native_choice.ENV, raising=False)
    monkeypatch.setattr(native_choice._trust, "verdicts", {})
    monkeypatch.setattr(native_choice._trust, "warned", set())


def _decode(impl, dtype=torch.float64, steps=6):
    g = torch.Generator().manual_seed(3)
    codebook = torch.randn(2, 7, 5, generator=g, dtype=dtype)
    state, outs = None, []
    with torch.no_grad():
        for _ in range(steps):
            q, k = torch.randn(1, 4, 1, 5, generator=g, dtype=dtype), torch.randn(1, 2, 1, 5, generator=g, dtype=dtype)
            v = torch.randn(1, 2, 1, 3, generator=g, dtype=dtype)
            out, _, state = linattn.vq_decode_step(q, k, v, codebook, state, block_size=L, impl=impl)
            outs.append(out)
    return torch.cat(outs, 2)


def test_auto_takes_the_native_step_on_cpu(fresh_verdicts):
    """Where a compiler is at hand (every machine this suite runs on), the automatic choice is
    the native step in float32 and float64, with no warning (half-precision inputs are
    computed in float32, so they take it too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native_choice.use_native("auto", CPU, torch.float64)
        assert native_choice.use_native("auto", CPU, torch.float32)
    assert native_choice.choice(CPU, torch.float64)[0] == "native"


def test_a_first_ask_inside_an_autocast_region_checks_in_the_dtype_asked(fresh_verdicts):
    """The self-check runs its torch reference with autocast off: a first use inside a
    bfloat16 autocast region (``bench lm --dtype bfloat16`` decodes there) once compared the
    native float32 step with a bfloat16 reference and turned the native step off."""
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("error")
        assert native_choice.use_native("auto", CPU, torch.float32)
    assert native_choice.verdict(torch.float32) is None


def test_a_failed_build_warns_once_and_runs_the_torch_form(fresh_verdicts, monkeypatch):
    def no_compiler():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(native, "extension", no_compiler)
    expected = _decode("torch")
    with pytest.warns(RuntimeWarning, match="native VQ decoding step failed in torch.float64: no compiler here"):
        out = _decode("auto")
    assert torch.equal(out, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per dtype
        _decode("auto")
    with pytest.raises(RuntimeError, match="no compiler here"):
        _decode("native")
    assert native_choice.choice(CPU, torch.float64) == ("torch", "the native step failed: no compiler here")


class _Off:
    """The compiled module with its output nudged: a kernel that is wrong on this machine."""

    def __init__(self, module):
        self.module = module

    def vq_decode_step(self, *args):
        self.module.vq_decode_step(*args)
        args[-2].add_(1e-6)  # out


def test_a_step_that_differs_is_caught_by_the_self_check(fresh_verdicts, monkeypatch):
    monkeypatch.setattr(native, "extension", lambda module=native.extension(): _Off(module))
    expected = _decode("torch")
    with pytest.warns(RuntimeWarning, match=r"the output differs by .* \(tolerance 1e-12\)"):
        out = _decode("auto")
    assert torch.equal(out, expected)
    with pytest.raises(RuntimeError, match="the output differs"):
        _decode("native")


def test_the_variable_and_impl_are_checked(monkeypatch):
    monkeypatch.setenv(native_choice.ENV, "fast")
    with pytest.raises(ValueError, match="LINATTN_VQ_STEP_IMPL must be 'torch' or 'native'"):
        _decode("auto")
    assert native_choice.choice(CPU, torch.float64)[0] == "error"
    cuda = torch.device("cuda")  # only named: the choice is made from the device and the dtype
    monkeypatch.setenv(native_choice.ENV, "native")
    with pytest.raises(ValueError, match=r"LINATTN_VQ_STEP_IMPL=native: .* runs on CPU tensors, got cuda"):
        native_choice.use_native("auto", cuda, torch.float32)
    assert native_choice.choice(cuda, torch.float32)[0] == "error"
    monkeypatch.delenv(native_choice.ENV)
    assert not native_choice.use_native("auto", cuda, torch.float32)
    with pytest.raises(ValueError, match=r"impl='native': .* runs on CPU tensors, got cuda"):
        native_choice.use_native("native", cuda, torch.float32)
    with pytest.raises(ValueError, match="impl must be one of 'auto', 'torch', 'native', got 'triton'"):
        _decode("triton")


def test_the_variable_forces_the_torch_form(monkeypatch):
    calls = []
    monkeypatch.setattr(native, "extension", lambda: calls.append(1))
    monkeypatch.setenv(native_choice.ENV, "torch")
    _decode("auto")
    assert calls == []
    assert native_choice.choice(CPU, torch.float64) == ("torch", "LINATTN_VQ_STEP_IMPL=torch")


def test_the_kernel_refuses_buffers_that_do_not_fit():
    """The C++ function checks what it writes through: a wrong shape, dtype or layout is an
    error naming the tensor, never a write out of bounds."""
    module = native.extension()
    B, Hkv, G, D, E, S = 1, 2, 1, 4, 3, 5
    C = 2 * L + S

    def arguments(**change):
        def f64(*shape):
            return torch.zeros(*shape, dtype=torch.float64)

        args = dict(q=f64(B, Hkv, G, D), k=f64(B, Hkv, D), v=f64(B, Hkv, E), search_t=torch.zeros(Hkv, D, S),
                    norms=torch.zeros(Hkv, S), codebook_t=f64(Hkv, D, S), keys=f64(B, Hkv, C, D),
                    values=f64(B, Hkv, C, E), codes=torch.zeros(B, Hkv, C, dtype=torch.int64), mask=f64(B, Hkv, C),
                    L=L, p=0, scale=1.0, relative=None, keys_are_codes=True, rerope=0, rerope_frequencies=None,
                    given_codes=None, soft_keys=False, out=f64(B, Hkv, G, E),
                    new_codes=torch.zeros(B, Hkv, dtype=torch.int64))
        args.update(change)
        return list(args.values())

    module.vq_decode_step(*arguments())
    with pytest.raises(RuntimeError, match=r"values has shape \[1, 2, 12, 3\], expected \[1, 2, 13, 3\]"):
        module.vq_decode_step(*arguments(values=torch.zeros(B, Hkv, C - 1, E, dtype=torch.float64)))
    with pytest.raises(RuntimeError, match="norms must be a contiguous CPU tensor of Float"):
        module.vq_decode_step(*arguments(norms=torch.zeros(S, Hkv).t()))
    with pytest.raises(RuntimeError, match="codes must be a contiguous CPU tensor of Long, got Int"):
        module.vq_decode_step(*arguments(codes=torch.zeros(B, Hkv, C, dtype=torch.int32)))
    with pytest.raises(RuntimeError, match="does not fit L = 4, S = 5, p = 4"):
        module.vq_decode_step(*arguments(p=L))
    module.vq_decode_step(*arguments(rerope=L, rerope_frequencies=torch.ones(D // 2, dtype=torch.float64)))
    with pytest.raises(RuntimeError, match=r"rerope 5 is not in \[0, L = 4\]"):
        module.vq_decode_step(*arguments(rerope=L + 1, rerope_frequencies=torch.ones(D // 2, dtype=torch.float64)))
    with pytest.raises(RuntimeError, match="ReRoPE needs an even Dk and rerope_frequencies"):
        module.vq_decode_step(*arguments(rerope=2))
    module.vq_decode_step(*arguments(given_codes=torch.tensor([[4, 0]])))
    with pytest.raises(RuntimeError, match=r"given code 5 is not in \[0, 5\)"):
        module.vq_decode_step(*arguments(given_codes=torch.tensor([[5, 0]])))
    with pytest.raises(RuntimeError, match=r"rerope_frequencies has shape \[3\], expected \[2\]"):
        module.vq_decode_step(*arguments(rerope=2, rerope_frequencies=torch.ones(3, dtype=torch.float64)))


def test_doctor_names_the_choice():
    from linattn import doctor

    rows = dict(doctor.implementations(CPU))
    assert rows["vq_decode_step (float32)"].startswith("impl='auto': native (")


def test_the_build_goes_where_torch_extensions_dir_says(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert native.build_directory() == tmp_path / "linattn" / native.extension_name()
    assert native.extension_name().startswith("linattn_native_")


def test_the_pinned_ninja_is_found_without_one_on_path(monkeypatch):
    """torch's builder runs ``ninja`` from PATH; an environment that is not activated has the
    pinned one only beside its interpreter, which the build then puts first on PATH."""
    import ninja

    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    monkeypatch.setenv("PATH", "/nowhere")
    native._ninja_on_path()
    assert native.os.environ["PATH"].split(native.os.pathsep) == [ninja.BIN_DIR, "/nowhere"]


# ---------------------------------------------------------------- the build: its lock and its folder


class _Hung(BaseException):
    """Raised by ``_within`` (a BaseException: the build's own ``except Exception`` must not
    take it for a build failure)."""


@contextlib.contextmanager
def _within(seconds: int):
    """Fails the test, instead of hanging it, when the block takes longer than ``seconds``."""

    def hung(signum, frame):
        raise _Hung(f"still waiting after {seconds} s: the native step's build hangs")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path, fresh_verdicts):
    """A build root of the test's own, where nothing is built, and a process that has not
    tried to build yet (the loaded module and a failed build are restored after the test);
    returns the build folder."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_build_error", None)
    return native.build_directory()


def _single_warning(record) -> str:
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    return messages[0]


def test_a_stale_build_lock_warns_naming_it_and_the_torch_form_runs(fresh_build):
    """A build killed half-way (SIGKILL, out of memory) leaves torch's ``lock`` in the build
    folder, on which torch's builder waits forever. No process builds there, so the lock is
    stale: the step warns once, naming the lock and ``LINATTN_VQ_STEP_IMPL``, and the torch
    form gives the result."""
    fresh_build.mkdir(parents=True)
    (fresh_build / "lock").touch()
    expected = _decode("torch")
    with _within(60), pytest.warns(RuntimeWarning) as record:
        out = _decode("auto")
    assert torch.equal(out, expected)
    message = _single_warning(record)
    assert str(fresh_build / "lock") in message and "stale" in message
    assert "LINATTN_VQ_STEP_IMPL=torch" in message
    with pytest.raises(RuntimeError, match="stale"):
        _decode("native")
    assert (fresh_build / "lock").exists(), "another process's lock is never deleted"


_HOLDER = """
import sys, time
from pathlib import Path
from linattn.ops.common import native
directory = Path(sys.argv[1])
with native.build_lock(directory, wait_seconds=0):
    (directory / "lock").touch()  # torch's, as its builder takes it
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_build_that_does_not_finish_is_waited_on_for_a_bounded_time(fresh_build, monkeypatch):
    """A live process building in the folder (here one that never finishes) is waited on for
    ``BUILD_WAIT_SECONDS``, then the torch form runs with a warning naming the lock, the
    process holding it and ``LINATTN_VQ_STEP_IMPL``."""
    monkeypatch.setattr(native, "BUILD_WAIT_SECONDS", 1.0)
    fresh_build.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(fresh_build)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        expected = _decode("torch")
        with _within(60), pytest.warns(RuntimeWarning) as record:
            out = _decode("auto")
    finally:
        holder.kill()
        holder.wait()
    assert torch.equal(out, expected)
    message = _single_warning(record)
    assert str(native.build_lock_path(fresh_build)) in message
    assert f"process {holder.pid} on {socket.gethostname()}" in message and "after 1 s" in message
    assert "LINATTN_VQ_STEP_IMPL=torch" in message


def test_the_build_folder_name_changes_with_every_build_input(monkeypatch, tmp_path):
    """Two installations, compilers, flags, CPUs, Pythons or torches never share a build
    folder (ninja would rebuild there at every switch, for a minute, silently); the same
    inputs give one name."""
    from torch.utils import cpp_extension

    name = native.extension_name()
    assert native.extension_name() == name
    compiler = tmp_path / "bin" / "c++"
    compiler.parent.mkdir()
    copies = []
    for source in native.SOURCES:
        copies.append(tmp_path / "install" / source.name)
        copies[-1].parent.mkdir(exist_ok=True)
        copies[-1].write_bytes(source.read_bytes())

    def fake_compiler(version):
        def change(mp):
            compiler.write_text(f"#!/bin/sh\necho 'c++ (fake) {version}'\n")
            compiler.chmod(0o755)
            mp.setenv("CXX", str(compiler))
        return change

    changes = {
        **{f"source text of {source.name}": (lambda mp, i=i: mp.setattr(native, "SOURCES", _edited(i, tmp_path)))
           for i, source in enumerate(native.SOURCES)},
        **{f"header text of {header.name}": (
            lambda mp, i=i: mp.setattr(native, "HEADERS", _edited(i, tmp_path, "HEADERS")))
           for i, header in enumerate(native.HEADERS)},
        "installation path": lambda mp: mp.setattr(native, "SOURCES", tuple(copies)),
        "compile flags": lambda mp: mp.setattr(native, "FLAGS", (*native.FLAGS, "-g")),
        "link flags": lambda mp: mp.setattr(native, "LDFLAGS", (*native.LDFLAGS, "-lm")),
        "compiler": lambda mp: mp.setenv("CXX", "clang++"),
        "compiler version 1": fake_compiler("1.0"),
        "compiler version 2": fake_compiler("2.0"),
        "CPU": lambda mp: mp.setattr(native, "_cpu_identity", lambda: "another CPU"),
        "torch version": lambda mp: mp.setattr(torch, "__version__", "0.0.1"),
        "torch installation": lambda mp: mp.setattr(cpp_extension, "include_paths",
                                                    lambda *args, **kwargs: [str(tmp_path / "torch" / "include")]),
        "Python version": lambda mp: mp.setattr(sys, "version", "3.0.0 (elsewhere)"),
    }
    names = {}
    for what, change in changes.items():
        with monkeypatch.context() as mp:
            change(mp)
            names[what] = native.extension_name()
            assert native.extension_name() == names[what], what
        assert native.extension_name() == name, f"{what}: undone"
    assert name not in names.values()
    assert len(set(names.values())) == len(names), names


def _edited(index, tmp_path, files="SOURCES"):
    """``native.SOURCES`` (or ``HEADERS``) with a comment added to file ``index`` (in a copy)."""
    paths = getattr(native, files)
    edited = tmp_path / f"edited-{files}-{index}" / paths[index].name
    edited.parent.mkdir()
    edited.write_text(paths[index].read_text() + "\n// edited\n")
    return tuple(edited if i == index else other for i, other in enumerate(paths))


def test_every_path_and_flag_torch_writes_into_the_build_file_enters_the_name(tmp_path):
    """What torch's builder writes into ``build.ninja`` (the compiler, the include and library
    folders of this torch and this Python, the sources' paths, our flags) is what ninja
    rebuilds on: each of it is among the inputs the folder's name hashes."""
    from torch.utils import cpp_extension

    build_file = tmp_path / "build.ninja"
    ldflags = cpp_extension._prepare_ldflags(list(native.LDFLAGS), False, False, False, False)
    cpp_extension._write_ninja_file_to_build_library(
        path=str(build_file), name="NAME", sources=[str(source) for source in native.SOURCES],
        extra_cflags=list(native.FLAGS),
        extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=ldflags,
        extra_include_paths=[str(folder) for folder in native.INCLUDES], with_cuda=False, with_sycl=False,
        is_standalone=False)
    inputs = "\n".join(native.build_inputs().values())
    objects = tuple(f"build {source.stem}.o" for source in native.SOURCES)
    lines = [line for line in build_file.read_text().splitlines()
             if line.startswith(("cxx =", "cflags =", "ldflags =", *objects))]
    assert len(lines) == 3 + len(native.SOURCES), lines
    tokens = [token for line in lines for token in line.partition(" = " if " = " in line else ": compile ")[2].split()]
    checked = [token for token in tokens if "/" in token or token in native.FLAGS + native.LDFLAGS]
    assert all(str(source) in checked for source in native.SOURCES) and cpp_extension.get_cxx_compiler() in tokens
    missing = [token for token in checked + [cpp_extension.get_cxx_compiler()]
               if token.removeprefix("-L").removeprefix("-I") not in inputs]
    assert not missing, missing


def test_a_built_library_loads_past_a_stale_torch_lock(tmp_path, monkeypatch):
    """A library already built in its folder is imported without torch's builder: a stale
    torch lock left beside it (a process killed while torch's builder held it to run ninja on a
    complete build) does not stop a later process."""
    native.extension()  # built (or loaded) in the default root
    built = native.build_directory()
    copy = tmp_path / "linattn" / built.name
    copy.mkdir(parents=True)
    shutil.copy2(built / f"{built.name}.so", copy / f"{built.name}.so")
    (copy / "lock").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_build_error", None)
    module = native.extension()
    assert hasattr(module, "vq_block_forward") and hasattr(module, "vq_decode_step")
    assert (copy / "lock").exists(), "another process's lock is never deleted"


def test_every_file_of_the_native_folders_enters_the_build():
    """Each ``.cpp`` of the ``_native`` folders is compiled (``SOURCES``) and each header is
    among the build's inputs (``HEADERS``): an edited header left out would load a stale build."""
    folders = native.INCLUDES
    assert {path for folder in folders for path in folder.glob("*.cpp")} == set(native.SOURCES)
    assert {path for folder in folders for path in folder.glob("*.h")} == set(native.HEADERS)


def test_every_source_of_the_build_is_in_the_package_data():
    """An installed (not editable) linattn ships every file the build reads: each source and
    header of ``native.py`` matches a ``package-data`` pattern of its package in pyproject.toml."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(linattn.__file__).parent
    config = tomllib.loads((root.parents[1] / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]
    for path in native.SOURCES + native.HEADERS:
        package_dir = path.parent.parent
        package = ".".join(("linattn",) + package_dir.relative_to(root).parts)
        relative = str(path.relative_to(package_dir))
        assert any(fnmatch.fnmatch(relative, p) for p in patterns.get(package, [])), (package, relative)
