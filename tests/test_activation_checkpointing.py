"""Activation checkpointing (``LM.activation_checkpointing``, ``train.activation_checkpointing``):
each layer's forward runs again during backward, and losses, gradients, carried states and
codebook statistics are those of the plain step (float64). A quantizer forward recomputed
inside backward adds no statistics (the guard ``_inside_backward`` of nn/quantizer.py)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import linattn.nn.quantizer as quantizer_module
from linattn.models import LM, LMConfig
from linattn.train import TrainConfig, load_checkpoint, train
from linattn.train import trainer as trainer_module
from _helpers import assert_close_rel, english_like, head_fields
from test_grad_accum import assert_states_close

torch.set_num_threads(1)


def config(**overrides) -> LMConfig:
    """VQ (k-means initialised, dead-code restarts), delta and softmax layers, and a paper-variant
    VQ layer whose sinusoid dropout draws random numbers that the recomputation must redraw."""
    options = dict(d_model=16, n_layers=3, attention="vq,delta,softmax", n_heads=2, gau_d_k=8, codebook_size=16,
                   block_size=4, chunk_size=4, ffn_hidden=32, softmax_memory=5, kmeans_init=True,
                   dead_code_threshold=0.5, sinusoid_dropout=0.3)
    options.update(overrides)
    return LMConfig(**head_fields(options["attention"], **options))


def _step(model, ids, targets, state):
    logits, state, aux = model(ids, state)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + aux["commit_loss"]
    loss.backward()
    return loss.detach(), state


def _count_quantizer_forwards(model) -> list[int]:
    calls = [0]
    for quantizer in model.quantizers():
        quantizer.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("gau_variant", ["linattn", "paper"])
def test_checkpointed_step_equals_the_plain_step_and_counts_statistics_once(gau_variant):
    torch.manual_seed(0)
    plain = LM(config(gau_variant=gau_variant)).double().train()
    recomputed = copy.deepcopy(plain)
    recomputed.activation_checkpointing = True
    plain_calls, recomputed_calls = _count_quantizer_forwards(plain), _count_quantizer_forwards(recomputed)
    tokens = torch.randint(0, 256, (3, 19), generator=torch.Generator().manual_seed(1))
    states = [None, None]
    for window in range(2):  # the second window starts from the carried states
        ids, targets = tokens[:, window * 9:(window + 1) * 9], tokens[:, window * 9 + 1:(window + 1) * 9 + 1]
        results = []
        for i, model in enumerate((plain, recomputed)):
            torch.manual_seed(10 + window)  # the same dropout draws
            model.zero_grad(set_to_none=True)
            results.append(_step(model, ids, targets, states[i]))
        (loss_plain, state_plain), (loss_recomputed, state_recomputed) = results
        assert_close_rel(loss_recomputed, loss_plain, rtol=1e-14, name="loss")
        for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
            assert (a.grad is None) == (b.grad is None), name
            if a.grad is not None:
                assert_close_rel(b.grad, a.grad, rtol=1e-12, name=f"grad {name}")
        assert_states_close(state_recomputed.detach(), state_plain.detach(), rtol=1e-12)
        for a, b in zip(plain.quantizers(), recomputed.quantizers()):
            assert bool(a.initialized) and torch.equal(b.codebook, a.codebook)  # k-means ran once, alike
            assert torch.equal(b.pending_counts, a.pending_counts)
            assert a.pending_counts.sum() == ids.numel() * a.n_heads  # each token counted once per head
            assert torch.equal(b._pending_sums, a._pending_sums)
        for model in (plain, recomputed):
            torch.manual_seed(20 + window)
            model.update_codebooks()
        for (name, a), (_, b) in zip(plain.named_buffers(), recomputed.named_buffers()):
            assert torch.equal(b, a), name
        states = [plain.carry(state_plain), recomputed.carry(state_recomputed)]
    # the forward of each quantizer did run again inside backward
    n = len(plain.quantizers())
    assert plain_calls[0] == 2 * n and recomputed_calls[0] == 4 * n


def test_without_the_backward_guard_recomputation_would_count_statistics_twice(monkeypatch):
    """The guard is what keeps the counts equal above: with ``_inside_backward`` answering
    False, the forward recomputed in backward adds its tokens a second time."""
    torch.manual_seed(0)
    model = LM(config(n_layers=1, attention="vq", kmeans_init=False, dead_code_threshold=0.0)).double().train()
    model.activation_checkpointing = True
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    _step(model, ids, ids, None)
    once = [q.pending_counts.clone() for q in model.quantizers()]
    for quantizer in model.quantizers():
        quantizer._reset_buffers()
    monkeypatch.setattr(quantizer_module, "_inside_backward", lambda: False)
    model.zero_grad(set_to_none=True)
    _step(model, ids, ids, None)
    for counted, quantizer in zip(once, model.quantizers()):
        assert counted.sum() == ids.numel() * quantizer.n_heads
        assert torch.equal(quantizer.pending_counts, 2 * counted)


def test_no_recomputation_without_gradients_or_when_off():
    torch.manual_seed(0)
    model = LM(config(n_layers=1, attention="vq", kmeans_init=False)).double()
    model.activation_checkpointing = True
    calls = _count_quantizer_forwards(model)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        model(ids)
    assert calls[0] == 2
    assert LM(config(n_layers=1, attention="vq")).activation_checkpointing is False
    with pytest.raises(TypeError, match="train.activation_checkpointing must be a bool, got int"):
        TrainConfig(activation_checkpointing=1)


def test_training_with_activation_checkpointing_follows_the_plain_run(tmp_path, monkeypatch):
    """float64 runs of 3 steps with 2 micro-batches: the same logged losses and final weights."""
    data = tmp_path / "corpus.txt"
    data.write_text(english_like(2000, seed=5))
    monkeypatch.setattr(trainer_module, "LM", lambda c: LM(c).double())
    runs = {}
    for flag in (False, True):
        out = tmp_path / f"run-{flag}"
        run_config = TrainConfig(data=str(data), out=str(out), steps=3, batch_size=4, grad_accum_steps=2,
                                 context=16, warmup_steps=1, eval_every=0, log_every=1, checkpoint_every=3,
                                 activation_checkpointing=flag, threads=1)
        summary = train(config(sinusoid_dropout=None), run_config, progress=False, echo=lambda *a: None)
        assert summary["model"].activation_checkpointing is flag
        runs[flag] = out
    records = {flag: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
               for flag, out in runs.items()}
    assert len(records[True]) == 3
    for a, b in zip(records[False], records[True]):
        for key in ("loss", "grad_norm", "commit_loss", "codebook_perplexity"):
            assert b[key] == pytest.approx(a[key], rel=1e-12), key
    plain, recomputed = load_checkpoint(runs[False]), load_checkpoint(runs[True])
    for name, value in plain.model.items():
        if value.is_floating_point():
            assert_close_rel(recomputed.model[name], value, rtol=1e-12, name=name)
        else:
            assert torch.equal(recomputed.model[name], value), name
