"""``linattn inspect``: the row measures on hand-made attention rows with known answers, the
recomputed probabilities against the ops they stand for, the VQ window/cache split, and the
command end to end on a tiny run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

import linattn
from linattn.inspector import _exact_weights, effective_rank, head_summaries, inspect_model, row_measures
from linattn.ops.vq import vq_attention_weights
from test_train_cli import corpus, run_captured, trained  # noqa: F401  (the tiny run fixtures)
from test_vq_attention import make_bias, make_position_keys, make_vq

F64 = torch.float64


def test_measures_of_known_rows():
    rows = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]], dtype=F64)
    got = row_measures(rows, torch.tensor([4, 4, 4]))
    torch.testing.assert_close(got["entropy"], torch.tensor([math.log(4), 0.0, math.log(2)], dtype=F64))
    torch.testing.assert_close(got["hoyer_sparsity"], torch.tensor([0.0, 1.0, 2 - math.sqrt(2)], dtype=F64))
    torch.testing.assert_close(got["entropy_sparsity"], torch.tensor([0.0, 1.0, 0.5], dtype=F64))


def test_effective_rank_of_known_matrices():
    torch.testing.assert_close(effective_rank(torch.eye(5)), torch.tensor(5.0, dtype=F64))
    rank_one = torch.outer(torch.arange(1.0, 4.0), torch.arange(1.0, 6.0))
    torch.testing.assert_close(effective_rank(rank_one), torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(effective_rank(torch.diag(torch.tensor([2.0, 2.0, 0.0]))), torch.tensor(2.0, dtype=F64))


@pytest.mark.parametrize("window", [None, 3])
def test_exact_weights_are_what_the_op_applies(window):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 9, 8, generator=g, dtype=F64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped key/value heads
    weights = _exact_weights(q, k, None, window)
    if window is None:
        want = linattn.softmax_attention(q, k, v, causal=True)
    else:
        want, _ = linattn.local_attention(q, k, v, window=window)
    torch.testing.assert_close(weights @ v.repeat_interleave(2, dim=1), want, rtol=1e-12, atol=1e-12)


def test_vq_weights_are_what_the_block_form_computes():
    q, k_hat, v, codes, codebook = make_vq(T=13, Dk=4, seed=4)
    kw = dict(block_size=4, bias=make_bias(4, 4), position_keys=make_position_keys(4, 4, 4))
    weights = vq_attention_weights(q, k_hat, **kw)
    out, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, **kw)  # the linear-time form
    torch.testing.assert_close(weights @ v.repeat_interleave(2, dim=1), out, rtol=1e-10, atol=1e-12)


def test_window_and_cache_mass_of_uniform_rows():
    """Uniform causal rows: query t (t >= 2L) puts (t - L (t // L - 1) + 1) / (t + 1) of its mass
    on its own and the previous block."""
    T, L = 20, 4
    weights = torch.tril(torch.ones(T, T, dtype=F64))
    weights = (weights / weights.sum(-1, keepdim=True)).unsqueeze(0)
    head = head_summaries(weights, "vq", block_size=L)[0]
    want = sum((t - L * (t // L - 1) + 1) / (t + 1) for t in range(2 * L, T)) / (T - 2 * L)
    assert head["window_mass"] == pytest.approx(want, rel=1e-12)
    assert head["cache_mass"] == pytest.approx(1 - want, rel=1e-12)
    assert head["entropy_sparsity"] == pytest.approx(0.0, abs=1e-12)  # uniform rows
    assert list(head["entropy_by_position"]) == ["1-1", "2-3", "4-7", "8-15", "16-19"]
    assert head["entropy_by_position"]["4-7"] == pytest.approx(sum(math.log(t + 1) for t in range(4, 8)) / 4)


def test_every_layer_kind_is_reported():
    config = linattn.LMConfig(d_model=16, n_layers=7, n_heads=2, gau_d_k=8, block_size=4, codebook_size=8,
                              attention="softmax,local:4,vq,gau-softmax,linear:elu,delta,vq-fsq", fsq_levels=(3, 3))
    torch.manual_seed(0)
    entries = inspect_model(linattn.LM(config), torch.randint(0, 256, (1, 30)))
    kinds = {entry["module"]: entry["kind"] for entry in entries}
    assert kinds == {"layers.0.mixer": "softmax", "layers.1.mixer": "local", "layers.2.units.0": "vq",
                     "layers.2.units.1": "vq", "layers.3.units.0": "gau-softmax", "layers.3.units.1": "gau-softmax",
                     "layers.4.mixer": "linear", "layers.5.mixer": "delta", "layers.6.units.0": "vq-fsq",
                     "layers.6.units.1": "vq-fsq"}
    by_name = {entry["module"]: entry for entry in entries}
    assert len(by_name["layers.0.mixer"]["heads"]) == 2 and len(by_name["layers.2.units.0"]["heads"]) == 1
    assert "window_mass" in by_name["layers.2.units.0"]["heads"][0]
    assert len(by_name["layers.4.mixer"]["effective_rank"]) == 2
    codes = by_name["layers.6.units.0"]["codes"]
    assert codes["codebook_size"] == 9 and 1 <= codes["perplexity"] <= 9


def test_inspect_command_end_to_end(trained, tmp_path):  # noqa: F811
    run, code, _, _ = trained
    assert code == 0
    out = tmp_path / "inspect"
    code, stdout, stderr = run_captured(["inspect", "--ckpt", str(run), "--tokens", "64", "--out", str(out)])
    assert code == 0, stderr
    document = json.loads((out / "inspect.json").read_text())
    assert {row["kind"] for row in document["rows"]} == {"vq", "local"}
    assert "layers.0.units.0" in (out / "inspect.md").read_text() and "entropy" in stdout
    for name in ("entropy.png", "mass.png"):
        with Image.open(out / name) as image:
            assert image.size[0] > 100
    code, _, stderr = run_captured(["inspect", "--ckpt", str(run), "--tokens", "0", "--out", str(out)])
    assert code == 2
