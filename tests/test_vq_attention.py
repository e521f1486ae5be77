"""Transformer-VQ attention (docs/design.md, section 4): the block (linear) form against the
parallel reference and an independent loop, gradients, causality, decode state, the
non-causal form, soft VQ, and input validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import linattn
import linattn.ops.vq as vq
from linattn.ops.vq import batched, block, fused, selfcheck, triton_choice
from linattn.ops.vq import schedule as vq_schedule
from linattn.ops.vq.soft import soft_assignments

from _helpers import assert_causal_jacobian, assert_close_rel

F64 = torch.float64


# ----------------------------------------------------------------------------- inputs


def gather_codes(codebook, codes):
    """``codebook[h, codes[b, h, t]]`` -> ``[B, Hkv, T, Dk]`` (differentiable in the codebook)."""
    Hkv = codebook.shape[0]
    return codebook[torch.arange(Hkv)[None, :, None], codes]


def make_vq(B=2, H=4, Hkv=2, T=7, Dk=4, Dv=3, S=8, unused=3, seed=0):
    """q, k_hat, v, codes, codebook; codes never use the last ``unused`` entries."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=F64)
    codebook = torch.randn(Hkv, S, Dk, generator=g, dtype=F64)
    codes = torch.randint(0, S - unused, (B, Hkv, T), generator=g)
    v = torch.randn(B, Hkv, T, Dv, generator=g, dtype=F64)
    return q, gather_codes(codebook, codes), v, codes, codebook


def make_bias(H, L, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(H, L + 1, generator=g, dtype=F64)


def make_position_keys(H, L, Dk, seed=2):
    g = torch.Generator().manual_seed(seed)
    return 0.5 * torch.randn(H, L + 1, Dk, generator=g, dtype=F64)


def callable_bias(H):
    slopes = torch.linspace(0.2, 1.0, H, dtype=F64)

    def bias(offsets):
        return -slopes[:, None] * offsets.to(F64)[None, :] + 0.1 * torch.cos(offsets.to(F64))[None, :]

    return bias


def loop_reference(q, k_hat, v, L, scale=None, bias=None, position_keys=None):
    """Causal softmax written as an explicit loop over query positions and heads."""
    B, H, T, Dk = q.shape
    Hkv = k_hat.shape[1]
    G = H // Hkv
    scale = Dk**-0.5 if scale is None else scale
    table = None if bias is None else (bias if bias.dim() == 2 else bias.expand(H, L + 1))
    P = None
    if position_keys is not None:
        P = position_keys if position_keys.dim() == 3 else position_keys.expand(H, L + 1, Dk)
    out = torch.zeros(B, H, T, v.shape[-1], dtype=F64)
    for h in range(H):
        kv = h // G
        for i in range(T):
            keys = k_hat[:, kv, : i + 1]  # [B, i+1, Dk]
            scores = scale * (keys @ q[:, h, i].unsqueeze(-1)).squeeze(-1)  # [B, i+1]
            extra = torch.zeros(i + 1, dtype=F64)
            for j in range(max(0, i - L), i + 1):
                if table is not None:
                    extra[j] = extra[j] + table[h, i - j]
            scores = scores + extra
            if P is not None:
                pos = torch.zeros(B, i + 1, dtype=F64)
                for j in range(max(0, i - L), i + 1):
                    pos[:, j] = scale * (q[:, h, i] * P[h, i - j]).sum(-1)
                scores = scores + pos
            weights = torch.softmax(scores, dim=-1)
            out[:, h, i] = (weights.unsqueeze(-1) * v[:, kv, : i + 1]).sum(1)
    return out


# ----------------------------------------------------------------------------- block == parallel

_GRID = [
    (T, L)
    for T in (1, 7, 128, 300, 1000)
    for L in (4, 16, 128)
    if not (T == 1000 and L != 4)
]


@pytest.mark.parametrize("extra", ["none", "tensor_bias", "callable_bias", "position_keys"])
@pytest.mark.parametrize("T,L", _GRID)
def test_block_equals_parallel(T, L, extra):
    H, Dk = 4, 4
    q, k_hat, v, codes, codebook = make_vq(T=T, Dk=Dk, seed=T + L)
    kwargs = {}
    if extra == "tensor_bias":
        kwargs["bias"] = make_bias(H, L)
    elif extra == "callable_bias":
        kwargs["bias"] = callable_bias(H)
    elif extra == "position_keys":
        kwargs["position_keys"] = make_position_keys(H, L, Dk)
    block, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, mode="block", **kwargs)
    par, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, mode="parallel", **kwargs)
    assert_close_rel(block, par, rtol=1e-10, name="block vs parallel")
    default, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, **kwargs)
    assert torch.equal(default, block), "mode=None should be the block form"


def test_block_equals_parallel_bias_and_position_keys_together():
    H, L, Dk = 4, 4, 4
    q, k_hat, v, codes, codebook = make_vq(T=37, Dk=Dk, seed=5)
    kw = dict(block_size=L, bias=make_bias(H, L), position_keys=make_position_keys(H, L, Dk), scale=0.8)
    block, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, mode="block", **kw)
    par, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, mode="parallel", **kw)
    assert_close_rel(block, par, rtol=1e-10)


def test_shared_bias_and_position_keys_broadcast_over_heads():
    H, L, Dk = 4, 4, 4
    q, k_hat, v, codes, codebook = make_vq(T=21, Dk=Dk, seed=6)
    b1 = make_bias(1, L)[0]
    P1 = make_position_keys(1, L, Dk)[0]
    one, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, bias=b1, position_keys=P1)
    full, _ = linattn.vq_attention(
        q, k_hat, v, codes, codebook, block_size=L, bias=b1.expand(H, L + 1), position_keys=P1.expand(H, L + 1, Dk)
    )
    assert_close_rel(one, full, rtol=1e-12)


# ----------------------------------------------------------------------------- parallel == loop


@pytest.mark.parametrize("L", [3, 8])
@pytest.mark.parametrize("extra", ["none", "tensor_bias", "callable_bias", "position_keys", "both"])
def test_parallel_equals_loop_reference(L, extra):
    H, Dk, T = 4, 4, 20
    q, k_hat, v, codes, codebook = make_vq(T=T, Dk=Dk, seed=11 + L)
    bias = pos = None
    if extra in ("tensor_bias", "both"):
        bias = make_bias(H, L)
    if extra == "callable_bias":
        bias = callable_bias(H)
    if extra in ("position_keys", "both"):
        pos = make_position_keys(H, L, Dk)
    scale = 0.7
    out, _ = linattn.vq_attention(
        q, k_hat, v, codes, codebook, block_size=L, bias=bias, position_keys=pos, mode="parallel", scale=scale
    )
    table = bias(torch.arange(L + 1)) if callable(bias) else bias
    expected = loop_reference(q, k_hat, v, L, scale=scale, bias=table, position_keys=pos)
    assert_close_rel(out, expected, rtol=1e-12, name="parallel vs loop")
    block, _ = linattn.vq_attention(
        q, k_hat, v, codes, codebook, block_size=L, bias=bias, position_keys=pos, mode="block", scale=scale
    )
    assert_close_rel(block, expected, rtol=1e-10, name="block vs loop")


def loop_weights(q, k_hat, L, scale, bias=None, position_keys=None):
    """The causal attention probabilities ``[B, H, T, T]`` written out: row i is the softmax over
    j <= i of ``scale q_i.(k_j + P_{i-j}) + b_{i-j}`` (relative terms only for i - j <= L)."""
    B, H, T, _ = q.shape
    G = H // k_hat.shape[1]
    weights = torch.zeros(B, H, T, T, dtype=F64)
    for h in range(H):
        for i in range(T):
            scores = []
            for j in range(i + 1):
                key = k_hat[:, h // G, j]
                if position_keys is not None and i - j <= L:
                    key = key + position_keys[h, i - j]
                s = scale * (q[:, h, i] * key).sum(-1)
                if bias is not None and i - j <= L:
                    s = s + bias[h, i - j]
                scores.append(s)
            weights[:, h, i, : i + 1] = torch.softmax(torch.stack(scores, dim=-1), dim=-1)
    return weights


@pytest.mark.parametrize("relative", ["none", "bias", "bias+positions"])
def test_attention_weights_are_the_causal_softmax_of_the_scores(relative):
    """``vq_attention_weights`` (what the inspector reads) with GQA heads and a given scale: the
    written-out probabilities (zero above the diagonal), and applied to v the output of ``vq_attention``."""
    H, L, Dk, T, scale = 4, 3, 4, 10, 0.7
    q, k_hat, v, codes, codebook = make_vq(T=T, Dk=Dk, seed=61)
    kw = {}
    if "bias" in relative:
        kw["bias"] = make_bias(H, L)
    if "positions" in relative:
        kw["position_keys"] = make_position_keys(H, L, Dk)
    weights = vq.vq_attention_weights(q, k_hat, scale=scale, block_size=L, **kw)
    expected = loop_weights(q, k_hat, L, scale, kw.get("bias"), kw.get("position_keys"))
    assert_close_rel(weights, expected, rtol=1e-12, name="weights")
    out, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, scale=scale, block_size=L, **kw)
    assert_close_rel(weights @ v.repeat_interleave(H // k_hat.shape[1], dim=1), out, rtol=1e-10, name="weights @ v")


def test_windowed_softmax_row_scale_multiplies_each_querys_logits():
    """The GAU's softmax twin (``windowed_softmax``; queries at positions past..past+T-1 after
    a KV cache): ``row_scale[a]`` multiplies every logit of query a, relative terms included."""
    B, Hkv, G, T, past, L, D, E = 1, 2, 2, 5, 3, 2, 4, 3
    g = torch.Generator().manual_seed(71)
    q = torch.randn(B, Hkv, G, T, D, generator=g, dtype=F64)
    k = torch.randn(B, Hkv, past + T, D, generator=g, dtype=F64)
    v = torch.randn(B, Hkv, past + T, E, generator=g, dtype=F64)
    table = torch.randn(Hkv, G, L + 1, generator=g, dtype=F64)
    positions = 0.5 * torch.randn(Hkv, G, L + 1, D, generator=g, dtype=F64)
    row_scale = 0.5 + torch.rand(T, generator=g, dtype=F64)
    out = vq.windowed_softmax(q, k, v, table, positions, L, True, past=past, row_scale=row_scale)
    expected = torch.zeros(B, Hkv, G, T, E, dtype=F64)
    for h in range(Hkv):
        for j in range(G):
            for a in range(T):
                i = past + a
                logits = []
                for c in range(i + 1):
                    s = (q[:, h, j, a] * k[:, h, c]).sum(-1)
                    if i - c <= L:
                        s = s + table[h, j, i - c] + (q[:, h, j, a] * positions[h, j, i - c]).sum(-1)
                    logits.append(row_scale[a] * s)
                w = torch.softmax(torch.stack(logits, dim=-1), dim=-1)  # [B, i + 1]
                expected[:, h, j, a] = (w.unsqueeze(-1) * v[:, h, : i + 1]).sum(1)
    assert_close_rel(out, expected, rtol=1e-12, name="row-scaled windowed softmax")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_are_computed_in_float32(dtype):
    """Half-precision inputs (block, parallel and decode forms, bias and position keys in that
    dtype too) are computed in float32: the output is the float32 inputs' output rounded to
    ``dtype``, bit for bit, and the state is float32."""
    H, L, Dk = 4, 4, 4
    q, _, v, codes, codebook = make_vq(T=11, Dk=Dk, seed=62)
    cb = codebook.to(dtype)
    inputs = (q.to(dtype), gather_codes(cb, codes), v.to(dtype), codes, cb)
    relative = dict(bias=make_bias(H, L).to(dtype), position_keys=make_position_keys(H, L, Dk).to(dtype))
    wide = [x.float() if x.is_floating_point() else x for x in inputs]
    wide_relative = {name: t.float() for name, t in relative.items()}
    for mode in ("block", "parallel"):
        out, _ = linattn.vq_attention(*inputs, block_size=L, mode=mode, **relative)
        want, _ = linattn.vq_attention(*wide, block_size=L, mode=mode, **wide_relative)
        assert out.dtype == dtype
        assert torch.equal(out, want.to(dtype)), mode
    head = [x[:, :, :6] for x in inputs[:4]]
    _, state = linattn.vq_attention(*head, cb, block_size=L, output_final_state=True, **relative)
    assert state.cache_means.dtype == state.partial_keys.dtype == torch.float32
    step = [x[:, :, 6:7] for x in inputs[:4]]
    out, _ = linattn.vq_attention(*step, cb, block_size=L, initial_state=state, **relative)
    wide_step = [x.float() if x.is_floating_point() else x for x in step]
    want, _ = linattn.vq_attention(*wide_step, cb.float(), block_size=L, initial_state=state, **wide_relative)
    assert out.dtype == dtype and torch.equal(out, want.to(dtype)), "decode step"


# ----------------------------------------------------------------------------- gradients


def _grads(mode, T, L, cache_grad, seed=0):
    H, Dk = 4, 4
    q, _, v, codes, codebook = make_vq(T=T, Dk=Dk, seed=seed)
    bias = make_bias(H, L)
    pos = make_position_keys(H, L, Dk)
    leaves = [t.clone().requires_grad_(True) for t in (q, v, codebook, bias, pos)]
    qq, vv, cb, bb, pp = leaves
    k_hat = gather_codes(cb, codes)  # inside the differentiated function: the codebook gets gradient
    out, _ = linattn.vq_attention(
        qq, k_hat, vv, codes, cb, block_size=L, bias=bb, position_keys=pp, mode=mode, cache_grad=cache_grad
    )
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=F64)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    return dict(zip(["q", "v", "codebook", "bias", "position_keys"], grads))


@pytest.mark.parametrize("T,L", [(40, 4), (29, 8), (7, 4)])
def test_block_gradients_equal_parallel_with_cache_grad(T, L):
    ref = _grads("parallel", T, L, cache_grad=False)
    blk = _grads("block", T, L, cache_grad=True)
    for name in ref:
        assert ref[name].abs().sum() > 0, f"reference gradient w.r.t. {name} is zero"
        assert_close_rel(blk[name], ref[name], rtol=1e-9, name=f"grad {name}")


def test_block_gradients_without_cache_grad():
    L = 4
    # No cache (T <= 2L): every gradient equals the reference.
    ref = _grads("parallel", 2 * L, L, cache_grad=False)
    blk = _grads("block", 2 * L, L, cache_grad=False)
    for name in ref:
        assert_close_rel(blk[name], ref[name], rtol=1e-9, name=f"grad {name} (no cache)")
    # With a cache the gradient into v through it is stopped: v-gradients differ ...
    T = 40
    ref = _grads("parallel", T, L, cache_grad=False)
    blk = _grads("block", T, L, cache_grad=False)
    err = (blk["v"] - ref["v"]).abs().max().item()
    assert err > 1e-3 * ref["v"].abs().max().item(), "v-gradient should miss the cache path"
    # ... but only at positions that enter a cache (blocks before the last two).
    blocks = -(-T // L)
    tail = (blocks - 2) * L  # the last two blocks never enter a cache
    assert_close_rel(blk["v"][:, :, tail:], ref["v"][:, :, tail:], rtol=1e-9, name="v tail")
    assert (blk["v"][:, :, :tail] - ref["v"][:, :, :tail]).abs().max() > 0
    # q, the codebook (through the cache logits) and the relative terms are unaffected.
    for name in ("q", "codebook", "bias", "position_keys"):
        assert_close_rel(blk[name], ref[name], rtol=1e-9, name=f"grad {name} (cache_grad=False)")


def _scope_grads(T, L, grad_scope, pieces=None, start=0, seed=0, detach=True):
    """Gradients of one block-form call over T positions after ``start`` (no-grad) ones, or
    of calls over ``pieces`` (lengths summing to T) with the state detached between them."""
    H, Dk = 4, 4
    q, _, v, codes, codebook = make_vq(T=start + T, Dk=Dk, seed=seed)
    bias, pos = make_bias(H, L), make_position_keys(H, L, Dk)
    leaves = [t.clone().requires_grad_(True) for t in (q, v, codebook, bias, pos)]
    qq, vv, cb, bb, pp = leaves
    k_hat = gather_codes(cb, codes)
    kw = dict(block_size=L, bias=bb, position_keys=pp, grad_scope=grad_scope, output_final_state=True)
    state = None
    if start:
        with torch.no_grad():
            _, state = linattn.vq_attention(q[:, :, :start], k_hat[:, :, :start].detach(), v[:, :, :start],
                                            codes[:, :, :start], codebook, **{**kw, "bias": bias, "position_keys": pos})
    outs, at = [], start
    for n in pieces or [T]:
        piece = slice(at, at + n)
        out, state = linattn.vq_attention(qq[:, :, piece], k_hat[:, :, piece], vv[:, :, piece], codes[:, :, piece],
                                          cb, initial_state=state, **kw)
        state = state.detach() if pieces and detach else state
        outs.append(out)
        at += n
    out = torch.cat(outs, dim=2)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=F64)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    return dict(zip(["q", "v", "codebook", "bias", "position_keys"], grads))


@pytest.mark.parametrize("T,L,start", [(40, 4, 0), (29, 8, 0), (23, 4, 3), (7, 4, 0)])
def test_state_scope_equals_blockwise_calls_with_detached_states(T, L, start):
    """``grad_scope="state"`` (the official training) == one call per block, detaching the
    state at every block boundary (the calls start and end on absolute block boundaries)."""
    first = (L - start % L) % L or L
    pieces = [min(first, T)]
    while sum(pieces) < T:
        pieces.append(min(L, T - sum(pieces)))
    one_call = _scope_grads(T, L, "state", start=start)
    blockwise = _scope_grads(T, L, "cache", pieces=pieces, start=start)
    for name in one_call:
        assert one_call[name].abs().sum() > 0, f"gradient w.r.t. {name} is zero"
        assert_close_rel(one_call[name], blockwise[name], rtol=1e-10, name=f"grad {name}")


def test_state_scope_token_by_token_equals_one_call():
    """The decode form cuts the same edges: undetached token-wise calls == one call."""
    one_call = _scope_grads(19, 4, "state", start=2)
    tokenwise = _scope_grads(19, 4, "state", pieces=[1] * 19, start=2, detach=False)
    for name in one_call:
        assert_close_rel(tokenwise[name], one_call[name], rtol=1e-10, name=f"grad {name}")


def test_state_scope_cuts_the_previous_block():
    state, cache = _scope_grads(40, 4, "state"), _scope_grads(40, 4, "cache")
    assert (state["v"] - cache["v"]).abs().max() > 1e-6
    assert (state["codebook"] - cache["codebook"]).abs().max() > 1e-6
    assert_close_rel(state["q"], cache["q"], rtol=1e-10, name="grad q")


def test_none_scope_is_the_exact_gradient_and_cache_grad_its_alias():
    exact = _grads("parallel", 29, 8, cache_grad=False)
    scoped = _scope_grads(29, 8, "none")
    aliased = _grads("block", 29, 8, cache_grad=True)
    for name in exact:
        assert_close_rel(scoped[name], exact[name], rtol=1e-9, name=f"grad {name}")
        assert torch.equal(aliased[name], scoped[name])


def test_grad_scope_is_checked():
    q, k_hat, v, codes, codebook = make_vq(T=5)
    with pytest.raises(ValueError, match="grad_scope must be one of 'cache', 'state', 'none'; got 'all'"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, grad_scope="all")
    with pytest.raises(ValueError, match="contradicts grad_scope='state'"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, grad_scope="state", cache_grad=True)


# ----------------------------------------------------------------------------- causality


@pytest.mark.parametrize("with_relative", [False, True])
def test_block_mode_is_causal(with_relative):
    H, Hkv, L, T, Dk = 2, 1, 4, 13, 3
    q, k_hat, v, codes, codebook = make_vq(B=1, H=H, Hkv=Hkv, T=T, Dk=Dk, Dv=2, S=5, unused=1, seed=3)
    kw = {}
    if with_relative:
        kw = dict(bias=make_bias(H, L), position_keys=make_position_keys(H, L, Dk))

    def fn(qq, kk, vv):
        return linattn.vq_attention(qq, kk, vv, codes, codebook, block_size=L, mode="block", **kw)[0]

    assert_causal_jacobian(fn, [q, k_hat, v], ["q", "k_hat", "v"])


# ----------------------------------------------------------------------------- state


def _run_pieces(fn, q, k_hat, v, codes, splits):
    outs, state, start = [], None, 0
    for n in splits:
        sl = slice(start, start + n)
        out, state = fn(q[:, :, sl], k_hat[:, :, sl], v[:, :, sl], codes[:, :, sl], state)
        outs.append(out)
        start += n
    assert start == q.shape[2]
    return torch.cat(outs, dim=2), state


@pytest.mark.parametrize("splits", [[1, 6, 3, 1, 9, 3, 10], [5, 1, 17, 2, 8], [30, 1, 2]])
def test_state_pieces_equal_one_call(splits):
    H, L, Dk = 4, 4, 4
    T = sum(splits)
    q, k_hat, v, codes, codebook = make_vq(T=T, Dk=Dk, seed=21)
    kw = dict(block_size=L, bias=make_bias(H, L), position_keys=make_position_keys(H, L, Dk))

    def fn(qq, kk, vv, cc, state):
        return linattn.vq_attention(qq, kk, vv, cc, codebook, initial_state=state, output_final_state=True, **kw)

    full, full_state = linattn.vq_attention(q, k_hat, v, codes, codebook, output_final_state=True, **kw)
    pieces, state = _run_pieces(fn, q, k_hat, v, codes, splits)
    assert_close_rel(pieces, full, rtol=1e-10, name="pieces")
    assert state.steps == T and full_state.steps == T
    assert_close_rel(state.cache_counts, full_state.cache_counts, rtol=1e-12, name="cache counts")
    assert_close_rel(state.cache_means, full_state.cache_means, rtol=1e-10, name="cache means")


@pytest.mark.parametrize("grad_scope", ["cache", "state"])
@pytest.mark.parametrize("splits", [(1,), (7,), (1, 12, 4, 9), (8, 8, 8)])
def test_block_without_gradients_equals_parallel(splits, grad_scope):
    """Without gradients the block form writes into one output buffer and normalises its
    softmax in place; in one call and in pieces that carry the state it equals the reference."""
    H, L, Dk = 4, 4, 4
    T = sum(splits)
    q, k_hat, v, codes, codebook = make_vq(T=T, Dk=Dk, seed=31 + T)
    kw = dict(block_size=L, bias=make_bias(H, L), position_keys=make_position_keys(H, L, Dk))
    par, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, mode="parallel", **kw)

    def fn(qq, kk, vv, cc, state):
        return linattn.vq_attention(qq, kk, vv, cc, codebook, initial_state=state, output_final_state=True,
                                    grad_scope=grad_scope, **kw)

    with torch.no_grad():
        full, _ = fn(q, k_hat, v, codes, None)
        pieces, _ = _run_pieces(fn, q, k_hat, v, codes, splits)
    assert_close_rel(full, par, rtol=1e-10, name="one call without gradients")
    assert_close_rel(pieces, par, rtol=1e-10, name="pieces without gradients")


@pytest.mark.parametrize("B, H, Hkv", [(1, 2, 1), (3, 4, 2)])  # one row; six rows (one running cache for all)
@pytest.mark.parametrize("schedule", ["loop", "batched"])
def test_forward_without_gradients_does_not_depend_on_the_thread_count(schedule, B, H, Hkv):
    """Float32, shapes big enough for torch to split its kernels over threads: outputs and
    the final state are the same bits at 1 and 2 threads."""
    q, k_hat, v, codes, codebook = make_vq(B=B, H=H, Hkv=Hkv, T=1500, Dk=32, Dv=96, S=64, unused=0, seed=41)
    args = (q.float(), k_hat.float(), v.float(), codes, codebook.float())
    results, threads = [], torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.no_grad():
                results.append(linattn.vq_attention(*args, block_size=64, bias=make_bias(H, 64).float(),
                                                    schedule=schedule, output_final_state=True))
    finally:
        torch.set_num_threads(threads)
    (out1, state1), (out2, state2) = results
    assert torch.equal(out1, out2)
    assert torch.equal(state1.cache_means, state2.cache_means) and torch.equal(state1.cache_counts, state2.cache_counts)


def test_token_by_token_decoding_equals_full_forward():
    H, L, Dk, T = 4, 4, 4, 23
    q, k_hat, v, codes, codebook = make_vq(T=T, Dk=Dk, seed=22)
    kw = dict(block_size=L, bias=callable_bias(H), position_keys=make_position_keys(H, L, Dk))
    full, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, **kw)
    state, outs = None, []
    for t in range(T):
        out, state = linattn.vq_attention(
            q[:, :, t : t + 1], k_hat[:, :, t : t + 1], v[:, :, t : t + 1], codes[:, :, t : t + 1], codebook,
            initial_state=state, output_final_state=True, **kw,
        )
        assert state.steps == t + 1
        assert state.partial_keys.shape[2] == (t + 1) % L
        outs.append(out)
    assert_close_rel(torch.cat(outs, dim=2), full, rtol=1e-10, name="decode")


def test_state_memory_is_constant():
    L, Dk = 4, 4
    shapes = {}
    for T in (3 * L, 30 * L):
        q, k_hat, v, codes, codebook = make_vq(T=T, Dk=Dk, seed=T)
        _, state = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, output_final_state=True)
        shapes[T] = {
            name: tuple(value.shape) for name, value in vars(state).items() if isinstance(value, torch.Tensor)
        }
        assert state.steps == T
    assert shapes[3 * L] == shapes[30 * L]
    assert set(shapes[3 * L]) >= {"cache_counts", "cache_means", "prev_keys", "prev_values", "partial_keys"}


def test_state_counts_cache_correctly():
    """Cache counts after the call = code histogram of every block but the last complete one."""
    L, T = 4, 22
    q, k_hat, v, codes, codebook = make_vq(T=T, seed=23)
    _, state = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, output_final_state=True)
    full = T // L
    old = codes[:, :, : (full - 1) * L]
    S = codebook.shape[1]
    hist = torch.zeros(*old.shape[:2], S, dtype=F64).scatter_add_(-1, old, torch.ones_like(old, dtype=F64))
    assert torch.equal(state.cache_counts.to(F64), hist)
    assert torch.equal(state.partial_codes, codes[:, :, full * L :])
    assert torch.equal(state.prev_codes, codes[:, :, (full - 1) * L : full * L])


# ----------------------------------------------------------------------------- non-causal


@pytest.mark.parametrize("scale", [None, 0.6])
def test_noncausal_equals_softmax_attention(scale):
    q, k_hat, v, codes, codebook = make_vq(T=37, seed=31)
    out, state = linattn.vq_attention(q, k_hat, v, codes, codebook, causal=False, scale=scale, block_size=4)
    assert state is None
    expected = linattn.softmax_attention(q, k_hat, v, causal=False, scale=scale, impl="reference")
    assert_close_rel(out, expected, rtol=1e-10, name="non-causal")


# ----------------------------------------------------------------------------- soft VQ


def make_soft(B=2, H=4, Hkv=2, T=30, Dk=4, Dv=3, S=6, seed=0, noise=0.1):
    """Keys near (but not on) codebook entries, so the nearest code is well separated."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=F64)
    codebook = 1.5 * torch.randn(Hkv, S, Dk, generator=g, dtype=F64)
    codes = torch.randint(0, S, (B, Hkv, T), generator=g)
    k = gather_codes(codebook, codes) + noise * torch.randn(B, Hkv, T, Dk, generator=g, dtype=F64)
    v = torch.randn(B, Hkv, T, Dv, generator=g, dtype=F64)
    return q, k, v, codebook


def nearest(k, codebook):
    d = ((k.unsqueeze(-2) - codebook.unsqueeze(0).unsqueeze(2)) ** 2).sum(-1)  # [B, Hkv, T, S]
    return d.argmin(-1)


def test_soft_vq_approaches_hard_vq_as_temperature_vanishes():
    H, L, Dk = 4, 4, 4
    q, k, v, codebook = make_soft(Dk=Dk, seed=41)
    codes = nearest(k, codebook)
    kw = dict(block_size=L, bias=make_bias(H, L), position_keys=make_position_keys(H, L, Dk))
    hard, _ = linattn.vq_attention(q, gather_codes(codebook, codes), v, codes, codebook, **kw)
    errors = []
    for tau in (1.0, 0.1, 0.01, 1e-3):
        soft, _ = linattn.soft_vq_attention(q, k, v, codebook, temperature=tau, **kw)
        errors.append((soft - hard).abs().max().item())
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[0] > 1e-3, "at tau=1 the soft form should differ visibly"
    assert errors[3] < 1e-6, errors


def test_soft_assignments_formula():
    _, k, _, codebook = make_soft(seed=42)
    tau = 0.3
    a = soft_assignments(k, codebook, tau)
    d = ((k.unsqueeze(-2) - codebook.unsqueeze(0).unsqueeze(2)) ** 2).sum(-1)
    expected = torch.softmax(-d / (2 * tau), dim=-1)
    assert_close_rel(a, expected, rtol=1e-12)


def test_soft_vq_state_carry_equals_one_call():
    H, L, Dk = 4, 4, 4
    q, k, v, codebook = make_soft(T=27, Dk=Dk, seed=43)
    kw = dict(block_size=L, temperature=0.5, bias=make_bias(H, L), position_keys=make_position_keys(H, L, Dk))
    full, full_state = linattn.soft_vq_attention(q, k, v, codebook, output_final_state=True, **kw)
    outs, state, start = [], None, 0
    for n in (1, 6, 3, 9, 1, 7):
        sl = slice(start, start + n)
        out, state = linattn.soft_vq_attention(
            q[:, :, sl], k[:, :, sl], v[:, :, sl], codebook, initial_state=state, output_final_state=True, **kw
        )
        outs.append(out)
        start += n
    assert start == 27 and state.steps == 27
    assert_close_rel(torch.cat(outs, dim=2), full, rtol=1e-10, name="soft pieces")
    assert_close_rel(state.cache_counts, full_state.cache_counts, rtol=1e-10, name="soft cache counts")


def test_soft_vq_without_gradients_equals_the_form_with_them():
    """Without gradients the block form writes soft codes' outputs into one buffer; the
    result and the state equal those of the same call with gradients on."""
    H, L, Dk = 4, 4, 4
    q, k, v, codebook = make_soft(T=23, Dk=Dk, seed=45)
    kw = dict(block_size=L, temperature=0.5, bias=make_bias(H, L), position_keys=make_position_keys(H, L, Dk))
    with_grad, state = linattn.soft_vq_attention(q, k, v, codebook, output_final_state=True, **kw)
    with torch.no_grad():
        without, state_nograd = linattn.soft_vq_attention(q, k, v, codebook, output_final_state=True, **kw)
    assert_close_rel(without, with_grad, rtol=1e-12, name="soft outputs without gradients")
    assert_close_rel(state_nograd.cache_means, state.cache_means, rtol=1e-12, name="soft cache means")


def test_soft_vq_gradcheck():
    L = 2
    q, k, v, codebook = make_soft(B=1, H=2, Hkv=1, T=9, Dk=2, Dv=2, S=3, seed=44, noise=0.5)
    bias = make_bias(2, L)
    inputs = tuple(t.clone().requires_grad_(True) for t in (q, k, v, codebook))

    def fn(qq, kk, vv, cb):
        return linattn.soft_vq_attention(qq, kk, vv, cb, temperature=0.7, block_size=L, bias=bias)[0]

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
    out = fn(*inputs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    grads = torch.autograd.grad((out * w).sum(), inputs)
    for name, g in zip(["q", "k", "v", "codebook"], grads):
        assert g.abs().sum() > 0, f"no gradient reaches {name}"


def test_soft_vq_noncausal_equals_linear_attention_with_softvq_features():
    q, k, v, codebook = make_soft(T=19, seed=45, noise=0.4)
    tau, scale = 0.5, 0.8
    out, _ = linattn.soft_vq_attention(q, k, v, codebook, temperature=tau, causal=False, scale=scale)
    # phi_q(q)_s = exp(scale q.c_s - max_s), per query head against its kv head's codebook
    B, H, T, Dk = q.shape
    Hkv = codebook.shape[0]
    cb_per_head = codebook.repeat_interleave(H // Hkv, dim=0)  # [H, S, Dk]
    logits = scale * q @ cb_per_head.unsqueeze(0).transpose(-1, -2)  # [B, H, T, S]
    phi_q = torch.exp(logits - logits.amax(-1, keepdim=True))
    d = ((k.unsqueeze(-2) - codebook.unsqueeze(0).unsqueeze(2)) ** 2).sum(-1)
    phi_k = torch.softmax(-d / (2 * tau), dim=-1)  # [B, Hkv, T, S]
    expected, _ = linattn.linear_attention(
        phi_q, phi_k, v, feature_map="identity", causal=False, normalize="attention", eps=0.0, mode="parallel"
    )
    assert_close_rel(out, expected, rtol=1e-10, name="soft non-causal")
    # and written out directly
    num = phi_q @ (phi_k.transpose(-1, -2) @ v).repeat_interleave(H // Hkv, dim=1)
    den = phi_q @ phi_k.sum(2).repeat_interleave(H // Hkv, dim=1).unsqueeze(-1)
    assert_close_rel(out, num / den, rtol=1e-10, name="soft non-causal (direct)")


# ----------------------------------------------------------------------------- bad input


def _base():
    return make_vq(B=1, H=2, Hkv=1, T=6, Dk=4, Dv=3, S=5, unused=1, seed=51)


def test_bad_codes_dtype():
    q, k_hat, v, codes, codebook = _base()
    with pytest.raises(TypeError, match="codes"):
        linattn.vq_attention(q, k_hat, v, codes.to(torch.int16), codebook)
    with pytest.raises((TypeError, ValueError), match="codes"):
        linattn.vq_attention(q, k_hat, v, codes.to(F64), codebook)
    with pytest.raises(TypeError, match="codes"):
        linattn.vq_attention(q, k_hat, v, codes.tolist(), codebook)


def test_bad_codes_shape():
    q, k_hat, v, codes, codebook = _base()
    with pytest.raises(ValueError, match="codes"):
        linattn.vq_attention(q, k_hat, v, codes[:, :, :-1], codebook)
    with pytest.raises(ValueError, match="codes"):
        linattn.vq_attention(q, k_hat, v, codes[0], codebook)


def test_bad_codebook_shape():
    q, k_hat, v, codes, codebook = _base()
    with pytest.raises(ValueError, match="codebook"):
        linattn.vq_attention(q, k_hat, v, codes, codebook[..., :3])
    with pytest.raises(ValueError, match="codebook"):
        linattn.vq_attention(q, k_hat, v, codes, torch.cat([codebook, codebook]))
    with pytest.raises(ValueError, match="codebook"):
        linattn.vq_attention(q, k_hat, v, codes, codebook[0])
    with pytest.raises(ValueError, match="codebook"):
        linattn.soft_vq_attention(q, k_hat, v, codebook[..., :3], temperature=1.0)


def test_bad_bias_shape():
    q, k_hat, v, codes, codebook = _base()
    L = 4
    with pytest.raises(ValueError, match="bias"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, bias=torch.zeros(L, dtype=F64))
    with pytest.raises(ValueError, match="bias"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, bias=torch.zeros(3, L + 1, dtype=F64))
    with pytest.raises(ValueError, match="bias"):
        linattn.vq_attention(
            q, k_hat, v, codes, codebook, block_size=L, bias=lambda o: torch.zeros(3, o.numel(), dtype=F64)
        )


def test_bias_that_is_neither_a_tensor_nor_a_callable_is_named():
    """A list (or any other non-callable) is not taken for a callable of the offsets: the
    tensor check names ``bias``."""
    q, k_hat, v, codes, codebook = _base()
    with pytest.raises(TypeError, match="bias must be a torch.Tensor, got list"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, bias=[0.0] * 5)


def test_bad_position_keys_shape():
    q, k_hat, v, codes, codebook = _base()
    L = 4
    with pytest.raises(ValueError, match="position_keys"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, position_keys=torch.zeros(L, 4, dtype=F64))
    with pytest.raises(ValueError, match="position_keys"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, position_keys=torch.zeros(L + 1, 3, dtype=F64))
    with pytest.raises(ValueError, match="position_keys"):
        linattn.vq_attention(
            q, k_hat, v, codes, codebook, block_size=L, position_keys=torch.zeros(3, L + 1, 4, dtype=F64)
        )


def test_parallel_mode_with_state_is_rejected():
    q, k_hat, v, codes, codebook = _base()
    _, state = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, output_final_state=True)
    with pytest.raises(ValueError, match="parallel"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, mode="parallel", initial_state=state)
    with pytest.raises(ValueError, match="parallel"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, mode="parallel", output_final_state=True)


def test_bias_with_noncausal_is_rejected():
    q, k_hat, v, codes, codebook = _base()
    with pytest.raises(ValueError, match="bias"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, causal=False, block_size=4, bias=torch.zeros(5, dtype=F64))
    with pytest.raises(ValueError, match="position_keys"):
        linattn.vq_attention(
            q, k_hat, v, codes, codebook, causal=False, block_size=4, position_keys=torch.zeros(5, 4, dtype=F64)
        )


def test_bad_mode_and_state_type():
    q, k_hat, v, codes, codebook = _base()
    with pytest.raises(ValueError, match="mode"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, mode="chunk")
    with pytest.raises(TypeError, match="initial_state"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, initial_state=(1, 2))
    with pytest.raises(ValueError, match="temperature"):
        linattn.soft_vq_attention(q, k_hat, v, codebook, temperature=0.0)


def test_a_state_whose_partial_block_is_not_shorter_than_a_block_is_refused():
    """``initial_state.partial_keys`` holds 0..L-1 positions (a completed block has become the
    previous block): a state with L partial positions, or without a partial tensor, is refused by name."""
    q, k_hat, v, codes, codebook = make_vq(T=8)
    L = 4
    _, state = linattn.vq_attention(q[:, :, :5], k_hat[:, :, :5], v[:, :, :5], codes[:, :, :5], codebook,
                                    block_size=L, output_final_state=True)
    full = dataclasses.replace(state, partial_keys=k_hat[:, :, :L], partial_values=v[:, :, :L],
                               partial_codes=codes[:, :, :L])
    missing = dataclasses.replace(state, partial_keys=None)
    for bad in (full, missing):
        with pytest.raises(ValueError, match=r"initial_state.partial_keys must hold 0..3 positions for block_size=4"):
            linattn.vq_attention(q[:, :, 5:], k_hat[:, :, 5:], v[:, :, 5:], codes[:, :, 5:], codebook, block_size=L,
                                 initial_state=bad)


# ----------------------------------------------------------------------------- input checks


@pytest.mark.parametrize("bad_code", [99, -1, 8])  # 8 = S: the first code past the end
def test_codes_out_of_range_are_a_clear_error(bad_code):
    q, k_hat, v, codes, codebook = make_vq()
    codes = codes.clone()
    codes[1, 0, 3] = bad_code
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 8\)"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4)


@pytest.mark.parametrize("mode", ["parallel", "block"])
def test_keys_that_are_not_their_codes_are_a_clear_error(mode):
    q, k_hat, v, codes, codebook = make_vq()
    shifted = k_hat + 0.5
    with pytest.raises(ValueError, match="k_hat must equal codebook.*differ by up to 0.5"):
        linattn.vq_attention(q, shifted, v, codes, codebook, block_size=4, mode=mode)
    out, _ = linattn.vq_attention(q, shifted, v, codes, codebook, block_size=4, mode=mode, check_inputs=False)
    assert out.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[-1])


def test_soft_vq_returns_a_state_only_when_asked():
    """Like every op: the state is returned only for ``output_final_state=True``."""
    q, k, v, codebook = make_soft(T=9, seed=44)
    out, state = linattn.soft_vq_attention(q, k, v, codebook, temperature=0.5, block_size=4)
    assert state is None
    asked, state = linattn.soft_vq_attention(q, k, v, codebook, temperature=0.5, block_size=4,
                                             output_final_state=True)
    assert state is not None and state.steps == 9
    assert torch.equal(out, asked)


@pytest.mark.parametrize("group", [1, 2, 3, 100])
@pytest.mark.parametrize("state_first", [False, True])
def test_schedules_agree_with_everything_on(state_first, group, monkeypatch):
    """Loop and batched schedules side by side (GQA, batch 2, bias and position keys, a carried
    state, a length that is not a multiple of the block) with groups of 1, 2, 3 and all blocks
    (the last group partial, the final cache inside a group or after the last): outputs,
    states and gradients."""
    monkeypatch.setattr(vq_schedule, "blocks_per_group", lambda device, scores_per_block: group)
    q, k_hat, v, codes, codebook = make_vq(B=2, H=4, Hkv=2, T=23, Dk=4, Dv=3, S=8, seed=5)
    kw = dict(block_size=4, bias=make_bias(4, 4), position_keys=make_position_keys(4, 4, 4), grad_scope="none")
    _, state = linattn.vq_attention(q[:, :, :6], k_hat[:, :, :6], v[:, :, :6], codes[:, :, :6], codebook,
                                    output_final_state=True, **kw)
    start = 6 if state_first else 0
    results = []
    for schedule in ("loop", "batched"):
        leaves = [t.clone().requires_grad_(True) for t in (q, v)]
        out, final = linattn.vq_attention(leaves[0][:, :, start:], k_hat[:, :, start:], leaves[1][:, :, start:],
                                          codes[:, :, start:], codebook, initial_state=state if state_first else None,
                                          output_final_state=True, schedule=schedule, **kw)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1], dtype=F64)).sum(), leaves)
        results.append((out, final, grads))
    (out_a, state_a, grads_a), (out_b, state_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    for name in ("partial_keys", "partial_values", "cache_counts", "cache_means", "prev_keys", "prev_values"):
        torch.testing.assert_close(getattr(state_b, name), getattr(state_a, name), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scope", ["none", "cache"])
def test_schedules_agree_on_soft_code_gradients(scope, monkeypatch):
    """Soft codes (assignment weights) with gradients: the batched schedule (groups of two
    blocks) gives the loop's gradients w.r.t. the weights, including those that reach them
    through the cache sums when the scope detaches only the counts and values."""
    monkeypatch.setattr(vq_schedule, "blocks_per_group", lambda device, scores_per_block: 2)
    q, k_hat, v, codes, codebook = make_vq(B=2, H=4, Hkv=2, T=23, Dk=4, Dv=3, S=8, seed=5)
    logits = torch.randn(2, 2, 23, 8, generator=torch.Generator().manual_seed(9), dtype=F64)
    grads = []
    for schedule in ("loop", "batched"):
        leaf = logits.clone().requires_grad_(True)
        weights = torch.softmax(leaf, dim=-1)
        out, _ = linattn.vq_attention(q, weights @ codebook.unsqueeze(0), v, weights, codebook, block_size=4,
                                      grad_scope=scope, schedule=schedule)
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1], dtype=F64)).sum(), leaf)[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)


def test_impl_triton_runs_the_kernels_only_for_calls_that_leave_the_current_block(monkeypatch):
    """With the kernels chosen (``impl="triton"``, resolved here without a device and trusted
    without their self-check; the kernels replaced by a stub that records the call), a call
    whose new positions stay inside the current block, the one that completes it included, is
    a decoding step on the torch decode form, with or without gradients; a call that goes past
    the block's end runs the kernels."""
    calls = []

    class KernelsCalled(Exception):
        pass

    def kernels(*args):
        calls.append(len(args))
        raise KernelsCalled

    monkeypatch.setattr(triton_choice, "resolve_impl", lambda impl, *args: "triton" if impl == "triton" else "torch")
    monkeypatch.setattr(selfcheck, "trusted", lambda *args, **kwargs: True)  # (tests/test_vq_selfcheck.py)
    monkeypatch.setattr(fused, "block_form", kernels)
    L = 4
    q, k_hat, v, codes, codebook = make_vq(T=6)
    _, state = linattn.vq_attention(q[:, :, :3], k_hat[:, :, :3], v[:, :, :3], codes[:, :, :3], codebook,
                                    block_size=L, output_final_state=True)
    step = [x[:, :, 3:4] for x in (q, k_hat, v, codes)]  # 3 + 1 = L: completes the block
    for gradients in (True, False):
        with torch.set_grad_enabled(gradients):
            got, _ = linattn.vq_attention(*step, codebook, block_size=L, initial_state=state, impl="triton")
            want, _ = linattn.vq_attention(*step, codebook, block_size=L, initial_state=state, impl="torch")
        assert torch.equal(got, want), f"gradients={gradients}"
    assert calls == []
    with pytest.raises(KernelsCalled):  # 3 + 2 > L
        linattn.vq_attention(*(x[:, :, 3:5] for x in (q, k_hat, v, codes)), codebook, block_size=L,
                             initial_state=state, impl="triton")
    assert len(calls) == 1


def test_schedule_is_checked():
    q, k_hat, v, codes, codebook = make_vq(T=5)
    with pytest.raises(ValueError, match="schedule"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, schedule="gpu")


def test_soft_vq_gradients_through_carried_states_equal_one_call():
    """Soft VQ keeps every gradient (``grad_scope="none"``): pieces decoded one token at a
    time, whose states fold a completed block's soft counts into the cache, give the
    gradients of one call (block size 2; pieces 3, 1, 1, 2, 2: the second piece folds block 0,
    the third reads it from the cache)."""
    L = 2
    q, k, v, codebook = make_soft(B=1, H=2, Hkv=1, T=9, Dk=3, Dv=2, S=4, seed=45, noise=0.5)
    w = torch.randn(1, 2, 9, 2, generator=torch.Generator().manual_seed(5), dtype=F64)

    def grads(pieces):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, codebook)]
        qq, kk, vv, cb = leaves
        outs, state, start = [], None, 0
        for n in pieces:
            sl = slice(start, start + n)
            out, state = linattn.soft_vq_attention(qq[:, :, sl], kk[:, :, sl], vv[:, :, sl], cb, temperature=0.7,
                                                   block_size=L, initial_state=state, output_final_state=True)
            outs.append(out)
            start += n
        return torch.autograd.grad((torch.cat(outs, dim=2) * w).sum(), leaves)

    for name, got, ref in zip(["q", "k", "v", "codebook"], grads((3, 1, 1, 2, 2)), grads((9,))):
        assert_close_rel(got, ref, rtol=1e-10, name=f"d{name}")


def test_fold_block_passes_soft_count_gradients_unless_detached():
    """``fold_block`` with soft codes a ``[B, Hkv, L, S]``: ``n' = n + sum_j a_j``,
    ``m' = (n m + a^T v) / n'``; by default the gradient reaches a through both the counts and
    the sums, with ``detach_counts=True`` only through the sums."""
    from linattn.ops.vq.cache import fold_block

    g = torch.Generator().manual_seed(9)
    counts = 1.0 + torch.rand(1, 2, 3, generator=g, dtype=F64)
    means = torch.randn(1, 2, 3, 4, generator=g, dtype=F64)
    soft = torch.softmax(torch.randn(1, 2, 5, 3, generator=g, dtype=F64), dim=-1)
    values = torch.randn(1, 2, 5, 4, generator=g, dtype=F64)
    w_n, w_m = torch.randn(1, 2, 3, generator=g, dtype=F64), torch.randn(1, 2, 3, 4, generator=g, dtype=F64)

    def loss(total, new_means):
        return (total * w_n).sum() + (new_means * w_m).sum()

    for detach in (False, True):
        a = soft.clone().requires_grad_(True)
        options = {"detach_counts": True} if detach else {}  # the default passes the gradient
        got = torch.autograd.grad(loss(*fold_block(counts, means, a, values, **options)), a)[0]
        b = soft.clone().requires_grad_(True)
        added = b.sum(2).detach() if detach else b.sum(2)
        total = counts + added
        sums = torch.einsum("bhls,bhle->bhse", b, values)
        ref = torch.autograd.grad(loss(total, (counts.unsqueeze(-1) * means + sums) / total.unsqueeze(-1)), b)[0]
        assert_close_rel(got, ref, rtol=1e-12, name=f"d soft codes (detach_counts={detach})")


@pytest.mark.parametrize("scope", ["cache", "state", "none"])
def test_soft_counts_pass_a_gradient_only_with_grad_scope_none(scope):
    """Soft codes given to ``vq_attention`` are read only by the cache (counts and value sums).
    With grad_scope "cache" or "state" the soft counts are detached like the values: when the
    values entering the cache are zero, no gradient reaches the codes. With "none" the counts
    (the cache logits ``log n_s``) pass one. One call (block form) and one token per call
    (decode form, the state carried undetached) give the same gradients."""
    B, H, Hkv, T, Dk, Dv, S, L = 1, 2, 1, 6, 3, 2, 4, 2
    g = torch.Generator().manual_seed(81)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=F64)
    k = torch.randn(B, Hkv, T, Dk, generator=g, dtype=F64)
    v = torch.randn(B, Hkv, T, Dv, generator=g, dtype=F64)
    v[:, :, :L] = 0.0  # block 0, the one block that enters the cache before the last query
    codebook = torch.randn(Hkv, S, Dk, generator=g, dtype=F64)
    soft = torch.softmax(torch.randn(B, Hkv, T, S, generator=g, dtype=F64), dim=-1)
    w = torch.randn(B, H, T, Dv, generator=g, dtype=F64)
    grads = []
    for pieces in ([T], [1] * T):
        a = soft.clone().requires_grad_(True)
        outs, state, start = [], None, 0
        for n in pieces:
            sl = slice(start, start + n)
            out, state = linattn.vq_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], a[:, :, sl], codebook,
                                              block_size=L, grad_scope=scope, initial_state=state,
                                              output_final_state=True)
            outs.append(out)
            start += n
        loss = (torch.cat(outs, dim=2) * w).sum()
        grad = torch.autograd.grad(loss, a, allow_unused=True)[0] if loss.requires_grad else None
        grads.append(torch.zeros_like(soft) if grad is None else grad)  # None: nothing reaches the codes
    if scope == "none":
        assert grads[0][:, :, :L].abs().max() > 1e-3, "the soft counts of block 0 should pass a gradient"
        assert_close_rel(grads[1], grads[0], rtol=1e-10, name="token-wise vs one call")
    else:
        for grad in grads:
            assert torch.equal(grad, torch.zeros_like(grad)), grad.abs().max()


@pytest.mark.parametrize("has_prev", [False, True])
def test_block_caches_are_the_counts_and_means_of_the_blocks_two_behind(has_prev):
    """``_block_caches`` (the cache every block reads on the Triton kernels): block r reads the
    carried cache plus the previous blocks of blocks 0..r-1 (block r' - 1, or the state's
    previous block for r' = 0; without one, block 0's previous block is padding and enters
    nothing): log counts and means, written as loops, and the cache before block ``full_blocks``."""
    B, Hkv, R, L, S, E, full_blocks = 2, 2, 4, 3, 5, 2, 2
    g = torch.Generator().manual_seed(91)
    prev_codes = torch.randint(0, S, (B, Hkv, R, L), generator=g)
    prev_v = torch.randn(B, Hkv, R, L, E, generator=g, dtype=F64)
    run = (1.0 + torch.rand(B, Hkv, S, generator=g, dtype=F64), torch.randn(B, Hkv, S, E, generator=g, dtype=F64))
    logn, means, final = batched.block_caches(prev_codes, prev_v, run, has_prev, full_blocks, "cache", S)
    for r in range(R + 1):
        counts, sums = run[0].clone(), run[1].clone()
        for entered in range(r):
            if entered == 0 and not has_prev:
                continue
            for b in range(B):
                for h in range(Hkv):
                    for j in range(L):
                        s = prev_codes[b, h, entered, j]
                        counts[b, h, s] += 1
                        sums[b, h, s] += prev_v[b, h, entered, j]
        if r < R:
            assert_close_rel(logn[:, :, r], counts.log(), rtol=1e-12, name=f"log counts before block {r}")
            assert_close_rel(means[:, :, r], sums / counts.unsqueeze(-1), rtol=1e-12, name=f"means before block {r}")
        if r == full_blocks:
            assert_close_rel(final[0], counts, rtol=1e-12, name="final counts")
            assert_close_rel(final[1], sums, rtol=1e-12, name="final sums")


def _record_walks(monkeypatch) -> list:
    """Wrap ``_block_loop`` and ``all_blocks`` (as ``block.py`` calls them) to append their names to
    the returned list when they run."""
    ran = []
    for name in ("_block_loop", "all_blocks"):
        walk = getattr(block, name)
        monkeypatch.setattr(block, name, lambda *a, walk=walk, name=name: ran.append(name) or walk(*a))
    return ran


@pytest.mark.parametrize("schedule, expected", [("loop", "_block_loop"), ("batched", "all_blocks")])
def test_schedule_runs_the_walk_it_names(monkeypatch, schedule, expected):
    """An explicit ``schedule`` walks the blocks that way (they hold different memory)."""
    ran = _record_walks(monkeypatch)
    q, k_hat, v, codes, codebook = make_vq(T=9)
    linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, mode="block", schedule=schedule)
    assert ran == [expected]


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("winner", ["loop", "batched"])
def test_auto_schedule_runs_the_grid_winner(monkeypatch, grad, winner):
    """``schedule="auto"`` of the torch form on a CPU walks the blocks the way ``AUTO_SCHEDULE`` names for the
    call's gradient mode and its (batch x heads, L, S, blocks), and the same call with
    gradients switched the other way reads the other half of the grid."""
    q, k_hat, v, codes, codebook = make_vq(B=2, H=2, T=9, S=5)
    other = "batched" if winner == "loop" else "loop"
    monkeypatch.setattr(vq_schedule, "AUTO_SCHEDULE", {(grad, 4, 4, 5, 3): winner, (not grad, 4, 4, 5, 3): other})
    ran = _record_walks(monkeypatch)
    with torch.set_grad_enabled(grad):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, schedule="auto", impl="torch")
    with torch.set_grad_enabled(not grad):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, schedule="auto", impl="torch")
    walks = {"loop": "_block_loop", "batched": "all_blocks"}
    assert ran == [walks[winner], walks[other]]


def test_the_auto_schedule_grid_is_the_committed_measurement():
    """``AUTO_SCHEDULE`` names, for every shape, the faster schedule of the grid files its
    comment cites (``tools/vq_schedule_grid.py``'s output: for long sequences the no-grad half
    from grid-running-rows.txt, the fwd+bwd half from grid-after-running-cache.txt; for a few
    blocks per row both halves from grid-short.txt; a pair equal in the printed whole
    milliseconds may go either way): the code cannot drift from its evidence."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("_vq_schedule_grid", root / "tools" / "vq_schedule_grid.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    folder, budget = root / "docs" / "benchmarks" / "vq-schedule-grid", vq_schedule.BATCHED_SCORES["cpu"]
    measured = {}
    for name, mode in (("grid-running-rows.txt", "forward"), ("grid-after-running-cache.txt", "train"),
                       ("grid-short.txt", "forward"), ("grid-short.txt", "train")):
        grid = tool.read_grid((folder / name).read_text())
        measured.update({(mode == "train", *key[1:]): times for key, times in grid.items() if key[0] == mode})
    assert measured.keys() == vq_schedule.AUTO_SCHEDULE.keys()
    for key, times in measured.items():
        winner = tool.faster(times["loop"], times[budget])
        assert winner is None or vq_schedule.AUTO_SCHEDULE[key] == winner, key


def test_auto_schedule_takes_the_nearest_grid_point_in_log_scale(monkeypatch):
    """Off the grid, the nearest point in log2 of rows, L, S and blocks per row decides; only
    points of the call's gradient mode count; devices other than the CPU get the batched
    schedule."""
    grid = {(False, 1, 64, 128, 256): "batched", (False, 16, 64, 128, 256): "loop",
            (False, 1, 256, 512, 256): "loop", (False, 1, 64, 128, 4): "loop", (True, 6, 64, 128, 256): "batched"}
    monkeypatch.setattr(vq_schedule, "AUTO_SCHEDULE", grid)
    cpu = torch.device("cpu")
    assert vq_schedule.auto_schedule(False, 3, 64, 128, 256, cpu) == "batched"  # log2 distance 1.58 vs 2.42
    assert vq_schedule.auto_schedule(False, 5, 64, 128, 256, cpu) == "loop"  # 2.32 vs 1.68
    assert vq_schedule.auto_schedule(False, 1, 200, 400, 256, cpu) == "loop"  # L and S count as rows do
    assert vq_schedule.auto_schedule(False, 1, 256, 181, 256, cpu) == "loop"  # 2.5 vs 1.5: L decides (S alone: batched)
    assert vq_schedule.auto_schedule(False, 1, 120, 512, 256, cpu) == "loop"  # 2.91 vs 2.09: S decides
    assert vq_schedule.auto_schedule(False, 1, 64, 128, 16, cpu) == "loop"  # blocks: 2 from 4, 4 from 256
    assert vq_schedule.auto_schedule(False, 1, 64, 128, 64, cpu) == "batched"  # 4 from 4, 2 from 256
    assert vq_schedule.auto_schedule(True, 1000, 8, 8, 2, cpu) == "batched"  # the only point with gradients
    assert vq_schedule.auto_schedule(False, 32, 64, 128, 4, torch.device("meta")) == "batched"


@pytest.mark.parametrize("rows_at_once", [1, 3, 100])
@pytest.mark.parametrize("group", [1, 3, 100])
@pytest.mark.parametrize("state_first", [False, True])
def test_running_form_agrees_with_the_loop_over_row_sets(state_first, group, rows_at_once, monkeypatch):
    """Without gradients the batched schedule runs the running cache for sets of rows at a
    time (batch 2 x 2 kv heads = 4 rows; GQA, bias and position keys, a carried state, a
    length that is not a multiple of the block): one row at a time, sets of 3 (the last set
    short) and all rows give the loop's outputs and final state."""
    monkeypatch.setattr(vq_schedule, "blocks_per_group", lambda device, scores_per_block: group)
    monkeypatch.setattr(vq_schedule, "rows_at_once", lambda device, weights_per_row: rows_at_once)
    q, k_hat, v, codes, codebook = make_vq(B=2, H=4, Hkv=2, T=23, Dk=4, Dv=3, S=8, seed=6)
    kw = dict(block_size=4, bias=make_bias(4, 4), position_keys=make_position_keys(4, 4, 4))
    start = 6 if state_first else 0
    with torch.no_grad():
        _, state = linattn.vq_attention(q[:, :, :6], k_hat[:, :, :6], v[:, :, :6], codes[:, :, :6], codebook,
                                        output_final_state=True, **kw)
        results = [linattn.vq_attention(q[:, :, start:], k_hat[:, :, start:], v[:, :, start:], codes[:, :, start:],
                                         codebook, initial_state=state if state_first else None,
                                         output_final_state=True, schedule=schedule, **kw)
                   for schedule in ("loop", "batched")]
    (out_a, state_a), (out_b, state_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-10, atol=1e-12)
    for name in ("partial_keys", "partial_values", "cache_counts", "cache_means", "prev_keys", "prev_values"):
        torch.testing.assert_close(getattr(state_b, name), getattr(state_a, name), rtol=1e-10, atol=1e-12)
