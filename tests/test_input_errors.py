"""Bad values are refused where they enter, with a message naming the argument (docs/design.md,
section 2): op entry, module and config construction, command-line parsing."""

from __future__ import annotations

import pytest
import torch

import linattn
from _helpers import make_qkv
from linattn.cli import main
from linattn.train import TrainConfig


@pytest.mark.parametrize("eps", [-1, float("nan"), float("inf"), "1e-6", True])
def test_linear_attention_eps_must_be_a_finite_number_at_least_zero(eps):
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=5, Dk=4, Dv=3)
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        linattn.linear_attention(q, k, v, eps=eps)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_delta_rule_beta_outside_zero_one_is_refused(bad, mode):
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=6, Dk=4, Dv=3)
    beta = torch.full((1, 1, 6), 0.5, dtype=q.dtype)
    beta[0, 0, 4] = bad
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):
        linattn.delta_rule(q, k, v, beta, mode=mode)


def test_delta_rule_accepts_the_ends_of_the_range():
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=6, Dk=4, Dv=3)
    beta = torch.tensor([[[0.0, 1.0, 0.5, 1.0, 0.0, 0.25]]], dtype=q.dtype)
    out, _ = linattn.delta_rule(q, k, v, beta)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("field, value", [("codebook_size", 0), ("n_heads", 0), ("head_dim", -2),
                                          ("kmeans_iters", 0), ("codebook_size", 2.0)])
def test_vector_quantizer_sizes_are_checked_at_construction(field, value):
    sizes = dict(n_heads=2, head_dim=4, codebook_size=8)
    options = {}
    if field in sizes:
        sizes[field] = value
    else:
        options[field] = value
    with pytest.raises(ValueError, match=field):
        linattn.VectorQuantizer(sizes["n_heads"], sizes["head_dim"], sizes["codebook_size"], **options)


@pytest.mark.parametrize("field, value", [("ema_decay", 1.0), ("dead_code_threshold", -1.0),
                                          ("commitment_weight", -1e-4), ("init_scale", 0.0)])
def test_vector_quantizer_options_are_checked_at_construction(field, value):
    with pytest.raises(ValueError, match=field):
        linattn.VectorQuantizer(2, 4, 8, **{field: value})


@pytest.mark.parametrize("attention", ["softmax", "local:8", "vq,softmax"])
def test_odd_rotary_head_dimension_is_refused_by_the_config(attention):
    with pytest.raises(ValueError, match="even head dimension.*head_dim=7"):
        linattn.LMConfig(d_model=28, n_heads=4, n_layers=2, attention=attention)


def test_layers_without_rotary_accept_an_odd_head_dimension():
    config = linattn.LMConfig(d_model=28, n_heads=4, n_layers=2, attention="linear:elu,delta", gau_d_k=8,
                              chunk_size=4)
    logits, _, _ = linattn.LM(config)(torch.randint(0, 256, (1, 5)))
    assert logits.shape == (1, 5, 256)


def test_more_heads_than_width_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"n_heads=8 must divide d_model=4 \(head_dim = d_model // n_heads = 0"):
        linattn.LMConfig(d_model=4, n_heads=8, attention="linear:elu")


@pytest.mark.parametrize("command", [["train", "--steps", "1"], ["eval", "--ckpt", "x"],
                                     ["generate", "--ckpt", "x"]])
@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cpu:0"])
def test_unknown_device_is_a_usage_error(command, device, capsys):
    assert main([*command, "--device", device]) == 2
    assert "expected a device (cpu, cuda or cuda:N)" in capsys.readouterr().err


def test_train_config_device_is_checked():
    with pytest.raises(ValueError, match="train.device must be cpu, cuda or cuda:N"):
        TrainConfig(device="tpu")
    assert TrainConfig(device="cuda:1").device == "cuda:1"


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint16, torch.uint32])
@pytest.mark.parametrize("where", [0, 9])
def test_token_ids_outside_the_vocabulary_are_found_in_any_piece_and_dtype(dtype, where, monkeypatch):
    """``check_token_ids`` reads the ids in pieces (a memory-mapped split stays on disk),
    widening dtypes torch has no min/max for (uint16, uint32)."""
    import linattn._checks as checks

    monkeypatch.setattr(checks, "_ID_SCAN_PIECE", 4)
    ids = torch.arange(10).to(dtype)
    checks.check_token_ids("ids", ids, 10)
    ids[where] = 12
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\), got values in \[\d, 12\]"):
        checks.check_token_ids("ids", ids, 10)


def test_byte_ids_need_no_pass_over_the_values_for_a_byte_vocabulary(monkeypatch):
    import linattn._checks as checks

    monkeypatch.setattr(checks.torch, "aminmax", lambda *args: pytest.fail("the values were read"))
    checks.check_token_ids("ids", torch.full((5,), 255, dtype=torch.uint8), 256)
    with pytest.raises(TypeError, match="ids must be an integer tensor, got Tensor torch.float32"):
        checks.check_token_ids("ids", torch.zeros(3), 256)
