"""The DeltaNet layer: decoding token by token equals the full pass; the conv cache; shapes."""

import pytest
import torch

from linattn.nn import DeltaNet, ShortConvolution
from linattn.ops.delta import delta_rule

D_MODEL = 24


def _layer(**kwargs):
    torch.manual_seed(0)
    return DeltaNet(D_MODEL, 4, chunk_size=8, **kwargs).double()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"short_conv": 4},
        {"n_kv_heads": 2, "short_conv": 3},
        {"n_kv_heads": 1, "use_beta": False, "feature_map": "dpfp", "normalize": "sum"},
    ],
)
def test_decoding_token_by_token_equals_full_pass(kwargs):
    layer = _layer(**kwargs)
    x = torch.randn(2, 19, D_MODEL, dtype=torch.float64)
    full, full_state, _ = layer(x)
    state, pieces = None, []
    for t in range(x.shape[1]):
        y, state, _ = layer(x[:, t : t + 1], state)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.rule.memory, full_state.rule.memory, rtol=1e-10, atol=1e-12)
    assert state.steps == full_state.steps == 19


def test_pieces_with_state_equal_full_pass():
    layer = _layer(short_conv=4, n_kv_heads=2)
    x = torch.randn(1, 30, D_MODEL, dtype=torch.float64)
    full, _, _ = layer(x)
    first, state, _ = layer(x[:, :13])
    second, _, _ = layer(x[:, 13:], state.detach())
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-10, atol=1e-12)


def test_layer_is_the_projections_around_the_op():
    layer = _layer(n_kv_heads=2)
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    heads = lambda t, n: t.reshape(2, 11, n, 6).transpose(1, 2)  # noqa: E731
    beta = torch.sigmoid(x @ layer.beta_proj.weight.T).transpose(1, 2)
    out, _ = delta_rule(
        heads(x @ layer.q_proj.weight.T, 4),
        heads(x @ layer.k_proj.weight.T, 2),
        heads(x @ layer.v_proj.weight.T, 2),
        beta,
        mode="recurrent",
    )
    expected = out.transpose(1, 2).reshape(2, 11, 24) @ layer.o_proj.weight.T
    torch.testing.assert_close(layer(x)[0], expected, rtol=1e-10, atol=1e-12)


def test_layer_is_causal():
    layer = _layer(short_conv=4)
    x = torch.randn(1, 7, D_MODEL, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda inp: layer(inp)[0], x)  # [1, 7, D, 1, 7, D]
    for i in range(7):
        assert torch.all(jac[0, i, :, 0, i + 1 :, :] == 0)
        assert jac[0, i, :, 0, i, :].abs().sum() > 0


def test_short_convolution_is_causal_depthwise_conv():
    torch.manual_seed(1)
    conv = ShortConvolution(5, kernel_size=3).double()
    x = torch.randn(2, 9, 5, dtype=torch.float64)
    y, cache = conv(x)
    padded = torch.nn.functional.pad(x, (0, 0, 2, 0))
    w = conv.weight[:, 0, :]  # [C, K]
    expected = torch.stack([(padded[:, t : t + 3, :] * w.T).sum(1) for t in range(9)], 1) + conv.bias
    torch.testing.assert_close(y, torch.nn.functional.silu(expected))
    torch.testing.assert_close(cache, x[:, -2:, :].transpose(1, 2))


def test_bad_input_is_named():
    layer = _layer()
    with pytest.raises(ValueError, match=r"x must have shape \[batch, length, 24\], got \[2, 5\]"):
        layer(torch.randn(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="n_kv_heads=3 must be >= 1 and divide n_heads=4"):
        DeltaNet(D_MODEL, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_kv_heads=0 must be >= 1 and divide n_heads=4"):
        DeltaNet(D_MODEL, 4, n_kv_heads=0)


def test_one_wide_heads_and_inputs_of_the_wrong_rank_or_width():
    """head_dim=1 is a valid layout; an input is refused by name when its rank is wrong
    (even with the right width) and when its width is wrong (even with the right rank)."""
    assert DeltaNet(D_MODEL, 4, head_dim=1)(torch.randn(1, 3, D_MODEL))[0].shape == (1, 3, D_MODEL)
    with pytest.raises(ValueError, match="head_dim must be >= 1, got 0"):
        DeltaNet(D_MODEL, 4, head_dim=0)
    layer = _layer()
    with pytest.raises(ValueError, match=r"x must have shape \[batch, length, 24\], got \[5, 24\]"):
        layer(torch.randn(5, D_MODEL, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must have shape \[batch, length, 24\], got \[2, 5, 23\]"):
        layer(torch.randn(2, 5, 23, dtype=torch.float64))


def test_float32_layer_keeps_float32_precision():
    """The op runs outside autocast in its own float32 precision: a float32 layer equals the
    same layer in float64 to float32 rounding (half-precision matmuls would be ~1e-3 off)."""
    layer = _layer(short_conv=3).float()
    x = torch.randn(2, 19, D_MODEL)
    y32 = layer(x)[0]
    y64 = layer.double()(x.double())[0]
    torch.testing.assert_close(y32.double(), y64, rtol=1e-5, atol=1e-6)
