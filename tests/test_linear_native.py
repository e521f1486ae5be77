"""The native chunk forms of kernel attention (``ops/kernel/native_scan.py``,
``_native/linear_scan.cpp`` and, with decay and without gradients, ``_native/decayed_scan.cpp``):
equal in float64 to the formula (the parallel reference with
independently written features) in outputs, final states and gradients of every input, the
carried state's included, on awkward shapes (T = 1, T not a multiple of the chunk, rows cut
into several segments, Hkv < H, batch > 1, carried states); the maps it makes itself (elu + 1,
relu, identity, with a query scale) and the ones made in torch around it; causal; the same bits
at 1 and 2 threads; second derivatives; ``impl`` and ``LINATTN_LINEAR_IMPL`` fail loudly; the
self-check catches a kernel that is off. With decay: the recurrence of ``test_decay.py``
(one decay per step and one per channel, strong decays, resets), and a call that records
gradients runs the torch form. ``tests/test_linear_attention.py`` runs every one of its
tests with the kernel (``impl="auto"``) and with the torch chunk form."""

from __future__ import annotations

import warnings

import pytest
import torch

from _helpers import F64, assert_causal_jacobian, assert_close_rel, independent_features, make_qkv
from linattn import LinearAttentionState, linear_attention
from linattn.feature_maps import DPFP, FAVOR
from linattn.ops.common import native
from linattn.ops.kernel import native_scan
from test_decay import initial as decay_initial
from test_decay import inputs as decay_inputs
from test_decay import loop as decay_loop
from test_decay import make_g

MADE = ("elu", "relu", "identity")  # the maps the kernel makes itself


@pytest.fixture(autouse=True)
def auto_choice(monkeypatch):
    monkeypatch.delenv(native_scan.ENV, raising=False)


@pytest.fixture
def fresh_verdicts(monkeypatch):
    """Forget the process's verdicts for the test, and restore them after it."""
    monkeypatch.setattr(native_scan._trust, "verdicts", {})
    monkeypatch.setattr(native_scan._trust, "warned", set())


@pytest.fixture
def kernel_calls(monkeypatch):
    """The feature map of every call of the forward kernel (so a test knows it ran); the
    self-checks run before, so their calls are not counted."""
    assert native_scan.verdict(torch.float64) is None and native_scan.verdict(torch.float32) is None
    calls = []
    forward = native_scan._forward

    decayed = native_scan.decayed

    def spy(q, k, v, S, z, options):
        calls.append(options.feature_map)
        return forward(q, k, v, S, z, options)

    def decayed_spy(*args, **kwargs):
        calls.append("decayed " + kwargs.get("feature_map", "given"))
        return decayed(*args, **kwargs)

    monkeypatch.setattr(native_scan, "_forward", spy)
    monkeypatch.setattr(native_scan, "decayed", decayed_spy)
    return calls


def formula(q, k, v, fmap, normalize, scale=1.0, state=None, eps=1e-6):
    """The causal sums written out for each query: phi made by ``independent_features``
    (unshifted), ``out_i = phi(q_i).S_i [/ (phi(q_i).z_i + eps)]`` -> (out, S_T, z_T)."""
    B, H, T, _ = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    phi_q = independent_features(fmap, q * scale)
    phi_k = independent_features(fmap, k)
    if normalize == "sum":  # exponential maps: a softmax, exact without eps
        extra = 0.0 if isinstance(fmap, FAVOR) else eps
        phi_q = phi_q / (phi_q.sum(-1, keepdim=True) + extra)
        phi_k = phi_k / (phi_k.sum(-1, keepdim=True) + extra)
    F, E = phi_k.shape[-1], v.shape[-1]
    S = state.kv.to(F64) if state is not None else q.new_zeros(B, Hkv, F, E)
    z = state.normalizer.to(F64) if state is not None and state.normalizer is not None else q.new_zeros(B, Hkv, F)
    outs = []
    for i in range(T):
        S = S + phi_k[:, :, i, :, None] * v[:, :, i, None, :]
        z = z + phi_k[:, :, i]
        S_q, z_q = S.repeat_interleave(G, 1), z.repeat_interleave(G, 1)
        num = torch.einsum("bhf,bhfe->bhe", phi_q[:, :, i], S_q)
        if normalize == "attention":
            num = num / ((phi_q[:, :, i] * z_q).sum(-1, keepdim=True) + eps)
        outs.append(num)
    return torch.stack(outs, 2), S, z


def _state(B, Hkv, F, E, seed, normalize, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    kv = (0.3 * torch.randn(B, Hkv, F, E, generator=g, dtype=F64)).requires_grad_(requires_grad)
    normalizer = None
    if normalize == "attention":
        normalizer = (0.5 + torch.rand(B, Hkv, F, generator=g, dtype=F64)).requires_grad_(requires_grad)
    return LinearAttentionState(kv=kv, normalizer=normalizer, steps=3, feature_map=None,
                                normalize="none" if normalize is None else normalize)


SHAPES = {  # (B, H, Hkv, T, chunk, Dk, Dv): T = 1; T not a multiple of the chunk; one key/value head for
    # 4 queries; widths that take every path of the tile products (in float64, 40 = 4 vectors + 1,
    # 21 = 2 vectors + 5 columns; chunks of 16 rows, so blocks of rows meet the triangles' diagonals)
    "T1": (2, 4, 2, 1, 4, 4, 3),
    "ragged": (2, 2, 2, 23, 4, 4, 3),
    "gqa": (1, 4, 1, 13, 3, 4, 3),
    "wide": (1, 2, 1, 45, 16, 40, 21),
}


# every map with every normalisation, but exp (unbounded) only in the attention ratio
MAP_NORMALIZE = [(fmap, normalize) for fmap in MADE + ("favor", "dpfp1") for normalize in ("attention", None, "sum")]


@pytest.mark.parametrize("fmap, normalize", MAP_NORMALIZE + [("exp", "attention")])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried"])
def test_equals_the_formula_with_gradients(fmap, normalize, shape, carried, kernel_calls):
    """Outputs, final states and the gradients of q, k, v and the carried state equal the
    formula's in float64; rows are cut into segments of 2 chunks, so the ragged shape crosses
    three segment ends."""
    B, H, Hkv, T, chunk, Dk, Dv = shape_args = SHAPES[shape]
    maps = {"favor": FAVOR(8, seed=1), "dpfp1": DPFP(1)}
    feature_map = maps.get(fmap, fmap)
    q, k, v = make_qkv(B=B, H=H, Hkv=Hkv, T=T, Dk=Dk, Dv=Dv, positive=fmap == "identity", seed=len(shape) + T)
    if Dk > 8:  # keep exp's and the unnormalised sums' magnitudes as at Dk = 4
        q, k = q * 0.3, k * 0.3
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    F = {"dpfp1": 2 * Dk, "favor": 8}.get(fmap, Dk)
    state = _state(B, Hkv, F, Dv, seed=T, normalize=normalize) if carried else None
    scale = 0.7
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native_scan, "segment_chunks_for", lambda rows, chunks: 2)
        got, got_state = linear_attention(q, k, v, feature_map=feature_map, normalize=normalize, chunk_size=chunk,
                                          initial_state=state, output_final_state=True, scale=scale, impl="native")
    assert kernel_calls == [fmap if fmap in MADE and normalize != "sum" else "given"], shape_args
    want, want_S, want_z = formula(q, k, v, feature_map, normalize, scale, state)
    if fmap in ("favor", "exp") and normalize == "attention":  # shifted sums: compare what they mean
        shift = got_state.key_shift.to(F64)[..., None]
        got_S, got_z = got_state.kv * shift[..., None].exp(), got_state.normalizer * shift.exp()
    else:
        got_S, got_z = got_state.kv, got_state.normalizer
    assert_close_rel(got, want, rtol=1e-11, name="out")
    assert_close_rel(got_S, want_S, rtol=1e-11, name="final S")
    if normalize == "attention":
        assert_close_rel(got_z, want_z, rtol=1e-11, name="final z")
    leaves = [q, k, v] + ([state.kv] + ([state.normalizer] if state.normalizer is not None else []) if carried else [])
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    # the final state enters the loss too, so its gradient reaches every input
    got_loss = (got * weights).sum() + 0.3 * got_S.sum() + (0.2 * got_z.sum() if normalize == "attention" else 0)
    want_loss = (want * weights).sum() + 0.3 * want_S.sum() + (0.2 * want_z.sum() if normalize == "attention" else 0)
    got_grads = torch.autograd.grad(got_loss, leaves)
    want_grads = torch.autograd.grad(want_loss, leaves)
    for name, a, b in zip(("q", "k", "v", "S", "z"), got_grads, want_grads):
        if T == 1 and name == "q" and not carried and normalize == "attention":
            # one key: out = v (phi(q).k / (phi(q).k + eps)), so d out / d q is of the size of eps, a
            # difference of terms of size 1: equal to their rounding
            assert (a - b).abs().max() < 1e-13
            continue
        assert_close_rel(a, b, rtol=1e-10, name=f"d {name}")


@pytest.mark.parametrize("fmap", MADE)
def test_segments_and_chunks_do_not_change_the_result(fmap, kernel_calls):
    """One segment, segments of one chunk, and the default cut (``segment_chunks_for``) give
    the same outputs and gradients to rounding; the default cuts a long row of one head."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=300, Dk=8, Dv=5, positive=fmap == "identity", seed=2, requires_grad=True)
    results = []
    for segment_chunks in (1, 1000, None):
        with pytest.MonkeyPatch.context() as mp:
            if segment_chunks is not None:
                mp.setattr(native_scan, "segment_chunks_for", lambda rows, chunks, n=segment_chunks: n)
            out, _ = linear_attention(q, k, v, feature_map=fmap, chunk_size=8, impl="native")
        grads = torch.autograd.grad((out * out.detach().sin()).sum(), (q, k, v))
        results.append((out, *grads))
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            assert_close_rel(a, b, rtol=1e-12)
    assert native_scan.segment_chunks_for(1, 31) == 31  # fewer than two segments of MIN_SEGMENT_CHUNKS
    assert native_scan.segment_chunks_for(1, 38) == 19  # this test's row: two segments
    assert native_scan.segment_chunks_for(1, 256) == 16  # one head: TASKS segments
    assert native_scan.segment_chunks_for(8, 256) == 128  # eight heads: two segments each
    assert native_scan.segment_chunks_for(16, 256) == 256  # enough rows: one segment


def test_causal():
    """d out_i / d (q, k, v)_j is zero for every j > i (and not zero everywhere)."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=9, Dk=3, Dv=2, seed=4)

    def run(q, k, v):
        return linear_attention(q, k, v, chunk_size=4, impl="native")[0]

    assert_causal_jacobian(run, (q, k, v), ("q", "k", "v"))


def test_thread_count_does_not_change_a_bit():
    """Float32, 8 rows of 3 segments: forward and gradients bit-equal at 1 and 2 threads."""
    q, k, v = make_qkv(B=2, H=8, Hkv=4, T=700, Dk=16, Dv=16, seed=6)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out, state = linear_attention(q, k, v, chunk_size=16, output_final_state=True, impl="native")
            grads = torch.autograd.grad((out * out.detach().cos()).sum() + state.kv.sum(), (q, k, v))
            results.append((out, state.kv, *grads))
    finally:
        torch.set_num_threads(before)
    assert native_scan.segment_chunks_for(8, 44) < 44
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_float32_matches_float64():
    q, k, v = make_qkv(B=1, H=4, Hkv=2, T=200, Dk=16, Dv=8, seed=7)
    want, _ = linear_attention(q, k, v, chunk_size=32, impl="torch")
    got, _ = linear_attention(q.float(), k.float(), v.float(), chunk_size=32, impl="native")
    assert got.dtype == torch.float32
    assert_close_rel(got, want, rtol=1e-5)


def test_second_derivatives_differentiate_the_torch_form():
    """``create_graph=True`` works (the backward differentiates ``forms.chunk``) and its second
    derivatives are the torch form's."""
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=10, Dk=3, Dv=2, seed=8, requires_grad=True)
    second = {}
    for impl in ("native", "torch"):
        out, _ = linear_attention(q, k, v, chunk_size=4, impl=impl)
        (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        second[impl] = torch.autograd.grad(dq.sum(), (q, k, v))
    for a, b in zip(second["native"], second["torch"]):
        assert_close_rel(a, b, rtol=1e-12)

    def first_grad_of_q(q, k, v):
        out, _ = linear_attention(q, k, v, chunk_size=4, impl="native")
        return out

    assert torch.autograd.gradgradcheck(first_grad_of_q, (q, k, v), eps=1e-6, atol=1e-7)


def test_impl_native_refuses_what_it_does_not_compute(monkeypatch):
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=6, Dk=3, Dv=2)
    with pytest.raises(ValueError, match=r"impl='native': the native kernel attention computes the causal form"):
        linear_attention(q, k, v, causal=False, impl="native")
    with pytest.raises(ValueError, match=r"computes mode='chunk', got mode='parallel'"):
        linear_attention(q, k, v, mode="parallel", impl="native")
    g = -torch.rand(1, 1, 6, dtype=F64)
    with pytest.raises(ValueError, match=r"decayed form \(g=\) without gradients"):
        linear_attention(q.requires_grad_(), k, v, g=g, impl="native")
    q = q.detach()
    with pytest.raises(ValueError, match="computes in float32 or float64, got torch.bfloat16"):
        native_scan.use_native("native", q, torch.bfloat16, True, "chunk", False)
    with pytest.raises(ValueError, match="impl must be one of"):
        linear_attention(q, k, v, impl="triton")
    # a causal T == 1 call with impl="native" takes the chunk form, not the recurrent one
    one = make_qkv(B=1, H=2, Hkv=1, T=1, Dk=3, Dv=2)
    want, _ = linear_attention(*one, impl="torch")
    got, _ = linear_attention(*one, impl="native")
    assert_close_rel(got, want, rtol=1e-14)
    monkeypatch.setenv(native_scan.ENV, "native")
    with pytest.raises(ValueError, match=r"LINATTN_LINEAR_IMPL=native: .* computes the causal form"):
        linear_attention(q, k, v, causal=False)
    monkeypatch.setenv(native_scan.ENV, "fast")
    with pytest.raises(ValueError, match="LINATTN_LINEAR_IMPL must be 'torch' or 'native'"):
        linear_attention(q, k, v)


def test_auto_takes_the_kernel_and_the_variable_the_torch_form(monkeypatch, kernel_calls):
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=6, Dk=3, Dv=2)
    linear_attention(q, k, v)
    linear_attention(q.float(), k.float(), v.float(), feature_map=FAVOR(4))
    assert kernel_calls == ["elu", "given"]
    linear_attention(q, k, v, causal=False)  # not a call the kernel computes: the torch form, no error
    linear_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1])  # decoding: the recurrent form
    monkeypatch.setenv(native_scan.ENV, "torch")
    linear_attention(q, k, v)
    assert kernel_calls == ["elu", "given"]


class _Off:
    """The compiled module with the output of its forward kernel ``kernel`` nudged: a kernel that is
    wrong here (both forward kernels take ``out`` fourth from the end)."""

    def __init__(self, module, kernel: str):
        self.module, self.kernel = module, kernel

    def __getattr__(self, name):
        function = getattr(self.module, name)
        if name != self.kernel:
            return function

        def nudged(*args):
            function(*args)
            args[-4].add_(1e-6)  # out

        return nudged


def test_a_kernel_that_differs_is_caught_by_the_self_check(fresh_verdicts, monkeypatch):
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=6, Dk=3, Dv=2)
    expected, _ = linear_attention(q, k, v, impl="torch")
    monkeypatch.setattr(native, "extension", lambda module=native.extension(): _Off(module, "linear_scan_forward"))
    with pytest.warns(RuntimeWarning, match=r"native kernel attention failed in torch.float64: output 0: differs"):
        out, _ = linear_attention(q, k, v)
    assert torch.equal(out, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per dtype
        linear_attention(q, k, v)
    with pytest.raises(RuntimeError, match="output 0: differs"):
        linear_attention(q, k, v, impl="native")


def test_the_self_check_passes_in_both_dtypes(fresh_verdicts):
    assert native_scan.verdict(torch.float64) is None
    assert native_scan.verdict(torch.float32) is None


def test_the_kernel_checks_its_arguments():
    ext = native.extension()
    q, k, v = torch.rand(2, 1, 5, 3), torch.rand(2, 5, 3), torch.randn(2, 5, 4)
    S, z = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    out, den = torch.empty(2, 1, 5, 4), torch.empty(2, 1, 5)
    final_S, final_z = torch.empty_like(S), torch.empty_like(z)
    ext.linear_scan_forward(q, k, v, S, z, 2, 1, 1, 1.0, True, 1e-6, out, den, final_S, final_z)
    with pytest.raises(RuntimeError, match=r"k has shape \[2, 4, 3\], expected \[2, 5, 3\]"):
        ext.linear_scan_forward(q, k[:, :4], v, S, z, 2, 1, 1, 1.0, True, 1e-6, out, den, final_S, final_z)
    with pytest.raises(RuntimeError, match="the division needs a normalizer"):
        ext.linear_scan_forward(q, k, v, S, None, 2, 1, 1, 1.0, True, 1e-6, out, None, final_S, None)
    with pytest.raises(RuntimeError, match="given features take no scale"):
        ext.linear_scan_forward(q, k, v, S, z, 2, 1, 0, 0.5, True, 1e-6, out, den, final_S, final_z)
    with pytest.raises(RuntimeError, match="feature_map 7 is not one of 0..3"):
        ext.linear_scan_forward(q, k, v, S, z, 2, 1, 7, 1.0, True, 1e-6, out, den, final_S, final_z)
    with pytest.raises(RuntimeError, match="out must be a contiguous CPU tensor of Float, got Double"):
        ext.linear_scan_forward(q, k, v, S, z, 2, 1, 1, 1.0, True, 1e-6, out.double(), den, final_S, final_z)
    with pytest.raises(RuntimeError, match="chunk 0 < 1"):
        ext.linear_scan_forward(q, k, v, S, z, 0, 1, 1, 1.0, True, 1e-6, out, den, final_S, final_z)
    with pytest.raises(ValueError, match="feature_map must be one of"):
        native_scan.scan(q, k, v, S, z, 2, feature_map="dpfp")


# ----------------------------------------------------------------------------- with decay


DECAY_SETTINGS = {"identity-none": "identity", "elu-attention": "elu", "exp-attention": "given",
                  "dpfp-sum": "given"}  # test_decay.SETTINGS, and the map the kernel is given


@pytest.mark.parametrize("setting", list(DECAY_SETTINGS))
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
@pytest.mark.parametrize("T, chunk, low", [(1, 8, -2.0), (37, 8, -2.0), (37, 5, -60.0)],
                         ids=["T1", "ragged", "strong"])
def test_decayed_equals_the_recurrence(setting, per_channel, T, chunk, low, kernel_calls):
    """Without gradients: outputs and final states equal ``test_decay.loop`` in float64, from a
    carried state, GQA (4 query heads on 2), a reset (g = -inf) inside a chunk, segments of 2
    chunks; strong decays (down to -60 per step) stay exact."""
    from test_decay import SETTINGS

    fmap, normalize, F = SETTINGS[setting]
    q, k, v = decay_inputs(setting, T=T)
    g = make_g(2, 2, T, F if per_channel else None, low=low)
    if T > 3:
        g[:, :, 3] = -torch.inf
    state, S0, z0 = decay_initial(setting)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(native_scan, "segment_chunks_for", lambda rows, chunks: 2)
        out, final = linear_attention(q, k, v, g=g, feature_map=fmap, normalize=normalize, chunk_size=chunk,
                                      initial_state=state, output_final_state=True, scale=0.8, impl="native")
    assert kernel_calls == ["decayed " + DECAY_SETTINGS[setting]]
    want, want_S, want_z = decay_loop(q, k, v, g, fmap, normalize, S0, z0, scale=0.8)
    factor = torch.ones(2, 2, dtype=F64) if final.key_shift is None else final.key_shift.exp()
    assert_close_rel(out, want, rtol=1e-11, name="out")
    assert_close_rel(final.kv * factor[..., None, None], want_S, rtol=1e-11, name="final S")
    if normalize == "attention":
        assert_close_rel(final.normalizer * factor[..., None], want_z, rtol=1e-11, name="final z")


@pytest.mark.parametrize("setting", ["identity-none", "elu-attention"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_decayed_wide_equals_the_recurrence(setting, per_channel, kernel_calls):
    """Widths that take every path of the tile products (Dk 40, Dv 21 in float64), chunks of 16
    rows (a per-step decay's chunk of 32 too), a reset."""
    from test_decay import SETTINGS

    fmap, normalize, _ = SETTINGS[setting]
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=70, Dk=40, Dv=21, seed=9, positive=normalize is None)
    q, k = q * 0.3, k * 0.3
    g = make_g(1, 1, 70, 40 if per_channel else None, low=-1.0)
    g[:, :, 20] = -torch.inf
    want, want_S, _ = decay_loop(q, k, v, g, fmap, normalize)
    for chunk in (16, 32):
        with torch.no_grad():
            out, final = linear_attention(q, k, v, g=g, feature_map=fmap, normalize=normalize, chunk_size=chunk,
                                          output_final_state=True, impl="native")
        assert_close_rel(out, want, rtol=1e-11, name=f"out, chunk {chunk}")
        assert_close_rel(final.kv, want_S, rtol=1e-11, name=f"final S, chunk {chunk}")
    assert kernel_calls == ["decayed " + DECAY_SETTINGS[setting]] * 2


def test_decayed_with_gradients_runs_the_torch_form(kernel_calls):
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=9, Dk=3, Dv=2, requires_grad=True)
    g = make_g(1, 1, 9, 3)
    out, _ = linear_attention(q, k, v, g=g, chunk_size=4)
    assert out.requires_grad and kernel_calls == []
    with pytest.raises(ValueError, match=r"impl='native': .* decayed form \(g=\) without gradients"):
        linear_attention(q, k, v, g=g, impl="native")
    with torch.no_grad():
        linear_attention(q, k, v, g=g, chunk_size=4)
    linear_attention(q.detach(), k.detach(), v.detach(), g=g, chunk_size=4)  # no input needs a gradient
    assert kernel_calls == ["decayed elu", "decayed elu"]


def test_decayed_thread_count_does_not_change_a_bit():
    q, k, v = make_qkv(B=2, H=8, Hkv=4, T=700, Dk=16, Dv=16, seed=6)
    q, k, v = q.float(), k.float(), v.float()
    g = make_g(2, 4, 700, 16, low=-0.5, dtype=torch.float32)
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.no_grad():
                out, state = linear_attention(q, k, v, g=g, chunk_size=16, output_final_state=True,
                                              feature_map="identity", normalize=None, impl="native")
            results.append((out, state.kv))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_decayed_kernel_that_differs_is_caught_by_the_self_check(fresh_verdicts, monkeypatch):
    monkeypatch.setattr(native, "extension", lambda module=native.extension(): _Off(module, "decayed_scan_forward"))
    with pytest.raises(RuntimeError, match="decayed output 0: differs"):
        native_scan.use_native("native", torch.zeros(1), torch.float64, True, "chunk", True)
