"""``torch.export`` of a linattn model's forward (the Hugging Face causal LM, ``use_cache=False``)
for every layer kind: the exported program computes the eager model's logits exactly, with and
without gradients, and over the sequence lengths its layers' forms allow (docs/guide/hf.md,
"Deployment export"): any length for exact softmax; multiples of the window (local) or of the
block (the GAU's softmax twin), at least two of them; the traced length for the chunked and
blocked recurrences (VQ, linear, FAVOR, delta, gated), whose chunk loop torch.export unrolls. A
length outside is refused by the program itself."""

from __future__ import annotations

import pytest
import torch

import linattn.hf as H
from test_hf import KINDS
from test_hf_init import tiny_config

torch.set_num_threads(1)

CHUNK, BLOCK, WINDOW = 4, 8, 4
VQ_KINDS = ("vq", "soft-vq", "vq-attn:rerope", "vq-attn:bias")


def tiny_model(attention: str) -> H.LinattnForCausalLM:
    """One layer per kind of ``attention``, blocks of 8 (VQ, the GAU), chunks of 4, windows of 4."""
    torch.manual_seed(0)
    config = tiny_config(attention, n_layers=attention.count(",") + 1, chunk_size=CHUNK, block_size=BLOCK,
                         local_window=WINDOW)
    model = H.LinattnForCausalLM(config).eval()
    with torch.no_grad():  # codes away from their init, so each lookup matters
        for quantizer in model.lm.quantizers():
            quantizer.codebook.add_(0.1 * torch.randn_like(quantizer.codebook))
    return model


def lengths(attention: str) -> tuple[int, torch.export.Dim | None, list[int], list[int]]:
    """``(traced length, its dimension or None for a static one, lengths the program takes, lengths
    it refuses)``, as the deployment docs give them for a model of ``attention``."""
    if attention == "softmax":
        return 12, torch.export.Dim("length", min=1, max=64), [1, 5, 12, 33], [65]
    if attention.startswith("local") and "," not in attention or attention == "gau-softmax":
        step = WINDOW if attention.startswith("local") else BLOCK
        return 3 * step, step * torch.export.Dim("steps", min=2, max=8), [2 * step, 3 * step, 5 * step], [step]
    traced = 2 * BLOCK + BLOCK // 2  # two full blocks (five chunks) and a part of one
    return traced, None, [traced], [traced - 1, traced + CHUNK]


def export(model: H.LinattnForCausalLM, ids: torch.Tensor, length) -> torch.export.ExportedProgram:
    shapes = None if length is None else {"input_ids": {1: length}, "use_cache": None}
    return torch.export.export(model, (), {"input_ids": ids, "use_cache": False}, dynamic_shapes=shapes)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("attention", KINDS)
def test_the_exported_forward_equals_eager_over_the_lengths_its_layers_allow(attention, monkeypatch):
    """The program traces the torch forms: it equals eager on them (``LINATTN_VQ_IMPL=torch``,
    ``LINATTN_LINEAR_IMPL=torch``, ``LINATTN_DELTA_IMPL=torch``) bit for bit, and eager as it runs
    by default (a VQ, kernel attention or delta-rule layer on a CPU: the native kernels) within
    float32 rounding."""
    model = tiny_model(attention)
    traced, length, accepted, refused = lengths(attention)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        program = export(model, torch.randint(1, 256, (2, traced), generator=generator), length)
        for count in accepted:
            ids = torch.randint(1, 256, (2, count), generator=generator)
            exported = logits(program.module(), ids)
            torch.testing.assert_close(exported, logits(model, ids), rtol=1e-5, atol=1e-6)
            with monkeypatch.context() as patch:
                patch.setenv("LINATTN_VQ_IMPL", "torch")
                patch.setenv("LINATTN_LINEAR_IMPL", "torch")
                patch.setenv("LINATTN_DELTA_IMPL", "torch")
                assert torch.equal(exported, logits(model, ids)), count
        for count in refused:
            with pytest.raises(Exception, match="Guard failed|to be equal to|to be <= 64"):
                program.module()(input_ids=torch.randint(1, 256, (2, count)), use_cache=False)


@pytest.mark.parametrize("attention", ["local:4,vq,delta", "vq-attn:rerope"])
def test_a_forward_with_gradients_exports_and_its_program_is_saved_and_loaded(attention, tmp_path, monkeypatch):
    """Traced with gradients on (the training IR), a VQ model exports too (its windowed bias and the
    delta rule's chunk form traced as plain ops); the program saved with ``torch.export.save`` and
    loaded again computes the eager logits: bit for bit on the torch forms it traced
    (``LINATTN_VQ_IMPL=torch``), within float32 rounding of eager as it runs by default (a VQ
    layer on a CPU: the native kernels)."""
    model = tiny_model(attention)
    traced, length, accepted, _ = lengths(attention)
    program = export(model, torch.randint(1, 256, (2, traced)), length)
    torch.export.save(program, tmp_path / "program.pt2")
    loaded = torch.export.load(tmp_path / "program.pt2").module()
    ids = torch.randint(1, 256, (2, accepted[-1]), generator=torch.Generator().manual_seed(2))
    with monkeypatch.context() as patch:
        patch.setenv("LINATTN_VQ_IMPL", "torch")
        expected = logits(model, ids)  # with gradients, as traced (without, the GAU takes its fused path)
    assert expected.requires_grad
    assert torch.equal(logits(program.module(), ids), expected)
    assert torch.equal(logits(loaded, ids), expected)
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=1e-5, atol=1e-6)
