"""Every layer kind under ``torch.inference_mode``, as serving engines (vLLM) run models: a model
whose weights and states are inference tensors (which keep no version counter) decodes the
same tokens as outside it, and the native VQ decoding step runs there too (a failure of it is
an error under ``LINATTN_VQ_STEP_IMPL=native``, not a fallback)."""

from __future__ import annotations

import warnings

import pytest
import torch

from _helpers import head_fields
from linattn import LM, LMConfig

torch.set_num_threads(1)

KINDS = ["vq", "vq-fsq", "soft-vq", "gau-softmax", "softmax", "linear:elu", "linear:hedgehog", "favor", "delta",
         "retnet", "gla", "gated-delta", "local:4", "vq-attn:rerope", "vq-attn:bias"]


def _config(attention: str) -> LMConfig:
    return LMConfig(vocab_size=32, d_model=16, n_layers=2, attention=attention, gau_d_k=8, gau_d_v=16,
                    codebook_size=8, block_size=4, chunk_size=4, local_window=4, favor_features=8,
                    **head_fields(attention, n_heads=2))


@pytest.mark.parametrize("attention", KINDS)
def test_a_model_of_inference_tensors_decodes_as_outside_inference_mode(attention, monkeypatch):
    monkeypatch.setenv("LINATTN_VQ_STEP_IMPL", "native")
    torch.manual_seed(0)
    model = LM(_config(attention)).eval()
    prompt = torch.randint(0, 32, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = list(model.generate(prompt, 9, temperature=0))
    with torch.inference_mode():
        served = LM(_config(attention)).eval()
        served.load_state_dict(model.state_dict())
        assert next(served.parameters()).is_inference()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            first = list(served.generate(prompt, 9, temperature=0))
            again = list(served.generate(prompt, 9, temperature=0))  # the caches of the first call reused
    assert first == expected and again == expected
