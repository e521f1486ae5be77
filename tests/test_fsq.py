"""Finite scalar quantization of keys (``FSQuantizer``, the ``vq-fsq`` layer) against the FSQ
formulas written here: codes, keys, the implicit codebook, the straight-through gradient;
``vq_attention``'s block form over FSQ keys equals its quadratic form; a ``vq-fsq`` model
decodes token by token as its full pass."""

from __future__ import annotations

import math

import pytest
import torch

import linattn
from _helpers import assert_decodes_as_full_pass
from linattn import FSQuantizer

F64 = torch.float64


def _quantizer(levels=(8, 5, 3, 2), heads=2, dim=6, seed=0) -> FSQuantizer:
    torch.manual_seed(seed)
    return FSQuantizer(heads, dim, levels).double()


def _by_hand(fsq: FSQuantizer, k: torch.Tensor):
    """Codes and quantized keys of ``k [B, H, T, Dk]`` from the paper's formulas, one key at a time."""
    codes = torch.zeros(k.shape[:3], dtype=torch.long)
    keys = torch.zeros_like(k)
    for b, h, t in torch.cartesian_prod(*(torch.arange(n) for n in k.shape[:3])).tolist():
        z = (fsq.w_in[h] @ k[b, h, t]).detach()
        code, radix, point = 0, 1, []
        for i, L in enumerate(fsq.levels):
            half = (1 + 1e-3) * (L - 1) / 2
            offset = 0.5 if L % 2 == 0 else 0.0
            bounded = math.tanh(float(z[i]) + math.atanh(offset / half)) * half - offset
            r = round(bounded)
            assert -(L // 2) <= r <= (L + 1) // 2 - 1
            code += (r + L // 2) * radix
            radix *= L
            point.append(r / (L // 2))
        codes[b, h, t] = code
        keys[b, h, t] = fsq.w_out[h] @ torch.tensor(point, dtype=F64)
    return codes, keys


def test_codes_and_keys_follow_the_formulas():
    fsq = _quantizer()
    k = 2 * torch.randn(2, 2, 5, 6, dtype=F64)
    k_hat, codes, loss = fsq(k)
    want_codes, want_keys = _by_hand(fsq, k)
    assert torch.equal(codes, want_codes)
    torch.testing.assert_close(k_hat, want_keys, rtol=1e-12, atol=1e-12)
    assert float(loss) == 0.0
    looked_up = fsq.codebook[torch.arange(2)[None, :, None], codes]
    assert torch.equal(k_hat, looked_up)  # exactly its codebook row, as vq_attention requires


def test_every_grid_point_is_a_code_and_reachable():
    fsq = _quantizer(levels=(3, 2, 4))
    grid = fsq.grid(F64)
    assert grid.shape == (24, 3) and len({tuple(row.tolist()) for row in grid}) == 24
    k = 20 * torch.randn(4, 2, 2000, 6, dtype=F64)
    _, codes, _ = fsq(k)
    assert codes.min() >= 0 and codes.max() < 24
    assert len(torch.unique(codes)) == 24
    for h in range(2):  # the codebook row of a code is W_out applied to its grid point
        torch.testing.assert_close(fsq.codebook[h], grid @ fsq.w_out[h].T, rtol=1e-12, atol=1e-12)


def test_straight_through_gradient():
    """d k_hat / d k passes the rounding as the identity: the gradient of ``g . k_hat`` w.r.t. k
    is ``W_in^T [(W_out^T g) / radius * h (1 - tanh^2(z + s))]``."""
    fsq = _quantizer(levels=(5, 4))
    k = torch.randn(1, 2, 3, 6, dtype=F64, requires_grad=True)
    g = torch.randn(1, 2, 3, 6, dtype=F64)
    k_hat, _, _ = fsq(k)
    (k_hat * g).sum().backward()
    want = torch.zeros_like(k)
    for h in range(2):
        for t in range(3):
            z = (fsq.w_in[h] @ k[0, h, t]).detach()
            through = fsq.w_out[h].T.detach() @ g[0, h, t]
            factors = []
            for i, L in enumerate(fsq.levels):
                half = (1 + 1e-3) * (L - 1) / 2
                shift = math.atanh((0.5 if L % 2 == 0 else 0.0) / half)
                factors.append(half * (1 - math.tanh(float(z[i]) + shift) ** 2) / (L // 2))
            want[0, h, t] = fsq.w_in[h].detach().T @ (through * torch.tensor(factors, dtype=F64))
    torch.testing.assert_close(k.grad, want, rtol=1e-10, atol=1e-12)
    _, want_keys = _by_hand(fsq, k.detach())  # W_out's gradient is taken at the rounded grid point z^
    points = torch.linalg.lstsq(fsq.w_out.detach(), want_keys.transpose(-1, -2)[0]).solution  # [H, d, T]
    want_w_out = torch.einsum("htk,hdt->hkd", g[0], points)
    torch.testing.assert_close(fsq.w_out.grad, want_w_out, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("T", [1, 9, 21])
def test_vq_attention_block_form_over_fsq_keys_equals_the_reference(T):
    fsq = _quantizer(levels=(4, 3, 2), heads=2, dim=4)
    g = torch.Generator().manual_seed(T)
    q = torch.randn(2, 4, T, 4, generator=g, dtype=F64)
    k = torch.randn(2, 2, T, 4, generator=g, dtype=F64)
    v = torch.randn(2, 2, T, 3, generator=g, dtype=F64)
    k_hat, codes, _ = fsq(k)
    block, _ = linattn.vq_attention(q, k_hat, v, codes, fsq.codebook, block_size=4)  # checks k_hat == codebook[codes]
    reference, _ = linattn.vq_attention(q, k_hat, v, codes, fsq.codebook, block_size=4, mode="parallel")
    torch.testing.assert_close(block, reference, rtol=1e-10, atol=1e-12)


def test_vq_fsq_model_decodes_as_its_full_pass_and_trains():
    config = linattn.LMConfig(d_model=16, n_layers=2, attention="vq-fsq", gau_d_k=8, block_size=4, fsq_levels=(4, 3, 3))
    torch.manual_seed(0)
    model = linattn.LM(config).double().eval()
    ids = torch.randint(0, 256, (2, 14))
    assert_decodes_as_full_pass(model, ids, prefill=5)
    model.train()
    logits, _, aux = model(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    w_in = model.layers[0].units[0].quantizer.w_in
    assert w_in.grad is not None and w_in.grad.abs().sum() > 0  # the keys' projections learn through the rounding
    assert float(aux["commit_loss"]) == 0.0


def test_cached_codebook_follows_the_weights():
    fsq = _quantizer()
    with torch.no_grad():
        before = fsq.codebook
        assert fsq.codebook is before  # computed once while nothing changes
        fsq.w_out.add_(1.0)
        torch.testing.assert_close(fsq.codebook, fsq._codebook(), rtol=0, atol=0)


def test_mode_switch_keeps_an_unchanged_codebook_and_reads_a_changed_one():
    """``train()``/``eval()`` have the codebook computed again (a write through ``.data`` bumps no
    version): the same tensor comes back while its values are unchanged, a new one after a write."""
    fsq = _quantizer()
    with torch.no_grad():
        before = fsq.codebook
        fsq.eval()
        fsq.train()
        assert fsq.codebook is before
        fsq.w_out.data.mul_(2.0)
        fsq.eval()
        after = fsq.codebook
    assert after is not before
    torch.testing.assert_close(after, fsq._codebook().detach(), rtol=0, atol=0)
    torch.testing.assert_close(after, 2.0 * before, rtol=0, atol=0)


def test_prompt_state_keys_stay_codebook_rows_across_eval():
    """A prompt's state, continued after ``eval()`` (as ``LM.generate`` calls it), still knows its
    keys are rows of the codebook: the decoding step scores the codebook once, not every key."""
    config = linattn.LMConfig(d_model=16, n_layers=1, attention="vq-fsq", gau_d_k=8, block_size=4, fsq_levels=(4, 3))
    torch.manual_seed(0)
    model = linattn.LM(config).eval()
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        _, state, _ = model(ids[:, :6])
        model.eval()
        _, state, _ = model(ids[:, 6:], state)
    assert all(unit_state._keys_from is not None for unit_state in state.layers[0])


def test_vq_fsq_model_generates_under_inference_mode():
    """Serving engines (vLLM) run models under torch.inference_mode: the cached codebook, whose
    version decoding reads, must not be an inference tensor there."""
    config = linattn.LMConfig(d_model=16, n_layers=1, attention="vq-fsq", gau_d_k=8, block_size=4, fsq_levels=(4, 3))
    torch.manual_seed(0)
    model = linattn.LM(config).eval()
    prompt = torch.randint(0, 256, (6,))
    expected = list(model.generate(prompt, 9, temperature=0))
    torch.manual_seed(0)
    model = linattn.LM(config).eval()  # a fresh model: no codebook cached before
    with torch.inference_mode():
        assert list(model.generate(prompt, 9, temperature=0)) == expected


def test_initial_keys_are_as_large_as_the_keys():
    """With keys of typical coordinate size ``init_scale``, the initial projections give ``k^``
    of the same order (neither vanishing nor blown up by the number of levels)."""
    torch.manual_seed(0)
    fsq = FSQuantizer(1, 64, (8, 5, 5, 5), init_scale=64 ** -0.25)
    k = torch.randn(4, 1, 256, 64) * 64 ** -0.25
    with torch.no_grad():
        k_hat, _, _ = fsq(k)
    ratio = float(k_hat.pow(2).mean().sqrt() / k.pow(2).mean().sqrt())
    assert 0.2 < ratio < 1.0, ratio


def test_module_plumbing():
    """Only the projections are state (the grid is derived); levels may come as a list (TOML,
    JSON); ``grid`` honours the dtype asked for; ``train()`` puts the module in training mode."""
    fsq = _quantizer()
    assert set(fsq.state_dict()) == {"w_in", "w_out"}
    assert FSQuantizer(1, 4, [4, 3]).levels == (4, 3)
    assert linattn.LMConfig.from_dict({"attention": "vq-fsq", "fsq_levels": [4, 3]}).fsq_levels == (4, 3)
    assert fsq.grid(torch.float32).dtype == torch.float32 and fsq.grid().dtype == F64
    fsq.eval()
    assert fsq.train().training


@pytest.mark.parametrize("levels", [(), (1, 4), (4, 2.5), "845", (True, 3)])
def test_bad_levels_are_refused(levels):
    with pytest.raises(ValueError, match="levels"):
        FSQuantizer(1, 4, levels)
    with pytest.raises(ValueError, match="fsq_levels"):
        linattn.LMConfig(attention="vq-fsq", fsq_levels=levels)


def test_bad_key_shape_is_refused():
    with pytest.raises(ValueError, match=r"expected \[B, 2, T, 6\]"):
        _quantizer()(torch.randn(1, 3, 2, 6, dtype=F64))
