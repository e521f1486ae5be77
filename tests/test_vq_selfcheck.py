"""The Triton VQ kernels check themselves before they are trusted (ops/vq/selfcheck.py), and
``LINATTN_VQ_IMPL`` forces the choice.

On a machine without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``) and ``impl="auto"`` is allowed to take them for CPU tensors here, so
the first call that would run them runs the self-check. The kernel path is made to fail
(raise) or differ (a perturbed output or gradient) on purpose: the warning comes once,
naming what failed, the result is the torch block form's, and later calls do not check again.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import linattn
from linattn.ops.vq import fused, selfcheck, triton_choice
from _helpers import assert_close_rel
from test_vq_attention import make_vq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
L = 8


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    """No verdict from an earlier test, no LINATTN_VQ_IMPL, ``impl="auto"`` taking the kernels
    on this device; and a count of the self-checks run."""
    selfcheck.reset()
    monkeypatch.delenv(selfcheck.ENV, raising=False)
    monkeypatch.setattr(triton_choice, "AUTO_DEVICE_TYPES", ("cuda", "cpu"))
    runs = []
    check = selfcheck._run_check
    monkeypatch.setattr(selfcheck, "_run_check", lambda *args: runs.append(args) or check(*args))
    yield runs
    selfcheck.reset()


def inputs(T: int = 20, dtype=torch.float32):
    q, k_hat, v, codes, codebook = make_vq(B=1, H=2, Hkv=1, T=T, Dk=16, Dv=16, S=8, seed=T)
    return [x.to(device=DEVICE, dtype=dtype) for x in (q, k_hat, v)] + [codes.to(DEVICE),
                                                                      codebook.to(device=DEVICE, dtype=dtype)]


def count_kernel_calls(monkeypatch, replacement=None) -> list:
    """Record every call of the kernel path (``fused.block_form``), run through ``replacement``
    (a function of the real ``block`` and its arguments) when given."""
    calls, block = [], fused.block_form

    def recorded(*args):
        calls.append(1)
        return replacement(block, *args) if replacement else block(*args)

    monkeypatch.setattr(fused, "block_form", recorded)
    return calls


def torch_form(args):
    return linattn.vq_attention(*args, block_size=L, impl="torch")[0]


def assert_falls_back_once(args, match: str, runs: list) -> None:
    """The first ``impl="auto"`` call warns once (``match``) and returns the torch form's output;
    the next one neither warns nor checks again, and returns it too."""
    with pytest.warns(RuntimeWarning, match=match) as record:
        first, _ = linattn.vq_attention(*args, block_size=L)
    assert len(record) == 1
    assert torch.equal(first, torch_form(args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = linattn.vq_attention(*args, block_size=L)
    assert torch.equal(again, torch_form(args))
    assert len(runs) == 1


def test_kernels_that_raise_are_replaced_by_torch_after_one_warning(monkeypatch, fresh_verdicts):
    def broken(block, *args):
        raise RuntimeError("out of shared memory")

    calls = count_kernel_calls(monkeypatch, broken)
    assert_falls_back_once(inputs(), rf"self-check on {DEVICE}\S* in torch.float32: RuntimeError: out of shared "
                                     r"memory; vq_attention uses the torch block form", fresh_verdicts)
    assert len(calls) == 1  # the self-check's call only


def test_kernels_whose_output_differs_are_replaced_by_torch(monkeypatch, fresh_verdicts):
    def perturbed(block, *args):
        out, pieces = block(*args)
        return out * 1.001, pieces

    count_kernel_calls(monkeypatch, perturbed)
    assert_falls_back_once(inputs(), r"output differs from the torch block form by 0\.001 of its largest value "
                                     r"\(tolerance 0\.0001\)", fresh_verdicts)


def test_kernels_whose_gradient_differs_are_replaced_by_torch(monkeypatch, fresh_verdicts):
    backward = fused._FusedBlocks.backward

    def perturbed(ctx, d_out):
        dq, *rest = backward(ctx, d_out)
        return (dq * 1.01, *rest)

    monkeypatch.setattr(fused._FusedBlocks, "backward", staticmethod(perturbed))
    assert_falls_back_once(inputs(), r"d q differs from the torch block form by 0\.01\d* of its largest value "
                                     r"\(tolerance 0\.001\)", fresh_verdicts)


def test_kernels_that_pass_are_used_and_checked_once_per_dtype(monkeypatch, fresh_verdicts):
    """Decoding steps (inside the current block) run no check and no kernel; the first call
    past a block runs the check, then the kernels, without a warning; a second dtype is
    checked on its own."""
    calls = count_kernel_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linattn.vq_attention(*inputs(T=5), block_size=L)
        assert fresh_verdicts == [] and calls == []
        args = inputs()
        for _ in range(2):
            out, _ = linattn.vq_attention(*args, block_size=L)
        assert len(fresh_verdicts) == 1 and len(calls) == 1 + 2  # the check's, then both calls
        assert_close_rel(out.cpu(), torch_form([a.double() if a.is_floating_point() else a for a in args]).cpu(),
                         rtol=2e-5, name="out")
        linattn.vq_attention(*inputs(dtype=torch.bfloat16), block_size=L)
    assert [run[1] for run in fresh_verdicts] == [torch.float32, torch.bfloat16]
    assert selfcheck._verdicts == {(str(args[0].device), torch.float32): None,
                                   (str(args[0].device), torch.bfloat16): None}


def test_explicit_triton_raises_instead_of_falling_back(monkeypatch, fresh_verdicts):
    """``impl="triton"`` (asked for by name) runs the check too and raises on a failure, at
    every call, without checking again; ``impl="auto"`` then falls back with its one warning."""
    def broken(block, *args):
        raise RuntimeError("bad tile")

    count_kernel_calls(monkeypatch, broken)
    args = inputs()
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"failed their self-check .*RuntimeError: bad tile\. Use impl='torch'"):
            linattn.vq_attention(*args, block_size=L, impl="triton")
    assert_falls_back_once(args, "RuntimeError: bad tile", fresh_verdicts)


def test_the_environment_variable_forces_the_choice(monkeypatch, fresh_verdicts):
    calls = count_kernel_calls(monkeypatch)
    args = inputs()
    monkeypatch.setenv("LINATTN_VQ_IMPL", "cuda")
    with pytest.raises(ValueError,
                       match=r"LINATTN_VQ_IMPL must be 'torch' or 'triton' or 'native' \(or unset.*got 'cuda'"):
        linattn.vq_attention(*args, block_size=L)
    monkeypatch.setenv("LINATTN_VQ_IMPL", "torch")
    assert torch.equal(linattn.vq_attention(*args, block_size=L)[0], torch_form(args))
    assert calls == [] and fresh_verdicts == []
    linattn.vq_attention(*args, block_size=L, impl="triton")  # an explicit argument wins
    assert len(calls) == 2  # the check's call and this one

    selfcheck.reset()
    monkeypatch.setattr(triton_choice, "AUTO_DEVICE_TYPES", ())  # auto alone would take torch everywhere
    monkeypatch.setenv("LINATTN_VQ_IMPL", "triton")
    linattn.vq_attention(*args, block_size=L)
    assert len(calls) == 4
    assert torch.equal(linattn.vq_attention(*args, block_size=L, impl="torch")[0], torch_form(args))
    with pytest.raises(ValueError, match="LINATTN_VQ_IMPL=triton, but impl='triton' takes float32, bfloat16 or "
                                         "float16 inputs, got torch.float64; unset LINATTN_VQ_IMPL"):
        linattn.vq_attention(*[a.double() if a.is_floating_point() else a for a in args], block_size=L)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="LINATTN_VQ_IMPL=triton, but impl='triton' needs CUDA tensors"):
            linattn.vq_attention(*args, block_size=L)


def test_a_forced_triton_raises_when_the_check_fails(monkeypatch, fresh_verdicts):
    def broken(block, *args):
        raise RuntimeError("driver quirk")

    count_kernel_calls(monkeypatch, broken)
    monkeypatch.setenv("LINATTN_VQ_IMPL", "triton")
    with pytest.raises(RuntimeError, match="RuntimeError: driver quirk"):
        linattn.vq_attention(*inputs(), block_size=L)


def test_the_real_kernels_pass_their_check_within_its_tolerances():
    """The check itself, unpatched, on this device: the kernels pass in float32 and bfloat16,
    and the contrasting case, a float32 tolerance 100 times below the float32 rounding the
    kernels show, fails."""
    device = torch.device(DEVICE)
    assert selfcheck.verdict(device, torch.float32) is None
    assert selfcheck.verdict(device, torch.bfloat16) is None
    selfcheck.reset()
    tight = {torch.float32: 1e-9}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selfcheck, "OUT_RTOL", tight)
        assert "output differs" in selfcheck.verdict(device, torch.float32)


def test_choice_says_what_auto_takes_and_why(monkeypatch, fresh_verdicts):
    """``triton_choice.choice`` (what ``linattn doctor`` prints) follows the same rules, running the
    self-check where it would take the kernels."""
    device = torch.device(DEVICE)
    assert triton_choice.choice(device, torch.float32) == ("triton", "CUDA, triton imports, the self-check passed")
    # where the Triton kernels do not run: the native block form on a CPU, else torch
    assert triton_choice.choice(device, torch.float64)[0] == ("native" if device.type == "cpu" else "torch")
    monkeypatch.setattr(triton_choice, "AUTO_DEVICE_TYPES", ())
    assert triton_choice.choice(device, torch.float32) == (("native", (
        "compiled for this CPU and agrees with the torch form: hard codes, no ReRoPE, with gradients grad_scope "
        "'cache' or 'state'; torch for the others")) if device.type == "cpu" else (
        "torch", f"the kernels are taken automatically on CUDA only, this is {device.type}"))
    monkeypatch.setenv("LINATTN_VQ_IMPL", "torch")
    assert triton_choice.choice(device, torch.float32) == ("torch", "LINATTN_VQ_IMPL=torch")
    monkeypatch.setenv("LINATTN_VQ_IMPL", "triton")
    assert triton_choice.choice(device, torch.float64)[0] == "error"
    monkeypatch.setenv("LINATTN_VQ_IMPL", "gpu")
    assert triton_choice.choice(device, torch.float32)[0] == "error"
    monkeypatch.delenv("LINATTN_VQ_IMPL")
    monkeypatch.setattr(triton_choice, "AUTO_DEVICE_TYPES", ("cuda", "cpu"))
    selfcheck._verdicts[(str(device), torch.float32)] = "RuntimeError: boom"
    assert triton_choice.choice(device, torch.float32) == (
        "torch", "the kernels failed their self-check: RuntimeError: boom")
    assert len(fresh_verdicts) == 1
