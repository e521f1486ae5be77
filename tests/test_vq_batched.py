"""The two schedules of ``vq_attention``'s block form against the same float64 checks: the
block-form tests of ``test_vq_attention.py`` and ``test_vq_decode.py`` (which run the default,
batched schedule, all blocks of their short inputs in one group) run again here with every
block form on the loop, and on the batched schedule in groups of two blocks (the two side by side
are in ``test_vq_attention.py``)."""

from __future__ import annotations

import pytest

from linattn.ops.vq import attention
from linattn.ops.vq import schedule as vq_schedule
from test_vq_attention import (  # noqa: F401  (collected again under each schedule)
    test_block_equals_parallel,
    test_block_equals_parallel_bias_and_position_keys_together,
    test_block_gradients_equal_parallel_with_cache_grad,
    test_block_gradients_without_cache_grad,
    test_block_without_gradients_equals_parallel,
    test_block_mode_is_causal,
    test_none_scope_is_the_exact_gradient_and_cache_grad_its_alias,
    test_shared_bias_and_position_keys_broadcast_over_heads,
    test_soft_vq_state_carry_equals_one_call,
    test_soft_vq_without_gradients_equals_the_form_with_them,
    test_state_counts_cache_correctly,
    test_state_pieces_equal_one_call,
    test_state_scope_equals_blockwise_calls_with_detached_states,
    test_state_scope_token_by_token_equals_one_call,
)
from test_vq_decode import (  # noqa: F401
    test_prefill_then_token_by_token_equals_one_call,
    test_small_pieces_that_end_exactly_on_block_boundaries,
    test_state_after_a_long_prefill_owns_small_tensors,
)


@pytest.fixture(autouse=True, params=["loop", "batched-in-pairs"])
def schedule(request, monkeypatch):
    """Every block form in this module runs on the loop, or batched in groups of two blocks
    (so the carry from group to group is exercised): the torch forms (``LINATTN_VQ_IMPL=torch``:
    never the native block form)."""
    block = attention.block_form
    name = request.param.split("-")[0]
    monkeypatch.setenv("LINATTN_VQ_IMPL", "torch")

    def forced(*args):
        return block(*args[:11], name, *args[12:])

    monkeypatch.setattr(attention, "block_form", forced)
    monkeypatch.setattr(vq_schedule, "blocks_per_group", lambda device, scores_per_block: 2)
    return name
