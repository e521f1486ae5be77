"""VectorQuantizer (docs/design.md, section 4): exact lookup, nearest codes, straight-through
gradient, commitment loss, the EMA update (once per step, padding excluded, also under
activation checkpointing), buffers, eval mode, k-means init, dead-code restart, usage."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.utils.checkpoint as cp

import linattn

F64 = torch.float64


def keys(B=2, H=2, T=9, D=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g).to(dtype)


def lookup(codebook, codes):
    H = codebook.shape[0]
    return codebook[torch.arange(H)[None, :, None], codes]


def distances64(k, codebook):
    return ((k.to(F64).unsqueeze(-2) - codebook.to(F64).unsqueeze(0).unsqueeze(2)) ** 2).sum(-1)


def tiny_quantizer(codebook_values, ema_decay=0.5, **kw):
    """H=1, D=1 quantizer with a hand-set codebook (EMA counts 1, sums = codebook)."""
    S = len(codebook_values)
    vq = linattn.VectorQuantizer(1, 1, S, ema_decay=ema_decay, **kw)
    cb = torch.tensor(codebook_values, dtype=torch.float32).reshape(1, S, 1)
    with torch.no_grad():
        vq.codebook.copy_(cb)
        vq.ema_sums.copy_(cb)
        vq.ema_counts.fill_(1.0)
    return vq


def as_keys(values):
    return torch.tensor(values, dtype=torch.float32).reshape(1, 1, -1, 1)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_hat_is_the_code_exactly(dtype):
    vq = linattn.VectorQuantizer(2, 4, 16)
    k = keys(dtype=dtype)
    k_hat, codes, _ = vq(k)
    assert k_hat.dtype == dtype
    assert codes.shape == (2, 2, 9) and codes.dtype == torch.int64
    assert torch.equal(k_hat, lookup(vq.codebook, codes).to(dtype))
    # and with a key that needs gradient (the straight-through branch is active)
    k_hat2, codes2, _ = vq(k.clone().requires_grad_(True))
    assert torch.equal(codes2, codes)
    assert torch.equal(k_hat2.detach(), lookup(vq.codebook, codes).to(dtype))


def test_codes_are_nearest():
    vq = linattn.VectorQuantizer(3, 5, 32)
    k = keys(B=2, H=3, T=20, D=5, seed=1)
    _, codes, _ = vq(k)
    expected = distances64(k, vq.codebook).argmin(-1)
    assert torch.equal(codes, expected)
    assert torch.equal(vq.nearest_codes(k), expected)


@pytest.mark.parametrize("entries", [1, 2 * 3 * 32 * 7])  # one position at a time; pieces of 7 and a rest of 6
def test_codes_are_nearest_when_searched_in_pieces(monkeypatch, entries):
    """The search over a long input goes ``_DISTANCE_ENTRIES`` distances at a time: pieces
    (including a shorter last one) give the nearest codes of every position, in order."""
    import linattn.nn.quantizer as quantizer

    monkeypatch.setattr(quantizer, "_DISTANCE_ENTRIES", entries)
    vq = linattn.VectorQuantizer(3, 5, 32)
    k = keys(B=2, H=3, T=20, D=5, seed=2)
    assert torch.equal(vq.nearest_codes(k), distances64(k, vq.codebook).argmin(-1))


@pytest.mark.parametrize("entries", [1, 32 * 7])  # one row at a time; pieces of 7 rows across the batch boundary
def test_one_head_searches_its_keys_as_rows(monkeypatch, entries):
    """One head: the keys are searched as rows of ``[B T, Dk]`` (here a strided slice of a
    wider projection, as a layer hands them over), pieces crossing from one sequence to the
    next; every position gets its nearest code, in order."""
    import linattn.nn.quantizer as quantizer

    monkeypatch.setattr(quantizer, "_DISTANCE_ENTRIES", entries)
    vq = linattn.VectorQuantizer(1, 5, 32)
    wide = keys(B=2, H=1, T=20, D=12, seed=3)
    k = wide[..., 2:7]
    assert not k.is_contiguous()
    assert torch.equal(vq.nearest_codes(k), distances64(k, vq.codebook).argmin(-1))


@pytest.mark.parametrize("reduction", ["mean", "paper"])
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-6), (F64, 1e-14)])
@pytest.mark.parametrize("H", [1, 2])
def test_commitment_loss_without_gradients(H, dtype, rel, reduction):
    """Without gradients (and without a mask) the loss is one reduction over every entry: it
    equals the formula, for both reductions, in the keys' dtype."""
    vq = linattn.VectorQuantizer(H, 4, 8, commitment_weight=0.25, commitment_reduction=reduction)
    k = keys(B=3, H=H, T=7, seed=6, dtype=dtype)
    with torch.no_grad():
        _, codes, loss = vq(k)
    squared = ((k.to(F64) - lookup(vq.codebook, codes).to(F64)) ** 2).sum(-1)  # [B, H, T]
    expected = 0.25 * (squared.sum() / (3 * 7) if reduction == "paper" else squared.mean())
    assert loss.dtype == dtype
    assert loss.item() == pytest.approx(expected.item(), rel=rel)


def test_straight_through_gradient():
    vq = linattn.VectorQuantizer(2, 4, 16)
    k = keys(seed=2).requires_grad_(True)
    w = torch.randn(k.shape, generator=torch.Generator().manual_seed(3))
    k_hat, _, _ = vq(k)
    (grad,) = torch.autograd.grad((k_hat * w).sum(), k)
    assert torch.equal(grad, w)


def test_commitment_loss_formula():
    beta = 0.25
    vq = linattn.VectorQuantizer(2, 4, 8, commitment_weight=beta)
    k = keys(B=3, T=7, seed=4).requires_grad_(True)
    _, codes, loss = vq(k)
    chosen = lookup(vq.codebook, codes)
    expected = beta * ((k.detach().to(F64) - chosen.to(F64)) ** 2).sum(-1).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    # gradient goes to k only: d loss / dk = beta * 2 (k - c_z) / (B H T)
    (grad,) = torch.autograd.grad(loss, k)
    n = k.shape[0] * k.shape[1] * k.shape[2]
    torch.testing.assert_close(grad, beta * 2 * (k.detach() - chosen) / n, rtol=1e-5, atol=1e-8)
    assert vq.codebook.grad is None


def test_commitment_loss_with_mask():
    beta = 0.5
    vq = linattn.VectorQuantizer(2, 4, 8, commitment_weight=beta)
    k = keys(B=2, T=6, seed=5)
    mask = torch.tensor([[True] * 6, [True, True, True, False, False, False]])
    _, codes, loss = vq(k, mask=mask)
    per_token = ((k.to(F64) - lookup(vq.codebook, codes).to(F64)) ** 2).sum(-1)  # [B, H, T]
    m = mask[:, None, :].expand_as(per_token)
    expected = beta * per_token[m].mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    # padding content does not matter
    k2 = k.clone()
    k2[1, :, 3:] = 1000.0
    _, _, loss2 = vq(k2, mask=mask)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-6)


# ----------------------------------------------------------------------------- EMA update


def test_ema_update_hand_checked():
    # codebook {0, 10}, g = 0.5; keys 1, 2 -> code 0, key 9 -> code 1.
    vq = tiny_quantizer([0.0, 10.0], ema_decay=0.5)
    vq.train()
    _, codes, _ = vq(as_keys([1.0, 2.0, 9.0]))
    assert codes.flatten().tolist() == [0, 0, 1]
    assert torch.equal(vq.codebook.flatten(), torch.tensor([0.0, 10.0])), "forward must not change the codebook"
    vq.update()
    # counts = 0.5*1 + 0.5*[2, 1] = [1.5, 1.0]; sums = 0.5*[0, 10] + 0.5*[3, 9] = [1.5, 9.5]
    assert vq.ema_counts.flatten().tolist() == [1.5, 1.0]
    assert vq.ema_sums.flatten().tolist() == [1.5, 9.5]
    assert vq.codebook.flatten().tolist() == [1.0, 9.5]
    # next step: only code 1 is used (key 9.5): code 0's count and sum decay, value stays.
    vq(as_keys([9.5]))
    vq.update()
    # counts = [0.75, 0.5 + 0.5] ; sums = [0.75, 4.75 + 4.75]
    assert vq.ema_counts.flatten().tolist() == [0.75, 1.0]
    assert vq.codebook.flatten().tolist() == [1.0, 9.5]
    # update() without new statistics does nothing
    before = vq.codebook.clone()
    vq.update()
    assert torch.equal(vq.codebook, before)


NON_FINITE = [float("nan"), float("inf"), -float("inf")]
_EMA = ("codebook", "ema_counts", "ema_sums")


def _ema_state(vq):
    return {name: getattr(vq, name).clone() for name in _EMA}


def _assert_unchanged(vq, before):
    for name, value in before.items():
        assert torch.equal(getattr(vq, name), value), name
        assert torch.isfinite(getattr(vq, name)).all(), name


@pytest.mark.parametrize("bad", NON_FINITE, ids=repr)
def test_update_after_a_non_finite_key_refuses_naming_the_code_and_changes_nothing(bad):
    """A user's own loop (no guard): a NaN or infinite key assigned to a code would make its
    EMA sum, and then the code, non-finite for good. ``update()`` refuses instead: a
    ValueError naming the head and the code, nothing updated (the step's statistics are
    dropped), the codebook finite; the next step updates as if the bad one never was."""
    vq = tiny_quantizer([0.0, 10.0], ema_decay=0.5)
    _, codes, _ = vq(as_keys([1.0, bad, 9.0]))
    before = _ema_state(vq)
    with pytest.raises(ValueError, match=rf"head 0, code {codes.flatten()[1].item()}\b.* not finite"):
        vq.update()
    _assert_unchanged(vq, before)
    vq(as_keys([1.0, 2.0, 9.0]))
    vq.update()
    assert vq.codebook.flatten().tolist() == [1.0, 9.5]  # as in test_ema_update_hand_checked


def test_the_guarded_update_drops_non_finite_statistics_without_a_host_read():
    """The trainer's update (``apply`` given) reads nothing on the host: statistics that are
    not finite are dropped on the device, as a step its guard refused."""
    from _helpers import HostRoundTrips

    vq = tiny_quantizer([0.0, 10.0], ema_decay=0.5, dead_code_threshold=0.6)
    vq(as_keys([1.0, float("nan"), 9.0]))
    before = _ema_state(vq)
    with HostRoundTrips() as trips:
        vq.update(apply=torch.tensor(True))
    assert trips == []
    _assert_unchanged(vq, before)


def test_update_codebooks_names_every_layer_whose_statistics_are_not_finite():
    """``LM.update_codebooks()`` updates every quantizer it can and names, in one error, each
    one whose statistics are not finite (a NaN embedding reaches both units' keys)."""
    torch.manual_seed(0)
    model = linattn.LM(linattn.LMConfig(d_model=16, n_layers=1, gau_d_k=8, codebook_size=4, block_size=4)).train()
    with torch.no_grad():
        model.embed.weight[7] = float("nan")
    model(torch.tensor([[1, 2, 7, 3]]))
    before = [_ema_state(quantizer) for quantizer in model.quantizers()]
    with pytest.raises(ValueError, match=r"^layers\.0\.units\.0\.quantizer: .*\n.*layers\.0\.units\.1\.quantizer: "):
        model.update_codebooks()
    for quantizer, state in zip(model.quantizers(), before):
        _assert_unchanged(quantizer, state)


def test_kmeans_initialisation_refuses_non_finite_keys():
    vq = linattn.VectorQuantizer(1, 1, 2, kmeans_init=True).train()
    with pytest.raises(ValueError, match=r"k holds non-finite values .*k-means initialisation"):
        vq(as_keys([1.0, float("nan"), 2.0]))
    assert vq.initialization_pending() and torch.isfinite(vq.codebook).all()
    padded = torch.tensor([[True, False, True]])  # a padded position's key is not the codebook's
    vq(as_keys([1.0, float("nan"), 2.0]), mask=padded)
    assert not vq.initialization_pending() and sorted(vq.codebook.flatten().tolist()) == [1.0, 2.0]


def test_codebook_uses_count_floor():
    # a code whose count decays below 0.01 is divided by 0.01, not by its count
    vq = tiny_quantizer([0.0, 10.0], ema_decay=0.1)
    for _ in range(3):
        vq(as_keys([0.5]))
        vq.update()
    counts, sums = vq.ema_counts[0, 1].item(), vq.ema_sums[0, 1].item()
    assert counts < 0.01
    assert vq.codebook[0, 1].item() == pytest.approx(sums / 0.01, rel=1e-6)


def test_statistics_accumulate_over_forwards_until_update():
    vq = tiny_quantizer([0.0, 10.0], ema_decay=0.5)
    vq(as_keys([1.0]))
    vq(as_keys([2.0, 9.0]))
    vq.update()
    assert vq.codebook.flatten().tolist() == [1.0, 9.5]


def test_masked_tokens_excluded_from_statistics():
    a = tiny_quantizer([0.0, 10.0], ema_decay=0.5)
    b = copy.deepcopy(a)
    a(as_keys([1.0, 2.0, 9.0]))
    a.update()
    padded = torch.tensor([1.0, 7.0, 2.0, 9.0, 100.0]).reshape(1, 1, 5, 1)
    mask = torch.tensor([[True, False, True, True, False]])
    b(padded, mask=mask)
    b.update()
    assert torch.equal(a.codebook, b.codebook)
    assert torch.equal(a.ema_counts, b.ema_counts)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_update_once_per_step_under_checkpoint(use_reentrant):
    torch.manual_seed(0)
    proj = torch.nn.Linear(4, 2 * 4)
    vq = linattn.VectorQuantizer(2, 4, 6, ema_decay=0.9)
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))

    def block(inp, proj=proj, vq=None):
        k = proj(inp).reshape(2, 5, 2, 4).transpose(1, 2)
        k_hat, _, loss = vq(k)
        return k_hat.pow(2).sum() + loss

    plain_proj, plain_vq = copy.deepcopy(proj), copy.deepcopy(vq)
    start = vq.codebook.clone()

    loss = block(x, plain_proj, plain_vq)
    loss.backward()
    plain_vq.update()

    xc = x.clone().requires_grad_(True)
    loss_c = cp.checkpoint(lambda t: block(t, proj, vq), xc, use_reentrant=use_reentrant)
    loss_c.backward()
    vq.update()

    assert not torch.equal(plain_vq.codebook, start), "the step should move the codebook"
    assert torch.equal(vq.codebook, plain_vq.codebook)
    assert torch.equal(vq.ema_counts, plain_vq.ema_counts)


@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
def test_training_forward_after_module_dtype_cast(dtype):
    # model.double() / model.to(bfloat16) casts the buffers; a training step must still work
    # and gather the same statistics (accumulated in float32 or wider).
    ref = tiny_quantizer([0.0, 10.0], ema_decay=0.5)
    vq = copy.deepcopy(ref).to(dtype)
    k = as_keys([1.0, 2.0, 9.0])
    k_hat, codes, _ = vq(k.to(dtype))
    ref(k)
    vq.update()
    ref.update()
    assert codes.flatten().tolist() == [0, 0, 1]
    assert vq.codebook.flatten().tolist() == ref.codebook.flatten().tolist() == [1.0, 9.5]


def test_codebook_is_a_buffer():
    vq = linattn.VectorQuantizer(2, 4, 8)
    params = dict(vq.named_parameters())
    buffers = dict(vq.named_buffers())
    assert "codebook" not in params and all(p is not vq.codebook for p in vq.parameters())
    assert "codebook" in buffers and "codebook" in vq.state_dict()
    assert not vq.codebook.requires_grad
    k = keys(seed=6).requires_grad_(True)
    k_hat, _, loss = vq(k)
    (k_hat.sum() + loss).backward()
    assert vq.codebook.grad is None
    assert k.grad is not None


def test_eval_mode_accumulates_nothing():
    vq = tiny_quantizer([0.0, 10.0], ema_decay=0.5)
    vq.eval()
    before = {n: b.clone() for n, b in vq.named_buffers()}
    vq(as_keys([1.0, 2.0, 9.0]))
    vq.update()
    for n, b in vq.named_buffers():
        assert torch.equal(b, before[n]), f"{n} changed in eval mode"
    # training mode counts even under no_grad: reentrant checkpointing runs the real
    # forward that way (its recomputation, inside backward, is the one that is skipped)
    vq.train()
    with torch.no_grad():
        vq(as_keys([1.0, 2.0, 9.0]))
    vq.update()
    assert not torch.equal(vq.codebook, before["codebook"])


# ----------------------------------------------------------------------------- k-means, dead codes


def clustered(n_clusters=8, per=20, D=3, H=2, seed=7):
    g = torch.Generator().manual_seed(seed)
    centers = 10.0 * torch.randn(H, n_clusters, D, generator=g)
    idx = torch.arange(n_clusters).repeat_interleave(per)
    pts = centers[:, idx] + 0.05 * torch.randn(H, idx.numel(), D, generator=g)  # [H, N, D]
    perm = torch.randperm(idx.numel(), generator=g)
    return pts[:, perm].reshape(H, 4, -1, D).transpose(0, 1).contiguous()  # [4, H, T, D]


def mean_nearest_distance(k, codebook):
    return distances64(k, codebook).min(-1).values.sqrt().mean().item()


def test_kmeans_init_from_first_batch():
    torch.manual_seed(0)
    k = clustered()
    km = linattn.VectorQuantizer(2, 3, 8, kmeans_init=True)
    rnd = linattn.VectorQuantizer(2, 3, 8, kmeans_init=False)
    assert not bool(km.initialized)
    km(k)
    rnd(k)
    assert bool(km.initialized)
    d_km, d_rnd = mean_nearest_distance(k, km.codebook), mean_nearest_distance(k, rnd.codebook)
    assert d_km < 0.1 * d_rnd, (d_km, d_rnd)
    assert torch.equal(km.ema_sums, km.codebook)
    # only the first batch initialises
    before = km.codebook.clone()
    km(k + 50.0)
    assert torch.equal(km.codebook, before)


def test_set_codes_puts_fitted_codes_and_their_statistics_in_place():
    """``set_codes`` writes the codes, ``ema_counts = counts``, ``ema_sums = codes * counts`` and
    marks the codebook initialized: the next training forward keeps the codes (no k-means)."""
    km = linattn.VectorQuantizer(2, 3, 4, kmeans_init=True)
    codes = torch.arange(24, dtype=torch.float64).reshape(2, 4, 3) / 10
    counts = torch.tensor([[1.0, 2.0, 0.5, 4.0], [3.0, 0.01, 1.0, 2.0]], dtype=torch.float64)
    km.set_codes(codes, counts)
    assert torch.equal(km.codebook, codes.float()) and torch.equal(km.ema_counts, counts.float())
    assert torch.allclose(km.ema_sums, (codes * counts[..., None]).float())
    assert bool(km.initialized) and not km.initialization_pending()
    km(clustered())
    assert torch.equal(km.codebook, codes.float())
    with pytest.raises(ValueError, match=r"codes \[2, 3, 3\] and counts \[2, 4\] must be \[2, 4, 3\] and \[2, 4\]"):
        km.set_codes(codes[:, :3], counts)
    with pytest.raises(ValueError, match="counts must have 2 dimensions"):
        km.set_codes(codes, counts[0])


def test_kmeans_init_not_in_eval_mode():
    km = linattn.VectorQuantizer(2, 3, 8, kmeans_init=True).eval()
    before = km.codebook.clone()
    km(clustered())
    assert not bool(km.initialized)
    assert torch.equal(km.codebook, before)


def test_dead_code_restart_moves_dead_codes_onto_recent_keys():
    torch.manual_seed(0)
    # code 0 sits on the data, codes 1..3 far away and unused: their counts decay to 0.5 < 0.6
    vq = tiny_quantizer([0.0, 100.0, 200.0, 300.0], ema_decay=0.5, dead_code_threshold=0.6)
    batch = as_keys([0.1, -0.2, 0.3, 0.05])
    vq(batch)
    vq.update()
    cb = vq.codebook.flatten()
    recent = set(batch.flatten().tolist())
    for s in (1, 2, 3):
        assert cb[s].item() in recent, f"dead code {s} was not moved onto a recent key: {cb[s].item()}"
        assert vq.ema_counts[0, s].item() >= 0.6
    assert cb[0].item() == pytest.approx((0.5 * 0.0 + 0.5 * 0.25) / (0.5 + 0.5 * 4), rel=1e-6)


def test_no_restart_without_threshold():
    vq = tiny_quantizer([0.0, 100.0], ema_decay=0.5)
    vq(as_keys([0.1, -0.2]))
    vq.update()
    assert vq.codebook[0, 1].item() == pytest.approx(100.0)


# ----------------------------------------------------------------------------- usage


def test_usage_perplexity():
    vq = linattn.VectorQuantizer(2, 1, 4)
    counts = torch.tensor([[4.0, 2.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    with torch.no_grad():
        vq.ema_counts.copy_(counts)
    u = vq.usage()
    p = counts[0] / counts[0].sum()
    expected = math.exp(-(p * p.log()).sum().item())
    assert u["perplexity"][0].item() == pytest.approx(expected, rel=1e-5)
    assert u["perplexity"][1].item() == pytest.approx(4.0, rel=1e-6)
    assert u["dead_codes"].tolist() == [0, 0]
    with torch.no_grad():
        vq.ema_counts.copy_(torch.tensor([[5.0, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 1e-5]]))
    u = vq.usage()
    assert u["perplexity"][0].item() == pytest.approx(1.0, rel=1e-6)
    assert u["dead_codes"].tolist() == [3, 2]


# ----------------------------------------------------------------------------- restart statistics, threshold


def test_restart_moves_statistics_with_the_code():
    # codes {25, 1000}, g = 1/2, threshold 0.6: keys 10..40 all go to code 0, code 1's count
    # decays to 0.5 and it is restarted onto one of them, r. The next EMA step must start
    # from r with count 1 (not from code 1's old sum 0.5 * 1000 and count 0.5).
    torch.manual_seed(0)
    g = 0.5
    vq = tiny_quantizer([25.0, 1000.0], ema_decay=g, dead_code_threshold=0.6)
    first = [10.0, 20.0, 30.0, 40.0]
    vq(as_keys(first))
    vq.update()
    r = vq.codebook[0, 1].item()
    assert r in first, f"code 1 was not restarted onto a key of the batch: {r}"
    count0, sum0 = g * 1.0 + (1 - g) * 4, g * 25.0 + (1 - g) * sum(first)  # code 0 after step 1
    # step 2: two keys near r (nearer to r than to code 0 at 25), one near code 0
    second = [r + 1.0, r + 2.0, 25.5]
    _, codes, _ = vq(as_keys(second))
    assert codes.flatten().tolist() == [1, 1, 0]
    vq.update()
    count1 = g * 1.0 + (1 - g) * 2  # restarted: count 1, sum r
    sum1 = g * r + (1 - g) * (second[0] + second[1])
    expected_counts = [g * count0 + (1 - g) * 1, count1]
    expected_codes = [(g * sum0 + (1 - g) * second[2]) / expected_counts[0], sum1 / count1]
    assert vq.ema_counts.flatten().tolist() == pytest.approx(expected_counts, rel=1e-7)
    assert vq.ema_sums[0, 1, 0].item() == pytest.approx(sum1, rel=1e-7)
    assert vq.codebook.flatten().tolist() == pytest.approx(expected_codes, rel=1e-6)


def test_restart_threshold_is_strict():
    # g = 1/2 and threshold 1/2: unused code 1 (count 1) decays to exactly 0.5 and stays,
    # unused code 2 (count just below 1) decays to just below 0.5 and is restarted.
    torch.manual_seed(0)
    below = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()  # float32
    vq = tiny_quantizer([0.0, 100.0, 200.0], ema_decay=0.5, dead_code_threshold=0.5)
    with torch.no_grad():
        vq.ema_counts.copy_(torch.tensor([[1.0, 1.0, below]]))
        vq.ema_sums.copy_(vq.codebook * vq.ema_counts.unsqueeze(-1))
    batch = [0.125, -0.25, 0.375, 0.0625]
    vq(as_keys(batch))
    vq.update()
    assert vq.ema_counts[0, 1].item() == 0.5, "the boundary case must be exact"
    assert vq.codebook[0, 1].item() == 100.0, "a count equal to the threshold is not restarted"
    assert vq.codebook[0, 2].item() in batch, "a count below the threshold is restarted"
    assert vq.ema_counts[0, 2].item() == 1.0
    # usage() counts dead codes with the same strict comparison
    with torch.no_grad():
        vq.ema_counts.copy_(torch.tensor([[1.0, 0.5, 0.5 * below]]))
    assert vq.usage()["dead_codes"].tolist() == [1]


# ----------------------------------------------------------------------------- the sync hook


class RecordingSync:
    """A fake collective: records every call; ``"sum"`` adds another rank's tensors,
    ``"broadcast"`` writes rank 0's tensors (None: this process is rank 0)."""

    def __init__(self, other_rank=None, rank0=None):
        self.calls, self.other_rank, self.rank0 = [], other_rank, rank0

    def __call__(self, op, tensors):
        self.calls.append((op, [t.clone() for t in tensors]))
        source = self.other_rank if op == "sum" else self.rank0
        if source is not None:
            for tensor, value in zip(tensors, source):
                if op == "sum":
                    tensor += value
                else:
                    tensor.copy_(value)


def test_update_sums_statistics_over_ranks_through_the_hook():
    # this rank: keys 1, 2 -> code 0, key 9 -> code 1; the other rank: -1 -> code 0, 11 -> code 1
    other = (torch.tensor([[1.0, 1.0]]), torch.tensor([[[-1.0], [11.0]]]))
    sync = RecordingSync(other_rank=other)
    vq = tiny_quantizer([0.0, 10.0], ema_decay=0.5, sync=sync)
    vq(as_keys([1.0, 2.0, 9.0]))
    assert sync.calls == [], "forward must not communicate"
    vq.update()
    assert [op for op, _ in sync.calls] == ["sum"], "one all-reduce per update"
    (counts, sums), = [tensors for _, tensors in sync.calls]
    assert counts.tolist() == [[2.0, 1.0]] and sums.flatten().tolist() == [3.0, 9.0]
    # both ranks' keys: code 0 {1, 2, -1}, code 1 {9, 11}
    counts64 = [0.5 * 1 + 0.5 * 3, 0.5 * 1 + 0.5 * 2]
    sums64 = [0.5 * 0.0 + 0.5 * 2.0, 0.5 * 10.0 + 0.5 * 20.0]
    assert vq.ema_counts.flatten().tolist() == counts64
    assert vq.codebook.flatten().tolist() == [s / c for s, c in zip(sums64, counts64)]
    sync.other_rank = None  # next step: no rank has statistics
    vq.update()  # the collective still runs (every rank takes part), nothing changes
    assert [op for op, _ in sync.calls] == ["sum", "sum"]
    assert vq.ema_counts.flatten().tolist() == counts64


@pytest.mark.parametrize("rank0_restarts", [True, False])
def test_restart_takes_rank0_choice_through_the_hook(rank0_restarts):
    # codes 1 and 2 die on this rank's update; rank 0 drew the keys 7 and 8 for them (or,
    # without keys of its own, restarted nothing)
    values = torch.tensor([[[0.0], [7.0], [8.0]]])
    chosen = torch.tensor([[0.0, 1.0, 1.0]]) if rank0_restarts else torch.zeros(1, 3)
    sync = RecordingSync(rank0=(values, chosen))
    vq = tiny_quantizer([0.0, 100.0, 200.0], ema_decay=0.5, dead_code_threshold=0.6, sync=sync)
    batch = [0.125, -0.25, 0.375, 0.0625]
    vq(as_keys(batch))
    vq.update()
    assert [op for op, _ in sync.calls] == ["sum", "broadcast"]
    local_values, local_chosen = sync.calls[1][1]
    assert local_chosen.tolist() == [[0.0, 1.0, 1.0]]
    assert all(v in batch for v in local_values[0, 1:, 0].tolist()), "this rank proposes its own keys"
    code0 = (0.5 * 0.0 + 0.5 * sum(batch)) / (0.5 + 0.5 * 4)
    if rank0_restarts:
        assert vq.codebook.flatten().tolist() == pytest.approx([code0, 7.0, 8.0], rel=1e-7)
        assert vq.ema_sums.flatten().tolist()[1:] == [7.0, 8.0]
        assert vq.ema_counts.flatten().tolist()[1:] == [1.0, 1.0]
    else:
        assert vq.codebook.flatten().tolist() == pytest.approx([code0, 100.0, 200.0], rel=1e-7)
        assert vq.ema_counts.flatten().tolist()[1:] == [0.5, 0.5]


def test_kmeans_init_takes_rank0_centers_through_the_hook():
    centers = torch.arange(16.0).reshape(2, 8, 1).expand(2, 8, 3).contiguous()
    sync = RecordingSync(rank0=(centers, torch.ones(2, 8)))
    vq = linattn.VectorQuantizer(2, 3, 8, kmeans_init=True, sync=sync)
    vq(clustered())
    assert [op for op, _ in sync.calls] == ["broadcast"]
    assert bool(vq.initialized)
    assert torch.equal(vq.codebook, centers) and torch.equal(vq.ema_sums, centers)
    assert torch.equal(vq.ema_counts, torch.ones(2, 8))


def test_default_sync_without_process_group_is_a_no_op():
    from linattn.nn.codebook import distributed_sync

    t = torch.tensor([1.0, 2.0])
    distributed_sync("sum", [t])
    distributed_sync("broadcast", [t])
    assert t.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="op"):
        distributed_sync("max", [t])


def test_state_dict_keys_are_those_of_earlier_checkpoints():
    vq = linattn.VectorQuantizer(2, 4, 8, kmeans_init=True, dead_code_threshold=0.5)
    assert sorted(vq.state_dict()) == ["codebook", "ema_counts", "ema_sums", "initialized"]


def test_kmeans_keeps_a_center_that_gets_no_keys():
    """Fewer keys than codes: the seeds repeat keys, the repeated centers draw no keys (ties
    go to the first), and a center without keys stays where it is (it is not moved to 0)."""
    keys = torch.tensor([[[1.0, 2.0], [3.0, -1.0]]])  # one head, 2 keys, 4 codes
    centers = linattn.nn.kmeans(keys, 4, iters=3, generator=torch.Generator().manual_seed(0))
    for center in centers[0]:
        assert any(torch.equal(center, key) for key in keys[0]), centers


def test_distinct_keys_as_many_as_codes_become_the_codes():
    keys = torch.tensor([[[0.0, 0.0], [5.0, 5.0], [-5.0, 5.0]]])
    centers = linattn.nn.kmeans(keys, 3, iters=2, generator=torch.Generator().manual_seed(1))
    assert sorted(map(tuple, centers[0].tolist())) == sorted(map(tuple, keys[0].tolist()))


def test_an_ema_decay_of_zero_is_allowed():
    vq = linattn.VectorQuantizer(1, 2, 4, ema_decay=0.0)
    assert vq.ema_decay == 0.0


# ----------------------------------------------------------------------------- mutation gaps (2026-12-01)


def test_kmeans_with_as_many_keys_as_codes_seeds_every_key():
    """N == n_codes: the seeds are the N keys, each once (drawn without repetition), so the
    centers are the keys, whatever the draw and before any iteration."""
    keys = torch.arange(16.0).reshape(1, 8, 2)
    for seed in range(5):
        for iters in (0, 2):
            centers = linattn.nn.kmeans(keys, 8, iters=iters, generator=torch.Generator().manual_seed(seed))
            assert sorted(map(tuple, centers[0].tolist())) == sorted(map(tuple, keys[0].tolist())), (seed, iters)


def test_kmeans_refuses_keys_without_tokens_or_of_the_wrong_rank():
    for bad in (torch.zeros(2, 0, 3), torch.zeros(5, 3), torch.zeros(1, 2, 5, 3)):
        with pytest.raises(ValueError, match=r"keys must have shape \[H, N, D\] with N > 0"):
            linattn.nn.kmeans(bad, 4)


@pytest.mark.parametrize("ema_decay", [1.0, 1.5, -0.1, "0.5", None])
def test_an_ema_decay_outside_zero_to_one_is_refused(ema_decay):
    with pytest.raises(ValueError, match=r"ema_decay must be in \[0, 1\)"):
        linattn.VectorQuantizer(1, 2, 4, ema_decay=ema_decay)


def test_restart_draws_from_the_latest_batch_with_real_tokens():
    """A fully masked batch leaves the restart candidates of the batch before it."""
    torch.manual_seed(0)
    vq = tiny_quantizer([0.0, 100.0], ema_decay=0.5, dead_code_threshold=0.6)
    first = [1.0, 2.0, 3.0]
    vq(as_keys(first))
    vq(as_keys([50.0, 60.0]), mask=torch.zeros(1, 2, dtype=torch.bool))
    vq.update()  # code 1 got no keys: its count decays to 0.5 < 0.6 and it is restarted
    assert vq.codebook[0, 1].item() in first
    assert vq.ema_counts[0, 1].item() == 1.0


def test_quantizer_input_errors_name_the_problem():
    vq = linattn.VectorQuantizer(2, 4, 8)
    with pytest.raises(TypeError, match="floating-point"):
        vq(torch.zeros(1, 2, 3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="floating-point"):
        vq([[[[0.0] * 4] * 3] * 2])
    for shape in ((1, 3, 5, 4), (1, 2, 5, 3), (1, 3, 5, 3), (2, 5, 4)):  # heads, width, both, rank
        with pytest.raises(ValueError, match=r"k has shape .*expected \[B, 2, T, 4\]"):
            vq(torch.zeros(shape))
    k = keys(B=2, H=2, T=5, D=4)
    for mask in (torch.ones(2, 5), torch.ones(2, 4, dtype=torch.bool)):  # float, wrong shape
        with pytest.raises(ValueError, match=r"mask must be a bool tensor \[2, 5\]"):
            vq(k, mask)


# ----------------------------------------------------------------------------- mutation gaps, codebook (2026-12-01b)


def test_default_sync_runs_the_collectives_of_the_default_group(monkeypatch):
    """With a process group, ``"sum"`` all-reduces each tensor and ``"broadcast"`` sends rank
    0's values of each tensor (torch.distributed replaced by a recorder: one process cannot
    run a collective; tests/test_quantizer_distributed.py runs the real one)."""
    from linattn.nn.codebook import distributed_sync

    calls = []
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)

    def all_reduce(tensor, **kw):
        calls.append(("all_reduce", tensor, kw))

    def broadcast(tensor, src, **kw):
        calls.append(("broadcast", tensor, {"src": src, **kw}))

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    a, b = torch.zeros(2), torch.ones(3)
    distributed_sync("sum", [a, b])
    assert [(name, t is x, kw) for (name, t, kw), x in zip(calls, (a, b))] == [("all_reduce", True, {})] * 2
    assert len(calls) == 2
    calls.clear()
    distributed_sync("broadcast", [b, a])
    assert [(name, t is x, kw) for (name, t, kw), x in zip(calls, (b, a))] == [("broadcast", True, {"src": 0})] * 2
    assert len(calls) == 2


def separated_clusters(scale=1.0, per=5, seed=0):
    """``[2, 6 per, 2]`` keys: per head, ``per`` keys within 0.01 of each of 6 centers at least
    15 apart (all coordinates positive), and the ``[2, 6, 2]`` centers."""
    g = torch.Generator().manual_seed(seed)
    base = torch.tensor([[10.0, 10.0], [10.0, 40.0], [40.0, 10.0], [40.0, 40.0], [25.0, 25.0], [60.0, 30.0]])
    centers = torch.stack([base, base + 5.0])
    pts = centers.repeat_interleave(per, dim=1) + 0.01 * torch.randn(2, 6 * per, 2, generator=g)
    return scale * pts, scale * centers


@pytest.mark.parametrize("scale", [1.0, 1e12])
def test_kmeans_plus_plus_seeds_fall_in_distinct_clusters(scale):
    """k-means++ draws each seed after the first with probability proportional to its squared
    distance to the nearest seed so far: with 6 well-separated clusters and 6 codes, a second
    seed in an occupied cluster has probability below 1e-5, so the seeds (iters=0) are one key
    of each cluster, at any magnitude of the keys (uniform random seeds share a cluster with
    probability ~0.97)."""
    keys, centers = separated_clusters(scale)
    for seed in range(4):
        seeds = linattn.nn.kmeans(keys, 6, iters=0, generator=torch.Generator().manual_seed(seed), seeding="kmeans++")
        assert seeds.shape == (2, 6, 2)
        for h in range(2):
            assert any(torch.equal(s, key) for s in seeds[h] for key in keys[h])
            cluster = ((seeds[h].to(F64)[:, None] - centers[h].to(F64)[None]) ** 2).sum(-1).argmin(-1)
            assert sorted(cluster.tolist()) == list(range(6)), (seed, h, cluster)
            assert all(any(torch.equal(s, key) for key in keys[h]) for s in seeds[h])


def test_kmeans_plus_plus_with_fewer_distinct_keys_than_codes():
    """Once every distinct key is a seed (all distances 0) the remaining seeds repeat keys
    uniformly: 3 distinct keys (one twice), 5 codes -> every distinct key is a seed, and every
    seed is a key."""
    keys = torch.tensor([[[0.0, 0.0], [3.0, 1.0], [0.0, 0.0], [-2.0, 5.0]]])
    distinct = {(0.0, 0.0), (3.0, 1.0), (-2.0, 5.0)}
    for seed in range(4):
        seeds = linattn.nn.kmeans(keys, 5, iters=0, generator=torch.Generator().manual_seed(seed), seeding="kmeans++")
        got = [tuple(s) for s in seeds[0].tolist()]
        assert len(got) == 5 and set(got) == distinct, (seed, got)


def test_kmeans_returns_the_nearest_center_of_each_key():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 11, 3, generator=g)
    for seeding in ("random", "kmeans++"):
        centers, assign = linattn.nn.kmeans(keys, 4, iters=2, generator=g, seeding=seeding, return_assignment=True)
        d = ((keys.to(F64)[:, :, None] - centers.to(F64)[:, None]) ** 2).sum(-1)  # [H, N, S]
        assert torch.equal(assign, d.argmin(-1))


def test_codebook_defaults_to_initialized_random_codes():
    cb = linattn.Codebook(2, 3, 4)
    assert bool(cb.initialized) and cb.initialization_pending() is False


@pytest.mark.parametrize("name", ["n_heads", "head_dim", "codebook_size", "kmeans_iters"])
@pytest.mark.parametrize("value", [0, 2.0, True])
def test_codebook_sizes_must_be_positive_ints(name, value):
    args = {"n_heads": 1, "head_dim": 2, "codebook_size": 4, "kmeans_iters": 3}
    args[name] = value
    with pytest.raises(ValueError, match=f"{name} must be a positive int, got {value!r}"):
        linattn.Codebook(args["n_heads"], args["head_dim"], args["codebook_size"], kmeans_iters=args["kmeans_iters"])


def test_init_scale_is_the_standard_deviation_of_the_random_codes():
    torch.manual_seed(0)
    cb = linattn.Codebook(1, 8, 1000, init_scale=4.0)  # 8000 normal draws: std within ~1%
    assert 3.8 < cb.codebook.to(F64).std().item() < 4.2
    assert abs(cb.codebook.to(F64).mean().item()) < 0.2
    assert torch.equal(cb.ema_sums, cb.codebook)


def test_initialization_pending_follows_the_loaded_flag():
    """``load_state_dict`` reads the loaded ``initialized``; on the meta device (a model built
    before its weights) it is read at the first use, once the buffers are real."""
    uninitialized = linattn.Codebook(1, 2, 4, kmeans_init=True).state_dict()
    cb = linattn.Codebook(1, 2, 4)
    cb.load_state_dict(uninitialized)
    assert cb.initialization_pending() is True
    cb.load_state_dict(linattn.Codebook(1, 2, 4).state_dict())
    assert cb.initialization_pending() is False
    with torch.device("meta"):
        lazy = linattn.Codebook(1, 2, 4)
    lazy.load_state_dict({name: t.to("meta") for name, t in uninitialized.items()})  # no host read
    lazy.to_empty(device="cpu")
    with torch.no_grad():
        for name, t in uninitialized.items():
            getattr(lazy, name).copy_(t)
    assert lazy.initialization_pending() is True


def test_restart_after_a_fully_masked_step_draws_from_the_step_before():
    """A rank whose forwards since the last update were all padding proposes the keys of the
    last forward that had real tokens (here the other rank's statistics make the update run)."""
    torch.manual_seed(0)
    sync = RecordingSync()
    vq = tiny_quantizer([0.0, 100.0, 200.0], ema_decay=0.5, dead_code_threshold=0.6, sync=sync)
    first = [1.0, 2.0, 3.0]
    vq(as_keys(first))
    vq.update()  # codes 1 and 2 got no keys: restarted onto keys of `first`, count 1
    sync.other_rank = (torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([[[4.0], [0.0], [0.0]]]))
    vq(as_keys([50.0, 60.0]), mask=torch.zeros(1, 2, dtype=torch.bool))
    vq.update()  # codes 1 and 2 again got no keys (count 1 -> 0.5): restarted
    assert [op for op, _ in sync.calls] == ["sum", "broadcast"] * 2
    for s in (1, 2):
        assert vq.codebook[0, s].item() in first
        assert vq.ema_counts[0, s].item() == 1.0


def test_restart_candidates_are_the_keys_since_the_previous_update():
    """Step 1's keys (30 in [0, 1)) are not candidates of step 2's restart: the codes that
    die in step 2 move onto step 2's keys {-50, -60}."""
    torch.manual_seed(0)
    vq = tiny_quantizer([0.0, 100.0, 200.0, 300.0, 400.0], ema_decay=0.5, dead_code_threshold=0.6)
    step1 = [i / 32 for i in range(30)]
    vq(as_keys(step1))
    vq.update()  # codes 1..4 restarted onto keys of step 1 (count 1)
    step2 = [-50.0, -60.0]
    _, codes, _ = vq(as_keys(step2))
    assert codes[0, 0, 0] == codes[0, 0, 1]  # both go to the lowest code
    vq.update()  # the 3 restarted codes without keys decay to 0.5 and restart again
    values = vq.codebook.flatten().tolist()
    assert not any(v in step1 for v in values), values
    assert sum(v in step2 for v in values) >= 3, values


def test_restart_candidates_are_the_keys_of_every_forward_since_the_update():
    """Two micro-batches before one update: the 11 dead codes draw from both (with one
    batch's keys only, all 11 would come from one side; both sides appear w.p. 1 - 2^-10)."""
    torch.manual_seed(0)
    vq = tiny_quantizer([0.0] + [100.0 * s for s in range(1, 12)], ema_decay=0.5, dead_code_threshold=0.6)
    a, b = [0.125 * i for i in range(1, 7)], [-0.125 * i for i in range(1, 7)]  # exact in float32
    vq(as_keys(a))
    vq(as_keys(b))
    vq.update()
    restarted = vq.codebook.flatten().tolist()[1:]
    assert all(v in a + b for v in restarted), restarted
    assert any(v in a for v in restarted) and any(v in b for v in restarted), restarted


def test_restart_draws_each_heads_codes_from_its_own_keys():
    torch.manual_seed(0)
    vq = linattn.VectorQuantizer(2, 1, 3, ema_decay=0.5, dead_code_threshold=0.6)
    cb = torch.tensor([[0.0, 100.0, 200.0], [0.0, -100.0, -200.0]]).unsqueeze(-1)
    with torch.no_grad():
        vq.codebook.copy_(cb)
        vq.ema_sums.copy_(cb)
        vq.ema_counts.fill_(1.0)
    k = torch.tensor([[0.1, 0.2, 0.3, 0.4], [-1.0, -2.0, -3.0, -4.0]]).reshape(1, 2, 4, 1)
    vq(k)
    vq.update()  # codes 1, 2 of both heads got no keys: restarted
    for h in range(2):
        for s in (1, 2):
            assert vq.codebook[h, s, 0].item() in k[0, h, :, 0].tolist(), (h, s)
            assert vq.ema_counts[h, s].item() == 1.0


def test_kmeans_init_waits_for_a_batch_with_real_tokens():
    torch.manual_seed(0)
    vq = linattn.VectorQuantizer(2, 3, 8, kmeans_init=True)
    before = vq.codebook.clone()
    k = clustered()
    vq(k, mask=torch.zeros(k.shape[0], k.shape[2], dtype=torch.bool))
    assert not bool(vq.initialized) and vq.initialization_pending() is True
    assert torch.equal(vq.codebook, before)
    vq(k)
    assert bool(vq.initialized) and torch.equal(vq.ema_sums, vq.codebook)
    assert mean_nearest_distance(k, vq.codebook) < 0.2 * mean_nearest_distance(k, before)


def test_inside_backward_is_false_while_compiling(monkeypatch):
    """Inside a backward pass (here a tensor hook) ``_inside_backward`` is True eagerly and False
    while torch.compile traces (a compiled graph's recomputation replays no buffer writes, so
    its trace counts statistics once); outside a backward it is False."""
    from linattn.nn import quantizer as quantizer_module

    def in_backward() -> list[bool]:
        seen = []
        x = torch.ones(2, requires_grad=True)
        y = x * 2
        y.register_hook(lambda grad: seen.append(quantizer_module._inside_backward()) or grad)
        y.sum().backward()
        return seen

    assert in_backward() == [True] and not quantizer_module._inside_backward()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert in_backward() == [False]


def test_code_norms_while_compiling_are_recomputed_from_the_codebook(monkeypatch):
    """While torch.compile traces, ``|c_s|^2`` is computed from the codebook each call ``[H, S]``
    (the eager cache keys on storage and version, which a trace cannot read); a codebook written
    through ``.data`` (no version bump) is seen at once."""
    vq = linattn.VectorQuantizer(2, 3, 4)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    vq._code_norms()
    vq.codebook.data.mul_(3.0)
    expected = (vq.codebook.double() ** 2).sum(-1)
    norms = vq._code_norms()
    assert norms.shape == (2, 4)
    torch.testing.assert_close(norms.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "paper"])
def test_commitment_loss_is_computed_in_the_keys_dtype(reduction):
    """float64 keys give a float64 loss equal to the formula to float64 rounding (computed in
    float32 it would be off by ~1e-8 of itself, as the contrasting case shows); float32 keys a
    float32 loss. Masked positions count as the reduction says."""
    torch.manual_seed(7)
    quantizer = linattn.VectorQuantizer(2, 4, 5, commitment_weight=0.3, commitment_reduction=reduction).eval()
    k = torch.randn(2, 2, 7, 4, dtype=F64)
    mask = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
    _, codes, loss = quantizer(k, mask)
    chosen = quantizer.codebook.to(F64)[torch.arange(2)[None, :, None], codes]  # [B, H, T, Dk]
    squared = ((k - chosen) ** 2).sum(-1) * mask[:, None].to(F64)
    expected = 0.3 * (squared.sum() / (2 * 7) if reduction == "paper" else squared.sum() / (mask.sum() * 2))
    assert loss.dtype == F64 and abs(loss.item() - expected.item()) <= 1e-15 * expected.item()
    in_float32 = ((k.float() - chosen.float()) ** 2).sum(-1) * mask[:, None].float()
    in_float32 = 0.3 * (in_float32.sum() / (2 * 7) if reduction == "paper" else in_float32.sum() / (mask.sum() * 2))
    assert abs(in_float32.double().item() - expected.item()) > 1e-15 * expected.item()
    assert quantizer(k.float(), mask)[2].dtype == torch.float32


def test_the_models_commitment_loss_keeps_float64():
    """A float64 model sums its units' float64 commitment losses in float64."""
    torch.manual_seed(8)
    model = linattn.LM(linattn.LMConfig(d_model=16, n_layers=2, gau_d_k=8, codebook_size=8, block_size=4,
                                        commitment_weight=0.5)).double()
    ids = torch.randint(0, 256, (2, 9))
    _, _, aux = model(ids)
    _, _, unit_aux, _ = model._trunk(model.embed(ids), None)
    losses = [a["commit_loss"] for a in unit_aux]
    assert len(losses) == 4 and all(loss.dtype == F64 for loss in losses)
    assert aux["commit_loss"].dtype == F64
    torch.testing.assert_close(aux["commit_loss"], sum(losses), rtol=1e-15, atol=0)
    assert model.float()(ids)[2]["commit_loss"].dtype == torch.float32
