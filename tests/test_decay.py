"""Kernel attention with decay (``linear_attention(g=...)``): every form equals the
recurrence written out below in float64 (outputs, final states, gradients), for one decay
per step (``g [B, Hkv, T]``) and one per feature channel (``[B, Hkv, T, F]``):

    S_t = diag(exp(g_t)) S_{t-1} + phi(k_t) v_t^T      z_t = exp(g_t) * z_{t-1} + phi(k_t)
    out_t = phi(q_t)^T S_t  [/ (phi(q_t).z_t + eps)]

Also: strong decay (g = -30, over 64k steps), resets (g = -inf), g = 0, carried states,
decoding, causality, GQA, scale, and every bad g named. Every test runs twice: as
``impl="auto"`` chooses (the native decayed chunk form for calls without gradients) and with
``LINATTN_LINEAR_IMPL=torch``.
"""

from __future__ import annotations

import pytest
import torch

from _helpers import (
    both_chunk_forms,
    F64,
    assert_causal_jacobian,
    assert_close_rel,
    independent_features,
    make_qkv,
    wide_shift_inputs,
)
from linattn import LinearAttentionState, linear_attention

# Small matmuls: one thread (as the suite runs once test_activation_checkpointing.py is collected).
torch.set_num_threads(1)

EPS = 1e-6
MODES = ("parallel", "chunk", "recurrent")


chunk_impl = both_chunk_forms("LINATTN_LINEAR_IMPL")  # every test on the native kernel and on the torch form
# (feature map, normalize, feature width F for Dk = 4)
SETTINGS = {
    "identity-none": ("identity", None, 4),
    "elu-attention": ("elu", "attention", 4),
    "exp-attention": ("exp", "attention", 4),
    "dpfp-sum": ("dpfp", "sum", 8),
}


def features(fmap, normalize, x):
    phi = independent_features(fmap, x)
    if normalize == "sum":
        phi = phi / (phi.sum(-1, keepdim=True) + EPS)  # dpfp is not exponential: + eps
    return phi


def make_g(B, Hkv, T, F=None, *, low=-2.0, seed=1, dtype=F64):
    """Log decays in [low, 0): ``[B, Hkv, T]``, or ``[B, Hkv, T, F]`` when F is given."""
    gen = torch.Generator().manual_seed(seed)
    shape = (B, Hkv, T) if F is None else (B, Hkv, T, F)
    return (low * torch.rand(shape, generator=gen, dtype=F64)).to(dtype)


def loop(q, k, v, g, fmap="identity", normalize=None, S0=None, z0=None, scale=1.0):
    """The recurrence, one step at a time, per query head: ``(out, S_T, z_T)``; query head h
    reads key/value head ``h // (H / Hkv)``, whose decays g are."""
    B, H, T, _ = q.shape
    Hkv = k.shape[1]
    phi_q, phi_k = features(fmap, normalize, q * scale), features(fmap, normalize, k)
    F = phi_k.shape[-1]
    S = torch.zeros(B, Hkv, F, v.shape[-1], dtype=F64) if S0 is None else S0
    z = torch.zeros(B, Hkv, F, dtype=F64) if z0 is None else z0
    out = []
    for t in range(T):
        a = torch.exp(g[:, :, t])  # [B, Hkv] or [B, Hkv, F]
        a = a[..., None] if g.dim() == 4 else a[..., None, None]
        S = a * S + phi_k[:, :, t, :, None] * v[:, :, t, None, :]
        z = a[..., 0] * z + phi_k[:, :, t]
        rows = []
        for h in range(H):
            kv = h // (H // Hkv)
            o = torch.einsum("bf,bfe->be", phi_q[:, h, t], S[:, kv])
            if normalize == "attention":
                o = o / (torch.einsum("bf,bf->b", phi_q[:, h, t], z[:, kv]) + EPS)[:, None]
            rows.append(o)
        out.append(torch.stack(rows, 1))
    return torch.stack(out, 2), S, z


def true_sums(state):
    """The state's sums without the key shift of exponential maps."""
    if state.key_shift is None:
        return state.kv, state.normalizer
    factor = torch.exp(state.key_shift)  # [B, Hkv]
    z = None if state.normalizer is None else state.normalizer * factor[..., None]
    return state.kv * factor[..., None, None], z


def inputs(setting, B=2, H=4, Hkv=2, T=37, Dk=4, Dv=3, seed=0):
    fmap, normalize, _ = SETTINGS[setting]
    return make_qkv(B=B, H=H, Hkv=Hkv, T=T, Dk=Dk, Dv=Dv, seed=seed, positive=normalize is None and fmap == "identity")


def initial(setting, B=2, Hkv=2, Dv=3, seed=5):
    """A random carried state (true sums, z > 0) as the op takes it and as ``loop`` does."""
    fmap, normalize, F = SETTINGS[setting]
    gen = torch.Generator().manual_seed(seed)
    S0 = torch.randn(B, Hkv, F, Dv, generator=gen, dtype=F64)
    z0 = 1 + torch.rand(B, Hkv, F, generator=gen, dtype=F64)
    state = LinearAttentionState(kv=S0, normalizer=z0 if normalize == "attention" else None, steps=4)
    return state, S0, z0


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("T, with_state", [(37, False), (37, True), (1, True)], ids=["T37", "T37-state", "T1-state"])
def test_forms_equal_the_recurrence(setting, per_channel, T, with_state):
    """parallel, chunk (sizes 1, 5, 16, 17, 64: T not a multiple; per-channel chunks
    cut to 16) and recurrent == the loop; B=2, GQA (H=4 over Hkv=2)."""
    fmap, normalize, F = SETTINGS[setting]
    q, k, v = inputs(setting, T=T)
    g = make_g(2, 2, T, F if per_channel else None)
    state, S0, z0 = initial(setting) if with_state else (None, None, None)
    expected, S_T, z_T = loop(q, k, v, g, fmap, normalize, S0, z0)
    ungated = loop(q, k, v, torch.zeros_like(g), fmap, normalize, S0, z0)[0]
    assert (expected - ungated).abs().max() > 1e-3  # the decay changes the result
    runs = [("parallel", 8), ("recurrent", 8)] + [("chunk", C) for C in (1, 5, 16, 17, 64)]
    for mode, C in runs:
        out, final = linear_attention(q, k, v, feature_map=fmap, normalize=normalize, g=g, mode=mode, chunk_size=C,
                                      initial_state=state, output_final_state=True)
        assert_close_rel(out, expected, rtol=1e-12, name=f"{mode} {C} output")
        kv, z = true_sums(final)
        assert_close_rel(kv, S_T, rtol=1e-12, name=f"{mode} {C} kv")
        if normalize == "attention":
            assert_close_rel(z, z_T, rtol=1e-12, name=f"{mode} {C} normalizer")
        assert final.steps == T + (4 if with_state else 0)
        assert final.kv.shape == (2, 2, F, 3)  # decay adds no state


def test_zero_decay_is_the_ungated_op():
    """g = 0 (either shape) gives the op without g, in every mode; a nonzero g does not."""
    q, k, v = inputs("elu-attention")
    base, base_state = linear_attention(q, k, v, output_final_state=True)
    for g in (torch.zeros(2, 2, 37, dtype=F64), torch.zeros(2, 2, 37, 4, dtype=F64)):
        for mode in MODES:
            out, state = linear_attention(q, k, v, g=g, mode=mode, output_final_state=True)
            assert_close_rel(out, base, rtol=1e-13, name=f"{mode} output")
            assert_close_rel(state.kv, base_state.kv, rtol=1e-13, name=f"{mode} kv")
            assert_close_rel(state.normalizer, base_state.normalizer, rtol=1e-13, name=f"{mode} normalizer")
    decayed, _ = linear_attention(q, k, v, g=torch.full((2, 2, 37), -0.1, dtype=F64))
    assert (decayed - base).abs().max() > 1e-3


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_scalar_decay_equals_the_same_decay_on_every_channel(per_channel):
    """A per-channel g whose channels are equal is the scalar g (two code paths, one math)."""
    q, k, v = inputs("identity-none")
    g = make_g(2, 2, 37)
    wide = g.unsqueeze(-1).expand(2, 2, 37, 4).contiguous()
    for mode in MODES:
        a, _ = linear_attention(q, k, v, feature_map="identity", normalize=None, g=g, mode=mode, chunk_size=20)
        b, _ = linear_attention(q, k, v, feature_map="identity", normalize=None, g=wide, mode=mode, chunk_size=20)
        assert_close_rel(a, b, rtol=1e-13, name=mode)


def test_scale_multiplies_the_queries_before_the_feature_map():
    q, k, v = inputs("elu-attention")
    g = make_g(2, 2, 37, 4)
    expected, _, _ = loop(q, k, v, g, "elu", "attention", scale=0.3)
    unscaled, _, _ = loop(q, k, v, g, "elu", "attention")
    assert (expected - unscaled).abs().max() > 1e-3
    for mode in MODES:
        out, _ = linear_attention(q, k, v, g=g, scale=0.3, mode=mode)
        assert_close_rel(out, expected, rtol=1e-12, name=mode)
    # without g too; for the identity map without normalisation it scales the output
    out, _ = linear_attention(q, k, v, scale=0.3)
    assert_close_rel(out, loop(q, k, v, torch.zeros_like(g), "elu", "attention", scale=0.3)[0], rtol=1e-12)
    plain, _ = linear_attention(q, k, v, feature_map="identity", normalize=None)
    out, _ = linear_attention(q, k, v, feature_map="identity", normalize=None, scale=0.3)
    assert_close_rel(out, 0.3 * plain, rtol=1e-13)


# ----------------------------------------------------------------------------- gradients


def _gradients(q, k, v, g, state, weights, **options):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, state.kv, state.normalizer)
              if t is not None]
    carried = LinearAttentionState(kv=leaves[4], normalizer=leaves[5] if len(leaves) > 5 else None)
    out, final = linear_attention(*leaves[:3], g=leaves[3], initial_state=carried, output_final_state=True, **options)
    loss = (out * weights[0]).sum() + (final.kv * weights[1]).sum()
    if final.normalizer is not None:
        loss = loss + (final.normalizer * weights[2]).sum()
    return torch.autograd.grad(loss, leaves)


def _loop_gradients(q, k, v, g, S0, z0, weights, fmap, normalize):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, S0, z0)]
    out, S, z = loop(*leaves[:4], fmap, normalize, leaves[4], leaves[5])
    loss = (out * weights[0]).sum() + (S * weights[1]).sum()
    if normalize == "attention":
        loss = loss + (z * weights[2]).sum()
    else:
        leaves = leaves[:5]  # z plays no part
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
@pytest.mark.parametrize("setting", ["identity-none", "elu-attention"])
def test_gradients_equal_the_recurrence(setting, per_channel):
    """Gradients w.r.t. q, k, v, g and the initial state (S and z), every form, chunk sizes
    1, 7, 16 and 64 (T = 37), against autograd through the loop."""
    fmap, normalize, F = SETTINGS[setting]
    q, k, v = inputs(setting)
    g = make_g(2, 2, 37, F if per_channel else None)
    state, S0, z0 = initial(setting)
    gen = torch.Generator().manual_seed(3)
    weights = (torch.randn(2, 4, 37, 3, generator=gen, dtype=F64), torch.randn(2, 2, F, 3, generator=gen, dtype=F64),
               torch.randn(2, 2, F, generator=gen, dtype=F64))
    expected = _loop_gradients(q, k, v, g, S0, z0, weights, fmap, normalize)
    names = ("q", "k", "v", "g", "initial kv", "initial normalizer")
    for mode, C in [("parallel", 8), ("recurrent", 8), ("chunk", 1), ("chunk", 7), ("chunk", 16), ("chunk", 64)]:
        got = _gradients(q, k, v, g, state, weights, feature_map=fmap, normalize=normalize, mode=mode, chunk_size=C)
        assert len(got) == len(expected)
        for name, a, b in zip(names, got, expected):
            assert b.abs().max() > 1e-6, name
            assert_close_rel(a, b, rtol=1e-11, name=f"{mode} {C}: d {name}")


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_decayed_scan_equals_the_chunk_loop(per_channel):
    """``common/decay.py``'s ``decayed_scan`` (a hand-written backward) gives the states of
    ``S_{c+1} = carry_c S_c + W_c`` written as a loop, their gradients with a reset (carry 0)
    among the chunks, and (gradgradcheck) second derivatives."""
    from linattn.ops.common.decay import decayed_scan

    gen = torch.Generator().manual_seed(11)
    N, n, F, W = 2, 5, 3, 2
    carry = torch.rand(N, n, F if per_channel else 1, 1, generator=gen, dtype=F64)
    carry[0, 2] = 0.0
    carry.requires_grad_(True)
    writes = torch.randn(N, n, F, W, generator=gen, dtype=F64, requires_grad=True)
    S0 = torch.randn(N, F, W, generator=gen, dtype=F64, requires_grad=True)
    states, S = [], S0
    for c in range(n):
        states.append(S)
        S = carry[:, c] * S + writes[:, c]
    expected = (torch.stack(states, 1), S)
    got = decayed_scan(carry, writes, S0)
    weights = [torch.randn(t.shape, generator=gen, dtype=F64) for t in expected]
    leaves = (carry, writes, S0)
    d_expected = torch.autograd.grad(sum((t * w).sum() for t, w in zip(expected, weights)), leaves)
    d_got = torch.autograd.grad(sum((t * w).sum() for t, w in zip(got, weights)), leaves)
    for name, a, b in zip(("entering", "final"), got, expected):
        assert_close_rel(a, b, rtol=1e-12, name=name)
    for name, a, b in zip(("carry", "writes", "state"), d_got, d_expected):
        assert_close_rel(a, b, rtol=1e-12, name=f"d {name}")
    assert torch.autograd.gradgradcheck(decayed_scan, leaves, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("forward_budget, backward_budget", [(1, 1), (140, 980)], ids=["one-chunk", "five-chunks"])
def test_per_channel_chunks_in_slices_equal_the_recurrence(monkeypatch, forward_budget, backward_budget):
    """The per-channel pairwise scores walk the chunks in slices (``common/decay.py``'s ``_FORWARD_BUDGET``,
    ``_BACKWARD_BUDGET``): one chunk per slice, and 5 (24 chunks of 7 with F = 4: the last
    slice shorter), give the loop's outputs and gradients."""
    import linattn.ops.common.decay as decay

    monkeypatch.setattr(decay, "_FORWARD_BUDGET", forward_budget)
    monkeypatch.setattr(decay, "_BACKWARD_BUDGET", backward_budget)
    fmap, normalize, F = SETTINGS["identity-none"]
    q, k, v = inputs("identity-none")
    g = make_g(2, 2, 37, F)
    state, S0, z0 = initial("identity-none")
    gen = torch.Generator().manual_seed(3)
    weights = (torch.randn(2, 4, 37, 3, generator=gen, dtype=F64), torch.randn(2, 2, F, 3, generator=gen, dtype=F64),
               torch.randn(2, 2, F, generator=gen, dtype=F64))
    expected = _loop_gradients(q, k, v, g, S0, z0, weights, fmap, normalize)
    got = _gradients(q, k, v, g, state, weights, feature_map=fmap, normalize=normalize, mode="chunk", chunk_size=7)
    for name, a, b in zip(("q", "k", "v", "g", "initial kv"), got, expected):
        assert_close_rel(a, b, rtol=1e-11, name=f"d {name}")
    out, _ = linear_attention(q, k, v, feature_map=fmap, normalize=normalize, g=g, mode="chunk", chunk_size=7,
                              initial_state=state)
    assert_close_rel(out, loop(q, k, v, g, fmap, normalize, S0=S0, z0=z0)[0], rtol=1e-11, name="out")


@pytest.mark.parametrize("mode, C", [("chunk", 3), ("chunk", 20), ("parallel", 3), ("recurrent", 3)])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_gradcheck(per_channel, mode, C):
    """torch.autograd.gradcheck (float64) w.r.t. q, k, v, g and the initial kv; T = 19 with
    chunk 20 is two chunks (16 + 3) of the per-channel form."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=19, Dk=2, Dv=2, seed=4, requires_grad=True)
    g = make_g(1, 1, 19, 2 if per_channel else None).requires_grad_(True)
    S0 = torch.randn(1, 1, 2, 2, dtype=F64, requires_grad=True)

    def fn(q, k, v, g, S0):
        state = LinearAttentionState(kv=S0)
        out, final = linear_attention(q, k, v, feature_map="identity", normalize=None, g=g, mode=mode, chunk_size=C,
                                      initial_state=state, output_final_state=True)
        return out, final.kv

    assert torch.autograd.gradcheck(fn, (q, k, v, g, S0), eps=1e-6, atol=1e-8, fast_mode=True)


def test_second_derivatives():
    """Every form has them but the per-channel chunk form, which refuses create_graph,
    naming the recurrent form."""
    q, k, v = make_qkv(B=1, H=1, Hkv=1, T=20, Dk=2, Dv=2, seed=4, requires_grad=True)
    for g, mode in [(make_g(1, 1, 20), "chunk"), (make_g(1, 1, 20, 2), "parallel"), (make_g(1, 1, 20, 2), "recurrent")]:
        out, _ = linear_attention(q, k, v, g=g, mode=mode, chunk_size=8)
        (grad,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        assert grad.requires_grad
    out, _ = linear_attention(q, k, v, g=make_g(1, 1, 20, 2), mode="chunk", chunk_size=8)
    with pytest.raises(RuntimeError, match="mode='recurrent'"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)


# ----------------------------------------------------------------------------- strong decay


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_strong_decay_is_finite_and_exact(per_channel):
    """g = -30 at every step (and down to -60): a chunk spans decays to exp(-1900); every form
    equals the loop, gradients included, and float32 stays finite."""
    q, k, v = inputs("identity-none", T=70)
    g = -30 + make_g(2, 2, 70, 4 if per_channel else None, low=-30.0)
    state, S0, z0 = initial("identity-none")
    expected, S_T, _ = loop(q, k, v, g, S0=S0)
    gen = torch.Generator().manual_seed(9)
    weights = (torch.randn(2, 4, 70, 3, generator=gen, dtype=F64), torch.randn(2, 2, 4, 3, generator=gen, dtype=F64))
    ref_grads = _loop_gradients(q, k, v, g, S0, z0, weights + (None,), "identity", None)
    for mode, C in [("parallel", 64), ("recurrent", 64), ("chunk", 64), ("chunk", 33)]:
        options = dict(feature_map="identity", normalize=None, mode=mode, chunk_size=C)
        out, final = linear_attention(q, k, v, g=g, initial_state=state, output_final_state=True, **options)
        assert_close_rel(out, expected, rtol=1e-12, name=f"{mode} output")
        assert_close_rel(final.kv, S_T, rtol=1e-12, name=f"{mode} kv")
        grads = _gradients(q, k, v, g, state, weights, **options)
        for name, a, b in zip(("q", "k", "v", "g", "kv"), grads, ref_grads):
            assert_close_rel(a, b, rtol=1e-11, name=f"{mode} d {name}")
        low = [t.float().requires_grad_(True) for t in (q, k, v, g)]
        out32, final32 = linear_attention(*low[:3], g=low[3], output_final_state=True, **options)
        out32.sum().backward()
        assert all(torch.isfinite(t).all() for t in [out32, final32.kv] + [x.grad for x in low])


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_strong_decay_over_64k_steps(per_channel):
    """T = 65536, g in [-30, -25]: the chunk form equals the formula. Older writes reach a
    read through exp(-25) per step, so the terms of lag >= 3 are below exp(-75) of the
    others, and the formula is written out over lags 0, 1, 2."""
    T = 65536
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=T, Dk=2, Dv=2, seed=2)
    g = -25 + make_g(1, 1, T, 2 if per_channel else None, low=-5.0)
    decays = g if per_channel else g.unsqueeze(-1)  # [1, 1, T, 1 or 2]
    expected = torch.zeros(1, 2, T, 2, dtype=F64)
    S_T = torch.zeros(1, 1, 2, 2, dtype=F64)
    for lag in range(3):
        # L[t] = sum of g over (t - lag, t]
        L = sum(decays[:, :, lag - m : T - m] for m in range(lag)) if lag else torch.zeros_like(decays)
        weight = (q[:, :, lag:] * torch.exp(L) * k[:, :, : T - lag]).sum(-1, keepdim=True)  # [1, 2, T - lag, 1]
        expected[:, :, lag:] += weight * v[:, :, : T - lag]
        tail = decays[:, :, T - lag :].sum(2) if lag else torch.zeros_like(decays[:, :, 0])
        S_T += (k[:, :, T - 1 - lag] * torch.exp(tail))[..., None] * v[:, :, T - 1 - lag, None, :]
    for dtype in (F64, torch.float32):
        out, final = linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), feature_map="identity", normalize=None,
                                      g=g.to(dtype), mode="chunk", output_final_state=True)
        rtol = 1e-12 if dtype == F64 else 1e-5
        assert_close_rel(out, expected, rtol=rtol, name=f"{dtype} output")
        assert_close_rel(final.kv, S_T, rtol=rtol, name=f"{dtype} kv")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_float32_keeps_weak_decays_after_a_strong_one(per_channel, mode):
    """A decay of -1e4 (and one of -inf) among decays of -1e-3, in float32: each decay is
    the exponential of a sum of its own terms, so the weak ones lose no precision next to
    the strong one (a difference of cumulative sums would carry an error of ~1e-3 there)."""
    q, k, v = inputs("identity-none", T=40)
    g = make_g(2, 2, 40, 4 if per_channel else None, low=-1e-3)
    g[:, :, 5] = -1e4
    g[:, :, 21] = -float("inf")
    expected, S_T, _ = loop(q, k, v, g)
    out, final = linear_attention(q.float(), k.float(), v.float(), feature_map="identity", normalize=None,
                                  g=g.float(), mode=mode, chunk_size=32, output_final_state=True)
    assert_close_rel(out, expected, rtol=1e-5, name="output")
    assert_close_rel(final.kv, S_T, rtol=1e-5, name="kv")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_minus_infinity_resets_the_state(per_channel, mode):
    """g = -inf at step r: the outputs from r on equal a fresh call on [r, T), and the
    gradients are finite (zero for the inputs before r, through the outputs from r on)."""
    q, k, v = inputs("elu-attention", T=29)
    g = make_g(2, 2, 29, 4 if per_channel else None)
    g[:, :, 11] = -float("inf")
    state, _, _ = initial("elu-attention")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g)]
    out, final = linear_attention(*leaves[:3], g=leaves[3], mode=mode, chunk_size=8, initial_state=state,
                                  output_final_state=True)
    fresh, fresh_final = linear_attention(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], g=g[:, :, 11:], mode=mode,
                                          chunk_size=8, output_final_state=True)
    assert_close_rel(out[:, :, 11:], fresh, rtol=1e-12)
    assert_close_rel(final.kv, fresh_final.kv, rtol=1e-12)
    out[:, :, 11:].sum().backward()
    for x in leaves:
        assert torch.isfinite(x.grad).all()
        assert (x.grad[:, :, :11] == 0).all()


# ----------------------------------------------------------------------------- state, decoding, causality


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
@pytest.mark.parametrize("setting", ["elu-attention", "exp-attention", "dpfp-sum"])
def test_pieces_with_carried_state_equal_one_call(setting, per_channel):
    """Pieces 5, 1, 9, 1, 13, 8 in mixed modes, the state carried, == one call."""
    fmap, normalize, F = SETTINGS[setting]
    q, k, v = inputs(setting)
    g = make_g(2, 2, 37, F if per_channel else None)
    options = dict(feature_map=fmap, normalize=normalize, chunk_size=4)
    whole, whole_state = linear_attention(q, k, v, g=g, output_final_state=True, **options)
    pieces, state, start = [], None, 0
    for length, mode in [(5, "chunk"), (1, "recurrent"), (9, "parallel"), (1, None), (13, "chunk"), (8, "parallel")]:
        part = slice(start, start + length)
        out, state = linear_attention(q[:, :, part], k[:, :, part], v[:, :, part], g=g[:, :, part], mode=mode,
                                      initial_state=state, output_final_state=True, **options)
        pieces.append(out)
        start += length
    assert_close_rel(torch.cat(pieces, 2), whole, rtol=1e-12)
    for a, b in zip(true_sums(state), true_sums(whole_state)):
        if b is not None:
            assert_close_rel(a, b, rtol=1e-12)
    assert state.steps == 37


def test_decoding_one_token_at_a_time():
    """A prompt of 10, then one-token calls (mode None: recurrent) carrying the state, with
    per-channel g: the outputs of one call."""
    q, k, v = inputs("elu-attention", T=16)
    g = make_g(2, 2, 16, 4)
    whole, _ = linear_attention(q, k, v, g=g)
    out, state = linear_attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], g=g[:, :, :10], output_final_state=True)
    pieces = [out]
    for t in range(10, 16):
        step = slice(t, t + 1)
        out, state = linear_attention(q[:, :, step], k[:, :, step], v[:, :, step], g=g[:, :, step],
                                      initial_state=state, output_final_state=True)
        pieces.append(out)
    assert_close_rel(torch.cat(pieces, 2), whole, rtol=1e-12)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
@pytest.mark.parametrize("mode", ["chunk", "parallel"])
def test_causality(mode, per_channel):
    """d out_i / d (q, k, v, g)_j == 0 for j > i (chunk 4 over T = 11; the per-channel chunk
    form with chunk 20 > 16 would need T > 16: covered by the gradient tests)."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=11, Dk=2, Dv=2, seed=6)
    g = make_g(1, 1, 11, 2 if per_channel else None).reshape(1, 1, 11, -1)

    def fn(q, k, v, g):
        decay = g if per_channel else g[..., 0]
        return linear_attention(q, k, v, g=decay, mode=mode, chunk_size=4)[0]

    assert_causal_jacobian(fn, (q, k, v, g), ("q", "k", "v", "g"))


def test_causality_across_per_channel_chunks():
    """The per-channel chunk form with chunk 24 at T = 24 (two chunks, 16 + 8): out_i does not
    depend on any input after i."""
    q, k, v = make_qkv(B=1, H=1, Hkv=1, T=24, Dk=2, Dv=1, seed=7)
    g = make_g(1, 1, 24, 2)
    assert_causal_jacobian(lambda q, k, v, g: linear_attention(q, k, v, g=g, mode="chunk", chunk_size=24)[0],
                           (q, k, v, g), ("q", "k", "v", "g"))


def test_half_precision_inputs_take_float32_decays():
    """bfloat16 q, k, v with float32 (or bfloat16) g: the output is near the float64 one."""
    q, k, v = inputs("elu-attention")
    g = make_g(2, 2, 37, 4)
    expected, _, _ = loop(*(t.bfloat16().double() for t in (q, k, v)), g.float().double(), "elu", "attention")
    for decay in (g.float(), g.bfloat16()):
        out, _ = linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), g=decay)
        assert out.dtype == torch.bfloat16
        assert_close_rel(out, expected, rtol=3e-2)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_float32_wide_shifts_are_recomputed_with_the_decay(per_channel):
    """The exp map in float32 on inputs whose stabilising shifts leave float32's range (the
    call is recomputed in float64): output and gradients (g's included) equal the float64
    loop in every form (compiled: tests/test_compile.py)."""
    q, k, v = wide_shift_inputs()
    g = make_g(1, 1, 13, 2 if per_channel else None)
    weights = torch.randn(1, 2, 13, 3, generator=torch.Generator().manual_seed(6), dtype=F64)
    ref_inputs = [t.clone().requires_grad_(True) for t in (q, k, v, g)]
    expected = loop(*ref_inputs, "exp", "attention")[0]
    expected_grads = torch.autograd.grad((expected * weights).sum(), ref_inputs)

    def run(fn, **options):
        inputs = [t.float().requires_grad_(True) for t in (q, k, v, g)]
        out, _ = fn(*inputs[:3], g=inputs[3], feature_map="exp", chunk_size=4, **options)
        return out, torch.autograd.grad((out * weights.float()).sum(), inputs)

    for mode in MODES:
        out, grads = run(linear_attention, mode=mode)
        assert out.dtype == torch.float32
        assert_close_rel(out, expected, rtol=1e-4, name=f"{mode} output")
        for name, a, b in zip("qkvg", grads, expected_grads):
            assert_close_rel(a, b, rtol=1e-4, name=f"{mode} d {name}")


# ----------------------------------------------------------------------------- errors


def _bad(**options):
    q, k, v = inputs("elu-attention", T=8)
    return lambda: linear_attention(q, k, v, **options)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("g, exc, pattern", [
    (torch.full((2, 2, 8), 0.5, dtype=F64), ValueError, r"\bg must be <= 0.*0\.5"),
    (torch.full((2, 2, 8, 4), float("nan"), dtype=F64), ValueError, r"\bg holds NaN"),
    (torch.full((2, 2, 8), float("inf"), dtype=F64), ValueError, r"\bg must be <= 0.*inf"),
    (torch.zeros(2, 4, 8, dtype=F64), ValueError, r"\bg has shape \[2, 4, 8\], expected \[2, 2, 8\]"),
    (torch.zeros(2, 2, 7, dtype=F64), ValueError, r"\bg has shape \[2, 2, 7\]"),
    (torch.zeros(2, 2, 8, 3, dtype=F64), ValueError, r"\bg has shape \[2, 2, 8, 3\].*\[2, 2, 8, 4\]"),
    (torch.zeros(2, 2, 8, 4, 1, dtype=F64), ValueError, r"\bg has shape"),
    (torch.zeros(2, 2, 8, dtype=torch.int64), TypeError, r"\bg must be a floating-point tensor.*int64"),
    (torch.zeros(2, 2, 8, dtype=torch.float32), TypeError, r"\bg has dtype torch.float32 but q has.*float64"),
    (torch.zeros(2, 2, 8, dtype=F64, device="meta"), ValueError, r"\bg is on meta"),
    ([0.0], TypeError, r"\bg must be a torch.Tensor"),
], ids=["positive", "nan", "plus-inf", "query-heads", "length", "channels", "rank-5", "int", "float32", "device",
        "list"])
def test_bad_decays_are_named(mode, g, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _bad(g=g, mode=mode)()


def test_decay_errors_that_depend_on_the_call():
    q, k, v = inputs("elu-attention", T=8)
    with pytest.raises(ValueError, match=r"\bg .*causal=True"):
        linear_attention(q, k, v, causal=False, g=torch.zeros(2, 2, 8, dtype=F64))
    # per-channel g spans the features: DPFP has 2 Dk = 8 of them
    with pytest.raises(ValueError, match=r"\bg has shape \[2, 2, 8, 4\].*\[2, 2, 8, 8\]"):
        linear_attention(q, k, v, feature_map="dpfp", g=torch.zeros(2, 2, 8, 4, dtype=F64))
    linear_attention(q, k, v, feature_map="dpfp", g=torch.zeros(2, 2, 8, 8, dtype=F64))
    # half-precision q: g in q's dtype or float32, nothing else
    half = [t.bfloat16() for t in (q, k, v)]
    with pytest.raises(TypeError, match=r"\bg has dtype torch.float16.*bfloat16 or torch.float32"):
        linear_attention(*half, g=torch.zeros(2, 2, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"\bg has dtype torch.float64"):
        linear_attention(*half, g=torch.zeros(2, 2, 8, dtype=F64))


def test_value_checks_can_be_switched_off():
    """check_inputs=False reads no value of g (a positive g then grows the state, unchecked);
    shapes are still checked."""
    q, k, v = inputs("elu-attention", T=8)
    linear_attention(q, k, v, g=torch.full((2, 2, 8), 0.5, dtype=F64), check_inputs=False)
    with pytest.raises(ValueError, match=r"\bg has shape"):
        linear_attention(q, k, v, g=torch.zeros(2, 2, 7, dtype=F64), check_inputs=False)
    with pytest.raises(TypeError, match=r"check_inputs must be a bool"):
        linear_attention(q, k, v, check_inputs=1)


@pytest.mark.parametrize("scale", [0, -1.0, float("nan"), float("inf"), "1", True, None])
def test_bad_scale_is_named(scale):
    with pytest.raises(ValueError, match=r"\bscale must be a finite positive number"):
        _bad(scale=scale)()
