"""The whole stack on one device, ``LINATTN_TEST_DEVICE`` (the CPU in ``make test``, CUDA in
``make test-gpu``): every layer kind's LM (a training step, a prefill, decoding steps,
generation), evaluation and the trainer run there, equal the float64 CPU computation, and
make no host round trip in their hot loops.

A host round trip (``.item()``, ``bool()`` of a tensor, ``.tolist()``, a boolean-mask
index, ...) stalls a GPU's stream once per call; ``HostRoundTrips`` finds the ones linattn's
code makes even on CPU tensors, where nothing waits, so this file guards the GPU path on
machines without one. On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` also fails any
real synchronisation, torch's own included.

One round trip is known and allowed: FAVOR+ (and every feature map whose shift is tracked)
in float32 reads the largest shift once per call to decide whether the call must be redone
in float64 to stay finite (``ops/kernel/attention.py``; under ``torch.compile`` the choice stays in
the graph and nothing is read).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from linattn import LM, LMConfig
from linattn.bench.lm_config import LMBenchConfig
from linattn.bench.lm_measure import training_step
from linattn.train import TrainConfig, evaluate_bpb, train
from linattn.train.optim import parameter_groups
from _helpers import F64, HostRoundTrips, english_like, head_fields

DEVICE = torch.device(os.environ.get("LINATTN_TEST_DEVICE", "cpu"))

SPECS = ["vq", "vq-fsq", "soft-vq", "gau-softmax", "softmax", "softmax:nope:entropy", "linear:elu", "favor", "delta",
         "retnet", "gla", "gated-delta",
         "local:8:entropy", "local:8,vq", "softmax:rerope=4", "local:8:rerope=3", "vq:rerope", "vq-attn:rerope",
         "vq-attn:bias", "linear:hedgehog"]
# the float32 overflow guard of feature maps with a tracked shift (module docstring)
ALLOWED = {"favor": ("ops/kernel/attention.py",)}


@pytest.fixture(autouse=True, scope="module")
def device_available():
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.fail("LINATTN_TEST_DEVICE=cuda but torch.cuda.is_available() is False")


@contextlib.contextmanager
def no_round_trips(allowed: tuple[str, ...] = ()):
    """Fails if the block's linattn code makes a host round trip outside ``allowed`` (source
    path prefixes); on CUDA, also if anything synchronises (unless round trips are allowed)."""
    strict_cuda = DEVICE.type == "cuda" and not allowed
    if strict_cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with HostRoundTrips() as trips:
            yield
    finally:
        if strict_cuda:
            torch.cuda.set_sync_debug_mode("default")
    unexpected = [trip for trip in trips if not trip[1].startswith(allowed)]
    assert not unexpected, f"host round trips: {sorted(set(unexpected))}"


def make_model(spec: str, seed: int = 0) -> LM:
    torch.manual_seed(seed)
    config = LMConfig(attention=spec, d_model=32, n_layers=2, gau_d_k=16, codebook_size=8, block_size=8,
                      chunk_size=4, local_window=8, ffn_hidden=64, dead_code_threshold=0.5,
                      **head_fields(spec, n_heads=2))
    return LM(config).to(DEVICE)


def token_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=generator).to(DEVICE)


@pytest.mark.parametrize("spec", SPECS)
def test_training_step_makes_no_round_trip(spec):
    """Forward, loss, backward, clipping, AdamW and the codebook update (with dead-code
    restarts on), as the trainer takes a step, after the first step (a k-means codebook
    initialisation, once per run, reads the keys)."""
    model = make_model(spec).train()
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-3)
    ids = token_ids(2, 21)

    step = training_step(model, optimizer, ids, LMBenchConfig(device=str(DEVICE)))

    first = step()
    with no_round_trips(ALLOWED.get(spec, ())):
        second = step()
    assert torch.isfinite(torch.stack([first, second])).all()
    assert second.device.type == DEVICE.type


@pytest.mark.parametrize("spec", SPECS)
def test_prefill_decoding_and_generation_make_no_round_trip(spec):
    """A prefill and token steps with the carried state (eval mode), and ``LM.generate`` on a
    batch (it yields tensors) past its first token (the prompt's ids are checked once, a read)."""
    model = make_model(spec).eval()
    ids = token_ids(2, 17)
    allowed = ALLOWED.get(spec, ())
    def prefill_and_decode():
        _, state, _ = model(ids[:, :13], check_inputs=False)
        for i in range(13, 17):
            logits, state, _ = model(ids[:, i : i + 1], state, check_inputs=False)
        return logits

    with torch.no_grad():
        # once uncounted: a process's first native VQ step runs its one-time self-check, which reads
        # values by design (ops/vq/native_choice.py); a test that comes first in its process would see it
        prefill_and_decode()
        with no_round_trips(allowed):
            logits = prefill_and_decode()
    assert logits.device.type == DEVICE.type and torch.isfinite(logits).all()
    tokens = model.generate(ids[:, :5], 4, temperature=0.8, top_k=50, top_p=0.9, seed=1)
    next(tokens)
    with no_round_trips(allowed):
        rest = list(tokens)
    assert len(rest) == 3 and all(t.shape == (2,) and t.device.type == DEVICE.type for t in rest)


@pytest.mark.parametrize("spec", SPECS)
def test_results_on_the_device_equal_float64_on_the_cpu(spec):
    """The model's logits and gradients on DEVICE (float32) against the same weights in float64 on
    the CPU, over two windows with the state carried (the second window reads the first's state)."""
    model = make_model(spec).train()
    reference = make_model(spec).train().to("cpu", F64)
    ids = token_ids(2, 33)

    def run(m: LM) -> tuple[torch.Tensor, dict]:
        first, state, _ = m(ids[:, :16].to(m.embed.weight.device), check_inputs=False)
        second, _, _ = m(ids[:, 16:32].to(m.embed.weight.device), m.carry(state), check_inputs=False)
        logits = torch.cat([first, second], dim=1)
        targets = ids[:, 1:].to(logits.device)
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        return logits, {name: p.grad for name, p in m.named_parameters() if p.grad is not None}

    logits, grads = run(model)
    expected, expected_grads = run(reference)
    torch.testing.assert_close(logits.cpu().double(), expected, rtol=1e-3, atol=1e-3)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        scale = expected_grads[name].abs().max().item() + 1e-6
        torch.testing.assert_close(grad.cpu().double() / scale, expected_grads[name] / scale, rtol=0, atol=2e-3,
                                   msg=lambda text, name=name: f"{name}: {text}")


def test_evaluation_reads_the_values_once_whatever_the_number_of_windows():
    """``evaluate_bpb``'s loop over windows makes no round trip: the same ones (the ids check
    and the final totals) for 4 windows as for 16."""
    model = make_model("local:8,vq")
    tokens = torch.randint(0, 256, (16 * 8 + 1,), generator=torch.Generator().manual_seed(3))
    counts = []
    for windows in (4, 16):
        with HostRoundTrips() as trips:
            result = evaluate_bpb(model, tokens, context=8, max_tokens=windows * 8 + 1)
        counts.append(len(trips))
        assert result["tokens"] == windows * 8
    assert counts[0] == counts[1], counts


def test_trainer_round_trips_do_not_grow_with_the_steps(tmp_path: Path):
    """The trainer's loop makes no round trip per step: 4 steps and 8 steps (one log line and
    one final checkpoint each, which read values) make the same ones."""
    data = tmp_path / "corpus.txt"
    data.write_text(english_like(4000))
    model_config = make_model("vq,delta").config
    found = []
    for steps in (4, 8):
        config = TrainConfig(data=str(data), out=str(tmp_path / f"run-{steps}"), steps=steps, batch_size=2,
                             context=32, lr=3e-3, warmup_steps=2, eval_every=0, log_every=steps, checkpoint_every=0,
                             device=str(DEVICE), threads=1)
        with HostRoundTrips() as trips:
            train(model_config, config, progress=False, echo=lambda *args: None)
        found.append(sorted(trips))
    assert found[0] == found[1]
    assert found[0], "the log line and the checkpoint read values: the detector must see them"
