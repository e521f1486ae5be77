"""The native chunk form of the delta rule and the gated delta rule (``ops/delta/native_chunk.py``,
``_native/delta_scan.cpp``, without gradients): equal in float64 to the recurrence written out in
``test_gated_delta.py`` (outputs and final memories) without decay, with one decay per step and
with one per key channel, on awkward shapes (T = 1, T not a multiple of the chunk, chunks longer
than the substitution's blocks, Hkv < H, batch > 1, carried memories, widths that reach every path
of the tile products), with strong decays and resets; causal; the same bits at 1 and 2 threads; a
call that records gradients runs the torch forms; ``impl`` and ``LINATTN_DELTA_IMPL`` fail loudly;
the self-check catches a kernel that is off. ``tests/test_delta_rule.py`` and
``tests/test_gated_delta.py`` run every one of their tests with the kernel (``impl="auto"``) and
with the torch forms."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from _helpers import F64, assert_close_rel
from linattn import DeltaRuleState, delta_rule
from linattn.nn import DeltaNet, GatedDeltaNet
from linattn.ops.common import native
from linattn.ops.delta import native_chunk
from test_gated_delta import SETTINGS, loop, make_inputs, memory, run

DECAYS = (None, "step", "channel")


@pytest.fixture(autouse=True)
def auto_choice(monkeypatch):
    monkeypatch.delenv(native_chunk.ENV, raising=False)


@pytest.fixture
def fresh_verdicts(monkeypatch):
    """Forget the process's verdicts for the test, and restore them after it."""
    monkeypatch.setattr(native_chunk._trust, "verdicts", {})
    monkeypatch.setattr(native_chunk._trust, "warned", set())


@pytest.fixture
def kernel_calls(monkeypatch):
    """The decay kind (None, "step", "channel") of every call of the kernel, so a test knows it
    ran; the self-checks run before, so their calls are not counted."""
    assert native_chunk.verdict(torch.float64) is None and native_chunk.verdict(torch.float32) is None
    calls = []
    chunk = native_chunk.chunk

    def spy(q, k, v, beta, g, *args):
        calls.append(None if g is None else ("step" if g.dim() == 2 else "channel"))
        return chunk(q, k, v, beta, g, *args)

    monkeypatch.setattr(native_chunk, "chunk", spy)
    return calls


def decays(decay, B, Hkv, T, F, *, low=-2.0, seed=3, resets=()):
    """Log decays of kind ``decay`` (None: none) in [low, 0), -inf at the positions ``resets``."""
    if decay is None:
        return None
    gen = torch.Generator().manual_seed(seed)
    g = low * torch.rand((B, Hkv, T) + ((F,) if decay == "channel" else ()), generator=gen, dtype=F64)
    for t in resets:
        g[:, :, t] = -math.inf
    return g


def reference(q, k, v, beta, g, fmap, normalize, S0=None):
    """``loop`` of ``test_gated_delta.py``; without decay, g = 0 (no decay)."""
    if g is None:
        g = torch.zeros(k.shape[:3], dtype=F64)
    return loop(q, k, v, beta, g, fmap, normalize, S0)


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("shape", [
    dict(B=1, H=1, Hkv=1, T=1), dict(B=2, H=4, Hkv=2, T=37), dict(B=1, H=3, Hkv=1, T=8), dict(B=2, H=2, Hkv=2, T=50),
], ids=["T1", "gqa-ragged", "gqa3-exact", "batch2-long"])
@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried"])
def test_equals_the_recurrence(decay, setting, shape, carried, kernel_calls):
    fmap, normalize, F = SETTINGS[setting]
    q, k, v, beta, _ = make_inputs(**shape)
    B, Hkv, T = shape["B"], shape["Hkv"], shape["T"]
    g = decays(decay, B, Hkv, T, F, resets=(T // 2,) if T > 2 else ())
    S0 = memory(F, B=B, Hkv=Hkv) if carried else None
    want_out, want_S = reference(q, k, v, beta, g, fmap, normalize, S0)
    out, state = run(q, k, v, beta, g, S0, feature_map=fmap, normalize=normalize, mode="chunk", chunk_size=8)
    assert kernel_calls == [decay]
    assert_close_rel(out, want_out, rtol=1e-11)
    assert_close_rel(state.memory, want_S, rtol=1e-11)
    assert state.steps == (3 if carried else 0) + T


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("chunk_size", [16, 33, 64])
def test_wide_equals_the_recurrence(decay, chunk_size, kernel_calls):
    """Widths past the tile products' vectors (Dk 40, Dv 21) and chunks past the substitution's
    blocks of 16 rows."""
    q, k, v, beta, _ = make_inputs(B=1, H=2, Hkv=1, T=70, Dk=40, Dv=21, seed=4)
    g = decays(decay, 1, 1, 70, 40, low=-0.3, resets=(45,))
    S0 = memory(40, B=1, Hkv=1, Dv=21)
    want_out, want_S = reference(q, k, v, beta, g, "identity", "l2", S0)
    out, state = run(q, k, v, beta, g, S0, mode="chunk", chunk_size=chunk_size)
    assert kernel_calls == [decay]
    assert_close_rel(out, want_out, rtol=1e-10)
    assert_close_rel(state.memory, want_S, rtol=1e-10)


@pytest.mark.parametrize("decay", ("step", "channel"))
@pytest.mark.parametrize("low", [0.0, -60.0], ids=["no-decay", "strong"])
def test_decays_at_their_edges(decay, low, kernel_calls):
    """g = 0 (the plain delta rule) and decays of -60 (factors of 1e-26) stay exact."""
    q, k, v, beta, _ = make_inputs(T=29)
    g = decays(decay, 2, 2, 29, 4, low=low)
    want_out, want_S = reference(q, k, v, beta, g, "identity", "l2", memory(4))
    out, state = run(q, k, v, beta, g, memory(4), mode="chunk", chunk_size=8)
    assert kernel_calls == [decay]
    assert_close_rel(out, want_out, rtol=1e-11)
    assert_close_rel(state.memory, want_S, rtol=1e-11)


@pytest.mark.parametrize("decay", DECAYS)
def test_a_call_split_in_two_continues_the_memory(decay, kernel_calls):
    q, k, v, beta, _ = make_inputs(T=30)
    g = decays(decay, 2, 2, 30, 4)
    whole, whole_state = run(q, k, v, beta, g, mode="chunk", chunk_size=8)
    cut = 13
    first, state = run(*(t[:, :, :cut] for t in (q, k, v, beta)), None if g is None else g[:, :, :cut],
                       mode="chunk", chunk_size=8)
    second, last = delta_rule(*(t[:, :, cut:] for t in (q, k, v, beta)), g=None if g is None else g[:, :, cut:],
                              initial_state=state, output_final_state=True, mode="chunk", chunk_size=8)
    assert len(kernel_calls) == 3
    assert_close_rel(torch.cat([first, second], 2), whole, rtol=1e-12)
    assert_close_rel(last.memory, whole_state.memory, rtol=1e-12)


@pytest.mark.parametrize("decay", DECAYS)
def test_causal(decay, kernel_calls):
    """Changing every input from position p on leaves the outputs before p bit for bit."""
    q, k, v, beta, _ = make_inputs(T=40)
    g = decays(decay, 2, 2, 40, 4)
    out, _ = run(q, k, v, beta, g, mode="chunk", chunk_size=16)
    p = 21
    changed = [t.clone() for t in (q, k, v, beta)]
    for t in changed:
        t[:, :, p:] = t[:, :, p:].flip(2) * 0.5
    g2 = None if g is None else g.clone()
    if g2 is not None:
        g2[:, :, p:] = -1.5
    out2, _ = run(*changed, g2, mode="chunk", chunk_size=16)
    assert torch.equal(out[:, :, :p], out2[:, :, :p])
    assert not torch.equal(out[:, :, p:], out2[:, :, p:])


@pytest.mark.parametrize("decay", DECAYS)
def test_thread_count_does_not_change_a_bit(decay, kernel_calls):
    q, k, v, beta, _ = make_inputs(B=2, H=4, Hkv=2, T=150, Dk=32, Dv=24)
    g = decays(decay, 2, 2, 150, 32, low=-0.2)
    inputs = [t.float() for t in (q, k, v, beta)] + [None if g is None else g.float()]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(run(*inputs, mode="chunk"))
    finally:
        torch.set_num_threads(before)
    (out1, state1), (out2, state2) = results
    assert torch.equal(out1, out2) and torch.equal(state1.memory, state2.memory)


@pytest.mark.parametrize("decay", DECAYS)
def test_float32_matches_float64(decay, kernel_calls):
    q, k, v, beta, _ = make_inputs(T=90, Dk=16, Dv=16)
    g = decays(decay, 2, 2, 90, 16, low=-0.5)
    want, want_state = run(q, k, v, beta, g, mode="chunk")
    got, state = run(*(t.float() for t in (q, k, v, beta)), None if g is None else g.float(), mode="chunk")
    assert got.dtype == torch.float32
    assert_close_rel(got.double(), want, rtol=2e-5)
    assert_close_rel(state.memory.double(), want_state.memory, rtol=2e-5)


@pytest.mark.parametrize("decay", DECAYS)
def test_a_call_with_gradients_runs_the_torch_form(decay, kernel_calls):
    q, k, v, beta, _ = make_inputs(T=19)
    g = decays(decay, 2, 2, 19, 4)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, beta)]
    out, _ = run(*leaves, g, mode="chunk", chunk_size=8)
    assert kernel_calls == []
    out.sum().backward()
    assert all(t.grad is not None for t in leaves)
    with torch.no_grad():
        run(*leaves, g, mode="chunk", chunk_size=8)
    assert kernel_calls == [decay]


def test_layers_in_evaluation_take_the_kernel(kernel_calls, monkeypatch):
    """DeltaNet and GatedDeltaNet under torch.no_grad run the kernel, and equal their torch forms."""
    torch.manual_seed(0)
    x = torch.randn(2, 45, 32, dtype=F64)
    for layer in (DeltaNet(32, 2).double(), GatedDeltaNet(32, 2).double()):
        with torch.no_grad():
            got = layer(x)[0]
            monkeypatch.setenv(native_chunk.ENV, "torch")
            want = layer(x)[0]
            monkeypatch.delenv(native_chunk.ENV)
        assert_close_rel(got, want, rtol=1e-11)
    assert len(kernel_calls) == 2


def test_impl_native_refuses_what_it_does_not_compute(monkeypatch):
    q, k, v, beta, g = make_inputs(T=6)
    with pytest.raises(ValueError, match="impl='native': the native delta rule computes mode='chunk', got "
                                         "mode='recurrent'"):
        delta_rule(q, k, v, beta, mode="recurrent", impl="native")
    with pytest.raises(ValueError, match="computes the chunk form without gradients"):
        delta_rule(q.clone().requires_grad_(True), k, v, beta, g=g, impl="native")
    with pytest.raises(ValueError, match="impl must be one of"):
        delta_rule(q, k, v, beta, impl="fast")
    monkeypatch.setenv(native_chunk.ENV, "native")
    with pytest.raises(ValueError, match="LINATTN_DELTA_IMPL=native: the native delta rule computes"):
        delta_rule(q, k, v, beta, mode="recurrent")
    monkeypatch.setenv(native_chunk.ENV, "fast")
    with pytest.raises(ValueError, match="LINATTN_DELTA_IMPL"):
        delta_rule(q, k, v, beta)


def test_auto_takes_the_kernel_and_the_variable_the_torch_form(monkeypatch, kernel_calls):
    q, k, v, beta, g = make_inputs(T=9)
    delta_rule(q, k, v, beta, g=g)
    delta_rule(q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1], impl="native")  # T = 1: the chunk form
    assert kernel_calls == ["step", None]
    monkeypatch.setenv(native_chunk.ENV, "torch")
    delta_rule(q, k, v, beta, g=g)
    delta_rule(q, k, v, beta, g=g, impl="native")  # the variable replaces only "auto"
    assert kernel_calls == ["step", None, "step"]


class _Off:
    """The compiled module with the output of ``delta_scan_forward`` nudged: a kernel that is wrong."""

    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        function = getattr(self.module, name)
        if name != "delta_scan_forward":
            return function

        def nudged(*args):
            function(*args)
            args[-2].add_(1e-6)  # out

        return nudged


def test_a_kernel_that_differs_is_caught_by_the_self_check(fresh_verdicts, monkeypatch):
    q, k, v, beta, g = make_inputs(T=6)
    expected, _ = delta_rule(q, k, v, beta, g=g, impl="torch")
    monkeypatch.setattr(native, "extension", lambda module=native.extension(): _Off(module))
    with pytest.warns(RuntimeWarning, match=r"native delta rule failed in torch.float64: output 0: differs"):
        out, _ = delta_rule(q, k, v, beta, g=g)
    assert torch.equal(out, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per dtype
        delta_rule(q, k, v, beta, g=g)
    with pytest.raises(RuntimeError, match="output 0: differs"):
        delta_rule(q, k, v, beta, g=g, impl="native")


def test_the_self_check_passes_in_both_dtypes(fresh_verdicts):
    assert native_chunk.verdict(torch.float64) is None
    assert native_chunk.verdict(torch.float32) is None


def test_the_kernel_checks_its_arguments():
    ext = native.extension()
    q, k, v = torch.rand(2, 1, 5, 3), torch.rand(2, 5, 3), torch.randn(2, 5, 4)
    beta, g, S = torch.rand(2, 5), -torch.rand(2, 5, 1), torch.zeros(2, 3, 4)
    out, final = torch.empty(2, 1, 5, 4), torch.empty_like(S)
    ext.delta_scan_forward(q, k, v, beta, g, S, 2, 1.0, out, final)
    ext.delta_scan_forward(q, k, v, beta, None, S, 2, 1.0, out, final)
    with pytest.raises(RuntimeError, match=r"k has shape \[2, 4, 3\], expected \[2, 5, 3\]"):
        ext.delta_scan_forward(q, k[:, :4], v, beta, g, S, 2, 1.0, out, final)
    with pytest.raises(RuntimeError, match=r"beta has shape \[2, 4\], expected \[2, 5\]"):
        ext.delta_scan_forward(q, k, v, beta[:, :4], g, S, 2, 1.0, out, final)
    with pytest.raises(RuntimeError, match=r"g must be \[N, T, 1\] or \[N, T, 3\], got \[2, 5, 2\]"):
        ext.delta_scan_forward(q, k, v, beta, g.expand(2, 5, 2), S, 2, 1.0, out, final)
    with pytest.raises(RuntimeError, match="out must be a contiguous CPU tensor of Float, got Double"):
        ext.delta_scan_forward(q, k, v, beta, g, S, 2, 1.0, out.double(), final)
    with pytest.raises(RuntimeError, match=r"memory has shape \[2, 4, 3\], expected \[2, 3, 4\]"):
        ext.delta_scan_forward(q, k, v, beta, g, S.transpose(1, 2), 2, 1.0, out, final)
    with pytest.raises(RuntimeError, match="chunk 0 < 1"):
        ext.delta_scan_forward(q, k, v, beta, g, S, 0, 1.0, out, final)


def test_a_state_from_the_kernel_decodes_on():
    """Prefill by the kernel, then the recurrent step continues as the recurrence does."""
    q, k, v, beta, g = make_inputs(T=20)
    with torch.no_grad():
        _, state = run(q[:, :, :19], k[:, :, :19], v[:, :, :19], beta[:, :, :19], g[:, :, :19], mode="chunk")
        step, _ = delta_rule(q[:, :, 19:], k[:, :, 19:], v[:, :, 19:], beta[:, :, 19:], g=g[:, :, 19:],
                             initial_state=state)
    want, _ = reference(q, k, v, beta, g, "identity", "l2")
    assert isinstance(state, DeltaRuleState)
    assert_close_rel(step, want[:, :, 19:], rtol=1e-11)
