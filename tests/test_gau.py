"""The GAU layer of Transformer-VQ (docs/design.md, section 4): decoding equals the full pass,
the softmax twin equals VQ when the codebook holds every key, causality, shapes, no
projection biases, the auxiliary commitment loss, input validation."""

from __future__ import annotations

import pytest
import torch

from linattn.nn import GAU

F64 = torch.float64
ATTENTIONS = ["vq", "soft-vq", "softmax"]


def make_gau(attention, d_model=8, d_k=8, codebook_size=16, block_size=4, seed=0, **kw):
    torch.manual_seed(seed)
    gau = GAU(d_model, d_k=d_k, codebook_size=codebook_size, block_size=block_size, attention=attention, **kw)
    with torch.no_grad():  # non-zero relative-position biases so they are exercised
        gau.content_bias.normal_(0, 0.3)
        gau.position_bias.normal_(0, 0.3)
    return gau.double().eval()


def make_x(B=2, T=19, d_model=8, seed=1):
    return torch.randn(B, T, d_model, generator=torch.Generator().manual_seed(seed), dtype=F64)


def close(a, b, rtol=1e-10, name=""):
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    assert a.shape == b.shape, name
    assert err <= rtol * max(scale, 1e-30), f"{name}: error {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_decoding_equals_full_pass(attention):
    gau = make_gau(attention, temperature=0.5)
    x = make_x()
    T = x.shape[1]
    with torch.no_grad():
        full, full_state, _ = gau(x)
        state, outs = None, []
        for t in range(T):
            y, state, _ = gau(x[:, t : t + 1], state)
            outs.append(y)
        close(torch.cat(outs, dim=1), full, name="token by token")
        assert state.steps == T and full_state.steps == T
        state, outs, start = None, [], 0
        for n in (3, 1, 6, 2, 7):
            y, state, _ = gau(x[:, start : start + n], state)
            outs.append(y)
            start += n
        assert start == T
        close(torch.cat(outs, dim=1), full, name="pieces")


def _layer_keys(gau, x):
    """The keys the layer computes: RMS(W_k RMSNorm(x)) * d_k^-1/4 (written out here)."""
    h = gau.norm(x)
    r = gau.w_k(h)
    return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6) * gau.d_k**-0.25


def test_softmax_twin_equals_vq_when_codebook_holds_every_key():
    B, T, S, L = 2, 14, 32, 4  # T > 2L so the cache is used; B*T <= S
    vq = make_gau("vq", codebook_size=S, block_size=L, seed=3)
    twin = make_gau("softmax", codebook_size=S, block_size=L, seed=4)
    twin.load_state_dict({n: t for n, t in vq.state_dict().items() if not n.startswith("quantizer")}, strict=True)
    x = make_x(B=B, T=T, seed=5)
    with torch.no_grad():
        k = _layer_keys(vq, x)  # [B, T, d_k]
        codebook = vq.quantizer.codebook.clone()
        codebook[0, : B * T] = k.reshape(B * T, -1)
        codebook[0, B * T :] = 100.0  # unused codes, far away
        vq.quantizer.codebook.copy_(codebook)
        y_vq, _, aux = vq(x)
        y_twin, _, _ = twin(x)
    assert torch.equal(aux["codes"].reshape(-1), torch.arange(B * T)), "each key should be its own code"
    # the codebook is kept in float32, so the stored keys carry float32 rounding (~1e-8 each:
    # the float64 commitment loss, 1e-4 times a mean squared distance, is ~1e-19)
    assert aux["commit_loss"].dtype == F64 and aux["commit_loss"].item() < 1e-17
    close(y_vq, y_twin, rtol=1e-6, name="vq vs softmax twin")
    # and a different codebook makes them differ (the comparison can fail)
    with torch.no_grad():
        vq.quantizer.codebook[0, : B * T] += 0.05 * torch.randn(B * T, vq.d_k, dtype=F64)
        y_vq2, _, _ = vq(x)
    assert (y_vq2 - y_twin).abs().max() > 1e-6


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_causality(attention):
    gau = make_gau(attention, d_model=4, d_k=4, codebook_size=8, block_size=3, temperature=0.7)
    x = make_x(B=1, T=10, d_model=4, seed=6)

    def fn(inp):
        return gau(inp)[0]

    J = torch.autograd.functional.jacobian(fn, x)  # [B, T, d, B, T, d]
    J = J[0, :, :, 0]  # [T, d, T, d]
    assert J.abs().sum() > 0
    T = x.shape[1]
    for i in range(T):
        assert (J[i, :, i + 1 :] == 0).all(), f"output {i} depends on later inputs ({attention})"
        assert J[i, :, : i + 1].abs().sum() > 0


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_shapes_and_defaults(attention):
    gau = GAU(6, d_k=8, codebook_size=16, block_size=4, attention=attention).double().eval()
    assert gau.d_v == 12
    assert gau.w_v.out_features == 12 and gau.w_g.out_features == 12 and gau.w_o.in_features == 12
    assert gau.w_q.out_features == 8 and gau.w_k.out_features == 8
    x = make_x(B=3, T=9, d_model=6)
    y, state, aux = gau(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert state is not None and state.steps == 9
    if attention == "softmax":  # the quadratic twin keeps every key and value
        assert state.keys.shape == (3, 1, 9, 8) and state.values.shape == (3, 1, 9, 12)
    assert set(aux) >= {"commit_loss", "codes"}
    if attention == "vq":
        assert aux["codes"].shape == (3, 1, 9)
    custom = GAU(6, d_k=8, d_v=5, codebook_size=16, block_size=4, attention=attention)
    assert custom.d_v == 5 and custom.w_v.out_features == 5


def test_default_sizes():
    gau = GAU(16)
    assert gau.d_k == 128 and gau.d_v == 32
    assert gau.quantizer.codebook.shape == (1, 512, 128)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_no_biases_in_linear_layers(attention):
    gau = GAU(6, d_k=8, codebook_size=16, block_size=4, attention=attention)
    linears = [m for m in gau.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) >= 5
    for m in linears:
        assert m.bias is None


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_commit_loss(attention):
    # float32 module in training mode (a float64 cast of the quantizer is covered in test_quantizer)
    torch.manual_seed(0)
    gau = GAU(8, d_k=8, codebook_size=16, block_size=4, attention=attention).train()
    x = make_x().float()
    _, _, aux = gau(x)
    loss = aux["commit_loss"]
    assert loss.dim() == 0
    if attention == "vq":
        assert loss.item() > 0
        assert loss.requires_grad
    else:
        assert loss.item() == 0.0


def test_vq_training_forward_feeds_quantizer_statistics():
    torch.manual_seed(0)
    gau = GAU(8, d_k=8, codebook_size=16, block_size=4, attention="vq").train()
    before = gau.quantizer.codebook.clone()
    gau(make_x().float())
    assert torch.equal(gau.quantizer.codebook, before), "forward must not move the codebook"
    gau.quantizer.update()
    assert not torch.equal(gau.quantizer.codebook, before)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_bad_x_shape(attention):
    gau = make_gau(attention)
    with pytest.raises(ValueError, match="x"):
        gau(torch.zeros(2, 5, 7, dtype=F64))
    with pytest.raises(ValueError, match="x"):
        gau(torch.zeros(5, 8, dtype=F64))


def test_softmax_twin_rejects_a_vq_state():
    vq = make_gau("vq")
    _, state, _ = vq(make_x())
    with pytest.raises(TypeError, match="KVCacheState"):
        make_gau("softmax")(make_x(), state)


def test_bad_attention_name():
    with pytest.raises(ValueError, match="attention"):
        GAU(8, attention="linear")


# ------------------------------------------------------------- relative positions, written out


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _set_relative_parameters(gau, seed):
    """Random non-zero u, w and W_r, large enough that (w - u) and (w + u) give different outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        gau.content_bias.copy_(torch.randn(gau.d_k, generator=g, dtype=F64))
        gau.position_bias.copy_(torch.randn(gau.d_k, generator=g, dtype=F64))
        gau.w_r.weight.copy_(torch.randn(gau.d_k, gau.d_k, generator=g, dtype=F64) / gau.d_k**0.5)


def _nearest_codes(k, codebook):
    """argmin_s |k_t - c_s|^2 for keys [B, T, d_k] and a codebook [S, d_k]."""
    return torch.cdist(k, codebook.unsqueeze(0).expand(k.shape[0], -1, -1)).argmin(-1)


def reference_gau(gau, x, *, codebook=None, window=True):
    """The GAU by its formula, in float64, with explicit loops over query and key positions.

    ``h = RMSNorm(x)``; ``q_i = RMS(W_q h_i) d_k^-1/4``, ``k_j = RMS(W_k h_j) d_k^-1/4``,
    ``v_j = SiLU(W_v h_j)``, ``g_i = SiLU(W_g h_i)``. With ``P_d = W_r R_d`` (R the layer's
    sinusoids, d = 0..L, L = block_size) the score of query i on key j <= i is

        s_ij = (q_i + u).k_j + [0 <= i - j <= L] (q_i + w).P_{i-j}

    so a key more than L positions back keeps the content term (with u) and loses the
    position term; keys j > i are masked. Scale 1. ``y_i = W_o((sum_j softmax_j(s_ij) v_j) * g_i)``.
    With ``codebook`` [S, d_k], every k_j is replaced by its nearest code ``c_{z_j}``
    (Transformer-VQ). ``window=False`` applies the position term at every offset instead
    (offsets past L use R_L), a contrast that shows the window matters.
    """
    B, T, _ = x.shape
    L = gau.block_size
    h = gau.norm(x)
    q = _rms(h @ gau.w_q.weight.T) * gau.d_k**-0.25
    k = _rms(h @ gau.w_k.weight.T) * gau.d_k**-0.25
    v = torch.nn.functional.silu(h @ gau.w_v.weight.T)
    gate = torch.nn.functional.silu(h @ gau.w_g.weight.T)
    if codebook is not None:
        k = codebook[_nearest_codes(k, codebook)]
    u, w = gau.content_bias, gau.position_bias
    R = gau.sinusoids.to(F64)
    assert R.shape[0] == L + 1
    out = torch.zeros(B, T, v.shape[-1], dtype=F64)
    for b in range(B):
        for i in range(T):
            scores = torch.empty(i + 1, dtype=F64)
            for j in range(i + 1):
                scores[j] = (q[b, i] + u) @ k[b, j]
                offset = i - j
                if offset <= L or not window:
                    P = gau.w_r.weight @ R[min(offset, L)]
                    scores[j] += (q[b, i] + w) @ P
            out[b, i] = torch.softmax(scores, dim=0) @ v[b, : i + 1]
    return (out * gate) @ gau.w_o.weight.T


def test_softmax_twin_equals_the_transformer_xl_formula():
    gau = make_gau("softmax", block_size=4, seed=7)
    _set_relative_parameters(gau, seed=8)
    x = make_x(B=2, T=13, seed=9)
    assert x.shape[1] > 2 * gau.block_size
    with torch.no_grad():
        y, _, _ = gau(x)
        expected = reference_gau(gau, x)
        without_window = reference_gau(gau, x, window=False)
    close(y, expected, rtol=1e-10, name="softmax GAU vs formula")
    assert (without_window - expected).abs().max() > 1e-4, "T is too short for the window to matter"


def test_vq_gau_equals_the_transformer_xl_formula_on_quantized_keys():
    gau = make_gau("vq", codebook_size=16, block_size=4, seed=10)
    _set_relative_parameters(gau, seed=11)
    x = make_x(B=2, T=15, seed=12)  # > 2 blocks: the cache of older blocks is used
    codebook = gau.quantizer.codebook[0].to(F64)
    with torch.no_grad():
        y, _, aux = gau(x)
        expected = reference_gau(gau, x, codebook=codebook)
        exact_keys = reference_gau(gau, x)
        k = _layer_keys(gau, x)
    assert torch.equal(aux["codes"][:, 0], _nearest_codes(k, codebook))
    assert aux["codes"].unique().numel() > 1
    close(y, expected, rtol=1e-10, name="VQ GAU vs formula on quantized keys")
    assert (exact_keys - expected).abs().max() > 1e-4, "quantization should change the output"


@pytest.mark.parametrize("attention", ["vq", "soft-vq", "softmax"])
def test_the_no_grad_path_equals_the_autograd_path(attention):
    """Without gradients the unit stacks its input maps into one matmul and caches its
    relative terms; with gradients it runs each map on its own. Both must give the same
    outputs (float64), in one pass and token by token, so that the formula tests, which run
    under no_grad, speak for training too."""
    torch.manual_seed(5)
    gau = GAU(8, d_k=8, codebook_size=16, block_size=4, attention=attention).double().eval()
    with torch.no_grad():
        gau.content_bias.normal_()
        gau.position_bias.normal_()
    x = torch.randn(2, 11, 8, dtype=F64)
    trained, _, _ = gau(x)
    assert trained.requires_grad
    with torch.no_grad():
        fast, _, _ = gau(x)
        state, steps = None, []
        for t in range(11):
            y, state, _ = gau(x[:, t : t + 1], state)
            steps.append(y)
    torch.testing.assert_close(fast, trained.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(steps, 1), trained.detach(), rtol=1e-10, atol=1e-12)


def test_sinusoids_are_transformer_xl_relative_encodings():
    """``R[d] = [sin(d f_0), .., sin(d f_{n-1}), cos(d f_0), .., cos(d f_{n-1})]`` with
    ``f_i = lam^(-2i / width)`` for offsets d = 0..L (width d_k; d_model in the paper variant);
    ``lam = sinusoid_wavelength``, by default 1e4 (linattn) or 1e5 (paper, the official pe_lam)."""
    for variant, width, wavelength, lam in (("linattn", 6, None, 1e4), ("paper", 10, None, 1e5),
                                            ("linattn", 6, 1e5, 1e5), ("paper", 10, 1e4, 1e4),
                                            ("linattn", 6, 300.0, 300.0)):
        gau = GAU(10, d_k=6, block_size=20, attention="softmax", variant=variant, sinusoid_wavelength=wavelength)
        offsets = torch.arange(21, dtype=F64)[:, None]
        frequencies = lam ** (-torch.arange(0, width, 2, dtype=F64) / width)
        expected = torch.cat([torch.sin(offsets * frequencies), torch.cos(offsets * frequencies)], dim=-1)
        assert gau.sinusoids.shape == (21, width) and gau.sinusoid_wavelength == lam
        torch.testing.assert_close(gau.sinusoids.double(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("wavelength", [0, -1e4, float("inf"), float("nan"), "1e4", True])
def test_a_wavelength_that_is_not_a_finite_positive_number_is_refused_by_name(wavelength):
    with pytest.raises(ValueError, match="sinusoid_wavelength must be a finite positive number"):
        GAU(8, d_k=8, sinusoid_wavelength=wavelength)


@pytest.mark.parametrize("attention", ["vq", "soft-vq"])
def test_initial_codes_have_the_scale_of_the_keys(attention):
    """Keys are RMS-normalised and scaled by d_k^-1/4, so each entry has rms d_k^-1/4; the
    random initial codebook (quantizer or learned) is drawn at that scale."""
    torch.manual_seed(0)
    d_k = 16
    gau = GAU(8, d_k=d_k, codebook_size=512, attention=attention)
    codebook = gau.quantizer.codebook if attention == "vq" else gau.codebook
    assert codebook.shape == (1, 512, d_k)
    rms = codebook.detach().double().pow(2).mean().sqrt().item()
    assert abs(rms - d_k**-0.25) < 0.05 * d_k**-0.25, rms


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_training_passes_keep_no_graph_in_the_caches(attention):
    """With gradients on, nothing is cached (the no-grad caches hold plain tensors): a second
    backward pass without a parameter update accumulates the same gradients again, and
    the unit can still be deep-copied (a cached graph would refuse both)."""
    import copy

    torch.manual_seed(6)
    gau = GAU(8, d_k=8, codebook_size=16, block_size=4, attention=attention).double().eval()
    x = torch.randn(2, 7, 8, dtype=F64)
    gau(x)[0].sum().backward()
    once = {name: p.grad.clone() for name, p in gau.named_parameters() if p.grad is not None}
    assert {"w_q.weight", "w_r.weight", "position_bias"} <= set(once)
    gau(x)[0].sum().backward()
    for name, p in gau.named_parameters():
        if name in once:
            torch.testing.assert_close(p.grad, 2 * once[name], rtol=1e-12, atol=1e-14, msg=name)
    copied = copy.deepcopy(gau)
    with torch.no_grad():
        torch.testing.assert_close(copied(x)[0], gau(x)[0], rtol=0, atol=0)


def test_entropy_scale_and_sinusoid_dropout_outside_their_range_are_refused_by_name():
    """``scale="entropy"`` is for the exact softmax unit only; ``sinusoid_dropout`` lies in [0, 1)."""
    GAU(8, d_k=8, attention="softmax", scale="entropy")  # the one unit that takes it
    for attention in ("vq", "soft-vq", "fsq"):
        with pytest.raises(ValueError, match="scale='entropy' is for the exact softmax unit"):
            GAU(8, d_k=8, attention=attention, scale="entropy")
    for dropout in (1.0, 1.5, -0.1, "0.5", None):
        with pytest.raises(ValueError, match=r"sinusoid_dropout must be in \[0, 1\)"):
            GAU(8, d_k=8, sinusoid_dropout=dropout)


def test_sinusoids_stay_out_of_the_state_dict_and_are_rebuilt_on_reset():
    """The sinusoids are a function of block size, width and wavelength: not saved, and
    ``_reset_buffers`` (used after a weights-only materialisation) rebuilds all L + 1 offsets."""
    gau = GAU(10, d_k=6, block_size=20, attention="softmax", sinusoid_wavelength=500.0).double()
    assert "sinusoids" not in gau.state_dict()
    gau.sinusoids = torch.zeros(1, 6)
    gau._reset_buffers()
    offsets = torch.arange(21, dtype=F64)[:, None]
    frequencies = 500.0 ** (-torch.arange(0, 6, 2, dtype=F64) / 6)
    expected = torch.cat([torch.sin(offsets * frequencies), torch.cos(offsets * frequencies)], dim=-1)
    assert gau.sinusoids.dtype == F64 and gau.sinusoids.shape == (21, 6)
    torch.testing.assert_close(gau.sinusoids, expected, rtol=0, atol=1e-6)


def test_initial_fsq_projections_have_the_scale_of_the_keys():
    """FSQ's ``init_scale`` is the key scale ``d_k^-1/4``: ``w_in`` has rms ``1 / (d_k^-1/4 sqrt(d_k))``
    (so z is O(1)) and ``w_out`` rms ``d_k^-1/4 / sqrt(d)`` for d = 4 bounded dimensions."""
    torch.manual_seed(0)
    d_k = 256
    gau = GAU(8, d_k=d_k, attention="fsq", fsq_levels=(8, 5, 5, 5))
    key_scale = d_k**-0.25
    for weight, expected in ((gau.quantizer.w_in, 1.0 / (key_scale * d_k**0.5)), (gau.quantizer.w_out, key_scale / 2)):
        rms = weight.detach().double().pow(2).mean().sqrt().item()
        assert abs(rms - expected) < 0.15 * expected, (rms, expected)


def test_entropy_scaled_softmax_unit_decodes_token_by_token_as_in_one_pass():
    """With ``scale="entropy"`` row n of the logits is scaled by log_512(n) (n = position + 1,
    counting the cached tokens): decoding token by token from a cache equals one pass."""
    torch.manual_seed(3)
    gau = GAU(8, d_k=8, block_size=4, attention="softmax", scale="entropy").double().eval()
    x = torch.randn(2, 7, 8, dtype=F64)
    with torch.no_grad():
        full, _, _ = gau(x)
        _, state, _ = gau(x[:, :3])
        rest, _, _ = gau(x[:, 3:5], state)
        steps = []
        for t in range(7):
            y, state, _ = gau(x[:, t : t + 1], None if t == 0 else state)
            steps.append(y)
    assert full.shape == (2, 7, 8)
    torch.testing.assert_close(rest, full[:, 3:5], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-12, atol=1e-12)


def test_relative_terms_are_computed_once_without_gradients_unless_dropout_draws_them(monkeypatch):
    """Without gradients the relative terms are cached, in eval mode (sinusoid dropout is off
    there) and in training mode without dropout; training mode with dropout redraws them each call."""
    import linattn.nn.gau as gau_module

    calls = []
    original = gau_module._compute_relative_terms

    def counting(unit, dtype):
        calls.append(unit.training)
        return original(unit, dtype)

    monkeypatch.setattr(gau_module, "_compute_relative_terms", counting)
    x = torch.randn(1, 3, 8, dtype=F64)
    for dropout, training, expected in ((0.5, False, 1), (0.0, True, 1), (0.0, False, 1), (0.5, True, 2)):
        gau = GAU(8, d_k=8, attention="softmax", variant="paper", sinusoid_dropout=dropout).double().train(training)
        calls.clear()
        with torch.no_grad():
            gau(x)
            gau(x)
        assert len(calls) == expected, (dropout, training, calls)
