"""Exact attention's preallocated KV cache (ops/softmax/kv_cache.py): decoding token by token with
gradients off writes into buffers in place, growing them by doubling (or by what
``LM.generate`` reserves), and equals attention over every key written out here in float64:
across capacity growth, batch > 1, grouped key/value heads, branches of one state, the
softmax ``Attention`` layer and the softmax GAU."""

from __future__ import annotations

import math

import pytest
import torch

from linattn import LM, KVCacheState, LMConfig
from linattn.nn import GAU
from linattn.nn.attention import Attention
from linattn.ops.softmax import kv_cache
from _helpers import F64, OpRecorder, head_fields
from test_paper_variant import _paper_gau_reference

torch.set_num_threads(1)


def _attention_reference(layer: Attention, x: torch.Tensor) -> torch.Tensor:
    """Causal multi-head softmax attention without positions (rotary=False), written out:
    head h reads key/value head h // (H / Hkv); scores q.k / sqrt(D); y = W_o [heads]."""
    B, T, _ = x.shape
    H, Hkv, D = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q = (x @ layer.q_proj.weight.T).view(B, T, H, D)
    k = (x @ layer.k_proj.weight.T).view(B, T, Hkv, D)
    v = (x @ layer.v_proj.weight.T).view(B, T, Hkv, D)
    out = torch.zeros(B, T, H, D, dtype=F64)
    for h in range(H):
        g = h // (H // Hkv)
        for i in range(T):
            scores = torch.stack([(q[:, i, h] * k[:, j, g]).sum(-1) / math.sqrt(D) for j in range(i + 1)], -1)
            out[:, i, h] = (torch.softmax(scores, -1).unsqueeze(-1) * v[:, : i + 1, g]).sum(1)
    return out.reshape(B, T, H * D) @ layer.o_proj.weight.T


def _layer(H: int, Hkv: int, seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    return Attention(12, H, n_kv_heads=Hkv, head_dim=4, rotary=False).double().eval()


def _decode(layer, x: torch.Tensor, prefill: int, state=None):
    """Outputs of ``layer`` reading ``x[:, :prefill]`` at once, then one position per call,
    and the states after each call."""
    y, state, _ = layer(x[:, :prefill], state)
    outs, states = [y], [state]
    for t in range(prefill, x.shape[1]):
        y, state, _ = layer(x[:, t : t + 1], state)
        outs.append(y)
        states.append(state)
    return torch.cat(outs, 1), states


@pytest.mark.parametrize("B,H,Hkv,prefill", [(1, 2, 2, 1), (3, 4, 2, 3), (2, 4, 1, 5)])
def test_softmax_layer_decodes_as_attention_over_every_key(B, H, Hkv, prefill):
    """Token steps without gradients (the buffer, grown past its capacity at least once on
    the way from ``prefill`` rows to 17) and with them (a new concatenated cache per step) both
    equal the written-out attention; the caches they hold are equal too."""
    layer = _layer(H, Hkv, seed=B)
    x = torch.randn(B, 17, 12, dtype=F64)
    expected = _attention_reference(layer, x)
    with torch.no_grad():
        buffered, states = _decode(layer, x, prefill)
    torch.testing.assert_close(buffered, expected, rtol=1e-10, atol=1e-12)
    capacities = [s._buffer.capacity for s in states[1:]]
    assert len(set(capacities)) >= 2 and capacities == sorted(capacities)  # it grew past a full buffer
    with torch.enable_grad():
        concatenated, grad_states = _decode(layer, x, prefill)
    torch.testing.assert_close(concatenated, expected, rtol=1e-10, atol=1e-12)
    assert all(s._buffer is None for s in grad_states)
    assert torch.equal(states[-1].keys, grad_states[-1].keys.detach())
    assert torch.equal(states[-1].values, grad_states[-1].values.detach())
    assert states[-1].steps == 17 and states[-1].keys.shape == (B, Hkv, 17, 4)


def test_steps_within_capacity_write_in_place_without_concatenating():
    """Within a buffer's capacity a step keeps its storage (the same data pointer) and runs
    no ``cat``; a step that does not fit moves to a buffer of twice the rows, once."""
    layer = _layer(2, 1)
    x = torch.randn(2, 12, 12, dtype=F64)
    with torch.no_grad():
        _, state, _ = layer(x[:, :4])
        _, state, _ = layer(x[:, 4:5], state)  # the first step allocates max(5, 2 * 4) = 8 rows
        assert state._buffer.capacity == 8
        pointers = [state.keys.data_ptr()]
        with OpRecorder() as ops:
            for t in range(5, 8):
                _, state, _ = layer(x[:, t : t + 1], state)
                pointers.append(state.keys.data_ptr())
        assert ops.calls["cat"] == 0
        assert len(set(pointers)) == 1 and state.keys.shape[2] == 8
        _, state, _ = layer(x[:, 8:9], state)
        assert state._buffer.capacity == 16 and state.keys.data_ptr() != pointers[0]
    with torch.enable_grad(), OpRecorder() as ops:  # the contrasting case: gradients on concatenate
        layer(x[:, 9:10], state)
    assert ops.calls["cat"] == 2


def test_branches_of_one_state_do_not_overwrite_each_other():
    """Two continuations of one state (beam search, a retry), advanced in turns: the second
    copies the buffer instead of writing over the rows the first claimed; each equals the
    written-out attention over its own sequence."""
    layer = _layer(2, 2)
    torch.manual_seed(1)
    x, other = torch.randn(1, 9, 12, dtype=F64), torch.randn(1, 3, 12, dtype=F64)
    branch = torch.cat([x[:, :6], other], 1)
    with torch.no_grad():
        _, state, _ = layer(x[:, :5])
        _, root, _ = layer(x[:, 5:6], state)  # a buffer of 10 rows, 6 of them written
        a, b, outs_a, outs_b = root, root, [], []
        for t in range(3):
            y, a, _ = layer(x[:, 6 + t : 7 + t], a)
            outs_a.append(y)
            y, b, _ = layer(other[:, t : t + 1], b)
            outs_b.append(y)
    assert a._buffer is root._buffer and b._buffer is not root._buffer
    torch.testing.assert_close(torch.cat(outs_a, 1), _attention_reference(layer, x)[:, 6:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.cat(outs_b, 1), _attention_reference(layer, branch)[:, 6:], rtol=1e-10,
                               atol=1e-12)


def test_rebuilt_states_and_states_read_with_gradients_start_a_new_buffer():
    """``select_batch``, ``.to``, ``.detach`` and ``dataclasses.replace`` give states without a
    buffer; a state read by a step with gradients on is released (no later step writes into
    its buffer: the graph that read it stays valid), and its next step copies."""
    layer = _layer(2, 1)
    x = torch.randn(2, 8, 12, dtype=F64)
    with torch.no_grad():
        _, state, _ = layer(x[:, :3])
        _, state, _ = layer(x[:, 3:4], state)
    for rebuilt in (state.select_batch(torch.tensor([1, 0])), state.to(F64), state.detach()):
        assert rebuilt._buffer is None
    x_grad = x[:, 4:5].clone().requires_grad_(True)
    y, _, _ = layer(x_grad, state)
    assert state._buffer.written is None
    with torch.no_grad():
        _, after, _ = layer(x[:, 4:5], state)
    assert after._buffer is not state._buffer
    y.sum().backward()  # nothing it read was written in place
    assert x_grad.grad is not None and torch.isfinite(x_grad.grad).all()


def test_a_cache_made_in_inference_mode_continues_under_no_grad():
    """Inference-mode tensors take in-place writes only in that mode: outside it the step copies."""
    layer = _layer(2, 2)
    x = torch.randn(1, 6, 12, dtype=F64)
    with torch.inference_mode():
        _, state, _ = layer(x[:, :3])
        _, state, _ = layer(x[:, 3:4], state)
    with torch.no_grad():
        y, after, _ = layer(x[:, 4:5], state)
    assert not after.keys.is_inference()
    torch.testing.assert_close(y, _attention_reference(layer, x[:, :5])[:, 4:], rtol=1e-10, atol=1e-12)


def test_softmax_gau_decodes_as_its_written_out_formula():
    """The softmax GAU (paper variant, against test_paper_variant's formula; T <= L + 1) on
    the same buffer: equal to the formula across growth, batch 2."""
    torch.manual_seed(3)
    unit = GAU(12, d_k=8, d_v=10, block_size=16, attention="softmax", variant="paper").double().eval()
    with torch.no_grad():
        for parameter in unit.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    x = torch.randn(2, 15, 12, dtype=F64)
    with torch.no_grad():
        decoded, states = _decode(unit, x, 2)
        pointers = {s.keys.data_ptr() for s in states[-4:]}
    torch.testing.assert_close(decoded, _paper_gau_reference(unit, x, 1e5), rtol=1e-10, atol=1e-12)
    assert isinstance(states[-1], KVCacheState) and states[-1]._buffer.capacity == 16
    assert len(pointers) == 1  # positions 12..15 of a 16-row buffer: written in place


def test_reserve_makes_room_once_and_keeps_bounded_caches():
    layer = _layer(2, 2)
    x = torch.randn(1, 10, 12, dtype=F64)
    with torch.no_grad():
        _, state, _ = layer(x[:, :4])
        reserved = kv_cache.reserve(state, 6)
        assert reserved._buffer.capacity == 10 and torch.equal(reserved.keys, state.keys)
        assert kv_cache.reserve(reserved, 6)._buffer is reserved._buffer  # room already there
        pointers = set()
        for t in range(4, 10):
            _, reserved, _ = layer(x[:, t : t + 1], reserved)
            pointers.add(reserved.keys.data_ptr())
        assert len(pointers) == 1 and reserved._buffer.capacity == 10
        local = KVCacheState(keys=torch.zeros(1, 1, 3, 4), values=torch.zeros(1, 1, 3, 4), window=4)
        assert kv_cache.reserve(local, 5) is local
    assert kv_cache.reserve(state, 6) is state  # with gradients on, steps concatenate anyway


@pytest.mark.parametrize("attention", ["softmax", "gau-softmax"])
def test_generate_reserves_exactly_the_tokens_it_feeds(attention, monkeypatch):
    """``LM.generate`` with a prompt of P tokens and N new ones reserves P + N - 1 rows after
    the prompt: every step writes into the same buffers, and greedy tokens equal the argmax of
    full passes over the sequence so far. (Through ``_run``: the native loop of a softmax model,
    which writes into the same rows, is ``test_block_generation.py``'s.)"""
    monkeypatch.setenv("LINATTN_BLOCK_STEP_IMPL", "torch")
    torch.manual_seed(4)
    config = LMConfig(attention=attention, d_model=16, n_layers=2, gau_d_k=8, block_size=8,
                      **head_fields(attention, n_heads=2))
    model = LM(config).double().eval()
    prompt = torch.randint(0, 256, (2, 5))
    seen = []
    run = model._run
    monkeypatch.setattr(model, "_run", lambda ids, state, **kw: seen.append(state) or run(ids, state, **kw))
    tokens = torch.stack(list(model.generate(prompt, 8, temperature=0)), 1)
    assert seen[0] is None  # the prompt
    seen = seen[1:]
    caches = [cache for state in seen for layer in state.layers
              for cache in (layer if isinstance(layer, tuple) else (layer,))]
    assert len(seen) == 7 and all(c._buffer.capacity == 5 + 8 - 1 for c in caches)  # doubling: 10, 20
    assert len({c._buffer.keys.data_ptr() for c in caches}) == len(caches) // len(seen)
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(tokens, ids[:, 5:])
