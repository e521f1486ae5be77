"""torch.compile: the LM's training forward and backward compile without graph breaks for
every layer kind and give eager's results; the checks that read tensor values sit at the
data boundary or behind ``check_inputs`` (docs/design.md, sections 2 and 7).

Compile time dominates these tests, so models are one layer of width 16 over 8 tokens (two
blocks or chunks of 4) and the cheapest backend that proves the point is used:
``backend="eager"`` with ``fullgraph=True`` raises on any graph break while tracing the
forward; ``"aot_eager"`` also traces the backward (AOTAutograd) for the layers with a
hand-written backward or a ``torch.cond``; inductor, whose C++ compilation takes longest,
runs once, for the agreement of compiled and eager float32 training losses."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import linattn.ops.kernel.attention as linear_module
from _helpers import head_fields, make_qkv, wide_shift_inputs
from linattn import VectorQuantizer, delta_rule, linear_attention, vq_attention
from linattn.feature_maps import FAVOR
from linattn.models import LM, LMConfig
from linattn.nn import GAU
from linattn.train.trainer import compile_model

torch.set_num_threads(1)

# every registered kind, the exact ones with their flags; "favor" stands for the exponential
# maps (a torch.cond decides their float64 recomputation), which
# test_linear_float64_fallback_is_decided_inside_the_graph covers for "exp"
KINDS = ["vq", "vq-fsq", "soft-vq", "gau-softmax:entropy", "softmax:nope:entropy", "linear:elu", "favor", "delta",
         "retnet", "gla", "gated-delta", "local:4:entropy", "vq-attn:rerope", "vq-attn:bias", "linear:hedgehog"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch (LM.forward's cache entries would pile up across models)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_lm(attention: str, seed: int = 0) -> LM:
    """One layer, d_model 16, blocks/chunks/windows of 4; VQ with k-means initialisation and
    dead-code restarts (both write module state in the forward pass); softmax layers carry
    4 keys to the next window."""
    config = LMConfig(vocab_size=32, d_model=16, n_layers=1, attention=attention, gau_d_k=8, gau_d_v=16,
                      codebook_size=8, block_size=4, chunk_size=4, local_window=4, favor_features=8,
                      kmeans_init=True, dead_code_threshold=0.5, softmax_memory=4, **head_fields(attention, n_heads=2))
    torch.manual_seed(seed)
    return LM(config).train()


def windows(seed: int = 1) -> list[torch.Tensor]:
    """Two consecutive training windows ``[2, 8]``."""
    return list(torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(seed)).split(8, dim=1))


def two_windows(forward, model: LM) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Training loss of two windows, the state carried between them (as the trainer does),
    and its backward -> ``(logits of each window, loss of each window)``; gradients in the model."""
    logits, losses, state = [], [], None
    for ids in windows():
        out, state, aux = forward(ids, state, check_inputs=False)
        losses.append(F.cross_entropy(out.flatten(0, 1), ids.roll(-1, 1).flatten()) + aux["commit_loss"])
        logits.append(out.detach())
        state = model.carry(state)
    sum(losses).backward()
    return logits, [loss.detach() for loss in losses]


def gradients(model: LM) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------- no graph breaks


@pytest.mark.parametrize("attention", KINDS)
def test_training_forward_compiles_as_one_graph_and_equals_eager(attention, monkeypatch):
    """fullgraph=True: no graph break with and without a carried state (ids unchecked: the
    trainer checks them where they are loaded). Same logits and gradients as eager, after
    the eager pass has run the one-time k-means initialisation. The trace runs the torch
    forms, and so does the eager pass here (``LINATTN_VQ_IMPL=torch``, ``LINATTN_LINEAR_IMPL=torch``,
    ``LINATTN_DELTA_IMPL=torch``;
    by default eager VQ and kernel attention layers on a CPU take the native kernels, equal to the
    torch forms within rounding: ``test_vq_native_backward.py``, ``test_linear_native.py``)."""
    model = tiny_lm(attention)
    with monkeypatch.context() as patch:
        patch.setenv("LINATTN_VQ_IMPL", "torch")
        patch.setenv("LINATTN_LINEAR_IMPL", "torch")
        patch.setenv("LINATTN_DELTA_IMPL", "torch")
        eager_logits, eager_losses = two_windows(model, model)
    eager_grads = gradients(model)
    model.zero_grad(set_to_none=True)
    logits, losses = two_windows(torch.compile(model, backend="eager", fullgraph=True), model)
    for name, wanted in eager_grads.items():
        torch.testing.assert_close(gradients(model)[name], wanted, rtol=1e-6, atol=1e-9, msg=name)
    for actual, wanted in zip(logits + losses, eager_logits + eager_losses):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("attention", ["delta", "gla", "gated-delta"])
def test_chunked_backward_traces_through_aot_autograd(attention):
    """AOTAutograd traces forward and backward as one graph, through the chunked delta rule's
    hand-written backward (delta), the per-channel decay's pairwise scores (gla) and the gated
    delta rule's chunk form (gated-delta), here on a window with a carried state: loss and
    gradients equal eager's to float32 rounding (AOT decomposes some ops, e.g. RMSNorm)."""
    eager_model = tiny_lm(attention)
    first, second = windows()
    carried = eager_model.carry(eager_model(first, check_inputs=False)[1])
    model = copy.deepcopy(eager_model)
    losses = []
    for forward in (eager_model, torch.compile(model, backend="aot_eager", fullgraph=True)):
        logits, _, _ = forward(second, carried, check_inputs=False)
        loss = F.cross_entropy(logits.flatten(0, 1), second.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for name, wanted in gradients(eager_model).items():
        torch.testing.assert_close(gradients(model)[name], wanted, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "activation-checkpointed"])
def test_vq_unit_backward_and_codebook_statistics_trace_through_aot_autograd(checkpointed):
    """One VQ gated attention unit under AOTAutograd, with a carried state, as it is and
    under activation checkpointing (as ``LM.activation_checkpointing`` wraps a layer): the
    straight-through keys, the block form's backward and the codebook statistics, which the
    compiled graph writes back into the quantizer's buffers once per forward (never again
    in the recomputation), equal eager's."""
    torch.manual_seed(0)
    eager_unit = GAU(16, d_k=8, d_v=16, codebook_size=8, block_size=4, dead_code_threshold=0.5).train()
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(4))
    _, state, _ = eager_unit(x[:, :8])
    eager_unit.quantizer.update()  # clears the pending statistics
    state = state.detach()
    unit = copy.deepcopy(eager_unit)

    def wrapped(module):
        if not checkpointed:
            return module
        return lambda x, state: checkpoint(module, x, state, use_reentrant=False)

    outputs = []
    compiled = compile_model(wrapped(unit), backend="aot_eager", fullgraph=True)
    for forward in (wrapped(eager_unit), compiled):
        y, _, aux = forward(x[:, 8:], state)
        (y.square().mean() + aux["commit_loss"]).backward()
        outputs.append(y.detach())
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-7)
    for (name, wanted), actual in zip(eager_unit.named_parameters(), unit.parameters()):
        torch.testing.assert_close(actual.grad, wanted.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert eager_unit.quantizer._pending_counts.sum() == 16  # the window counted once: 2 rows x 8 tokens
    assert torch.equal(unit.quantizer._pending_counts, eager_unit.quantizer._pending_counts)
    torch.testing.assert_close(unit.quantizer._pending_sums, eager_unit.quantizer._pending_sums, rtol=1e-5,
                               atol=1e-6)


def test_vq_unit_gradients_under_inductor_equal_eagers():
    """A VQ gated attention unit compiled by the default backend (inductor), its block form
    through the torch schedule ``schedule="auto"`` takes for a few blocks per row (the loop),
    with the position band (``ops/common/bias.add_window_band``): every gradient finite and equal
    to eager's (the band's autograd Function once gave non-finite query and position-key
    gradients in an inductor graph)."""
    torch.manual_seed(0)
    eager_unit = GAU(32, d_k=16, d_v=24, codebook_size=16, block_size=8)
    unit = copy.deepcopy(eager_unit)
    x = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(5))
    for forward in (eager_unit, torch.compile(unit)):
        y, _, aux = forward(x)
        (y.square().mean() + aux["commit_loss"]).backward()
    for (name, wanted), actual in zip(eager_unit.named_parameters(), unit.parameters()):
        assert actual.grad.isfinite().all(), name
        torch.testing.assert_close(actual.grad, wanted.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_training_loss_agrees_with_eager_under_inductor():
    """The default backend (inductor: generated C++ kernels) on a local-attention model:
    float32 losses and gradients equal eager's to float32 rounding."""
    eager_model = tiny_lm("local:4")
    model = copy.deepcopy(eager_model)
    ids = windows()[0]
    losses = []
    for forward in (eager_model, torch.compile(model, fullgraph=True)):
        logits, _, _ = forward(ids, check_inputs=False)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-6, atol=0)
    for name, wanted in gradients(eager_model).items():
        torch.testing.assert_close(gradients(model)[name], wanted, rtol=1e-4, atol=1e-7, msg=name)


# ----------------------------------------------------------------------------- what used to read values


@pytest.mark.parametrize("final_state", [True, False])
def test_linear_float64_fallback_is_decided_inside_the_graph(final_state):
    """The float64 recomputation of exponential maps is a torch.cond under compile: one
    graph (fullgraph) serves inputs that need it and inputs that do not, with eager's
    outputs, states and gradients (eager equals the float64 formula: test_linear_attention).
    q arrives transposed and the output gradient strided, as from the Attention layer."""
    call = functools.partial(linear_attention, feature_map="exp", chunk_size=16, output_final_state=final_state)
    # the layers' form (a final state) through AOTAutograd, the other only through dynamo
    compiled = torch.compile(call, backend="aot_eager" if final_state else "eager", fullgraph=True)
    weights = torch.randn(1, 13, 2, 3, generator=torch.Generator().manual_seed(2))

    def run(fn, q, k, v):
        inputs = [t.float().detach().requires_grad_(True) for t in (q, k, v)]
        q_strided = inputs[0].transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, T, D] over [B, T, H, D]
        out, state = fn(q_strided, *inputs[1:])
        (out.transpose(1, 2) * weights).sum().backward()
        return out.detach(), state, [t.grad for t in inputs]

    for q, k, v in (make_qkv(B=1, H=2, Hkv=1, T=13, Dk=2, Dv=3), wide_shift_inputs()):
        eager_out, eager_state, eager_grads = run(call, q, k, v)
        out, state, grads = run(compiled, q, k, v)
        assert torch.isfinite(eager_out).all() and all(torch.isfinite(g).all() for g in eager_grads)
        torch.testing.assert_close(out, eager_out, rtol=1e-6, atol=0)
        for actual, wanted in zip(grads, eager_grads):
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-7)
        if final_state:
            for name in ("kv", "normalizer", "key_shift"):
                torch.testing.assert_close(getattr(state, name), getattr(eager_state, name), rtol=1e-6, atol=0)


def test_decayed_float64_fallback_compiles_with_eagers_gradients():
    """With per-channel log decays g (test_decay.py: eager equals the float64 formula), the
    compiled wide-shift call (the float64 choice a torch.cond) gives eager's output and
    gradients, g's included (whose gradient, a slice of a padded one, needs the standard
    strides the cond compares)."""
    q, k, v = wide_shift_inputs()
    g = -torch.rand(1, 1, 13, 2, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    call = functools.partial(linear_attention, feature_map="exp", chunk_size=4, check_inputs=False)
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)

    def run(fn):
        inputs = [t.float().requires_grad_(True) for t in (q, k, v, g)]
        out, _ = fn(*inputs[:3], g=inputs[3])
        out.square().sum().backward()
        return out.detach(), [t.grad for t in inputs]

    eager_out, eager_grads = run(call)
    out, grads = run(compiled)
    torch.testing.assert_close(out, eager_out, rtol=1e-6, atol=0)
    for actual, wanted in zip(grads, eager_grads):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-7)


def test_float64_fallback_still_runs_in_eager_mode(monkeypatch):
    """The compiled path's cond did not replace eager's choice: wide shifts are recomputed."""
    calls = []
    original = linear_module._in_float64
    monkeypatch.setattr(linear_module, "_in_float64", lambda *args: calls.append(1) or original(*args))
    q, k, v = (t.float() for t in wide_shift_inputs())
    linear_attention(q, k, v, feature_map="exp")
    assert calls == [1]


def test_favor_projection_enters_the_graph_and_follows_a_redraw():
    """FAVOR+ draws its projection eagerly (``prepare``, called by the Attention layer); a
    compiled call reads the current draw, so a redraw reaches the compiled function."""
    fmap = FAVOR(8, seed=3)
    fmap.prepare(4)
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=8, Dk=4, Dv=3, dtype=torch.float32)
    compiled = torch.compile(lambda q, k, v: linear_attention(q, k, v, feature_map=fmap, chunk_size=4)[0],
                             backend="eager", fullgraph=True)
    # compiled calls run the torch forms (the native kernel reads tensors' data): so do the references
    expected = linear_attention(q, k, v, feature_map=FAVOR(8, seed=3), chunk_size=4, impl="torch")[0]
    torch.testing.assert_close(compiled(q, k, v), expected, rtol=1e-6, atol=0)
    fmap.redraw(4)
    redrawn = linear_attention(q, k, v, feature_map=FAVOR(8, seed=4), chunk_size=4, impl="torch")[0]
    assert not torch.allclose(redrawn, expected)
    torch.testing.assert_close(compiled(q, k, v), redrawn, rtol=1e-6, atol=0)


def test_favor_projection_left_undrawn_is_a_clear_error_under_compile():
    fmap = FAVOR(8, seed=3)
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=8, Dk=4, Dv=3, dtype=torch.float32)
    compiled = torch.compile(lambda q, k, v: linear_attention(q, k, v, feature_map=fmap)[0], backend="eager",
                             fullgraph=True)
    with pytest.raises(Exception, match=r"prepare\(4\)"):
        compiled(q, k, v)


def test_kmeans_initialisation_runs_eagerly_inside_a_compiled_quantizer():
    """The one-time k-means initialisation is excluded from compilation (it is data-dependent
    throughout) and runs on the first compiled training forward as it would eagerly; the
    next forward is one graph."""
    keys = torch.randn(2, 1, 12, 4, generator=torch.Generator().manual_seed(3))
    eager_quantizer, quantizer = (VectorQuantizer(1, 4, 8, kmeans_init=True) for _ in range(2))
    torch.manual_seed(5)
    k_hat, codes, _ = torch.compile(quantizer, backend="eager")(keys)
    torch.manual_seed(5)
    eager_k_hat, eager_codes, _ = eager_quantizer(keys)
    assert bool(quantizer.initialized) and torch.equal(quantizer.codebook, eager_quantizer.codebook)
    assert torch.equal(codes, eager_codes) and torch.equal(k_hat, eager_k_hat)
    torch.compile(quantizer, backend="eager", fullgraph=True)(keys)


def test_loaded_codebooks_keep_their_initialisation_state():
    """The quantizer remembers whether k-means is pending instead of reading its flag every
    forward; loading a state dict refreshes what it remembers, in both directions."""
    keys = torch.randn(2, 1, 12, 4, generator=torch.Generator().manual_seed(3))
    trained = VectorQuantizer(1, 4, 8, kmeans_init=True)
    trained(keys)  # initialised by k-means
    reloaded = VectorQuantizer(1, 4, 8, kmeans_init=True)  # pending at construction
    reloaded.load_state_dict(trained.state_dict())
    before = reloaded.codebook.clone()
    reloaded(keys + 5.0)
    assert torch.equal(reloaded.codebook, before)  # not clustered again
    fresh = VectorQuantizer(1, 4, 8, kmeans_init=False)  # ready at construction
    fresh.load_state_dict(VectorQuantizer(1, 4, 8, kmeans_init=True).state_dict())  # an uninitialised one
    fresh(keys)
    assert bool(fresh.initialized)


def test_check_inputs_false_leaves_the_range_of_the_ids_unread():
    """``LM.forward(check_inputs=False)``: no range check (the embedding's own indexing
    fails instead); the default keeps the named error."""
    model = tiny_lm("linear:elu")
    ids = torch.tensor([[1, 40, 2]])
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 32\), got values in \[1, 40\]"):
        model(ids)
    with pytest.raises(IndexError):
        model(ids, check_inputs=False)
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        model(ids.float(), check_inputs=False)  # type and shape are still checked


def test_delta_rule_check_inputs_false_does_not_read_beta():
    q, k, v = make_qkv(B=1, H=2, Hkv=1, T=6, Dk=4, Dv=3)
    beta = torch.full((1, 1, 6), 1.5, dtype=q.dtype)
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):
        delta_rule(q, k, v, beta)
    out, _ = delta_rule(q, k, v, beta, check_inputs=False)
    assert out.shape == (1, 2, 6, 3)


def test_vq_attention_batched_schedule_compiles_as_one_graph():
    """The block form's batched schedule (the default on CUDA) through AOTAutograd with a
    carried state: eager's outputs and gradients."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, heads, 14, 8, generator=g) for heads in (2, 1, 1))
    quantizer = VectorQuantizer(1, 8, 16).eval()
    k_hat, codes, _ = quantizer(k)
    options = dict(block_size=4, schedule="batched", output_final_state=True)
    _, state = vq_attention(q[:, :, :6], k_hat[:, :, :6], v[:, :, :6], codes[:, :, :6], quantizer.codebook, **options)

    def call(q, v):
        return vq_attention(q, k_hat[:, :, 6:], v, codes[:, :, 6:], quantizer.codebook, initial_state=state,
                            check_inputs=False, **options)

    results = []
    for fn in (call, torch.compile(call, backend="aot_eager", fullgraph=True)):
        inputs = [q[:, :, 6:].clone().requires_grad_(True), v[:, :, 6:].clone().requires_grad_(True)]
        out, _ = fn(*inputs)
        out.square().sum().backward()
        results.append([out.detach(), *(t.grad for t in inputs)])
    for actual, wanted in zip(*reversed(results)):
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-6)
