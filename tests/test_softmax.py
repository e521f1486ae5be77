"""Exact softmax attention (``linattn.softmax_attention``): the three implementations
agree with each other and with the formula, their gradients agree, causality holds
exactly, the tiled form never materialises a T x S tensor, and half precision is safe.

    out_i = sum_j softmax_j(s_i q_i.k_j + b_ij [-inf for j > i when causal]) v_j
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch

from _helpers import F64, OpRecorder, assert_causal_jacobian, assert_close_rel, make_qkv
from linattn import softmax_attention

IMPLS = ("reference", "sdpa", "tiled", "auto")


# ----------------------------------------------------------------------------- helpers


def make_bias(kind, B, H, T, S, *, seed=1, requires_grad=False):
    """A bias of the given kind for scores ``[B, H, T, S]``.

    ``tensor``: additive ``[H, T, S]``; ``bool``: keep-mask ``[B, 1, T, S]`` that always
    keeps key 0 and the diagonal (no row fully masked); ``callable``: per-head slopes
    times the offset ``i - j`` (returns ``[H, n]``).
    """
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "tensor":
        return torch.randn(H, T, S, generator=g, dtype=F64).requires_grad_(requires_grad)
    if kind == "bool":
        keep = torch.rand(B, 1, T, S, generator=g) > 0.4
        keep[..., 0] = True
        diag = torch.arange(min(T, S))
        keep[..., diag, diag] = True
        return keep
    if kind == "callable":
        slopes = (0.3 * torch.randn(H, generator=g, dtype=F64)).requires_grad_(requires_grad)
        return relative_bias(slopes)
    raise AssertionError(kind)


def relative_bias(slopes):
    """Relative bias ``slopes[h] * (i - j)``, the callable form of a bias."""

    def bias(offsets):
        return slopes[:, None] * offsets.to(slopes.dtype)[None, :]

    bias.slopes = slopes
    return bias


def offset_bias(amplitude):
    """A callable bias that is not linear in the offset o = i - j (a linear one only shifts each
    row, which softmax ignores): ``a cos(0.9 o) + 0.05 o^2``; ``[H, n]`` for a ``[H]`` amplitude,
    ``[n]`` (shared by the heads) for a scalar one."""

    def bias(offsets):
        o = offsets.to(amplitude.dtype)
        a = amplitude[:, None] if amplitude.dim() else amplitude
        return a * torch.cos(0.9 * o) + 0.05 * o**2

    return bias


def loop_reference(q, k, v, *, causal, scale, bias):
    """The formula, one query position at a time: softmax over the keys query i sees."""
    B, H, T, Dk = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    heads = torch.arange(H) // (H // Hkv)  # kv head read by each query head
    keys, values = k[:, heads], v[:, heads]  # [B, H, S, D]
    out = torch.empty(B, H, T, v.shape[-1], dtype=q.dtype)
    for i in range(T):
        n = i + 1 if causal else S
        if scale is None:
            s = 1.0 / math.sqrt(Dk)
        elif scale == "entropy":
            s = math.log(n) / math.log(512) / math.sqrt(Dk)
        else:
            s = scale
        logits = s * torch.einsum("bhd,bhnd->bhn", q[:, :, i], keys[:, :, :n])
        if callable(bias) and not isinstance(bias, torch.Tensor):
            logits = logits + bias(torch.tensor([i - j for j in range(n)]))
        elif bias is not None:
            b = bias.expand(B, H, T, S)[:, :, i, :n]
            logits = logits + (torch.where(b, 0.0, -math.inf) if b.dtype == torch.bool else b)
        weights = torch.softmax(logits, dim=-1)
        out[:, :, i] = torch.einsum("bhn,bhnd->bhd", weights, values[:, :, :n])
    return out


def block_for(T):
    """A block size that does not divide T (except for T = 1)."""
    return {1: 4, 7: 3, 64: 24, 129: 32, 1000: 96}[T]


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("scale", [None, 0.37, "entropy"], ids=["scale-default", "scale-number", "scale-entropy"])
@pytest.mark.parametrize("bias_kind", ["none", "tensor", "bool", "callable"])
@pytest.mark.parametrize("layout", ["causal", "self", "cross"])
@pytest.mark.parametrize("T", [1, 7, 64, 129])
def test_impls_match_formula(T, layout, bias_kind, scale):
    """reference == sdpa == tiled == auto == the per-query loop, GQA (H=4, Hkv=2), B=2.

    ``cross``: non-causal with key length S = T + 2 != T.
    """
    causal = layout == "causal"
    S = T + 2 if layout == "cross" else T
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=T, S=S, Dk=4, Dv=3, seed=T)
    bias = make_bias(bias_kind, 2, 4, T, S)
    expected = loop_reference(q, k, v, causal=causal, scale=scale, bias=bias)
    for impl in IMPLS:
        out = softmax_attention(q, k, v, causal=causal, scale=scale, bias=bias, impl=impl, block_size=block_for(T))
        assert out.dtype == F64
        assert_close_rel(out, expected, rtol=1e-10, name=impl)


@pytest.mark.parametrize(
    "causal, bias_kind, scale",
    [(True, "callable", "entropy"), (False, "tensor", None), (True, "bool", 0.2)],
)
def test_impls_agree_long(causal, bias_kind, scale):
    """T = 1000 (block 96 does not divide it): sdpa and tiled equal the reference."""
    T = 1000
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=T, Dk=8, Dv=4, seed=3)
    bias = make_bias(bias_kind, 1, 2, T, T)
    kwargs = dict(causal=causal, scale=scale, bias=bias, block_size=block_for(T))
    expected = softmax_attention(q, k, v, impl="reference", **kwargs)
    for impl in ("sdpa", "tiled"):
        assert_close_rel(softmax_attention(q, k, v, impl=impl, **kwargs), expected, rtol=1e-10, name=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_inputs(impl):
    """Inputs that are [B, T, H, D] tensors viewed as [B, H, T, D] (non-contiguous)."""
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=9, Dk=4, Dv=3)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not strided[0].is_contiguous()
    out = softmax_attention(*strided, causal=True, bias=make_bias("callable", 2, 4, 9, 9), impl=impl, block_size=4)
    expected = loop_reference(q, k, v, causal=True, scale=None, bias=make_bias("callable", 2, 4, 9, 9))
    assert_close_rel(out, expected, rtol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("Hkv", [1, 2])
def test_gqa_equals_repeated_heads(impl, Hkv):
    """Query head h reads key/value head h // (H / Hkv) (repeat_interleave, not repeat)."""
    q, k, v = make_qkv(B=2, H=4, Hkv=Hkv, T=9, Dk=4, Dv=3)
    group = 4 // Hkv
    out = softmax_attention(q, k, v, causal=True, impl=impl, block_size=4)
    full = softmax_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), causal=True, impl="reference"
    )
    assert_close_rel(out, full, rtol=1e-12, name=impl)


def test_default_is_not_causal():
    """Without ``causal`` every query sees every key (the documented default ``causal=False``)."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=6, Dk=4, Dv=3, seed=13)
    expected = loop_reference(q, k, v, causal=False, scale=None, bias=None)
    for impl in IMPLS:
        assert_close_rel(softmax_attention(q, k, v, impl=impl, block_size=4), expected, rtol=1e-12, name=impl)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-by-heads", "per-head"])
@pytest.mark.parametrize("layout", ["causal", "cross"])
def test_callable_bias_of_the_offset_equals_the_formula_with_its_gradient(layout, shared):
    """A callable bias that is not linear in i - j, shared by the heads (``[n]``) or per head
    (``[H, n]``): the output and the gradient of its parameter equal the per-query loop's, in every
    impl (the table holds exactly the offsets -(S - 1)..T - 1; a shared one gets the summed gradient)."""
    causal = layout == "causal"
    T, S = 7, (7 if causal else 10)
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=T, S=S, Dk=4, Dv=3, seed=14)
    amplitude = torch.tensor(0.8 if shared else [0.8, -0.5, 1.2, 0.3], dtype=F64, requires_grad=True)
    grad_out = torch.randn(2, 4, T, 3, generator=torch.Generator().manual_seed(15), dtype=F64)
    expected = loop_reference(q, k, v, causal=causal, scale=None, bias=offset_bias(amplitude))
    (want,) = torch.autograd.grad(expected, amplitude, grad_out)
    for impl in IMPLS:
        out = softmax_attention(q, k, v, causal=causal, bias=offset_bias(amplitude), impl=impl, block_size=3)
        assert_close_rel(out, expected, rtol=1e-12, name=impl)
        (grad,) = torch.autograd.grad(out, amplitude, grad_out)
        assert_close_rel(grad, want, rtol=1e-10, name=f"{impl} gradient")


# ----------------------------------------------------------------------------- gradients


def _tiled_fn(causal, scale, bias_kind):
    """A function of (q, k, v[, bias or slopes]) running impl='tiled' with block 2."""

    def fn(q, k, v, *extra):
        bias = None
        if bias_kind == "tensor":
            bias = extra[0]
        elif bias_kind == "callable":
            bias = relative_bias(extra[0])
        return softmax_attention(q, k, v, causal=causal, scale=scale, bias=bias, impl="tiled", block_size=2)

    return fn


@pytest.mark.parametrize("bias_kind, scale", [("none", None), ("tensor", "entropy"), ("callable", 0.7)])
@pytest.mark.parametrize("causal", [True, False])
def test_tiled_gradcheck(causal, bias_kind, scale):
    """Finite differences agree with the tiled backward w.r.t. q, k, v and the bias
    (a tensor bias, or the slopes inside a callable bias)."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=5, Dk=3, Dv=2, seed=7, requires_grad=True)
    inputs = [q, k, v]
    bias = make_bias(bias_kind, 1, 2, 5, 5, requires_grad=True)
    if bias_kind == "tensor":
        inputs.append(bias)
    elif bias_kind == "callable":
        inputs.append(bias.slopes)
    fn = _tiled_fn(causal, scale, bias_kind)
    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("bias_shape", [(1, 4, 1, 64), (64, 64), (2, 1, 1, 64), (4, 1, 64), (2, 4, 64, 1)])
def test_tiled_gradient_of_broadcast_bias(bias_shape):
    """A bias broadcast over some of [B, H, T, S] gets the summed gradient (zero for a
    bias constant over keys, which softmax ignores)."""
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=64, Dk=4, Dv=3, requires_grad=True)
    grad_out = torch.randn(2, 4, 64, 3, generator=torch.Generator().manual_seed(6), dtype=F64)
    grads = {}
    for impl in ("reference", "tiled"):
        bias = torch.randn(bias_shape, generator=torch.Generator().manual_seed(5), dtype=F64, requires_grad=True)
        out = softmax_attention(q, k, v, causal=True, bias=bias, impl=impl, block_size=24)
        grads[impl] = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    for g_tiled, g_ref in zip(grads["tiled"], grads["reference"]):
        torch.testing.assert_close(g_tiled, g_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bias_kind", ["none", "tensor", "callable"])
@pytest.mark.parametrize("layout", ["causal", "cross"])
def test_gradients_match_reference(layout, bias_kind):
    """Medium case (T=129, block 32, GQA, B=2, entropy scale): tiled and sdpa gradients
    w.r.t. q, k, v and the bias (tensor, or slopes of a callable) == reference gradients."""
    causal = layout == "causal"
    T, S = 129, (129 if causal else 131)
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=T, S=S, Dk=8, Dv=5, requires_grad=True)
    grad_out = torch.randn(2, 4, T, 5, generator=torch.Generator().manual_seed(11), dtype=F64)
    grads = {}
    for impl in ("reference", "tiled", "sdpa"):
        bias = make_bias(bias_kind, 2, 4, T, S, requires_grad=True)
        wrt = [q, k, v] + ([bias] if bias_kind == "tensor" else [bias.slopes] if bias_kind == "callable" else [])
        out = softmax_attention(q, k, v, causal=causal, scale="entropy", bias=bias, impl=impl, block_size=32)
        grads[impl] = torch.autograd.grad(out, wrt, grad_out)
    for impl in ("tiled", "sdpa"):
        for i, (g_impl, g_ref) in enumerate(zip(grads[impl], grads["reference"])):
            assert_close_rel(g_impl, g_ref, rtol=1e-10, name=f"{impl} grad of input {i}")


@pytest.mark.parametrize("impl", ["reference", "tiled", "sdpa"])
def test_causal_jacobian_is_lower_triangular(impl):
    """d out_i / d (q_j, k_j, v_j) is exactly zero for j > i (with a relative bias)."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=6, Dk=3, Dv=2, seed=2)
    bias = make_bias("callable", 1, 2, 6, 6)

    def fn(q, k, v):
        return softmax_attention(q, k, v, causal=True, bias=bias, impl=impl, block_size=4)

    assert_causal_jacobian(fn, (q, k, v), ("q", "k", "v"))


# ----------------------------------------------------------------------------- memory


def _record(impl, causal, T, block_size, backward):
    q, k, v = make_qkv(B=1, H=1, Hkv=1, T=T, Dk=16, Dv=16, dtype=torch.float32, requires_grad=backward)
    grad_out = torch.randn(1, 1, T, 16, generator=torch.Generator().manual_seed(0))
    with OpRecorder() as rec:
        out = softmax_attention(q, k, v, causal=causal, impl=impl, block_size=block_size)
        if backward:
            out.backward(grad_out)
    return rec


@pytest.mark.parametrize("causal", [True, False])
def test_tiled_never_builds_t_by_s(causal):
    """Forward and backward of impl='tiled' at T=2048, block 256: no op output reaches
    T*T/16 elements (tiles are 256 x 256 = T*T/64; chunking queries alone would give
    256 x T = T*T/8); the reference, for contrast, does build T*T."""
    T = 2048
    tiled = _record("tiled", causal, T, 256, backward=True)
    assert tiled.max_numel < T * T / 16, f"tiled built a tensor of {tiled.max_numel} elements"
    reference = _record("reference", causal, T, 256, backward=False)
    assert reference.max_numel >= T * T


def test_tiled_causal_skips_blocks_above_diagonal():
    """Causal tiled runs matmuls only on the nb(nb+1)/2 blocks on or below the diagonal."""
    T, block = 512, 64
    nb = T // block

    def matmuls(rec):
        return sum(n for name, n in rec.calls.items() if name in ("mm", "bmm", "matmul", "addmm", "baddbmm"))

    full = matmuls(_record("tiled", False, T, block, backward=False))
    causal = matmuls(_record("tiled", True, T, block, backward=False))
    assert full >= nb * nb  # at least one matmul per block: the count sees them
    assert causal <= full * (nb + 1) / (2 * nb) + 2 * nb, (causal, full)


def test_auto_with_a_callable_bias_is_tiled_and_never_builds_t_by_s():
    """``impl="auto"`` with a callable bias runs the tiled form: no op output reaches T*T/8 elements
    (64 x 64 tiles are T*T/64), where sdpa, for contrast, materialises the [T, T] bias."""
    T = 512
    q, k, v = make_qkv(B=1, H=1, Hkv=1, T=T, Dk=8, Dv=8, dtype=torch.float32, seed=16)
    bias = offset_bias(torch.tensor(0.5))
    for impl, small in (("auto", True), ("sdpa", False)):
        with OpRecorder() as rec:
            softmax_attention(q, k, v, causal=True, bias=bias, impl=impl, block_size=64)
        assert (rec.max_numel < T * T / 8) == small, (impl, rec.max_numel)


# ----------------------------------------------------------------------------- second derivatives


def _second_derivative_matches_finite_differences(loss, inputs, seed=0):
    """``u^T H d`` of ``loss(*inputs)`` by double backward, against the central difference of
    the gradient along ``d`` (u, d random directions); float64, relative 1e-6."""
    g = torch.Generator().manual_seed(seed)
    u = [torch.randn(x.shape, generator=g, dtype=F64) for x in inputs]
    d = [torch.randn(x.shape, generator=g, dtype=F64) for x in inputs]

    def gradient_along_u(step):
        xs = [(x.detach() + step * dx).requires_grad_() for x, dx in zip(inputs, d)]
        grads = torch.autograd.grad(loss(*xs), xs, create_graph=step == 0)
        return xs, sum((gr * ui).sum() for gr, ui in zip(grads, u))

    xs, gu = gradient_along_u(0.0)
    exact = sum((h * dx).sum() for h, dx in zip(torch.autograd.grad(gu, xs), d)).item()
    eps = 1e-4
    numeric = (gradient_along_u(eps)[1] - gradient_along_u(-eps)[1]).item() / (2 * eps)
    assert abs(exact - numeric) <= 1e-6 * abs(numeric), (exact, numeric)


@pytest.mark.parametrize("bias_kind", ["none", "tensor"])
def test_auto_without_a_callable_bias_has_second_derivatives(bias_kind):
    """``impl="auto"`` runs torch's SDPA unless the bias is a callable: its second derivatives
    w.r.t. q, k, v (and a tensor bias) match finite differences; the tiled form refuses them."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=5, Dk=3, Dv=2, seed=17)
    bias = make_bias(bias_kind, 1, 2, 5, 5)
    inputs = (q, k, v) + ((bias,) if bias is not None else ())
    weights = torch.randn(1, 2, 5, 2, generator=torch.Generator().manual_seed(18), dtype=F64)

    def loss(q, k, v, *bias):
        out = softmax_attention(q, k, v, causal=True, bias=bias[0] if bias else None)
        return (out * weights).sum()

    _second_derivative_matches_finite_differences(loss, inputs)


@pytest.mark.parametrize("impl, bias", [("tiled", None), ("auto", offset_bias(torch.tensor(0.5, dtype=F64)))],
                         ids=["tiled", "auto-callable-bias"])
@pytest.mark.parametrize("loss", ["linear", "square"])
def test_tiled_refuses_second_derivatives(impl, bias, loss):
    """The tiled backward recomputes each block from the saved log-sum-exp, which it reads as a
    constant: a backward with ``create_graph=True`` through it is an error, not silently wrong (or
    missing) second derivatives, whether or not the incoming gradient itself requires grad."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=4, Dk=3, Dv=2, seed=17, requires_grad=True)
    out = softmax_attention(q, k, v, causal=True, bias=bias, impl=impl, block_size=2)
    total = out.sum() if loss == "linear" else out.square().sum()
    with pytest.raises(RuntimeError, match=re.escape("softmax_attention(impl='tiled') has no second derivatives")):
        torch.autograd.grad(total, (q, k, v), create_graph=True)
    assert all(g.shape == t.shape for g, t in zip(torch.autograd.grad(total, (q, k, v)), (q, k, v)))


# ----------------------------------------------------------------------------- half precision


@functools.lru_cache(maxsize=None)
def _large_half_inputs(dtype):
    """T=4096 inputs with q, k scaled by 30 (scores in the thousands), in ``dtype``, and the
    float64 result on the same (rounded) values."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=4096, Dk=16, Dv=16, dtype=F64, seed=4)
    q, k, v = (q * 30).to(dtype), (k * 30).to(dtype), v.to(dtype)
    expected = softmax_attention(q.to(F64), k.to(F64), v.to(F64), causal=True, impl="tiled", block_size=512)
    return q, k, v, expected


@pytest.mark.parametrize("impl", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_large_scores(dtype, impl):
    """fp16/bf16 inputs with huge scores: finite output in the input dtype, equal to the
    float64 computation up to the output rounding."""
    q, k, v, expected = _large_half_inputs(dtype)
    out = softmax_attention(q, k, v, causal=True, impl=impl, block_size=256)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    tol = 1e-2 if dtype == torch.float16 else 4e-2
    assert (out.to(F64) - expected).abs().max().item() <= tol * v.abs().max().item()


# ----------------------------------------------------------------------------- rows that see no key


def _dead_row_cases():
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[0, :, 3] = False  # batch 0: row 3 sees nothing
    keep[1, :, 0] = False  # batch 1: row 0 sees nothing
    return keep


@pytest.mark.parametrize("impl", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("causal", [False, True])
def test_rows_that_see_no_key_give_zero_output_and_zero_gradient(impl, causal):
    """One answer in every impl: a fully masked row is 0 and passes no gradient; the other
    rows are the softmax over the keys they keep, written out here."""
    q, k, v = make_qkv(B=2, H=2, Hkv=1, T=6, Dk=4, Dv=3, seed=11)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    keep = _dead_row_cases()
    out = softmax_attention(q, k, v, causal=causal, bias=keep, impl=impl, block_size=4)
    visible = keep & (torch.ones(6, 6, dtype=torch.bool).tril() if causal else True)
    expected = torch.zeros_like(out)
    for b in range(2):
        for h in range(2):
            for i in range(6):
                cols = visible[b, 0, i].nonzero().flatten()
                if cols.numel():
                    weights = torch.softmax(q[b, h, i] @ k[b, 0, cols].T / 2.0, -1)
                    expected[b, h, i] = weights @ v[b, 0, cols]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)
    assert grads[0][0, :, 3].abs().max() == 0 and grads[0][1, :, 0].abs().max() == 0


def test_callable_bias_that_hides_a_row_gives_zero_in_both_impls():
    q, k, v = make_qkv(B=1, H=1, Hkv=1, T=5, Dk=4, Dv=4, seed=12)

    def hide_offset_zero_row(offsets):  # -inf everywhere: every row sees nothing
        return torch.full(offsets.shape, float("-inf"), dtype=F64)

    for impl in ("reference", "tiled"):
        out = softmax_attention(q, k, v, bias=hide_offset_zero_row, impl=impl)
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("shape", ["3d", "n+1", "heads+1", "int"])
def test_bias_callable_of_the_wrong_shape_is_a_clear_error(shape):
    """A callable bias must return ``[n]`` or ``[H, n]`` floats for n offsets; anything else is
    refused by name (here through the tiled impl, which reads the table block by block)."""
    q, k, v = make_qkv(B=1, H=2, Hkv=2, T=4, Dk=4, Dv=3)

    def bias(offsets):
        n = offsets.numel()
        return {"3d": torch.zeros(1, 2, n, dtype=F64), "n+1": torch.zeros(n + 1, dtype=F64),
                "heads+1": torch.zeros(3, n, dtype=F64), "int": torch.zeros(n, dtype=torch.long)}[shape]

    error = TypeError if shape == "int" else ValueError
    with pytest.raises(error, match="bias callable"):
        softmax_attention(q, k, v, causal=True, bias=bias, impl="tiled")


@pytest.mark.parametrize("lead", [(), (2,), (2, 3, 1)], ids=["2d", "3d", "5d"])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared-row", "row-per-query"])
def test_offset_rows_equals_its_loop(lead, per_row):
    """``_bias.offset_rows``, the relative-bias layout shared by the softmax and VQ ops:
    ``M[..., a, c] = table[..., a or 0, o - low]`` with ``o = first_offset + a - c`` when
    ``low <= o <= high``, else 0, for tables of any rank, including blocks that read no
    offset of the table at all (all zeros, still ``[..., rows, columns]``)."""
    from linattn.ops.common.bias import offset_rows

    rows, columns, low, high = 3, 4, -1, 2
    table = torch.randn(*lead, rows if per_row else 1, high - low + 1, generator=torch.Generator().manual_seed(9),
                        dtype=F64)
    for first_offset in (-9, -4, -1, 0, 2, 5, 9):  # -9, 9: every offset outside low..high
        expected = torch.zeros(*lead, rows, columns, dtype=F64)
        for a in range(rows):
            for c in range(columns):
                o = first_offset + a - c
                if low <= o <= high:
                    expected[..., a, c] = table[..., a if per_row else 0, o - low]
        got = offset_rows(table, first_offset, rows, columns, low, high)
        assert got.shape == expected.shape, (first_offset, got.shape)
        assert torch.equal(got, expected), first_offset


@pytest.mark.parametrize("scale", [0, 0.0, -0.5, True, [0.5]], ids=["int-0", "float-0", "negative", "bool", "list"])
def test_scales_that_are_not_positive_numbers_are_refused_by_name(scale):
    """``scale`` is None, ``"entropy"`` or a finite positive int/float: zero, a negative number, a
    bool and anything else are refused with a ValueError that names it."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=3, Dk=4, Dv=3)
    message = f"scale must be a finite positive number, None (key_dim^-1/2) or 'entropy', got {scale!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        softmax_attention(q, k, v, scale=scale)


@pytest.mark.parametrize("impl", ["reference", "sdpa", "tiled"])
@pytest.mark.parametrize("shape", [(5, 7), (3, 5, 6), (3, 4, 5, 6), (2, 4, 1, 2)], ids=["S", "H", "B", "S-of-4d"])
def test_bias_that_does_not_broadcast_is_refused_by_name(shape, impl):
    """A tensor bias must broadcast to [B, H, T, S]: one size that is neither 1 nor the full size is a
    ValueError naming both shapes, in every impl (not torch's broadcast error, not a sliced bias)."""
    q, k, v = make_qkv(B=2, H=4, Hkv=2, T=5, S=6, Dk=4, Dv=3)
    message = f"bias must broadcast to [B, H, T, S] = [2, 4, 5, 6], got shape {list(shape)}"
    with pytest.raises(ValueError, match=re.escape(message)):
        softmax_attention(q, k, v, bias=torch.zeros(shape, dtype=F64), impl=impl)


@pytest.mark.parametrize("bias", [0.5, [[0.0]]], ids=["float", "list"])
def test_bias_that_is_neither_a_tensor_nor_a_callable_is_refused_by_name(bias):
    """A bias is a tensor, a callable of the offsets or None; anything else is a TypeError saying so
    (not an attempt to call it)."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=3, Dk=4, Dv=3)
    message = f"bias must be a tensor, a callable of (i - j), or None; got {type(bias).__name__}"
    with pytest.raises(TypeError, match=re.escape(message)):
        softmax_attention(q, k, v, bias=bias)
