"""Decode states know what made them (issue 34): every op, layer and ``LM`` that continues a
state refuses one made with another setting (feature map, normalisation, window, block or
codebook size, short convolution, model settings) or for another batch size, with a
ValueError naming the setting and both values, where the state enters; the recorded settings
survive every way a state is rebuilt (checkpoint JSON, ``select_batch``, ``detach``, ``to``,
``LM.carry``, micro-batch split/join, the Hugging Face cache); a setting left None (a state
built by hand, an older checkpoint) is unknown and only shapes are checked. A batch of size 0
is a ValueError naming the batch argument in every public op, layer and the LM."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import linattn
from _helpers import F64, make_qkv, head_fields
from linattn import LM, LMConfig, LMState
from linattn.feature_maps import FAVOR
from linattn.nn import (GAU, Attention, DeltaNet, FSQuantizer, GatedDeltaNet, GatedLinearAttention, LinformerAttention,
                        MultiScaleRetention, ShortConvolution, VectorQuantizer)
from linattn.state import KVCacheState, _State
from linattn.train.checkpoint import flatten_state, unflatten_state
from linattn.train.microbatch import join_states, split_state

torch.set_num_threads(1)

SETTINGS = ("feature_map", "normalize", "short_conv", "window", "block_size", "codebook_size", "rotary_base", "model")
BATCH = r"batch size 2\b.*batch size 3\b"


def vq_inputs(B=2, T=2, S=5, Dk=4, Dv=3, seed=0):
    """``q, k_hat, v, codes, codebook`` for ``vq_attention``: ``k_hat = codebook[codes]``."""
    g = torch.Generator().manual_seed(seed)
    codebook = torch.randn(1, S, Dk, generator=g, dtype=F64)
    codes = torch.randint(0, S, (B, 1, T), generator=g)
    k_hat = codebook[0][codes]
    q = torch.randn(B, 2, T, Dk, generator=g, dtype=F64)
    v = torch.randn(B, 1, T, Dv, generator=g, dtype=F64)
    return q, k_hat, v, codes, codebook


def vq_state(B=2, T=2, S=5, L=4):
    q, k_hat, v, codes, codebook = vq_inputs(B, T, S)
    return linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, output_final_state=True)[1]


def vq_call(state, B=2, S=5, L=4):
    q, k_hat, v, codes, codebook = vq_inputs(B, 1, S, seed=1)
    return linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, initial_state=state)


def soft_vq(B=2, T=2, S=5, L=4, state=None, seed=0):
    q, k, v = make_qkv(B=B, H=2, Hkv=1, T=T, Dk=4, Dv=3, seed=seed)
    codebook = torch.randn(1, S, 4, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return linattn.soft_vq_attention(q, k, v, codebook, temperature=0.5, block_size=L, initial_state=state,
                                     output_final_state=True)


def linear(B=2, T=5, state=None, **options):
    q, k, v = make_qkv(B=B, H=2, Hkv=1, T=T, Dk=4, Dv=3)
    return linattn.linear_attention(q, k, v, initial_state=state, output_final_state=True, **options)


def delta(B=2, T=5, state=None, **options):
    q, k, v = make_qkv(B=B, H=2, Hkv=1, T=T, Dk=4, Dv=3)
    beta = torch.full((B, 1, T), 0.5, dtype=F64)
    return linattn.delta_rule(q, k, v, beta, initial_state=state, output_final_state=True, **options)


def local(B=2, T=5, state=None, window=4, **options):
    q, k, v = make_qkv(B=B, H=2, Hkv=1, T=T, Dk=4, Dv=3)
    return linattn.local_attention(q, k, v, window=window, initial_state=state, output_final_state=True, **options)


# (id, the state, a call that continues it with one other setting, the same call with the
#  setting that made it (which must run: the contrast), regex naming the setting and both values)
OP_CASES = [
    ("linear-feature-map", lambda: linear(feature_map="elu")[1], lambda s: linear(T=1, state=s, feature_map="exp"),
     lambda s: linear(T=1, state=s, feature_map="elu"), r"feature_map='elu'.*feature_map='exp'"),
    ("linear-favor-seed", lambda: linear(feature_map=FAVOR(8, seed=0))[1],
     lambda s: linear(T=1, state=s, feature_map=FAVOR(8, seed=1)),
     lambda s: linear(T=1, state=s, feature_map=FAVOR(8, seed=0)), r"'favor:8:seed=0'.*'favor:8:seed=1'"),
    ("linear-dpfp-nu", lambda: linear(feature_map="dpfp:1")[1], lambda s: linear(T=1, state=s, feature_map="dpfp:2"),
     lambda s: linear(T=1, state=s, feature_map="dpfp:1"), r"feature_map='dpfp:1'.*feature_map='dpfp:2'"),
    ("linear-normalize", lambda: linear(normalize="attention")[1], lambda s: linear(T=1, state=s, normalize="sum"),
     lambda s: linear(T=1, state=s, normalize="attention"), r"normalize='attention'.*normalize='sum'"),
    ("linear-normalize-none", lambda: linear(normalize="sum")[1], lambda s: linear(T=1, state=s, normalize=None),
     lambda s: linear(T=1, state=s, normalize="sum"), r"normalize='sum'.*normalize='none'"),
    ("delta-feature-map", lambda: delta(feature_map="identity")[1], lambda s: delta(T=1, state=s, feature_map="elu"),
     lambda s: delta(T=1, state=s, feature_map="identity"), r"feature_map='identity'.*feature_map='elu'"),
    ("delta-normalize", lambda: delta(normalize="l2")[1], lambda s: delta(T=1, state=s, normalize="sum"),
     lambda s: delta(T=1, state=s, normalize="l2"), r"normalize='l2'.*normalize='sum'"),
    ("local-window", lambda: local(window=4)[1], lambda s: local(T=1, state=s, window=8),
     lambda s: local(T=1, state=s, window=4), r"window=4.*window=8"),
    ("local-look-backward", lambda: local(window=4)[1], lambda s: local(T=1, state=s, window=4, look_backward=2),
     lambda s: local(T=1, state=s, window=2, look_backward=2), r"window=4.*look_backward=2 = 8"),
    ("vq-block-size", lambda: vq_state(L=4), lambda s: vq_call(s, L=8), lambda s: vq_call(s, L=4),
     r"block_size=4.*block_size=8"),
    ("vq-codebook-size", lambda: vq_state(S=5), lambda s: vq_call(s, S=7), lambda s: vq_call(s, S=5),
     r"codebook_size=5.*codebook_size=7"),
    ("soft-vq-block-size", lambda: soft_vq(L=4)[1], lambda s: soft_vq(T=1, L=8, state=s, seed=1),
     lambda s: soft_vq(T=1, L=4, state=s, seed=1), r"block_size=4.*block_size=8"),
    ("soft-vq-codebook-size", lambda: soft_vq(S=5)[1], lambda s: soft_vq(T=1, S=7, state=s, seed=1),
     lambda s: soft_vq(T=1, S=5, state=s, seed=1), r"codebook_size=5.*codebook_size=7"),
    ("soft-vq-into-vq", lambda: soft_vq(S=5)[1], lambda s: vq_call(s, S=5), lambda s: soft_vq(T=1, state=s, seed=1),
     r"partial_codes.*hard codes"),
    # another batch size
    ("linear-batch", lambda: linear(B=2)[1], lambda s: linear(B=3, T=1, state=s), lambda s: linear(B=2, T=1, state=s),
     BATCH),
    ("delta-batch", lambda: delta(B=2)[1], lambda s: delta(B=3, T=1, state=s), lambda s: delta(B=2, T=1, state=s),
     BATCH),
    ("local-batch", lambda: local(B=2)[1], lambda s: local(B=3, T=1, state=s), lambda s: local(B=2, T=1, state=s),
     BATCH),
    ("vq-batch", lambda: vq_state(B=2), lambda s: vq_call(s, B=3), lambda s: vq_call(s, B=2), BATCH),
    ("soft-vq-batch", lambda: soft_vq(B=2)[1], lambda s: soft_vq(B=3, T=1, state=s, seed=1),
     lambda s: soft_vq(B=2, T=1, state=s, seed=1), BATCH),
]


@pytest.mark.parametrize("case_id, make, other, same, pattern", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_an_op_refuses_a_state_made_with_another_setting(case_id, make, other, same, pattern):
    state = make()
    with pytest.raises(ValueError, match=pattern):
        other(state)
    same(state)


def test_a_setting_left_none_is_unknown_and_only_shapes_are_checked():
    """A state of window 4 is refused by a call of window 8; the same state with ``window=None``
    (built by hand, or read from a checkpoint written before the field) passes, as its keys fit;
    a state too long for the call still fails on its shape."""
    state = local(window=4)[1]
    assert state.window == 4
    with pytest.raises(ValueError, match="window=4"):
        local(T=1, state=state, window=8)
    local(T=1, state=dataclasses.replace(state, window=None), window=8)
    long = local(window=8)[1]
    with pytest.raises(ValueError, match="at most 3"):
        local(T=1, state=dataclasses.replace(long, window=None), window=4)


# ----------------------------------------------------------------------------- layers


def _run(layer, x, state=None, *, grad=False):
    with torch.set_grad_enabled(grad):
        return layer(x, state)


def _x(B=2, T=5, d=12, seed=0):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _gau(**options):
    torch.manual_seed(0)
    values = dict(d_k=8, d_v=10, codebook_size=6, block_size=4)
    values.update(options)
    return GAU(12, **values).double().eval()


def _layer_state(layer, B=2, T=5):
    return _run(layer, _x(B, T))[1]


# (id, layer that makes the state, layer that continues it, batch of the continuation,
#  gradients on in the continuation (off: the GAU's one-token decode step), regex)
LAYER_CASES = [
    ("attention-linear-feature-map", lambda: Attention(12, 2, mechanism="linear", feature_map="elu"),
     lambda: Attention(12, 2, mechanism="linear", feature_map="exp"), 2, False, r"feature_map='elu'.*'exp'"),
    ("attention-local-window", lambda: Attention(12, 2, mechanism="local", window=4),
     lambda: Attention(12, 2, mechanism="local", window=8), 2, False, r"window=4.*window=8"),
    ("attention-softmax-given-a-local-cache", lambda: Attention(12, 2, mechanism="local", window=4),
     lambda: Attention(12, 2, mechanism="softmax"), 2, False, r"window=4.*window=None"),
    ("delta-net-short-conv", lambda: DeltaNet(12, 2, short_conv=4), lambda: DeltaNet(12, 2, short_conv=3), 2, False,
     r"short_conv=4.*short_conv=3"),
    ("delta-net-without-short-conv", lambda: DeltaNet(12, 2, short_conv=4), lambda: DeltaNet(12, 2), 2, False,
     r"short_conv=4.*short_conv=0"),
    ("delta-net-feature-map", lambda: DeltaNet(12, 2), lambda: DeltaNet(12, 2, feature_map="elu"), 2, False,
     r"feature_map='identity'.*feature_map='elu'"),
    ("retention-rotary-base", lambda: MultiScaleRetention(12, 2), lambda: MultiScaleRetention(12, 2, rotary_base=500),
     2, False, r"rotary_base=10000.0.*rotary_base=500.0"),
    ("gated-delta-net-short-conv", lambda: GatedDeltaNet(12, 2, short_conv=4),
     lambda: GatedDeltaNet(12, 2, short_conv=3), 2, False, r"short_conv=4.*short_conv=3"),
    ("gated-delta-net-without-short-conv", lambda: GatedDeltaNet(12, 2, short_conv=4),
     lambda: GatedDeltaNet(12, 2, short_conv=None), 2, False, r"short_conv=4.*short_conv=0"),
    ("gau-vq-codebook-size-decode", lambda: _gau(codebook_size=6), lambda: _gau(codebook_size=8), 2, False,
     r"codebook_size=6.*codebook_size is 8"),
    ("gau-vq-codebook-size", lambda: _gau(codebook_size=6), lambda: _gau(codebook_size=8), 2, True,
     r"codebook_size=6.*codebook_size is 8"),
    ("gau-vq-block-size", lambda: _gau(block_size=8), lambda: _gau(block_size=16), 2, False,
     r"block_size=8.*block_size is 16"),
    ("gau-fsq-grid", lambda: _gau(attention="fsq", fsq_levels=(3, 3)), lambda: _gau(attention="fsq", fsq_levels=(2, 2)),
     2, False, r"codebook_size=9.*codebook_size is 4"),
    ("gau-soft-vq-codebook-size", lambda: _gau(attention="soft-vq", codebook_size=6),
     lambda: _gau(attention="soft-vq", codebook_size=8), 2, False, r"codebook_size=6.*codebook_size is 8"),
    # another batch size
    ("attention-softmax-batch", lambda: Attention(12, 2), lambda: Attention(12, 2), 3, False, BATCH),
    ("attention-linear-batch", lambda: Attention(12, 2, mechanism="linear"),
     lambda: Attention(12, 2, mechanism="linear"), 3, False, BATCH),
    ("attention-local-batch", lambda: Attention(12, 2, mechanism="local", window=4),
     lambda: Attention(12, 2, mechanism="local", window=4), 3, False, BATCH),
    ("delta-net-batch", lambda: DeltaNet(12, 2), lambda: DeltaNet(12, 2), 3, False, BATCH),
    ("retention-batch", lambda: MultiScaleRetention(12, 2), lambda: MultiScaleRetention(12, 2), 3, False, BATCH),
    ("gla-batch", lambda: GatedLinearAttention(12, 2), lambda: GatedLinearAttention(12, 2), 3, False, BATCH),
    ("gated-delta-net-batch", lambda: GatedDeltaNet(12, 2), lambda: GatedDeltaNet(12, 2), 3, False, BATCH),
    ("gau-vq-batch-decode", _gau, _gau, 3, False, BATCH),
    ("gau-vq-batch", _gau, _gau, 3, True, BATCH),
    ("gau-soft-vq-batch", lambda: _gau(attention="soft-vq"), lambda: _gau(attention="soft-vq"), 3, False, BATCH),
    ("gau-softmax-batch", lambda: _gau(attention="softmax"), lambda: _gau(attention="softmax"), 3, False, BATCH),
]


@pytest.mark.parametrize("case_id, maker, consumer, batch, grad, pattern", LAYER_CASES,
                         ids=[c[0] for c in LAYER_CASES])
def test_a_layer_refuses_a_state_made_with_another_setting(case_id, maker, consumer, batch, grad, pattern):
    """... while the layer that made the state continues it (the contrast), on the same path."""
    made_by = maker().double().eval()
    state = _layer_state(made_by)
    layer = consumer().double().eval()
    with pytest.raises(ValueError, match=pattern):
        _run(layer, _x(batch, 1, seed=1), state, grad=grad)
    _run(made_by, _x(2, 1, seed=1), state, grad=grad)


def test_the_softmax_gau_refuses_a_local_cache():
    unit = _gau(attention="softmax")
    cache = KVCacheState(keys=torch.zeros(2, 1, 3, 8, dtype=F64), values=torch.zeros(2, 1, 3, 10, dtype=F64), window=4)
    with pytest.raises(ValueError, match=r"window=4.*window=None"):
        _run(unit, _x(2, 1), cache)
    _run(unit, _x(2, 1), dataclasses.replace(cache, window=None))  # the same cache, window unknown


# ----------------------------------------------------------------------------- the LM


def tiny_lm(attention="vq", seed=0, **overrides) -> LM:
    torch.manual_seed(seed)
    values = dict(vocab_size=32, d_model=16, n_layers=1, attention=attention, n_heads=2, gau_d_k=8, gau_d_v=16,
                  codebook_size=8, block_size=4, chunk_size=4, local_window=4, favor_features=8)
    values.update(overrides)
    return LM(LMConfig(**head_fields(values["attention"], **values))).double().eval()


def ids(B=2, T=6, seed=0):
    return torch.randint(0, 32, (B, T), generator=torch.Generator().manual_seed(seed))


LM_CASES = [
    ("local-window", dict(attention="local:8"), dict(attention="local:16"),
     r"attention=\['local:8'\].*attention=\['local:16'\]"),
    ("codebook-size", dict(codebook_size=8), dict(codebook_size=16), r"codebook_size=8.*codebook_size=16"),
    ("block-size", dict(block_size=4), dict(block_size=8), r"block_size=4.*block_size=8"),
    ("linear-feature-map", dict(attention="linear:elu"), dict(attention="linear:relu"),
     r"attention=\['linear:elu'\].*attention=\['linear:relu'\]"),
    ("favor-seed", dict(attention="favor", feature_seed=0), dict(attention="favor", feature_seed=1),
     r"feature_seed=0.*feature_seed=1"),
    ("short-conv", dict(attention="delta", delta_short_conv=4), dict(attention="delta", delta_short_conv=None),
     r"delta_short_conv=4.*delta_short_conv=None"),
    ("gated-delta-short-conv", dict(attention="gated-delta", delta_short_conv=4),
     dict(attention="gated-delta", delta_short_conv=3), r"delta_short_conv=4.*delta_short_conv=3"),
    ("retnet-rotary-base", dict(attention="retnet"), dict(attention="retnet", rotary_base=500.0),
     r"rotary_base=10000.0.*rotary_base=500.0"),
    ("gau-variant", dict(gau_variant="linattn"), dict(gau_variant="paper"), r"gau_variant='linattn'.*'paper'"),
    ("kv-heads", dict(attention="softmax", n_kv_heads=2), dict(attention="softmax", n_kv_heads=1),
     r"n_kv_heads=2.*n_kv_heads=1"),
]


@pytest.mark.parametrize("case_id, made_by, used_by, pattern", LM_CASES, ids=[c[0] for c in LM_CASES])
def test_the_lm_refuses_a_state_of_a_model_with_other_settings(case_id, made_by, used_by, pattern):
    _, state, _ = tiny_lm(**made_by)(ids())
    model = tiny_lm(**used_by)
    with torch.no_grad():
        with pytest.raises(ValueError, match=pattern):
            model(ids(T=1, seed=1), state)
        with pytest.raises(ValueError, match=pattern):
            next(model.generate(ids(T=1, seed=1), 2, state=state))


def test_the_lm_names_only_the_settings_that_differ_and_continues_its_own_state():
    _, state, _ = tiny_lm(attention="local:8")(ids())
    model = tiny_lm(attention="local:16")
    with pytest.raises(ValueError) as error:
        model(ids(T=1, seed=1), state)
    assert "attention" in str(error.value) and "d_model" not in str(error.value)
    twin = tiny_lm(attention="local:8", chunk_size=2, softmax_memory=3)  # neither changes a state
    assert state.model == twin.state_settings
    twin(ids(T=1, seed=1), state)
    list(twin.generate(ids(T=1, seed=1), 2, state=state))


def test_without_the_model_settings_the_layers_still_check_their_states():
    """An LMState whose ``model`` is unknown (None) is still refused by the local layer, whose
    cache records its window."""
    _, state, _ = tiny_lm(attention="local:8")(ids())
    with pytest.raises(ValueError, match=r"window=8.*window=16"):
        tiny_lm(attention="local:16")(ids(T=1, seed=1), dataclasses.replace(state, model=None))


@pytest.mark.parametrize("attention", ["vq", "linear:elu", "delta", "local:4", "softmax", "soft-vq", "gau-softmax",
                                       "retnet", "gla", "gated-delta"])
def test_the_lm_refuses_a_state_of_another_batch_size(attention):
    model = tiny_lm(attention)
    _, state, _ = model(ids(B=2))
    with torch.no_grad():
        with pytest.raises(ValueError, match=BATCH):
            model(ids(B=3, T=1, seed=1), state)
        with pytest.raises(ValueError, match=BATCH):
            next(model.generate(ids(B=3, T=1, seed=1), 2, state=state))


def test_the_hugging_face_cache_of_another_model_is_refused():
    H = pytest.importorskip("linattn.hf")
    made_by = H.LinattnForCausalLM.from_lm(tiny_lm("local:4", n_layers=2)).eval()
    used_by = H.LinattnForCausalLM.from_lm(tiny_lm("local:8", n_layers=2)).eval()
    cache = made_by(ids(), use_cache=True).cache
    with pytest.raises(ValueError, match=r"attention=\['local:4', 'local:4'\].*\['local:8', 'local:8'\]"):
        used_by(ids(T=1, seed=1), cache=cache)
    made_by(ids(T=1, seed=1), cache=cache)


# ----------------------------------------------------------------------------- the fields survive


def settings_of(value):
    """The recorded settings of every state nested in ``value``, in order (tensors left out)."""
    if isinstance(value, _State):
        fields = dataclasses.fields(value)
        return (type(value).__name__, tuple((f.name, getattr(value, f.name)) for f in fields if f.name in SETTINGS),
                tuple(settings_of(getattr(value, f.name)) for f in fields if f.init and f.name not in SETTINGS))
    if isinstance(value, tuple):
        return tuple(settings_of(item) for item in value)
    return None


def known(value) -> set[str]:
    """The names of the settings recorded (not None) anywhere in ``value``'s states."""
    found = set()
    if isinstance(value, _State):
        for f in dataclasses.fields(value):
            if f.name in SETTINGS and getattr(value, f.name) is not None:
                found.add(f.name)
            elif f.init and f.name not in SETTINGS:
                found |= known(getattr(value, f.name))
    elif isinstance(value, tuple):
        for item in value:
            found |= known(item)
    return found


ALL_KINDS = "vq,vq-fsq,soft-vq,gau-softmax,softmax,linear:elu,favor,delta,retnet,gla,gated-delta,local:4"


@pytest.fixture(scope="module")
def lm_state():
    model = tiny_lm(ALL_KINDS, n_layers=12)
    _, state, _ = model(ids(B=4))
    return model, state


def test_every_layer_state_records_its_settings(lm_state):
    model, state = lm_state
    assert state.model == model.state_settings and dict(state.model)["attention"][-1] == "local:4"
    vq, fsq, soft, gau_softmax, softmax, elu, favor, delta_state, retnet, gla, gated_delta, local_state = state.layers
    assert (vq[0].block_size, vq[0].codebook_size, fsq[1].codebook_size) == (4, 8, 8 * 5 * 5 * 5)
    assert (soft[0].block_size, soft[0].codebook_size) == (4, 8)
    assert gau_softmax[0].window is None and softmax.window is None and local_state.window == 4
    assert (elu.feature_map, elu.normalize) == ("elu", "attention")
    assert favor.feature_map == "favor:8:seed=6"  # feature_seed 0 + the layer's index
    assert (delta_state.rule.feature_map, delta_state.rule.normalize, delta_state.short_conv) == ("identity", "l2", 4)
    assert (retnet.attention.feature_map, retnet.attention.normalize, retnet.rotary_base) == ("identity", "none", 1e4)
    assert (gla.attention.feature_map, gla.attention.normalize) == ("identity", "none")
    assert (gated_delta.rule.feature_map, gated_delta.rule.normalize, gated_delta.short_conv) == ("identity", "l2", 4)


def test_the_settings_survive_a_checkpoint(lm_state):
    """``flatten_state`` -> JSON -> ``unflatten_state`` (train/checkpoint.py) keeps every setting."""
    _, state = lm_state
    tensors = {}
    structure = json.loads(json.dumps(flatten_state(state, "carry", tensors)))
    restored = unflatten_state(structure, tensors)
    assert {"feature_map", "normalize", "short_conv", "window", "block_size", "codebook_size", "model"} <= known(state)
    assert settings_of(restored) == settings_of(state)


def test_a_state_from_an_older_checkpoint_has_unknown_settings_and_is_continued(lm_state):
    """A checkpoint written before the settings existed: its states read back with None, and
    the model continues them (shapes checked)."""
    model, state = lm_state
    tensors = {}
    structure = flatten_state(state, "carry", tensors)

    def strip(node):
        if isinstance(node, dict):
            fields = node.get("fields")
            if fields is not None:
                node = {**node, "fields": {name: value for name, value in fields.items() if name not in SETTINGS}}
            return {key: strip(value) for key, value in node.items()}
        if isinstance(node, list):
            return [strip(item) for item in node]
        return node

    old = unflatten_state(strip(structure), tensors)
    assert known(old) == set() and known(state)
    model(ids(B=4, T=1, seed=2), old)


@pytest.mark.parametrize("rebuild", ["select_batch", "detach", "to", "carry", "split-join"])
def test_the_settings_survive_every_rebuild(lm_state, rebuild):
    model, state = lm_state
    if rebuild == "select_batch":
        rebuilt = [state.select_batch(torch.tensor([3, 0]))]
    elif rebuild == "detach":
        rebuilt = [state.detach()]
    elif rebuild == "to":
        rebuilt = [state.to(torch.float32)]
    elif rebuild == "carry":
        rebuilt = [model.carry(state)]
    else:
        pieces = split_state(state, 2)
        rebuilt = [*pieces, join_states(pieces)]
    assert known(state) == set(SETTINGS)
    for other in rebuilt:
        assert settings_of(other) == settings_of(state)


def test_the_settings_survive_the_hugging_face_cache_row_selection():
    H = pytest.importorskip("linattn.hf")
    lm = tiny_lm("vq,local:4,delta,linear:elu", n_layers=4)
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    cache = model(ids(B=3), use_cache=True).cache
    before = settings_of(cache.groups[0].state)
    cache.reorder_cache(torch.tensor([2, 0, 0, 1]))
    assert settings_of(cache.groups[0].state) == before
    assert {"model", "window", "block_size", "feature_map"} <= known(cache.groups[0].state)
    model(ids(B=4, T=1, seed=1), cache=cache)


# ----------------------------------------------------------------------------- batch size 0

EMPTY = r"\b{name}\b.*batch size 0.*at least one row"


def _empty_qkv():
    return make_qkv(B=0, H=2, Hkv=1, T=4, Dk=4, Dv=3)


def _empty_vq():
    q, k_hat, v, codes, codebook = vq_inputs(B=1, T=4)
    return q[:0], k_hat[:0], v[:0], codes[:0], codebook


OP_EMPTY = [
    ("softmax_attention", "q", lambda: linattn.softmax_attention(*_empty_qkv())),
    ("linear_attention", "q", lambda: linattn.linear_attention(*_empty_qkv())),
    ("linear_attention-favor", "q", lambda: linattn.linear_attention(*_empty_qkv(), feature_map=FAVOR(8))),
    ("delta_rule", "q", lambda: linattn.delta_rule(*_empty_qkv(), torch.zeros(0, 1, 4, dtype=F64))),
    ("local_attention", "q", lambda: linattn.local_attention(*_empty_qkv(), window=2)),
    ("strided_attention", "q", lambda: linattn.strided_attention(*_empty_qkv(), block=2)),
    ("linformer_attention", "q", lambda: linattn.linformer_attention(
        *_empty_qkv(), torch.randn(3, 8, dtype=F64), torch.randn(3, 8, dtype=F64))),
    ("lsh_attention", "qk", lambda: linattn.lsh_attention(torch.zeros(0, 2, 4, 4, dtype=F64),
                                                          torch.zeros(0, 2, 4, 3, dtype=F64))),
    ("vq_attention", "q", lambda: linattn.vq_attention(*_empty_vq(), block_size=2)),
    ("soft_vq_attention", "q", lambda: linattn.soft_vq_attention(*_empty_qkv(), torch.randn(1, 5, 4, dtype=F64),
                                                                 temperature=1.0, block_size=2)),
]


@pytest.mark.parametrize("case_id, name, call", OP_EMPTY, ids=[c[0] for c in OP_EMPTY])
def test_an_op_refuses_an_empty_batch(case_id, name, call):
    with pytest.raises(ValueError, match=EMPTY.format(name=name)):
        call()


LAYER_EMPTY = [
    ("attention-softmax", lambda: Attention(12, 2)),
    ("attention-linear", lambda: Attention(12, 2, mechanism="linear")),
    ("attention-favor", lambda: Attention(12, 2, mechanism="linear", feature_map="favor:8")),
    ("attention-local", lambda: Attention(12, 2, mechanism="local", window=2)),
    ("delta-net", lambda: DeltaNet(12, 2, short_conv=4)),
    ("retention", lambda: MultiScaleRetention(12, 2)),
    ("gla", lambda: GatedLinearAttention(12, 2)),
    ("gated-delta-net", lambda: GatedDeltaNet(12, 2)),
    ("gau-vq", lambda: GAU(12, d_k=8, codebook_size=6, block_size=2)),
    ("gau-fsq", lambda: GAU(12, d_k=8, block_size=2, attention="fsq")),
    ("gau-soft-vq", lambda: GAU(12, d_k=8, codebook_size=6, block_size=2, attention="soft-vq")),
    ("gau-softmax", lambda: GAU(12, d_k=8, block_size=2, attention="softmax")),
    ("linformer", lambda: LinformerAttention(12, 2, max_len=8, k=3)),
    ("short-convolution", lambda: ShortConvolution(12, 3)),
]


@pytest.mark.parametrize("case_id, make", LAYER_EMPTY, ids=[c[0] for c in LAYER_EMPTY])
def test_a_layer_refuses_an_empty_batch(case_id, make):
    layer = make().double()
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=EMPTY.format(name="x")):
            layer(torch.zeros(0, 3, 12, dtype=F64))


@pytest.mark.parametrize("quantizer", [VectorQuantizer(1, 4, 5), FSQuantizer(1, 4, (3, 3))], ids=["vq", "fsq"])
def test_a_quantizer_refuses_an_empty_batch(quantizer):
    with pytest.raises(ValueError, match=EMPTY.format(name="k")):
        quantizer(torch.zeros(0, 1, 3, 4))


@pytest.mark.parametrize("attention", ["vq", "linear:elu", "favor", "delta", "local:4", "softmax", "soft-vq",
                                       "gau-softmax", "vq-fsq", "retnet", "gla", "gated-delta"])
def test_the_lm_refuses_an_empty_batch(attention):
    model = tiny_lm(attention)
    empty = torch.zeros(0, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=EMPTY.format(name="ids")):
        model(empty)
    with pytest.raises(ValueError, match=r"batch size 0.*at least one row"):  # the prompt, however generate names it
        next(model.generate(empty, 2))
    _, state, _ = model(ids(B=1))
    with pytest.raises(ValueError, match=EMPTY.format(name="ids")):
        model(empty, state)
    assert isinstance(state, LMState)
