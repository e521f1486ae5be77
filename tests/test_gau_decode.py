"""The one-token decoding path of the VQ ``GAU`` (``nn/_gau_decode.py``) against the general
layer: same outputs, states and losses in float64, across block boundaries, with batch > 1,
for both GAU variants; taken only when it applies; its derived constants follow the
parameters and the codebook. Every test runs with the attention of a token in torch
operators and in the native VQ decoding step (``LINATTN_VQ_STEP_IMPL``)."""

from __future__ import annotations

import pytest
import torch

import linattn.nn._gau_decode as fast
from linattn.nn import GAU
from linattn.state import VQAttentionState

F64 = torch.float64
torch.set_num_threads(1)


def _unit(variant: str = "linattn", seed: int = 0, rerope: int | None = None, attention: str = "vq") -> GAU:
    torch.manual_seed(seed)
    unit = GAU(12, d_k=8, d_v=10, block_size=4, codebook_size=6, variant=variant, commitment_weight=0.3,
               rerope=rerope, attention=attention, fsq_levels=(3, 4, 2)).double()
    with torch.no_grad():
        for parameter in unit.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return unit.eval()


@pytest.fixture(autouse=True, params=["torch", "native"])
def step_impl(request, monkeypatch):
    monkeypatch.setenv("LINATTN_VQ_STEP_IMPL", request.param)
    return request.param


@pytest.fixture
def fast_calls(monkeypatch) -> list:
    calls = []
    original = fast.decode_token

    def counting(unit, x, state):
        calls.append(state.partial_keys.shape[2])
        return original(unit, x, state)

    monkeypatch.setattr("linattn.nn.gau.decode_token", counting)
    return calls


def _assert_states_equal(a: VQAttentionState, b: VQAttentionState) -> None:
    assert a.steps == b.steps
    for name in ("partial_keys", "partial_values", "partial_codes", "cache_counts", "cache_means", "prev_keys",
                 "prev_values", "prev_codes"):
        left, right = getattr(a, name), getattr(b, name)
        assert (left is None) == (right is None), name
        if left is not None:
            assert left.shape == right.shape and left.dtype == right.dtype, name
            assert torch.allclose(left.double(), right.double(), rtol=1e-12, atol=1e-12), name


@pytest.mark.parametrize("variant,rerope,attention", [
    ("linattn", None, "vq"), ("paper", None, "vq"), ("linattn", 4, "vq"), ("linattn", 2, "vq"), ("paper", 3, "vq"),
    ("linattn", None, "fsq"), ("paper", 2, "fsq"), ("linattn", None, "soft-vq"), ("paper", None, "soft-vq"),
])
@pytest.mark.parametrize("prompt", [0, 3, 6])
def test_token_steps_equal_the_general_layer(variant, rerope, attention, prompt, fast_calls):
    """VQ, FSQ and soft-VQ units, with and without ReRoPE (w = L, w < L: keys at distances below w
    turned, the rest at w)."""
    unit = _unit(variant, rerope=rerope, attention=attention)
    x = torch.randn(3, prompt + 11, 12, dtype=F64)
    full, full_state, _ = unit(x)  # gradients on: the general layer
    with torch.no_grad():
        state, outputs = None, []
        if prompt:
            y, state, _ = unit(x[:, :prompt])
            outputs.append(y)
        for t in range(prompt, x.shape[1]):
            y, state, aux = unit(x[:, t : t + 1], state)
            outputs.append(y)
            assert aux["codes"] is None if attention == "soft-vq" else aux["codes"].shape == (3, 1, 1)
    assert torch.allclose(torch.cat(outputs, 1), full, rtol=1e-10, atol=1e-12)
    _assert_states_equal(state, full_state)
    first = 1 if prompt == 0 else 0  # the very first token has no state: the general layer
    assert len(fast_calls) == x.shape[1] - prompt - first  # every other token, block-completing ones included


def test_aux_equals_the_general_layer(fast_calls):
    unit = _unit()
    x = torch.randn(2, 7, 12, dtype=F64)
    with torch.no_grad():
        _, state, _ = unit(x[:, :5])
        _, _, fast_aux = unit(x[:, 5:6], state)
    assert fast_calls == [1]
    _, _, general_aux = unit(x[:, 5:6], state)  # gradients on: the general layer
    assert torch.equal(fast_aux["codes"], general_aux["codes"])
    assert fast_aux["commit_loss"].dtype == general_aux["commit_loss"].dtype == torch.float64  # the keys' dtype
    assert torch.allclose(fast_aux["commit_loss"], general_aux["commit_loss"], rtol=1e-12)


def test_constants_follow_parameter_and_codebook_changes(fast_calls):
    unit = _unit()
    x = torch.randn(2, 6, 12, dtype=F64)
    with torch.no_grad():
        _, state, _ = unit(x[:, :5])
        unit(x[:, 5:6], state)
        unit.w_o.weight.mul_(1.5)
        unit.norm.weight.add_(0.2)
        unit.content_bias.add_(0.1)
        unit.quantizer.codebook.mul_(0.9)
        y, _, _ = unit(x[:, 5:6], state)
    assert fast_calls == [1, 1]
    expected, _, _ = unit(x[:, 5:6], state)
    assert torch.allclose(y, expected, rtol=1e-10, atol=1e-12)


def test_general_path_when_the_fast_one_does_not_apply(fast_calls):
    unit = _unit()
    x = torch.randn(2, 6, 12, dtype=F64)
    with torch.no_grad():
        _, state, _ = unit(x[:, :5])
    unit(x[:, 5:6], state)  # gradients on
    unit.train()
    with torch.no_grad():
        unit(x[:, 5:6], state)  # training mode: the codebook statistics must be gathered
    unit.eval()
    with torch.no_grad():
        unit(x[:, 4:6], state)  # two tokens
        unit(x[:, 5:6], None)  # no state
    assert fast_calls == []
    single = _unit().float().eval()
    with torch.no_grad():
        _, state32, _ = single(x[:, :5].float())
        single(x[:, 5:6].float(), state32)
    assert fast_calls == [1]


def test_a_state_of_another_kind_or_block_size_is_named():
    from linattn.state import KVCacheState

    unit = _unit()
    x = torch.randn(2, 9, 12, dtype=F64)
    cache = KVCacheState(keys=torch.zeros(2, 1, 3, 8, dtype=F64), values=torch.zeros(2, 1, 3, 10, dtype=F64))
    other = GAU(12, d_k=8, d_v=10, block_size=8, codebook_size=6).double().eval()
    with torch.no_grad():
        _, foreign, _ = other(x)  # block 8: a previous block of 8 is impossible with block size 4
        for state, error, match in ((cache, TypeError, "VQAttentionState, got KVCacheState"),
                                    (foreign, ValueError, "this unit's block_size is 4")):
            for length in (1, 2):
                with pytest.raises(error, match=match):
                    unit(x[:, :length], state)


def test_weights_written_through_data_are_seen_after_a_mode_switch(fast_calls):
    unit = _unit()
    x = torch.randn(2, 6, 12, dtype=F64)
    with torch.no_grad():
        _, state, _ = unit(x[:, :5])
        before, _, _ = unit(x[:, 5:6], state)
        unit.w_q.weight.data.mul_(3.0)  # no version bump
        unit.quantizer.codebook.data.mul_(0.5)
        unit.eval()
        after, _, _ = unit(x[:, 5:6], state)
    expected, _, _ = unit(x[:, 5:6], state)  # the general layer, gradients on
    assert fast_calls == [1, 1]
    assert not torch.allclose(after, before)
    assert torch.allclose(after, expected, rtol=1e-10, atol=1e-12)


def test_token_steps_fill_one_buffer_per_block():
    """Consecutive one-token steps write into the state's buffer in place: inside a block every
    state shares one buffer, a completed block moves to the next one (no copy per step)."""
    unit = _unit()
    x = torch.randn(2, 15, 12, dtype=F64)
    with torch.no_grad():
        _, state, _ = unit(x[:, :2])
        buffers = []
        for t in range(2, 15):
            _, state, _ = unit(x[:, t : t + 1], state)
            if not buffers or state._resident is not buffers[-1]:
                buffers.append(state._resident)
    assert len(buffers) == 4  # positions 2..14 with blocks of 4: the blocks of 2-3, 4-7, 8-11, 12-14


def test_a_partial_block_as_long_as_the_block_size_is_refused():
    """A unit's carried partial block is always shorter than its block size (a full block
    moves to ``prev_keys``): a state holding L pending positions was made with a larger block
    and is refused by name, on the one-token fast path and on the general path alike."""
    unit = _unit()  # block_size 4
    other = GAU(12, d_k=8, d_v=10, block_size=8, codebook_size=6).double().eval()
    x = torch.randn(2, 6, 12, dtype=F64)
    with torch.no_grad():
        _, foreign, _ = other(x[:, :4])
        assert foreign.partial_keys.shape[2] == 4 and foreign.prev_keys is None
        for length in (1, 2):
            with pytest.raises(ValueError, match="this unit's block_size is 4"):
                unit(x[:, 4 : 4 + length], foreign)
