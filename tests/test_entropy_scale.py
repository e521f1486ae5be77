"""The entropy-invariant scale (``log_512(n) / sqrt(d)``, n = keys a query sees) and NoPE for
the exact softmax layer kinds (``softmax``, ``local``, ``gau-softmax``): against formulas
written here, decode == full pass in float64, and the layer-spec flags that select them."""

from __future__ import annotations

import math

import pytest
import torch

import linattn
from _helpers import assert_decodes_as_full_pass, head_fields
from linattn.nn import GAU, Attention

F64 = torch.float64


def _attention(mechanism: str, **options) -> Attention:
    torch.manual_seed(0)
    return Attention(8, 1, mechanism=mechanism, **options).double()


def _by_hand(layer: Attention, x: torch.Tensor, window: int | None) -> torch.Tensor:
    """One head, no positions: ``softmax_j(log_512(n_t)/sqrt(d) q_t.k_j) v_j`` over the keys
    query t sees (all j <= t, or the last ``window`` of them)."""
    q, k, v = layer.q_proj(x[0]), layer.k_proj(x[0]), layer.v_proj(x[0])
    rows = []
    for t in range(x.shape[1]):
        first = 0 if window is None else max(0, t - window + 1)
        n = t + 1 - first
        weights = torch.softmax(math.log(n) / math.log(512) / math.sqrt(8) * (k[first : t + 1] @ q[t]), dim=0)
        rows.append(weights @ v[first : t + 1])
    return layer.o_proj(torch.stack(rows)).unsqueeze(0)


@pytest.mark.parametrize("mechanism, window", [("softmax", None), ("local", 3)])
def test_entropy_scale_equals_the_formula(mechanism, window):
    options = dict(window=window) if window else {}
    layer = _attention(mechanism, rotary=False, scale="entropy", **options)
    x = torch.randn(1, 9, 8, dtype=F64)
    y, _, _ = layer(x)
    torch.testing.assert_close(y, _by_hand(layer, x, window), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mechanism", ["softmax", "local"])
@pytest.mark.parametrize("rotary", [True, False])
def test_entropy_scale_decodes_as_the_full_pass(mechanism, rotary):
    options = dict(window=4) if mechanism == "local" else {}
    layer = _attention(mechanism, rotary=rotary, scale="entropy", **options)
    x = torch.randn(2, 11, 8, dtype=F64)
    full, _, _ = layer(x)
    out, state = [], None
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 11)):
        y, state, _ = layer(x[:, start:stop], state)
        out.append(y)
    torch.testing.assert_close(torch.cat(out, 1), full, rtol=1e-12, atol=1e-12)


def test_nope_sees_its_past_as_a_set():
    """Without positions, a query's output does not depend on the order of the keys before it
    (with rotary positions it does)."""
    x = torch.randn(1, 7, 8, dtype=F64)
    shuffled = torch.cat([x[:, [3, 0, 5, 1, 4, 2]], x[:, 6:]], 1)
    for rotary, same in ((False, True), (True, False)):
        layer = _attention("softmax", rotary=rotary)
        last = [layer(inputs)[0][:, -1] for inputs in (x, shuffled)]
        assert torch.allclose(*last, rtol=1e-12, atol=1e-12) == same


def test_gau_entropy_scale_is_one_at_512_keys():
    """The GAU's entropy scale multiplies query i's logits by log_512(i + 1): at i = 511 the
    unit computes exactly what the default scale does, elsewhere not."""
    torch.manual_seed(1)
    default = GAU(8, d_k=8, d_v=8, block_size=4, attention="softmax").double()
    entropy = GAU(8, d_k=8, d_v=8, block_size=4, attention="softmax", scale="entropy").double()
    entropy.load_state_dict(default.state_dict())
    with torch.no_grad():
        for p in default.parameters():
            p.add_(0.3 * torch.randn_like(p))
        entropy.load_state_dict(default.state_dict())
    x = torch.randn(1, 513, 8, dtype=F64)
    a, b = default(x)[0], entropy(x)[0]
    torch.testing.assert_close(b[:, 511], a[:, 511], rtol=1e-10, atol=1e-12)
    assert not torch.allclose(b[:, 100], a[:, 100])
    assert not torch.allclose(b[:, 512], a[:, 512])


@pytest.mark.parametrize("attention", ["softmax:entropy", "softmax:nope:entropy", "local:3:entropy",
                                       "gau-softmax:entropy", "local:4,local:4,softmax:nope:entropy"])
def test_lm_decodes_as_the_full_pass(attention):
    config = linattn.LMConfig(d_model=16, n_layers=len(attention.split(",")) if "," in attention else 2,
                              attention=attention, gau_d_k=8, block_size=4, **head_fields(attention, n_heads=2))
    torch.manual_seed(0)
    model = linattn.LM(config).double().eval()
    assert_decodes_as_full_pass(model, torch.randint(0, 256, (2, 13)), prefill=6)


def test_specs_and_the_config_choose_the_scale_and_positions():
    config = linattn.LMConfig(d_model=16, n_layers=4, n_heads=2, gau_d_k=8, block_size=4,
                              attention="local:4,local:nope,softmax:nope:entropy,gau-softmax")
    model = linattn.LM(config)
    mixers = [layer.mixer for layer in model.layers[:3]]
    assert [(m.mechanism, m.window, m.rotary, m.scale) for m in mixers] == [
        ("local", 4, True, "default"), ("local", 256, False, "default"), ("softmax", 256, False, "entropy")]
    assert model.layers[3].units[0].scale == "default"
    everywhere = linattn.LMConfig(d_model=16, n_layers=3, n_heads=2, gau_d_k=8, block_size=4,
                                  attention="softmax,local:4,gau-softmax", attention_scale="entropy")
    model = linattn.LM(everywhere)
    assert [model.layers[0].mixer.scale, model.layers[1].mixer.scale, model.layers[2].units[1].scale] == [
        "entropy"] * 3
    assert linattn.LMConfig(d_model=6, n_heads=2, attention="softmax:nope").layer_specs()  # odd head_dim, no rotary


@pytest.mark.parametrize("spec", ["softmax:nope:nope", "softmax:rope", "softmax:4", "local:0", "local:nope:4",
                                  "gau-softmax:nope", "vq:entropy", "linear:elu:entropy"])
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError, match="layer attention spec"):
        linattn.LMConfig(d_model=16, n_heads=2, attention=spec)


def test_bad_scale_arguments_are_refused():
    with pytest.raises(ValueError, match="attention_scale"):
        linattn.LMConfig(attention_scale="log")
    with pytest.raises(ValueError, match="entropy"):
        Attention(8, 1, mechanism="linear", scale="entropy")
    with pytest.raises(ValueError, match="entropy"):
        GAU(8, d_k=8, attention="vq", scale="entropy")
    with pytest.raises(ValueError, match="scale"):
        Attention(8, 1, scale="log")
    with pytest.raises(ValueError, match="even head dimension"):
        linattn.LMConfig(d_model=6, n_heads=2, attention="softmax:entropy")
