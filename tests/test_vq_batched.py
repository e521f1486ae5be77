"""The batched-blocks schedule of ``vq_attention``'s block form (all blocks at once, the
caches from a prefix sum over blocks) against the same float64 checks as the loop: the
block-form tests of ``test_vq_attention.py`` and ``test_vq_decode.py`` run again here with
every block form forced onto the batched schedule, plus the two schedules side by side."""

from __future__ import annotations

import pytest
import torch

import linattn
import linattn.ops.vq as vq
from _helpers import F64
from test_vq_attention import make_bias, make_position_keys, make_vq
from test_vq_attention import (  # noqa: F401  (collected again under the batched schedule)
    test_block_equals_parallel,
    test_block_equals_parallel_bias_and_position_keys_together,
    test_block_gradients_equal_parallel_with_cache_grad,
    test_block_gradients_without_cache_grad,
    test_block_mode_is_causal,
    test_none_scope_is_the_exact_gradient_and_cache_grad_its_alias,
    test_shared_bias_and_position_keys_broadcast_over_heads,
    test_soft_vq_state_carry_equals_one_call,
    test_state_counts_cache_correctly,
    test_state_pieces_equal_one_call,
    test_state_scope_equals_blockwise_calls_with_detached_states,
    test_state_scope_token_by_token_equals_one_call,
)
from test_vq_decode import (  # noqa: F401
    test_prefill_then_token_by_token_equals_one_call,
    test_small_pieces_that_end_exactly_on_block_boundaries,
)


@pytest.fixture(autouse=True)
def batched_schedule(monkeypatch):
    """Every block form in this module runs batched, in groups of two blocks (so the grouping is exercised)."""
    block = vq._block

    def batched(*args):
        return block(*args[:11], "batched")

    monkeypatch.setattr(vq, "_block", batched)
    monkeypatch.setattr(vq, "_BATCHED_SCORES", 1)


@pytest.mark.parametrize("state_first", [False, True])
def test_schedules_agree_with_everything_on(state_first):
    """Loop and batched schedules side by side (GQA, batch 2, bias and position keys, a carried
    state, a length that is not a multiple of the block): outputs, states and gradients."""
    q, k_hat, v, codes, codebook = make_vq(B=2, H=4, Hkv=2, T=23, Dk=4, Dv=3, S=8, seed=5)
    kw = dict(block_size=4, bias=make_bias(4, 4), position_keys=make_position_keys(4, 4, 4), grad_scope="none")
    _, state = linattn.vq_attention(q[:, :, :6], k_hat[:, :, :6], v[:, :, :6], codes[:, :, :6], codebook,
                                    output_final_state=True, **kw)
    start = 6 if state_first else 0
    results = []
    for schedule in ("loop", "batched"):
        leaves = [t.clone().requires_grad_(True) for t in (q, v)]
        out, final = linattn.vq_attention(leaves[0][:, :, start:], k_hat[:, :, start:], leaves[1][:, :, start:],
                                          codes[:, :, start:], codebook, initial_state=state if state_first else None,
                                          output_final_state=True, schedule=schedule, **kw)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1], dtype=F64)).sum(), leaves)
        results.append((out, final, grads))
    (out_a, state_a, grads_a), (out_b, state_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    for name in ("partial_keys", "partial_values", "cache_counts", "cache_means", "prev_keys", "prev_values"):
        torch.testing.assert_close(getattr(state_b, name), getattr(state_a, name), rtol=1e-10, atol=1e-12)


def test_schedule_is_checked():
    q, k_hat, v, codes, codebook = make_vq(T=5)
    with pytest.raises(ValueError, match="schedule"):
        linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=4, schedule="gpu")
