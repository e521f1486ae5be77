"""The state slots of the vLLM plugin (``linattn.serve.states``): every recurrent layer kind's
state survives a round trip through a fixed-size float32 row, so a sequence fed in pieces
through its slot equals one pass; layouts refuse what they cannot hold."""

import pytest
import torch

from linattn.models import LM, LMConfig
from linattn.serve.states import layer_layout
from _helpers import head_fields

SLOT_KINDS = ["vq", "vq-fsq", "soft-vq", "gau-softmax", "linear:elu", "favor", "delta", "retnet", "gla",
              "gated-delta", "local:8", "vq:rerope=4", "local:8:rerope=3", "linear:hedgehog", "vq-attn:rerope=4",
              "vq-attn:bias"]


def _model(kinds: list[str]) -> LM:
    torch.manual_seed(0)
    config = LMConfig(d_model=64, n_layers=len(kinds), attention=kinds, gau_d_k=32, codebook_size=16,
                      block_size=8, favor_features=16, fsq_levels=(3, 3, 2), **head_fields(kinds, n_heads=2))
    return LM(config).eval()


@pytest.mark.parametrize("kind", SLOT_KINDS)
def test_pieces_through_a_slot_equal_one_pass(kind):
    lm = _model([kind])
    layer, spec = lm.layers[0], lm.specs[0]
    layout = layer_layout(spec.kind, layer, 64, max_positions=64, option=spec.option)
    torch.manual_seed(1)
    x = torch.randn(2, 30, 64)
    slots = torch.full((5, layout.size), float("nan"))  # what a slot held before is never read
    rows = torch.tensor([3, 1])
    with torch.no_grad():
        full, _, _ = layer(x, None)
        outputs, position, state = [], 0, None
        for piece in (5, 3, 1, 1, 8, 1, 11):  # across block boundaries (8) and the local window (8)
            y, state, _ = layer(x[:, position:position + piece], state)
            position += piece
            layout.write(slots, rows, state, position)
            state = layout.read(slots, rows, position)
            outputs.append(y)
    torch.testing.assert_close(torch.cat(outputs, 1), full, rtol=1e-5, atol=1e-5)
    assert torch.isnan(slots[[0, 2, 4]]).all()  # other slots untouched


def test_rows_of_one_batch_are_independent():
    """Two sequences written into their slots come back each with its own state."""
    lm = _model(["gated-delta"])
    layer = lm.layers[0]
    layout = layer_layout("gated-delta", layer, 64, max_positions=64)
    torch.manual_seed(2)
    a, b = torch.randn(1, 6, 64), torch.randn(1, 6, 64)
    slots = torch.zeros(4, layout.size)
    with torch.no_grad():
        _, state_a, _ = layer(a, None)
        _, state_b, _ = layer(b, None)
        layout.write(slots, torch.tensor([2]), state_a, 6)
        layout.write(slots, torch.tensor([0]), state_b, 6)
        both = layout.read(slots, torch.tensor([0, 2]), 6)
    torch.testing.assert_close(both.rule.memory[0], state_b.rule.memory[0])
    torch.testing.assert_close(both.rule.memory[1], state_a.rule.memory[0])


def test_group_keys_batch_only_states_of_one_shape():
    lm = _model(["vq", "linear:elu", "retnet"])
    vq, linear, retnet = (layer_layout(spec.kind, layer, 64, 64) for spec, layer in zip(lm.specs, lm.layers))
    assert vq.group_key(11) == vq.group_key(19) != vq.group_key(12)  # block size 8: position 3 in the block
    assert vq.group_key(3) != vq.group_key(11)  # no previous block yet at 3
    assert linear.group_key(3) == linear.group_key(300)
    assert retnet.group_key(3) != retnet.group_key(4)  # rotary angles follow the position


def test_a_state_of_another_shape_is_refused():
    lm = _model(["local:8"])
    layout = layer_layout("local", lm.layers[0], 64, 64)
    with torch.no_grad():
        _, state, _ = lm.layers[0](torch.randn(1, 3, 64), None)
    with pytest.raises(ValueError, match=r"keys has shape \[2, 3, 32\] per sequence at position 5"):
        layout.write(torch.zeros(1, layout.size), torch.tensor([0]), state, 5)


def test_an_unbounded_softmax_cache_has_no_slot():
    lm = _model(["softmax"])
    with pytest.raises(ValueError, match="served by the engine's paged attention"):
        layer_layout("softmax", lm.layers[0], 64, 64)


def test_reading_a_new_sequence_is_refused():
    lm = _model(["delta"])
    layout = layer_layout("delta", lm.layers[0], 64, 64)
    with pytest.raises(ValueError, match="a new sequence has none"):
        layout.read(torch.zeros(1, layout.size), torch.tensor([0]), 0)


# -- the engine settings the plugin refuses (linattn.serve.config) ----------------------------------------------


def _config(kinds, **fields) -> LMConfig:
    return LMConfig(d_model=64, n_layers=len(kinds), attention=kinds, **head_fields(kinds, n_heads=2), **fields)


def test_served_settings_are_checked_by_name():
    from linattn.serve.config import check_served_config, layer_types

    sizes = [32, 64, 128]
    hybrid = _config(["gated-delta", "softmax"])
    assert layer_types(hybrid) == ["linattn_state", "full_attention"]
    check_served_config(hybrid, torch.float32, sizes, prefix_caching=False)
    check_served_config(_config(["softmax"]), torch.float32, sizes, prefix_caching=True)  # paged layers only
    with pytest.raises(ValueError, match=r"served in float32, got dtype torch.bfloat16: pass --dtype float32"):
        check_served_config(hybrid, torch.bfloat16, sizes, prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching is not supported .* --no-enable-prefix-caching"):
        check_served_config(hybrid, torch.float32, sizes, prefix_caching=True)
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        check_served_config(hybrid, torch.float32, sizes, prefix_caching=False, speculative=True)
    with pytest.raises(ValueError, match=r"head_dim=16, but vLLM's attention backend here takes head sizes"):
        check_served_config(_config(["softmax"], head_dim=16), torch.float32, sizes, prefix_caching=False)
    check_served_config(_config(["gated-delta"], head_dim=16), torch.float32, sizes, prefix_caching=False)
