"""``linattn.hf``'s one-token forwards through ``LM.generate``'s native token loops
(``hf/_native_steps.py``): ``generate``'s logits and tokens equal those of the general path
(``LM._trunk`` per token, the loops switched off by their variables) in float64 for every kind
the loops take, the loop really holds the cache, a cache stepped past is refused by name and a
deep copy continues, the prompt's cache stays a value, a parameter written between tokens is
seen, a softmax cache out of reserved rows starts a new loop, and no loop is retried where none
applies."""

from __future__ import annotations

import copy

import pytest
import torch

import linattn.hf as H
from linattn.hf import _native_steps
from linattn.models import _block_generation
from linattn.models._native_generation import NativeGeneration
from test_hf import random_ids, tiny_lm

GENERAL = {"LINATTN_BLOCK_STEP_IMPL": "torch", "LINATTN_VQ_STEP_IMPL": "torch"}  # every token through LM._trunk
KINDS = ["vq", "vq-attn:rerope", "vq-attn:bias", "softmax", "local:4,vq,delta", "linear:elu", "gated-delta",
         "linear:hedgehog", "vq:rerope", "vq-fsq", "gau-softmax", "soft-vq"]


def _greedy(model, prompt, n, monkeypatch, general: bool):
    with monkeypatch.context() as patch:
        for name, value in GENERAL.items():
            if general:
                patch.setenv(name, value)
            else:
                patch.delenv(name, raising=False)
        out = model.generate(prompt, max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("attention", KINDS)
def test_generate_through_the_loops_equals_the_general_path(attention, monkeypatch):
    model = H.LinattnForCausalLM.from_lm(tiny_lm(attention, n_kv_heads=1 if "vq-attn" in attention else None)).eval()
    prompt = random_ids(2, 5, seed=3)
    tokens, logits = _greedy(model, prompt, 9, monkeypatch, general=False)  # crosses blocks of 4
    want_tokens, want_logits = _greedy(model, prompt, 9, monkeypatch, general=True)
    assert torch.equal(tokens, want_tokens)
    assert torch.allclose(logits, want_logits, rtol=1e-11, atol=1e-12)
    with torch.no_grad():
        cache = model(prompt).cache
        stepped = model(prompt[:, -1:], cache=cache).cache
    assert isinstance(stepped.groups[0].loop, NativeGeneration)  # the loop was taken, not the general path
    assert cache.groups[0].loop is None and len(stepped) == len(cache)


def _logits_after(model, ids, general_from: int, monkeypatch):
    """The logits of the last token of ``ids`` after the others, one token at a time after the
    first ``general_from`` tokens read at once, through the general path."""
    with monkeypatch.context() as patch, torch.no_grad():
        for name, value in GENERAL.items():
            patch.setenv(name, value)
        out = model(ids[:, :general_from])
        for t in range(general_from, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=out.cache)
    return out.logits


def test_a_cache_stepped_past_is_refused_and_a_deep_copy_continues(monkeypatch):
    model = H.LinattnForCausalLM.from_lm(tiny_lm("local:4,vq,delta")).eval()
    ids = random_ids(2, 9, seed=4)
    with torch.no_grad():
        cache = model(ids[:, :5]).cache
        cache = model(ids[:, 5:6], cache=cache).cache  # held by the loop
        model(ids[:, 6:7], cache=cache)  # steps the loop on
        with pytest.raises(ValueError, match="advanced in place by a later forward.*copy.deepcopy"):
            model(ids[:, 6:7], cache=cache)
        with pytest.raises(ValueError, match="advanced in place"):
            H.lm_state_of(cache)
        cache = model(ids[:, 5:6], cache=model(ids[:, :5]).cache).cache
        kept = copy.deepcopy(cache)  # reads the state while the loop still holds it
        assert kept.groups[0].loop is None
        model(ids[:, 6:7], cache=cache)
        branches = [model(ids[:, 6:7], cache=kept), model(ids[:, 6:7], cache=cache)]  # the state read is kept
        branches = [model(ids[:, 7:8], cache=branch.cache) for branch in branches]
    want = _logits_after(model, ids[:, :8], 5, monkeypatch)
    assert all(torch.allclose(branch.logits, want, rtol=1e-11, atol=1e-12) for branch in branches)


def test_the_prompt_cache_continues_twice(monkeypatch):
    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq-attn:rerope", n_kv_heads=1)).eval()
    ids = random_ids(2, 8, seed=5)
    with torch.no_grad():
        prompt = model(ids[:, :6]).cache
        firsts = []
        for _ in range(2):
            out = model(ids[:, 6:7], cache=prompt)
            out = model(ids[:, 7:8], cache=out.cache)
            assert out.cache.groups[0].loop is not None
            firsts.append(out.logits)
    want = _logits_after(model, ids, 6, monkeypatch)
    assert all(torch.allclose(logits, want, rtol=1e-11, atol=1e-12) for logits in firsts)


def test_a_parameter_written_between_tokens_is_seen(monkeypatch):
    model = H.LinattnForCausalLM.from_lm(tiny_lm("softmax,delta")).eval()
    ids = random_ids(1, 8, seed=6)
    with torch.no_grad():
        out = model(ids[:, :5])
        out = model(ids[:, 5:6], cache=out.cache)
        out = model(ids[:, 6:7], cache=out.cache)
        old_loop = out.cache.groups[0].loop
        model.lm.layers[1].ffn.w_up.weight.mul_(1.5)
        out = model(ids[:, 7:8], cache=out.cache)
    assert out.cache.groups[0].loop is not old_loop  # a new loop, reading the new weight
    assert torch.allclose(out.logits, _logits_after(model, ids, 5, monkeypatch), rtol=1e-11, atol=1e-12)


def test_a_softmax_cache_out_of_rows_starts_a_new_loop(monkeypatch):
    model = H.LinattnForCausalLM.from_lm(tiny_lm("softmax,softmax")).eval()
    prompt = random_ids(2, 3, seed=7)
    monkeypatch.setattr(_native_steps, "_ROOM", 2)  # with 3 positions: room for 3 more rows, then 6, ...
    starts = []
    original = _block_generation.BlockGeneration.start.__func__
    monkeypatch.setattr(_block_generation.BlockGeneration, "start",
                        classmethod(lambda cls, *a: starts.append(1) or original(cls, *a)))
    tokens, logits = _greedy(model, prompt, 12, monkeypatch, general=False)
    assert len(starts) == 3  # rows for 3, then 6, then 12 more: 11 steps take three loops
    want_tokens, want_logits = _greedy(model, prompt, 12, monkeypatch, general=True)
    assert torch.equal(tokens, want_tokens) and torch.allclose(logits, want_logits, rtol=1e-11, atol=1e-12)


def test_no_loop_is_tried_again_where_none_applies(monkeypatch):
    model = H.LinattnForCausalLM.from_lm(tiny_lm("softmax")).eval()
    monkeypatch.setenv("LINATTN_BLOCK_STEP_IMPL", "torch")  # no native loop
    calls = []
    original = _native_steps.step
    monkeypatch.setattr(_native_steps, "step", lambda *a: calls.append(1) or original(*a))
    ids = random_ids(1, 8, seed=8)
    with torch.no_grad():
        out = model(ids[:, :4])
        for t in range(4, 8):
            out = model(ids[:, t : t + 1], cache=out.cache)
    assert out.cache.groups[0].loop is None and not out.cache.groups[0].native_start
    assert len(calls) == 4  # asked each token, ...
    with torch.no_grad():
        cache = model(ids[:, :4]).cache
        model(ids[:, 4:5], cache=cache)
    assert not cache.groups[0].native_start  # ... and it gave up on the group at the first


def test_beam_search_reorders_without_starting_loops(monkeypatch):
    model = H.LinattnForCausalLM.from_lm(tiny_lm("local:4,vq,delta")).eval()
    prompt = random_ids(2, 5, seed=9)
    beams = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False)
    with monkeypatch.context() as patch:
        for name, value in GENERAL.items():
            patch.setenv(name, value)
        want = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False)
    assert torch.equal(beams, want)
    cache = H.LinattnCache(2, [H.RowGroup(torch.arange(2), loop=None, state=model(prompt).cache.groups[0].state)], 5)
    cache.select_rows(torch.tensor([1, 0]))
    assert not cache.groups[0].native_start
