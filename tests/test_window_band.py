"""``ops/common/bias.py``'s ``add_window_band``: the position term of a block's window through one strided
view, against the padded gather of ``offset_rows`` (the form the softmax reference uses), in
float64: values, the columns after the window left alone, and gradients."""

from __future__ import annotations

import pytest
import torch

from linattn.ops.common.bias import add_window_band, offset_rows, window_position_keys

F64 = torch.float64


def reference(q, P, L):
    """``q_a . P_{L + a - c}`` for ``0 <= L + a - c <= L``, else 0: ``[..., L, 2L]``."""
    return offset_rows(q @ P.transpose(-1, -2), L, L, 2 * L, 0, L)


@pytest.mark.parametrize("L", [1, 2, 5, 8])
@pytest.mark.parametrize("extra", [0, 3])  # columns after the window (the loop's cache slots)
def test_band_equals_the_offset_gather(L, extra):
    g = torch.Generator().manual_seed(L)
    q = torch.randn(2, 3, L, 4, generator=g, dtype=F64, requires_grad=True)
    P = torch.randn(L + 1, 4, generator=g, dtype=F64, requires_grad=True)
    base = torch.randn(2, 3, L, 2 * L + extra, generator=g, dtype=F64, requires_grad=True)
    upstream = torch.randn(2, 3, L, 2 * L + extra, generator=g, dtype=F64)

    got = add_window_band(base * 1.0, q @ window_position_keys(P).transpose(-1, -2))
    want = base + torch.nn.functional.pad(reference(q, P, L), (0, extra))
    assert torch.allclose(got, want, rtol=1e-13, atol=1e-13)
    assert torch.equal(got[..., 2 * L :], base[..., 2 * L :])

    grads = torch.autograd.grad((got * upstream).sum(), (q, P, base))
    expected = torch.autograd.grad((want * upstream).sum(), (q, P, base))
    for a, b in zip(grads, expected):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_band_reads_only_offsets_zero_to_L():
    """Outside ``0 <= L + a - c <= L`` nothing is added: keys older than the window (c < a) and
    future keys (c > a + L) get exactly the scores they had."""
    L = 4
    q = torch.ones(1, L, 2, dtype=F64)
    P = torch.arange(1.0, L + 2, dtype=F64).unsqueeze(-1).expand(L + 1, 2)  # q . P_o = 2 (o + 1)
    out = add_window_band(torch.zeros(1, L, 2 * L, dtype=F64), q @ window_position_keys(P).transpose(-1, -2))
    for a in range(L):
        for c in range(2 * L):
            offset = L + a - c
            assert out[0, a, c] == (2 * (offset + 1) if 0 <= offset <= L else 0), (a, c)
