"""Input validation of the public ops: every bad call raises ValueError/TypeError whose
message names the argument and what was seen (docs/design.md, section 2), never an opaque
einsum/matmul error. Each case runs against every implementation/mode."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import linattn
from _helpers import F64, make_qkv
from linattn import LinearAttentionState, linear_attention, softmax_attention

SOFTMAX_OPS = {
    f"softmax-{impl}": (lambda impl: lambda q, k, v, **kw: softmax_attention(q, k, v, impl=impl, **kw))(impl)
    for impl in ("reference", "sdpa", "tiled", "auto")
}
LINEAR_OPS = {
    f"linear-{mode}": (lambda mode: lambda q, k, v, **kw: linear_attention(q, k, v, mode=mode, **kw))(mode)
    for mode in ("parallel", "chunk", "recurrent", None)
}
ALL_OPS = {**SOFTMAX_OPS, **LINEAR_OPS}


def shape_re(*shape):
    """A regex matching a shape as the messages print it, e.g. ``[2, 4, 8]``."""
    return re.escape("[" + ", ".join(str(s) for s in shape) + "]")


def good():
    """Valid inputs: q [2, 4, 8, 4], k [2, 2, 8, 4], v [2, 2, 8, 5]."""
    return make_qkv(B=2, H=4, Hkv=2, T=8, Dk=4, Dv=5)


def _replace(which, tensor):
    q, k, v = good()
    return {"q": (tensor, k, v), "k": (q, tensor, v), "v": (q, k, tensor)}[which]


def _randn(*shape, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=dtype)


# (id, inputs, exception, regex): the regex names the argument and the shape/dtype seen.
QKV_CASES = [
    ("q-rank-3", lambda: _replace("q", _randn(2, 4, 8)), ValueError, r"\bq\b.*" + shape_re(2, 4, 8)),
    ("k-rank-5", lambda: _replace("k", _randn(2, 2, 8, 4, 1)), ValueError, r"\bk\b.*" + shape_re(2, 2, 8, 4, 1)),
    ("v-rank-2", lambda: _replace("v", _randn(8, 5)), ValueError, r"\bv\b.*" + shape_re(8, 5)),
    ("k-batch", lambda: _replace("k", _randn(3, 2, 8, 4)), ValueError, r"\bk\b.*" + shape_re(3, 2, 8, 4)),
    ("v-batch", lambda: _replace("v", _randn(1, 2, 8, 5)), ValueError, r"\bv\b.*" + shape_re(1, 2, 8, 5)),
    (
        "kv-length",  # causal: keys must cover the queries
        lambda: (good()[0], _randn(2, 2, 9, 4), _randn(2, 2, 9, 5)),
        ValueError,
        r"\bk\b.*" + shape_re(2, 2, 9, 4),
    ),
    ("v-length", lambda: _replace("v", _randn(2, 2, 7, 5)), ValueError, r"\bv\b.*" + shape_re(2, 2, 7, 5)),
    (
        "heads-not-divisible",
        lambda: (good()[0], _randn(2, 3, 8, 4), _randn(2, 3, 8, 5)),
        ValueError,
        r"\bk\b.*" + shape_re(2, 3, 8, 4),
    ),
    ("kv-heads-differ", lambda: _replace("v", _randn(2, 1, 8, 5)), ValueError, r"\bv\b.*" + shape_re(2, 1, 8, 5)),
    ("key-dim", lambda: _replace("k", _randn(2, 2, 8, 3)), ValueError, r"\bk\b.*" + shape_re(2, 2, 8, 3)),
    ("mixed-dtype", lambda: _replace("k", _randn(2, 2, 8, 4, dtype=torch.float32)), TypeError, r"\bk\b.*float32"),
    (
        "empty-length",
        lambda: (_randn(2, 4, 0, 4), _randn(2, 2, 0, 4), _randn(2, 2, 0, 5)),
        ValueError,
        r"\bq\b.*" + shape_re(2, 4, 0, 4),
    ),
    ("int-q", lambda: _replace("q", torch.ones(2, 4, 8, 4, dtype=torch.int64)), TypeError, r"\bq\b.*int64"),
    ("int-v", lambda: _replace("v", torch.ones(2, 2, 8, 5, dtype=torch.int32)), TypeError, r"\bv\b.*int32"),
    ("list-k", lambda: _replace("k", [[1.0]]), TypeError, r"\bk\b.*list"),
    (
        "mixed-device",
        lambda: _replace("v", torch.empty(2, 2, 8, 5, dtype=F64, device="meta")),
        ValueError,
        r"\bv\b.*meta",
    ),
]


@pytest.mark.parametrize("case_id, make, exc, pattern", QKV_CASES, ids=[c[0] for c in QKV_CASES])
@pytest.mark.parametrize("op", list(ALL_OPS))
def test_bad_qkv(op, case_id, make, exc, pattern):
    q, k, v = make()
    with pytest.raises(exc, match=pattern):
        ALL_OPS[op](q, k, v, causal=True)


@pytest.mark.parametrize("op", list(SOFTMAX_OPS))
def test_softmax_empty_key_length(op):
    """Non-causal softmax accepts S != T, but S == 0 keys leaves the softmax undefined."""
    q, _, _ = good()
    with pytest.raises(ValueError, match=r"\bk\b.*" + shape_re(2, 2, 0, 4)):
        SOFTMAX_OPS[op](q, _randn(2, 2, 0, 4), _randn(2, 2, 0, 5), causal=False)


# ----------------------------------------------------------------------------- softmax options

SOFTMAX_OPTION_CASES = [
    ("block-size-0", dict(block_size=0), ValueError, r"block_size.*\b0\b"),
    ("block-size-negative", dict(block_size=-4), ValueError, r"block_size.*-4"),
    ("block-size-float", dict(block_size=2.5), TypeError, r"block_size.*2\.5"),
    ("scale-name", dict(scale="log"), ValueError, r"scale.*'log'"),
    ("scale-negative", dict(scale=-1.0), ValueError, r"scale.*-1"),
    ("causal-str", dict(causal="yes"), TypeError, r"causal.*str"),
    ("bias-shape", dict(bias=torch.zeros(3, 8, 8, dtype=F64)), ValueError, r"bias.*" + shape_re(3, 8, 8)),
    ("bias-rank-5", dict(bias=torch.zeros(1, 2, 4, 8, 8, dtype=F64)), ValueError, r"bias.*" + shape_re(1, 2, 4, 8, 8)),
    ("bias-key-length", dict(bias=torch.zeros(8, 7, dtype=F64)), ValueError, r"bias.*" + shape_re(8, 7)),
    ("bias-int", dict(bias=torch.zeros(8, 8, dtype=torch.int64)), TypeError, r"bias.*int64"),
    ("bias-list", dict(bias=[0.0]), TypeError, r"bias.*list"),
    ("bias-device", dict(bias=torch.empty(8, 8, dtype=F64, device="meta")), ValueError, r"bias.*meta"),
    (
        "bias-callable-shape",
        dict(bias=lambda off: torch.zeros(3, off.numel(), dtype=F64)),
        ValueError,
        r"bias.*" + shape_re(3, 15),
    ),
    ("bias-callable-int", dict(bias=lambda off: off), TypeError, r"bias"),
]


@pytest.mark.parametrize(
    "case_id, kwargs, exc, pattern", SOFTMAX_OPTION_CASES, ids=[c[0] for c in SOFTMAX_OPTION_CASES]
)
@pytest.mark.parametrize("op", list(SOFTMAX_OPS))
def test_bad_softmax_options(op, case_id, kwargs, exc, pattern):
    q, k, v = good()
    kwargs = {"causal": False, **kwargs}
    with pytest.raises(exc, match=pattern):
        SOFTMAX_OPS[op](q, k, v, **kwargs)


# ----------------------------------------------------------------------------- linear options


def _state(kv_shape=(2, 2, 4, 5), z_shape=(2, 2, 4), shift_shape=None, z=True):
    return LinearAttentionState(
        kv=torch.zeros(kv_shape, dtype=F64),
        normalizer=torch.ones(z_shape, dtype=F64) if z else None,
        key_shift=None if shift_shape is None else torch.zeros(shift_shape, dtype=F64),
    )


LINEAR_OPTION_CASES = [
    ("feature-map-name", dict(feature_map="softmax"), ValueError, r"feature_map.*'softmax'"),
    ("feature-map-arg", dict(feature_map="elu:2"), ValueError, r"feature_map.*'elu:2'"),
    ("feature-map-type", dict(feature_map=3), TypeError, r"feature_map.*int"),
    ("normalize", dict(normalize="softmax"), ValueError, r"normalize.*'softmax'"),
    ("chunk-size-0", dict(chunk_size=0), ValueError, r"chunk_size.*\b0\b"),
    ("chunk-size-negative", dict(chunk_size=-2), ValueError, r"chunk_size.*-2"),
    ("chunk-size-float", dict(chunk_size=8.0), TypeError, r"chunk_size.*8\.0"),
    ("causal-int", dict(causal=1), TypeError, r"causal.*int"),
    ("state-type", dict(initial_state={"kv": 0}), TypeError, r"initial_state.*dict"),
    ("state-tensor", dict(initial_state=torch.zeros(2, 2, 4, 5)), TypeError, r"initial_state.*Tensor"),
    (
        "state-kv-shape",
        dict(initial_state=_state(kv_shape=(2, 2, 5, 4))),
        ValueError,
        r"initial_state\.kv.*" + shape_re(2, 2, 5, 4),
    ),
    (
        "state-kv-heads",
        dict(initial_state=_state(kv_shape=(2, 4, 4, 5))),
        ValueError,
        r"initial_state\.kv.*" + shape_re(2, 4, 4, 5),
    ),
    (
        "state-kv-rank",
        dict(initial_state=_state(kv_shape=(4, 4, 5))),
        ValueError,
        r"initial_state\.kv.*" + shape_re(4, 4, 5),
    ),
    (
        "state-normalizer-shape",
        dict(initial_state=_state(z_shape=(2, 2, 5))),
        ValueError,
        r"initial_state\.normalizer.*" + shape_re(2, 2, 5),
    ),
    ("state-normalizer-missing", dict(initial_state=_state(z=False)), ValueError, r"initial_state\.normalizer"),
    (
        "state-key-shift-shape",
        dict(feature_map="exp", initial_state=_state(shift_shape=(2, 2, 1))),
        ValueError,
        r"initial_state\.key_shift.*" + shape_re(2, 2, 1),
    ),
    (
        "state-feature-dim",  # the state of elu (F=4) fed to DPFP (F=8)
        dict(feature_map="dpfp", initial_state=_state()),
        ValueError,
        r"initial_state\.kv.*" + shape_re(2, 2, 4, 5),
    ),
    (
        "state-device",
        dict(initial_state=LinearAttentionState(kv=torch.empty(2, 2, 4, 5, dtype=F64, device="meta"))),
        ValueError,
        r"initial_state\.kv.*meta",
    ),
    (
        "state-int",
        dict(initial_state=LinearAttentionState(kv=torch.zeros(2, 2, 4, 5, dtype=torch.int64))),
        TypeError,
        r"initial_state\.kv.*int64",
    ),
    # log decays g: [B, Hkv, T] or [B, Hkv, T, F] (here [2, 2, 8] or [2, 2, 8, 4]), <= 0, q's dtype
    ("g-positive", dict(g=torch.full((2, 2, 8), 0.5, dtype=F64)), ValueError, r"\bg\b.*<= 0.*0\.5"),
    ("g-nan", dict(g=torch.full((2, 2, 8), float("nan"), dtype=F64)), ValueError, r"\bg\b.*NaN"),
    ("g-query-heads", dict(g=torch.zeros(2, 4, 8, dtype=F64)), ValueError, r"\bg\b.*" + shape_re(2, 4, 8)),
    ("g-length", dict(g=torch.zeros(2, 2, 9, dtype=F64)), ValueError, r"\bg\b.*" + shape_re(2, 2, 9)),
    ("g-channels", dict(g=torch.zeros(2, 2, 8, 5, dtype=F64)), ValueError, r"\bg\b.*" + shape_re(2, 2, 8, 5)),
    ("g-rank-2", dict(g=torch.zeros(2, 16, dtype=F64)), ValueError, r"\bg\b.*" + shape_re(2, 16)),
    ("g-int", dict(g=torch.zeros(2, 2, 8, dtype=torch.int64)), TypeError, r"\bg\b.*int64"),
    ("g-float32", dict(g=torch.zeros(2, 2, 8, dtype=torch.float32)), TypeError, r"\bg\b.*float32"),
    ("g-list", dict(g=[0.0]), TypeError, r"\bg\b.*list"),
    ("g-device", dict(g=torch.empty(2, 2, 8, dtype=F64, device="meta")), ValueError, r"\bg\b.*meta"),
    ("g-noncausal", dict(g=torch.zeros(2, 2, 8, dtype=F64), causal=False), ValueError, r"\bg\b.*causal"),
    ("scale-zero", dict(scale=0.0), ValueError, r"scale.*\b0\.0"),
    ("scale-inf", dict(scale=float("inf")), ValueError, r"scale.*inf"),
    ("scale-str", dict(scale="entropy"), ValueError, r"scale.*'entropy'"),
    ("check-inputs-int", dict(check_inputs=1), TypeError, r"check_inputs.*int"),
]


@pytest.mark.parametrize("case_id, kwargs, exc, pattern", LINEAR_OPTION_CASES, ids=[c[0] for c in LINEAR_OPTION_CASES])
@pytest.mark.parametrize("op", list(LINEAR_OPS))
def test_bad_linear_options(op, case_id, kwargs, exc, pattern):
    q, k, v = good()
    with pytest.raises(exc, match=pattern):
        LINEAR_OPS[op](q, k, v, **kwargs)


def test_unknown_impl_and_mode():
    q, k, v = good()
    with pytest.raises(ValueError, match=r"impl.*'flash'"):
        softmax_attention(q, k, v, impl="flash")
    with pytest.raises(ValueError, match=r"mode.*'fast'"):
        linear_attention(q, k, v, mode="fast")


@pytest.mark.parametrize("op", list(LINEAR_OPS))
def test_valid_decays_pass(op):
    """Both shapes of g, a reset (-inf) and a float64 g of float64 q are valid."""
    q, k, v = good()
    for g in (torch.zeros(2, 2, 8, dtype=F64), torch.full((2, 2, 8, 4), -float("inf"), dtype=F64)):
        out, _ = LINEAR_OPS[op](q, k, v, g=g, scale=0.5)
        assert out.shape == (2, 4, 8, 5) and torch.isfinite(out).all()


@pytest.mark.parametrize("op", list(ALL_OPS))
def test_valid_call_passes(op):
    """The inputs the cases above corrupt are themselves valid (so each case tests one fault)."""
    q, k, v = good()
    out = ALL_OPS[op](q, k, v, causal=True)
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == (2, 4, 8, 5)


# ----------------------------------------------------------------------------- scale, in every op


def _scale_calls():
    """Each public op with a ``scale``, as a function of it, on valid inputs."""
    q, k, v = good()
    g = torch.Generator().manual_seed(1)
    codebook = torch.randn(2, 6, 4, generator=g, dtype=F64)
    codes = torch.randint(0, 6, (2, 2, 8), generator=g)
    k_hat = codebook[torch.arange(2)[None, :, None], codes]
    beta = torch.rand(2, 2, 8, generator=g, dtype=F64)
    projection = torch.randn(3, 8, generator=g, dtype=F64)
    return {
        "softmax_attention": lambda scale: linattn.softmax_attention(q, k, v, scale=scale),
        "linear_attention": lambda scale: linattn.linear_attention(q, k, v, scale=scale),
        "delta_rule": lambda scale: linattn.delta_rule(q, k, v, beta, scale=scale),
        "local_attention": lambda scale: linattn.local_attention(q, k, v, window=4, scale=scale),
        "linformer_attention": lambda scale: linattn.linformer_attention(q, k, v, projection, projection, scale=scale),
        "strided_attention": lambda scale: linattn.strided_attention(q, k, v, block=4, scale=scale),
        "vq_attention": lambda scale: linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, scale=scale),
        "vq_decode_step": lambda scale: linattn.vq_decode_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], codebook,
                                                               block_size=4, scale=scale),
        "soft_vq_attention": lambda scale: linattn.soft_vq_attention(q, k, v, codebook, temperature=1.0, block_size=4,
                                                                     scale=scale),
    }


SCALE_OPS = list(_scale_calls())
BAD_SCALES = [float("nan"), float("inf"), -float("inf"), 0, 0.0, -1, -0.5, True, False]


def test_every_public_op_with_a_scale_is_checked_here():
    ops = [name for name in linattn.__all__ if inspect.isfunction(getattr(linattn, name))
           and "scale" in inspect.signature(getattr(linattn, name)).parameters]
    assert sorted(ops) == sorted(SCALE_OPS)


@pytest.mark.parametrize("scale", BAD_SCALES, ids=repr)
@pytest.mark.parametrize("op", SCALE_OPS)
def test_a_scale_that_is_not_a_finite_positive_number_is_refused_by_name(op, scale):
    """One rule in every op: ``scale`` is a finite positive int or float (or the op's
    default); NaN, infinities, 0, negatives and bools are a ValueError naming it, never a
    NaN output."""
    message = rf"^scale must be a finite positive number\b.*, got {re.escape(repr(scale))}$"
    with pytest.raises(ValueError, match=message):
        _scale_calls()[op](scale)


@pytest.mark.parametrize("op", SCALE_OPS)
def test_a_finite_positive_scale_is_taken(op):
    """The values around the refused ones pass (a tiny, a large and an int scale)."""
    call = _scale_calls()[op]
    for scale in (1e-30, 1e30, 2):
        out = call(scale)
        assert (out[0] if isinstance(out, tuple) else out).shape[:3] in ((2, 4, 8), (2, 4, 1))
