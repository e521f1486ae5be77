"""Gradient accumulation (``train.grad_accum_steps``, ``train/microbatch.py``): a step over a
batch of 8 streams read as 2 micro-batches of 4 equals the step over all 8 at once, in
float64 up to rounding -- loss, gradients, the codebook EMA update (statistics of both
micro-batches, applied once; dead-code restarts drawing from the keys of both) and the
carried states -- and a run with accumulation resumes exactly."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from linattn.models import LM, LMConfig
from linattn.state import LMState, _State
from linattn.train import TrainConfig, load_checkpoint, train
from linattn.train import trainer as trainer_module
from linattn.train.microbatch import join_states, split_rows, split_state
from linattn.train.trainer import accumulate_gradients
from _helpers import F64, assert_close_rel, english_like

CPU = torch.device("cpu")


def hybrid_config(**overrides) -> LMConfig:
    """VQ (with dead-code restarts), delta, linear and exact softmax layers: every kind of carried state."""
    options = dict(d_model=16, n_layers=4, attention="vq,delta,linear:elu,softmax", n_heads=2, gau_d_k=8,
                   codebook_size=32, block_size=4, chunk_size=4, ffn_hidden=32, softmax_memory=6,
                   dead_code_threshold=0.995)
    return LMConfig(**{**options, **overrides})


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def assert_states_close(actual, expected, path="state", rtol=1e-10):
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, path
        if expected.numel() == 0:
            assert actual.shape == expected.shape, path
        elif expected.is_floating_point():
            assert_close_rel(actual, expected, rtol=rtol, name=path)
        else:
            assert torch.equal(actual, expected), path
    elif isinstance(expected, tuple):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_states_close(a, e, f"{path}[{i}]", rtol)
    elif isinstance(expected, _State):
        for field in dataclasses.fields(expected):
            assert_states_close(getattr(actual, field.name), getattr(expected, field.name),
                                f"{path}.{field.name}", rtol)
    else:
        assert actual == expected, path


# ----------------------------------------------------------------------------- one step


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_two_micro_batches_of_four_equal_one_batch_of_eight(threads):
    """Two consecutive windows (the second starting from the carried states): the batch of 8
    written out here (one forward, mean cross-entropy + commitment loss, one backward) against
    ``accumulate_gradients`` with two micro-batches of rows 0-3 and 4-7, each carrying its own
    streams' state."""
    torch.manual_seed(0)
    whole = LM(hybrid_config()).double().train()
    parts = copy.deepcopy(whole)
    context = 12
    tokens = torch.randint(0, 256, (8, 2 * context + 1), generator=torch.Generator().manual_seed(1))
    carry_whole, carries_parts = None, [None, None]
    for window in range(2):
        inputs = tokens[:, window * context:(window + 1) * context]
        targets = tokens[:, window * context + 1:(window + 1) * context + 1]
        whole.zero_grad(set_to_none=True)
        parts.zero_grad(set_to_none=True)
        logits, state_whole, aux = whole(inputs, carry_whole)
        loss_whole = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        (loss_whole + aux["commit_loss"]).backward()
        loss, commit, states = accumulate_gradients(parts, inputs, targets, carries_parts, device=CPU)

        assert loss.dtype == F64 and len(states) == 2
        assert_close_rel(loss, loss_whole.detach(), rtol=1e-13, name="loss")
        # the commitment loss is float32 whatever the model (nn/quantizer.py)
        assert_close_rel(commit, aux["commit_loss"].detach(), rtol=1e-6, name="commit_loss")
        assert aux["commit_loss"] > 0
        for (name, p_whole), (_, p_parts) in zip(whole.named_parameters(), parts.named_parameters()):
            assert_close_rel(p_parts.grad, p_whole.grad, rtol=1e-10, name=f"grad {name}")
        # codebook statistics: both micro-batches counted, nothing yet applied
        for q_whole, q_parts in zip(whole.quantizers(), parts.quantizers()):
            assert torch.equal(q_parts.pending_counts, q_whole.pending_counts)
            assert q_whole.pending_counts.sum() == 8 * context * q_whole.n_heads
            torch.testing.assert_close(q_parts._pending_sums, q_whole._pending_sums, rtol=1e-6, atol=1e-6)
        # one EMA update each, from the same random state (dead-code restarts draw from it)
        rng = torch.get_rng_state()
        whole.update_codebooks()
        restarted = not torch.equal(rng, torch.get_rng_state())
        torch.set_rng_state(rng)
        parts.update_codebooks()
        assert restarted, "no dead-code restart drew a key: the restart candidates went untested"
        for name, buffer in whole.named_buffers():
            other = dict(parts.named_buffers())[name]
            if buffer.is_floating_point():
                torch.testing.assert_close(other, buffer, rtol=1e-6, atol=1e-6, msg=name)
            else:
                assert torch.equal(other, buffer), name
        # carried states: each micro-batch's, stacked in row order, is the batch's
        carry_whole = whole.carry(state_whole)
        carries_parts = [parts.carry(state) for state in states]
        assert_states_close(join_states(carries_parts), carry_whole)
        assert isinstance(carry_whole, LMState) and carry_whole.steps == (window + 1) * context


def test_accumulated_loss_is_the_mean_over_micro_batches_not_the_last_one():
    """With micro-batches of different difficulty, the reported loss is the step's mean
    (a sum over micro-batches, divided by their number)."""
    torch.manual_seed(0)
    model = LM(hybrid_config(attention="linear:elu", n_layers=1)).double()
    inputs = torch.cat([torch.zeros(2, 8, dtype=torch.long), torch.randint(0, 256, (2, 8))])
    targets = inputs.roll(-1, dims=1)
    loss, commit, _ = accumulate_gradients(model, inputs, targets, [None, None], device=CPU)
    with torch.no_grad():
        first = F.cross_entropy(model(inputs[:2])[0].flatten(0, 1), targets[:2].flatten())
        second = F.cross_entropy(model(inputs[2:])[0].flatten(0, 1), targets[2:].flatten())
    assert not torch.allclose(first, second)
    assert_close_rel(loss, (first + second) / 2, rtol=1e-14)
    assert commit == 0


def test_split_and_join_states_are_inverse_and_keep_row_order():
    torch.manual_seed(0)
    model = LM(hybrid_config()).double().eval()
    with torch.no_grad():
        _, state, _ = model(torch.randint(0, 256, (6, 9)))
    state = model.carry(state)
    pieces = split_state(state, 3)
    assert len(pieces) == 3
    rows = torch.tensor([2, 3])
    assert_states_close(pieces[1], state.select_batch(rows), rtol=0)
    assert_states_close(join_states(pieces), state, rtol=0)
    assert split_state(None, 2) == [None, None] and join_states([None, None]) is None
    with pytest.raises(ValueError, match="cannot cut a carried state of 6 rows into 4"):
        split_state(state, 4)
    with pytest.raises(ValueError, match="cannot cut 6 rows into 4"):
        split_rows(torch.zeros(6, 3), 4)


def test_grad_accum_steps_must_divide_the_batch():
    with pytest.raises(ValueError, match=r"^train\.grad_accum_steps must divide train\.batch_size, got 3 and 8$"):
        TrainConfig(batch_size=8, grad_accum_steps=3)
    with pytest.raises(ValueError, match=r"^train\.grad_accum_steps must be a positive int, got 0$"):
        TrainConfig(grad_accum_steps=0)
    assert TrainConfig(batch_size=8, grad_accum_steps=4).grad_accum_steps == 4


# ----------------------------------------------------------------------------- whole runs


def _records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def float64_runs(tmp_path_factory):
    """float64 trainings of 4 steps over 8 streams: in one batch, in 2 micro-batches, and in 2
    micro-batches stopped at step 2 and resumed."""
    root = tmp_path_factory.mktemp("accumulation")
    data = root / "corpus.txt"
    data.write_text(english_like(2400, seed=3))
    patch = pytest.MonkeyPatch()
    patch.setattr(trainer_module, "LM", lambda config: LM(config).double())
    torch.set_num_threads(1)

    def run(name, accumulate):
        config = TrainConfig(data=str(data), out=str(root / name), steps=4, batch_size=8,
                             grad_accum_steps=accumulate, context=16, lr=3e-3, warmup_steps=1, eval_every=0,
                             log_every=1, checkpoint_every=2, keep_checkpoints=4, threads=1)
        return train(hybrid_config(), config, progress=False, echo=lambda *a: None)

    try:
        runs = {"one": run("one", 1), "two": run("two", 2)}
        shutil.copytree(root / "two", root / "resumed")  # then continued from its step-2 checkpoint
        runs["resumed"] = train(None, None, resume=True, resume_from=2, out=root / "resumed", progress=False,
                                echo=lambda *a: None)
    finally:
        patch.undo()
    return root, runs


def test_a_run_with_two_micro_batches_follows_the_one_batch_run(float64_runs):
    root, runs = float64_runs
    one, two = _records(root / "one"), _records(root / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    for a, b in zip(one, two):
        for key, rtol in (("loss", 1e-9), ("grad_norm", 1e-9), ("commit_loss", 1e-6), ("codebook_perplexity", 1e-6)):
            assert b[key] == pytest.approx(a[key], rel=rtol), (a["step"], key)  # commitment: float32
    assert one[-1]["loss"] < one[0]["loss"]
    for step in (2, 4):
        a = load_checkpoint(root / "one" / "checkpoints" / f"step-{step:08d}")
        b = load_checkpoint(root / "two" / "checkpoints" / f"step-{step:08d}")
        assert a.meta["train_config"]["grad_accum_steps"] == 1 and b.meta["train_config"]["grad_accum_steps"] == 2
        for name, value in a.model.items():  # weights (float64) and codebooks (float32)
            if not value.is_floating_point():
                assert torch.equal(b.model[name], value), name
                continue
            assert_close_rel(b.model[name], value, rtol=1e-9 if value.dtype == F64 else 1e-5, name=name)
        # the stored carried state is the whole batch's, whatever the number of micro-batches
        assert_states_close(b.carry(0), a.carry(0), rtol=1e-8)
        assert a.carry(0).layers[0][0].cache_counts.shape[0] == 8


def test_a_run_with_micro_batches_resumes_exactly(float64_runs):
    root, runs = float64_runs
    assert runs["resumed"]["start_step"] == 2 and runs["resumed"]["step"] == 4
    keys = ("step", "loss", "bpb", "lr", "grad_norm", "commit_loss", "codebook_perplexity")

    def curve(run):
        return [tuple(r[k] for k in keys) for r in _records(root / run)]

    assert len(curve("resumed")) == 4 and curve("resumed") == curve("two")
    final, resumed = load_checkpoint(root / "two"), load_checkpoint(root / "resumed")
    for name, value in final.model.items():
        assert torch.equal(resumed.model[name], value), name
    for name, value in final.training.items():
        assert torch.equal(resumed.training[name], value), name
