"""Sliding-window attention: equal to exact attention under the equivalent dense mask,
blockwise memory, decode state, causality, errors."""

import pytest
import torch

from _helpers import F64, OpRecorder, assert_causal_jacobian, assert_close_rel, make_qkv
from linattn import local_attention, softmax_attention


def dense_window_mask(T, window, look_backward, look_forward):
    """keep[i, j] = -look_forward*window <= i - j < look_backward*window, built with loops."""
    keep = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            keep[i, j] = -look_forward * window <= i - j < look_backward * window
    return keep


SETTINGS = [(1, 0, True), (2, 0, True), (1, 1, False), (2, 1, False)]


@pytest.mark.parametrize("T", [1, 7, 100, 257])
@pytest.mark.parametrize("window", [1, 3, 64])
@pytest.mark.parametrize("look_backward,look_forward,causal", SETTINGS)
def test_equals_reference_with_dense_mask(T, window, look_backward, look_forward, causal):
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=T, Dk=8, Dv=5, seed=T + window)
    out, _ = local_attention(q, k, v, window=window, causal=causal, look_backward=look_backward,
                             look_forward=look_forward)
    mask = dense_window_mask(T, window, look_backward, look_forward)
    expected = softmax_attention(q, k, v, bias=mask, impl="reference")
    assert_close_rel(out, expected, rtol=1e-10)


def test_scale_and_gqa():
    q, k, v = make_qkv(B=1, H=6, Hkv=3, T=40, Dk=8, Dv=4, seed=3)
    out, _ = local_attention(q, k, v, window=8, scale=0.3)
    mask = dense_window_mask(40, 8, 1, 0)
    repeated = softmax_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), bias=mask,
                                 scale=0.3, impl="reference")
    assert_close_rel(out, repeated, rtol=1e-10)


@pytest.mark.parametrize("window,look_backward", [(1, 1), (4, 1), (4, 3), (16, 2)])
def test_state_carry_and_token_by_token(window, look_backward):
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=45, Dk=8, Dv=5, seed=window)
    full, full_state = local_attention(q, k, v, window=window, look_backward=look_backward,
                                       output_final_state=True)
    state, outs = None, []
    for a, b in [(0, 13), (13, 14), (14, 30), (30, 45)]:
        out, state = local_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], window=window,
                                     look_backward=look_backward, initial_state=state, output_final_state=True)
        outs.append(out)
    assert_close_rel(torch.cat(outs, 2), full, rtol=1e-10)
    assert state.steps == full_state.steps == 45
    assert state.keys.shape[2] == full_state.keys.shape[2] == min(window * look_backward - 1, 45)
    state, outs = None, []
    for t in range(45):
        out, state = local_attention(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], window=window,
                                     look_backward=look_backward, initial_state=state, output_final_state=True)
        outs.append(out)
    assert_close_rel(torch.cat(outs, 2), full, rtol=1e-10)


def test_causal_jacobian():
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=11, Dk=4, Dv=3, seed=5)
    assert_causal_jacobian(lambda q, k, v: local_attention(q, k, v, window=3, look_backward=2)[0], (q, k, v),
                           ("q", "k", "v"))


def test_gradients_match_reference():
    q, k, v = make_qkv(B=1, H=2, Hkv=2, T=30, Dk=4, Dv=3, seed=6, requires_grad=True)
    grad = torch.randn(1, 2, 30, 3, dtype=F64)
    local_attention(q, k, v, window=4, look_backward=2)[0].backward(grad)
    ours = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    softmax_attention(q, k, v, bias=dense_window_mask(30, 4, 2, 0), impl="reference").backward(grad)
    for mine, theirs in zip(ours, (q.grad, k.grad, v.grad)):
        assert_close_rel(mine, theirs, rtol=1e-9)


def test_memory_is_blockwise():
    T, window = 4096, 32
    q, k, v = make_qkv(B=1, H=1, Hkv=1, T=T, Dk=8, Dv=8, dtype=torch.float32, seed=7)
    with OpRecorder() as local:
        local_attention(q, k, v, window=window)
    with OpRecorder() as dense:
        softmax_attention(q, k, v, causal=True, impl="reference")
    assert local.max_numel <= 2 * T * window  # scores: T rows x (look_backward + 1) * window keys
    assert dense.max_numel >= T * T
    assert local.max_numel * 20 < dense.max_numel


def test_errors_name_the_argument():
    q, k, v = make_qkv(T=8)
    with pytest.raises(ValueError, match="window"):
        local_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="look_forward"):
        local_attention(q, k, v, window=2, look_forward=1)  # causal by default
    with pytest.raises(ValueError, match="state"):
        local_attention(q, k, v, window=2, causal=False, look_forward=1, output_final_state=True)
    with pytest.raises(TypeError, match="initial_state"):
        local_attention(q, k, v, window=2, initial_state=object())
    _, state = local_attention(q, k, v, window=4, output_final_state=True)
    with pytest.raises(ValueError, match="initial_state"):
        local_attention(q, k, v, window=2, initial_state=state)  # holds 3 > 1 positions
    with pytest.raises(ValueError, match="k has"):
        local_attention(q, k[:, :, :5], v, window=2)


def test_peak_memory_at_64k_is_far_below_the_dense_reference():
    from linattn.reporting import peak_memory

    T, window = 65536, 256
    q, k, v = make_qkv(B=1, H=1, Hkv=1, T=T, Dk=16, Dv=16, dtype=torch.float32, seed=8)
    with OpRecorder() as rec:
        local_attention(q, k, v, window=window)
    dense_scores = T * T  # the reference materialises at least the T x T float32 scores
    assert rec.max_numel <= 2 * T * window
    assert rec.max_numel * 20 < dense_scores
    peak = peak_memory(lambda: local_attention(q, k, v, window=window), "cpu")
    assert peak is not None and peak * 20 < dense_scores * 4, f"peak {peak} bytes"


def test_decode_step_scores_one_row_and_the_state_owns_its_memory():
    """A one-token step scores the new query against the carried keys only (no block of W
    padded queries), and the state is a copy of the last keys, not a view of the prompt."""
    window, T = 64, 1000
    q, k, v = make_qkv(B=1, H=2, Hkv=2, T=T + 1, Dk=8, Dv=8, seed=9)
    _, state = local_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], window=window, output_final_state=True)
    for tensor in (state.keys, state.values):
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    step = [t[:, :, T:].clone() for t in (q, k, v)]
    with OpRecorder() as recorder:
        out, _ = local_attention(*step, window=window, initial_state=state)
    assert recorder.max_numel <= 2 * 2 * window * 8  # the keys themselves, not W x 2W scores
    full, _ = local_attention(q, k, v, window=window)
    assert_close_rel(out, full[:, :, T:], rtol=1e-10)
