"""Feature maps of kernel attention (``linattn.feature_maps``): each equals its formula
and reports its dimension; FAVOR+ is an unbiased, seeded, orthogonal random-feature
estimate of the softmax kernel; Taylor and DPFP have their closed forms; names parse."""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch

from _helpers import F64, independent_features
from linattn import feature_maps as fm
from linattn.ops.kernel import normalized_features

D = 16
SEEDS = range(400)


# ----------------------------------------------------------------------------- formulas and sizes

ALL_MAPS = {
    "elu": (fm.EluPlusOne, lambda d: d),
    "relu": (fm.ReLU, lambda d: d),
    "identity": (fm.Identity, lambda d: d),
    "exp": (fm.Exp, lambda d: d),
    "favor-24": (lambda: fm.FAVOR(24, seed=2), lambda d: 24),
    "favor-5-iid": (lambda: fm.FAVOR(5, seed=1, orthogonal=False), lambda d: 5),
    "dpfp-1": (lambda: fm.DPFP(1), lambda d: 2 * d),
    "dpfp-3": (lambda: fm.DPFP(3), lambda d: 6 * d),
    "taylor": (fm.Taylor, lambda d: 1 + d + d * d),
}


@pytest.mark.parametrize("d", [3, 8])
@pytest.mark.parametrize("name", list(ALL_MAPS))
def test_map_equals_formula_and_dim_out(name, d):
    """``phi(x)`` has ``dim_out(d)`` features, equals the formula for queries and keys
    alike, on a [2, 3, 5, d] batch."""
    make, expected_dim = ALL_MAPS[name]
    fmap = make()
    assert fmap.dim_out(d) == expected_dim(d)
    x = torch.randn(2, 3, 5, d, generator=torch.Generator().manual_seed(d), dtype=F64)
    expected = independent_features(fmap, x)
    for is_query in (True, False):
        phi = fmap(x, is_query=is_query)
        assert phi.shape == (2, 3, 5, expected_dim(d))
        torch.testing.assert_close(phi, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["elu", "exp", "favor-24", "dpfp-1", "dpfp-3"])
def test_positive_maps_are_non_negative(name):
    """Maps meant as kernels of softmax give non-negative features (DPFP: sparse)."""
    fmap = ALL_MAPS[name][0]()
    x = 3 * torch.randn(200, 6, generator=torch.Generator().manual_seed(0), dtype=F64)
    assert (fmap(x, is_query=True) >= 0).all()


@pytest.mark.parametrize("nu", [1, 2, 3])
def test_dpfp_by_hand(nu):
    """DPFP written out entry by entry: r = [relu(x), relu(-x)] (2d), block j holds
    r_i * r_{(i - j) mod 2d}."""
    d = 3
    x = torch.tensor([0.5, -2.0, 1.5], dtype=F64)
    r = [max(t, 0.0) for t in x.tolist()] + [max(-t, 0.0) for t in x.tolist()]
    expected = [r[i] * r[(i - j) % (2 * d)] for j in range(1, nu + 1) for i in range(2 * d)]
    torch.testing.assert_close(fm.DPFP(nu)(x, is_query=True), torch.tensor(expected, dtype=F64))


def test_taylor_kernel_is_second_order_exp():
    """phi(q).phi(k) == 1 + s + s^2/2 with s = q.k / sqrt(d), to 1e-12 in float64."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(50, 7, generator=g, dtype=F64), torch.randn(50, 7, generator=g, dtype=F64)
    taylor = fm.Taylor()
    s = (q * k).sum(-1) / math.sqrt(7)
    kernel = (taylor(q, is_query=True) * taylor(k, is_query=False)).sum(-1)
    torch.testing.assert_close(kernel, 1 + s + s * s / 2, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- FAVOR+


@functools.lru_cache(maxsize=None)
def _favor_estimates(m, orthogonal=True):
    """``phi(q).phi(k)`` of the ``_pairs()`` for each seed in SEEDS: ``[len(SEEDS), 4]``."""
    q, k = _pairs()
    rows = []
    for seed in SEEDS:
        f = fm.FAVOR(m, seed=seed, orthogonal=orthogonal)
        rows.append((f(q, is_query=True) * f(k, is_query=False)).sum(-1))
    return torch.stack(rows)


def _pairs():
    """Four (q, k) pairs in d=16 with moderate norms (1.2 to 2.4): along the diagonal
    direction (aligned and opposed), along one axis, and random."""
    ones, axis = torch.ones(D, dtype=F64), torch.eye(D, dtype=F64)[0]
    g = torch.Generator().manual_seed(0)
    q = torch.stack([0.5 * ones, 0.5 * ones, 2.0 * axis, 0.6 * torch.randn(D, generator=g, dtype=F64)])
    k = torch.stack([0.5 * ones, -0.3 * ones, 1.5 * axis, 0.6 * torch.randn(D, generator=g, dtype=F64)])
    return q, k


@pytest.mark.parametrize("orthogonal", [True, False], ids=["orthogonal", "iid"])
@pytest.mark.parametrize("m", [16, 64, 256])
def test_favor_is_unbiased(m, orthogonal):
    """Averaged over 400 seeds, phi(q).phi(k) is within 4 standard errors of
    exp(q.k / sqrt(d)) for each of four (q, k) pairs."""
    q, k = _pairs()
    est = _favor_estimates(m, orthogonal)
    target = torch.exp((q * k).sum(-1) / math.sqrt(D))
    stderr = est.std(0) / math.sqrt(len(SEEDS))
    z = (est.mean(0) - target) / stderr
    assert (z.abs() < 4).all(), f"mean {est.mean(0).tolist()} target {target.tolist()} z-scores {z.tolist()}"


def test_favor_error_decreases_with_features():
    """The mean squared error over seeds shrinks as m grows: 16 > 64 > 256."""
    q, k = _pairs()
    target = torch.exp((q * k).sum(-1) / math.sqrt(D))
    mse = [((_favor_estimates(m, True) - target) ** 2).mean().item() for m in (16, 64, 256)]
    assert mse[0] > mse[1] > mse[2], mse


def test_favor_rows_are_centred_gaussians():
    """Each projection row is marginally N(0, I): over 400 seeds every entry of W has
    mean 0 and mean square 1 (within 5 standard errors).

    A QR factorisation without the sign correction of R's diagonal makes the directions
    non-uniform (e.g. row i always has a negative i-th coordinate) and biases FAVOR+.
    """
    W = torch.stack([fm.FAVOR(D, seed=s).projection(D, dtype=F64) for s in SEEDS])  # [400, 16, 16]
    stderr = W.std(0) / math.sqrt(len(SEEDS))
    z = W.mean(0) / stderr
    worst = z.abs().argmax().item()
    assert z.abs().max() < 5, f"entry (row, col) {divmod(worst, D)} has mean z-score {z.flatten()[worst]:.1f}"
    mean_square = (W**2).mean(0)  # each entry: mean 1, standard error sqrt(2 / 400)
    assert (mean_square - 1).abs().max() < 5 * math.sqrt(2 / len(SEEDS))
    assert abs(mean_square.mean().item() - 1) < 0.05


def test_favor_projection_blocks_are_orthogonal():
    """m=40, d=16: rows within each block of d are mutually orthogonal; row norms vary
    (chi-distributed), so the rows are not just an orthonormal basis."""
    W = fm.FAVOR(40, seed=5).projection(D, dtype=F64)
    assert W.shape == (40, D)
    for start in range(0, 40, D):
        block = W[start : start + D]
        gram = block @ block.T
        off_diagonal = gram - torch.diag(torch.diagonal(gram))
        assert off_diagonal.abs().max() < 1e-10 * gram.diagonal().max()
    across = W[:D] @ W[D : 2 * D].T
    assert across.abs().max() > 1e-3  # different blocks are independent draws
    norms = W.norm(dim=-1)
    assert norms.std() > 0.05 * norms.mean()


def test_favor_seed_and_redraw():
    """Same seed -> same projection; another seed or redraw(seed) -> a new one, equal to
    a fresh map with that seed; redraw() steps the seed by one."""
    a, b = fm.FAVOR(32, seed=3), fm.FAVOR(32, seed=3)
    Wa = a.projection(D, dtype=F64).clone()
    assert torch.equal(Wa, b.projection(D, dtype=F64))
    assert not torch.allclose(Wa, fm.FAVOR(32, seed=4).projection(D, dtype=F64))
    a.redraw(11)
    assert not torch.allclose(a.projection(D, dtype=F64), Wa)
    assert torch.equal(a.projection(D, dtype=F64), fm.FAVOR(32, seed=11).projection(D, dtype=F64))
    b.redraw()
    assert torch.equal(b.projection(D, dtype=F64), fm.FAVOR(32, seed=4).projection(D, dtype=F64))
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(0), dtype=F64)
    assert not torch.allclose(a(x, is_query=True), fm.FAVOR(32, seed=3)(x, is_query=True))


def test_favor_projection_dtypes_agree():
    """The float32 projection is the float64 one rounded (one draw, any dtype)."""
    f = fm.FAVOR(20, seed=9)
    torch.testing.assert_close(f.projection(D), f.projection(D, dtype=F64).float())


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_favor_and_dpfp_reject_bad_sizes(bad):
    with pytest.raises((ValueError, TypeError), match="num_features"):
        fm.FAVOR(bad)
    with pytest.raises((ValueError, TypeError), match="nu"):
        fm.DPFP(bad)


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    "spec, cls",
    [
        ("elu", fm.EluPlusOne),
        ("relu", fm.ReLU),
        ("identity", fm.Identity),
        ("exp", fm.Exp),
        ("favor", fm.FAVOR),
        ("dpfp", fm.DPFP),
        ("taylor", fm.Taylor),
    ],
)
def test_get_feature_map_names(spec, cls):
    assert type(fm.get_feature_map(spec)) is cls


def test_get_feature_map_arguments_and_instances():
    """'favor:32' -> 32 features, 'dpfp:3' -> nu 3; an instance passes through."""
    assert fm.get_feature_map("favor:32").num_features == 32
    assert fm.get_feature_map("favor:32").dim_out(D) == 32
    assert fm.get_feature_map("dpfp:3").nu == 3
    favor = fm.FAVOR(8, seed=1)
    assert fm.get_feature_map(favor) is favor


@pytest.mark.parametrize("spec", ["softmax", "", "elu:3", "favor:abc", "taylor:2", "dpfp:-1"])
def test_get_feature_map_rejects_unknown(spec):
    """Unknown names and bad arguments raise ValueError naming 'feature_map' and the spec."""
    with pytest.raises(ValueError, match=r"feature_map.*" + re.escape(repr(spec))):
        fm.get_feature_map(spec)


def test_get_feature_map_rejects_non_strings():
    with pytest.raises(TypeError, match="feature_map.*int"):
        fm.get_feature_map(3)


# ----------------------------------------------------------------------------- soft VQ and normalisation


def test_soft_vq_features_equal_their_formulas():
    """phi_q(q)_y = exp(q.c_y - max_y q.c_y); phi_k(k)_y = softmax_y(-|k - c_y|^2 / 2 tau),
    written out per row; as tau -> 0 their product picks the nearest code of k."""
    g = torch.Generator().manual_seed(3)
    codebook = torch.randn(5, 4, generator=g, dtype=F64)
    q, k = torch.randn(2, 3, 7, 4, generator=g, dtype=F64), torch.randn(2, 3, 6, 4, generator=g, dtype=F64)
    soft = fm.SoftVQ(codebook, temperature=0.7)
    assert soft.dim_out(4) == 5
    phi_q, phi_k = soft(q, is_query=True), soft(k, is_query=False)
    logits = torch.einsum("bhtd,sd->bhts", q, codebook)
    torch.testing.assert_close(phi_q, torch.exp(logits - logits.max(-1, keepdim=True).values))
    distances = torch.stack([((k - c) ** 2).sum(-1) for c in codebook], dim=-1)
    torch.testing.assert_close(phi_k, torch.softmax(-distances / 1.4, dim=-1))
    hard = fm.SoftVQ(codebook, temperature=1e-6)(k, is_query=False)
    assert torch.equal(hard.argmax(-1), distances.argmin(-1)) and torch.allclose(hard.max(-1).values,
                                                                                  torch.ones(()).to(F64))


@pytest.mark.parametrize("name", ["elu", "favor-24", "dpfp-1"])
@pytest.mark.parametrize("normalize", ["sum", "l2", None])
def test_normalized_features_formulas(name, normalize):
    """"sum": phi / (sum phi + eps) (exponential maps: the same ratio computed as a softmax of
    the log-features, no eps); "l2": phi / max(|phi|, eps); None: phi. A large eps shows it."""
    fmap = ALL_MAPS[name][0]()
    x = torch.randn(2, 3, 5, D, generator=torch.Generator().manual_seed(4), dtype=F64)
    for is_query in (True, False):
        phi = fmap(x, is_query=is_query)
        got = normalized_features(fmap, x, is_query=is_query, normalize=normalize, eps=0.5)
        if normalize == "sum":
            expected = phi / phi.sum(-1, keepdim=True) if fmap.exponential else phi / (phi.sum(-1, keepdim=True) + 0.5)
        elif normalize == "l2":
            expected = phi / phi.norm(dim=-1, keepdim=True).clamp_min(0.5)
        else:
            expected = phi
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("codebook", [torch.zeros(2, 3, 4), torch.zeros(4), torch.zeros(3, 4, dtype=torch.long)])
def test_soft_vq_codebook_must_be_a_float_matrix(codebook):
    with pytest.raises(ValueError, match="SoftVQ codebook must be a floating-point tensor"):
        fm.SoftVQ(codebook)


def test_favor_under_compile_reads_only_prepared_draws(monkeypatch):
    """While torch.compile traces, the projection is never drawn: a dimension prepared before
    (and redrawn since: ``redraw`` prepares again what was prepared) is returned; another one
    raises, naming ``prepare(d)``."""
    f = fm.FAVOR(16, seed=3)
    f.prepare(D)
    f.redraw(7)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = f.projection(D, dtype=F64)
    with pytest.raises(RuntimeError, match=rf"prepare\({D + 1}\)"):
        f.projection(D + 1)
    monkeypatch.undo()
    assert torch.equal(traced, fm.FAVOR(16, seed=7).projection(D, dtype=F64))


def test_get_feature_map_takes_one_as_the_smallest_argument():
    """'favor:1' is one random feature and 'dpfp:1' is nu = 1; 'favor:0' and 'dpfp:0' are refused."""
    assert fm.get_feature_map("favor:1").num_features == 1
    assert fm.get_feature_map("dpfp:1").nu == 1
    for spec in ("favor:0", "dpfp:0"):
        with pytest.raises(ValueError, match=r"feature_map.*" + re.escape(repr(spec))):
            fm.get_feature_map(spec)
