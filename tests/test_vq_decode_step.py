"""``vq_decode_step``: one decoding step from a raw key (quantize, then attend) equals
``VectorQuantizer`` followed by ``vq_attention``: the same codes, the quadratic reference's
outputs and the block form's final state in float64, across block boundaries, with
relative bias and position keys, GQA, batch > 1, in float32 (queries and key in one matmul)
and float64; after the codebook changed under a state; for branched states; with clear
errors for what does not fit. Every test runs both forms of the step: the torch form and
the native C++ one (``LINATTN_VQ_STEP_IMPL``; ``tests/test_vq_native.py`` for its build,
self-check and fallback)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import linattn
from _helpers import F64, assert_close_rel
from test_vq_attention import make_bias, make_position_keys

L = 4


@pytest.fixture(autouse=True, params=["torch", "native"])
def step_impl(request, monkeypatch):
    monkeypatch.setenv("LINATTN_VQ_STEP_IMPL", request.param)
    return request.param


def _problem(B, H, Hkv, T, dtype=F64, D=5, E=3, S=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, T, D, generator=g, dtype=dtype), torch.randn(B, Hkv, T, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, T, E, generator=g, dtype=dtype)
    quantizer = linattn.VectorQuantizer(Hkv, D, S).eval()
    with torch.no_grad():
        quantizer.codebook.copy_(torch.randn(Hkv, S, D, generator=g))
    return q, k, v, quantizer


def _relative(kind, H, D=5):
    return {} if kind == "none" else dict(bias=make_bias(H, L), position_keys=make_position_keys(H, L, D))


def _steps(q, k, v, codebook, start, state, **kw):
    outs, codes = [], []
    for t in range(start, q.shape[2]):
        out, code, state = linattn.vq_decode_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], codebook,
                                                  state, block_size=L, **kw)
        outs.append(out)
        codes.append(code)
    return torch.cat(outs, 2), torch.cat(codes, 2), state


def _state_fields(state):
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.init}


@pytest.mark.parametrize("relative", ["none", "bias+position-keys"])
@pytest.mark.parametrize("B,H,Hkv", [(1, 2, 2), (2, 4, 2), (2, 3, 1)])
@pytest.mark.parametrize("prompt", [0, 1, 4, 6])
def test_steps_equal_quantizer_then_reference(relative, B, H, Hkv, prompt):
    T = prompt + 11  # crosses two block boundaries after the prompt
    q, k, v, quantizer = _problem(B, H, Hkv, T)
    codebook = quantizer.codebook.to(F64)
    kw = _relative(relative, H)
    with torch.no_grad():
        k_hat, codes, _ = quantizer(k)
        expected, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, mode="parallel", **kw)
        _, expected_state = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, output_final_state=True,
                                                 **kw)
        state = None
        if prompt:
            _, state = linattn.vq_attention(q[:, :, :prompt], k_hat[:, :, :prompt], v[:, :, :prompt],
                                            codes[:, :, :prompt], codebook, block_size=L, output_final_state=True, **kw)
        out, step_codes, state = _steps(q, k, v, codebook, prompt, state, **kw)
    assert torch.equal(step_codes, codes[:, :, prompt:])
    assert out.dtype == F64 and out.shape == (B, H, T - prompt, 3)
    assert_close_rel(out, expected[:, :, prompt:], 1e-12, "out")
    assert state.steps == T
    for name, value in _state_fields(expected_state).items():
        got = getattr(state, name)
        if isinstance(value, torch.Tensor) and value.numel() == 0:
            assert got.shape == value.shape, name
        elif isinstance(value, torch.Tensor):
            assert_close_rel(got.to(value.dtype), value, 1e-12, name)
        else:
            assert got == value, name


@pytest.mark.parametrize("B,H,Hkv", [(1, 2, 2), (2, 4, 2), (1, 3, 1)])
def test_float32_equals_float64_and_the_quantizer(B, H, Hkv):
    """In float32 the queries and the key share one matmul (its own layout for B = 1)."""
    q, k, v, quantizer = _problem(B, H, Hkv, 13, dtype=torch.float32, D=16, S=32)
    kw = _relative("both", H, 16)
    kw32 = {name: t.float() for name, t in kw.items()}
    with torch.no_grad():
        _, codes, _ = quantizer(k)
        out32, codes32, _ = _steps(q, k, v, quantizer.codebook, 0, None, **kw32)
        out64, codes64, _ = _steps(q.double(), k.double(), v.double(), quantizer.codebook.double(), 0, None, **kw)
    assert torch.equal(codes32, codes) and torch.equal(codes64, codes)
    assert out32.dtype == torch.float32
    assert_close_rel(out32.double(), out64, 1e-5, "float32 out")


def test_continues_and_is_continued_by_vq_attention():
    """States pass both ways: steps of vq_decode_step, then vq_attention over several
    positions, then steps again, equal the reference throughout."""
    q, k, v, quantizer = _problem(2, 4, 2, 17)
    codebook = quantizer.codebook.to(F64)
    with torch.no_grad():
        k_hat, codes, _ = quantizer(k)
        expected, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, mode="parallel")
        first, _, state = _steps(q[:, :, :6], k[:, :, :6], v[:, :, :6], codebook, 0, None)
        middle, state = linattn.vq_attention(q[:, :, 6:11], k_hat[:, :, 6:11], v[:, :, 6:11], codes[:, :, 6:11],
                                             codebook, block_size=L, initial_state=state, output_final_state=True)
        last, _, _ = _steps(q, k, v, codebook, 11, state)
    assert_close_rel(torch.cat([first, middle, last], 2), expected, 1e-12, "out")


def test_a_changed_codebook_reads_the_state_keys():
    """The window's keys were quantized with the codebook of their time: after the codebook
    changes, a step scores them as stored (as vq_attention does), not as today's codes."""
    q, k, v, quantizer = _problem(1, 2, 2, 9)
    codebook = quantizer.codebook.to(F64)
    with torch.no_grad():
        _, _, state = _steps(q[:, :, :6], k[:, :, :6], v[:, :, :6], codebook, 0, None)
        codebook.mul_(0.8)
        out, code, _ = linattn.vq_decode_step(q[:, :, 6:7], k[:, :, 6:7], v[:, :, 6:7], codebook, state, block_size=L)
        k_hat = codebook[torch.arange(2)[None, :, None], code]
        expected, _ = linattn.vq_attention(q[:, :, 6:7], k_hat, v[:, :, 6:7], code, codebook, block_size=L,
                                           initial_state=state)
    assert_close_rel(out, expected, 1e-12, "out")


def test_branches_of_one_state_are_independent():
    q, k, v, quantizer = _problem(1, 2, 2, 8)
    codebook = quantizer.codebook.to(F64)
    with torch.no_grad():
        _, _, state = _steps(q[:, :, :5], k[:, :, :5], v[:, :, :5], codebook, 0, None)
        snapshot = {name: t.clone() for name, t in _state_fields(state).items() if isinstance(t, torch.Tensor)}
        one, _, _ = _steps(q, k, v, codebook, 5, state)
        other, _, _ = _steps(q.flip(2), k.flip(2), v.flip(2), codebook, 5, state)
        again, _, _ = _steps(q, k, v, codebook, 5, state)
    assert torch.equal(one, again)
    assert not torch.equal(one, other)
    for name, value in snapshot.items():
        assert torch.equal(getattr(state, name), value), name


def test_does_not_depend_on_the_thread_count():
    q, k, v, quantizer = _problem(2, 4, 2, 10, dtype=torch.float32, D=16, S=32)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            with torch.no_grad():
                results.append(_steps(q, k, v, quantizer.codebook, 0, None)[0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


def test_errors_name_the_argument():
    q, k, v, quantizer = _problem(1, 2, 2, 3)
    codebook = quantizer.codebook.to(F64)
    step = linattn.vq_decode_step
    with torch.no_grad():
        with pytest.raises(ValueError, match="q has 3 positions"):
            step(q, k, v, codebook)
        with pytest.raises(ValueError, match=r"codebook has shape \[2, 7, 4\]"):
            step(q[:, :, :1], k[:, :, :1], v[:, :, :1], codebook[..., :4])
        with pytest.raises(TypeError, match="codebook has dtype"):
            step(q[:, :, :1], k[:, :, :1], v[:, :, :1], codebook.float())
        _, _, state = step(q[:, :, :1], k[:, :, :1], v[:, :, :1], codebook, block_size=L)
        with pytest.raises(ValueError, match="block_size"):
            step(q[:, :, 1:2], k[:, :, 1:2], v[:, :, 1:2], codebook, state, block_size=L + 1)
        soft = dataclasses.replace(state, partial_codes=torch.rand(1, 2, 1, 7, dtype=F64))
        with pytest.raises(ValueError, match="partial_codes"):
            step(q[:, :, 1:2], k[:, :, 1:2], v[:, :, 1:2], codebook, soft, block_size=L)
    with pytest.raises(ValueError, match="no backward"):
        step(q[:, :, :1].requires_grad_(), k[:, :, :1], v[:, :, :1], codebook, block_size=L)


def test_a_rebuilt_state_is_read_as_stored():
    """A state rebuilt by hand (``dataclasses.replace``: here with keys that are no code) is
    not known to hold codes, so its keys are read as stored, as vq_attention reads them."""
    q, k, v, quantizer = _problem(2, 4, 2, 9)
    codebook = quantizer.codebook.to(F64)
    with torch.no_grad():
        _, _, state = _steps(q[:, :, :6], k[:, :, :6], v[:, :, :6], codebook, 0, None)
        state = dataclasses.replace(state, prev_keys=state.prev_keys + 0.25, partial_keys=state.partial_keys - 0.5)
        out, code, _ = linattn.vq_decode_step(q[:, :, 6:7], k[:, :, 6:7], v[:, :, 6:7], codebook, state, block_size=L)
        k_hat = codebook[torch.arange(2)[None, :, None], code]
        expected, _ = linattn.vq_attention(q[:, :, 6:7], k_hat, v[:, :, 6:7], code, codebook, block_size=L,
                                           initial_state=state, check_inputs=False)
    assert_close_rel(out, expected, 1e-12, "out")
