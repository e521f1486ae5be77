"""The gated layers: multi-scale retention (``retnet``), gated linear attention (``gla``) and
Gated DeltaNet (``gated-delta``). Each layer's forward equals its math written out here in
float64 with a loop over positions (the projections, rotary positions, gates, norms and the
recurrence step by step; the ops are not called), gradients included; decoding token by token
and in pieces equals the full pass; states of another kind, setting or batch are refused;
outputs are causal; strong decays stay finite; the layer kinds build, train and decode."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import linattn
from _helpers import F64
from linattn.nn import DeltaNet, GatedDeltaNet, GatedLinearAttention, MultiScaleRetention
from linattn.state import (DeltaNetState, GatedDeltaNetState, GatedLinearAttentionState, LinearAttentionState,
                           RetentionState)
from linattn.train.optim import parameter_groups

torch.set_num_threads(1)

D_MODEL, HEADS, KV_HEADS = 24, 4, 2
LAYERS = {"retnet": MultiScaleRetention, "gla": GatedLinearAttention, "gated-delta": GatedDeltaNet}
KINDS = list(LAYERS)


def _randomize(layer, seed: int):
    """Every parameter drawn at random (norm gains and biases too, so a norm or bias left out
    of the computation shows), in float64."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale, shift = (0.5 if p.dim() >= 2 else 0.3), (1.0 if "norm.weight" in name else 0.0)
            p.copy_(scale * torch.randn(p.shape, generator=generator, dtype=F64) + shift)
    return layer


def make(kind: str, *, seed: int = 0, n_kv_heads: int = KV_HEADS, chunk_size: int = 4, **options):
    torch.manual_seed(seed)
    layer = LAYERS[kind](D_MODEL, HEADS, n_kv_heads=n_kv_heads, chunk_size=chunk_size, **options).double()
    return _randomize(layer, seed)


def inputs(B=2, T=11, seed=1, requires_grad=False):
    x = torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return x.requires_grad_(requires_grad)


# ----------------------------------------------------------------------------- the math, written out


def linear(x, layer):
    return x @ layer.weight.T


def split_heads(t, n):
    """``[B, T, n * d]`` -> ``[B, T, n, d]``."""
    return t.view(*t.shape[:2], n, -1)


def rotate(x, position: int, base: float):
    """RoPE at one position on ``x [..., D]``: the pair ``(x_2m, x_2m+1)`` as the complex number
    ``x_2m + i x_2m+1`` times ``exp(i position base^(-2m/D))``."""
    D = x.shape[-1]
    z = torch.complex(x[..., 0::2], x[..., 1::2])
    angles = position * base ** (-torch.arange(0, D, 2, dtype=F64) / D)
    turned = z * torch.exp(1j * angles)
    return torch.stack([turned.real, turned.imag], dim=-1).flatten(-2)


def read(S, q_t, H):
    """``o_h = S_{h // G}^T q_h`` for every query head h (G query heads share a key/value head):
    ``S [B, Hkv, Dk, Dv]``, ``q_t [B, H, Dk]`` -> ``[B, H, Dv]``."""
    group = H // S.shape[1]
    return torch.stack([(S[:, h // group] * q_t[:, h, :, None]).sum(1) for h in range(H)], 1)


def rms_norm(o, norm):
    return o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def gated_output(layer, x, o, norm):
    """``W_o (norm(o) * swish(W_g x))`` for head outputs ``o [B, T, H, D]``."""
    gate = linear(x, layer.gate_proj)
    gate = gate * torch.sigmoid(gate)
    return linear(norm(o).flatten(2) * gate, layer.o_proj)


def retnet_reference(layer: MultiScaleRetention, x):
    B, T, _ = x.shape
    H, Hkv, D = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q, k, v = (split_heads(linear(x, p), n) for p, n in ((layer.q_proj, H), (layer.k_proj, Hkv), (layer.v_proj, Hkv)))
    gammas = [1 - 2.0 ** (-5 - h) for h in range(Hkv)]  # RetNet, section 2.2
    S = torch.zeros(B, Hkv, D, D, dtype=F64)
    outs = []
    for t in range(T):
        q_t = rotate(q[:, t], t, layer.rotary_base)
        k_t = rotate(k[:, t], t, layer.rotary_base)
        S = torch.stack([gammas[h] * S[:, h] + k_t[:, h, :, None] * v[:, t, h, None, :] for h in range(Hkv)], 1)
        outs.append(read(S, q_t, H))
    o = torch.stack(outs, 1) / math.sqrt(D)  # [B, T, H, D]

    def group_norm(o):
        mean = o.mean(-1, keepdim=True)
        var = (o - mean).pow(2).mean(-1, keepdim=True)
        normed = (o - mean) / torch.sqrt(var + layer.group_norm.eps)
        return normed * layer.group_norm.weight.view(H, D) + layer.group_norm.bias.view(H, D)

    return gated_output(layer, x, o, group_norm), S


def gla_reference(layer: GatedLinearAttention, x):
    B, T, _ = x.shape
    H, Hkv, D = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q, k, v = (split_heads(linear(x, p), n) for p, n in ((layer.q_proj, H), (layer.k_proj, Hkv), (layer.v_proj, Hkv)))
    # the paper's form of the gate: alpha = sigmoid(x W1 W2 + b)^(1/tau)
    alpha = torch.sigmoid(linear(linear(x, layer.decay_down), layer.decay_up) + layer.decay_bias)
    alpha = split_heads(alpha ** (1 / layer.gate_temperature), Hkv)
    S = torch.zeros(B, Hkv, D, D, dtype=F64)
    outs = []
    for t in range(T):
        S = alpha[:, t, :, :, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(read(S, q[:, t], H))
    o = torch.stack(outs, 1) / math.sqrt(D)
    return gated_output(layer, x, o, lambda o: rms_norm(o, layer.norm)), S


def gated_delta_reference(layer: GatedDeltaNet, x):
    B, T, _ = x.shape
    H, Hkv, D = layer.n_heads, layer.n_kv_heads, layer.head_dim
    qkv = torch.cat([linear(x, layer.q_proj), linear(x, layer.k_proj), linear(x, layer.v_proj)], -1)
    if layer.conv is not None:  # causal depthwise: y_t = b + sum_i w_i qkv_{t-K+1+i}, zeros before 0
        K = layer.conv.kernel_size
        padded = F.pad(qkv, (0, 0, K - 1, 0))
        qkv = torch.stack([(padded[:, t : t + K] * layer.conv.weight[:, 0].T).sum(1) for t in range(T)], 1)
        qkv = qkv + layer.conv.bias
    qkv = qkv * torch.sigmoid(qkv)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    q, k, v = split_heads(q, H), split_heads(k, Hkv), split_heads(v, Hkv)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    beta = torch.sigmoid(linear(x, layer.beta_proj))  # [B, T, Hkv]
    dt = F.softplus(linear(x, layer.decay_proj) + layer.dt_bias)
    alpha = torch.exp(-torch.exp(layer.A_log) * dt)  # Mamba-2's exp(-dt A)
    eye = torch.eye(D, dtype=F64)
    S = torch.zeros(B, Hkv, D, D, dtype=F64)
    outs = []
    for t in range(T):
        k_t, v_t, b_t = k[:, t, :, :, None], v[:, t, :, None, :], beta[:, t, :, None, None]
        S = (eye - b_t * k_t @ k_t.transpose(-1, -2)) @ (alpha[:, t, :, None, None] * S) + b_t * k_t @ v_t
        outs.append(read(S, q[:, t], H))
    o = torch.stack(outs, 1) / math.sqrt(D)
    return gated_output(layer, x, o, lambda o: rms_norm(o, layer.norm)), S


REFERENCES = {"retnet": retnet_reference, "gla": gla_reference, "gated-delta": gated_delta_reference}
STATE_TYPES = {"retnet": RetentionState, "gla": GatedLinearAttentionState, "gated-delta": GatedDeltaNetState}


def final_memory(state):
    """The recurrent matrix ``[B, Hkv, Dk, Dv]`` inside a layer's state."""
    return state.rule.memory if hasattr(state, "rule") else state.attention.kv


# ----------------------------------------------------------------------------- forward and gradients


LAYOUTS = [
    dict(n_kv_heads=2, chunk_size=4),  # GQA, T = 11 not a multiple of the chunk
    dict(n_kv_heads=4, chunk_size=64),  # one chunk longer than the sequence
    dict(n_kv_heads=1, chunk_size=3),  # MQA
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["gqa-chunk4", "mha-chunk64", "mqa-chunk3"])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_final_state_equal_the_written_out_recurrence(kind, layout):
    layer = make(kind, **layout)
    x = inputs()
    y, state, aux = layer(x)
    expected, memory = REFERENCES[kind](layer, x)
    assert aux == {} and isinstance(state, STATE_TYPES[kind]) and state.steps == 11
    assert expected.abs().max() > 0.1  # not a trivial comparison
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final_memory(state), memory, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_the_written_out_recurrence_and_are_finite(kind):
    """Gradients w.r.t. the input and every parameter (the decays' A_log, dt_bias and gate bias
    included), float64, against autograd through the loop above."""
    layer = make(kind)
    x = inputs(T=9, requires_grad=True)
    weights = torch.randn(2, 9, D_MODEL, generator=torch.Generator().manual_seed(7), dtype=F64)
    names = [name for name, _ in layer.named_parameters()]
    params = [p for _, p in layer.named_parameters()]
    got = torch.autograd.grad((layer(x)[0] * weights).sum(), [x, *params])
    wanted = torch.autograd.grad((REFERENCES[kind](layer, x)[0] * weights).sum(), [x, *params])
    for name, a, b in zip(["x", *names], got, wanted):
        assert torch.isfinite(a).all(), name
        assert b.abs().max() > 0, name  # every parameter takes part
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda text, name=name: f"{name}: {text}")


@pytest.mark.parametrize("kind", KINDS)
def test_float32_training_step_over_several_chunks_has_finite_gradients(kind):
    torch.manual_seed(0)
    layer = LAYERS[kind](32, 4, chunk_size=16)
    x = torch.randn(2, 70, 32, requires_grad=True)
    y, _, _ = layer(x)
    y.pow(2).mean().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()} | {"x": x.grad}
    assert all(g is not None and torch.isfinite(g).all() and g.abs().max() > 0 for g in grads.values()), grads.keys()


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_token_by_token_and_in_pieces_equals_the_full_pass(kind):
    layer = make(kind)
    x = inputs(T=13)
    full, full_state, _ = layer(x)
    state, pieces = None, []
    for t in range(13):
        y, state, _ = layer(x[:, t : t + 1], state)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(final_memory(state), final_memory(full_state), rtol=1e-10, atol=1e-12)
    assert state.steps == full_state.steps == 13
    # prefill 5, then decode one token at a time
    prefill, state, _ = layer(x[:, :5])
    rest = []
    for t in range(5, 13):
        y, state, _ = layer(x[:, t : t + 1], state)
        rest.append(y)
    torch.testing.assert_close(torch.cat([prefill, *rest], 1), full, rtol=1e-10, atol=1e-12)
    # uneven pieces, the state detached between them
    first, state, _ = layer(x[:, :6])
    second, _, _ = layer(x[:, 6:], state.detach())
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-10, atol=1e-12)
    # the contrast: without the state the second piece is another computation
    assert (layer(x[:, 6:])[0] - full[:, 6:]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_the_decode_state_has_a_constant_size(kind):
    layer = make(kind)
    x = inputs(T=40)
    sizes, state = [], None
    for t in range(40):
        _, state, _ = layer(x[:, t : t + 1], state)
        sizes.append(sum(t.numel() for t in _tensors(state)))
    assert len(set(sizes)) == 1


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "value_fields"):
        return [t for f in value.value_fields() for t in _tensors(getattr(value, f.name))]
    return []


# ----------------------------------------------------------------------------- what each layer is


def test_retention_decays_are_the_papers_and_positions_are_rotary():
    decays = linattn.nn.retention.retention_log_decays(4, dtype=F64)
    torch.testing.assert_close(decays.exp(), torch.tensor([1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128, 1 - 1 / 256],
                                                          dtype=F64), rtol=1e-15, atol=0)
    # a relative-position layer: shifting where the sequence starts (the state's step count,
    # with an empty memory) changes nothing; another rotary base does
    layer = make("retnet")
    x = inputs(T=7)
    empty = RetentionState(attention=LinearAttentionState(kv=torch.zeros(2, KV_HEADS, 6, 6, dtype=F64), steps=50,
                                                          feature_map="identity", normalize="none"),
                           steps=50, rotary_base=layer.rotary_base)
    torch.testing.assert_close(layer(x, empty)[0], layer(x)[0], rtol=1e-10, atol=1e-12)
    other = make("retnet", rotary_base=100.0)
    assert (other(x)[0] - layer(x)[0]).abs().max() > 1e-3


def test_gla_gate_temperature_and_rank_are_the_layers_settings():
    base = make("gla")
    assert base.gate_temperature == 16.0 and base.decay_down.out_features == 16
    hot = make("gla", gate_temperature=2.0)
    x = inputs()
    assert (hot(x)[0] - base(x)[0]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="gate_temperature"):
        GatedLinearAttention(D_MODEL, HEADS, gate_temperature=0.0)
    with pytest.raises(ValueError, match="gate_rank"):
        GatedLinearAttention(D_MODEL, HEADS, gate_rank=0)


def test_gated_delta_net_initial_decays_are_mamba2s():
    """A = exp(A_log) in [1, 16]; softplus(dt_bias) = dt in [1e-3, 1e-1]; no weight decay on them."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(64, 8, n_kv_heads=8)
    A, dt = layer.A_log.exp(), F.softplus(layer.dt_bias)
    assert (A >= 1).all() and (A <= 16).all() and A.max() - A.min() > 1
    assert (dt >= 1e-3 * (1 - 1e-6)).all() and (dt <= 1e-1 * (1 + 1e-6)).all() and dt.max() / dt.min() > 3
    no_decay = parameter_groups(layer, 0.1)[1]["params"]
    assert any(p is layer.A_log for p in no_decay) and any(p is layer.dt_bias for p in no_decay)


def test_gated_delta_net_without_a_short_convolution_applies_silu_alone():
    layer = make("gated-delta", short_conv=None)
    x = inputs()
    torch.testing.assert_close(layer(x)[0], gated_delta_reference(layer, x)[0], rtol=1e-10, atol=1e-12)
    assert layer(x)[1].conv is None and layer(x)[1].short_conv == 0


@pytest.mark.parametrize("kind", ["gla", "gated-delta"])
def test_strong_decays_stay_finite_and_exact(kind):
    """Decays of exp(-300) per step (each state forgets almost everything at once) over
    several chunks: finite, and equal to the loop."""
    layer = make(kind)
    with torch.no_grad():
        if kind == "gla":
            layer.decay_bias.fill_(-300.0 * layer.gate_temperature)  # logsigmoid(-4800) / 16 ~ -300
            layer.decay_up.weight.zero_()
        else:
            layer.A_log.fill_(math.log(16.0))
            layer.dt_bias.fill_(20.0)  # g ~ -16 * 20 = -320
    x = inputs(T=11)
    y, state, _ = layer(x)
    expected, memory = REFERENCES[kind](layer, x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(final_memory(state), memory, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_is_causal(kind):
    layer = make(kind)
    x = inputs(B=1, T=7)
    jac = torch.autograd.functional.jacobian(lambda inp: layer(inp)[0], x)  # [1, 7, D, 1, 7, D]
    for i in range(7):
        assert torch.all(jac[0, i, :, 0, i + 1 :, :] == 0), i
        assert jac[0, i, :, 0, i, :].abs().sum() > 0, i


@pytest.mark.parametrize("kind", KINDS)
def test_bad_inputs_are_named(kind):
    layer = make(kind)
    with pytest.raises(ValueError, match=r"x must have shape \[batch, length, 24\]"):
        layer(torch.zeros(2, 5, 23, dtype=F64))
    with pytest.raises(ValueError, match="x has batch size 0"):
        layer(torch.zeros(0, 5, D_MODEL, dtype=F64))
    cls = type(layer)
    with pytest.raises(ValueError, match="n_kv_heads=3 must be >= 1 and divide n_heads=4"):
        cls(D_MODEL, HEADS, n_kv_heads=3)


def test_retention_needs_an_even_head_dimension():
    with pytest.raises(ValueError, match="head_dim must be even"):
        MultiScaleRetention(15, 3)
    with pytest.raises(ValueError, match="'retnet' uses rotary positions"):
        linattn.LMConfig(n_layers=1, attention="retnet", d_model=15, n_heads=3)
    linattn.LMConfig(n_layers=2, attention="gla,gated-delta", d_model=15, n_heads=3)


# ----------------------------------------------------------------------------- states of another kind


def _state(kind, **options):
    return make(kind, **options)(inputs(T=5))[1]


@pytest.mark.parametrize("made_by, used_by", [("retnet", "gla"), ("gla", "retnet"), ("gated-delta", "retnet"),
                                              ("retnet", "gated-delta")])
def test_a_state_of_another_gated_kind_is_refused(made_by, used_by):
    state = _state(made_by)
    with pytest.raises(TypeError, match=f"state is a {STATE_TYPES[used_by].__name__}, got {type(state).__name__}"):
        make(used_by)(inputs(T=1, seed=2), state)
    make(made_by)(inputs(T=1, seed=2), state)  # the contrast: its own kind continues it


def test_delta_net_and_gated_delta_net_refuse_each_others_states():
    """Both hold a delta-rule memory of the same shape: only the state's type tells them apart."""
    gated = _state("gated-delta")
    torch.manual_seed(0)
    plain = DeltaNet(D_MODEL, HEADS, n_kv_heads=KV_HEADS, short_conv=4).double()
    plain_state = plain(inputs(T=5))[1]
    assert isinstance(plain_state, DeltaNetState)
    with pytest.raises(TypeError, match="GatedDeltaNet's state is a GatedDeltaNetState, got DeltaNetState"):
        make("gated-delta")(inputs(T=1), plain_state)
    with pytest.raises(TypeError, match="DeltaNet's state is a DeltaNetState, got GatedDeltaNetState"):
        plain(inputs(T=1), gated)


def test_retention_and_kernel_attention_refuse_each_others_states():
    """A retention state holds the sums of kernel attention (identity features, no normaliser):
    only the state's type tells them apart."""
    torch.manual_seed(0)
    kernel = linattn.nn.Attention(D_MODEL, HEADS, n_kv_heads=KV_HEADS, mechanism="linear",
                                  feature_map="identity").double()
    kernel_state = kernel(inputs(T=5))[1]
    assert isinstance(kernel_state, LinearAttentionState)
    with pytest.raises(TypeError, match="MultiScaleRetention's state is a RetentionState, got LinearAttentionState"):
        make("retnet")(inputs(T=1), kernel_state)
    with pytest.raises(TypeError, match="linear attention's state is a LinearAttentionState, got RetentionState"):
        kernel(inputs(T=1), _state("retnet"))


def test_the_lm_refuses_a_state_of_another_gated_kind():
    def model(attention):
        torch.manual_seed(0)
        return linattn.LM(linattn.LMConfig(d_model=16, n_heads=2, n_layers=1, attention=attention)).double().eval()

    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    _, state, _ = model("retnet")(ids)
    with pytest.raises(ValueError, match=r"attention=\['retnet'\].*attention=\['gla'\]"):
        model("gla")(ids[:, :1], state)
    model("retnet")(ids[:, :1], state)


# ----------------------------------------------------------------------------- the layer kinds


@pytest.mark.parametrize("kind", KINDS)
def test_the_kind_builds_its_layer_from_the_config(kind):
    config = linattn.LMConfig(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, attention=kind, chunk_size=8,
                              rotary_base=500.0, delta_short_conv=3)
    model = linattn.LM(config)
    mixer = model.layers[0].mixer
    assert type(mixer) is LAYERS[kind]
    assert (mixer.n_heads, mixer.n_kv_heads, mixer.head_dim, mixer.chunk_size) == (4, 2, 8, 8)
    if kind == "retnet":
        assert mixer.rotary_base == 500.0
    if kind == "gated-delta":
        assert mixer.conv.kernel_size == 3
        without = linattn.LMConfig(**{**config.to_dict(), "delta_short_conv": None})
        assert linattn.LM(without).layers[0].mixer.conv is None
    # output projections start with the residual std init_std / sqrt(2 n_layers)
    assert mixer.o_proj.weight.std().item() == pytest.approx(0.02 / 2, rel=0.2)
    assert mixer.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.2)


@pytest.mark.parametrize("spec", ["retnet:4", "gla:16", "gated-delta:elu", "gated_delta"])
def test_the_kinds_take_no_option(spec):
    with pytest.raises(ValueError, match="unknown layer attention spec"):
        linattn.LMConfig(n_layers=1, attention=spec)
