"""ReRoPE (``rerope=w``) on softmax_attention, local_attention and vq_attention, and the layer
specs that use it: every form against the score written out here with one rotation matrix per
pair of positions,

    s_ij = scale (R(min(i - j, w)) q_i) . k_j,    R(p) = diag over m of [[cos a, -sin a], [sin a, cos a]],
                                                  a = p base^(-2m/D) on the pair (x_2m, x_2m+1),

in float64: outputs, final states and gradients, on w = 1, w >= T, lengths that are not a
multiple of the block, states carried across uneven pieces, GQA, batch > 1 and decoding one
token at a time; and the refusals (w > block_size for VQ, the forms without a ReRoPE form).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from linattn import local_attention, softmax_attention, vq_attention, vq_decode_step
from linattn.models import LM, LMConfig
from linattn.nn import GAU, Attention
from linattn.inspector import _Recorder
from linattn.nn.rotary import apply_rotary
from linattn.ops.vq import vq_attention_weights

from _helpers import assert_causal_jacobian, assert_close_rel, assert_decodes_as_full_pass, head_fields, make_qkv

F64 = torch.float64
BASE = 10000.0


# ----------------------------------------------------------------------------- the written-out score


@functools.cache
def rotation_matrix(p: int, D: int, base: float = BASE) -> torch.Tensor:
    """R(p) ``[D, D]``: block diagonal, the pair (2m, 2m+1) turned by ``p * base^(-2m/D)``."""
    R = torch.zeros(D, D, dtype=F64)
    for m in range(D // 2):
        angle = p * base ** (-2 * m / D)
        c, s = math.cos(angle), math.sin(angle)
        R[2 * m, 2 * m], R[2 * m, 2 * m + 1] = c, -s
        R[2 * m + 1, 2 * m], R[2 * m + 1, 2 * m + 1] = s, c
    return R


def loop_attention(q, k, v, w, *, scale=None, past=0, window=None, extra=None, L=None, base=BASE):
    """Causal softmax, one query and one key at a time: query t sits at position ``past + t`` of
    the keys, sees keys j <= i (``window``: also ``i - j < window``), with the score
    ``scale (R(min(i - j, w)) q_i).k_j`` (``w=None``: ``scale q_i.k_j``), plus ``extra(b, h, t, i - j)``
    for ``0 <= i - j <= L`` when given. Differentiable: autograd gives its gradients."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    rows = []
    for b in range(B):
        heads = []
        for h in range(H):
            kv = h // (H // Hkv)
            outs = []
            for t in range(T):
                i = past + t
                seen = [j for j in range(i + 1) if window is None or i - j < window]
                scores = []
                for j in seen:
                    query = q[b, h, t] if w is None else rotation_matrix(min(i - j, w), D, base) @ q[b, h, t]
                    score = scale * (query * k[b, kv, j]).sum()
                    if extra is not None and i - j <= L:
                        score = score + extra(b, h, t, i - j)
                    scores.append(score)
                weights = torch.softmax(torch.stack(scores), dim=0)
                outs.append((weights[:, None] * v[b, kv, seen]).sum(0))
            heads.append(torch.stack(outs))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def grads(out, inputs, seed=7):
    """Gradients of ``(out * g).sum()`` for a fixed random g, w.r.t. ``inputs``."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * g).sum(), inputs, retain_graph=True)


def assert_same_with_grads(actual, expected, inputs, names, rtol=1e-10):
    assert_close_rel(actual, expected, rtol=rtol, name="output")
    for name, a, e in zip(names, grads(actual, inputs), grads(expected, inputs)):
        assert_close_rel(a, e, rtol=rtol, name=f"gradient wrt {name}")


# ----------------------------------------------------------------------------- softmax_attention

SOFTMAX_CASES = [  # (T, w, block_size of the tiled form)
    (9, 1, 4),  # w = 1: only the diagonal is rotated by its distance
    (9, 3, 4),  # the window's edge crosses key blocks
    (9, 9, 4),  # w >= T: plain rotary
    (11, 4, 3),  # T not a multiple of the block
    (7, 2, 16),  # one block
]


@pytest.mark.parametrize("impl", ["reference", "tiled", "auto"])
@pytest.mark.parametrize("T,w,block", SOFTMAX_CASES)
def test_softmax_rerope_equals_the_written_loop(impl, T, w, block):
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=T, Dk=6, Dv=3, seed=T + w, requires_grad=True)
    out = softmax_attention(q, k, v, causal=True, rerope=w, impl=impl, block_size=block)
    expected = loop_attention(q, k, v, w)
    assert_same_with_grads(out, expected, (q, k, v), "qkv")


def test_softmax_rerope_continues_a_cache_and_shifts_callable_bias_and_entropy_scale():
    """S > T: the queries are the last T of the keys (a block after a cache); a callable bias
    reads i - j at those positions, the entropy scale counts the keys each query sees."""
    T, S, w = 4, 10, 3
    q, k, v = make_qkv(B=2, H=2, Hkv=1, T=T, S=S, Dk=4, Dv=3, seed=3, requires_grad=True)
    slopes = torch.tensor([0.3, -0.2], dtype=F64)
    table = slopes[:, None] * torch.arange(S, dtype=F64)[None, :] + 0.4 * torch.cos(torch.arange(S, dtype=F64))

    def bias(offsets):
        return slopes[:, None] * offsets.to(F64)[None, :] + 0.4 * torch.cos(offsets.to(F64))[None, :]

    for impl in ("reference", "tiled"):
        out = softmax_attention(q, k, v, causal=True, rerope=w, impl=impl, block_size=3, bias=bias)
        expected = loop_attention(q, k, v, w, past=S - T, extra=lambda b, h, t, d: table[h, d], L=S)
        assert_same_with_grads(out, expected, (q, k, v), "qkv")
        scaled = softmax_attention(q, k, v, causal=True, rerope=w, impl=impl, block_size=3, scale="entropy")
        seen = torch.arange(S - T + 1, S + 1, dtype=F64)  # query t sees S - T + t + 1 keys
        row_scale = (torch.log(seen) / math.log(512) / 2.0)[:, None]
        expected = loop_attention(q * row_scale * 2.0, k, v, w, past=S - T)  # scale 1/sqrt(4) folded in q
        assert_close_rel(scaled, expected, rtol=1e-10, name=f"{impl} entropy scale")


def test_softmax_rerope_differs_from_rotary_inside_T_and_equals_it_beyond():
    """The loop's R(p) is linattn's rotary rotation (R(i)^T R(j) = R(j - i)), so ReRoPE with
    w >= T is rotary attention; with w < T it is not."""
    x = torch.randn(1, 1, 5, 6, dtype=F64)
    for t, row in enumerate(apply_rotary(x, offset=3)[0, 0]):
        torch.testing.assert_close(row, rotation_matrix(3 + t, 6) @ x[0, 0, t])
    torch.testing.assert_close(rotation_matrix(4, 6).T @ rotation_matrix(9, 6), rotation_matrix(5, 6))
    q, k, v = make_qkv(B=1, H=2, Hkv=2, T=8, Dk=4, Dv=3, seed=1)
    rotary = softmax_attention(apply_rotary(q), apply_rotary(k), v, causal=True, impl="reference")
    for impl in ("reference", "tiled"):
        assert_close_rel(softmax_attention(q, k, v, causal=True, rerope=8, impl=impl), rotary, name="w >= T")
        assert (softmax_attention(q, k, v, causal=True, rerope=3, impl=impl) - rotary).abs().max() > 1e-3


@pytest.mark.parametrize("impl", ["reference", "tiled"])
def test_softmax_rerope_is_causal(impl):
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=6, Dk=4, Dv=2, seed=2)
    assert_causal_jacobian(lambda q, k, v: softmax_attention(q, k, v, causal=True, rerope=2, impl=impl,
                                                             block_size=4), (q, k, v), "qkv")


@pytest.mark.parametrize("kwargs,message", [
    (dict(impl="sdpa"), "impl='sdpa' takes one score product"),
    (dict(causal=False), "needs causal=True"),
    (dict(rerope=0), "rerope must be None or the ReRoPE window, an int >= 1, got 0"),
    (dict(rerope=True), "an int >= 1, got True"),
    (dict(rerope=2.0), "an int >= 1, got 2.0"),
    (dict(rotary_base=1.0), "rotary_base must be a finite number > 1, got 1.0"),
])
def test_softmax_rerope_refusals(kwargs, message):
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=5, Dk=4, Dv=2)
    call = dict(causal=True, rerope=2) | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        softmax_attention(q, k, v, **call)


def test_softmax_rerope_refuses_fewer_keys_than_queries_and_an_odd_head_dim():
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=5, S=4, Dk=4, Dv=2)
    with pytest.raises(ValueError, match="S >= T; got T=5 queries and S=4 keys"):
        softmax_attention(q, k, v, causal=True, rerope=2)
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=5, Dk=5, Dv=2)
    with pytest.raises(ValueError, match="needs an even key dimension, got Dk=5"):
        softmax_attention(q, k, v, causal=True, rerope=2)


# ----------------------------------------------------------------------------- local_attention

LOCAL_CASES = [  # (T, window W, look_backward, w)
    (13, 4, 1, 1),
    (13, 4, 1, 2),
    (13, 4, 2, 5),  # the window reaches 7 back, ReRoPE's edge inside it
    (13, 4, 1, 6),  # w >= the keys a query sees: rotary in the window
    (3, 4, 2, 2),  # T <= W: the few-queries form
]


@pytest.mark.parametrize("T,W,back,w", LOCAL_CASES)
def test_local_rerope_equals_the_written_loop(T, W, back, w):
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=T, Dk=4, Dv=3, seed=T + W + w, requires_grad=True)
    out, _ = local_attention(q, k, v, window=W, look_backward=back, rerope=w)
    expected = loop_attention(q, k, v, w, window=W * back)
    assert_same_with_grads(out, expected, (q, k, v), "qkv")


@pytest.mark.parametrize("pieces", [(5, 1, 6, 1), (1,) * 13, (12, 1)])
def test_local_rerope_carries_its_state_across_uneven_pieces(pieces):
    W, back, w = 4, 2, 3
    q, k, v = make_qkv(B=2, H=2, Hkv=1, T=13, Dk=4, Dv=3, seed=4, requires_grad=True)
    full, final = local_attention(q, k, v, window=W, look_backward=back, rerope=w, output_final_state=True)
    state, outs, start = None, [], 0
    for n in pieces:
        part = slice(start, start + n)
        out, state = local_attention(q[:, :, part], k[:, :, part], v[:, :, part], window=W, look_backward=back,
                                     rerope=w, initial_state=state, output_final_state=True)
        outs.append(out)
        start += n
    expected = loop_attention(q, k, v, w, window=W * back)
    assert_same_with_grads(torch.cat(outs, 2), expected, (q, k, v), "qkv")
    # the state keeps the last W * back - 1 keys and values, unrotated, and counts every position
    assert state.steps == final.steps == 13
    torch.testing.assert_close(state.keys, k[:, :, -(W * back - 1):].detach(), rtol=0, atol=0)
    torch.testing.assert_close(state.values, final.values)


def test_local_rerope_refuses_a_non_causal_window():
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=5, Dk=4, Dv=2)
    with pytest.raises(ValueError, match="needs causal=True"):
        local_attention(q, k, v, window=2, causal=False, look_forward=1, rerope=2)


# ----------------------------------------------------------------------------- vq_attention


def make_vq(B=2, H=4, Hkv=2, T=11, Dk=4, Dv=3, S=6, seed=0):
    """q, v and a codebook (all requiring grad), codes, and k_hat = codebook[codes] (differentiable)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dk, generator=g, dtype=F64).requires_grad_()
    codebook = torch.randn(Hkv, S, Dk, generator=g, dtype=F64).requires_grad_()
    codes = torch.randint(0, S, (B, Hkv, T), generator=g)
    v = torch.randn(B, Hkv, T, Dv, generator=g, dtype=F64).requires_grad_()
    return q, v, codes, codebook


def gather(codebook, codes):
    return codebook[torch.arange(codebook.shape[0])[None, :, None], codes]


VQ_CASES = [  # (T, L, w)
    (11, 4, 1),
    (11, 4, 4),  # w = L: the whole block window rotated by distance, the cache at L
    (11, 4, 3),
    (13, 5, 2),
    (3, 4, 4),  # one partial block (the decode form)
]


@pytest.mark.parametrize("form", ["parallel", "loop", "batched", "loop-nograd", "batched-nograd"])
@pytest.mark.parametrize("T,L,w", VQ_CASES)
def test_vq_rerope_equals_the_written_loop(form, T, L, w):
    q, v, codes, codebook = make_vq(T=T, seed=T + L + w)
    mode, _, grad = form.partition("-")
    expected = loop_attention(q, gather(codebook, codes), v, w)
    with torch.set_grad_enabled(grad != "nograd"):
        out, _ = vq_attention(q, gather(codebook, codes), v, codes, codebook, block_size=L, rerope=w,
                              grad_scope="none", mode="parallel" if mode == "parallel" else "block",
                              schedule="auto" if mode == "parallel" else mode)
    if grad == "nograd":
        assert_close_rel(out, expected, rtol=1e-10, name="output")
    else:
        assert_same_with_grads(out, expected, (q, v, codebook), ("q", "v", "codebook"))


def test_vq_rerope_with_bias_and_position_keys_adds_their_terms():
    T, L, w, H, Dk = 10, 4, 3, 4, 4
    q, v, codes, codebook = make_vq(T=T, seed=5)
    g = torch.Generator().manual_seed(9)
    bias = torch.randn(H, L + 1, generator=g, dtype=F64)
    P = 0.5 * torch.randn(H, L + 1, Dk, generator=g, dtype=F64)
    k_hat = gather(codebook, codes)
    out, _ = vq_attention(q, k_hat, v, codes, codebook, block_size=L, rerope=w, bias=bias, position_keys=P,
                          grad_scope="none")

    def extra(b, h, t, d):  # b_{i-j} + scale q_i.P_{i-j} inside the window
        return bias[h, d] + Dk ** -0.5 * (q[b, h, t] * P[h, d]).sum()

    expected = loop_attention(q, k_hat, v, w, extra=extra, L=L)
    assert_same_with_grads(out, expected, (q, v, codebook), ("q", "v", "codebook"))


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("pieces", [(3, 1, 6, 1, 2), (1,) * 13, (9, 4)])
def test_vq_rerope_carries_its_state_across_uneven_pieces(grad, pieces):
    L, w, T = 4, 3, 13
    q, v, codes, codebook = make_vq(B=2, H=4, Hkv=2, T=T, seed=6)
    k_hat = gather(codebook, codes)
    with torch.set_grad_enabled(grad):
        full, final = vq_attention(q, k_hat, v, codes, codebook, block_size=L, rerope=w, grad_scope="none",
                                   output_final_state=True)
        plain, plain_final = vq_attention(q, k_hat, v, codes, codebook, block_size=L, grad_scope="none",
                                          output_final_state=True)
        state, outs, start = None, [], 0
        for n in pieces:
            part = slice(start, start + n)
            out, state = vq_attention(q[:, :, part], k_hat[:, :, part], v[:, :, part], codes[:, :, part], codebook,
                                      block_size=L, rerope=w, grad_scope="none", initial_state=state,
                                      output_final_state=True)
            outs.append(out)
            start += n
    pieced = torch.cat(outs, 2)
    expected = loop_attention(q, k_hat, v, w)
    if grad:
        assert_same_with_grads(pieced, expected, (q, v, codebook), ("q", "v", "codebook"))
    else:
        assert_close_rel(pieced, expected, rtol=1e-10, name="output")
    assert_close_rel(full, expected, rtol=1e-10, name="one call")
    assert (full - plain).abs().max() > 1e-3  # ReRoPE changes the scores
    # the state holds unrotated keys: the same state as without ReRoPE, and the same from pieces
    for name in ("partial_keys", "partial_values", "partial_codes", "prev_keys", "prev_values", "prev_codes",
                 "cache_counts", "cache_means"):
        for got in (state, final):
            assert_close_rel(getattr(got, name).double(), getattr(plain_final, name).double(), rtol=1e-12, name=name)
    assert state.steps == final.steps == T


def test_vq_rerope_decoding_one_token_at_a_time_equals_the_full_pass():
    L, w, T = 4, 2, 14
    q, v, codes, codebook = make_vq(B=2, H=2, Hkv=1, T=T, seed=8)
    k_hat = gather(codebook, codes)
    expected = loop_attention(q, k_hat, v, w)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            state, outs = None, []
            for t in range(T):
                out, state = vq_attention(q[:, :, t:t + 1], k_hat[:, :, t:t + 1], v[:, :, t:t + 1],
                                          codes[:, :, t:t + 1], codebook, block_size=L, rerope=w,
                                          initial_state=state, output_final_state=True)
                outs.append(out)
        assert_close_rel(torch.cat(outs, 2), expected, rtol=1e-10, name=f"gradients {'on' if grad else 'off'}")


@pytest.mark.parametrize("impl", ["torch", "native"])
@pytest.mark.parametrize("L,w,prompt", [(4, 3, 0), (4, 4, 5), (4, 1, 2), (5, 2, 0)])
def test_vq_decode_step_with_rerope_equals_the_written_out_attention(impl, L, w, prompt):
    """Both forms of the step (the native one turns each query by the distances below w, the
    torch one merges two products): the nearest codes and the loop's outputs, after a prompt
    read by vq_attention or from nothing, across block boundaries, GQA 2:1, batch 2."""
    T, Hkv, S, Dk = 12, 2, 6, 4
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, T, Dk, generator=g, dtype=F64)
    k = torch.randn(2, Hkv, T, Dk, generator=g, dtype=F64)
    v = torch.randn(2, Hkv, T, 3, generator=g, dtype=F64)
    codebook = torch.randn(Hkv, S, Dk, generator=g, dtype=F64)
    codes = ((k.unsqueeze(3) - codebook[None, :, None]) ** 2).sum(-1).argmin(-1)  # the nearest code, written out
    expected = loop_attention(q, gather(codebook, codes), v, w)
    with torch.no_grad():
        state, outs = None, []
        if prompt:
            _, state = vq_attention(q[:, :, :prompt], gather(codebook, codes[:, :, :prompt]), v[:, :, :prompt],
                                    codes[:, :, :prompt], codebook, block_size=L, rerope=w, output_final_state=True)
        for t in range(prompt, T):
            out, step_codes, state = vq_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], codebook,
                                                    state, block_size=L, rerope=w, impl=impl)
            assert torch.equal(step_codes, codes[:, :, t:t + 1])
            outs.append(out)
    assert_close_rel(torch.cat(outs, 2), expected[:, :, prompt:], rtol=1e-10, name=f"decode steps ({impl})")


def test_the_native_vq_step_with_rerope_reads_stored_keys_that_are_not_codes():
    """A state whose keys are not the codebook's rows (the codebook changed since): the native
    step scores the stored keys, near ones by their turned queries, as the torch form does."""
    L, w, T, Hkv, S, Dk = 4, 3, 9, 1, 5, 4
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, T, Dk, generator=g, dtype=F64), torch.randn(1, Hkv, T, Dk, generator=g, dtype=F64)
    v = torch.randn(1, Hkv, T, 3, generator=g, dtype=F64)
    old, new = torch.randn(2, Hkv, S, Dk, generator=g, dtype=F64)
    outs = {}
    with torch.no_grad():
        for impl in ("torch", "native"):
            state, steps = None, []
            for t in range(T):
                codebook = old if t < 5 else new
                out, _, state = vq_decode_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], codebook, state,
                                               block_size=L, rerope=w, impl=impl)
                steps.append(out)
            outs[impl] = torch.cat(steps, 2)
    assert_close_rel(outs["native"], outs["torch"], rtol=1e-12, name="native vs torch")


def test_vq_rerope_is_causal():
    q, v, codes, codebook = make_vq(B=1, H=2, Hkv=1, T=9, seed=1)
    k_hat = gather(codebook, codes).detach()
    assert_causal_jacobian(lambda q, v: vq_attention(q, k_hat, v, codes, codebook.detach(), block_size=3, rerope=2,
                                                     grad_scope="none")[0], (q.detach(), v.detach()), "qv")


def test_vq_attention_weights_with_rerope_are_the_written_probabilities():
    q, v, codes, codebook = make_vq(B=1, H=2, Hkv=1, T=7, seed=2)
    k_hat = gather(codebook, codes).detach()
    identity = torch.eye(7, dtype=F64)[None, None]  # values = one-hot positions: the output is the weights
    weights = vq_attention_weights(q.detach(), k_hat, block_size=3, rerope=2)
    assert_close_rel(weights, loop_attention(q.detach(), k_hat, identity, 2), rtol=1e-10, name="weights")


@pytest.mark.parametrize("call,message", [
    ("attention", "rerope=5 is larger than block_size=4"),
    ("step", "rerope=5 is larger than block_size=4"),
    ("weights", "rerope=5 is larger than block_size=4"),
    ("unchecked", "rerope=5 is larger than block_size=4"),  # check_inputs=False still refuses it
    ("triton", "impl='triton': the fused VQ kernels have no ReRoPE form"),
    ("encoder", "not defined for causal=False"),
])
def test_vq_rerope_refusals(call, message):
    q, v, codes, codebook = make_vq(B=1, H=2, Hkv=1, T=6, seed=0)
    q, v, codebook = q.detach(), v.detach(), codebook.detach()
    k_hat = gather(codebook, codes)
    with pytest.raises(ValueError, match=message):
        if call == "attention":
            vq_attention(q, k_hat, v, codes, codebook, block_size=4, rerope=5)
        elif call == "step":
            with torch.no_grad():
                vq_decode_step(q[:, :, :1], k_hat[:, :, :1], v[:, :, :1], codebook, block_size=4, rerope=5)
        elif call == "weights":
            vq_attention_weights(q, k_hat, block_size=4, rerope=5)
        elif call == "unchecked":
            vq_attention(q, k_hat, v, codes, codebook, block_size=4, rerope=5, check_inputs=False)
        elif call == "triton":
            vq_attention(q, k_hat, v, codes, codebook, block_size=4, rerope=2, impl="triton")
        else:
            vq_attention(q, k_hat, v, codes, codebook, block_size=4, rerope=2, causal=False)


# ----------------------------------------------------------------------------- layers and specs


def test_attention_layer_passes_unrotated_projections_to_the_op():
    """``Attention(rerope=w)`` computes ``W_o loop(W_q x, W_k x, W_v x)``: ReRoPE on the
    unrotated projections (no rotary applied before the op as well)."""
    torch.manual_seed(0)
    for mechanism, window in (("softmax", None), ("local", 4)):
        layer = Attention(16, 4, n_kv_heads=2, mechanism=mechanism, window=window or 256, rerope=3).double()
        x = torch.randn(2, 9, 16, dtype=F64)
        y, _, _ = layer(x)
        q = layer.q_proj(x).view(2, 9, 4, 4).transpose(1, 2)
        k = layer.k_proj(x).view(2, 9, 2, 4).transpose(1, 2)
        v = layer.v_proj(x).view(2, 9, 2, 4).transpose(1, 2)
        out = loop_attention(q, k, v, 3, window=window)
        assert_close_rel(y, layer.o_proj(out.transpose(1, 2).reshape(2, 9, 16)), rtol=1e-10, name=mechanism)


def test_gau_with_rerope_replaces_the_transformer_xl_terms():
    torch.manual_seed(0)
    unit = GAU(16, d_k=8, d_v=12, codebook_size=6, block_size=4, rerope=3).double().eval()
    names = {name for name, _ in unit.named_parameters()}
    assert not names & {"w_r.weight", "content_bias", "position_bias"}
    x = torch.randn(2, 11, 16, dtype=F64)
    with torch.no_grad():
        y, _, aux = unit(x)
        h = unit.norm(x)
        q = F.rms_norm(unit.w_q(h), (8,), eps=1e-6) * 8 ** -0.25
        k = F.rms_norm(unit.w_k(h), (8,), eps=1e-6) * 8 ** -0.25
        codebook = unit.quantizer.codebook[0]
        codes = ((k.unsqueeze(2) - codebook) ** 2).sum(-1).argmin(-1)
        assert torch.equal(aux["codes"].reshape(2, 11), codes)
        out = loop_attention(q[:, None], codebook[codes][:, None], F.silu(unit.w_v(h))[:, None], 3, scale=1.0)
        expected = unit.w_o(out[:, 0] * F.silu(unit.w_g(h)))
    assert_close_rel(y, expected, rtol=1e-10, name="GAU output")


@pytest.mark.parametrize("kwargs,message", [
    (dict(rerope=5), "rerope=5 is larger than block_size=4"),
    (dict(rerope=2, attention="soft-vq"), "rerope is for the VQ units"),
    (dict(rerope=2, sinusoid_dropout=0.1), "a rerope unit has no sinusoids"),
])
def test_gau_rerope_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GAU(16, d_k=8, codebook_size=6, block_size=4, **kwargs)


SPECS = ["softmax:rerope=3", "softmax:entropy:rerope=2", "local:4:rerope=2", "local:3:rerope=9", "vq:rerope",
         "vq:rerope=2", "vq-fsq:rerope=1"]


@pytest.mark.parametrize("spec", SPECS)
def test_rerope_specs_decode_token_by_token_as_the_full_pass(spec):
    torch.manual_seed(0)
    config = LMConfig(d_model=16, n_layers=2, attention=spec, block_size=4, codebook_size=8, gau_d_k=8,
                      fsq_levels=(3, 2), **head_fields(spec, n_heads=2, n_kv_heads=1))
    model = LM(config).double().eval()
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(1))
    assert_decodes_as_full_pass(model, ids, prefill=5)


def test_rerope_specs_build_rerope_layers():
    config = LMConfig(d_model=16, n_layers=3, n_heads=2, block_size=4, codebook_size=8, gau_d_k=8,
                      attention="softmax:rerope=3:entropy,local:4:rerope=2,vq:rerope")
    model = LM(config)
    softmax, local, vq = (layer for layer in model.layers)
    assert (softmax.mixer.rerope, softmax.mixer.scale, softmax.mixer.rotary) == (3, "entropy", False)
    assert (local.mixer.rerope, local.mixer.window) == (2, 4)
    assert [unit.rerope for unit in vq.units] == [4, 4]  # bare 'rerope': the block size
    plain = LM(LMConfig(d_model=16, n_layers=1, n_heads=2, attention="softmax"))
    assert plain.layers[0].mixer.rerope is None and plain.layers[0].mixer.rotary


@pytest.mark.parametrize("good,bad", [
    ("softmax:rerope=1", "softmax:rerope=0"), ("softmax:rerope=2", "softmax:rerope=x"),
    ("softmax:entropy:rerope=3", "softmax:nope:rerope=3"), ("softmax:rerope=2", "softmax:rerope=2:rerope=3"),
    ("softmax:rerope=2", "softmax:rerope"), ("local:4:rerope=2", "local:4:rerope="), ("vq:rerope=1", "vq:rerope=0"),
    ("vq:rerope", "vq:rope"), ("vq-fsq:rerope", "gau-softmax:rerope=2"), ("local:rerope=2", "linear:elu:rerope=2"),
])
def test_rerope_specs_and_their_near_misses(good, bad):
    LMConfig(d_model=16, n_layers=1, attention=good, block_size=8, **head_fields(good, n_heads=2))
    with pytest.raises(ValueError, match=f"unknown layer attention spec '{bad}'"):
        LMConfig(d_model=16, n_layers=1, attention=bad, block_size=8)


def test_vq_rerope_spec_checks_the_block_and_the_sinusoids():
    with pytest.raises(ValueError, match=r"ReRoPE window of 9 > block_size=8"):
        LMConfig(d_model=16, n_layers=1, attention="vq:rerope=9", block_size=8)
    with pytest.raises(ValueError, match="sinusoid_dropout=0.2 has nothing to drop"):
        LMConfig(d_model=16, n_layers=1, attention="vq:rerope", block_size=8, sinusoid_dropout=0.2)
    paper = LM(LMConfig(d_model=16, n_layers=1, attention="vq:rerope", block_size=8, gau_d_k=8,
                        gau_variant="paper"))  # the variant's sinusoid dropout has no sinusoids to act on
    assert paper.layers[0].units[0].rerope == 8


@pytest.mark.parametrize("spec", ["softmax:rerope=2", "local:4:rerope=2"])
def test_inspector_weights_of_a_rerope_layer_are_rerope_probabilities(spec):
    torch.manual_seed(0)
    model = LM(LMConfig(d_model=16, n_layers=1, n_heads=2, attention=spec)).double().eval()
    ids = torch.randint(0, 256, (1, 8))
    recorder = _Recorder(model)
    try:
        with torch.no_grad(), recorder.patched():
            model(ids)
    finally:
        recorder.close()
    (name,) = recorder.weights
    layer = model.layers[0]
    x = layer.mixer_norm(model.embed(ids))
    q = layer.mixer.q_proj(x).view(1, 8, 2, 8).transpose(1, 2)
    k = layer.mixer.k_proj(x).view(1, 8, 2, 8).transpose(1, 2)
    window = layer.mixer.window if spec.startswith("local") else None
    expected = loop_attention(q, k, torch.eye(8, dtype=F64)[None, None].expand(1, 2, 8, 8), 2, window=window)
    assert_close_rel(recorder.weights[name][0], expected[0], rtol=1e-10, name="recorded weights")
