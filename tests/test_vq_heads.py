"""The layers a softmax transformer is converted into: ``vq-attn`` (``MultiHeadVQAttention``: multi-head
attention over keys quantized per key/value head, with ReRoPE or Transformer-VQ's windowed bias) and
``linear:hedgehog`` (kernel attention with Hedgehog's learned feature map), against the attention
written out in the test in float64, one query and key at a time; the EMA codebook update reaching
the new quantizers through the LM; decoding token by token; and what is refused, by name."""

from __future__ import annotations

import pytest
import torch

from linattn import LM, LMConfig
from linattn.nn.attention import Attention
from linattn.nn.hedgehog import HedgehogFeatureMap
from linattn.nn.rotary import apply_rotary
from linattn.nn.vq_heads import MultiHeadVQAttention
from linattn.state import VQAttentionState

from _helpers import assert_decodes_as_full_pass
from test_rerope import loop_attention

F64 = torch.float64
torch.set_num_threads(1)


def nearest_codes(k: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``k [B, Hkv, T, D]`` replaced by its nearest code of its head's codebook ``[Hkv, S, D]`` (loops)."""
    out = torch.empty_like(k)
    for b in range(k.shape[0]):
        for h in range(k.shape[1]):
            for t in range(k.shape[2]):
                distances = [float((k[b, h, t] - code).pow(2).sum()) for code in codebook[h]]
                out[b, h, t] = codebook[h][distances.index(min(distances))]
    return out


def vq_layer(positions: str, **options) -> MultiHeadVQAttention:
    torch.manual_seed(0)
    layer = MultiHeadVQAttention(16, 4, n_kv_heads=2, codebook_size=6, block_size=4, positions=positions,
                                 **options).double().eval()
    with torch.no_grad():
        layer.quantizer.codebook.copy_(torch.randn(2, 6, 4, dtype=F64))
        for projection in (layer.q_proj, layer.k_proj):
            projection.weight.mul_(8.0)  # scores large enough for positions and codes to matter
        if layer.relative_bias is not None:
            layer.relative_bias.copy_(torch.randn(4, 5, dtype=F64))
    return layer


def heads(x: torch.Tensor, projection, n: int) -> torch.Tensor:
    B, T, _ = x.shape
    return projection(x).view(B, T, n, -1).transpose(1, 2)


@pytest.mark.parametrize(("positions", "rerope"), [("rerope", None), ("rerope", 2), ("bias", None)])
def test_vq_attention_layer_is_softmax_over_the_nearest_codes(positions, rerope):
    """``y = W_o softmax(s) v`` with ``s_ij = (R(min(i - j, w)) q_i).c(k_j) / sqrt(d)`` (ReRoPE, w the
    block size by default) or ``q_i.c(k_j) / sqrt(d) + b_{h, i - j}`` for ``i - j <= L`` (the bias):
    T = 11 spans three blocks of 4 and is not a multiple of it; 4 query heads share 2 key heads."""
    layer = vq_layer(positions, rerope=rerope)
    x = torch.randn(2, 11, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y, state, aux = layer(x)
        q, k, v = heads(x, layer.q_proj, 4), heads(x, layer.k_proj, 2), heads(x, layer.v_proj, 2)
        k_hat = nearest_codes(k, layer.quantizer.codebook.double())
        if positions == "rerope":
            o = loop_attention(q, k_hat, v, 4 if rerope is None else rerope)
        else:
            bias = layer.relative_bias
            o = loop_attention(q, k_hat, v, None, L=4, extra=lambda b, h, t, d: bias[h, d])
        expected = layer.o_proj(o.transpose(1, 2).reshape(2, 11, 16))
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)
    assert isinstance(state, VQAttentionState) and state.steps == 11
    assert aux["codes"].shape == (2, 2, 11) and aux["commit_loss"] > 0
    # the positions matter: without ReRoPE's rotation (or the bias) the output differs
    with torch.no_grad():
        plain = layer.o_proj(loop_attention(q, k_hat, v, None).transpose(1, 2).reshape(2, 11, 16))
    assert (plain - y).abs().max() > 1e-3


def test_the_training_forward_feeds_the_codebook_ema_through_the_lm():
    """``LM.update_codebooks`` moves a ``vq-attn`` layer's codes by the EMA of the keys assigned to
    them in the last training forward: ``c = (g sums + (1 - g) s) / (g counts + (1 - g) n)``."""
    torch.manual_seed(0)
    config = LMConfig(d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, attention="vq-attn:rerope", codebook_size=5,
                      block_size=4, ema_decay=0.9)
    model = LM(config).double()
    quantizer = model.layers[0].mixer.quantizer
    before_counts, before_sums = quantizer.ema_counts.clone().double(), quantizer.ema_sums.clone().double()
    keys = []
    hook = model.layers[0].mixer.k_proj.register_forward_hook(lambda m, i, out: keys.append(out.detach()))
    model.train()(torch.randint(0, 256, (2, 9)))
    hook.remove()
    model.update_codebooks()
    k = keys[0].view(2, 9, 2, -1).transpose(1, 2)  # [B, Hkv, T, D]
    for h in range(2):
        codebook = before_sums[h] / before_counts[h].clamp_min(0.01)[:, None]
        rows = k[:, h].reshape(-1, k.shape[-1])
        chosen = torch.cdist(rows, codebook.to(rows)).argmin(-1)
        for s in range(5):
            n = float((chosen == s).sum())
            total = rows[chosen == s].sum(0)
            count = 0.9 * before_counts[h, s] + 0.1 * n
            torch.testing.assert_close(quantizer.codebook[h, s].double(), (0.9 * before_sums[h, s] + 0.1 * total)
                                       / max(float(count), 0.01), rtol=1e-5, atol=1e-6)
    assert not torch.equal(quantizer.codebook.double(), before_sums / before_counts[..., None])


def test_hedgehog_features_and_attention_follow_their_formulas():
    """``phi(x) = [softmax(x W_h), softmax(-x W_h)]``; the ``linear:hedgehog`` layer is
    ``W_o sum_j phi(q_i).phi(k_j) v_j / (sum_j phi(q_i).phi(k_j) + 1e-6)`` over rotary q and k (the
    kernel attention's epsilon)."""
    torch.manual_seed(0)
    feature_map = HedgehogFeatureMap(2, 3).double()
    with torch.no_grad():
        feature_map.weight.add_(torch.randn(2, 3, 3, dtype=F64))
    x = torch.randn(1, 2, 5, 3, dtype=F64)
    with torch.no_grad():
        phi = feature_map(x)
    weight = feature_map.weight.detach()
    for h in range(2):
        for t in range(5):
            z = [sum(float(x[0, h, t, d]) * float(weight[h, d, f]) for d in range(3)) for f in range(3)]
            positive = torch.tensor(z, dtype=F64).exp()
            negative = torch.tensor([-value for value in z], dtype=F64).exp()
            torch.testing.assert_close(phi[0, h, t], torch.cat([positive / positive.sum(), negative / negative.sum()]))
    layer = Attention(16, 4, n_kv_heads=2, mechanism="linear", feature_map="hedgehog", rotary=True).double()
    with torch.no_grad():
        for mapping in (layer.query_map, layer.key_map):
            mapping.weight.add_(torch.randn_like(mapping.weight))
    x = torch.randn(2, 7, 16, dtype=F64)
    with torch.no_grad():
        y, _, _ = layer(x)
        q = layer.query_map(apply_rotary(heads(x, layer.q_proj, 4)))
        k = layer.key_map(apply_rotary(heads(x, layer.k_proj, 2)))
        v = heads(x, layer.v_proj, 2)
        o = torch.zeros(2, 4, 7, 4, dtype=F64)
        for b in range(2):
            for h in range(4):
                for i in range(7):
                    weights = torch.stack([q[b, h, i] @ k[b, h // 2, j] for j in range(i + 1)])
                    o[b, h, i] = (weights[:, None] * v[b, h // 2, : i + 1]).sum(0) / (weights.sum() + 1e-6)
        expected = layer.o_proj(o.transpose(1, 2).reshape(2, 7, 16))
    torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("spec", ["vq-attn:rerope", "vq-attn:rerope=2", "vq-attn:bias", "linear:hedgehog"])
def test_decoding_one_token_at_a_time_equals_the_full_pass_with_a_constant_state(spec):
    torch.manual_seed(0)
    config = LMConfig(d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, attention=spec, codebook_size=6, block_size=4)
    model = LM(config).double().eval()
    with torch.no_grad():
        for quantizer in model.quantizers():
            quantizer.codebook.add_(0.3 * torch.randn_like(quantizer.codebook))
    ids = torch.randint(0, 256, (2, 15), generator=torch.Generator().manual_seed(2))
    assert_decodes_as_full_pass(model, ids, prefill=5)
    sizes = []
    with torch.no_grad():
        for length in (9, 41, 161):  # the same place in a block (of 4): the partial block's size is the same
            _, state, _ = model(torch.randint(0, 256, (1, length)))
            sizes.append(sum(t.numel() for layer in state.layers for t in vars(layer).values()
                             if isinstance(t, torch.Tensor)))
    assert sizes[0] == sizes[1] == sizes[2] and not model.has_growing_cache


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        (dict(attention="vq-attn"), "vq-attn:rerope"),
        (dict(attention="vq-attn:rerope=9", block_size=8), "block_size=8"),
        (dict(attention="vq-attn:rerope", rotary_scaling={"type": "linear", "factor": 2.0}), "rotary_scaling"),
        (dict(attention="vq-attn:rerope", head_dim=5), "even head dimension"),
        (dict(attention="linear:hedgehog", head_dim=5), "even head dimension"),
        (dict(attention="delta:hedgehog"), "unknown layer attention spec 'delta:hedgehog'"),
    ],
)
def test_what_the_layers_cannot_be_built_with_is_refused_by_name(settings, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[")):
        LMConfig(**{"d_model": 16, "n_layers": 1, "n_heads": 4, **settings})


def test_layer_arguments_are_checked():
    with pytest.raises(ValueError, match="positions"):
        MultiHeadVQAttention(16, 4, positions="sinusoids")
    with pytest.raises(ValueError, match="rerope=3 is the window of positions='rerope'"):
        MultiHeadVQAttention(16, 4, positions="bias", rerope=3)
    with pytest.raises(ValueError, match="larger than block_size"):
        MultiHeadVQAttention(16, 4, block_size=4, rerope=5)
    layer = MultiHeadVQAttention(16, 4, block_size=4, codebook_size=6)
    _, state, _ = layer(torch.randn(1, 6, 16))
    other = MultiHeadVQAttention(16, 4, block_size=4, codebook_size=7)
    with pytest.raises(ValueError, match="codebook_size"):
        other(torch.randn(1, 1, 16), state)
    with pytest.raises(ValueError, match="batch"):
        layer(torch.randn(2, 1, 16), state)
