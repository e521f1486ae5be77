"""Tests of the delta rule op (``linattn.ops.delta.rule.delta_rule``).

Recurrence per key/value head (docs/design.md section 4, Schlag et al. 2021, seed 001):
``v_old = S^T k_t``; ``S <- S + k_t (beta_t (v_t - v_old))^T``; ``out_t = scale S^T q_t``
(read after the write), with q_t, k_t the feature-mapped, normalised inputs.
"""

from __future__ import annotations

import pytest
import torch

from _helpers import both_chunk_forms

from linattn import linear_attention
from linattn.feature_maps import FAVOR, SoftVQ
from linattn.ops.delta import delta_rule
from linattn.state import DeltaRuleState, LinearAttentionState

F64 = torch.float64


chunk_impl = both_chunk_forms("LINATTN_DELTA_IMPL")  # every test on the native kernel and on the torch form

# (feature_map, normalize, feature dimension as a function of Dk)
FMAPS = {
    "identity-l2": ("identity", "l2", lambda d: d),
    "dpfp-sum": ("dpfp", "sum", lambda d: 2 * d),
    "elu-sum": ("elu", "sum", lambda d: d),
    "favor16-sum": ("favor:16", "sum", lambda d: 16),
}


# ----------------------------------------------------------------------------- helpers


def make_inputs(B=2, H=4, Hkv=2, T=10, Dk=8, Dv=6, *, feat=None, init=False, dtype=F64, seed=0):
    """Random q, k, v, beta (in (0, 1)) and, with ``init``, a random initial memory."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=F64)
    k = torch.randn(B, Hkv, T, Dk, generator=g, dtype=F64)
    v = torch.randn(B, Hkv, T, Dv, generator=g, dtype=F64)
    beta = torch.sigmoid(torch.randn(B, Hkv, T, generator=g, dtype=F64))
    mem = None
    if init:
        F = Dk if feat is None else feat
        mem = 0.5 * torch.randn(B, Hkv, F, Dv, generator=g, dtype=F64)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(beta), cast(mem)


def state_of(mem, steps=0):
    return None if mem is None else DeltaRuleState(memory=mem, steps=steps)


def run(q, k, v, beta, mem=None, **kw):
    kw.setdefault("output_final_state", True)
    return delta_rule(q, k, v, beta, initial_state=state_of(mem), **kw)


def assert_close(a, b, atol, rtol=0.0, what=""):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, atol=atol, rtol=rtol), f"{what}: max abs diff {err:.3e}"


# Independent, from-the-paper feature maps: phi computed here, not by the library.


def phi_identity_l2(x, eps):
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


def phi_dpfp_sum(nu):
    def phi(x, eps):
        r = torch.cat([torch.clamp(x, min=0.0), torch.clamp(-x, min=0.0)], dim=-1)  # [.., 2d]
        n = r.shape[-1]
        parts = []
        for j in range(1, nu + 1):
            # roll(r, j)[i] = r[(i - j) mod 2d]
            idx = torch.tensor([(i - j) % n for i in range(n)])
            parts.append(r * r[..., idx])
        p = torch.cat(parts, dim=-1)
        return p / (p.sum(-1, keepdim=True) + eps)

    return phi


def phi_elu_sum(x, eps):
    p = torch.where(x > 0, x + 1.0, torch.exp(x))  # elu(x) + 1
    return p / (p.sum(-1, keepdim=True) + eps)


def paper_delta_rule(q, k, v, beta, phi, scale, mem0=None, eps=1e-6):
    """The FWP paper's loop, per query head, with W [Dv, F] (W = S^T).

    v_bar = W phi(k_t); W <- W + beta_t (v_t - v_bar) outer phi(k_t); y_t = scale W phi(q_t).
    Query head h reads the memory of key/value head h // (H // Hkv).
    """
    B, H, T, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    G = H // Hkv
    out = torch.zeros(B, H, T, Dv, dtype=q.dtype)
    finals = torch.zeros(B, Hkv, Dv, phi(k[0, 0, :1], eps).shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            kv = h // G
            F = phi(k[b, kv, :1], eps).shape[-1]
            W = torch.zeros(Dv, F, dtype=q.dtype) if mem0 is None else mem0[b, kv].T.clone()
            for t in range(T):
                pk = phi(k[b, kv, t], eps)
                pq = phi(q[b, h, t], eps)
                v_bar = W @ pk
                W = W + beta[b, kv, t] * torch.outer(v[b, kv, t] - v_bar, pk)
                out[b, h, t] = scale * (W @ pq)
            finals[b, kv] = W
    return out, finals.transpose(-1, -2)  # final memory as [B, Hkv, F, Dv]


# ----------------------------------------------------- 1. chunk == recurrent (forward)


@pytest.mark.parametrize("fmap_id", list(FMAPS))
@pytest.mark.parametrize("init", [False, True], ids=["zero-state", "init-state"])
@pytest.mark.parametrize("T", [1, 5, 64, 100, 257])
def test_chunk_matches_recurrent_forward(fmap_id, init, T):
    fm, norm, fdim = FMAPS[fmap_id]
    Dk = 8
    q, k, v, beta, mem = make_inputs(T=T, Dk=Dk, feat=fdim(Dk), init=init, seed=T)
    ref, ref_state = run(q, k, v, beta, mem, feature_map=fm, normalize=norm, mode="recurrent")
    assert ref.shape == (2, 4, T, 6) and ref.dtype == F64
    assert ref_state.memory.shape == (2, 2, fdim(Dk), 6)
    assert ref.abs().max() > 1e-3  # not trivially zero
    for C in (16, 32, 64):
        out, st = run(q, k, v, beta, mem, feature_map=fm, normalize=norm, mode="chunk", chunk_size=C)
        assert_close(out, ref, 1e-10, 1e-9, f"out C={C}")
        assert_close(st.memory, ref_state.memory, 1e-10, 1e-9, f"memory C={C}")
        assert st.steps == ref_state.steps == T


def test_favor_instance_equals_favor_name():
    q, k, v, beta, _ = make_inputs(T=20)
    a, _ = delta_rule(q, k, v, beta, feature_map="favor:16", normalize="sum", mode="chunk", chunk_size=8)
    b, _ = delta_rule(q, k, v, beta, feature_map=FAVOR(16, seed=0), normalize="sum", mode="recurrent")
    assert_close(a, b, 1e-10, 1e-9)


def test_default_mode_and_scale():
    """mode=None: recurrent for T == 1, chunk otherwise (same numbers); scale=None is F^-1/2."""
    q, k, v, beta, _ = make_inputs(T=7, Dk=5)
    out_default, _ = delta_rule(q, k, v, beta, feature_map="dpfp", normalize="sum")
    out_rec, _ = delta_rule(q, k, v, beta, feature_map="dpfp", normalize="sum", mode="recurrent")
    assert_close(out_default, out_rec, 1e-10, 1e-9)
    out_one, _ = delta_rule(q, k, v, beta, feature_map="dpfp", normalize="sum", scale=1.0, mode="recurrent")
    assert_close(out_default, out_one * (2 * 5) ** -0.5, 1e-12, 1e-12, "default scale")


# ----------------------------------------------------- 1b. chunk == recurrent (gradients)

GRAD_CASES = [
    # (fmap_id, T, chunk_size, init)
    ("identity-l2", 1, 16, True),
    ("identity-l2", 5, 16, False),
    ("identity-l2", 100, 32, True),
    ("identity-l2", 257, 64, True),
    ("dpfp-sum", 64, 16, True),
    ("dpfp-sum", 100, 64, False),
    ("elu-sum", 64, 64, True),
    ("elu-sum", 100, 16, True),
    ("favor16-sum", 5, 32, True),
    ("favor16-sum", 100, 32, True),
]


def _grads(q, k, v, beta, mem, wo, wm, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, beta)]
    mem_leaf = None if mem is None else mem.detach().clone().requires_grad_(True)
    out, st = run(*leaves, mem_leaf, **kw)
    loss = (out * wo).sum() + (st.memory * wm).sum()
    inputs = leaves + ([mem_leaf] if mem_leaf is not None else [])
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("fmap_id,T,C,init", GRAD_CASES)
def test_chunk_matches_recurrent_gradients(fmap_id, T, C, init):
    fm, norm, fdim = FMAPS[fmap_id]
    Dk = 8
    q, k, v, beta, mem = make_inputs(T=T, Dk=Dk, feat=fdim(Dk), init=init, seed=100 + T)
    g = torch.Generator().manual_seed(7)
    wo = torch.randn(2, 4, T, 6, generator=g, dtype=F64)
    wm = torch.randn(2, 2, fdim(Dk), 6, generator=g, dtype=F64)
    kw = dict(feature_map=fm, normalize=norm)
    ref = _grads(q, k, v, beta, mem, wo, wm, mode="recurrent", **kw)
    got = _grads(q, k, v, beta, mem, wo, wm, mode="chunk", chunk_size=C, **kw)
    names = ["q", "k", "v", "beta", "initial memory"]
    assert len(ref) == len(got) == (5 if init else 4)
    for name, a, b in zip(names, got, ref):
        assert b.abs().max() > 1e-6, f"reference gradient of {name} is zero"
        assert_close(a, b, 1e-9, 1e-8, f"grad {name}")


# ------------------------------------------------- 2. against the paper's loop (W = S^T)

PAPER_FMAPS = [
    ("identity", "l2", phi_identity_l2, lambda d: d),
    ("dpfp", "sum", phi_dpfp_sum(1), lambda d: 2 * d),
    ("dpfp:2", "sum", phi_dpfp_sum(2), lambda d: 4 * d),
    ("elu", "sum", phi_elu_sum, lambda d: d),
]


@pytest.mark.parametrize("fm,norm,phi,fdim", PAPER_FMAPS, ids=[p[0] + "-" + p[1] for p in PAPER_FMAPS])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (3, 1)], ids=["gqa", "mha", "mqa"])
def test_matches_paper_loop(fm, norm, phi, fdim, heads):
    H, Hkv = heads
    Dk, eps = 4, 1e-6
    F = fdim(Dk)
    q, k, v, beta, mem = make_inputs(B=2, H=H, Hkv=Hkv, T=11, Dk=Dk, Dv=3, feat=F, init=True, seed=3)
    for mem0 in (None, mem):
        # scale=None must be F^-1/2 with F the feature dimension (computed here, not read off the lib).
        ref, ref_mem = paper_delta_rule(q, k, v, beta, phi, F ** -0.5, mem0=mem0, eps=eps)
        for mode, C in (("recurrent", 64), ("chunk", 4), ("chunk", 16)):
            out, st = run(q, k, v, beta, mem0, feature_map=fm, normalize=norm, mode=mode, chunk_size=C, eps=eps)
            assert_close(out, ref, 1e-10, 1e-9, f"{mode} C={C} out")
            assert_close(st.memory, ref_mem, 1e-10, 1e-9, f"{mode} C={C} memory")


def test_gqa_head_mapping():
    """Query head h reads kv head h // (H // Hkv): compare with explicit per-head MHA calls."""
    q, k, v, beta, mem = make_inputs(B=1, H=6, Hkv=2, T=13, init=True, seed=11)
    out, _ = run(q, k, v, beta, mem, mode="chunk", chunk_size=4)
    for h in range(6):
        kv = h // 3
        single, _ = run(q[:, h : h + 1], k[:, kv : kv + 1], v[:, kv : kv + 1], beta[:, kv : kv + 1],
                        mem[:, kv : kv + 1], mode="recurrent")
        assert_close(out[:, h : h + 1], single, 1e-10, 1e-9, f"head {h}")


# ------------------------------------------------------------------------ 3. gradcheck


@pytest.mark.parametrize("fm,norm", [("identity", "l2"), ("dpfp", "sum")])
def test_gradcheck_chunk(fm, norm):
    F = 3 if fm == "identity" else 6
    q, k, v, beta, mem = make_inputs(B=1, H=2, Hkv=1, T=6, Dk=3, Dv=2, feat=F, init=True, seed=5)
    inputs = tuple(t.clone().requires_grad_(True) for t in (q, k, v, beta, mem))

    def f(q, k, v, beta, mem):
        out, st = delta_rule(q, k, v, beta, feature_map=fm, normalize=norm, mode="chunk", chunk_size=4,
                             initial_state=DeltaRuleState(memory=mem), output_final_state=True)
        return out, st.memory

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------------ 4. memory editing


def _editing_sequence(seed=0):
    """Writes with orthonormal keys (some repeated with new values), then read-only queries.

    Returns q, k, v, beta [1, 1, T, *] laid out as: write positions (beta=1, q irrelevant),
    then one query position per key (k = 0, v = 0, beta = 0) with q = that key; and, per
    key, the list of values written to it in order.
    """
    Dk, Dv = 8, 5
    g = torch.Generator().manual_seed(seed)
    keys = torch.linalg.qr(torch.randn(Dk, Dk, generator=g, dtype=F64))[0].T  # orthonormal rows
    order = [0, 1, 2, 0, 3, 1, 4, 0, 5]  # key 0 written three times, key 1 twice
    vals = torch.randn(len(order), Dv, generator=g, dtype=F64)
    written = {}
    for i, kid in enumerate(order):
        written.setdefault(kid, []).append(vals[i])
    queried = sorted(written)
    n_w, n_q = len(order), len(queried)
    T = n_w + n_q
    q = torch.zeros(1, 1, T, Dk, dtype=F64)
    k = torch.zeros(1, 1, T, Dk, dtype=F64)
    v = torch.zeros(1, 1, T, Dv, dtype=F64)
    beta = torch.zeros(1, 1, T, dtype=F64)
    q[0, 0, :n_w] = torch.randn(n_w, Dk, generator=g, dtype=F64)
    k[0, 0, :n_w] = keys[order]
    v[0, 0, :n_w] = vals
    beta[0, 0, :n_w] = 1.0
    q[0, 0, n_w:] = keys[queried]
    return q, k, v, beta, n_w, queried, written


@pytest.mark.parametrize("mode,C", [("recurrent", 64), ("chunk", 4), ("chunk", 64)])
def test_delta_rule_overwrites_memory(mode, C):
    q, k, v, beta, n_w, queried, written = _editing_sequence()
    out, st = delta_rule(q, k, v, beta, feature_map="identity", normalize="l2", scale=1.0, mode=mode,
                         chunk_size=C, output_final_state=True)
    for i, kid in enumerate(queried):
        got = out[0, 0, n_w + i]
        assert_close(got, written[kid][-1], 1e-10, 0.0, f"key {kid} (written {len(written[kid])}x)")
        # and the final memory read directly with that key
        assert_close(st.memory[0, 0].T @ q[0, 0, n_w + i], written[kid][-1], 1e-10, 0.0, f"memory key {kid}")
    # Right after a write with beta=1 the memory returns the value just written for that key.
    edited = [kid for kid in queried if len(written[kid]) > 1]
    assert edited, "the sequence must rewrite some key"


def test_sum_rule_accumulates_instead():
    """Plain linear attention (sum rule) returns the SUM of the values written to a key."""
    q, k, v, beta, n_w, queried, written = _editing_sequence()
    out, _ = linear_attention(q, k, v, feature_map="identity", normalize=None, causal=True)
    delta_out, _ = delta_rule(q, k, v, beta, feature_map="identity", normalize="l2", scale=1.0, mode="chunk",
                              chunk_size=4)
    for i, kid in enumerate(queried):
        got = out[0, 0, n_w + i]
        total = torch.stack(written[kid]).sum(0)
        assert_close(got, total, 1e-10, 0.0, f"sum rule key {kid}")
        if len(written[kid]) > 1:
            # Differs clearly from the last value (which the delta rule returns) ...
            assert (got - written[kid][-1]).norm() > 0.1 * written[kid][-1].norm() + 0.1
            assert_close(delta_out[0, 0, n_w + i], written[kid][-1], 1e-10, 0.0, f"delta key {kid}")
            # ... by exactly the earlier values.
            assert_close(got - delta_out[0, 0, n_w + i], torch.stack(written[kid][:-1]).sum(0), 1e-10)


def test_beta_zero_is_read_only_and_beta_interpolates():
    """beta = 0 leaves the memory untouched; 0 < beta < 1 stores the convex combination
    beta v + (1 - beta) v_bar for an orthonormal key (the paper's v_new)."""
    q, k, v, beta, mem = make_inputs(B=1, H=1, Hkv=1, T=6, Dk=4, Dv=3, init=True, seed=9)
    _, st = run(q, k, v, torch.zeros_like(beta), mem, mode="chunk", chunk_size=4)
    assert_close(st.memory, mem, 1e-15, 0.0, "beta=0 memory")
    key = torch.zeros(1, 1, 1, 4, dtype=F64)
    key[..., 2] = 1.0
    b = 0.3
    v_bar = mem[0, 0, 2]
    out, _ = delta_rule(key, key, v[:, :, :1], torch.full((1, 1, 1), b, dtype=F64), scale=1.0,
                        initial_state=DeltaRuleState(memory=mem))
    assert_close(out[0, 0, 0], b * v[0, 0, 0] + (1 - b) * v_bar, 1e-12)


# ------------------------------------------------------------------- 5. state carry


@pytest.mark.parametrize("fm,norm,fdim", [("identity", "l2", 8), ("dpfp", "sum", 16)])
def test_state_carry_equals_one_call(fm, norm, fdim):
    T = 88
    q, k, v, beta, mem = make_inputs(T=T, Dk=8, feat=fdim, init=True, seed=21)
    kw = dict(feature_map=fm, normalize=norm)
    full, full_state = delta_rule(q, k, v, beta, mode="chunk", chunk_size=16, output_final_state=True,
                                  initial_state=DeltaRuleState(memory=mem, steps=5), **kw)
    assert full_state.steps == 5 + T
    state = DeltaRuleState(memory=mem, steps=5)
    outs = []
    pieces = [(0, 37, "chunk"), (37, 38, "recurrent"), (38, 88, "chunk")]
    expected_steps = 5
    for a, b, mode in pieces:
        sl = slice(a, b)
        o, state = delta_rule(q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl], mode=mode, chunk_size=16,
                              initial_state=state, output_final_state=True, **kw)
        expected_steps += b - a
        assert state.steps == expected_steps
        assert state.memory.shape == (2, 2, fdim, 6)
        outs.append(o)
    assert_close(torch.cat(outs, dim=2), full, 1e-10, 1e-9, "outputs")
    assert_close(state.memory, full_state.memory, 1e-10, 1e-9, "final memory")


def test_decoding_token_by_token_equals_one_call():
    T = 12
    q, k, v, beta, _ = make_inputs(T=T, seed=4)
    full, full_state = delta_rule(q, k, v, beta, mode="chunk", chunk_size=5, output_final_state=True)
    state, outs = None, []
    for t in range(T):
        o, state = delta_rule(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], beta[:, :, t : t + 1],
                              initial_state=state, output_final_state=True)
        outs.append(o)
    assert state.steps == T
    assert_close(torch.cat(outs, 2), full, 1e-10, 1e-9)
    assert_close(state.memory, full_state.memory, 1e-10, 1e-9)


def test_no_state_unless_asked_and_zero_state_equals_none():
    q, k, v, beta, _ = make_inputs(T=9)
    out, st = delta_rule(q, k, v, beta)
    assert st is None
    zero = DeltaRuleState(memory=torch.zeros(2, 2, 8, 6, dtype=F64))
    out0, _ = delta_rule(q, k, v, beta, initial_state=zero)
    assert_close(out, out0, 1e-12)


def test_initial_state_memory_not_mutated():
    q, k, v, beta, mem = make_inputs(T=9, init=True)
    before = mem.clone()
    for mode in ("chunk", "recurrent"):
        run(q, k, v, beta, mem, mode=mode, chunk_size=4)
        assert torch.equal(mem, before)


# ---------------------------------------------------------------------- 6. causality


def test_causality_jacobian_chunk():
    T, C = 9, 4
    q, k, v, beta, _ = make_inputs(B=1, H=2, Hkv=1, T=T, Dk=3, Dv=2, seed=8)

    def f(q, k, v, beta):
        return delta_rule(q, k, v, beta, mode="chunk", chunk_size=C)[0]

    jac = torch.autograd.functional.jacobian(f, (q, k, v, beta))
    names = ["q", "k", "v", "beta"]
    for name, J in zip(names, jac):
        # J: [B, H, T, Dv, *input.shape]; the input's time axis is at position 4 + 2.
        J = J.movedim(2, 0).movedim(2 + 4, 1)  # [T_out, T_in, ...]
        for t in range(T):
            future = J[t, t + 1 :]
            assert torch.count_nonzero(future) == 0, f"out[{t}] depends on future {name}"
            assert J[t, : t + 1].abs().max() > 0, f"out[{t}] ignores past {name}"
        if name != "q":
            # k, v, beta of earlier positions reach later outputs (also across chunks)
            assert J[T - 1, 0].abs().max() > 0


# ------------------------------------------------------------------ 7. low precision


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("fm,norm", [("identity", "l2"), ("dpfp", "sum")])
def test_low_precision(dtype, tol, fm, norm):
    T = 300
    q, k, v, beta, _ = make_inputs(B=1, H=2, Hkv=1, T=T, Dk=16, Dv=8, seed=13)
    lo = [t.to(dtype) for t in (q, k, v, beta)]
    out, st = delta_rule(*lo, feature_map=fm, normalize=norm, mode="chunk", chunk_size=64, output_final_state=True)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert st.memory.dtype == torch.float32  # accumulated in float32
    assert torch.isfinite(st.memory).all()
    ref, ref_st = delta_rule(*[t.to(F64) for t in lo], feature_map=fm, normalize=norm, mode="recurrent",
                             output_final_state=True)
    scale = ref.abs().max().item()
    err = (out.to(F64) - ref).abs().max().item()
    assert err <= tol * max(scale, 1.0), f"{dtype}: max err {err:.3e} (output scale {scale:.3e})"
    merr = (st.memory.to(F64) - ref_st.memory).abs().max().item()
    assert merr <= tol * max(ref_st.memory.abs().max().item(), 1.0)


def test_float32_recurrent_matches_float64():
    q, k, v, beta, _ = make_inputs(B=1, H=2, Hkv=1, T=300, Dk=16, Dv=8, seed=14)
    out, _ = delta_rule(*(t.float() for t in (q, k, v, beta)), mode="recurrent")
    ref, _ = delta_rule(*(t.float().double() for t in (q, k, v, beta)), mode="recurrent")
    assert out.dtype == torch.float32
    assert_close(out.double(), ref, 1e-4)


# ------------------------------------------------------------------------ 8. bad input


def _good(T=5):
    return make_inputs(B=2, H=4, Hkv=2, T=T, Dk=8, Dv=6)[:4]


def test_bad_beta_shape():
    q, k, v, beta = _good()
    # one beta per query head instead of per key/value head
    with pytest.raises(ValueError, match=r"beta.*\[2, 4, 5\].*\[2, 2, 5\]"):
        delta_rule(q, k, v, torch.rand(2, 4, 5, dtype=F64))
    with pytest.raises(ValueError, match=r"beta.*\[2, 2, 4\]"):
        delta_rule(q, k, v, beta[:, :, :4])
    with pytest.raises(ValueError, match=r"beta.*\[2, 2, 5, 1\]"):
        delta_rule(q, k, v, beta.unsqueeze(-1))


def test_bad_beta_dtype():
    q, k, v, beta = _good()
    with pytest.raises(TypeError, match="beta"):
        delta_rule(q, k, v, torch.ones(2, 2, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="beta"):
        delta_rule(q, k, v, beta.float())  # dtype differs from q
    with pytest.raises(TypeError, match="beta"):
        delta_rule(q, k, v, beta.tolist())


def test_bad_mode_and_chunk_size():
    q, k, v, beta = _good()
    with pytest.raises(ValueError, match="mode"):
        delta_rule(q, k, v, beta, mode="parallel")
    with pytest.raises(ValueError, match="mode"):
        delta_rule(q, k, v, beta, mode="Chunk")
    for bad in (0, -4):
        with pytest.raises(ValueError, match="chunk_size"):
            delta_rule(q, k, v, beta, chunk_size=bad)
    for bad in (2.5, True):
        with pytest.raises(TypeError, match="chunk_size"):
            delta_rule(q, k, v, beta, chunk_size=bad)


def test_bad_normalize_and_feature_map():
    q, k, v, beta = _good()
    with pytest.raises(ValueError, match="normalize"):
        delta_rule(q, k, v, beta, normalize="attention")
    with pytest.raises(ValueError, match="feature_map"):
        delta_rule(q, k, v, beta, feature_map="nope")


def test_bad_initial_state():
    q, k, v, beta = _good()
    with pytest.raises(TypeError, match="initial_state"):
        delta_rule(q, k, v, beta, initial_state=torch.zeros(2, 2, 8, 6, dtype=F64))
    with pytest.raises(TypeError, match="initial_state"):
        delta_rule(q, k, v, beta, initial_state=LinearAttentionState(kv=torch.zeros(2, 2, 8, 6, dtype=F64)))
    # memory per query head instead of per key/value head
    with pytest.raises(ValueError, match=r"initial_state.*\[2, 4, 8, 6\]"):
        delta_rule(q, k, v, beta, initial_state=DeltaRuleState(memory=torch.zeros(2, 4, 8, 6, dtype=F64)))
    # memory sized for Dk, but DPFP's feature dimension is 2 Dk
    with pytest.raises(ValueError, match=r"initial_state.*\[2, 2, 16, 6\]"):
        delta_rule(q, k, v, beta, feature_map="dpfp", normalize="sum",
                   initial_state=DeltaRuleState(memory=torch.zeros(2, 2, 8, 6, dtype=F64)))
    with pytest.raises(TypeError, match="initial_state"):
        delta_rule(q, k, v, beta, initial_state=DeltaRuleState(memory=torch.zeros(2, 2, 8, 6, dtype=torch.int32)))


def test_bad_qkv_shapes():
    q, k, v, beta = _good()
    with pytest.raises(ValueError, match="k has 3 heads"):
        delta_rule(
            q, torch.zeros(2, 3, 5, 8, dtype=F64), torch.zeros(2, 3, 5, 6, dtype=F64), torch.zeros(2, 3, 5, dtype=F64)
        )
    with pytest.raises(ValueError, match=r"k has length"):
        delta_rule(q, k[:, :, :4], v[:, :, :4], beta[:, :, :4])
    with pytest.raises(ValueError, match="scale must be a finite positive number or None .*, got '1'"):
        delta_rule(q, k, v, beta, scale="1")


def test_queries_and_keys_get_their_own_features():
    """A map whose query and key features differ (SoftVQ: ``exp(q.c_s - max_s q.c_s)`` for a
    query, ``softmax_s(-|k - c_s|^2 / 2 tau)`` for a key) must be applied with ``is_query``
    True to q and False to k: the paper loop on features computed here."""
    g = torch.Generator().manual_seed(21)
    codebook = torch.randn(5, 4, generator=g, dtype=F64)
    tau = 0.5
    q, k, v, beta, _ = make_inputs(B=1, H=2, Hkv=1, T=6, Dk=4, Dv=3, seed=22)
    logits = q @ codebook.T
    phi_q = torch.exp(logits - logits.amax(-1, keepdim=True))
    phi_k = torch.softmax(-((k.unsqueeze(-2) - codebook) ** 2).sum(-1) / (2 * tau), dim=-1)
    as_is = lambda x, eps: x  # noqa: E731  (the features are already made)
    expected, expected_memory = paper_delta_rule(phi_q, phi_k, v, beta, as_is, 1.0)
    for mode in ("recurrent", "chunk"):
        out, st = run(q, k, v, beta, feature_map=SoftVQ(codebook, tau), normalize=None, scale=1.0,
                      mode=mode, chunk_size=4)
        assert_close(out, expected, 1e-12, 1e-10, f"{mode} out")
        assert_close(st.memory, expected_memory, 1e-12, 1e-10, f"{mode} memory")


def test_beta_outside_zero_one_is_refused_unless_the_check_is_off():
    """Default ``check_inputs=True``: one write strength below 0, above 1 or NaN is refused
    by name; 0 and 1 themselves are allowed. ``check_inputs=False`` does not read beta."""
    q, k, v, beta = _good()
    for bad in (-0.25, 1.25, float("nan")):
        wrong = beta.clone()
        wrong[1, 0, 3] = bad
        with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):
            delta_rule(q, k, v, wrong)
        out, _ = delta_rule(q, k, v, wrong, check_inputs=False)
        assert out.shape == (2, 4, 5, 6)
    bounds = beta.clone()
    bounds[0, 0, 0], bounds[1, 1, 4] = 0.0, 1.0
    out, _ = delta_rule(q, k, v, bounds)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("T, mode", [(3, "recurrent"), (1, None)])
def test_recurrent_form_has_second_derivatives(T, mode):
    """``mode="recurrent"`` (and the default for T == 1, the decoding step) is the plain
    autograd reference: its second derivatives pass gradgradcheck against finite differences.
    (The chunk form's hand-written backward is first order only.)"""
    q, k, v, beta, _ = make_inputs(B=1, H=2, Hkv=1, T=T, Dk=3, Dv=2, seed=8)
    inputs = tuple(t.clone().requires_grad_(True) for t in (q, k, v, beta))
    assert torch.autograd.gradgradcheck(lambda *a: delta_rule(*a, mode=mode)[0], inputs)


def test_chunk_form_refuses_second_derivatives_naming_the_recurrent_form():
    """``create_graph=True`` through the chunk form raises an error that points to
    ``mode="recurrent"`` (its hand-written backward has no derivative), also when the
    incoming gradient is a constant; a plain backward still works."""
    q, k, v, beta, _ = make_inputs(B=1, H=2, Hkv=1, T=5, Dk=3, Dv=2, seed=9)
    q = q.clone().requires_grad_(True)
    out, _ = delta_rule(q, k, v, beta, mode="chunk", chunk_size=2)
    with pytest.raises(RuntimeError, match="mode='recurrent'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    out, _ = delta_rule(q, k, v, beta, mode="chunk", chunk_size=2)
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(grad).all()
