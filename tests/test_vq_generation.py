"""``LM.generate``'s native token loop for VQ models (``models/_vq_generation.py``, the native
``VQModelStep``) against the step through ``LM._run``: the same logits and states in float64
across block boundaries, batch > 1, both GAU variants, tied and untied heads, prompts that end
inside a block and on its edge; the same tokens from ``generate``; a parameter written between
two tokens is seen (the loop goes on through ``_run``); the thread count changes no bit; the
loop is taken only where it applies, and the native object's own checks name what is wrong."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from linattn import LM, LMConfig
from linattn.bench.decode_parts import torch_vq_steps
from linattn.models.sampling import NO_TOKEN, NonFiniteLogits, sample_next
from linattn.models._vq_generation import VQGeneration
from _helpers import generated, generated_with_a_write
from test_vq_native_block import at_one_and_two_threads

F64 = torch.float64


def _model(seed: int = 0, dtype=F64, **overrides) -> LM:
    torch.manual_seed(seed)
    settings = dict(vocab_size=40, d_model=16, n_layers=2, attention="vq", gau_d_k=8, gau_d_v=12, codebook_size=6,
                    block_size=4)
    model = LM(LMConfig(**{**settings, **overrides})).to(dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return model.eval()


def _stepped_by_run(model, state, ids):
    """Logits ``[B, T, V]`` and the state after feeding ``ids [B, T]`` one token at a time
    through ``_run``, each unit in its torch form (``LINATTN_VQ_STEP_IMPL=torch``: nothing
    of the native code the loop under test runs)."""
    logits = []
    with torch_vq_steps():
        for t in range(ids.shape[1]):
            step_logits, state, _ = model._run(ids[:, t : t + 1], state, with_aux=False)
            logits.append(step_logits)
    return torch.cat(logits, 1), state


def _assert_lm_states_equal(a, b):
    assert a.steps == b.steps and len(a.layers) == len(b.layers)
    for pair_a, pair_b in zip(a.layers, b.layers):
        for unit_a, unit_b in zip(pair_a, pair_b):
            assert unit_a.steps == unit_b.steps
            for name in ("partial_keys", "partial_values", "partial_codes", "cache_counts", "cache_means",
                         "prev_keys", "prev_values", "prev_codes"):
                left, right = getattr(unit_a, name), getattr(unit_b, name)
                assert (left is None) == (right is None), name
                if left is not None:
                    assert left.shape == right.shape, name
                    assert torch.allclose(left.double(), right.double(), rtol=1e-12, atol=1e-12), name


def _both_ways(model, ids, prompt):
    """After the prompt ``ids[:, :prompt]``, the rest of ``ids`` fed through ``_run`` (torch
    forms) and through the native loop: ``(native logits, native final state, run's logits,
    run's final state)``."""
    with torch.no_grad():
        _, state, _ = model(ids[:, :prompt])
        expected, expected_state = _stepped_by_run(model, state, ids[:, prompt:])
        _, state, _ = model(ids[:, :prompt])
        session = VQGeneration.start(model, state, ids.shape[0])
        assert session is not None
        got = torch.cat([session.step(ids[:, t]).clone() for t in range(prompt, ids.shape[1])], 1)
        return got, session.state(), expected, expected_state


WIDE = dict(vocab_size=150, d_model=80, gau_d_v=72)  # products of full 64-column tiles and a partial one


@pytest.mark.parametrize("variant", ["linattn", "paper"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("prompt", [1, 4, 6])  # inside the first block, on its edge, inside the second
@pytest.mark.parametrize("sizes", [{}, WIDE], ids=["narrow", "wide"])
def test_native_steps_equal_the_steps_through_run(variant, tied, prompt, sizes):
    model = _model(gau_variant=variant, tie_embeddings=tied, **sizes)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (3, prompt + 11), generator=torch.Generator().manual_seed(1))
    got, final, expected, expected_state = _both_ways(model, ids, prompt)
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12)
    _assert_lm_states_equal(final, expected_state)
    with torch.no_grad():  # the state it hands back continues as the one from _run
        after, _, _ = model._run(ids[:, :2], final, with_aux=False)
        expected_after, _, _ = model._run(ids[:, :2], expected_state, with_aux=False)
    assert torch.allclose(after, expected_after, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("attention", ["vq:rerope", "vq:rerope=2", "vq-fsq", "vq-fsq:rerope=3", "soft-vq",
                                       "soft-vq,vq"])
@pytest.mark.parametrize("prompt", [1, 6])
def test_native_steps_of_other_units_equal_the_steps_through_run(attention, prompt):
    """Units with ReRoPE, FSQ keys and soft VQ's soft keys."""
    model = _model(attention=attention, fsq_levels=(3, 4, 2))
    ids = torch.randint(0, 40, (3, prompt + 11), generator=torch.Generator().manual_seed(2))
    got, final, expected, expected_state = _both_ways(model, ids, prompt)
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12)
    _assert_lm_states_equal(final, expected_state)


@pytest.mark.parametrize("attention", ["vq", "vq-fsq", "soft-vq"])
def test_a_new_blocks_buffer_reads_none_of_its_uninitialised_memory(attention, monkeypatch):
    """At a block's end the next buffer is allocated uninitialised and written part by part:
    with every such allocation filled with NaN (codes with -1) first, the native steps and the
    torch steps across block edges give what they give on clean memory."""
    model = _model(attention=attention, fsq_levels=(3, 4, 2))
    ids = torch.randint(0, 40, (2, 14), generator=torch.Generator().manual_seed(3))
    clean_native, _, clean_run, _ = _both_ways(model, ids, 1)
    empty_like = torch.empty_like

    def poisoned(tensor, *args, **kwargs):
        out = empty_like(tensor, *args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty_like", poisoned)
    native, _, run, _ = _both_ways(model, ids, 1)
    assert torch.allclose(native, clean_native, rtol=1e-12, atol=1e-12)
    assert torch.allclose(run, clean_run, rtol=1e-12, atol=1e-12)


def test_native_steps_equal_the_steps_through_run_with_a_long_block():
    """Block 64: the relative terms' product (L + 1 = 65 columns) fills a whole tile of the
    native products, and the steps cross the block's edge."""
    ids = torch.randint(0, 40, (2, 72), generator=torch.Generator().manual_seed(7))
    got, _, expected, _ = _both_ways(_model(block_size=64), ids, 60)
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_scores_far_above_exps_range_stay_finite():
    """Scores in the thousands (a large content bias): the step's softmax subtracts its
    largest score before the exp, as the torch form does."""
    model = _model()
    with torch.no_grad():
        for layer in model.layers:
            for unit in layer.units:
                unit.content_bias.mul_(4000.0)
    ids = torch.randint(0, 40, (2, 14), generator=torch.Generator().manual_seed(8))
    got, _, expected, _ = _both_ways(model, ids, 5)
    assert expected.isfinite().all()
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_k=10, seed=3)])
def test_generate_gives_the_tokens_of_the_general_step(sampling, native_steps, monkeypatch):
    model = _model()
    prompt = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(2))
    native = generated(model, prompt, 13, **sampling)
    assert native_steps == [2] * 12  # every token after the first
    monkeypatch.setenv("LINATTN_VQ_STEP_IMPL", "torch")  # no native step: every token through _run
    general = generated(model, prompt, 13, **sampling)
    assert native_steps == [2] * 12
    assert torch.equal(native, general)


def test_a_parameter_written_between_tokens_is_seen(native_steps, monkeypatch):
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(4))

    def write(model):
        model.layers[1].units[0].w_o.weight.mul_(-3.0)
        model.norm.weight.add_(0.5)

    native = generated_with_a_write(_model(), prompt, 10, write)
    assert native_steps == [2] * 4  # tokens 2..5; the rest through _run after the write
    monkeypatch.setenv("LINATTN_VQ_STEP_IMPL", "torch")
    assert torch.equal(native, generated_with_a_write(_model(), prompt, 10, write))


def test_the_thread_count_changes_no_bit():
    model = _model(dtype=torch.float32, d_model=256, gau_d_k=64, gau_d_v=384, codebook_size=32, block_size=8)
    ids = torch.randint(0, 40, (8, 12), generator=torch.Generator().manual_seed(5))

    def run():
        with torch.no_grad():
            _, state, _ = model(ids[:, :3])
            session = VQGeneration.start(model, state, 8)
            return torch.cat([session.step(ids[:, t]).clone() for t in range(3, 12)], 1)

    one, two = at_one_and_two_threads(run)
    assert torch.equal(one, two)


def _state_of(model, batch=2):
    with torch.no_grad():
        return model(torch.randint(0, 40, (batch, 5), generator=torch.Generator().manual_seed(6)))[1]


def test_taken_only_where_it_applies(monkeypatch):
    model = _model()
    state = _state_of(model)
    with torch.no_grad():
        assert VQGeneration.start(model, state, 2) is not None
        handle = model.layers[0].units[1].register_forward_hook(lambda *args: None)
        assert VQGeneration.start(model, state, 2) is None  # a hook must be called
        handle.remove()
        handle = model.norm.register_forward_pre_hook(lambda *args: None)
        assert VQGeneration.start(model, state, 2) is None
        handle.remove()
        monkeypatch.setenv("LINATTN_VQ_STEP_IMPL", "torch")
        assert VQGeneration.start(model, state, 2) is None
        monkeypatch.delenv("LINATTN_VQ_STEP_IMPL")
        model.head = nn.Linear(16, 40, bias=True).double()  # a head with a bias is not read
        assert VQGeneration.start(model, state, 2) is None
        model.head = None
    assert VQGeneration.start(model, state, 2) is None  # gradients on
    model.train()
    with torch.no_grad():
        assert VQGeneration.start(model, state, 2) is None
    model.eval()
    hybrid = _model(attention="vq,softmax")
    with torch.no_grad():
        assert VQGeneration.start(hybrid, _state_of(hybrid), 2) is None


def test_half_precision_models_take_the_general_step():
    model = _model(dtype=torch.bfloat16)
    with torch.no_grad():
        assert VQGeneration.start(model, _state_of(model), 2) is None


def test_the_native_object_names_bad_arguments():
    model = _model()
    with torch.no_grad():
        session = VQGeneration.start(model, _state_of(model), 2)
        with pytest.raises(RuntimeError, match=r"token id 40 is not in \[0, 40\)"):
            session.native.step(torch.tensor([0, 40]), 1, session.logits, session.codes)
        with pytest.raises(RuntimeError, match=r"logits must be a contiguous \[B, V\]"):
            session.native.step(torch.tensor([0, 1]), 1, session.logits[:1], session.codes)
        with pytest.raises(RuntimeError, match=r"codes must be a contiguous \[units, B, 1\]"):
            session.native.step(torch.tensor([0, 1]), 1, session.logits, session.codes[:1])


def test_greedy_tokens_are_the_first_largest_logit_or_none():
    model = _model(tie_embeddings=False)
    with torch.no_grad():
        model.embed.weight[3] = float("inf")  # token 3 makes its row's logits NaN
        session = VQGeneration.start(model, _state_of(model), 2)
        tokens = session.step_greedy(torch.tensor([3, 1]))
        assert tokens[0] == NO_TOKEN
        assert tokens[1] == sample_next(session.logits[1:], temperature=0)[0] != NO_TOKEN
        model.embed.weight[3] = 0.5
        model.head.weight.copy_(model.head.weight[:1].expand(40, -1).clone())  # every logit the same
        session = VQGeneration.start(model, _state_of(model), 2)
        assert session.step_greedy(torch.tensor([0, 1])).tolist() == [0, 0]  # as torch.argmax: the first


def test_logits_that_overflow_in_a_native_step_give_no_token(native_steps):
    model = _model(tie_embeddings=False)
    with torch.no_grad():
        model.head.weight.copy_(model.head.weight[:1].expand(40, -1).clone())  # greedy always picks token 0
        model.embed.weight[0] = float("inf")  # and feeding token 0 overflows
    tokens = model.generate(torch.tensor([1, 2]), 4, temperature=0)
    assert next(tokens) == 0
    with pytest.raises(NonFiniteLogits, match="generated token 2 "):
        next(tokens)
    assert native_steps == [1]
    rows = list(model.generate(torch.tensor([[1, 2], [3, 4]]), 3, temperature=0))
    assert [row.tolist() for row in rows] == [[0, 0], [NO_TOKEN, NO_TOKEN], [NO_TOKEN, NO_TOKEN]]
