"""Transformer-VQ as the official code trains it: the paper GAU parameterisation, the paper
commitment-loss reduction and the LM preset, against formulas written out here."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from linattn import LM, LMConfig, VectorQuantizer
from linattn.nn import GAU

F64 = torch.float64
torch.set_num_threads(1)


def _sinusoids(length: int, width: int, lam: float) -> torch.Tensor:
    """The official relative encodings (``get_sinusoid_embs`` with wavelength ``pe_lam = lam``):
    positions t, ``inv_lams = 1 / lam^(arange(0, width, 2) / width)``, ``pre = t inv_lams``,
    ``[sin(pre), cos(pre)]``."""
    inv_lams = 1.0 / (lam ** (torch.arange(0, width, 2, dtype=F64) / width))
    pre = torch.arange(length, dtype=F64)[:, None] * inv_lams[None, :]
    return torch.cat([pre.sin(), pre.cos()], dim=-1)


def _paper_gau_reference(unit: GAU, x: torch.Tensor, lam: float) -> torch.Tensor:
    """The official GAU with exact causal softmax, for T <= L + 1 (every offset in the window):
    x~ = rms(x) g + b; q, k = rms(W x~) d_k^-1/4; r = d_k^-1/4 W_r R (wavelength ``lam``); u, w
    scaled by d_k^-1/4; s_ij = (q_i + u).k_j + (q_i + w).r_{i-j};  y = W_o((softmax(s) v) * g)."""
    d_k = unit.d_k
    s = d_k ** -0.25
    rms = lambda t, eps: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)  # noqa: E731
    xt = rms(x, 1e-6) * unit.norm.weight + unit.norm.bias
    q = rms(xt @ unit.w_q.weight.T, 1e-6) * s
    k = rms(xt @ unit.w_k.weight.T, 1e-6) * s
    v, g = F.silu(xt @ unit.w_v.weight.T), F.silu(xt @ unit.w_g.weight.T)
    T = x.shape[1]
    sinusoids = _sinusoids(unit.block_size + 1, x.shape[-1], lam).float().double()  # the layer keeps R in float32
    r = (sinusoids @ unit.w_r.weight.T) * s  # [L + 1, d_k]
    u, w = unit.content_bias * s, unit.position_bias * s
    scores = torch.full((x.shape[0], T, T), float("-inf"), dtype=F64)
    for i in range(T):
        for j in range(i + 1):
            scores[:, i, j] = ((q[:, i] + u) * k[:, j]).sum(-1) + ((q[:, i] + w) * r[i - j]).sum(-1)
    out = torch.softmax(scores, -1) @ v
    return (out * g) @ unit.w_o.weight.T


def _randomised(unit: GAU) -> GAU:
    with torch.no_grad():
        for parameter in unit.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return unit


def test_paper_gau_equals_the_official_formula():
    """At the official default wavelength 1e5 (the paper variant's); 1e4 (linattn's, and
    every GAU's before ``sinusoid_wavelength``) gives another output."""
    torch.manual_seed(0)
    unit = _randomised(GAU(12, d_k=8, d_v=10, block_size=6, attention="softmax", variant="paper")).double().eval()
    x = torch.randn(2, 7, 12, dtype=F64)
    y, _, _ = unit(x)
    expected = _paper_gau_reference(unit, x, 1e5)
    assert torch.allclose(y, expected, rtol=1e-10, atol=1e-12)
    assert (y - _paper_gau_reference(unit, x, 1e4)).abs().max() > 1e-3
    ours = GAU(12, d_k=8, d_v=10, block_size=6, attention="softmax").double().eval()
    assert ours.w_r.weight.shape == (8, 8) and unit.w_r.weight.shape == (8, 12)
    assert "bias" in dict(unit.norm.named_parameters()) and not hasattr(ours.norm, "bias")


def test_paper_vq_gau_decodes_like_its_full_pass_and_equals_its_softmax_twin_before_any_cache():
    torch.manual_seed(1)
    vq = _randomised(GAU(12, d_k=8, d_v=10, block_size=4, codebook_size=6, variant="paper")).double().eval()
    x = torch.randn(2, 11, 12, dtype=F64)
    full, _, _ = vq(x)
    state, pieces = None, []
    for t in range(11):
        y, state, _ = vq(x[:, t : t + 1], state)
        pieces.append(y)
    assert torch.allclose(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-12)


def test_sinusoid_dropout_acts_in_training_only():
    torch.manual_seed(2)
    unit = _randomised(GAU(12, d_k=8, d_v=10, block_size=4, attention="softmax", variant="paper",
                           sinusoid_dropout=0.5)).double()
    x = torch.randn(1, 5, 12, dtype=F64)
    unit.train()
    first, second = unit(x)[0], unit(x)[0]
    assert not torch.allclose(first, second)
    torch.manual_seed(3)
    again = unit(x)[0]
    torch.manual_seed(3)
    assert torch.equal(unit(x)[0], again)
    unit.eval()
    with torch.no_grad():
        assert torch.equal(unit(x)[0], unit(x)[0])
    expected = _paper_gau_reference(unit, x, 1e5)
    assert torch.allclose(unit(x)[0], expected, rtol=1e-10, atol=1e-12)


def test_paper_commitment_reduction_is_the_official_l_commit():
    torch.manual_seed(4)
    quantizer = VectorQuantizer(3, 4, 5, commitment_weight=0.7, commitment_reduction="paper").double()
    quantizer.train(False)
    k = torch.randn(2, 3, 6, 4, dtype=F64)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    _, codes, loss = quantizer(k, mask)
    # official: errs2 = min_s |k - c_s|^2 [B, H, L]; l_commit = mean_{B, L}(sum_H mask * errs2)
    codebook = quantizer.codebook.double()
    errs2 = ((k[:, :, :, None, :] - codebook[None, :, None]) ** 2).sum(-1).min(-1).values
    official = (mask[:, None].double() * errs2).sum(1).mean()
    assert torch.allclose(loss.double(), 0.7 * official, rtol=1e-6)
    ours = VectorQuantizer(3, 4, 5, commitment_weight=0.7).double().train(False)
    ours.load_state_dict(quantizer.state_dict())
    mean_loss = ours(k, mask)[2]
    assert torch.allclose(mean_loss.double(), 0.7 * (mask[:, None].double() * errs2).sum() / (mask.sum() * 3),
                          rtol=1e-6)
    with pytest.raises(ValueError, match="commitment_reduction must be one of 'mean', 'paper'; got 'sum'"):
        VectorQuantizer(3, 4, 5, commitment_reduction="sum")


def test_lm_preset_selects_every_paper_setting():
    config = LMConfig(d_model=16, n_layers=1, gau_d_k=8, codebook_size=8, block_size=4, gau_variant="paper")
    assert config.gau_options() == dict(variant="paper", sinusoid_dropout=0.2, sinusoid_wavelength=1e5,
                                        grad_scope="state", commitment_reduction="paper")
    unit = LM(config).layers[0].units[0]
    assert (unit.variant, unit.grad_scope, unit.sinusoid_dropout, unit.sinusoid_wavelength) == ("paper", "state",
                                                                                                0.2, 1e5)
    assert unit.quantizer.commitment_reduction == "paper"
    mixed = LMConfig(d_model=16, n_layers=1, gau_d_k=8, gau_variant="paper", vq_grad_scope="none",
                     sinusoid_dropout=0.0, sinusoid_wavelength=1e4)
    assert mixed.gau_options()["grad_scope"] == "none" and mixed.gau_options()["sinusoid_dropout"] == 0.0
    assert LM(mixed).layers[0].units[1].sinusoid_wavelength == 1e4
    assert LMConfig().gau_options() == dict(variant="linattn", sinusoid_dropout=0.0, sinusoid_wavelength=1e4,
                                            grad_scope="cache", commitment_reduction="mean")
    assert LMConfig(sinusoid_wavelength=2e4).gau_options()["sinusoid_wavelength"] == 2e4
    for field, value in (("gau_variant", "official"), ("vq_grad_scope", "all"), ("commitment_reduction", "sum"),
                         ("sinusoid_dropout", 1.0), ("sinusoid_wavelength", 0.0), ("sinusoid_wavelength", -1e5),
                         ("sinusoid_wavelength", float("inf")), ("sinusoid_wavelength", "1e5")):
        with pytest.raises(ValueError, match=f"LMConfig.{field} must be"):
            LMConfig(**{field: value})


def test_the_paper_lm_equals_the_official_formula_at_its_wavelength():
    """A paper-preset LM's first unit, with the whole preset (dropout off in eval mode), against
    the official GAU formula at pe_lam = 1e5."""
    torch.manual_seed(6)
    config = LMConfig(d_model=12, n_layers=1, attention="gau-softmax", gau_d_k=8, gau_d_v=10, block_size=6,
                      gau_variant="paper")
    unit = _randomised(LM(config).layers[0].units[0]).double().eval()
    x = torch.randn(2, 7, 12, dtype=F64)
    with torch.no_grad():
        assert torch.allclose(unit(x)[0], _paper_gau_reference(unit, x, 1e5), rtol=1e-10, atol=1e-12)


def test_models_saved_before_the_wavelength_existed_load_with_the_wavelength_they_had(tmp_path):
    """A checkpoint or an export whose config has no ``sinusoid_wavelength`` was written when
    every GAU used 1e4, the paper variant's too: it loads with 1e4, exactly as it was trained;
    a config saved now records None (the variant's value: 1e5 for paper)."""
    from linattn.hf import LinattnConfig
    from linattn.train.checkpoint import load_model, save_checkpoint

    config = LMConfig(d_model=16, n_layers=1, gau_d_k=8, codebook_size=8, block_size=4, gau_variant="paper")
    saved_before = config.to_dict()
    del saved_before["sinusoid_wavelength"]
    save_checkpoint(tmp_path / "run", step=1, model_tensors=LM(config).state_dict(),
                    optimizer_state={"state": {}, "param_groups": []}, rng={}, carries=[],
                    meta={"model_config": saved_before})
    model, _ = load_model(tmp_path / "run")
    assert model.config.sinusoid_wavelength == 1e4
    assert {unit.sinusoid_wavelength for unit in model.layers[0].units} == {1e4}
    assert config.to_dict()["sinusoid_wavelength"] is None
    assert LMConfig.from_saved(config.to_dict()).gau_options()["sinusoid_wavelength"] == 1e5

    LinattnConfig.from_lm_config(config).save_pretrained(tmp_path / "new")
    assert LinattnConfig.from_pretrained(tmp_path / "new").to_lm_config().gau_options()["sinusoid_wavelength"] == 1e5
    LinattnConfig.from_lm_config(config).save_pretrained(tmp_path / "old")
    path = tmp_path / "old" / "config.json"
    values = json.loads(path.read_text())
    del values["sinusoid_wavelength"]
    path.write_text(json.dumps(values))
    assert LinattnConfig.from_pretrained(tmp_path / "old").sinusoid_wavelength == 1e4


def test_paper_lm_trains_and_decodes_like_its_full_pass():
    torch.manual_seed(5)
    config = LMConfig(d_model=16, n_layers=2, gau_d_k=8, codebook_size=8, block_size=4, gau_variant="paper")
    model = LM(config).double()
    ids = torch.randint(0, 256, (2, 13))
    logits, _, aux = model(ids)
    (F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()) + aux["commit_loss"]).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "norm.bias" in n)
    model.eval()
    with torch.no_grad():
        full = model(ids)[0]
        state, steps = None, []
        for t in range(13):
            out, state, _ = model(ids[:, t : t + 1], state)
            steps.append(out)
    assert torch.allclose(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
