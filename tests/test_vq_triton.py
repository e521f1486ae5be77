"""``vq_attention(impl="triton")``: the causal block form on the fused Triton kernels
(ops/vq/triton_kernels.py) against the float64 parallel reference and the float64 torch block form.

Without a GPU the kernels run on CPU tensors in the Triton interpreter: Triton chooses
at import, so tests/conftest.py sets ``TRITON_INTERPRET=1`` before any test module is
imported. With a CUDA device the same tests run the compiled kernels on it instead. The
last test builds the kernels for a CUDA target in a process that compiles instead of
interpreting.

Tolerances (float32 kernels vs float64): each output is a softmax-weighted mean of at most
``2L + S = 128`` values computed with float32 products and sums, so its error is a few
float32 roundings (eps = 1.2e-7) times that length at worst, ~1e-5 of the largest value;
gradients chain two such sums (dP, then dS against q or k), so ~1e-4. We check 2e-5 on
outputs and 2e-4 on gradients (observed: ~2e-7 and ~7e-7). bfloat16 inputs (eps 7.8e-3)
round the probabilities and dS to bfloat16 before each product: ~1e-2 observed, checked at
4e-2 (outputs) and 8e-2 (gradients) against the float64 reference on the same rounded inputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import pytest

import linattn
from linattn.ops.vq import fused
from _helpers import assert_close_rel
from test_vq_attention import gather_codes, make_bias, make_position_keys, make_vq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

F64, F32 = torch.float64, torch.float32
OUT_RTOL, GRAD_RTOL = 2e-5, 2e-4


def leaves_for(q, k_hat, v, codebook, bias, position_keys, dtype, separate_keys):
    """Inputs in ``dtype`` on DEVICE as leaves; k_hat either its own leaf (its gradient is
    the straight-through gradient of the keys) or gathered from the codebook leaf."""
    names = ["q", "v", "codebook"] + ["k_hat"] * separate_keys
    tensors = [q, v, codebook] + [k_hat] * separate_keys
    if bias is not None:
        names.append("bias")
        tensors.append(bias)
    if position_keys is not None:
        names.append("position_keys")
        tensors.append(position_keys)
    return {n: t.to(device=DEVICE, dtype=dtype).requires_grad_(True) for n, t in zip(names, tensors)}


def attend(leaves, codes, L, pieces=None, **kw):
    """Outputs over the sequence (in pieces that carry the state when ``pieces`` is given),
    the gradients of a fixed weighting of them w.r.t. every leaf, and the final state."""
    codes = codes.to(DEVICE)
    k_hat = leaves.get("k_hat")
    if k_hat is None:
        k_hat = gather_codes(leaves["codebook"], codes)
    q, v = leaves["q"], leaves["v"]
    T = q.shape[2]
    outs, state, start = [], None, 0
    for n in pieces or [T]:
        s = slice(start, start + n)
        out, state = linattn.vq_attention(q[:, :, s], k_hat[:, :, s], v[:, :, s], codes[:, :, s], leaves["codebook"],
                                          block_size=L, bias=leaves.get("bias"),
                                          position_keys=leaves.get("position_keys"), initial_state=state,
                                          output_final_state=kw.get("mode") != "parallel", **kw)
        outs.append(out)
        start += n
    out = torch.cat(outs, dim=2).to(F64)
    weights = torch.linspace(-1, 1, out.numel(), dtype=F64, device=DEVICE).reshape(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), list(leaves.values()))
    return out, dict(zip(leaves, grads)), state


def assert_same(actual, expected, out_rtol=OUT_RTOL, grad_rtol=GRAD_RTOL):
    assert_close_rel(actual[0].cpu(), expected[0].cpu(), rtol=out_rtol, name="out")
    for name, grad in expected[1].items():
        assert_close_rel(actual[1][name].cpu(), grad.cpu(), rtol=grad_rtol, name=f"d {name}")


def assert_same_state(actual, expected):
    for name in ("partial_keys", "partial_values", "partial_codes", "cache_counts", "cache_means", "prev_keys",
                 "prev_values", "prev_codes"):
        a, e = getattr(actual, name), getattr(expected, name)
        assert (a is None) == (e is None), name
        if a is not None:
            assert a.dtype == e.dtype or (a.dtype == F32 and e.dtype == F64), name
            assert_close_rel(a.cpu(), e.cpu(), rtol=OUT_RTOL, name=f"state {name}")
    assert actual.steps == expected.steps


# B, H, Hkv, T, D, S, L, relative terms
_SHAPES = [
    (1, 2, 1, 1, 16, 8, 16, "bias+positions"),  # inside one block: the torch decode form
    (2, 4, 2, 37, 16, 8, 16, "bias+positions"),
    (1, 2, 1, 128, 32, 64, 32, "positions"),
    (1, 4, 2, 128, 16, 64, 16, "none"),
    (1, 2, 1, 300, 16, 8, 32, "bias"),
]


@pytest.mark.parametrize("B,H,Hkv,T,D,S,L,relative", _SHAPES)
def test_outputs_and_gradients_equal_the_parallel_reference(B, H, Hkv, T, D, S, L, relative):
    """grad_scope="none": the block form's gradients are the reference's w.r.t. q, v, the
    codebook (keys gathered from it: window and cache both reach it), bias, position keys."""
    q, k_hat, v, codes, codebook = make_vq(B=B, H=H, Hkv=Hkv, T=T, Dk=D, Dv=D, S=S, seed=T + S)
    bias = make_bias(H, L) if "bias" in relative else None
    positions = make_position_keys(H, L, D) if "positions" in relative else None
    expected = attend(leaves_for(q, k_hat, v, codebook, bias, positions, F64, False), codes, L, mode="parallel")
    actual = attend(leaves_for(q, k_hat, v, codebook, bias, positions, F32, False), codes, L, impl="triton",
                    grad_scope="none")
    assert_same(actual, expected)


@pytest.mark.parametrize("scope", ["cache", "state"])
def test_grad_scopes_and_states_equal_the_torch_block_form(scope):
    """A carried state (first 21 positions, then 49; L = 16) and every gradient, the keys'
    straight-through gradient separately: as the float64 torch block form, which itself
    differs from the exact gradient here (so a kernel ignoring the scope would fail)."""
    H, L, D = 4, 16, 16
    q, k_hat, v, codes, codebook = make_vq(B=1, H=H, Hkv=2, T=70, Dk=D, Dv=D, S=8, seed=3)
    inputs = (q, k_hat, v, codebook, make_bias(H, L), make_position_keys(H, L, D))
    expected = attend(leaves_for(*inputs, F64, True), codes, L, pieces=[21, 49], impl="torch", grad_scope=scope)
    actual = attend(leaves_for(*inputs, F32, True), codes, L, pieces=[21, 49], impl="triton", grad_scope=scope)
    assert_same(actual, expected)
    assert_same_state(actual[2], expected[2])
    exact = attend(leaves_for(*inputs, F64, True), codes, L, pieces=[21, 49], impl="torch", grad_scope="none")
    assert (exact[1]["v"] - expected[1]["v"]).abs().max() > 1e-3


def test_states_carried_over_uneven_pieces_equal_one_reference_call():
    """Pieces of 5 (inside the first block: torch decode), 40 (a state with a partial block
    and no previous block) and 30 (with a previous block) on the kernels, the gradient
    flowing through the states (grad_scope="none"), against the reference over all 75."""
    H, L, D = 2, 16, 16
    q, k_hat, v, codes, codebook = make_vq(B=1, H=H, Hkv=1, T=75, Dk=D, Dv=D, S=8, seed=7)
    inputs = (q, k_hat, v, codebook, make_bias(H, L), None)
    expected = attend(leaves_for(*inputs, F64, False), codes, L, mode="parallel")
    actual = attend(leaves_for(*inputs, F32, False), codes, L, pieces=[5, 40, 30], impl="triton", grad_scope="none")
    assert_same(actual, expected)
    one_call = attend(leaves_for(*inputs, F64, False), codes, L, impl="torch", grad_scope="none")
    assert_same_state(actual[2], one_call[2])


def test_soft_codes_equal_the_torch_block_form():
    """Soft assignment weights: the cache's soft counts and means carry the gradient to the
    weights themselves (grad_scope="none"), through torch around the kernels."""
    H, L, D, S = 2, 16, 16, 8
    q, k_hat, v, _, codebook = make_vq(B=1, H=H, Hkv=1, T=45, Dk=D, Dv=D, S=S, seed=11)
    logits = torch.randn(1, 1, 45, S, generator=torch.Generator().manual_seed(12), dtype=F64)
    results = []
    for dtype, impl in ((F64, "torch"), (F32, "triton")):
        leaves = leaves_for(q, k_hat, v, codebook, make_bias(H, L), None, dtype, True)
        leaves["logits"] = logits.to(device=DEVICE, dtype=dtype).requires_grad_(True)
        codes = torch.softmax(leaves["logits"], dim=-1)
        out, _ = linattn.vq_attention(leaves["q"], leaves["k_hat"], leaves["v"], codes, leaves["codebook"],
                                      block_size=L, bias=leaves["bias"], impl=impl, grad_scope="none")
        weights = torch.linspace(-1, 1, out.numel(), dtype=F64, device=DEVICE).reshape(out.shape)
        grads = torch.autograd.grad((out.to(F64) * weights).sum(), list(leaves.values()))
        results.append((out.to(F64), dict(zip(leaves, grads))))
    assert_same(results[1], results[0])
    assert results[0][1]["logits"].abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_are_close_to_the_reference(dtype):
    """bfloat16 / float16 inputs, float32 accumulation, against the float64 reference on the
    same rounded inputs (outputs in the input dtype)."""
    H, L, D = 2, 16, 16
    q, k_hat, v, codes, codebook = make_vq(B=1, H=H, Hkv=1, T=40, Dk=D, Dv=D, S=8, seed=13)
    rounded = [t.to(dtype).to(F64) for t in (q, v, codebook, make_bias(H, L), make_position_keys(H, L, D))]
    q, v, codebook, bias, positions = rounded
    expected = attend(leaves_for(q, k_hat, v, codebook, bias, positions, F64, False), codes, L, mode="parallel")
    leaves = leaves_for(q, k_hat, v, codebook, bias, positions, dtype, False)
    actual = attend(leaves, codes, L, impl="triton", grad_scope="none")
    out, _ = linattn.vq_attention(leaves["q"], gather_codes(leaves["codebook"], codes.to(DEVICE)), leaves["v"],
                                  codes.to(DEVICE), leaves["codebook"], block_size=L, impl="triton")
    assert out.dtype == dtype
    assert_same(actual, expected, out_rtol=4e-2, grad_rtol=8e-2)


def test_gradients_do_not_depend_on_the_thread_count():
    q, k_hat, v, codes, codebook = make_vq(B=1, H=2, Hkv=1, T=40, Dk=16, Dv=16, S=8, seed=17)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            leaves = leaves_for(q, k_hat, v, codebook, make_bias(2, 16), None, F32, True)
            results.append(attend(leaves, codes, 16, impl="triton", grad_scope="none"))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0])
    for name in results[0][1]:
        assert torch.equal(results[0][1][name], results[1][1][name]), name


# ----------------------------------------------------------------------------- choosing the impl


def test_impl_is_checked_and_triton_refuses_what_it_cannot_run(monkeypatch):
    q, k_hat, v, codes, codebook = make_vq(B=1, H=2, Hkv=1, T=20, Dk=16, Dv=16, S=8)
    args = (q.float(), k_hat.float(), v.float(), codes, codebook.float())
    with pytest.raises(ValueError, match="impl"):
        linattn.vq_attention(*args, block_size=16, impl="cuda")
    with pytest.raises(ValueError, match="impl='triton'.*float64"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=16, impl="triton")
    with pytest.raises(ValueError, match="impl='triton'.*causal block form"):
        linattn.vq_attention(*args, block_size=16, impl="triton", mode="parallel")
    with pytest.raises(ValueError, match="impl='triton'.*causal block form"):
        linattn.vq_attention(*args, impl="triton", causal=False)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="impl='triton'.*TRITON_INTERPRET=1"):
            linattn.vq_attention(*args, block_size=16, impl="triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")

    def no_triton():
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(fused, "kernels", no_triton)
    with pytest.raises(ValueError, match="impl='triton' needs the triton package"):
        linattn.vq_attention(*[a.to(DEVICE) for a in args], block_size=16, impl="triton")


def test_auto_runs_triton_only_on_cuda(monkeypatch):
    """``impl="auto"`` on CPU tensors is the torch form even under the interpreter."""
    q, k_hat, v, codes, codebook = make_vq(B=1, H=2, Hkv=1, T=20, Dk=16, Dv=16, S=8)
    calls = []
    block = fused.block_form
    monkeypatch.setattr(fused, "block_form", lambda *a: calls.append(1) or block(*a))
    args = (q.float(), k_hat.float(), v.float(), codes, codebook.float())
    linattn.vq_attention(*args, block_size=16)
    assert calls == []
    on_device = [a.to(DEVICE) for a in args]
    linattn.vq_attention(*on_device, block_size=16, impl="triton")
    assert calls == [1]
    linattn.vq_attention(*on_device, block_size=16)
    assert calls == ([1, 1] if DEVICE == "cuda" else [1])


def test_several_tiles_per_block_and_ragged_sizes(monkeypatch):
    """Tiles of 16 on L = 24, S = 40, Dk = 20, Dv = 12 (none a multiple of the tile: the
    causal and ragged edges of every kernel loop), with a carried state, against the reference."""
    from linattn.ops.vq import triton_kernels as kernels

    monkeypatch.setattr(kernels, "_MOST_ROWS", 16)
    H, L, D = 2, 24, 20
    q, k_hat, v, codes, codebook = make_vq(B=1, H=H, Hkv=1, T=90, Dk=D, Dv=12, S=40, unused=5, seed=19)
    inputs = (q, k_hat, v, codebook, make_bias(H, L), make_position_keys(H, L, D))
    expected = attend(leaves_for(*inputs, F64, False), codes, L, mode="parallel")
    actual = attend(leaves_for(*inputs, F32, False), codes, L, pieces=[30, 60], impl="triton", grad_scope="none")
    assert_same(actual, expected)


def test_kernels_build_for_a_cuda_target():
    """The interpreter runs Python, not the compiler: every kernel and switch combination
    (float32 and bfloat16) also goes through Triton's front end for sm_90, in a process that
    compiles instead of interpreting (tools/compile_vq_kernels.py; without --front-end it
    compiles to machine code and checks shared memory, minutes on this CPU)."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(root / "src"), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, str(root / "tools" / "compile_vq_kernels.py"), "--front-end", "--dtypes",
                           "float32", "bfloat16"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "built the Triton IR of 44 kernel variants" in done.stdout
