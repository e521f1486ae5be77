"""linattn.models: LMConfig parsing, the LM's decoding/causality/aux contracts, generation,
sampling and the Transformer-XL carry. Models are tiny and run in float64."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from _helpers import assert_causal_jacobian, head_fields
from linattn.models import LM, LMConfig, sample_next
from linattn.state import KVCacheState, LMState, _State

torch.set_num_threads(1)

ALL_KINDS = ["vq", "softmax", "linear:elu", "favor:16", "delta", "local:5", "linear:dpfp", "soft-vq",
             "gau-softmax", "delta:dpfp", "retnet", "gla", "gated-delta", "vq-attn:rerope", "vq-attn:bias",
             "linear:hedgehog"]
RECURRENT = ["vq", "linear:elu", "favor:16", "delta", "local:5", "linear:dpfp", "soft-vq", "delta:dpfp", "retnet",
             "gla", "gated-delta", "vq-attn:rerope", "vq-attn:bias", "linear:hedgehog"]
FIXED_SIZE = ["linear:elu", "favor:16", "delta", "delta:dpfp", "retnet", "gla", "gated-delta",
              "linear:hedgehog"]  # the same at every step
TINY = dict(d_model=16, n_heads=2, chunk_size=4, gau_d_k=8, codebook_size=8, block_size=4, ffn_hidden=32)


def make_model(attention, n_layers=None, *, seed=0, vocab_size=256, **overrides):
    """A tiny float64 LM in eval mode."""
    if n_layers is None:
        n_layers = len(attention) if isinstance(attention, list) else len(attention.split(","))
    options = head_fields(attention, **{**TINY, **overrides})
    config = LMConfig(vocab_size=vocab_size, n_layers=n_layers, attention=attention, **options)
    torch.manual_seed(seed)
    return LM(config).double().eval()


def random_ids(B, T, *, vocab=256, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def state_tensors(value):
    """Every tensor inside a (nested) decode state."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple):
        return [t for item in value for t in state_tensors(item)]
    if isinstance(value, _State):
        return [t for f in dataclasses.fields(value) for t in state_tensors(getattr(value, f.name))]
    return []


def state_numel(state):
    return sum(t.numel() for t in state_tensors(state))


@pytest.fixture(scope="module")
def hybrid():
    return make_model(ALL_KINDS)


# ----------------------------------------------------------------------------- decoding


def _decode_token_by_token(model, ids):
    state, pieces = None, []
    for i in range(ids.shape[1]):
        logits, state, _ = model(ids[:, i : i + 1], state)
        pieces.append(logits)
    return torch.cat(pieces, dim=1), state


def test_hybrid_covers_every_layer_kind(hybrid):
    assert [str(s) for s in hybrid.specs] == ALL_KINDS
    assert len(hybrid.layers) == len(ALL_KINDS)


@torch.no_grad()
def test_hybrid_token_by_token_decoding_equals_full_pass(hybrid):
    ids = random_ids(2, 13, seed=1)
    full, full_state, _ = hybrid(ids)
    assert full.dtype == torch.float64 and full.shape == (2, 13, 256)
    stepped, state = _decode_token_by_token(hybrid, ids)
    torch.testing.assert_close(stepped, full, atol=1e-10, rtol=0)
    assert state.steps == full_state.steps == 13


@torch.no_grad()
def test_hybrid_two_pieces_equal_full_pass(hybrid):
    ids = random_ids(2, 13, seed=2)
    full, _, _ = hybrid(ids)
    first, state, _ = hybrid(ids[:, :6])
    assert state.steps == 6
    second, state, _ = hybrid(ids[:, 6:], state)
    assert state.steps == 13
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind", ALL_KINDS)
@torch.no_grad()
def test_single_kind_decoding_equals_full_pass(kind):
    model = make_model(kind, n_layers=2, seed=3)
    ids = random_ids(2, 13, seed=4)
    full, _, _ = model(ids)
    stepped, _ = _decode_token_by_token(model, ids)
    torch.testing.assert_close(stepped, full, atol=1e-10, rtol=0)
    first, state, _ = model(ids[:, :6])
    second, _, _ = model(ids[:, 6:], state)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=1e-10, rtol=0)
    # the check can fail: a model that ignores its state would not match
    fresh, _, _ = model(ids[:, 6:])
    assert (fresh - full[:, 6:]).abs().max() > 1e-6


@torch.no_grad()
def _state_sizes(model, steps):
    ids = random_ids(2, steps, seed=5)
    state, sizes = None, []
    for i in range(steps):
        _, state, _ = model(ids[:, i : i + 1], state)
        sizes.append(state_numel(state))
    return sizes  # sizes[t - 1] = after t steps


@pytest.mark.parametrize("kind", ["vq", "local:5", "soft-vq", *FIXED_SIZE])
def test_recurrent_state_size_is_constant(kind):
    block = TINY["block_size"]
    sizes = _state_sizes(make_model(kind, n_layers=1), 45)
    # VQ keeps the current partial block, so its size cycles with period block_size; compare
    # positions of the same phase (5 and 41 = 5 + 9 * block_size) and bound the whole run.
    assert (41 - 5) % block == 0
    assert sizes[5 - 1] == sizes[41 - 1]
    assert sizes[40 - 1] == sizes[8 - 1]
    assert max(sizes) == max(sizes[: 2 * block + 5])
    if kind in FIXED_SIZE:
        assert len(set(sizes)) == 1


@pytest.mark.parametrize("kind", ["softmax", "gau-softmax"])
def test_softmax_state_grows(kind):
    sizes = _state_sizes(make_model(kind, n_layers=1), 41)
    assert sizes[40 - 1] > sizes[5 - 1]
    assert all(b > a for a, b in zip(sizes, sizes[1:]))
    assert sizes[40 - 1] == 8 * sizes[5 - 1]  # linear in the number of tokens


# ----------------------------------------------------------------------------- causality


@torch.no_grad()
def test_hybrid_logits_do_not_see_the_future(hybrid):
    ids = random_ids(2, 13, seed=6)
    base, _, _ = hybrid(ids)
    for i in (0, 3, 4, 7, 11):
        changed = ids.clone()
        changed[:, i + 1 :] = (ids[:, i + 1 :] + 1 + torch.arange(12 - i)) % 256
        logits, _, _ = hybrid(changed)
        torch.testing.assert_close(logits[:, : i + 1], base[:, : i + 1], atol=1e-12, rtol=0,
                                   msg=lambda m: f"positions <= {i} changed: {m}")
        assert (logits[:, i + 1 :] - base[:, i + 1 :]).abs().max() > 1e-8  # the change does matter


def _embedding_hook(model, embedded):
    """Replace the embedding output by ``embedded`` (a leaf tensor requiring grad)."""
    return model.embed.register_forward_hook(lambda module, inputs, output: embedded)


def test_hybrid_gradient_causality_through_embedding(hybrid):
    ids = random_ids(1, 11, seed=7)
    T = ids.shape[1]
    with torch.no_grad():
        embedded = hybrid.embed(ids).clone()
    embedded.requires_grad_(True)
    handle = _embedding_hook(hybrid, embedded)
    try:
        logits, _, _ = hybrid(ids)
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0), dtype=logits.dtype)
        for i in range(T):
            (grad,) = torch.autograd.grad((logits[:, i] * weights[:, i]).sum(), embedded, retain_graph=True)
            assert (grad[:, i + 1 :] == 0).all(), f"logits at {i} depend on embeddings after {i}"
            assert grad[:, i].abs().sum() > 0
            if i > 0:
                assert grad[:, :i].abs().sum() > 0, f"logits at {i} ignore the past"
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_causal_jacobian_per_kind(kind):
    model = make_model(kind, n_layers=1, vocab_size=12, seed=8)
    ids = random_ids(1, 7, vocab=12, seed=9)
    with torch.no_grad():
        start = model.embed(ids).clone().unsqueeze(1)  # [B, 1, T, D]

    def fn(embedded):
        handle = _embedding_hook(model, embedded.squeeze(1))
        try:
            logits, _, _ = model(ids)
        finally:
            handle.remove()
        return logits.unsqueeze(1)  # [B, 1, T, V]

    assert_causal_jacobian(fn, [start], ["embedding"])


# ----------------------------------------------------------------------------- aux


@pytest.mark.parametrize("attention, has_vq", [("vq", True), ("local:4,vq", True), ("softmax", False),
                                               ("linear:elu,delta", False), ("soft-vq", False),
                                               ("gau-softmax", False)])
def test_aux_commit_loss_and_perplexity(attention, has_vq):
    model = make_model(attention, n_layers=2).train()
    logits, _, aux = model(random_ids(2, 10, seed=10))
    commit, perplexity = aux["commit_loss"], aux["codebook_perplexity"]
    if has_vq:
        assert commit.item() > 0
        assert commit.grad_fn is not None and commit.requires_grad
        (grad,) = torch.autograd.grad(commit, [p for n, p in model.named_parameters() if "w_k" in n][0])
        assert grad.abs().sum() > 0  # the commitment loss reaches the key projection
        assert perplexity is not None
        assert 1.0 <= float(perplexity) <= model.config.codebook_size
    else:
        assert commit.item() == 0
        assert perplexity is None


def test_perplexity_matches_code_histogram():
    """One VQ unit: exp(entropy) of the histogram of the codes it picked, recomputed here."""
    model = make_model("vq", n_layers=1).eval()
    ids = random_ids(2, 10, seed=11)
    captured = []
    handles = [q.register_forward_hook(lambda m, i, o: captured.append(o[1].flatten())) for q in model.quantizers()]
    try:
        _, _, aux = model(ids)
    finally:
        for h in handles:
            h.remove()
    assert len(captured) == 2
    expected = []
    for codes in captured:
        counts = torch.tensor([float((codes == s).sum()) for s in range(8)])
        p = counts / counts.sum()
        p = p[p > 0]
        expected.append(math.exp(-(p * p.log()).sum().item()))
    assert float(aux["codebook_perplexity"]) == pytest.approx(sum(expected) / len(expected), rel=1e-5)


# ----------------------------------------------------------------------------- LMConfig


def test_pattern_repeats_to_n_layers():
    config = LMConfig(n_layers=4, attention="local:4,vq", **TINY)
    specs = config.layer_specs()
    assert [(s.kind, s.option) for s in specs] == [("local", "4"), ("vq", None), ("local", "4"), ("vq", None)]
    assert [type(layer).__name__ for layer in LM(config).layers] == ["PreNormBlock", "GAUPair"] * 2
    model = LM(config)
    assert [str(s) for s in model.specs] == ["local:4", "vq", "local:4", "vq"]
    assert LMConfig(n_layers=3, attention=["vq", "delta"], **TINY).layer_specs()[2].kind == "vq"
    assert [str(s) for s in LMConfig(n_layers=2, attention="softmax", **TINY).layer_specs()] == ["softmax"] * 2


def test_pattern_longer_than_n_layers_errors():
    with pytest.raises(ValueError, match="n_layers"):
        LMConfig(n_layers=2, attention="vq,delta,softmax", **TINY)
    with pytest.raises(ValueError, match="n_layers"):
        LMConfig(n_layers=1, attention=["vq", "delta"], **TINY)


@pytest.mark.parametrize("spec", ["linear:foo", "favor:x", "local:0", "bogus", "vq:3", "", "favor:0",
                                  "softmax:2", "linear:dpfp:0"])
def test_bad_layer_specs_list_valid_ones(spec):
    with pytest.raises(ValueError) as info:
        LMConfig(n_layers=1, attention=spec, **TINY)
    message = str(info.value)
    for valid in ("'vq'", "linear:elu", "favor", "delta", "local"):
        assert valid in message, f"{valid} missing from {message!r}"


def test_from_dict_unknown_key_is_named():
    with pytest.raises(ValueError, match="d_modle"):
        LMConfig.from_dict({"d_modle": 32})
    config = LMConfig.from_dict({**TINY, "n_layers": 2, "attention": "vq,delta"})
    assert LMConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("field, value", [("d_model", 0), ("n_layers", -1), ("codebook_size", 0),
                                          ("block_size", 2.5), ("chunk_size", True), ("softmax_memory", -1)])
def test_invalid_ints_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LMConfig(**{**TINY, field: value})


# ----------------------------------------------------------------------------- input checks


def test_ids_validation():
    model = make_model("vq", n_layers=1)
    with pytest.raises(TypeError):
        model(torch.rand(2, 5))
    with pytest.raises(TypeError):
        model([[1, 2, 3]])
    with pytest.raises(ValueError, match="256"):
        model(torch.tensor([[0, 256]]))
    with pytest.raises(ValueError):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError):
        model(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError):
        model(torch.zeros(1, 0, dtype=torch.long))
    model(torch.tensor([[0, 255]]))  # both ends of the vocabulary are fine


def test_state_validation():
    model = make_model("vq,delta", n_layers=2)
    ids = random_ids(1, 4)
    with pytest.raises(ValueError, match="state"):
        model(ids, {"layers": ()})
    with pytest.raises(ValueError, match="state"):
        model(ids, LMState(layers=(None,), steps=0))
    _, state, _ = model(ids)
    with pytest.raises(ValueError, match="state"):
        model(ids, state.layers[0])


# ----------------------------------------------------------------------------- generation


def _greedy_by_full_pass(model, prompt, n):
    """Greedy continuation written independently: re-run the whole sequence each step."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits, _, _ = model(torch.tensor([sequence]))
            sequence.append(int(logits[0, -1].argmax()))
    return sequence[len(prompt):]


def test_generate_same_seed_same_tokens(hybrid):
    prompt = [72, 105, 33]
    a = list(hybrid.generate(prompt, 12, seed=5))
    b = list(hybrid.generate(prompt, 12, seed=5))
    assert a == b and len(a) == 12
    assert all(isinstance(t, int) and 0 <= t < 256 for t in a)
    others = [list(hybrid.generate(prompt, 12, seed=s)) for s in (6, 7, 8)]
    assert any(o != a for o in others)


def test_generate_temperature_zero_is_greedy(hybrid):
    prompt = [10, 20, 30, 40, 50]
    expected = _greedy_by_full_pass(hybrid, prompt, 10)
    assert list(hybrid.generate(prompt, 10, temperature=0)) == expected
    assert list(hybrid.generate(torch.tensor(prompt), 10, temperature=1.0, top_k=1, seed=3)) == expected


def test_generate_batched_prompt_yields_rows():
    model = make_model("vq,local:5", n_layers=2)
    prompt = random_ids(3, 4, seed=12)
    tokens = list(model.generate(prompt, 5, temperature=0))
    assert len(tokens) == 5
    for token in tokens:
        assert isinstance(token, torch.Tensor) and token.shape == (3,) and token.dtype == torch.int64
    for row in range(3):
        assert [int(t[row]) for t in tokens] == _greedy_by_full_pass(model, prompt[row].tolist(), 5)


def test_generate_zero_new_tokens_yields_nothing(hybrid):
    assert list(hybrid.generate([1, 2, 3], 0)) == []


@pytest.mark.parametrize("options", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=0),
                                     dict(top_k=-2), dict(top_k=2.5)])
def test_generate_bad_sampling_options(options):
    model = make_model("linear:elu", n_layers=1)
    with pytest.raises(ValueError):
        list(model.generate([1, 2], 3, **options))


def test_generate_bad_max_new_tokens():
    model = make_model("linear:elu", n_layers=1)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError):
            list(model.generate([1, 2], bad))


@pytest.mark.parametrize("training", [True, False])
def test_generate_restores_training_flag(training):
    model = make_model("vq", n_layers=1)
    model.train(training)
    modes = []
    handle = model.embed.register_forward_hook(lambda m, i, o: modes.append(m.training))
    try:
        list(model.generate([1, 2, 3], 4, seed=0))
    finally:
        handle.remove()
    assert modes and not any(modes)  # generation runs in eval mode
    assert model.training is training
    assert all(m.training is training for m in model.modules())


def test_generate_leaves_codebook_untouched():
    model = make_model("vq", n_layers=1).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    list(model.generate([1, 2, 3], 6, seed=0))
    model.update_codebooks()  # would apply any statistics gathered while generating
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


# ----------------------------------------------------------------------------- sampling


def _draws(logits, n, **options):
    generator = torch.Generator().manual_seed(0)
    return sample_next(logits.unsqueeze(0).expand(n, -1), generator=generator, **options)


def test_sample_next_top_k_only_largest():
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.9, 1.7, -0.2, 0.0])
    draws = _draws(logits, 4000, top_k=3)
    allowed = set(sorted(range(8), key=lambda i: -logits[i].item())[:3])  # {1, 5, 3}
    assert set(draws.tolist()) == allowed
    assert draws.dtype == torch.int64 and draws.shape == (4000,)


def test_sample_next_top_p_keeps_the_nucleus():
    logits = torch.tensor([0.6, 0.2, 0.1, 0.1]).log()
    assert set(_draws(logits, 3000, top_p=0.5).tolist()) == {0}
    assert set(_draws(logits, 3000, top_p=0.7).tolist()) == {0, 1}
    assert set(_draws(logits, 3000, top_p=1.0).tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sample_next_temperature_frequencies(temperature):
    logits = torch.tensor([1.0, 0.0, -0.5, 0.5])
    n = 20000
    draws = _draws(logits, n, temperature=temperature)
    frequencies = torch.bincount(draws, minlength=4).double() / n
    expected = torch.tensor([math.exp(x / temperature) for x in logits.tolist()], dtype=torch.float64)
    expected = expected / expected.sum()
    assert (frequencies - expected).abs().max() < 0.02
    untempered = logits.double().softmax(-1)
    if temperature != 1.0:  # the tolerance is tight enough to tell the temperatures apart
        assert (expected - untempered).abs().max() > 0.06


def test_sample_next_at_a_tiny_positive_temperature_is_the_argmax():
    """Logits divided by 1e-45 overflow to inf; any positive temperature must still sample, and one
    that small leaves only the largest logit."""
    logits = 10 * torch.randn(64, 300, generator=torch.Generator().manual_seed(2))
    for options in (dict(), dict(top_k=5), dict(top_p=0.9)):
        draws = sample_next(logits, temperature=1e-45, generator=torch.Generator().manual_seed(0), **options)
        assert torch.equal(draws, logits.argmax(-1)), options


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_row_of_logits_that_are_not_finite_draws_no_token(temperature):
    """A row holding NaN or inf (a forward pass that overflowed) gives -1, never a plausible id
    (argmax would take the NaN's place: token 0); the other rows draw as usual."""
    logits = torch.tensor([[float("nan"), 1.0, 0.0], [0.0, 3.0, 1.0], [float("inf"), 0.0, 1.0]])
    draws = sample_next(logits, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert draws[0] == -1 and draws[2] == -1 and 0 <= draws[1] < 3
    if temperature == 0:
        assert draws[1] == 1


def test_generate_stops_at_logits_that_are_not_finite():
    """A single prompt raises NonFiniteLogits, a ValueError, where its logits are not finite; a
    batch (read without host round trips) yields -1 in the rows concerned."""
    from linattn.models.sampling import NonFiniteLogits

    model = make_model("local:4", n_layers=1)
    with torch.no_grad():
        model.norm.weight.fill_(1e308)  # finite (float64), but the forward pass overflows
    with pytest.raises(NonFiniteLogits, match="generated token 1 are not finite"):
        list(model.generate([1, 2, 3], 3, temperature=0))
    tokens = list(model.generate([[1, 2, 3], [4, 5, 6]], 2, temperature=0.8, seed=0))
    assert all(torch.equal(token, torch.tensor([-1, -1])) for token in tokens)


def test_sample_next_temperature_zero_is_argmax():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample_next(logits, temperature=0), logits.argmax(-1))


# ----------------------------------------------------------------------------- carry


def test_carry_detaches_every_tensor():
    model = make_model(ALL_KINDS, seed=1).train()
    _, state, _ = model(random_ids(2, 9, seed=13))
    assert any(t.grad_fn is not None for t in state_tensors(state))
    carried = model.carry(state)
    assert isinstance(carried, LMState) and carried.steps == state.steps == 9
    tensors = state_tensors(carried)
    assert tensors and all(t.grad_fn is None and not t.requires_grad for t in tensors)


@pytest.mark.parametrize("memory", [0, 3, 50])
def test_carry_truncates_softmax_cache(memory):
    model = make_model("softmax,linear:elu", n_layers=2, softmax_memory=memory)
    _, state, _ = model(random_ids(2, 9, seed=14))
    cache = state.layers[0]
    assert isinstance(cache, KVCacheState) and cache.keys.shape[2] == 9
    carried = model.carry(state).layers[0]
    kept = min(memory, 9)
    assert carried.keys.shape[2] == carried.values.shape[2] == kept
    assert torch.equal(carried.keys, cache.keys[:, :, 9 - kept :])
    assert torch.equal(carried.values, cache.values[:, :, 9 - kept :])
    assert carried.steps == 9
    # the linear layer's state is carried unchanged
    assert torch.equal(model.carry(state).layers[1].kv, state.layers[1].kv)


@pytest.mark.parametrize("memory", [0, 3])
def test_carry_bounds_gau_softmax_cache(memory):
    """``carry`` promises bounded memory across training windows for every softmax cache,
    the GAU's quadratic twin included (otherwise training with carried state is quadratic
    in the length of a pass over the data)."""
    model = make_model("gau-softmax", n_layers=1, softmax_memory=memory)
    ids = random_ids(2, 9, seed=15)
    _, state, _ = model(ids)
    carried = model.carry(state)
    for _ in range(3):
        _, state, _ = model(ids, carried)
        carried = model.carry(state)
    for unit_state in carried.layers[0]:
        assert unit_state.keys.shape[2] <= memory


@pytest.mark.parametrize("kind", RECURRENT + ["softmax-with-memory"])
@torch.no_grad()
def test_carry_across_windows_equals_one_pass(kind):
    if kind == "softmax-with-memory":
        model = make_model("softmax", n_layers=2, softmax_memory=64)
    else:
        model = make_model(kind, n_layers=2, seed=2)
    ids = random_ids(2, 14, seed=16)
    full, _, _ = model(ids)
    first, state, _ = model(ids[:, :7])
    second, _, _ = model(ids[:, 7:], model.carry(state))
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=1e-10, rtol=0)


# ------------------------------------------------------------------- bfloat16 autocast


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_bf16_autocast_training_step_and_decoding(kind):
    """Under torch.autocast(bfloat16) every layer kind trains (finite loss and gradients)
    and its logits stay close to the float32 model's; decoding under autocast works too."""
    torch.manual_seed(0)
    model = LM(LMConfig(n_layers=1, attention=kind, **head_fields(kind, **TINY))).train()
    ids = random_ids(2, 11)
    with torch.no_grad():
        reference, _, _ = model.eval()(ids)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, state, aux = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()) + aux["commit_loss"]
    assert logits.dtype == torch.float32
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert (logits.detach() - reference).abs().max() < 0.1  # bf16 has ~3 significant digits
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        step_logits, _, _ = model(ids[:, :1], state)
    assert torch.isfinite(step_logits).all()


# ----------------------------------------------------------------------------- tied embeddings


def _final_hidden_and_logits(model, ids):
    """The final-norm output h [B, T, d_model] (read with a hook) and the logits."""
    captured = []
    handle = model.norm.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        logits, _, _ = model(ids)
    finally:
        handle.remove()
    (hidden,) = captured
    return hidden, logits


def test_tied_embeddings_project_with_the_embedding_matrix():
    tied = make_model("vq", n_layers=1)
    assert tied.config.tie_embeddings
    names = [name for name, _ in tied.named_parameters()]
    assert not any(name.startswith("head") for name in names), names
    ids = random_ids(2, 9, seed=20)
    with torch.no_grad():
        hidden, logits = _final_hidden_and_logits(tied, ids)
    torch.testing.assert_close(logits, hidden @ tied.embed.weight.T, atol=1e-12, rtol=0)

    untied = make_model("vq", n_layers=1, tie_embeddings=False)
    assert any(name.startswith("head") for name, _ in untied.named_parameters())
    with torch.no_grad():
        hidden, logits = _final_hidden_and_logits(untied, ids)
    assert (logits - hidden @ untied.embed.weight.T).abs().max() > 1e-3  # the check above can fail


def test_a_step_on_the_tied_embedding_moves_the_output_projection():
    """A token absent from the input reaches the loss only through the output projection:
    its embedding row gets a gradient, and stepping it changes exactly its logit column."""
    model = make_model("vq", n_layers=1, vocab_size=64)
    ids = random_ids(2, 9, vocab=32, seed=21)
    absent = 40
    assert not (ids == absent).any()
    hidden, logits = _final_hidden_and_logits(model, ids)
    logits[..., absent].sum().backward()
    row_step = -0.5 * model.embed.weight.grad[absent]
    assert row_step.abs().max() > 0, "the output projection does not use the embedding"
    with torch.no_grad():
        model.embed.weight[absent] += row_step
        new_logits, _, _ = model(ids)
    others = [t for t in range(64) if t != absent]
    torch.testing.assert_close(new_logits[..., others], logits.detach()[..., others], atol=1e-12, rtol=0)
    expected_change = hidden.detach() @ row_step
    assert expected_change.abs().max() > 1e-6
    torch.testing.assert_close(new_logits[..., absent] - logits.detach()[..., absent], expected_change,
                               atol=1e-12, rtol=0)


@pytest.mark.parametrize("vocab_size, d_model", [(256, 16), (97, 24)])
def test_untying_adds_exactly_one_vocab_by_d_model_matrix(vocab_size, d_model):
    tied = make_model("vq", n_layers=1, vocab_size=vocab_size, d_model=d_model)
    untied = make_model("vq", n_layers=1, vocab_size=vocab_size, d_model=d_model, tie_embeddings=False)
    assert untied.num_parameters() - tied.num_parameters() == vocab_size * d_model
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == (
        vocab_size * d_model
    )


def test_default_ffn_width_and_matched_gau_width():
    """SwiGLU width 8/3 d_model rounded up to a multiple of 32; the matched GAU value width
    makes a VQ layer the size of an attention + SwiGLU block (within 2%)."""
    from linattn.models.config import matched_gau_value_width

    assert LMConfig(d_model=128).ffn_width == 352 and LMConfig(d_model=96).ffn_width == 256
    assert LMConfig(d_model=96, ffn_hidden=50).ffn_width == 50
    for d_model, d_k in ((128, 64), (256, 128)):
        block = LM(LMConfig(d_model=d_model, n_layers=1, attention="softmax", n_heads=4)).num_parameters()
        width = matched_gau_value_width(d_model, d_k)
        gau = LM(LMConfig(d_model=d_model, n_layers=1, attention="vq", gau_d_k=d_k, gau_d_v=width,
                          codebook_size=8)).num_parameters()
        assert width % 8 == 0 and abs(gau - block) / block < 0.02, (d_model, width, gau, block)


# ----------------------------------------------------------------------------- mutation gaps (2026-12-01)


def test_sample_next_top_p_of_one_filters_nothing(monkeypatch):
    """top_p = 1 keeps every token, even one whose probability (2e-9) is below float32's
    resolution near 1, where the mass of the more likely tokens rounds to exactly 1."""
    sampled_from = []
    multinomial = torch.multinomial

    def recording(probs, *args, **kwargs):
        sampled_from.append(probs.clone())
        return multinomial(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", recording)
    logits = torch.tensor([[0.0, -20.0, -3.0], [-20.0, 0.0, 0.0]])
    for top_p in (None, 1.0):
        sampled_from.clear()
        sample_next(logits, top_p=top_p, generator=torch.Generator().manual_seed(0))
        (probs,) = sampled_from
        expected = logits.double().softmax(-1)
        assert (probs > 0).all(), (top_p, probs)
        torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=0)


def test_sample_next_nucleus_that_reaches_p_exactly_stops_there():
    """Four equally likely tokens (1/4 each, exact in float32): the smallest set whose mass
    reaches p = 1/4, 1/2, 3/4 has 1, 2, 3 tokens; a token after the mass reached p is dropped."""
    logits = torch.zeros(4)
    for top_p, size in ((0.25, 1), (0.5, 2), (0.75, 3)):
        kept = set(_draws(logits, 2000, top_p=top_p).tolist())
        assert len(kept) == size, (top_p, kept)


def test_builtin_output_projections_get_the_residual_std():
    """GPT-2's residual scaling on the built-in kinds: the maps that write into the residual
    stream (attention o_proj, SwiGLU w_down, each GAU unit's w_o) start with
    init_std / sqrt(2 n_layers) = 0.5 / 4, every other linear map and the embedding with 0.5."""
    config = LMConfig(d_model=32, n_heads=2, n_layers=8, attention="softmax,vq", init_std=0.5, gau_d_k=8,
                      codebook_size=8, block_size=4, ffn_hidden=64)
    torch.manual_seed(0)
    model = LM(config)
    outputs = ("mixer.o_proj", "ffn.w_down", "units.0.w_o", "units.1.w_o")
    residual, other = [], []
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            (residual if name.endswith(outputs) else other).append(module.weight.detach().flatten())
    assert len(residual) == 4 * 2 + 4 * 2  # four softmax blocks (o_proj, w_down), four GAU pairs (w_o twice)
    assert torch.cat(residual).std().item() == pytest.approx(0.5 / math.sqrt(2 * 8), rel=0.05)
    assert torch.cat(other).std().item() == pytest.approx(0.5, rel=0.05)


def test_codebook_usage_averages_the_quantizers():
    """Mean over the VQ units of their mean per-head perplexity, and the dead codes summed;
    None for a model without VQ units."""
    model = make_model("vq", n_layers=2)
    quantizers = model.quantizers()
    assert len(quantizers) == 4  # two GAU units per layer
    S = TINY["codebook_size"]
    for i, quantizer in enumerate(quantizers):  # unit i uses S - i codes equally, i codes never
        counts = torch.ones_like(quantizer.ema_counts)
        counts[:, :i] = 0.0
        with torch.no_grad():
            quantizer.ema_counts.copy_(counts)
    usage = model.codebook_usage()
    heads = quantizers[0].n_heads
    assert usage["perplexity"] == pytest.approx(sum(S - i for i in range(4)) / 4, rel=1e-5)
    assert usage["dead_codes"] == heads * (0 + 1 + 2 + 3)
    assert make_model("softmax", n_layers=1).codebook_usage() is None


def test_generate_feeds_each_token_back_once():
    """The prompt is read in one pass, then each produced token but the last is fed back as
    the next single-token input (the last one's logits would go unused)."""
    model = make_model("linear:elu", n_layers=1)
    seen = []
    handle = model.embed.register_forward_hook(lambda module, args, output: seen.append(args[0].tolist()))
    try:
        tokens = list(model.generate([5, 6, 7], 4, seed=1))
        one = list(model.generate([5, 6, 7], 1, seed=1))
    finally:
        handle.remove()
    assert seen == [[[5, 6, 7]]] + [[[t]] for t in tokens[:-1]] + [[[5, 6, 7]]]
    assert one == tokens[:1]


@pytest.mark.parametrize("logits", [torch.zeros(5), torch.zeros(2, 3, 5), torch.zeros(2, 5, dtype=torch.long)])
def test_sample_next_takes_logits_of_shape_batch_by_vocab(logits):
    with pytest.raises(ValueError, match=r"logits must be a float tensor \[batch, vocab\]"):
        sample_next(logits, temperature=1.0, top_k=2)


def test_default_codebooks_are_ready_before_training():
    """k-means initialisation is opt-in (beyond the paper): by default every VQ codebook is
    usable at construction and the first training batch is quantized, not clustered."""
    model = LM(LMConfig(d_model=16, n_layers=1, gau_d_k=8, codebook_size=8, block_size=4))
    assert model.quantizers() and all(bool(q.initialized) for q in model.quantizers())
    opted = LM(LMConfig(d_model=16, n_layers=1, gau_d_k=8, codebook_size=8, block_size=4, kmeans_init=True))
    assert not any(bool(q.initialized) for q in opted.quantizers())


@pytest.mark.parametrize("value", [0.0, 0.5])
def test_sinusoid_dropout_in_zero_to_one_is_accepted(value):
    assert LMConfig(sinusoid_dropout=value).gau_options()["sinusoid_dropout"] == value


@pytest.mark.parametrize("value", [1.0, -0.1, "0.1"])
def test_sinusoid_dropout_outside_zero_to_one_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"LMConfig.sinusoid_dropout must be in \[0, 1\) or None"):
        LMConfig(sinusoid_dropout=value)


def test_gau_options_fill_unset_fields_from_the_variant():
    # the defaults documented in LMConfig: linattn 0 / 1e4 / "cache" / "mean", paper 0.2 / 1e5 / "state" / "paper"
    assert LMConfig().gau_options() == dict(variant="linattn", sinusoid_dropout=0.0, sinusoid_wavelength=1e4,
                                            grad_scope="cache", commitment_reduction="mean")
    assert LMConfig(gau_variant="paper").gau_options() == dict(variant="paper", sinusoid_dropout=0.2,
                                                               sinusoid_wavelength=1e5, grad_scope="state",
                                                               commitment_reduction="paper")


def test_check_inputs_false_does_not_read_the_ids():
    model = make_model("linear:elu", vocab_size=8)
    ids = torch.tensor([[1, 8]])
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 8\)"):
        model(ids)
    with pytest.raises(IndexError):  # not range-checked: the embedding's indexing fails instead
        model(ids, check_inputs=False)


def test_update_codebooks_updates_every_quantizer(monkeypatch):
    model = make_model("vq,vq")
    calls = []
    for quantizer in model.quantizers():
        monkeypatch.setattr(quantizer, "update",
                            lambda apply=None, quantizer=quantizer: calls.append((quantizer, apply)))
    model.update_codebooks()
    assert len(calls) >= 2 and calls == [(q, None) for q in model.quantizers()]
    flag = torch.tensor(False)
    calls.clear()
    model.update_codebooks(apply=flag)  # the trainer's guard: a non-finite step's statistics are dropped
    assert calls == [(q, flag) for q in model.quantizers()]


def test_activation_checkpointing_recomputes_only_when_on_and_under_grad():
    plain = make_model("linear:elu", vocab_size=32)
    assert plain.activation_checkpointing is False
    recomputed = make_model("linear:elu", vocab_size=32)
    recomputed.activation_checkpointing = True
    ids = random_ids(2, 5, vocab=32)
    grads = []
    for model, forwards in ((plain, 1), (recomputed, 2)):
        calls = []
        model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
        with torch.no_grad():
            model(ids)
        assert len(calls) == 1
        logits, _, _ = model(ids)
        grads.append(torch.autograd.grad(logits.square().sum(), list(model.parameters()), allow_unused=True))
        assert len(calls) == 1 + forwards
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
