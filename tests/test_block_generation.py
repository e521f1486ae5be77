"""``LM.generate``'s native token loop for models of pre-norm blocks (``models/_block_generation.py``,
the native ``BlockModelStep``) against the step through ``LM._run``: the same logits and states
in float64 for every mixer it takes (the sum and delta rules with their maps (elementwise, DPFP,
Taylor, Hedgehog's learned map, the exponential maps exp and FAVOR+ with their running key
shift), normalisations, decays, short convolutions and head norms; softmax over a KV cache and
over a window, with rotary positions, rope scaling, NoPE, ReRoPE, the entropy scale and
projection biases; VQ GAU pairs among the blocks, their blocks completed by the tokens), with
grouped heads, batch > 1, untied heads, a window that the tokens pass; the same tokens from
``generate``; a parameter written between two tokens is seen; the KV cache's rows are claimed
and handed back; the thread count changes no bit; the loop is taken only where it applies, and
the native object's own checks name what is wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from linattn import LM, LMConfig
from linattn.models import _block_generation
from linattn.models._block_generation import BlockGeneration, why_not
from linattn.ops.common.native import extension
from linattn.ops.softmax import kv_cache
from _helpers import generated, generated_with_a_write
from test_vq_native_block import at_one_and_two_threads

F64 = torch.float64
VOCAB = 40
VQ = dict(codebook_size=8, gau_d_k=8, gau_d_v=16)  # small VQ units


def _model(attention: str, seed: int = 0, dtype=F64, **overrides) -> LM:
    torch.manual_seed(seed)
    settings = dict(vocab_size=VOCAB, d_model=32, n_layers=len(attention.split(",")), n_heads=4, attention=attention)
    model = LM(LMConfig(**{**settings, **overrides})).to(dtype)
    with torch.no_grad():  # away from the initial values (zero biases, unit gains, zero decay biases)
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    return model.eval()


def _leaves(value) -> list:
    """Every tensor and ``steps`` of a (nested) state, in field order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple):
        return [leaf for item in value for leaf in _leaves(item)]
    if dataclasses.is_dataclass(value):
        found = []
        for field in dataclasses.fields(value):
            if field.name == "steps":
                found.append(getattr(value, field.name))
            elif field.name != "model":
                found += _leaves(getattr(value, field.name))
        return found
    return []


def _assert_states_equal(a, b):
    left, right = _leaves(a), _leaves(b)
    assert len(left) == len(right) and a.steps == b.steps
    for x, y in zip(left, right):
        if isinstance(x, int):
            assert x == y
        else:
            assert x.shape == y.shape and x.dtype == y.dtype
            assert torch.allclose(x, y, rtol=1e-11, atol=1e-12)


def _both_ways(model, ids, prompt):
    """After the prompt ``ids[:, :prompt]`` (its state with room reserved, as ``generate`` leaves
    it), the rest of ``ids`` through the native loop and through ``_run``: ``(native logits,
    native final state, run's logits, run's final state)``."""
    tokens = ids.shape[1] - prompt
    with torch.no_grad():
        _, state, _ = model(ids[:, :prompt])
        state = kv_cache.reserve(state, tokens)
        session = BlockGeneration.start(model, state, ids.shape[0])
        assert session is not None, why_not(model, state)
        got = torch.cat([session.step(ids[:, t]).clone() for t in range(prompt, ids.shape[1])], 1)
        got_state = session.state()
        _, state, _ = model(ids[:, :prompt])
        expected = []
        for t in range(prompt, ids.shape[1]):
            logits, state, _ = model._run(ids[:, t : t + 1], state, with_aux=False)
            expected.append(logits)
        return got, got_state, torch.cat(expected, 1), state


CASES = {
    "linear:elu": {}, "linear:relu": dict(n_kv_heads=2), "linear:identity": dict(qkv_bias=True, out_bias=True),
    "delta": dict(n_kv_heads=2), "delta:elu": {}, "delta:relu": dict(delta_short_conv=None),
    "delta:identity": dict(delta_short_conv=1),
    "linear:hedgehog": dict(n_kv_heads=2), "linear:dpfp": {}, "linear:dpfp:2": dict(n_kv_heads=2),
    "linear:taylor": dict(n_kv_heads=2), "delta:dpfp": dict(n_kv_heads=2), "delta:taylor": {},
    "favor": dict(n_kv_heads=2), "favor:12": {}, "linear:exp": dict(n_kv_heads=2), "delta:exp": {},
    "gated-delta": dict(n_kv_heads=2), "gated-delta,gated-delta": dict(delta_short_conv=None),
    "gla": dict(n_kv_heads=2), "retnet": dict(n_kv_heads=2, rotary_base=500.0),
    "softmax": dict(n_kv_heads=2), "softmax:nope": {}, "softmax:entropy": dict(qkv_bias=True, out_bias=True),
    "softmax,softmax": dict(rotary_scaling={"type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
    "local:3": dict(n_kv_heads=2), "local:1": {}, "local:5:entropy": {}, "local:2:nope": dict(qkv_bias=True),
    "linear:elu,delta,gated-delta,gla,retnet,softmax,local:4": dict(n_kv_heads=2, tie_embeddings=False),
    # VQ GAU pairs among the blocks, their blocks completed by the tokens (L 4 and 3)
    "local:3,vq": dict(VQ, block_size=4), "vq,softmax,gated-delta": dict(VQ, block_size=3, n_kv_heads=2),
    # ReRoPE: keys within w at their distance, the rest at w (the window passed by the tokens)
    "softmax:rerope=3": dict(n_kv_heads=2), "softmax:rerope=2:entropy": {}, "local:6:rerope=3": dict(n_kv_heads=2),
    "local:3:rerope=5": {},
    # multi-head VQ attention (the converted students' layer), blocks completed by the tokens (L 4 and 3)
    "vq-attn:rerope": dict(codebook_size=8, block_size=4, n_kv_heads=2),
    "vq-attn:rerope=2": dict(codebook_size=8, block_size=3),
    "vq-attn:bias": dict(codebook_size=8, block_size=4, n_kv_heads=2, qkv_bias=True, out_bias=True),
    "softmax,vq-attn:rerope=3,vq,local:3": dict(VQ, block_size=4, n_kv_heads=2),
    "local:3,vq:rerope=3": dict(VQ, block_size=4),  # VQ GAU pairs with ReRoPE among the blocks
    "vq-fsq,softmax": dict(VQ, block_size=4, fsq_levels=(3, 4, 2)),
    # GAU pairs with exact softmax over their KV caches: relative terms within L, the entropy scale
    "gau-softmax": dict(VQ, block_size=3, n_heads=None), "gau-softmax:entropy,local:3": dict(VQ, block_size=4),
    "gau-softmax,vq": dict(VQ, block_size=4, gau_variant="paper", n_heads=None),
    "soft-vq,local:3": dict(VQ, block_size=4), "gau-softmax,soft-vq": dict(VQ, block_size=3, n_heads=None),
}


@pytest.mark.parametrize("attention", list(CASES))
@pytest.mark.parametrize("prompt", [1, 6])
def test_logits_and_states_equal_the_step_through_run(attention, prompt):
    model = _model(attention, **CASES[attention])
    ids = torch.randint(0, VOCAB, (3, prompt + 9), generator=torch.Generator().manual_seed(1))
    got, got_state, expected, expected_state = _both_ways(model, ids, prompt)
    assert torch.allclose(got, expected, rtol=1e-11, atol=1e-12)
    _assert_states_equal(got_state, expected_state)


def test_float32_logits_near_the_step_through_run():
    model = _model("linear:elu,delta,gated-delta,gla,retnet,softmax,local:4", dtype=torch.float32, n_kv_heads=2)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    got, _, expected, _ = _both_ways(model, ids, 4)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_the_state_handed_back_continues_through_run():
    """``state()`` mid-way, then more tokens through ``_run``: the same as ``_run`` all along (a
    softmax cache's rows go back to its buffer, which the next step appends to in place)."""
    model = _model("softmax,local:3,delta", n_kv_heads=2)
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, state, _ = model(ids[:, :4])
        state = kv_cache.reserve(state, 10)
        session = BlockGeneration.start(model, state, 2)
        for t in range(4, 8):
            session.step(ids[:, t])
        state = session.state()
        buffer = state.layers[0]._buffer
        assert buffer is not None and buffer.written == 8 and state.layers[0].keys._base is buffer.keys
        logits, state, _ = model._run(ids[:, 8:], state, with_aux=False)
        assert state.layers[0].keys._base is buffer.keys  # appended in place
        whole_logits, whole, _ = model(ids)
    assert torch.allclose(logits, whole_logits[:, 8:], rtol=1e-11, atol=1e-12)
    _assert_states_equal(state, whole)


def test_a_claimed_cache_is_not_appended_to_in_place_by_another_step():
    """While the loop holds a softmax cache's rows, a second continuation of the prompt's state
    copies its cache (its rows past the prompt are the loop's)."""
    model = _model("softmax")
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, state, _ = model(ids[:, :3])
        state = kv_cache.reserve(state, 5)
        session = BlockGeneration.start(model, state, 1)
        assert not kv_cache.claimable(state.layers[0])
        session.step(ids[:, 3])
        _, other, _ = model._run(ids[:, 5:6], state, with_aux=False)  # another token after the prompt
        assert other.layers[0].keys._base is not state.layers[0]._buffer.keys
        assert torch.equal(other.layers[0].keys[:, :, :3], state.layers[0].keys)
        with pytest.raises(ValueError, match="claimable"):
            kv_cache.claim(state.layers[0])


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_k=10, seed=3)])
@pytest.mark.parametrize("attention, options", [("gated-delta,softmax", {}), ("retnet,local:3", {}),
                                                ("local:3,vq", dict(VQ, block_size=4))])
def test_generate_gives_the_tokens_of_the_general_step(attention, options, sampling, native_steps, monkeypatch):
    model = _model(attention, **options)
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    native = generated(model, prompt, 13, **sampling)
    assert native_steps == [2] * 12  # every token after the first
    monkeypatch.setenv("LINATTN_BLOCK_STEP_IMPL", "torch")  # every token through _run
    general = generated(model, prompt, 13, **sampling)
    assert native_steps == [2] * 12
    assert torch.equal(native, general)


def test_a_parameter_written_between_tokens_is_seen(native_steps, monkeypatch):
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))

    def write(model):
        model.layers[1].mixer.decay_bias.add_(2.0)
        model.layers[0].ffn.w_up.weight.mul_(-3.0)

    native = generated_with_a_write(_model("softmax,gla"), prompt, 10, write)
    assert native_steps == [2] * 4  # tokens 2..5; the rest through _run after the write
    monkeypatch.setenv("LINATTN_BLOCK_STEP_IMPL", "torch")
    assert torch.equal(native, generated_with_a_write(_model("softmax,gla"), prompt, 10, write))


def test_the_thread_count_changes_no_bit():
    model = _model("linear:elu,gated-delta,gla,retnet,softmax,local:8", dtype=torch.float32, d_model=256,
                   n_heads=8, n_kv_heads=4)
    ids = torch.randint(0, VOCAB, (8, 40), generator=torch.Generator().manual_seed(5))

    def run():
        with torch.no_grad():
            _, state, _ = model(ids[:, :30])
            session = BlockGeneration.start(model, kv_cache.reserve(state, 10), 8)
            return torch.cat([session.step(ids[:, t]).clone() for t in range(30, 40)], 1)

    one, two = at_one_and_two_threads(run)
    assert torch.equal(one, two)


def _state_of(model, batch=2, reserve=4):
    with torch.no_grad():
        state = model(torch.randint(0, VOCAB, (batch, 5), generator=torch.Generator().manual_seed(6)))[1]
        return kv_cache.reserve(state, reserve)


@pytest.mark.parametrize("attention, hooked, reason", [
    ("softmax,gau-softmax", lambda model: model.layers[1].units[0], "GAU softmax pair whose units are not plain"),
    ("softmax,soft-vq", lambda model: model.layers[1].units[1].w_q, "GAU pair whose units do not take"),
    ("softmax,local:3", lambda model: model.layers[1].mixer.q_proj, "not a plain nn.Linear"),
])
def test_not_taken_for_a_layer_it_does_not_compute(attention, hooked, reason, monkeypatch):
    """A layer with a forward hook (what an adapter or a recorder adds) is one the step cannot read."""
    model = _model(attention, **VQ)
    hooked(model).register_forward_hook(lambda module, args, out: out)
    state = _state_of(model)
    with torch.no_grad():
        assert BlockGeneration.start(model, state, 2) is None
        assert reason in why_not(model, state)
        monkeypatch.setenv("LINATTN_BLOCK_STEP_IMPL", "native")
        with pytest.raises(ValueError, match=f"LINATTN_BLOCK_STEP_IMPL=native: .*{reason}"):
            BlockGeneration.start(model, state, 2)


def test_vq_units_without_the_native_vq_step_are_refused(monkeypatch):
    model = _model("local:3,vq", **VQ, block_size=4)
    state = _state_of(model)
    monkeypatch.setenv("LINATTN_VQ_STEP_IMPL", "torch")
    with torch.no_grad():
        assert BlockGeneration.start(model, state, 2) is None
        assert "LINATTN_VQ_STEP_IMPL" in why_not(model, state)


def test_a_model_of_vq_pairs_alone_is_the_vq_loop_s():
    model = _model("vq,vq", **VQ, block_size=4, n_heads=None)
    with torch.no_grad():
        assert BlockGeneration.start(model, _state_of(model), 2) is None


def test_taken_only_where_it_applies(monkeypatch):
    model = _model("gla,softmax")
    state = _state_of(model)
    with torch.no_grad():
        assert BlockGeneration.start(model, state, 2) is not None
        state = _state_of(model)
        for module in (model.layers[0].mixer.decay_up, model.layers[1].ffn, model.norm, model.layers[0].mixer.norm):
            handle = module.register_forward_hook(lambda *args: None)
            assert BlockGeneration.start(model, state, 2) is None  # a hook must be called
            handle.remove()
        model.layers[0].mixer.gate_proj = type("Sub", (nn.Linear,), {})(32, 32, bias=False).double()
        assert "not a plain nn.Linear" in why_not(model, state)
        model = _model("gla,softmax")
        unreserved = model(torch.randint(0, VOCAB, (2, 5)))[1]  # a cache without room: no buffer of its own
        assert "KV cache" in why_not(model, unreserved)
        assert "float32 or float64" in why_not(model.to(torch.bfloat16), state)
        model = _model("gla,softmax").train()
        assert "training mode" in why_not(model, state)
        monkeypatch.setenv("LINATTN_BLOCK_STEP_IMPL", "torch")
        assert BlockGeneration.start(model.eval(), _state_of(model), 2) is None
    with pytest.raises(ValueError, match="training mode"):  # gradients on
        monkeypatch.setenv("LINATTN_BLOCK_STEP_IMPL", "native")
        BlockGeneration.start(model, state, 2)


def test_a_full_cache_hands_over_to_run():
    """With no reserved row left, ``current()`` is false: the loop goes on through ``_run``."""
    model = _model("softmax")
    with torch.no_grad():
        _, state, _ = model(torch.randint(0, VOCAB, (1, 3)))
        state = kv_cache.reserve(state, 2)
        session = BlockGeneration.start(model, state, 1)
        capacity = state.layers[0]._buffer.capacity
        for _ in range(capacity - 3):
            assert session.current()
            session.step(torch.tensor([1]))
        assert not session.current()
        with pytest.raises(RuntimeError, match="cache is full"):
            session.step(torch.tensor([1]))


def test_a_failing_self_check_is_warned_of_once_and_the_loop_is_not_taken(monkeypatch):
    trust = _block_generation._trust
    monkeypatch.setattr(trust, "_check", lambda dtype: "made to fail")
    monkeypatch.setattr(trust, "verdicts", {})
    monkeypatch.setattr(trust, "warned", set())
    model = _model("delta")
    state = _state_of(model)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="native block step failed in torch.float64: made to fail"):
            assert BlockGeneration.start(model, state, 2) is None
        assert BlockGeneration.start(model, state, 2) is None  # no second warning (pytest fails on one)
        monkeypatch.setenv("LINATTN_BLOCK_STEP_IMPL", "native")
        with pytest.raises(RuntimeError, match="made to fail"):
            BlockGeneration.start(model, state, 2)


def test_the_self_check_passes_and_fails_a_wrong_step(monkeypatch):
    assert _block_generation._self_check(F64) is None
    assert _block_generation._self_check(torch.float32) is None
    original = BlockGeneration.step
    monkeypatch.setattr(BlockGeneration, "step", lambda self, ids: original(self, ids) * 1.001)
    assert "differ" in _block_generation._self_check(F64)


def _block_tensors(heads=4, kv_heads=2, head_dim=8, d=32, ffn=16):
    """A block's projection and feed-forward tensors (zeros) for a mixer of q, k and v only."""
    width = (heads + 2 * kv_heads) * head_dim
    return {"in_t": torch.zeros(d, width, dtype=F64), "out_t": torch.zeros(heads * head_dim, d, dtype=F64),
            "gate_up_t": torch.zeros(d, 2 * ffn, dtype=F64), "down_t": torch.zeros(ffn, d, dtype=F64)}


def test_the_native_object_names_what_is_wrong():
    native = extension()
    model = _model("delta")
    state = _state_of(model)
    with torch.no_grad():
        session = BlockGeneration.start(model, state, 2)
        obj = session.native
        with pytest.raises(RuntimeError, match="token id 40 is not in"):
            obj.step(torch.tensor([1, 40]), 5, session.logits)
        with pytest.raises(RuntimeError, match="holds no state of 3 rows"):
            obj.step(torch.tensor([1, 2, 3]), 5, torch.empty(3, VOCAB, dtype=F64))
        with pytest.raises(RuntimeError, match="logits must be a contiguous"):
            obj.step(torch.tensor([1, 2]), 5, torch.empty(2, VOCAB))
        with pytest.raises(RuntimeError, match="no block 3"):
            obj.set_state(3, {})
        with pytest.raises(RuntimeError, match="has no tensor 'memory'"):
            obj.set_state(0, {})
        with pytest.raises(RuntimeError, match="memory has shape"):
            obj.set_state(0, {"memory": torch.zeros(2, 4, 8, 7, dtype=F64), "conv": torch.zeros(2, 96, 3, dtype=F64)})
        embed = torch.zeros(VOCAB, 32, dtype=F64)
        fresh = native.BlockModelStep(embed, torch.ones(32, dtype=F64), 1e-5, torch.zeros(32, VOCAB, dtype=F64))
        with pytest.raises(RuntimeError, match="mixer is 'sum', 'delta', 'softmax', 'local' or 'vq'"):
            fresh.add_block("retention", {}, {})
        with pytest.raises(RuntimeError, match="no number 'feature_eps'"):
            fresh.add_block("sum", {}, {"heads": 4.0, "kv_heads": 2.0, "head_dim": 8.0})
        with pytest.raises(RuntimeError, match="'kv_heads' must be an integer in"):
            fresh.add_block("sum", {}, {"heads": 4.0, "kv_heads": 5.0, "head_dim": 8.0})
        with pytest.raises(RuntimeError, match="is not a VQ unit or multi-head VQ attention"):
            obj.set_window(0, *[torch.zeros(1)] * 4, True)
        vq_numbers = {"heads": 4.0, "kv_heads": 2.0, "head_dim": 8.0, "feature_eps": 1e-6, "scale": 0.5,
                      "mixer_eps": 1e-5, "ffn_eps": 1e-5, "block_size": 4.0, "rerope": 5.0}
        with pytest.raises(RuntimeError, match="'rerope' must be an integer in \\[0, 4\\]"):
            fresh.add_block("vq", {}, vq_numbers)
        with pytest.raises(RuntimeError, match="a 'vq' mixer reads q, k and v only"):
            fresh.add_block("vq", _block_tensors(), {**vq_numbers, "rerope": 0.0, "feature": 1.0})
        with pytest.raises(RuntimeError, match="search_t must be a contiguous CPU tensor of Float"):
            fresh.add_block("vq", {**_block_tensors(), "search_t": torch.zeros(2, 8, 5, dtype=F64)},
                            {**vq_numbers, "rerope": 0.0})
        with pytest.raises(RuntimeError, match="float32 or float64"):
            native.BlockModelStep(embed.half(), torch.ones(32).half(), 1e-5, torch.zeros(32, VOCAB).half())


@pytest.mark.parametrize("attention", ["softmax:entropy", "softmax"])
def test_a_cache_cut_by_carry_keeps_its_positions(attention):
    """A softmax cache cut to ``softmax_memory`` keys (``LM.carry``) holds fewer keys than the
    positions consumed: rotary positions count every position, the entropy scale the keys read,
    in the native step as in ``_run``."""
    model = _model(attention, softmax_memory=3)
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        _, state, _ = model(ids[:, :8])
        carried = model.carry(state)
        assert carried.layers[0].keys.shape[2] == 3 and carried.layers[0].steps == 8
        session = BlockGeneration.start(model, kv_cache.reserve(carried, 6), 2)
        got = torch.cat([session.step(ids[:, t]).clone() for t in range(8, 14)], 1)
        expected, _, _ = model._run(ids[:, 8:], model.carry(state), with_aux=False)
    assert torch.allclose(got, expected, rtol=1e-11, atol=1e-12)
