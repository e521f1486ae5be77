"""Kernel attention (``linattn.linear_attention``): the parallel, chunk and recurrent
forms agree with each other and with the formula, for every feature map and
normalisation; gradients agree; carried state reproduces one call; causality and GQA
hold; half precision does not overflow at T = 65536. Every test runs twice: with the
causal chunk form by the native kernel where ``impl="auto"`` takes it, and with
``LINATTN_LINEAR_IMPL=torch`` (the torch chunk form).

    S_i = S_0 + sum_{j<=i} phi(k_j) v_j^T,   z_i = z_0 + sum_{j<=i} phi(k_j)
    out_i = phi(q_i).S_i / (phi(q_i).z_i + eps)   ("attention")
    out_i = phi~(q_i).S_i, phi~ = phi / sum(phi) on q and k   ("sum")
    out_i = phi(q_i).S_i   (None)
"""

from __future__ import annotations

import functools
import math

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
from linattn.feature_maps import DPFP, FAVOR, Exp, FeatureMap, SoftVQ, get_feature_map

MODES = ("parallel", "chunk", "recurrent")
NORMALIZE = ("attention", "sum", None)
EPS = 1e-6

# Fresh map objects per test (FAVOR caches its projection).
MAPS = {
    "elu": lambda: "elu",
    "relu": lambda: "relu",
    "identity": lambda: "identity",
    "exp": lambda: "exp",
    "favor": lambda: FAVOR(16, seed=0),
    "dpfp1": lambda: DPFP(1),
    "dpfp2": lambda: DPFP(2),
    "taylor": lambda: "taylor",
}


chunk_impl = both_chunk_forms("LINATTN_LINEAR_IMPL")  # every test on the native kernel and on the torch form


# ----------------------------------------------------------------------------- helpers


def inputs_for(map_name, **kwargs):
    """q, k, v for a map: positive q, k for the identity map (denominators stay > 0)."""
    return make_qkv(positive=map_name == "identity", **kwargs)


def is_exponential(fmap):
    return isinstance(get_feature_map(fmap), (Exp, FAVOR))


def true_sums(state):
    """The state's ``(sum phi(k) v^T, sum phi(k))``, undoing the stored key shift."""
    if state.key_shift is None:
        return state.kv, state.normalizer
    factor = torch.exp(state.key_shift)  # [B, Hkv]
    z = None if state.normalizer is None else state.normalizer * factor[..., None]
    return state.kv * factor[..., None, None], z


def loop_reference(q, k, v, fmap, *, causal, normalize, eps=EPS, initial=None, features=None):
    """The formula, one query position at a time, with unstabilised features.

    ``initial``: optional ``(S_0 [B, Hkv, F, Dv], z_0 [B, Hkv, F] or None)`` true sums.
    ``features``: optional ``(phi(q), phi(k))`` computed by the caller, for maps whose
    query and key features differ.
    Returns ``(out, S_final, z_final)`` with the final sums per key/value head.
    """
    B, H, T, _ = q.shape
    Hkv = k.shape[1]
    if features is None:
        phi_q, phi_k = independent_features(fmap, q), independent_features(fmap, k)
    else:
        phi_q, phi_k = features
    if normalize == "sum":
        extra = 0.0 if is_exponential(fmap) else eps  # exponential maps normalise exactly
        phi_q = phi_q / (phi_q.sum(-1, keepdim=True) + extra)
        phi_k = phi_k / (phi_k.sum(-1, keepdim=True) + extra)
    F_, Dv = phi_k.shape[-1], v.shape[-1]
    S0 = torch.zeros(B, Hkv, F_, Dv, dtype=q.dtype) if initial is None else initial[0]
    z0 = torch.zeros(B, Hkv, F_, dtype=q.dtype) if initial is None or initial[1] is None else initial[1]
    heads = torch.arange(H) // (H // Hkv)
    out = torch.empty(B, H, T, Dv, dtype=q.dtype)
    for i in range(T):
        n = i + 1 if causal else k.shape[2]  # non-causal: every key (T_k may differ from T)
        S = S0 + torch.einsum("bgnf,bgne->bgfe", phi_k[:, :, :n], v[:, :, :n])
        z = z0 + phi_k[:, :, :n].sum(2)
        num = torch.einsum("bhf,bhfe->bhe", phi_q[:, :, i], S[:, heads])
        if normalize == "attention":
            num = num / (torch.einsum("bhf,bhf->bh", phi_q[:, :, i], z[:, heads]) + eps)[..., None]
        out[:, :, i] = num
    S_final = S0 + torch.einsum("bgnf,bgne->bgfe", phi_k, v)
    z_final = z0 + phi_k.sum(2)
    return out, S_final, z_final


class AsymmetricExp(FeatureMap):
    """A user's exponential map whose query and key features differ:
    ``log phi(q) = q``, ``log phi(k) = 2 k - 1``."""

    name = "asymmetric-exp"
    exponential = True

    def dim_out(self, d):
        return d

    def log_features(self, x, *, is_query):
        return x if is_query else 2 * x - 1


def soft_vq_codebook(Dk=4, S=5):
    return torch.randn(S, Dk, generator=torch.Generator().manual_seed(11), dtype=F64)


def own_features(map_name, q, k):
    """``(phi(q), phi(k))`` of the maps whose queries and keys differ, from their formulas:
    SoftVQ (temperature 0.5) ``exp(q.c - max q.c)`` and ``softmax(-|k - c|^2 / 2 tau)``;
    ``AsymmetricExp`` ``exp(q)`` and ``exp(2 k - 1)``."""
    if map_name == "asymmetric-exp":
        return torch.exp(q), torch.exp(2 * k - 1)
    C = soft_vq_codebook(q.shape[-1])
    logits = torch.einsum("...d,sd->...s", q, C)
    distances = ((k.unsqueeze(-2) - C) ** 2).sum(-1)
    return torch.exp(logits - logits.max(-1, keepdim=True).values), torch.softmax(-distances / (2 * 0.5), dim=-1)


def run(q, k, v, fmap, **kwargs):
    kwargs.setdefault("output_final_state", True)
    return linear_attention(q, k, v, feature_map=fmap, **kwargs)


def _prefix_state(map_name, fmap, normalize, *, B=1, Hkv=2, Dk=4, Dv=3, T=6):
    """A realistic initial state (from a prefix), detached, its sums requiring grad."""
    q, k, v = inputs_for(map_name, B=B, H=Hkv, Hkv=Hkv, T=T, Dk=Dk, Dv=Dv, seed=99)
    _, state = run(q, k, v, fmap, normalize=normalize, mode="parallel")
    state = state.detach()
    state.kv.requires_grad_(True)
    if state.normalizer is not None:
        state.normalizer.requires_grad_(True)
    return state


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("T, with_state", [(37, False), (37, True), (1, True)], ids=["T37", "T37-state", "T1-state"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("normalize", NORMALIZE, ids=["attention", "sum", "none"])
@pytest.mark.parametrize("map_name", list(MAPS))
def test_modes_match_formula(map_name, normalize, causal, T, with_state):
    """parallel == chunk (chunk 8, T not a multiple) == recurrent == the per-position loop,
    for outputs and final states (B=2, H=4, Hkv=2, Dk=4, Dv=3), optionally continuing
    from the state of a 6-position prefix (its sums enter every position)."""
    fmap = MAPS[map_name]()
    q, k, v = inputs_for(map_name, B=2, H=4, Hkv=2, T=T, Dk=4, Dv=3, seed=T)
    init = initial = None
    if with_state:
        init = _prefix_state(map_name, fmap, normalize, B=2).detach()
        initial = true_sums(init)
    expected, S_final, z_final = loop_reference(q, k, v, fmap, causal=causal, normalize=normalize, initial=initial)
    for mode in MODES:
        out, state = run(q, k, v, fmap, causal=causal, normalize=normalize, mode=mode, chunk_size=8, initial_state=init)
        assert out.dtype == F64 and state.steps == T + (6 if with_state else 0)
        assert_close_rel(out, expected, rtol=1e-9, name=f"{mode} output")
        kv, z = true_sums(state)
        assert_close_rel(kv, S_final, rtol=1e-9, name=f"{mode} state.kv")
        if normalize == "attention":
            assert_close_rel(z, z_final, rtol=1e-9, name=f"{mode} state.normalizer")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("map_name", ["soft-vq", "asymmetric-exp"])
def test_queries_and_keys_get_their_own_features(map_name, causal):
    """Maps whose query and key features differ (SoftVQ; a user's exponential map, which
    "attention" stabilises by shifts) == the formula with each side's own features, in
    every mode (chunk 4 of T=9) and normalisation."""
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=9, Dk=4, Dv=3, seed=12)
    features = own_features(map_name, q, k)
    normalizations = NORMALIZE if map_name == "soft-vq" else ("attention", None)
    fmap = SoftVQ(soft_vq_codebook(), temperature=0.5) if map_name == "soft-vq" else AsymmetricExp()
    for normalize in normalizations:
        expected, S_final, _ = loop_reference(q, k, v, fmap, causal=causal, normalize=normalize, features=features)
        for mode in MODES:
            out, state = run(q, k, v, fmap, causal=causal, normalize=normalize, mode=mode, chunk_size=4)
            assert_close_rel(out, expected, rtol=1e-9, name=f"{normalize} {mode} output")
            assert_close_rel(true_sums(state)[0], S_final, rtol=1e-9, name=f"{normalize} {mode} state.kv")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T_q, T_k", [(1, 9), (3, 17), (17, 5)])
@pytest.mark.parametrize("normalize", NORMALIZE, ids=["attention", "sum", "none"])
@pytest.mark.parametrize("map_name", ["elu", "favor", "dpfp1"])
def test_noncausal_reads_keys_of_another_length(map_name, normalize, T_q, T_k, mode):
    """causal=False with T_q != T_k (e.g. a few queries reading a long memory) == the formula;
    the state counts the keys; causal=True refuses different lengths."""
    q, _, _ = inputs_for(map_name, B=2, H=4, Hkv=2, T=T_q, Dk=4, Dv=3, seed=T_q)
    _, k, v = inputs_for(map_name, B=2, H=4, Hkv=2, T=T_k, Dk=4, Dv=3, seed=T_k + 50)
    expected, S_final, _ = loop_reference(q, k, v, MAPS[map_name](), causal=False, normalize=normalize)
    out, state = run(q, k, v, MAPS[map_name](), causal=False, normalize=normalize, mode=mode, chunk_size=4)
    assert out.shape == (2, 4, T_q, 3) and state.steps == T_k
    assert_close_rel(out, expected, rtol=1e-9, name=f"{mode} output")
    assert_close_rel(true_sums(state)[0], S_final, rtol=1e-9, name=f"{mode} state.kv")
    with pytest.raises(ValueError, match="k has length"):
        run(q, k, v, MAPS[map_name](), causal=True, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("Hkv", [1, 2])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("map_name", ["elu", "favor"])
def test_gqa_equals_repeated_heads(map_name, causal, Hkv, mode):
    """H=4 query heads over Hkv kv heads == the op on k, v repeat_interleave'd to 4 heads."""
    q, k, v = inputs_for(map_name, B=2, H=4, Hkv=Hkv, T=13, Dk=4, Dv=3)
    group = 4 // Hkv
    out, _ = run(q, k, v, MAPS[map_name](), causal=causal, mode=mode, chunk_size=4)
    full, _ = run(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), MAPS[map_name](),
        causal=causal, mode="parallel",
    )
    assert_close_rel(out, full, rtol=1e-10)


@pytest.mark.parametrize("mode", MODES)
def test_strided_inputs(mode):
    """Inputs that are [B, T, H, D] tensors viewed as [B, H, T, D] (non-contiguous)."""
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=11, Dk=4, Dv=3)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not strided[0].is_contiguous()
    out, _ = run(*strided, FAVOR(16, seed=0), mode=mode, chunk_size=4)
    expected, _, _ = loop_reference(q, k, v, FAVOR(16, seed=0), causal=True, normalize="attention")
    assert_close_rel(out, expected, rtol=1e-9)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("normalize", NORMALIZE, ids=["attention", "sum", "none"])
@pytest.mark.parametrize("map_name", ["elu", "favor", "exp", "dpfp2"])
def test_gradients_match_across_modes(map_name, normalize, causal):
    """d/d(q, k, v, initial kv, initial normalizer) of a loss on the output and the final
    state are the same in the three modes."""
    fmap = MAPS[map_name]()
    q, k, v = inputs_for(map_name, B=1, H=4, Hkv=2, T=19, Dk=4, Dv=3, requires_grad=True)
    init = _prefix_state(map_name, fmap, normalize)
    wrt = [q, k, v, init.kv] + ([init.normalizer] if init.normalizer is not None else [])
    g = torch.Generator().manual_seed(3)
    grad_out = torch.randn(1, 4, 19, 3, generator=g, dtype=F64)
    grad_kv = torch.randn(init.kv.shape, generator=g, dtype=F64)
    grads = {}
    for mode in MODES:
        out, state = run(
            q, k, v, fmap, causal=causal, normalize=normalize, mode=mode, chunk_size=8, initial_state=init
        )
        loss = (out * grad_out).sum() + (state.kv * grad_kv).sum()
        grads[mode] = torch.autograd.grad(loss, wrt)
    for mode in ("chunk", "recurrent"):
        for i, (g_mode, g_ref) in enumerate(zip(grads[mode], grads["parallel"])):
            assert_close_rel(g_mode, g_ref, rtol=1e-9, name=f"{mode} grad of input {i}")


@pytest.mark.parametrize(
    "map_name, normalize, causal",
    [("elu", "attention", True), ("favor", "attention", True), ("exp", "attention", False), ("dpfp1", "sum", True)],
)
def test_chunk_gradcheck_with_initial_state(map_name, normalize, causal):
    """Finite differences agree with autograd for chunk mode (T=5, chunk 2) with an
    initial state, w.r.t. q, k, v and the state's sums."""
    fmap = MAPS[map_name]()
    q, k, v = inputs_for(map_name, B=1, H=2, Hkv=1, T=5, Dk=3, Dv=2, requires_grad=True)
    init = _prefix_state(map_name, fmap, normalize, Hkv=1, Dk=3, Dv=2, T=3)
    with_z = init.normalizer is not None

    def fn(q, k, v, kv, *z):
        state = LinearAttentionState(kv=kv, normalizer=z[0] if with_z else None, key_shift=init.key_shift, steps=3)
        out, _ = run(q, k, v, fmap, causal=causal, normalize=normalize, mode="chunk", chunk_size=2, initial_state=state)
        return out

    inputs = (q, k, v, init.kv) + ((init.normalizer,) if with_z else ())
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("map_name", ["elu", "favor", "exp"])
def test_chunk_causal_jacobian_is_lower_triangular(map_name):
    """Chunk mode (chunk 4, T=6): d out_i / d (q_j, k_j, v_j) is exactly zero for j > i,
    even though exponential maps subtract a (detached) max over all key positions."""
    fmap = MAPS[map_name]()
    q, k, v = inputs_for(map_name, B=1, H=2, Hkv=1, T=6, Dk=3, Dv=2, seed=5)

    def fn(q, k, v):
        return run(q, k, v, fmap, causal=True, mode="chunk", chunk_size=4, output_final_state=False)[0]

    assert_causal_jacobian(fn, (q, k, v), ("q", "k", "v"))


# ----------------------------------------------------------------------------- state carry

PIECES = [(5, "chunk"), (1, "recurrent"), (9, "parallel"), (1, "recurrent"), (13, "chunk"), (8, "parallel")]


def _carry_inputs(map_name):
    """T=37 inputs whose key magnitude rises then falls, so the largest key (and the
    key shift of exponential maps) moves both up and down between pieces."""
    q, k, v = inputs_for(map_name, B=2, H=4, Hkv=2, T=37, Dk=4, Dv=3, seed=8)
    ramp = 1 + 1.5 * torch.sin(math.pi * torch.arange(37, dtype=F64) / 37)
    return q, k * ramp[:, None], v


@pytest.mark.parametrize("normalize", NORMALIZE, ids=["attention", "sum", "none"])
@pytest.mark.parametrize("map_name", ["elu", "favor", "exp", "dpfp2"])
def test_state_carry_equals_one_call(map_name, normalize):
    """Pieces of lengths 5, 1, 9, 1, 13, 8 in mixed modes (length 1 in recurrent mode),
    carrying the state, give the one-call output and final state; steps add up."""
    fmap = MAPS[map_name]()
    q, k, v = _carry_inputs(map_name)
    whole, whole_state = run(q, k, v, fmap, normalize=normalize, mode="chunk", chunk_size=8)
    outs, state, start = [], None, 0
    for length, mode in PIECES:
        sl = slice(start, start + length)
        out, state = run(
            q[:, :, sl], k[:, :, sl], v[:, :, sl], fmap,
            normalize=normalize, mode=mode, chunk_size=4, initial_state=state,
        )
        start += length
        assert state.steps == start
        outs.append(out)
    assert_close_rel(torch.cat(outs, dim=2), whole, rtol=1e-9, name="output")
    for name, a, b in zip(("kv", "normalizer"), true_sums(state), true_sums(whole_state)):
        if b is not None:
            assert_close_rel(a, b, rtol=1e-9, name=name)


def test_state_carry_keeps_larger_key_shift():
    """float32, exp map, a dominant first key (log-feature 100, beyond float32's exp
    range): later pieces must keep the state's larger shift rather than rescale the
    state by exp(100 - 2), so the carried output stays finite and equals one call."""
    q, k, v = (t.float() for t in inputs_for("exp", B=1, H=2, Hkv=1, T=37, Dk=4, Dv=3, seed=4))
    k[:, :, 0, 0] = 100.0
    whole, _ = run(q, k, v, "exp", mode="chunk", chunk_size=8)
    expected, _, _ = loop_reference(q.double(), k.double(), v.double(), "exp", causal=True, normalize="attention")
    assert_close_rel(whole, expected, rtol=1e-4, name="one call")
    outs, state, start = [], None, 0
    for length, mode in PIECES:
        sl = slice(start, start + length)
        out, state = run(q[:, :, sl], k[:, :, sl], v[:, :, sl], "exp", mode=mode, initial_state=state)
        outs.append(out)
        start += length
    assert_close_rel(torch.cat(outs, dim=2), expected, rtol=1e-4, name="carried")


@pytest.mark.parametrize("map_name", ["exp", "favor"])
def test_state_without_key_shift_holds_unshifted_sums(map_name):
    """A hand-built state (true sums of a prefix, key_shift=None) continues the sequence
    like one call, for exponential maps."""
    fmap = MAPS[map_name]()
    q, k, v = _carry_inputs(map_name)
    whole, _ = run(q, k, v, fmap, mode="chunk")
    P = 20
    prefix = (q[:, :, :P], k[:, :, :P], v[:, :, :P])
    _, S_prefix, z_prefix = loop_reference(*prefix, fmap, causal=True, normalize="attention")
    state = LinearAttentionState(kv=S_prefix, normalizer=z_prefix, steps=P)
    out, final = run(q[:, :, P:], k[:, :, P:], v[:, :, P:], fmap, mode="chunk", chunk_size=4, initial_state=state)
    assert_close_rel(out, whole[:, :, P:], rtol=1e-9)
    assert final.steps == 37


def test_final_state_is_returned_only_when_asked():
    """By default (``output_final_state=False``) the second result is None; asked for, it is
    the state after the last position."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=5, Dk=3, Dv=2)
    for fmap in ("elu", "exp"):
        out, state = linear_attention(q, k, v, feature_map=fmap)
        assert state is None
        asked, state = linear_attention(q, k, v, feature_map=fmap, output_final_state=True)
        assert isinstance(state, LinearAttentionState) and state.steps == 5
        assert torch.equal(asked, out)


def test_state_key_shift_of_the_wrong_shape_is_refused_by_name():
    """An exponential map's carried ``key_shift`` must be ``[B, Hkv]``: flattened (the same
    size) or of the wrong length, it is refused naming ``initial_state.key_shift``."""
    q, k, v = make_qkv(B=1, H=2, Hkv=2, T=5, Dk=3, Dv=2)
    _, state = run(q, k, v, "exp")
    for bad in (state.key_shift.reshape(2), torch.zeros(1, 3, dtype=F64)):
        carried = LinearAttentionState(kv=state.kv, normalizer=state.normalizer, key_shift=bad, steps=5)
        with pytest.raises(ValueError, match=r"initial_state\.key_shift has shape \[.*\], expected \[1, 2\]"):
            run(q, k, v, "exp", initial_state=carried)


# ----------------------------------------------------------------------------- float32 range


# (key, query, at) of wide_shift_inputs: shifts summing to 100, and to 80 on queries of the
# second chunk of 4, the first chunk's shifts staying ordinary. 80 is past the guard's limit
# (log(eps) - log(float32 tiny) - 17 = 56.5 for eps = 1e-6) but below that limit + 34, and the
# float32 gradients already overflow there (NaN from about 75).
WIDE_SHIFTS = {"shift100": (60.0, 40.0, 0), "shift80-second-chunk": (30.0, 50.0, 4)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shifts", list(WIDE_SHIFTS))
def test_float32_wide_shifts_match_float64_formula(shifts, mode):
    """float32 inputs whose shifts leave float32's range: output and gradients are finite
    and equal the float64 formula; the output keeps the input dtype. The guard reads the
    largest shift of every chunk, and takes shifts that sum to 80 as well as 100."""
    key, query, at = WIDE_SHIFTS[shifts]
    q, k, v = wide_shift_inputs(key, query, at)
    grad_out = torch.randn(1, 2, q.shape[2], 3, generator=torch.Generator().manual_seed(6), dtype=F64)
    ref_inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected, _, _ = loop_reference(*ref_inputs, "exp", causal=True, normalize="attention")
    expected_grads = torch.autograd.grad((expected * grad_out).sum(), ref_inputs)
    inputs = [t.float().requires_grad_(True) for t in (q, k, v)]
    out, _ = run(*inputs, "exp", mode=mode, chunk_size=4)
    assert out.dtype == torch.float32
    grads = torch.autograd.grad((out * grad_out.float()).sum(), inputs)
    assert_close_rel(out, expected, rtol=1e-4, name="output")
    for name, actual, wanted in zip("qkv", grads, expected_grads):
        assert_close_rel(actual, wanted, rtol=1e-4, name=f"grad {name}")


def test_float32_wide_shifts_state_carry():
    """The same inputs in pieces with a carried state: the outputs equal the float64
    formula, and the final state is float32 and holds the true sums."""
    q, k, v = wide_shift_inputs()
    expected, S_ref, z_ref = loop_reference(q, k, v, "exp", causal=True, normalize="attention")
    qf, kf, vf = q.float(), k.float(), v.float()
    outs, state, start = [], None, 0
    for length, mode in [(3, "chunk"), (1, "recurrent"), (5, "parallel"), (4, "chunk")]:
        sl = slice(start, start + length)
        out, state = run(qf[:, :, sl], kf[:, :, sl], vf[:, :, sl], "exp", mode=mode, chunk_size=2,
                         initial_state=state)
        outs.append(out)
        start += length
    assert_close_rel(torch.cat(outs, dim=2), expected, rtol=1e-4, name="output")
    assert state.kv.dtype == state.normalizer.dtype == state.key_shift.dtype == torch.float32
    kv, normalizer = true_sums(state)
    assert_close_rel(kv, S_ref, rtol=1e-4, name="kv")
    assert_close_rel(normalizer, z_ref, rtol=1e-4, name="normalizer")


@pytest.mark.parametrize("map_name", ["exp", "favor"])
def test_float32_ordinary_shifts_stay_in_float32(map_name, monkeypatch):
    """Inputs of ordinary scale never take the float64 recomputation."""
    import linattn.ops.kernel.attention as linear_module

    def fail(*args, **kwargs):
        raise AssertionError("ordinary float32 inputs were recomputed in float64")

    monkeypatch.setattr(linear_module, "_in_float64", fail)
    q, k, v = (t.float() for t in inputs_for(map_name, B=2, H=4, Hkv=2, T=37, Dk=4, Dv=3))
    for mode in MODES:
        out, _ = run(q, k, v, MAPS[map_name](), mode=mode, chunk_size=8)
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("map_name", ["exp", "favor"])
def test_float32_exponential_maps_accept_zero_eps(map_name):
    """``eps=0`` (allowed: eps >= 0) with an exponential map in float32, where the range
    guard has no eps term to protect, == the float64 formula without eps."""
    q, k, v = (t.float() for t in inputs_for(map_name, B=1, H=2, Hkv=1, T=9, Dk=4, Dv=3))
    expected, _, _ = loop_reference(q.double(), k.double(), v.double(), MAPS[map_name](), causal=True,
                                    normalize="attention", eps=0.0)
    for mode in MODES:
        out, _ = run(q, k, v, MAPS[map_name](), mode=mode, chunk_size=4, eps=0.0)
        assert_close_rel(out, expected, rtol=1e-5, name=f"{mode} output")


@pytest.mark.parametrize("map_name", ["exp", "asymmetric-exp"])
def test_largest_shift_is_the_largest_query_plus_key_shift_of_a_row(map_name):
    """The shift on which a compiled call decides the float64 recomputation (in the graph,
    before either computation) == max over rows of (the row's largest query log-feature +
    its key/value head's key shift); the key shift is merged with a carried state's (0 for
    a state without one). GQA (H=4 over Hkv=2); keys below 0 so that the merge matters."""
    from linattn.ops.kernel.attention import _largest_shift

    fmap = Exp() if map_name == "exp" else AsymmetricExp()
    q, k, _ = make_qkv(B=2, H=4, Hkv=2, T=5, Dk=3, Dv=2, dtype=torch.float32, seed=13)
    k = k - 5
    log_q, log_k = q.double(), (k.double() if map_name == "exp" else 2 * k.double() - 1)
    row_shifts = log_q.amax(-1)  # [B, H, T]
    heads = torch.arange(4) // 2
    key_shift = log_k.amax((-1, -2))  # [B, Hkv]
    carried = torch.tensor([[4.0, -30.0], [-30.0, -30.0]])
    cases = {  # name: (carried key_shift or None, the key shift the rows see)
        "no state": (None, key_shift),
        "state with a shift": (carried, torch.maximum(key_shift, carried.double())),
        "state without a shift": (None, key_shift.clamp_min(0.0)),
    }
    for name, (shift, merged) in cases.items():
        state = None
        if name != "no state":
            state = LinearAttentionState(kv=torch.zeros(2, 2, 3, 2), normalizer=torch.zeros(2, 2, 3), key_shift=shift,
                                         steps=5)
        expected = (row_shifts + merged[:, heads, None]).max()
        torch.testing.assert_close(_largest_shift(q, k, fmap, state).double(), expected, rtol=1e-6, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_compiled_noncausal_call_returns_the_whole_state():
    """Compiled (fullgraph), a non-causal exp-map call in float32 with a final state, on
    ordinary and on wide shifts (the two branches of the graph's float64 choice), returns
    the float64 formula's output and the whole state (the layers' compiled calls are causal)."""
    compiled = torch.compile(functools.partial(linear_attention, feature_map="exp", causal=False,
                                               output_final_state=True), backend="eager", fullgraph=True)
    for q, k, v in (make_qkv(B=1, H=2, Hkv=1, T=13, Dk=2, Dv=3), wide_shift_inputs()):
        expected, S_ref, z_ref = loop_reference(q, k, v, "exp", causal=False, normalize="attention")
        out, state = compiled(q.float(), k.float(), v.float())
        assert out.dtype == state.kv.dtype == state.normalizer.dtype == state.key_shift.dtype == torch.float32
        kv, normalizer = true_sums(state)
        assert_close_rel(out, expected, rtol=1e-5, name="output")
        assert_close_rel(kv, S_ref, rtol=1e-5, name="kv")
        assert_close_rel(normalizer, z_ref, rtol=1e-5, name="normalizer")


# ----------------------------------------------------------------------------- half precision


@functools.lru_cache(maxsize=None)
def _long_inputs(map_name, dtype):
    """T=65536 inputs in ``dtype`` (q, k shifted by +1 so elu+1 sums reach ~1e5, beyond
    float16's range) and the float64 result on the same rounded values."""
    q, k, v = make_qkv(B=1, H=1, Hkv=1, T=65536, Dk=16, Dv=16, seed=6)
    q, k, v = (q + 1).to(dtype), (k + 1).to(dtype), v.to(dtype)
    expected, _ = run(q.to(F64), k.to(F64), v.to(F64), MAPS[map_name](), mode="chunk", output_final_state=False)
    return q, k, v, expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("map_name", ["elu", "favor"])
def test_half_precision_long_sequence(map_name, dtype):
    """fp16/bf16 at T=65536 (chunk mode): finite output in the input dtype, close to the
    float64 computation; the final state is float32."""
    q, k, v, expected = _long_inputs(map_name, dtype)
    out, state = run(q, k, v, MAPS[map_name](), mode="chunk")
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert state.kv.dtype == torch.float32 and torch.isfinite(state.kv).all()
    assert_close_rel(out, expected, rtol=1e-2 if dtype == torch.float16 else 3e-2)


@pytest.mark.parametrize("causal, T, mode, expected", [
    (True, 5, "parallel", "parallel"), (True, 5, "chunk", "chunk"), (True, 5, "recurrent", "recurrent"),
    (False, 5, "parallel", "parallel"), (False, 1, "recurrent", "recurrent"),
    (True, 5, None, "chunk"), (True, 1, None, "recurrent"), (False, 1, None, "chunk"), (False, 5, None, "chunk"),
])
def test_mode_runs_the_form_it_names(monkeypatch, causal, T, mode, expected):
    """An explicit ``mode`` runs that form (their memory differs: the parallel form is
    quadratic); ``None`` runs the recurrent form for a causal T == 1 call, else the chunk form."""
    import linattn.ops.kernel.forms as module

    ran = []
    for name in ("parallel", "chunk", "recurrent"):
        form = getattr(module, name)
        monkeypatch.setattr(module, name, functools.partial(lambda form, name, *a: ran.append(name) or form(*a),
                                                            form, name))
    q, k, v = (torch.randn(1, 2, T, 4, dtype=torch.float64) for _ in range(3))
    linear_attention(q, k, v, causal=causal, mode=mode, chunk_size=2, impl="torch")
    assert ran == [expected]
