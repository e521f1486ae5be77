"""``init_weights()`` / ``_init_weights`` initialise every parameter and buffer of a linattn model
(VQ codebooks and their EMA statistics, the sinusoids, the FSQ radix, every layer kind's own
parameters): a model built on the meta device (``torch.device("meta")``, accelerate's
``init_empty_weights`` with and without its buffers), or by ``from_pretrained`` without weights
(transformers' fast init), then initialised, is finite and equals an eager build drawn from the
same random state, tensor for tensor."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights

import linattn.hf as H
from linattn import LM
from test_hf import KINDS
from _helpers import head_fields

torch.set_num_threads(1)

CONFIGS = [(kind, {}) for kind in KINDS] + [("vq-fsq", {"fsq_levels": [3, 3]}), ("vq", {"gau_variant": "paper"}),
                                            ("vq", {"kmeans_init": True})]
BUILDS = ["meta device", "init_empty_weights", "init_empty_weights with buffers", "from_pretrained without weights"]


def tiny_config(attention: str, **extra) -> H.LinattnConfig:
    values = dict(d_model=16, n_layers=max(2, attention.count(",") + 1), n_heads=2, attention=attention, gau_d_k=8,
                  codebook_size=8, block_size=4, chunk_size=4, local_window=4, favor_features=8)
    values.update(extra)
    return H.LinattnConfig(**head_fields(attention, **values))


def rng_after_the_lm(config: H.LinattnConfig) -> torch.Tensor:
    """The random state an eager build's ``post_init`` starts initialising from (seed 0, then
    the ``LM``'s constructor)."""
    torch.manual_seed(0)
    LM(config.to_lm_config())
    return torch.get_rng_state()


def build(how: str, config: H.LinattnConfig, rng: torch.Tensor) -> H.LinattnForCausalLM:
    """A model built without its tensors' values (``how``), then initialised from ``rng``."""
    if how == "from_pretrained without weights":
        torch.set_rng_state(rng)
        return H.LinattnForCausalLM.from_pretrained(None, config=config, state_dict={})
    if how == "meta device":
        with torch.device("meta"):
            model = H.LinattnForCausalLM(config)
    else:
        with init_empty_weights(include_buffers=how.endswith("with buffers")):
            model = H.LinattnForCausalLM(config)
    model.to_empty(device="cpu")
    torch.set_rng_state(rng)
    model.init_weights()
    return model


@pytest.mark.parametrize("how", BUILDS)
@pytest.mark.parametrize("attention, extra", CONFIGS, ids=[f"{k}{'-' + '-'.join(e) if e else ''}" for k, e in CONFIGS])
def test_a_model_built_without_values_and_initialised_equals_an_eager_build(attention, extra, how):
    config = tiny_config(attention, **extra)
    torch.manual_seed(0)
    eager = H.LinattnForCausalLM(config)
    model = build(how, config, rng_after_the_lm(config))
    expected = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
    built = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert sorted(built) == sorted(expected)
    for name, tensor in built.items():
        assert tensor.device.type == "cpu" and tensor.dtype == expected[name].dtype, name
        if tensor.is_floating_point():
            assert bool(torch.isfinite(tensor).all()), name
        assert torch.equal(tensor, expected[name]), name
    ids = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.eval()(ids).logits
    assert bool(torch.isfinite(logits).all())
    with torch.no_grad():
        assert torch.equal(logits, eager.eval()(ids).logits)


def test_every_codebook_buffer_is_written_with_the_constructors_distribution():
    """The VQ buffers of a meta build, initialised, are what a new quantizer holds: codes drawn from
    N(0, d_k^-1/2) (a large codebook's sample moments), EMA counts 1, EMA sums the codes, no pending
    statistics; with ``kmeans_init`` the codebook waits for its k-means initialisation."""
    for kmeans_init in (False, True):
        config = tiny_config("vq", codebook_size=512, gau_d_k=64, kmeans_init=kmeans_init)
        with torch.device("meta"):
            model = H.LinattnForCausalLM(config)
        model.to_empty(device="cpu").init_weights()
        for quantizer in model.lm.quantizers():
            codes = quantizer.codebook
            assert abs(float(codes.mean())) < 0.02 and abs(float(codes.std()) * 64 ** 0.25 - 1.0) < 0.05
            assert torch.equal(quantizer.ema_sums, codes) and bool((quantizer.ema_counts == 1.0).all())
            assert float(quantizer.pending_counts.abs().sum()) == 0.0
            assert quantizer.initialization_pending() is kmeans_init


def test_a_module_without_reset_parameters_is_named():
    """A layer kind whose module holds tensors of its own but cannot initialise them is refused by
    class name, never left holding uninitialised memory."""

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(3))

    model = H.LinattnForCausalLM(tiny_config("vq"))
    model.lm.extra = Scale()
    with pytest.raises(TypeError, match=r"Scale holds tensors \(gain\) but has no reset_parameters"):
        model._init_weights(model.lm.extra)


def test_loading_an_export_keeps_its_tensors_and_draws_nothing(tmp_path):
    """``from_pretrained`` recomputes only the non-persistent buffers a checkpoint lacks (pending
    statistics, sinusoids, the FSQ radix): every saved tensor arrives as saved, and the global
    random state is where it was."""
    torch.manual_seed(3)
    model = H.LinattnForCausalLM(tiny_config("vq,local:4,gla,gated-delta,vq-fsq", fsq_levels=[3, 3]))
    with torch.no_grad():
        for quantizer in model.lm.quantizers():
            quantizer.codebook.add_(1.0)
    model.save_pretrained(tmp_path)
    state = torch.get_rng_state()
    loaded = H.LinattnForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(torch.get_rng_state(), state)
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, tensor in [*loaded.named_parameters(), *loaded.named_buffers()]:
        assert torch.equal(tensor, expected[name]), name
