"""``linattn convert``: a ``gau-softmax`` model becomes a ``vq`` (or ``soft-vq``) model with the
same weights and codebooks fitted by k-means++ / Lloyd on its own keys. With a codebook as
large as the set of keys it sees, the converted model computes what the softmax model
computes; the converted run evaluates, generates and fine-tunes like any run."""

from __future__ import annotations

import json

import pytest
import torch

import linattn
from linattn.convert import collect_keys, convert_model, converted_config
from linattn.nn.codebook import kmeans
from linattn.train import load_checkpoint, load_model
from test_train_cli import TINY_SETS, corpus, run_captured  # noqa: F401  (the tiny corpus fixture)

torch.set_num_threads(1)


def _softmax_model(seed: int = 0, codebook_size: int = 64) -> linattn.LM:
    config = linattn.LMConfig(d_model=16, n_layers=2, attention="local:4,gau-softmax", n_heads=2, gau_d_k=8,
                              block_size=4, codebook_size=codebook_size)
    torch.manual_seed(seed)
    model = linattn.LM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


def test_converted_config_maps_gau_softmax_layers_only():
    config = _softmax_model().config
    converted = converted_config(config, "vq", codebook_size=32)
    assert [str(spec) for spec in converted.layer_specs()] == ["local:4", "vq"]
    assert converted.codebook_size == 32
    assert [str(s) for s in converted_config(config, "soft-vq").layer_specs()] == ["local:4", "soft-vq"]
    with pytest.raises(ValueError, match="no gau-softmax layer"):
        converted_config(linattn.LMConfig(attention="vq,local:4"), "vq")
    with pytest.raises(ValueError, match="to"):
        converted_config(config, "delta")


def test_a_codebook_that_holds_every_key_reproduces_the_softmax_model():
    """Calibrated on the very tokens it is then run on, with S >= the keys each unit sees, every
    key is a code: the VQ model's logits are the softmax model's (float32 codebooks)."""
    source = _softmax_model()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    converted = convert_model(source, ids, to="vq", codebook_size=64, kmeans_iters=5)
    want, _, _ = source(ids)
    got, _, _ = converted.eval()(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    small = convert_model(source, ids, to="vq", codebook_size=2, kmeans_iters=5)  # too few codes: not the same
    assert not torch.allclose(small.eval()(ids)[0], want, rtol=1e-3, atol=1e-3)
    for name, tensor in source.state_dict().items():  # every weight copied
        assert torch.equal(converted.state_dict()[name], tensor), name


def test_codebooks_are_the_kmeans_of_the_units_keys():
    source = _softmax_model()
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(2))
    keys = collect_keys(source, ids)
    assert [k.shape for k in keys] == [(48, 8), (48, 8)]  # the two units of the gau-softmax pair
    converted = convert_model(source, ids, to="vq", codebook_size=8, kmeans_iters=30, tokens_per_step=96, seed=3)
    for unit, unit_keys in zip(converted.layers[1].units, keys):
        codebook = unit.quantizer.codebook[0]
        nearest = torch.cdist(unit_keys, codebook).argmin(-1)
        for s in range(8):  # a converged Lloyd step: each used code is the mean of its keys
            chosen = unit_keys[nearest == s]
            if len(chosen):
                torch.testing.assert_close(codebook[s], chosen.mean(0), rtol=1e-5, atol=1e-6)
        counts = torch.bincount(nearest, minlength=8).float() * (96 / 48)
        torch.testing.assert_close(unit.quantizer.ema_counts[0], torch.where(counts > 0, counts, 0.01))
        torch.testing.assert_close(unit.quantizer.ema_sums[0], codebook * unit.quantizer.ema_counts[0, :, None])
    soft = convert_model(source, ids, to="soft-vq", codebook_size=8, kmeans_iters=30, seed=3)
    torch.testing.assert_close(soft.layers[1].units[0].codebook, converted.layers[1].units[0].quantizer.codebook)


def test_kmeans_plus_plus_seeds_every_cluster():
    """Three tight, far-apart clusters and three codes: k-means++ seeds one code in each
    (a far key is drawn with probability ~1), so Lloyd ends at the cluster means."""
    g = torch.Generator().manual_seed(0)
    means = torch.tensor([[0.0, 0.0], [50.0, 0.0], [0.0, 50.0]])
    keys = (means.repeat_interleave(30, 0) + 0.01 * torch.randn(90, 2, generator=g)).unsqueeze(0)
    for seed in range(5):
        centers = kmeans(keys, 3, 5, torch.Generator().manual_seed(seed), seeding="kmeans++")[0]
        order = centers[:, 0] * 10 + centers[:, 1]  # sort: (0,0), (0,50), (50,0)
        torch.testing.assert_close(centers[order.argsort()], means[[0, 2, 1]], rtol=0, atol=0.01)
    twice = torch.tensor([[[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]])  # fewer distinct keys than codes
    assert kmeans(twice, 4, 2, seeding="kmeans++").shape == (1, 4, 2)
    with pytest.raises(ValueError, match="seeding"):
        kmeans(twice, 2, seeding="far")


def test_convert_command_end_to_end(corpus, tmp_path):  # noqa: F811
    source = tmp_path / "softmax"
    argv = ["train", "--data", str(corpus), "--out", str(source), "--steps", "6", "--attention", "gau-softmax",
            "--d-model", "16", "--n-layers", "1", "--batch-size", "2", "--context", "16", "--eval-every", "6",
            *TINY_SETS, "--no-progress", "--threads", "1"]
    assert run_captured(argv)[0] == 0
    out = tmp_path / "vq"
    code, stdout, stderr = run_captured(["convert", "--ckpt", str(source), "--out", str(out), "--codebook-size", "16",
                                         "--calibration-tokens", "256", "--kmeans-iters", "3"])
    assert code == 0, stderr
    model, checkpoint = load_model(out)
    assert [str(s) for s in model.specs] == ["vq"] and model.config.codebook_size == 16
    assert checkpoint.step == 6 and checkpoint.meta["converted_from"]["calibration_tokens"] == 256
    code, stdout, _ = run_captured(["eval", "--ckpt", str(out), "--split", "test", "--json"])
    assert code == 0 and json.loads(stdout)["bpb"] > 0
    assert run_captured(["generate", "--ckpt", str(out), "--prompt", "The", "--max-new-tokens", "5"])[0] == 0
    code, _, stderr = run_captured(["train", "--resume", "--out", str(out), "--steps", "8", "--no-progress"])
    assert code == 0, stderr
    assert load_checkpoint(out).step == 8
    code, _, stderr = run_captured(["convert", "--ckpt", str(out), "--out", str(tmp_path / "again")])
    assert code == 2 and "no gau-softmax layer" in stderr
    code, _, stderr = run_captured(["convert", "--ckpt", str(source), "--out", str(out)])
    assert code == 2 and "already holds a run" in stderr
