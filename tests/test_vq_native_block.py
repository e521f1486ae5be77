"""The native block form of ``vq_attention`` without gradients (``ops/vq/native_block.py``,
``_native/vq_block_forward.cpp``; chosen by ``ops/vq/native_block_check.py``; its gradients are
``test_vq_native_backward.py``'s): float64
equality with the quadratic reference and the torch block forms on awkward shapes and carried
states, the same bits at 1 and 2 threads, what it refuses, when ``impl="auto"`` takes it, and
its self-check made to fail."""

from __future__ import annotations

import warnings

import pytest
import torch

import linattn
from linattn.ops.vq import native_block, native_block_check

F64 = torch.float64


def make_vq(B=2, H=4, Hkv=2, T=11, Dk=4, Dv=3, S=8, unused=2, seed=0, dtype=F64):
    """q, k_hat, v, codes, codebook; codes never use the last ``unused`` entries (empty cache slots)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=F64).to(dtype)
    codebook = torch.randn(Hkv, S, Dk, generator=g, dtype=F64).to(dtype)
    codes = torch.randint(0, S - unused, (B, Hkv, T), generator=g)
    v = torch.randn(B, Hkv, T, Dv, generator=g, dtype=F64).to(dtype)
    k_hat = codebook[torch.arange(Hkv)[None, :, None], codes]
    return q, k_hat, v, codes, codebook


def _split(args, sizes):
    """The sequence tensors of ``args`` (q, k_hat, v, codes) cut along time into ``sizes``."""
    q, k_hat, v, codes, codebook = args
    pieces = zip(*(t.split(sizes, dim=2) for t in (q, k_hat, v, codes)))
    return [(*piece, codebook) for piece in pieces]


def _run(args, L, impl, state=None, **options):
    with torch.no_grad():
        return linattn.vq_attention(*args, block_size=L, impl=impl, initial_state=state, output_final_state=True,
                                    **options)


def counted_calls(monkeypatch, owner=native_block, name="running_blocks"):
    """Calls of ``owner.name`` (the native block form's entry), recorded after the self-check's own."""
    native_block_check.verdict(F64)
    calls = []
    real = getattr(owner, name)

    def counted(*args, **options):
        calls.append(1)
        return real(*args, **options)

    monkeypatch.setattr(owner, name, counted)
    return calls


SHAPES = [  # B, H, Hkv, T, L, S
    (1, 1, 1, 9, 4, 4),      # one row, T not a multiple of L
    (2, 4, 2, 11, 4, 8),     # batch, query groups (Hkv < H), a partial last block
    (2, 2, 2, 16, 4, 6),     # whole blocks only
    (1, 6, 3, 40, 8, 16),    # many blocks
    (3, 2, 1, 5, 4, 8),      # one full block and one position
]


@pytest.mark.parametrize("B, H, Hkv, T, L, S", SHAPES)
@pytest.mark.parametrize("relative", ["none", "bias", "positions", "both", "shared"])
def test_equals_the_reference_and_the_torch_forms_in_float64(monkeypatch, segment_blocks, B, H, Hkv, T, L, S,
                                                            relative):
    """Outputs and final states; ``relative``: a bias table per head, position keys per head,
    both, or both shared by the heads."""
    calls = counted_calls(monkeypatch)
    args = make_vq(B=B, H=H, Hkv=Hkv, T=T, S=S)
    g = torch.Generator().manual_seed(5)
    heads = () if relative == "shared" else (H,)
    options = {}
    if relative in ("bias", "both", "shared"):
        options["bias"] = torch.randn(*heads, L + 1, generator=g, dtype=F64)
    if relative in ("positions", "both", "shared"):
        options["position_keys"] = 0.5 * torch.randn(*heads, L + 1, 4, generator=g, dtype=F64)
    out, state = _run(args, L, "native", **options)
    assert calls == [1]
    reference, _ = linattn.vq_attention(*args, block_size=L, mode="parallel", **options)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)
    for schedule in ("loop", "batched"):
        want, want_state = _run(args, L, "torch", schedule=schedule, **options)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
        assert torch.equal(state.cache_counts, want_state.cache_counts)
        torch.testing.assert_close(state.cache_means, want_state.cache_means, rtol=0, atol=1e-12)
        for name in ("partial_keys", "partial_values", "partial_codes", "prev_keys", "prev_values", "prev_codes"):
            got, expected = getattr(state, name), getattr(want_state, name)
            assert (got is None) == (expected is None), name
            if got is not None:
                assert torch.equal(got, expected), name
    assert len(calls) == 1  # the torch runs did not take it


@pytest.mark.parametrize("sizes", [(3, 9, 1, 10), (8, 8, 7), (1, 1, 21), (5, 16, 2)])
def test_carried_states_give_the_whole_sequence(segment_blocks, sizes):
    """Calls that continue each other's state (ending inside a block, on a block boundary, one
    position long) give the outputs of one call over the whole sequence and its final cache."""
    L = 4
    args = make_vq(B=2, H=4, Hkv=2, T=sum(sizes), S=8, seed=3)
    g = torch.Generator().manual_seed(6)
    relative = dict(bias=torch.randn(4, L + 1, generator=g, dtype=F64),
                    position_keys=0.5 * torch.randn(4, L + 1, 4, generator=g, dtype=F64))
    whole, whole_state = _run(args, L, "torch", **relative)
    outs, state = [], None
    for piece in _split(args, list(sizes)):
        out, state = _run(piece, L, "auto", state, **relative)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=2), whole, rtol=0, atol=1e-12)
    assert torch.equal(state.cache_counts, whole_state.cache_counts)
    torch.testing.assert_close(state.cache_means, whole_state.cache_means, rtol=0, atol=1e-12)


def test_float32_agrees_with_the_torch_form():
    args = make_vq(B=2, H=8, Hkv=4, T=300, Dk=16, Dv=16, S=32, dtype=torch.float32)
    out, _ = _run(args, 32, "native")
    want, _ = _run(args, 32, "torch")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=0, atol=2e-6 * float(want.abs().max()))


def test_causal_a_changed_future_changes_no_earlier_output():
    L, t = 4, 13
    args = make_vq(T=30, seed=4)
    changed = [a.clone() for a in args]
    g = torch.Generator().manual_seed(9)
    changed[0][:, :, t:] = torch.randn(changed[0][:, :, t:].shape, generator=g, dtype=F64)
    changed[3][:, :, t:] = (changed[3][:, :, t:] + 1) % 6
    changed[1] = args[4][torch.arange(2)[None, :, None], changed[3]]
    changed[2][:, :, t:] = torch.randn(changed[2][:, :, t:].shape, generator=g, dtype=F64)
    out, _ = _run(args, L, "native")
    out_changed, _ = _run(tuple(changed), L, "native")
    assert torch.equal(out[:, :, :t], out_changed[:, :, :t])
    assert not torch.equal(out[:, :, t:], out_changed[:, :, t:])


def at_one_and_two_threads(call):
    """``[call() at 1 torch thread, call() at 2]``, the thread count restored after."""
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(call())
        return results
    finally:
        torch.set_num_threads(before)


def test_the_thread_count_does_not_change_a_bit(segment_blocks):
    args = make_vq(B=2, H=4, Hkv=4, T=70, Dk=8, Dv=8, S=16, dtype=torch.float32)
    (one, one_state), (two, two_state) = at_one_and_two_threads(lambda: _run(args, 8, "native"))
    assert torch.equal(one, two)
    assert torch.equal(one_state.cache_means, two_state.cache_means)


def test_segments_do_not_change_a_bit(monkeypatch):
    """The cache at a segment's start is the running cache's additions in the same order: the
    outputs and the final state are the same bits however a row is cut."""
    args = make_vq(B=2, H=4, Hkv=2, T=45, Dk=8, Dv=8, S=16, dtype=torch.float32)
    results = []
    for blocks in (1, 3, 32):
        monkeypatch.setattr(native_block, "SEGMENT_BLOCKS", blocks)
        results.append(_run(args, 4, "native", bias=torch.linspace(-1, 1, 5)))
    for out, state in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(state.cache_means, results[0][1].cache_means)
        assert torch.equal(state.cache_counts, results[0][1].cache_counts)


def test_auto_takes_it_on_cpus(monkeypatch):
    calls = counted_calls(monkeypatch)
    args = make_vq()
    with torch.no_grad():
        linattn.vq_attention(*args, block_size=4)
    assert calls == [1]
    with torch.no_grad():
        linattn.vq_attention(*args, block_size=4, schedule="loop")  # a schedule names a torch walk
        linattn.vq_attention(*args, block_size=4, impl="torch")
        linattn.vq_attention(*args, block_size=4, rerope=2)
    assert calls == [1]
    monkeypatch.setenv("LINATTN_VQ_IMPL", "torch")
    with torch.no_grad():
        linattn.vq_attention(*args, block_size=4)
    assert calls == [1]


@pytest.mark.parametrize("case, match", [
    ("soft codes", "takes hard codes"),
    ("rerope", r"has no ReRoPE form \(rerope=\)"),
])
def test_impl_native_refuses_what_it_does_not_compute(case, match):
    q, k_hat, v, codes, codebook = make_vq()
    options = {}
    if case == "soft codes":
        codes = torch.nn.functional.one_hot(codes, 8).to(F64)
    if case == "rerope":
        options["rerope"] = 2
    with torch.no_grad(), pytest.raises(ValueError,
                                        match=f"impl='native': the native VQ block form {match}.*; use impl='torch'"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, impl="native", **options)


def test_impl_native_refuses_the_other_modes():
    args = make_vq()
    with torch.no_grad(), pytest.raises(ValueError, match="impl='native' runs the causal block form; causal=False"):
        linattn.vq_attention(*args, block_size=4, causal=False, impl="native")


def test_a_failed_self_check_warns_once_and_auto_runs_torch(monkeypatch, fresh_block_verdicts):
    monkeypatch.setattr(native_block_check, "_run_check", lambda dtype: "result 0: differs by 1 (on purpose)")
    calls = counted_calls(monkeypatch)
    args = make_vq()
    with pytest.warns(RuntimeWarning, match="the native VQ block form failed in torch.float64: result 0: differs"):
        out, _ = _run(args, 4, "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = _run(args, 4, "auto")
    want, _ = _run(args, 4, "torch")
    assert calls == [] and torch.equal(out, want) and torch.equal(again, want)
    with pytest.raises(RuntimeError, match="the native VQ block form failed in torch.float64"):
        _run(args, 4, "native")
    monkeypatch.setenv("LINATTN_VQ_IMPL", "native")
    with pytest.raises(RuntimeError, match="the native VQ block form failed in torch.float64"):
        _run(args, 4, "auto")


def test_the_self_check_fails_a_kernel_that_differs(monkeypatch, fresh_block_verdicts):
    """The check itself, on a kernel made wrong: block 0 always seen without its previous block."""
    real = native_block.running_blocks

    def forgetting(blocks, codebook, window, position_keys, run, has_prev, full_blocks, scale, prev_grad=True):
        return real(blocks, codebook, window, position_keys, run, False, full_blocks, scale, prev_grad)

    assert native_block_check.verdict(F64) is None
    native_block_check.reset()
    monkeypatch.setattr(native_block, "running_blocks", forgetting)
    assert "differs by" in native_block_check.verdict(F64)


def test_the_kernel_checks_what_it_is_given():
    args = make_vq(T=9)
    q, k_hat, v, codes, codebook = args
    bad = codes.clone()
    bad[0, 0, 0] = 8  # beyond the codebook: unchecked by check_inputs=False, caught by the kernel
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"code 8 outside \[0, 8\)"):
        linattn.vq_attention(q, k_hat, v, bad, codebook, block_size=4, impl="native", check_inputs=False)


def test_an_empty_cache_slot_takes_no_weight_however_high_its_score():
    """A code no key has used (its cache slot empty) scores far above everything else: it gets
    weight exactly 0, as ``log n = -inf`` gives it in the torch form (no inf times an empty sum)."""
    q, k_hat, v, codes, codebook = make_vq(T=20, S=8, unused=2)
    codebook = codebook.clone()
    codebook[:, -1] = 1e3 * q[0, 0, 0] / q[0, 0, 0].norm()  # the last code is never used
    q = q.clone()
    q[:, :, 8:] = 50.0 * q[0, 0, 0]  # queries after the first blocks point at it
    args = (q, codebook[torch.arange(2)[None, :, None], codes], v, codes, codebook)
    out, _ = _run(args, 4, "native")
    want, _ = _run(args, 4, "torch")
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
