"""The multi-head ``Attention`` layer (``linattn.nn.Attention``): argument and input checks, the
per-query scale (default and entropy) against its formula, and a cache truncated to nothing.

Its mechanisms, head layouts, rotary positions and KV cache are tested in test_layers.py.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from linattn.nn import Attention
from linattn.nn.attention import truncate_cache

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


def _by_formula(layer, x, visible, scale):
    """One head, no positions: ``y_t = W_o sum_j softmax_j(s_t q_t.k_j) v_j`` over the key positions
    ``visible[t]``, with ``s_t = d^-1/2`` (default) or ``log_512(n_t) / sqrt(d)``, n_t = len(visible[t])."""
    q, k, v = layer.q_proj(x[0]), layer.k_proj(x[0]), layer.v_proj(x[0])
    d = layer.head_dim
    rows = []
    for t, keys in visible.items():
        s = math.log(len(keys)) / math.log(512) / math.sqrt(d) if scale == "entropy" else 1 / math.sqrt(d)
        weights = torch.softmax(s * (k[keys] @ q[t]), dim=0)
        rows.append(weights @ v[keys])
    return layer.o_proj(torch.stack(rows)).unsqueeze(0)


@pytest.mark.parametrize("scale", ["default", "entropy"])
@pytest.mark.parametrize("mechanism", ["softmax", "local"])
def test_each_query_gets_its_scale_in_a_full_pass_and_in_pieces(mechanism, scale):
    """Each query's logits are scaled by ``head_dim^-1/2`` or, for ``scale="entropy"``, by
    ``log_512(n) / sqrt(head_dim)`` with n the keys it sees: its position + 1, at most ``window``
    (local), or the keys left in a truncated cache + 1 (softmax); in one pass and in pieces."""
    torch.manual_seed(0)
    window = 3
    layer = Attention(8, 1, mechanism=mechanism, window=window, rotary=False, scale=scale).double()
    x = torch.randn(1, 9, 8, dtype=F64)
    first = (lambda t: max(0, t - window + 1)) if mechanism == "local" else (lambda t: 0)
    expected = _by_formula(layer, x, {t: list(range(first(t), t + 1)) for t in range(9)}, scale)
    torch.testing.assert_close(layer(x)[0], expected, rtol=1e-12, atol=1e-12)
    pieces, state = [], None
    for start, stop in ((0, 4), (4, 5), (5, 9)):
        y, state, _ = layer(x[:, start:stop], state)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, 1), expected, rtol=1e-12, atol=1e-12)
    if mechanism == "softmax":  # keep keys 3, 4 of the first five; queries 5..7 see 3..t
        state = truncate_cache(layer(x[:, :5])[1], 2)
        y = layer(x[:, 5:8], state)[0]
        torch.testing.assert_close(y, _by_formula(layer, x, {t: list(range(3, t + 1)) for t in range(5, 8)}, scale),
                                   rtol=1e-12, atol=1e-12)


def test_a_cache_truncated_to_nothing_still_counts_the_positions():
    """``truncate_cache(state, 0)`` keeps no key but the positions consumed: the layer continues
    from there (steps = all tokens seen), and with rotary positions, which are relative, the pieces
    after it equal a fresh pass over the tokens after the cut."""
    torch.manual_seed(0)
    layer = Attention(16, 2).double()
    x = torch.randn(2, 7, 16, dtype=F64)
    state = truncate_cache(layer(x[:, :3])[1], 0)
    assert state.keys.shape[2] == 0 and state.steps == 3
    y1, state, _ = layer(x[:, 3:5], state)
    assert state.steps == 5 and state.keys.shape[2] == 2
    y2, state, _ = layer(x[:, 5:7], state)
    assert state.steps == 7
    torch.testing.assert_close(torch.cat([y1, y2], 1), layer(x[:, 3:7])[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mechanism", ["softmax", "local", "linear"])
def test_the_entropy_scale_is_refused_for_the_linear_mechanism_only(mechanism):
    """``scale="entropy"`` is for the softmax mechanisms; a linear layer refuses it by name."""
    if mechanism == "linear":
        message = "scale='entropy' is for the softmax mechanisms (softmax, local), not 'linear'"
        with pytest.raises(ValueError, match=re.escape(message)):
            Attention(8, 1, mechanism=mechanism, scale="entropy")
    else:
        assert Attention(8, 1, mechanism=mechanism, scale="entropy").scale == "entropy"
