"""Linformer: with E = F = identity it is exact non-causal attention; projections act along
the length axis; no causal form; lengths beyond max_len are rejected."""

import pytest
import torch

from _helpers import F64, assert_close_rel, make_qkv
from linattn import linformer_attention, softmax_attention
from linattn.nn import LinformerAttention


@pytest.mark.parametrize("T", [1, 7, 50])
@pytest.mark.parametrize("Hkv", [1, 2, 4])
def test_identity_projection_is_exact_attention(T, Hkv):
    q, k, v = make_qkv(B=2, H=4, Hkv=Hkv, T=T, Dk=8, Dv=5, seed=T)
    eye = torch.eye(T, dtype=F64)
    out = linformer_attention(q, k, v, eye, eye)
    assert_close_rel(out, softmax_attention(q, k, v, causal=False, impl="reference"), rtol=1e-10)


def test_projection_along_length_by_hand():
    q, k, v = make_qkv(B=1, H=2, Hkv=2, T=9, Dk=4, Dv=3, seed=1)
    E = torch.randn(5, 12, dtype=F64)
    F = torch.randn(5, 12, dtype=F64)
    out = linformer_attention(q, k, v, E, F, scale=0.5)
    for h in range(2):
        keys = E[:, :9] @ k[0, h]  # [5, Dk]
        values = F[:, :9] @ v[0, h]
        expected = torch.softmax(0.5 * q[0, h] @ keys.T, dim=-1) @ values
        assert_close_rel(out[0, h], expected, rtol=1e-10)


def test_per_head_projections():
    q, k, v = make_qkv(B=1, H=4, Hkv=2, T=6, Dk=4, Dv=3, seed=2)
    E = torch.randn(2, 3, 6, dtype=F64)
    F = torch.randn(2, 3, 6, dtype=F64)
    out = linformer_attention(q, k, v, E, F)
    for h in range(4):
        kv = h // 2
        single = linformer_attention(q[:, h : h + 1], k[:, kv : kv + 1], v[:, kv : kv + 1], E[kv], F[kv])
        assert_close_rel(out[:, h : h + 1], single, rtol=1e-12)


def test_layer_shapes_and_gradients():
    torch.manual_seed(0)
    layer = LinformerAttention(16, 4, max_len=32, k=8).double()
    x = torch.randn(2, 20, 16, dtype=F64, requires_grad=True)
    y, _, _ = layer(x)
    assert y.shape == x.shape
    y.sum().backward()
    assert layer.E.grad is not None and layer.E.grad[:, 20:].abs().sum() == 0  # unused columns
    assert layer.E.grad[:, :20].abs().sum() > 0


def test_errors_explain():
    q, k, v = make_qkv(T=8)
    E = torch.randn(4, 6, dtype=F64)
    with pytest.raises(ValueError, match="no causal form"):
        linformer_attention(q, k, v, E, E, causal=True)
    with pytest.raises(ValueError, match="T=8 exceeds max_len=6"):
        linformer_attention(q, k, v, E, E)
    with pytest.raises(ValueError, match="E has shape"):
        linformer_attention(q, k, v, torch.randn(3, 4, 8, dtype=F64), torch.randn(4, 8, dtype=F64))
    layer = LinformerAttention(8, 2, max_len=4, k=2).double()
    with pytest.raises(ValueError, match="exceeds max_len=4"):
        layer(torch.randn(1, 5, 8, dtype=F64))
