"""``LinearAttentionState``: ``.detach()`` cuts every tensor from the graph and ``.to()``
moves/casts every tensor, both keeping the other fields; a detached state still
continues the sequence."""

from __future__ import annotations

import torch

from _helpers import F64, assert_close_rel, make_qkv
from linattn import LinearAttentionState, linear_attention


def _state_with_grad():
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=5, Dk=3, Dv=2, requires_grad=True)
    _, state = linear_attention(q, k, v, feature_map="exp", output_final_state=True)
    return state


def test_detach_cuts_graph_keeps_values():
    state = _state_with_grad()
    assert state.kv.requires_grad and state.normalizer.requires_grad
    detached = state.detach()
    assert isinstance(detached, LinearAttentionState)
    for name in ("kv", "normalizer", "key_shift"):
        before, after = getattr(state, name), getattr(detached, name)
        assert not after.requires_grad and after.grad_fn is None
        assert torch.equal(before.detach(), after)
    assert detached.steps == state.steps == 5


def test_to_casts_every_tensor_and_keeps_missing_fields():
    state = LinearAttentionState(
        kv=torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0), dtype=F64), steps=7
    )
    cast = state.to(torch.float32)
    assert cast.kv.dtype == torch.float32 and torch.equal(cast.kv, state.kv.float())
    assert cast.normalizer is None and cast.key_shift is None and cast.steps == 7
    full = _state_with_grad().to(dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in (full.kv, full.normalizer, full.key_shift))


def test_detached_state_continues_sequence():
    """Transformer-XL style: the detached state gives the same continuation, and no
    gradient flows into the first segment."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=12, Dk=3, Dv=2, requires_grad=True)
    whole, _ = linear_attention(q, k, v, feature_map="elu")
    _, state = linear_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], feature_map="elu", output_final_state=True)
    out, _ = linear_attention(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], feature_map="elu", initial_state=state.detach())
    assert_close_rel(out, whole[:, :, 7:], rtol=1e-12)
    (grad_k,) = torch.autograd.grad(out.sum(), k)
    assert (grad_k[:, :, :7] == 0).all() and (grad_k[:, :, 7:] != 0).any()
