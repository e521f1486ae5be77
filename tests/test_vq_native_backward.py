"""The gradients of the native block form (``ops/vq/native_block.py``,
``_native/vq_block_backward.cpp``): float64 equality with both torch schedules of the block
form for grad_scope "cache" and "state" on awkward shapes and carried states, torch's
numerical gradients where the scope stops nothing, causality, the same bits at 1 and 2
threads, what it refuses, and its self-check made to fail."""

from __future__ import annotations

import pytest
import torch

import linattn
from linattn.ops.vq import native_block, native_block_check

from test_vq_native_block import SHAPES, at_one_and_two_threads, counted_calls, make_vq

F64 = torch.float64


def _relative(H, L, Dk, kind, seed=5, dtype=F64):
    """``bias`` / ``position_keys`` options, leaves with gradients: per head, shared, or none."""
    g = torch.Generator().manual_seed(seed)
    heads = () if kind == "shared" else (H,)
    options = {}
    if kind in ("bias", "both", "shared"):
        options["bias"] = torch.randn(*heads, L + 1, generator=g, dtype=F64).to(dtype).requires_grad_()
    if kind in ("positions", "both", "shared"):
        options["position_keys"] = (0.5 * torch.randn(*heads, L + 1, Dk, generator=g, dtype=F64)).to(
            dtype).requires_grad_()
    return options


def _gradients(args, L, impl, options, scope, sizes=None, schedule="auto", seed=9):
    """Outputs and the gradients of a weighted sum of them w.r.t. q, k_hat, v, the codebook and
    the relative leaves, the sequence cut into calls of ``sizes`` carrying the state."""
    q, k_hat, v, codes, codebook = (t.detach().clone() for t in args)
    leaves = [q.requires_grad_(), k_hat.requires_grad_(), v.requires_grad_(), codebook.requires_grad_()]
    leaves += [options[name] for name in ("bias", "position_keys") if name in options]
    sizes = sizes or [q.shape[2]]
    state, outs = None, []
    pieces = zip(*(t.split(sizes, dim=2) for t in (q, k_hat, v, codes)))
    for q_i, k_i, v_i, codes_i in pieces:
        out, state = linattn.vq_attention(q_i, k_i, v_i, codes_i, codebook, block_size=L, impl=impl,
                                          schedule=schedule, grad_scope=scope, initial_state=state,
                                          output_final_state=True, **options)
        outs.append(out)
    out = torch.cat(outs, dim=2)
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    return out.detach(), grads


def _counted(monkeypatch):
    """Forward calls of the native kernels with gradients, recorded (after the self-check's)."""
    return counted_calls(monkeypatch, native_block._NativeBlocks, "apply")


@pytest.mark.parametrize("B, H, Hkv, T, L, S", SHAPES)
@pytest.mark.parametrize("relative", ["none", "both", "shared"])
@pytest.mark.parametrize("scope", ["cache", "state"])
def test_gradients_equal_both_torch_schedules_in_float64(monkeypatch, segment_blocks, B, H, Hkv, T, L, S, relative,
                                                        scope):
    calls = _counted(monkeypatch)
    args = make_vq(B=B, H=H, Hkv=Hkv, T=T, S=S)
    out, grads = _gradients(args, L, "native", _relative(H, L, 4, relative), scope)
    assert calls == [1]
    for schedule in ("loop", "batched"):
        want_out, want = _gradients(args, L, "torch", _relative(H, L, 4, relative), scope, schedule=schedule)
        torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
        for got, expected in zip(grads, want):
            torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("relative", ["bias", "positions"])
def test_one_kind_of_relative_term_alone(relative):
    args = make_vq(B=2, H=4, Hkv=2, T=19, S=8)
    _, grads = _gradients(args, 4, "native", _relative(4, 4, 4, relative), "cache")
    _, want = _gradients(args, 4, "torch", _relative(4, 4, 4, relative), "cache", schedule="loop")
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("sizes", [(3, 9, 1, 10), (8, 8, 7), (1, 1, 21), (5, 16, 2)])
@pytest.mark.parametrize("scope", ["cache", "state"])
def test_gradients_through_carried_states(segment_blocks, sizes, scope):
    """The sequence in several calls, each continuing the last one's state: the gradients reach
    every call's inputs as the torch form sends them (the carried previous block included)."""
    args = make_vq(B=2, H=4, Hkv=2, T=sum(sizes), S=8)
    out, grads = _gradients(args, 4, "native", _relative(4, 4, 4, "both"), scope, sizes=list(sizes))
    want_out, want = _gradients(args, 4, "torch", _relative(4, 4, 4, "both"), scope, sizes=list(sizes),
                                schedule="loop")
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-12)


def test_numerical_gradients_where_the_cache_stops_nothing():
    """torch's finite differences (``gradcheck``) for everything that reaches the output only
    through the scores: q, the window's keys, the codebook (the cache's logits), the bias
    table and the position keys. The values are held fixed: grad_scope "cache" stops their
    path through the cache on purpose."""
    q, k_hat, v, codes, codebook = make_vq(B=2, H=4, Hkv=2, T=13, S=8)
    options = _relative(4, 4, 4, "both")
    bias, keys = options["bias"], options["position_keys"]

    def attend(q_, k_, codebook_, bias_, keys_):
        return linattn.vq_attention(q_, k_, v, codes, codebook_, block_size=4, bias=bias_, position_keys=keys_,
                                    impl="native", check_inputs=False)[0]

    inputs = tuple(t.detach().clone().requires_grad_() for t in (q, k_hat, codebook, bias, keys))
    assert torch.autograd.gradcheck(attend, inputs, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_causal_no_gradient_reaches_the_past_from_the_future():
    args = make_vq(B=1, H=2, Hkv=1, T=23, S=8)
    q, k_hat, v, codes, codebook = (t.detach().clone() for t in args)
    leaves = [q.requires_grad_(), k_hat.requires_grad_(), v.requires_grad_()]
    out, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, impl="native")
    t = 10
    grads = torch.autograd.grad(out[:, :, :t].sum(), leaves)
    for grad in grads:
        assert bool((grad[:, :, t:] == 0).all())
        assert bool((grad[:, :, :t] != 0).any())


def test_the_thread_count_does_not_change_a_bit(segment_blocks):
    args = make_vq(B=2, H=4, Hkv=4, T=70, Dk=8, Dv=8, S=16, dtype=torch.float32)
    (out_one, one), (out_two, two) = at_one_and_two_threads(
        lambda: _gradients(args, 8, "native", _relative(4, 8, 8, "shared", dtype=torch.float32), "cache"))
    assert torch.equal(out_one, out_two)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_segments_change_only_the_order_of_the_partial_sums(monkeypatch):
    """Cut into segments, a row's query, key and value gradients are the same bits (each
    position's terms are added in the same order); the codebook's, bias's and position keys'
    are sums of per-segment partial sums, equal to rounding."""
    args = make_vq(B=1, H=2, Hkv=1, T=45, Dk=8, Dv=8, S=16, dtype=torch.float32)
    results = []
    for blocks in (1, 3, 32):
        monkeypatch.setattr(native_block, "SEGMENT_BLOCKS", blocks)
        results.append(_gradients(args, 4, "native", _relative(2, 4, 8, "both", dtype=torch.float32), "cache"))
    (out, first), rest = results[0], results[1:]
    for other_out, other in rest:
        assert torch.equal(other_out, out)
        for a, b in zip(first[:3], other[:3]):
            assert torch.equal(a, b)
        for a, b in zip(first[3:], other[3:]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_float32_agrees_with_the_torch_form():
    args = make_vq(B=2, H=4, Hkv=2, T=50, Dk=8, Dv=8, S=16, dtype=torch.float32)
    options = _relative(4, 8, 8, "both", dtype=torch.float32)
    _, grads = _gradients(args, 8, "native", options, "cache")
    _, want = _gradients(args, 8, "torch", _relative(4, 8, 8, "both", dtype=torch.float32), "cache",
                         schedule="loop")
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_auto_takes_it_with_gradients_except_for_grad_scope_none(monkeypatch):
    calls = _counted(monkeypatch)
    args = make_vq()
    _gradients(args, 4, "auto", {}, "cache")
    _gradients(args, 4, "auto", {}, "state")
    assert calls == [1, 1]
    _gradients(args, 4, "auto", {}, "none")  # the cache's gradient: the torch form
    _gradients(args, 4, "auto", {}, "cache", schedule="loop")  # a schedule names a torch walk
    assert calls == [1, 1]


@pytest.mark.parametrize("case, match", [
    ("grad_scope none", "computes gradients for grad_scope 'cache' or 'state', not 'none'"),
    ("a cache with gradients", "sends no gradient into a carried cache"),
])
def test_impl_native_refuses_gradients_it_does_not_compute(case, match):
    q, k_hat, v, codes, codebook = make_vq(T=12)
    v = v.clone().requires_grad_()
    if case == "grad_scope none":
        options = {"grad_scope": "none"}
    else:  # a state whose cache came through a grad_scope "none" call
        _, state = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, grad_scope="none", impl="torch",
                                        output_final_state=True)
        assert state.cache_means.requires_grad
        options = {"initial_state": state}
    with pytest.raises(ValueError, match=f"impl='native': the native VQ block form {match}.*; use impl='torch'"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, impl="native", **options)


def test_the_self_check_fails_a_backward_that_differs(monkeypatch, fresh_block_verdicts):
    """The check itself, on a backward made wrong: the codebook's gradient dropped."""
    real = native_block._NativeBlocks.backward

    def dropping(ctx, *grads):
        result = list(real(ctx, *grads))
        if result[5] is not None:
            result[5] = torch.zeros_like(result[5])
        return tuple(result)

    assert native_block_check.verdict(F64) is None
    native_block_check.reset()
    monkeypatch.setattr(native_block._NativeBlocks, "backward", staticmethod(dropping))
    verdict = native_block_check.verdict(F64)
    assert "gradient of codebook (with gradients): differs by" in verdict
