"""``bench/decode_parts.py``: which calls of a step count as its products, that a VQ model's
step shows its attention's products only through the torch form, and the sum's bookkeeping."""

from __future__ import annotations

import os

import pytest
import torch

from linattn import LM, LMConfig
from linattn.bench import decode_parts
from linattn.bench.decode_parts import products_s, recorded_products, torch_vq_steps

aten = torch.ops.aten


def test_products_are_recorded_and_elementwise_passes_are_not():
    a, b, c = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)
    x, y = torch.randn(2, 3, 4), torch.randn(2, 4, 6)

    def step():
        h = a @ b
        h = torch.addmm(c, a, b) + h.relu()
        torch.bmm(x, y).softmax(-1)
        torch.nn.functional.scaled_dot_product_attention(x.unsqueeze(0), x.unsqueeze(0), x.unsqueeze(0))
        return h

    ops = [call[0].overloadpacket for call in recorded_products(step)]
    assert ops == [aten.mm, aten.addmm, aten.bmm, aten._scaled_dot_product_flash_attention_for_cpu]


def test_a_step_without_products_costs_nothing_and_one_with_costs_its_calls(monkeypatch):
    a = torch.randn(8, 8)
    assert products_s(lambda: (a + 1).exp()) == 0.0
    clock = iter(range(1000))
    monkeypatch.setattr(decode_parts.time, "perf_counter", lambda: float(next(clock)))  # each call takes 1 "second"
    assert products_s(lambda: (a @ a, a @ a), repeats=5, warmup=2) == 2.0  # two products, the median of each


def _vq_model():
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=32, d_model=16, n_layers=1, attention="vq", gau_d_k=8, gau_d_v=12,
                        codebook_size=6, block_size=4)).eval()
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        state = model(ids[:, :6])[1]
    return lambda: model._run(ids[:, 6:], state, with_aux=False)


def test_the_vq_attention_is_seen_through_its_torch_form_only():
    step = _vq_model()
    native = [call[0].overloadpacket for call in recorded_products(step)]
    with torch_vq_steps():
        torch_form = [call[0].overloadpacket for call in recorded_products(step)]
    assert aten.baddbmm not in native and aten.addmm not in native  # inside the native unit step
    assert {aten.baddbmm, aten.bmm, aten.addmm, aten.mm} <= set(torch_form)
    assert len(torch_form) >= len(native) + 2 * 5  # per unit: input, relative, codes, scores, weighted sum


@pytest.mark.parametrize("before", [None, "native"])
def test_torch_vq_steps_restores_the_setting(before, monkeypatch):
    if before is None:
        monkeypatch.delenv("LINATTN_VQ_STEP_IMPL", raising=False)
    else:
        monkeypatch.setenv("LINATTN_VQ_STEP_IMPL", before)
    with pytest.raises(KeyError), torch_vq_steps():
        assert os.environ["LINATTN_VQ_STEP_IMPL"] == "torch"
        raise KeyError("inside")
    assert os.environ.get("LINATTN_VQ_STEP_IMPL") == before
