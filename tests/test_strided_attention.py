"""Sparse Transformer patterns: equal to exact attention under the dense pattern mask (built
here from the paper's definitions), causal, and computed without a T x T tensor."""

import pytest
import torch

from _helpers import F64, OpRecorder, assert_causal_jacobian, assert_close_rel, make_qkv
from linattn import softmax_attention, strided_attention


def pattern_mask(T, pattern, block, stride, summary, causal):
    """keep[i, j] from the definitions, one entry at a time."""
    keep = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            if pattern == "strided":
                seen = abs(i - j) < block or (i - j) % stride == 0
            else:
                seen = i // block == j // block or j % block >= block - summary
            keep[i, j] = seen and (j <= i or not causal)
    return keep


@pytest.mark.parametrize("T", [1, 7, 64, 129])
@pytest.mark.parametrize("pattern", ["strided", "fixed"])
@pytest.mark.parametrize("block,stride,summary", [(1, 1, 1), (3, 3, 1), (4, 5, 2), (16, 16, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_equals_reference_with_dense_mask(T, pattern, block, stride, summary, causal):
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=T, Dk=8, Dv=5, seed=T + block)
    out = strided_attention(q, k, v, pattern=pattern, block=block, stride=stride, summary=summary, causal=causal)
    expected = softmax_attention(q, k, v, bias=pattern_mask(T, pattern, block, stride, summary, causal),
                                 impl="reference")
    assert_close_rel(out, expected, rtol=1e-10)


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
def test_causal_jacobian(pattern):
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=13, Dk=4, Dv=3, seed=4)
    fn = lambda q, k, v: strided_attention(q, k, v, pattern=pattern, block=3, summary=1)  # noqa: E731
    assert_causal_jacobian(fn, (q, k, v), ("q", "k", "v"))


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
def test_gradients_match_reference(pattern):
    q, k, v = make_qkv(B=1, H=2, Hkv=2, T=40, Dk=4, Dv=3, seed=5, requires_grad=True)
    grad = torch.randn(1, 2, 40, 3, dtype=F64)
    strided_attention(q, k, v, pattern=pattern, block=6, stride=4, summary=2).backward(grad)
    ours = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    mask = pattern_mask(40, pattern, 6, 4, 2, True)
    softmax_attention(q, k, v, bias=mask, impl="reference").backward(grad)
    for mine, theirs in zip(ours, (q.grad, k.grad, v.grad)):
        assert_close_rel(mine, theirs, rtol=1e-9)


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
def test_no_t_by_t_tensor(pattern):
    T = 2048
    q, k, v = make_qkv(B=1, H=1, Hkv=1, T=T, Dk=8, Dv=8, dtype=torch.float32, seed=6)
    with OpRecorder() as rec:
        strided_attention(q, k, v, pattern=pattern, block=64, summary=4)
    # local group T x 3*block plus the long-range group (T x T/stride or T x T*summary/block)
    assert rec.max_numel * 4 < T * T, f"{pattern} built a tensor of {rec.max_numel} elements"


def test_errors_name_the_argument():
    q, k, v = make_qkv(T=8)
    with pytest.raises(ValueError, match="pattern"):
        strided_attention(q, k, v, pattern="dilated", block=2)
    with pytest.raises(ValueError, match="block"):
        strided_attention(q, k, v, block=0)
    with pytest.raises(ValueError, match="summary"):
        strided_attention(q, k, v, pattern="fixed", block=2, summary=3)
    with pytest.raises(ValueError, match="H % Hkv|must divide"):
        strided_attention(
            q, k[:, :1].expand(2, 3, 8, 4).contiguous(), v[:, :1].expand(2, 3, 8, 3).contiguous(), block=2
        )
