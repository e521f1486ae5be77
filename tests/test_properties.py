"""Property-based tests (hypothesis) over the public ops: for random shapes and options
within the documented limits, every fast form equals its reference in float64, a sequence
fed in two pieces with the carried state equals one call, and a wrong shape is always a
clear ``ValueError`` naming the argument. Example counts are bounded and derandomized, so
CI sees the same examples every run."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import linattn
from _helpers import assert_close_rel

F64 = torch.float64
PROPERTY = settings(max_examples=25, deadline=None, derandomize=True)


@st.composite
def attention_shapes(draw, max_length=20):
    """``(B, H, Hkv, T, Dk, Dv, seed)`` with ``Hkv`` dividing ``H``."""
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.integers(1, 2))
    return (draw(st.integers(1, 2)), kv_heads * group, kv_heads, draw(st.integers(1, max_length)),
            draw(st.integers(1, 6)), draw(st.integers(1, 5)), draw(st.integers(0, 2**16)))


def _inputs(shape, positive=False):
    B, H, Hkv, T, Dk, Dv, seed = shape
    g = torch.Generator().manual_seed(seed)
    draw = (lambda *s: 0.1 + torch.rand(*s, generator=g, dtype=F64)) if positive else (
        lambda *s: torch.randn(*s, generator=g, dtype=F64))
    return draw(B, H, T, Dk), draw(B, Hkv, T, Dk), torch.randn(B, Hkv, T, Dv, generator=g, dtype=F64), g


def _split(T, data):
    return data.draw(st.integers(0, T), label="split")


@PROPERTY
@given(shape=attention_shapes(), feature_map=st.sampled_from(["elu", "relu", "favor:8", "dpfp", "taylor", "exp"]),
       normalize=st.sampled_from(["attention", "sum", None]), chunk=st.integers(1, 8), data=st.data())
def test_linear_attention_forms_agree(shape, feature_map, normalize, chunk, data):
    q, k, v, _ = _inputs(shape, positive=normalize is None)
    options = dict(feature_map=feature_map, normalize=normalize)
    expected, _ = linattn.linear_attention(q, k, v, mode="parallel", **options)
    chunked, state = linattn.linear_attention(q, k, v, mode="chunk", chunk_size=chunk, output_final_state=True,
                                              **options)
    assert_close_rel(chunked, expected, rtol=1e-9, name="chunk")
    cut = _split(q.shape[2], data)
    if 0 < cut < q.shape[2]:
        first, carried = linattn.linear_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], chunk_size=chunk,
                                                  output_final_state=True, **options)
        second, final = linattn.linear_attention(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], chunk_size=chunk,
                                                 initial_state=carried, output_final_state=True, **options)
        assert_close_rel(torch.cat([first, second], 2), expected, rtol=1e-9, name="pieces")
        assert_close_rel(final.kv, state.kv, rtol=1e-9, name="final state")


@PROPERTY
@given(shape=attention_shapes(max_length=40), feature_map=st.sampled_from(["identity", "elu", "exp", "dpfp"]),
       normalize=st.sampled_from(["attention", "sum", None]), per_channel=st.booleans(), chunk=st.integers(1, 40),
       data=st.data())
def test_decayed_linear_attention_forms_agree(shape, feature_map, normalize, per_channel, chunk, data):
    """With log decays g (scalar or per feature channel; per-channel chunks hold at most 16):
    chunk and recurrent equal parallel, and two pieces with the carried state equal one call."""
    q, k, v, g = _inputs(shape, positive=normalize is None)
    B, _, Hkv, T = shape[:4]
    F = linattn.feature_maps.get_feature_map(feature_map).dim_out(shape[4])
    decay = -2 * torch.rand(B, Hkv, T, *((F,) if per_channel else ()), generator=g, dtype=F64)
    options = dict(feature_map=feature_map, normalize=normalize, g=decay, chunk_size=chunk)
    expected, state = linattn.linear_attention(q, k, v, mode="parallel", output_final_state=True, **options)
    for mode in ("chunk", "recurrent"):
        out, final = linattn.linear_attention(q, k, v, mode=mode, output_final_state=True, **options)
        assert_close_rel(out, expected, rtol=1e-9, name=mode)
        assert_close_rel(final.kv, state.kv, rtol=1e-9, name=f"{mode} final state")
    cut = _split(T, data)
    if 0 < cut < T:
        pieces, carried = [], None
        for part in (slice(0, cut), slice(cut, T)):
            out, carried = linattn.linear_attention(q[:, :, part], k[:, :, part], v[:, :, part],
                                                    **{**options, "g": decay[:, :, part]}, initial_state=carried,
                                                    output_final_state=True)
            pieces.append(out)
        assert_close_rel(torch.cat(pieces, 2), expected, rtol=1e-9, name="pieces")


@PROPERTY
@given(shape=attention_shapes(), feature_map=st.sampled_from(["identity", "elu", "dpfp"]),
       chunk=st.integers(1, 8), data=st.data())
def test_delta_rule_chunk_equals_recurrent(shape, feature_map, chunk, data):
    q, k, v, g = _inputs(shape)
    B, _, Hkv, T = shape[:4]
    beta = torch.rand(B, Hkv, T, generator=g, dtype=F64)
    normalize = "l2" if feature_map == "identity" else "sum"
    options = dict(feature_map=feature_map, normalize=normalize)
    expected, state = linattn.delta_rule(q, k, v, beta, mode="recurrent", output_final_state=True, **options)
    cut = _split(T, data)
    pieces, carried = [], None
    for lo, hi in ((0, cut), (cut, T)):
        if hi > lo:
            out, carried = linattn.delta_rule(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], beta[:, :, lo:hi],
                                              mode="chunk", chunk_size=chunk, initial_state=carried,
                                              output_final_state=True, **options)
            pieces.append(out)
    assert_close_rel(torch.cat(pieces, 2), expected, rtol=1e-9, name="chunk pieces")
    assert_close_rel(carried.memory, state.memory, rtol=1e-9, name="final state")


@PROPERTY
@given(shape=attention_shapes(max_length=40), feature_map=st.sampled_from(["identity", "elu", "dpfp"]),
       per_channel=st.booleans(), chunk=st.integers(1, 40), data=st.data())
def test_gated_delta_rule_chunk_equals_recurrent(shape, feature_map, per_channel, chunk, data):
    """With log decays g (scalar: Gated DeltaNet; per feature channel: KDA): the chunk form
    in two pieces with the carried memory equals the recurrent form in one call."""
    q, k, v, g = _inputs(shape)
    B, _, Hkv, T = shape[:4]
    F = linattn.feature_maps.get_feature_map(feature_map).dim_out(shape[4])
    beta = torch.rand(B, Hkv, T, generator=g, dtype=F64)
    decay = -2 * torch.rand(B, Hkv, T, *((F,) if per_channel else ()), generator=g, dtype=F64)
    options = dict(feature_map=feature_map, normalize="l2" if feature_map == "identity" else "sum")
    expected, state = linattn.delta_rule(q, k, v, beta, g=decay, mode="recurrent", output_final_state=True, **options)
    cut = _split(T, data)
    pieces, carried = [], None
    for lo, hi in ((0, cut), (cut, T)):
        if hi > lo:
            out, carried = linattn.delta_rule(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], beta[:, :, lo:hi],
                                              g=decay[:, :, lo:hi], mode="chunk", chunk_size=chunk,
                                              initial_state=carried, output_final_state=True, **options)
            pieces.append(out)
    assert_close_rel(torch.cat(pieces, 2), expected, rtol=1e-9, name="chunk pieces")
    assert_close_rel(carried.memory, state.memory, rtol=1e-9, name="final state")


@PROPERTY
@given(shape=attention_shapes(max_length=24), causal=st.booleans(), block=st.integers(1, 9),
       mask=st.sampled_from(["none", "bool", "float", "callable"]))
def test_softmax_impls_agree(shape, causal, block, mask):
    q, k, v, g = _inputs(shape)
    T, H = shape[3], shape[1]
    bias = None
    if mask == "bool":
        bias = torch.rand(T, T, generator=g) > 0.5  # rows may be fully masked: output 0 everywhere
    elif mask == "float":
        bias = torch.randn(H, T, T, generator=g, dtype=F64)
    elif mask == "callable":
        slopes = torch.rand(H, generator=g, dtype=F64)
        bias = lambda offsets: -slopes[:, None] * offsets.abs().to(F64)[None, :]  # noqa: E731
    expected = linattn.softmax_attention(q, k, v, causal=causal, bias=bias, impl="reference")
    for impl in ("sdpa", "tiled"):
        if impl == "sdpa" and mask == "callable":
            continue
        out = linattn.softmax_attention(q, k, v, causal=causal, bias=bias, impl=impl, block_size=block)
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12, msg=lambda m: f"{impl}: {m}")


@PROPERTY
@given(shape=attention_shapes(max_length=24), block=st.integers(1, 6), codes=st.integers(1, 6),
       relative=st.booleans(), data=st.data())
def test_vq_block_form_equals_parallel(shape, block, codes, relative, data):
    q, _, v, g = _inputs(shape)
    B, H, Hkv, T, Dk = shape[:5]
    codebook = torch.randn(Hkv, codes, Dk, generator=g, dtype=F64)
    index = torch.randint(0, codes, (B, Hkv, T), generator=g)
    k_hat = codebook[torch.arange(Hkv)[None, :, None], index]
    options = dict(block_size=block)
    if relative:
        options.update(bias=torch.randn(block + 1, generator=g, dtype=F64),
                       position_keys=torch.randn(H, block + 1, Dk, generator=g, dtype=F64))
    expected, _ = linattn.vq_attention(q, k_hat, v, index, codebook, mode="parallel", **options)
    cut = _split(T, data)
    pieces, state = [], None
    for lo, hi in ((0, cut), (cut, T)):
        if hi > lo:
            out, state = linattn.vq_attention(q[:, :, lo:hi], k_hat[:, :, lo:hi], v[:, :, lo:hi],
                                              index[:, :, lo:hi], codebook, initial_state=state,
                                              output_final_state=True, **options)
            pieces.append(out)
    assert_close_rel(torch.cat(pieces, 2), expected, rtol=1e-9, name="block pieces")


@PROPERTY
@given(shape=attention_shapes(max_length=24), window=st.integers(1, 8))
def test_local_attention_equals_masked_softmax(shape, window):
    q, k, v, _ = _inputs(shape)
    T = shape[3]
    offsets = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    keep = (offsets >= 0) & (offsets < window)
    expected = linattn.softmax_attention(q, k, v, bias=keep, impl="reference")
    out, _ = linattn.local_attention(q, k, v, window=window)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)


_OPS = {
    "softmax": lambda q, k, v: linattn.softmax_attention(q, k, v, causal=True),
    "linear": lambda q, k, v: linattn.linear_attention(q, k, v),
    "delta": lambda q, k, v: linattn.delta_rule(q, k, v, torch.full(k.shape[:3], 0.5, dtype=k.dtype)),
    "local": lambda q, k, v: linattn.local_attention(q, k, v, window=4),
    "linear-decay": lambda q, k, v: linattn.linear_attention(q, k, v, g=torch.zeros(k.shape[:3], dtype=k.dtype)),
    "gated-delta": lambda q, k, v: linattn.delta_rule(q, k, v, torch.full(k.shape[:3], 0.5, dtype=k.dtype),
                                                      g=torch.zeros(*k.shape[:3], k.shape[3], dtype=k.dtype)),
}


@PROPERTY
@given(shape=attention_shapes(max_length=10), op=st.sampled_from(sorted(_OPS)),
       tensor=st.sampled_from(["q", "k", "v"]), axis=st.integers(0, 3), change=st.sampled_from([1, 2, 3]))
def test_a_wrong_dimension_is_a_clear_error(shape, op, tensor, axis, change):
    """Changing one size of one input (batch, heads, length or feature) is refused with a
    ValueError that names that input, never an error from deep inside the op."""
    assume(not (tensor == "v" and axis == 3))  # any value width is valid
    q, k, v, _ = _inputs(shape)
    inputs = {"q": q, "k": k, "v": v}
    bad = list(inputs[tensor].shape)
    bad[axis] += change
    assume(not (tensor == "q" and axis == 1 and bad[1] % k.shape[1] == 0))  # more query heads per kv head: valid
    inputs[tensor] = torch.randn(*bad, dtype=F64)
    with pytest.raises(ValueError) as info:
        _OPS[op](inputs["q"], inputs["k"], inputs["v"])
    names = set(re.findall(r"\b[a-z_]+\b", str(info.value)))
    assert tensor in names or (tensor == "q" and "k" in names), str(info.value)  # names the input (or the k it fails)
