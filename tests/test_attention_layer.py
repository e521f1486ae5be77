"""The multi-head ``Attention`` layer (``linattn.nn.Attention``): argument and input checks.

Its mechanisms, head layouts, rotary positions and KV cache are tested in test_layers.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from linattn.nn import Attention

F64 = torch.float64


@pytest.mark.parametrize("n_kv_heads", [0, -2, 3])
def test_key_value_heads_that_do_not_divide_the_heads_are_refused_by_name(n_kv_heads):
    """``n_kv_heads`` must be >= 1 and divide ``n_heads``; either failure is a ValueError that
    names it, raised when the layer is built (not a ZeroDivisionError, not a later shape error)."""
    with pytest.raises(ValueError, match=rf"n_kv_heads={n_kv_heads} must be >= 1 and divide n_heads=4"):
        Attention(16, 4, n_kv_heads=n_kv_heads)
    assert Attention(16, 4, n_kv_heads=2).k_proj.out_features == 2 * 4


@pytest.mark.parametrize("mechanism", ["softmax", "linear", "local"])
def test_inputs_of_the_wrong_rank_or_width_are_refused_by_name(mechanism):
    """``x`` must be ``[batch, length, d_model]``: a wrong rank with the right width and a wrong
    width with the right rank are both refused with the expected layout."""
    layer = Attention(16, 2, mechanism=mechanism, window=4).double()
    for shape in ([5, 16], [1, 2, 5, 16], [2, 5, 8]):
        with pytest.raises(ValueError, match=re.escape(f"x must have shape [batch, length, 16], got {shape}")):
            layer(torch.randn(*shape, dtype=F64))
    assert layer(torch.randn(2, 5, 16, dtype=F64))[0].shape == (2, 5, 16)
