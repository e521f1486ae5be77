"""The layer interface and the layer-kind registry (docs/design.md, section 5)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import linattn
from linattn.models import layers as layer_registry
from linattn.models.layers import LayerKind, PreNormBlock
from _helpers import head_fields

F64 = torch.float64
TINY = dict(d_model=16, n_heads=2, gau_d_k=8, codebook_size=8, block_size=4, local_window=4, chunk_size=4)
ALL_SPECS = "vq,soft-vq,gau-softmax,softmax,linear:elu,favor,delta,retnet,gla,gated-delta,local,vq-attn:bias"


class _CausalMean(nn.Module):
    """A test mixer: ``y_t = W_o mean_{j <= t} x_j`` with the running sum and count as state."""

    def __init__(self, d_model: int):
        super().__init__()
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, state=None):
        total, count = (torch.zeros_like(x[:, 0]), 0) if state is None else state
        sums = total.unsqueeze(1) + x.cumsum(1)
        counts = count + torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        return self.o_proj(sums / counts), (sums[:, -1], count + x.shape[1]), {}


@pytest.fixture
def causal_mean_kind():
    kind = LayerKind("causal-mean", lambda config, spec, index: PreNormBlock(config, _CausalMean(config.d_model)),
                     "'causal-mean'", output_projections=("mixer.o_proj", "ffn.w_down"))
    linattn.register_layer_kind(kind)
    yield kind
    layer_registry._LAYER_KINDS.pop("causal-mean")


def test_registered_kind_builds_trains_and_decodes(causal_mean_kind):
    config = linattn.LMConfig(n_layers=2, attention="causal-mean,vq", **TINY)
    torch.manual_seed(0)
    model = linattn.LM(config).double().eval()
    assert isinstance(model.layers[0].mixer, _CausalMean)
    assert "'causal-mean'" in linattn.models.layer_spec_help()
    ids = torch.randint(0, 256, (2, 9))
    full, _, _ = model(ids)
    state, pieces = None, []
    for t in range(ids.shape[1]):
        logits, state, _ = model(ids[:, t : t + 1], state)
        pieces.append(logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-12)


def test_output_projections_follow_the_kind(causal_mean_kind):
    config = linattn.LMConfig(n_layers=4, attention="causal-mean", init_std=0.5, **TINY)
    torch.manual_seed(0)
    model = linattn.LM(config)
    output_std = 0.5 / (2 * 4) ** 0.5
    for layer in model.layers:
        assert layer.mixer.o_proj.weight.std().item() == pytest.approx(output_std, rel=0.25)
        assert layer.ffn.w_down.weight.std().item() == pytest.approx(output_std, rel=0.25)
        assert layer.ffn.w_up.weight.std().item() == pytest.approx(0.5, rel=0.25)


def test_carry_policy_comes_from_the_kind():
    config = linattn.LMConfig(n_layers=2, attention="softmax,local:4", softmax_memory=3, **TINY)
    model = linattn.LM(config)
    _, state, _ = model(torch.randint(0, 256, (1, 10)))
    carried = model.carry(state)
    assert carried.layers[0].keys.shape[2] == 3  # softmax cache cut to softmax_memory
    assert carried.layers[1].keys.shape[2] == state.layers[1].keys.shape[2]  # local window kept whole
    assert not carried.layers[0].keys.requires_grad
    assert model.has_growing_cache
    assert not linattn.LM(linattn.LMConfig(n_layers=1, attention="local:4", **TINY)).has_growing_cache


def test_every_builtin_mixer_has_the_common_interface():
    x = torch.randn(2, 5, 16, dtype=F64)
    config = linattn.LMConfig(n_layers=12, attention=ALL_SPECS, **TINY)
    model = linattn.LM(config).double()
    mixers = [m for m in model.modules() if isinstance(m, (
        linattn.nn.Attention, linattn.nn.DeltaNet, linattn.nn.GAU, linattn.nn.MultiScaleRetention,
        linattn.nn.GatedLinearAttention, linattn.nn.GatedDeltaNet, linattn.nn.MultiHeadVQAttention))]
    mixers.append(linattn.nn.LinformerAttention(16, 2, max_len=8, k=4).double())
    assert len(mixers) == 16
    for mixer in mixers:
        y, state, aux = mixer(x)
        assert y.shape == x.shape and isinstance(aux, dict)


def test_registry_rejects_duplicates_and_bad_names():
    with pytest.raises(ValueError, match="already registered"):
        linattn.register_layer_kind(LayerKind("vq", lambda *a: None, "'vq'"))
    with pytest.raises(ValueError, match="without ':'"):
        linattn.register_layer_kind(LayerKind("a:b", lambda *a: None, "'a:b'"))
    with pytest.raises(TypeError, match="LayerKind"):
        linattn.register_layer_kind("vq")


def test_linformer_refuses_a_state():
    layer = linattn.nn.LinformerAttention(8, 2, max_len=4, k=2)
    with pytest.raises(ValueError, match="state must be None"):
        layer(torch.randn(1, 3, 8), object())


def test_mixers_have_no_projection_biases():
    config = linattn.LMConfig(n_layers=12, attention=ALL_SPECS, **TINY)
    model = linattn.LM(config)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) > 30
    assert all(m.bias is None for _, m in linears), [name for name, m in linears if m.bias is not None]


@pytest.mark.parametrize("mechanism", ["softmax", "local"])
def test_softmax_mechanisms_use_rotary_positions_by_default(mechanism):
    torch.manual_seed(0)
    default = linattn.nn.Attention(16, 2, mechanism=mechanism, window=4).double()
    plain = linattn.nn.Attention(16, 2, mechanism=mechanism, window=4, rotary=False).double()
    plain.load_state_dict(default.state_dict())
    with_rotary = linattn.nn.Attention(16, 2, mechanism=mechanism, window=4, rotary=True).double()
    with_rotary.load_state_dict(default.state_dict())
    x = torch.randn(1, 6, 16, dtype=F64)
    assert torch.equal(default(x)[0], with_rotary(x)[0])
    assert not torch.allclose(default(x)[0], plain(x)[0])


def test_attention_head_layouts_and_state_steps():
    """MQA (one key/value head) and one-wide heads are valid; the KV cache counts positions."""
    mqa = linattn.nn.Attention(16, 4, n_kv_heads=1).double()
    narrow = linattn.nn.Attention(16, 2, mechanism="linear", head_dim=1).double()
    x = torch.randn(2, 5, 16, dtype=F64)
    assert narrow(x)[0].shape == x.shape
    state = None
    for t in range(5):
        _, state, _ = mqa(x[:, t : t + 1], state)
        assert state.steps == t + 1 and state.keys.shape[2] == t + 1


def test_rotary_is_a_complex_rotation_by_position_times_frequency():
    """RoPE written as complex numbers: pair m of position p is multiplied by
    exp(i p base^(-2m/D)); dot products then depend on the offset between positions only."""
    from linattn.nn.rotary import apply_rotary

    x = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    rotated = apply_rotary(x, offset=3, base=100.0)
    pairs = torch.view_as_complex(x.unflatten(-1, (4, 2)).contiguous())
    frequencies = 100.0 ** (-torch.arange(0, 8, 2, dtype=F64) / 8)
    angles = torch.arange(3, 8, dtype=F64)[:, None] * frequencies[None, :]
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
    torch.testing.assert_close(rotated, expected, rtol=1e-12, atol=1e-12)
    q, k = x[:, :, :1], x[:, :, 1:2]
    near = (apply_rotary(q, 7) * apply_rotary(k, 4)).sum()
    far = (apply_rotary(q, 107) * apply_rotary(k, 104)).sum()
    torch.testing.assert_close(near, far, rtol=1e-10, atol=1e-12)
    assert apply_rotary(x.float(), 2).dtype == torch.float32


def test_short_convolution_and_linformer_initial_scales():
    torch.manual_seed(0)
    conv = linattn.nn.ShortConvolution(64, kernel_size=4)
    bound = 1 / 4**0.5
    for tensor in (conv.weight, conv.bias):
        assert tensor.abs().max() <= bound and tensor.std() > bound / 4
    layer = linattn.nn.LinformerAttention(16, 2, max_len=256, k=64)
    for tensor in (layer.E, layer.F):
        assert abs(tensor.std().item() - 64**-0.5) < 0.1 * 64**-0.5
    assert all(m.bias is None for m in layer.modules() if isinstance(m, nn.Linear))
    assert linattn.nn.DeltaNet(16, 2, head_dim=1)(torch.randn(1, 3, 16))[0].shape == (1, 3, 16)


def test_one_tap_convolution_and_linformer_input_checks():
    conv = linattn.nn.ShortConvolution(4, kernel_size=1)
    assert conv(torch.randn(1, 3, 4))[0].shape == (1, 3, 4)
    layer = linattn.nn.LinformerAttention(8, 2, max_len=4, k=2)
    with pytest.raises(ValueError, match=r"\[batch, length, 8\]"):
        layer(torch.randn(1, 3, 6))  # three dimensions, the wrong width


# ----------------------------------------------------------------------------- mutation gaps (2026-12-01)


def test_only_dpfp_takes_a_degree_of_at_least_one():
    from linattn.models.layers import parse_layer_spec

    for spec in ("linear:dpfp:1", "linear:dpfp:3"):
        assert str(parse_layer_spec(spec)) == spec
    model = linattn.LM(linattn.LMConfig(n_layers=1, attention="linear:dpfp:1", **TINY))
    assert model.layers[0].mixer.feature_map.nu == 1
    for spec in ("linear:elu:2", "linear:relu:1", "linear:dpfp:0", "linear:dpfp:x"):
        with pytest.raises(ValueError, match="unknown layer attention spec"):
            parse_layer_spec(spec)


def test_layer_kinds_cannot_be_changed_after_registration():
    kind = layer_registry.layer_kind("gau-softmax")
    with pytest.raises(dataclasses.FrozenInstanceError):
        kind.growing_cache = kind.growing_cache  # the same value: nothing changes even where it is allowed


def test_blocks_add_their_residual_branches():
    """PreNormBlock: ``h = x + mixer(norm(x))``, ``out = h + SwiGLU(norm(h))``; GAUPair:
    ``h = x + GAU_0(x)``, ``out = h + GAU_1(h)`` (each unit normalises its own input)."""
    config = linattn.LMConfig(n_layers=2, attention="softmax,vq", **TINY)
    torch.manual_seed(0)
    block, pair = linattn.LM(config).double().eval().layers
    x = torch.randn(2, 5, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = x + block.mixer(block.mixer_norm(x))[0]
        expected = h + block.ffn(block.ffn_norm(h))
        torch.testing.assert_close(block(x)[0], expected, rtol=1e-12, atol=1e-12)
        h = x + pair.units[0](x)[0]
        expected = h + pair.units[1](h)[0]
        torch.testing.assert_close(pair(x)[0], expected, rtol=1e-12, atol=1e-12)


def test_favor_layers_draw_their_features_from_the_seed_plus_their_index():
    config = linattn.LMConfig(n_layers=3, attention="favor:8", feature_seed=5, **TINY)
    model = linattn.LM(config)
    head_dim = TINY["d_model"] // TINY["n_heads"]
    drawn = [layer.mixer.feature_map.projection(head_dim) for layer in model.layers]
    for i, projection in enumerate(drawn):
        assert torch.equal(projection, linattn.ops.kernel.FAVOR(8, seed=5 + i).projection(head_dim)), i
    assert not torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[1], drawn[2])


def test_one_wide_heads_are_allowed_and_fewer_channels_than_heads_are_not():
    config = linattn.LMConfig(n_layers=3, attention="linear:elu,favor:8,delta", **{**TINY, "d_model": 4, "n_heads": 4})
    logits, _, _ = linattn.LM(config)(torch.randint(0, 256, (1, 5)))
    assert logits.shape == (1, 5, 256)
    linattn.LMConfig(n_layers=1, attention="linear:elu", head_dim=1, **TINY)
    with pytest.raises(ValueError, match=r"n_heads=4 must divide d_model=3 \(.*3 of its 3 channels unused"):
        linattn.LMConfig(n_layers=1, attention="linear:elu", **{**TINY, "d_model": 3, "n_heads": 4})


def _state_numel(value):
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (tuple, list)):
        return sum(_state_numel(item) for item in value)
    if dataclasses.is_dataclass(value):
        return sum(_state_numel(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


@pytest.mark.parametrize("spec", ["vq", "soft-vq", "gau-softmax", "softmax", "linear:elu", "favor:8", "delta",
                                  "retnet", "gla", "gated-delta", "local:4"])
@torch.no_grad()
def test_growing_cache_flag_says_whether_the_decode_state_grows(spec):
    model = linattn.LM(linattn.LMConfig(n_layers=1, attention=spec, **head_fields(spec, **TINY))).eval()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    _, state, _ = model(ids[:, :8])
    before = _state_numel(state)
    _, state, _ = model(ids[:, 8:], state)  # 16 more tokens, the same phase of every block and window
    assert before > 0
    assert model.has_growing_cache == (_state_numel(state) > before), (spec, before, _state_numel(state))


def test_parsed_specs_are_frozen_and_hashable():
    spec = layer_registry.parse_layer_spec("local:4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.option = "8"
    assert {spec: 1}[layer_registry.LayerSpec("local", "4")] == 1


@pytest.mark.parametrize("spec", ["favor:1", "local:1", "local:1:nope"])
def test_counts_of_one_are_accepted(spec):
    parsed = layer_registry.parse_layer_spec(spec)
    assert str(parsed) == spec


@pytest.mark.parametrize("spec", ["favor:0", "local:0"])
def test_counts_of_zero_are_refused(spec):
    with pytest.raises(ValueError, match="unknown layer attention spec"):
        layer_registry.parse_layer_spec(spec)


@pytest.mark.parametrize("spec", [3, None, "", "   "])
def test_specs_that_are_not_non_empty_strings_are_refused_by_name(spec):
    with pytest.raises(ValueError, match="must be a non-empty string"):
        layer_registry.parse_layer_spec(spec)


def test_entropy_flag_sets_the_scale_and_its_absence_keeps_the_config_scale():
    config = linattn.LMConfig(n_layers=2, attention="softmax:entropy,softmax", **TINY)
    model = linattn.LM(config)
    assert model.layers[0].mixer.scale == "entropy"
    assert model.layers[1].mixer.scale == config.attention_scale != "entropy"


def test_delta_layers_normalize_identity_features_by_l2_and_others_by_their_sum():
    model = linattn.LM(linattn.LMConfig(n_layers=2, attention="delta,delta:elu", **TINY))
    assert model.layers[0].mixer.normalize == "l2"
    assert model.layers[1].mixer.normalize == "sum"


def test_rotary_head_dim_is_d_model_over_n_heads_or_head_dim():
    # 12 / 3 = 4 channels per head: even, so rotary positions fit
    linattn.LMConfig(n_layers=1, attention="softmax", **{**TINY, "d_model": 12, "n_heads": 3})
    with pytest.raises(ValueError, match="got head_dim=3 "):  # 12 / 4
        linattn.LMConfig(n_layers=1, attention="softmax", **{**TINY, "d_model": 12, "n_heads": 4})
    with pytest.raises(ValueError, match="got head_dim=1 "):
        linattn.LMConfig(n_layers=1, attention="softmax", head_dim=1, **{**TINY, "d_model": 6, "n_heads": 4})


@pytest.mark.parametrize("kind", ["softmax", "local"])
def test_only_nope_layers_accept_an_odd_head_dim(kind):
    odd = {**TINY, "d_model": 6, "n_heads": 2}  # head_dim 3
    linattn.LMConfig(n_layers=1, attention=f"{kind}:nope", **odd)
    with pytest.raises(ValueError, match="even head dimension"):
        linattn.LMConfig(n_layers=1, attention=kind, **odd)
