"""``linattn doctor``, run in-process through the command's ``main``: its sections, its
self-test passing here, and a fast form made wrong (or failing) on purpose, which must turn
the exit code to 1 and be named."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import linattn.ops.delta.chunk as delta_chunk
import linattn.ops.sparse.strided as strided
from linattn import _selftest, doctor
from linattn.cli import main

CHECKS_ON_CPU = len(_selftest.checks())


def test_doctor_reports_every_section_and_exits_0_when_all_agree(capsys):
    assert main(["doctor", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    for section in ("versions", "threads", "devices", "implementations on cpu", "self-test on cpu"):
        assert f"\n{section}" in text, section
    for name in ("linattn", "python", "torch", "triton", "transformers", "peft", "numpy", "torch intra-op threads",
                 "softmax_attention (float32)", "linear_attention", "delta_rule", "vq_attention (float32)",
                 "vq_attention schedule", "KV cache"):
        assert f"\n  {name} " in text, name
    families = {check.family.split(":")[0] for check in _selftest.checks()}
    assert families == {"softmax_attention", "linear_attention", "delta_rule", "vq_attention", "local_attention",
                        "strided_attention", "lsh_attention", "linformer_attention", "soft_vq_attention"}
    assert text.count("\n  ok    ") == CHECKS_ON_CPU and "FAIL" not in text
    assert text.rstrip().splitlines()[-1].startswith(f"all {CHECKS_ON_CPU} checks agree")


def test_a_wrong_fast_form_fails_the_doctor_by_name(capsys, monkeypatch):
    """The delta rule's chunk form off by 1e-6 of its output: exit 1, a FAIL line and the last
    line name it; the other checks still pass."""
    chunk = delta_chunk.chunk
    monkeypatch.setattr(delta_chunk, "chunk",
                        lambda *args: (lambda out, memory: (out * (1 + 1e-6), memory))(*chunk(*args)))
    assert main(["doctor", "--device", "cpu"]) == 1
    lines = capsys.readouterr().out.rstrip().splitlines()
    failed = [line for line in lines if line.startswith("  FAIL")]
    assert len(failed) == 1 and "delta_rule" in failed[0] and "chunk vs recurrent" in failed[0]
    assert "output off by 1e-06 (tolerance 1e-09)" in failed[0]
    assert lines[-1] == f"1 of {CHECKS_ON_CPU} checks FAILED: delta_rule chunk vs recurrent (float64, cpu)"


def test_a_fast_form_that_raises_fails_the_doctor_naming_the_error(capsys, monkeypatch):
    def broken(*args):
        raise IndexError("stride tile out of range")

    monkeypatch.setattr(strided, "_strided_group", broken)
    assert main(["doctor", "--device", "cpu"]) == 1
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  FAIL")]
    assert len(failed) == 1
    assert "strided_attention" in failed[0] and failed[0].endswith("IndexError: stride tile out of range")


def test_json_output_holds_the_same_report(capsys):
    assert main(["doctor", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["failures"] == []
    assert report["versions"]["torch"] == torch.__version__ and list(report["devices"]) == ["cpu"]
    assert "vq_attention (float32)" in report["implementations"]["cpu"]
    results = report["self_test"]["cpu"]
    assert len(results) == CHECKS_ON_CPU and all(r["ok"] and r["dtype"] == "float64" for r in results)
    assert max(r["out_error"] for r in results) < 1e-12


def test_a_device_torch_cannot_see_is_refused_before_anything_runs(capsys):
    missing = f"cuda:{torch.cuda.device_count()}"
    assert main(["doctor", "--device", missing]) == 2
    assert f"{missing!r} requested but" in capsys.readouterr().err


def test_the_sdpa_backend_is_read_from_the_operator_torch_runs():
    assert doctor.sdpa_backend(torch.device("cpu"), torch.float32, 16, 16) == "flash attention (CPU kernel)"
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        assert doctor.sdpa_backend(torch.device("cpu"), torch.float32, 16, 16) == "math (materialised scores)"


_FIRST_DECODE = """
import torch, linattn
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 1, 4, generator=g, dtype=torch.float64) for _ in range(3))
codebook = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
linattn.vq_decode_step(q, k, v, codebook, block_size=4, impl="native")
print("decoded")
"""


def test_doctor_build_compiles_ahead_so_a_first_decode_compiles_nothing(monkeypatch, tmp_path):
    """``linattn doctor --build`` builds the native kernels (into a build root of the test's own
    here: a real build, about a minute) and checks the decoding step, the block form, the
    model step of pre-norm blocks, kernel attention's and the delta rule's chunk forms in float32 and float64; a
    later process's first decoding step loads that build and compiles nothing."""
    from linattn.ops.common import native
    from linattn.ops.vq import native_choice

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(native_choice.ENV, raising=False)
    doctor_run = subprocess.run([sys.executable, "-m", "linattn.cli", "doctor", "--build"], capture_output=True,
                                text=True, timeout=600)
    assert doctor_run.returncode == 0, doctor_run.stdout + doctor_run.stderr
    assert "compiling the native kernels" in doctor_run.stderr
    assert doctor_run.stdout.splitlines() == [f"native kernels: built in {native.build_directory()}"] + [
        f"  ok    {kernel}, {dtype}: agrees with the torch form"
        for kernel in ("decoding step", "block form", "model step of pre-norm blocks", "kernel attention's chunk form",
                       "the delta rule's chunk form")
        for dtype in ("float32", "float64")]
    later = subprocess.run([sys.executable, "-c", _FIRST_DECODE], capture_output=True, text=True, timeout=300)
    assert later.returncode == 0 and later.stdout == "decoded\n", later.stderr
    assert "compiling" not in later.stderr


def test_doctor_build_exits_1_naming_a_build_that_fails(monkeypatch, capsys):
    from linattn.ops.common import native

    def no_compiler():
        raise RuntimeError("the native kernels could not be built: no compiler here")

    monkeypatch.setattr(native, "extension", no_compiler)
    assert main(["doctor", "--build"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines() == ["  FAIL  native kernels: the native kernels could not be built: no compiler "
                                "here"]
