"""The gated delta rule (``delta_rule(g=...)``): the chunk (WY) and recurrent forms equal
the recurrence written out below in float64 (outputs, final memories, gradients), for one
decay per step (Gated DeltaNet, ``g [B, Hkv, T]``) and one per key channel (KDA,
``[B, Hkv, T, F]``):

    S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   out_t = scale S_t^T q_t

with q_t, k_t the feature-mapped, normalised inputs. Also: strong decay (g = -30, over 64k
steps), resets (g = -inf), g = 0, carried states, decoding, causality, GQA and every bad g
named.
"""

from __future__ import annotations

import pytest
import torch

from _helpers import F64, assert_causal_jacobian, assert_close_rel, both_chunk_forms, independent_features
from linattn import DeltaRuleState, delta_rule

# Small matmuls: one thread (as the suite runs once test_activation_checkpointing.py is collected).
torch.set_num_threads(1)


chunk_impl = both_chunk_forms("LINATTN_DELTA_IMPL")  # every test on the native kernel and on the torch form

EPS = 1e-6
# (feature map, normalize, feature width F for Dk = 4)
SETTINGS = {
    "identity-l2": ("identity", "l2", 4),
    "elu-sum": ("elu", "sum", 4),
    "dpfp-sum": ("dpfp", "sum", 8),
}


def features(fmap, normalize, x):
    phi = independent_features(fmap, x)
    if normalize == "l2":
        return phi / phi.norm(dim=-1, keepdim=True).clamp_min(EPS)
    return phi / (phi.sum(-1, keepdim=True) + EPS)


def make_inputs(B=2, H=4, Hkv=2, T=37, Dk=4, Dv=3, F=None, *, low=-2.0, seed=0):
    """Random q, k, v, beta in (0, 1) and log decays g in [low, 0) (per channel when F is given)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=gen, dtype=F64)
    k = torch.randn(B, Hkv, T, Dk, generator=gen, dtype=F64)
    v = torch.randn(B, Hkv, T, Dv, generator=gen, dtype=F64)
    beta = torch.rand(B, Hkv, T, generator=gen, dtype=F64)
    g = low * torch.rand((B, Hkv, T) if F is None else (B, Hkv, T, F), generator=gen, dtype=F64)
    return q, k, v, beta, g


def loop(q, k, v, beta, g, fmap="identity", normalize="l2", S0=None, scale=None):
    """The recurrence with explicit matrices, per query head: ``(out, S_T)``."""
    B, H, T, _ = q.shape
    Hkv = k.shape[1]
    phi_q, phi_k = features(fmap, normalize, q), features(fmap, normalize, k)
    F = phi_k.shape[-1]
    scale = F**-0.5 if scale is None else scale
    S = torch.zeros(B, Hkv, F, v.shape[-1], dtype=F64) if S0 is None else S0
    eye = torch.eye(F, dtype=F64)
    out = []
    for t in range(T):
        a = torch.exp(g[:, :, t])
        decay = torch.diag_embed(a) if g.dim() == 4 else a[..., None, None] * eye  # [B, Hkv, F, F]
        b = beta[:, :, t, None, None]
        kk = phi_k[:, :, t]
        erase = eye - b * kk[..., :, None] * kk[..., None, :]
        S = erase @ decay @ S + b * kk[..., :, None] * v[:, :, t, None, :]
        heads = [scale * torch.einsum("bf,bfe->be", phi_q[:, h, t], S[:, h // (H // Hkv)]) for h in range(H)]
        out.append(torch.stack(heads, 1))
    return torch.stack(out, 2), S


def run(q, k, v, beta, g, S0=None, **options):
    state = None if S0 is None else DeltaRuleState(memory=S0, steps=3)
    return delta_rule(q, k, v, beta, g=g, initial_state=state, output_final_state=True, **options)


def memory(F, B=2, Hkv=2, Dv=3, seed=5):
    return 0.5 * torch.randn(B, Hkv, F, Dv, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("T, with_state", [(37, False), (37, True), (1, True)], ids=["T37", "T37-state", "T1-state"])
def test_forms_equal_the_recurrence(setting, per_channel, T, with_state):
    """recurrent and chunk (sizes 1, 5, 16, 17, 64) == the loop; B=2, GQA (H=4 over Hkv=2)."""
    fmap, normalize, F = SETTINGS[setting]
    q, k, v, beta, g = make_inputs(T=T, F=F if per_channel else None)
    S0 = memory(F) if with_state else None
    expected, S_T = loop(q, k, v, beta, g, fmap, normalize, S0)
    assert (expected - loop(q, k, v, beta, torch.zeros_like(g), fmap, normalize, S0)[0]).abs().max() > 1e-3
    for mode, C in [("recurrent", 8)] + [("chunk", C) for C in (1, 5, 16, 17, 64)]:
        out, state = run(q, k, v, beta, g, S0, feature_map=fmap, normalize=normalize, mode=mode, chunk_size=C)
        assert_close_rel(out, expected, rtol=1e-12, name=f"{mode} {C} output")
        assert_close_rel(state.memory, S_T, rtol=1e-12, name=f"{mode} {C} memory")
        assert state.memory.shape == (2, 2, F, 3) and state.steps == T + (3 if with_state else 0)


def test_zero_decay_is_the_ungated_rule():
    """g = 0 (either shape) gives delta_rule without g, in both modes; a nonzero g does not."""
    q, k, v, beta, _ = make_inputs()
    S0 = memory(4)
    base, base_state = run(q, k, v, beta, None, S0)
    for g in (torch.zeros(2, 2, 37, dtype=F64), torch.zeros(2, 2, 37, 4, dtype=F64)):
        for mode in ("chunk", "recurrent"):
            out, state = run(q, k, v, beta, g, S0, mode=mode)
            assert_close_rel(out, base, rtol=1e-13, name=f"{mode} output")
            assert_close_rel(state.memory, base_state.memory, rtol=1e-13, name=f"{mode} memory")
    decayed, _ = run(q, k, v, beta, torch.full((2, 2, 37), -0.1, dtype=F64), S0)
    assert (decayed - base).abs().max() > 1e-3


def test_scalar_decay_equals_the_same_decay_on_every_channel():
    q, k, v, beta, g = make_inputs()
    wide = g.unsqueeze(-1).expand(2, 2, 37, 4).contiguous()
    for mode in ("chunk", "recurrent"):
        a, _ = run(q, k, v, beta, g, mode=mode, chunk_size=20)
        b, _ = run(q, k, v, beta, wide, mode=mode, chunk_size=20)
        assert_close_rel(a, b, rtol=1e-13, name=mode)


# ----------------------------------------------------------------------------- gradients


def _gradients(fn, q, k, v, beta, g, S0, weights):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, beta, g, S0)]
    out, S = fn(*leaves)
    loss = (out * weights[0]).sum() + (S * weights[1]).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
@pytest.mark.parametrize("setting", ["identity-l2", "dpfp-sum"])
def test_gradients_equal_the_recurrence(setting, per_channel):
    """Gradients w.r.t. q, k, v, beta, g and the initial memory, recurrent and chunk (1, 7,
    16, 64; T = 37), against autograd through the loop."""
    fmap, normalize, F = SETTINGS[setting]
    q, k, v, beta, g = make_inputs(F=F if per_channel else None)
    S0 = memory(F)
    gen = torch.Generator().manual_seed(3)
    weights = (torch.randn(2, 4, 37, 3, generator=gen, dtype=F64), torch.randn(2, 2, F, 3, generator=gen, dtype=F64))
    expected = _gradients(lambda *x: loop(*x[:5], fmap, normalize, x[5]), q, k, v, beta, g, S0, weights)
    names = ("q", "k", "v", "beta", "g", "initial memory")
    for mode, C in [("recurrent", 8), ("chunk", 1), ("chunk", 7), ("chunk", 16), ("chunk", 64)]:
        def fn(*x):
            out, state = run(*x, feature_map=fmap, normalize=normalize, mode=mode, chunk_size=C)
            return out, state.memory

        got = _gradients(fn, q, k, v, beta, g, S0, weights)
        for name, a, b in zip(names, got, expected):
            assert b.abs().max() > 1e-6, name
            assert_close_rel(a, b, rtol=1e-11, name=f"{mode} {C}: d {name}")


@pytest.mark.parametrize("mode, C", [("chunk", 3), ("chunk", 20), ("recurrent", 3)])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_gradcheck(per_channel, mode, C):
    """torch.autograd.gradcheck (float64) w.r.t. q, k, v, beta, g and the initial memory;
    T = 19 with chunk 20 is two chunks (16 + 3) of the per-channel form."""
    q, k, v, beta, g = make_inputs(B=1, H=2, Hkv=1, T=19, Dk=2, Dv=2, F=2 if per_channel else None, seed=4)
    S0 = memory(2, B=1, Hkv=1, Dv=2)
    inputs = tuple(t.requires_grad_(True) for t in (q, k, v, beta, g, S0))

    def fn(*x):
        out, state = run(*x, mode=mode, chunk_size=C)
        return out, state.memory

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, fast_mode=True)


def test_second_derivatives():
    """The recurrent form has them; the per-channel chunk form refuses create_graph, naming
    the recurrent form."""
    q, k, v, beta, g = make_inputs(B=1, H=1, Hkv=1, T=20, F=4)
    q.requires_grad_(True)
    out, _ = run(q, k, v, beta, g, mode="recurrent")
    (grad,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    assert grad.requires_grad
    out, _ = run(q, k, v, beta, g, mode="chunk", chunk_size=8)
    with pytest.raises(RuntimeError, match="mode='recurrent'"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)


# ----------------------------------------------------------------------------- strong decay, resets


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_strong_decay_is_finite_and_exact(per_channel):
    """g in [-60, -30]: both forms equal the loop, gradients included; float32 stays finite."""
    q, k, v, beta, g = make_inputs(T=70, F=4 if per_channel else None, low=-30.0)
    g = g - 30
    S0 = memory(4)
    expected, S_T = loop(q, k, v, beta, g, S0=S0)
    gen = torch.Generator().manual_seed(9)
    weights = (torch.randn(2, 4, 70, 3, generator=gen, dtype=F64), torch.randn(2, 2, 4, 3, generator=gen, dtype=F64))
    ref_grads = _gradients(lambda *x: loop(*x[:5], S0=x[5]), q, k, v, beta, g, S0, weights)
    for mode, C in [("recurrent", 64), ("chunk", 64), ("chunk", 33)]:
        out, state = run(q, k, v, beta, g, S0, mode=mode, chunk_size=C)
        assert_close_rel(out, expected, rtol=1e-12, name=f"{mode} output")
        assert_close_rel(state.memory, S_T, rtol=1e-12, name=f"{mode} memory")

        def fn(*x, mode=mode, C=C):
            out, state = run(*x, mode=mode, chunk_size=C)
            return out, state.memory

        for name, a, b in zip(("q", "k", "v", "beta", "g", "memory"), _gradients(fn, q, k, v, beta, g, S0, weights),
                              ref_grads):
            assert_close_rel(a, b, rtol=1e-11, name=f"{mode} d {name}")
        low = [t.float().requires_grad_(True) for t in (q, k, v, beta, g)]
        out32, state32 = run(*low, mode=mode, chunk_size=C)
        out32.sum().backward()
        assert all(torch.isfinite(t).all() for t in [out32, state32.memory] + [x.grad for x in low])


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_strong_decay_over_64k_steps(per_channel):
    """T = 65536, g in [-30, -25]: the chunk form equals the formula. With
    ``A_t = (I - beta_t k_t k_t^T) diag(exp(g_t))`` and ``B_t = beta_t k_t v_t^T``,
    ``S_t = B_t + A_t B_{t-1} + A_t A_{t-1} B_{t-2} + ...``; each A shrinks by exp(-25) at
    least, so the terms past lag 2 are below exp(-75) of the others and are left out."""
    T = 65536
    q, k, v, beta, g = make_inputs(B=1, H=2, Hkv=1, T=T, Dk=2, Dv=2, F=2 if per_channel else None, low=-5.0, seed=2)
    g = g - 25
    kn = k / k.norm(dim=-1, keepdim=True)
    qn = q / q.norm(dim=-1, keepdim=True)
    a = torch.exp(g) if per_channel else torch.exp(g).unsqueeze(-1).expand(1, 1, T, 2)
    b = beta[..., None, None]
    A = (torch.eye(2, dtype=F64) - b * kn[..., :, None] * kn[..., None, :]) * a[..., None, :]  # [1, 1, T, 2, 2]
    Bt = b * kn[..., :, None] * v[..., None, :]  # [1, 1, T, 2, 2]
    S = Bt.clone()
    S[:, :, 1:] += A[:, :, 1:] @ Bt[:, :, :-1]
    S[:, :, 2:] += A[:, :, 2:] @ A[:, :, 1:-1] @ Bt[:, :, :-2]
    expected = 2**-0.5 * torch.einsum("bhtf,btfe->bhte", qn, S[:, 0])
    for dtype in (F64, torch.float32):
        out, state = run(*(t.to(dtype) for t in (q, k, v, beta, g)), mode="chunk")
        rtol = 1e-12 if dtype == F64 else 1e-5
        assert_close_rel(out, expected, rtol=rtol, name=f"{dtype} output")
        assert_close_rel(state.memory, S[:, :, -1], rtol=rtol, name=f"{dtype} memory")


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_float32_keeps_weak_decays_after_a_strong_one(per_channel, mode):
    """A decay of -1e4 (and one of -inf) among decays of -1e-3, in float32, within a chunk."""
    q, k, v, beta, g = make_inputs(T=40, F=4 if per_channel else None, low=-1e-3)
    g[:, :, 5] = -1e4
    g[:, :, 21] = -float("inf")
    expected, S_T = loop(q, k, v, beta, g)
    out, state = run(*(t.float() for t in (q, k, v, beta, g)), mode=mode, chunk_size=32)
    assert_close_rel(out, expected, rtol=1e-5, name="output")
    assert_close_rel(state.memory, S_T, rtol=1e-5, name="memory")


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_minus_infinity_resets_the_memory(per_channel, mode):
    """g = -inf at step r: the outputs from r on equal a fresh call on [r, T); gradients are
    finite and zero for the inputs before r."""
    q, k, v, beta, g = make_inputs(T=29, F=4 if per_channel else None)
    g[:, :, 11] = -float("inf")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, beta, g)]
    out, state = run(*leaves, memory(4), mode=mode, chunk_size=8)
    fresh, fresh_state = run(*(t[:, :, 11:] for t in (q, k, v, beta, g)), mode=mode, chunk_size=8)
    assert_close_rel(out[:, :, 11:], fresh, rtol=1e-12)
    assert_close_rel(state.memory, fresh_state.memory, rtol=1e-12)
    out[:, :, 11:].sum().backward()
    for x in leaves:
        assert torch.isfinite(x.grad).all()
        assert (x.grad[:, :, :11] == 0).all()


# ----------------------------------------------------------------------------- state, decoding, causality


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
@pytest.mark.parametrize("setting", ["identity-l2", "dpfp-sum"])
def test_pieces_with_carried_state_equal_one_call(setting, per_channel):
    """Pieces 5, 1, 9, 1, 13, 8 in mixed modes, the memory carried, == one call."""
    fmap, normalize, F = SETTINGS[setting]
    q, k, v, beta, g = make_inputs(F=F if per_channel else None)
    options = dict(feature_map=fmap, normalize=normalize, chunk_size=4)
    whole, whole_state = run(q, k, v, beta, g, **options)
    pieces, state, start = [], None, 0
    for length, mode in [(5, "chunk"), (1, "recurrent"), (9, "chunk"), (1, None), (13, "recurrent"), (8, "chunk")]:
        part = slice(start, start + length)
        out, state = delta_rule(*(t[:, :, part] for t in (q, k, v, beta)), g=g[:, :, part], mode=mode,
                                initial_state=state, output_final_state=True, **options)
        pieces.append(out)
        start += length
    assert_close_rel(torch.cat(pieces, 2), whole, rtol=1e-12)
    assert_close_rel(state.memory, whole_state.memory, rtol=1e-12)
    assert state.steps == 37


def test_decoding_one_token_at_a_time():
    """A prompt of 10, then one-token calls (mode None: recurrent) with per-channel g."""
    q, k, v, beta, g = make_inputs(T=16, F=4)
    whole, _ = run(q, k, v, beta, g)
    out, state = delta_rule(*(t[:, :, :10] for t in (q, k, v, beta)), g=g[:, :, :10], output_final_state=True)
    pieces = [out]
    for t in range(10, 16):
        step = slice(t, t + 1)
        out, state = delta_rule(*(x[:, :, step] for x in (q, k, v, beta)), g=g[:, :, step], initial_state=state,
                                output_final_state=True)
        pieces.append(out)
    assert_close_rel(torch.cat(pieces, 2), whole, rtol=1e-12)


@pytest.mark.parametrize("per_channel, T, C", [(False, 11, 4), (True, 11, 4), (True, 24, 24)],
                         ids=["scalar", "channel", "channel-cut-to-16"])
def test_causality(per_channel, T, C):
    """d out_i / d (q, k, v, beta, g)_j == 0 for j > i (chunk form)."""
    q, k, v, beta, g = make_inputs(B=1, H=2, Hkv=1, T=T, Dk=2, Dv=2, F=2 if per_channel else None, seed=6)

    def fn(q, k, v, beta, g):
        return delta_rule(q, k, v, beta[..., 0], g=g if per_channel else g[..., 0], mode="chunk", chunk_size=C)[0]

    assert_causal_jacobian(fn, (q, k, v, beta[..., None], g.reshape(1, 1, T, -1)), ("q", "k", "v", "beta", "g"))


def test_half_precision_inputs_take_float32_decays():
    q, k, v, beta, g = make_inputs(F=4)
    expected, _ = loop(*(t.bfloat16().double() for t in (q, k, v, beta)), g.float().double())
    for decay in (g.float(), g.bfloat16()):
        out, _ = run(*(t.bfloat16() for t in (q, k, v, beta)), decay)
        assert out.dtype == torch.bfloat16
        assert_close_rel(out, expected, rtol=3e-2)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("g, exc, pattern", [
    (torch.full((2, 2, 8), 0.5, dtype=F64), ValueError, r"\bg must be <= 0.*0\.5"),
    (torch.full((2, 2, 8, 4), float("nan"), dtype=F64), ValueError, r"\bg holds NaN"),
    (torch.zeros(2, 4, 8, dtype=F64), ValueError, r"\bg has shape \[2, 4, 8\], expected \[2, 2, 8\]"),
    (torch.zeros(2, 2, 8, 3, dtype=F64), ValueError, r"\bg has shape \[2, 2, 8, 3\].*\[2, 2, 8, 4\]"),
    (torch.zeros(2, 2, 8, dtype=torch.int64), TypeError, r"\bg must be a floating-point tensor.*int64"),
    (torch.zeros(2, 2, 8, dtype=torch.float32), TypeError, r"\bg has dtype torch.float32 but q has.*float64"),
    (torch.zeros(2, 2, 8, dtype=F64, device="meta"), ValueError, r"\bg is on meta"),
    ((0.0,), TypeError, r"\bg must be a torch.Tensor"),
], ids=["positive", "nan", "query-heads", "channels", "int", "float32", "device", "tuple"])
def test_bad_decays_are_named(mode, g, exc, pattern):
    q, k, v, beta, _ = make_inputs(T=8)
    with pytest.raises(exc, match=pattern):
        delta_rule(q, k, v, beta, g=g, mode=mode)


def test_decay_checks_follow_the_features_and_check_inputs():
    q, k, v, beta, _ = make_inputs(T=8)
    with pytest.raises(ValueError, match=r"\bg has shape \[2, 2, 8, 4\].*\[2, 2, 8, 8\]"):
        delta_rule(q, k, v, beta, feature_map="dpfp", normalize="sum", g=torch.zeros(2, 2, 8, 4, dtype=F64))
    delta_rule(q, k, v, beta, feature_map="dpfp", normalize="sum", g=torch.zeros(2, 2, 8, 8, dtype=F64))
    # check_inputs=False reads no value of g; its shape is still checked
    delta_rule(q, k, v, beta, g=torch.full((2, 2, 8), 0.5, dtype=F64), check_inputs=False)
    with pytest.raises(ValueError, match=r"\bg has shape"):
        delta_rule(q, k, v, beta, g=torch.zeros(2, 2, 7, dtype=F64), check_inputs=False)
