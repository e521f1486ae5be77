"""PEFT (LoRA) adapters on linattn's Hugging Face model: every forward path calls the
adapted projections -- training, evaluation without gradients, the one-token VQ decode,
the resident VQ decode, ``generate`` -- so a LoRA model computes what its merged model
computes; the fast paths that read weights directly stay for plain projections only."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import linattn.hf as H
import linattn.nn.gau as gau_module
from linattn import LM, LMConfig
from linattn.models._vq_generation import VQGeneration
from linattn.nn import VectorQuantizer
from peft import LoraConfig, PeftModel, get_peft_model
from _helpers import head_fields

torch.set_num_threads(1)

# every projection of every layer kind: the GAU's (w_r included: its relative terms are
# cached without gradients), multi-head attention's, DeltaNet's, the gated layers' (output
# gates, GLA's low-rank decay, Gated DeltaNet's decay rate) and the SwiGLU FFN's
TARGETS = ["w_q", "w_k", "w_v", "w_g", "w_o", "w_r", "q_proj", "k_proj", "v_proj", "o_proj", "beta_proj",
           "gate_proj", "decay_down", "decay_up", "decay_proj", "w_gate", "w_up", "w_down"]
# each mix with a GAU kind: those are the layers with fast paths that read weights
GAU_MIXES = ["vq,softmax,delta", "gau-softmax,linear:elu,local:4"]
MIXES = [*GAU_MIXES, "retnet,gla,gated-delta"]


def tiny_lm(attention: str, seed: int = 0) -> LM:
    """A float64 model small enough for exact comparisons; blocks, chunks and windows of 4,
    so a few tokens cross several of them."""
    torch.manual_seed(seed)
    config = LMConfig(d_model=16, n_layers=attention.count(",") + 1, attention=attention, gau_d_k=8,
                      codebook_size=8, block_size=4, chunk_size=4, local_window=4, **head_fields(attention, n_heads=2))
    model = LM(config).double().eval()
    with torch.no_grad():  # spread the codebooks away from their init
        for quantizer in model.quantizers():
            quantizer.codebook.add_(0.1 * torch.randn_like(quantizer.codebook))
    return model


def base_model(attention: str, seed: int = 0) -> H.LinattnForCausalLM:
    return H.LinattnForCausalLM.from_lm(tiny_lm(attention, seed)).eval()


def with_lora(model: H.LinattnForCausalLM, seed: int = 1) -> PeftModel:
    """LoRA (r=4) on every projection, with a random ``lora_B`` (PEFT starts it at zero,
    where the adapter would change nothing). No ``train()``/``eval()`` call, which would
    clear the layers' no-grad caches: the model stays in ``model``'s mode."""
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return peft_model


def merged(peft_model: PeftModel) -> H.LinattnForCausalLM:
    """The adapter folded into a copy of the base weights (the copy: merging changes them in place)."""
    return copy.deepcopy(peft_model).merge_and_unload().eval()


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids: torch.Tensor, grad: bool) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        return model(ids).logits.detach()


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to float64 rounding (the adapter adds ``B A x`` where the merged weight adds ``(B A) x``)."""
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)


def assert_differs(actual: torch.Tensor, other: torch.Tensor) -> None:
    assert (actual - other).abs().max() > 1e-3


@pytest.mark.parametrize("attention", MIXES)
def test_lora_logits_are_the_same_with_and_without_gradients_and_equal_the_merged_model(attention):
    model = with_lora(base_model(attention))
    ids = random_ids(2, 11)  # crosses blocks, chunks and windows of 4
    with_grad, without_grad = logits(model, ids, True), logits(model, ids, False)
    assert_same(without_grad, with_grad)
    assert_same(without_grad, logits(merged(model), ids, False))
    plain = logits(base_model(attention), ids, False)
    assert_differs(with_grad, plain)  # the adapter changes the output
    with model.disable_adapter():  # and switched off, it is gone on both paths
        assert_same(logits(model, ids, False), plain)
        assert_same(logits(model, ids, True), plain)


@pytest.mark.parametrize("attention", MIXES)
def test_merging_after_an_evaluation_of_the_plain_model_uses_the_merged_weights(attention):
    """The no-grad caches of the plain model are forgotten when its projections are
    replaced: merging writes the weights through ``.data`` (no version bump)."""
    model = base_model(attention)
    ids = random_ids(2, 11)
    plain = logits(model, ids, False)  # fills the caches of the fast paths
    peft_model = with_lora(model)
    expected = logits(peft_model, ids, True)
    merged_model = peft_model.merge_and_unload()
    assert_differs(expected, plain)
    assert_same(logits(merged_model, ids, False), expected)


@pytest.mark.parametrize("attention", MIXES)
def test_peft_generate_equals_the_merged_model_token_for_token(attention):
    """Greedy ``generate`` from a 3-token prompt for 11 tokens: VQ blocks of 4 complete
    three times during decoding (one-token decode through the resident buffer)."""
    model = with_lora(base_model(attention))
    reference = merged(model)
    prompt = random_ids(2, 3, seed=5)
    options = dict(max_new_tokens=11, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        ours = model.generate(input_ids=prompt, **options)
        theirs = reference.generate(input_ids=prompt, **options)
        plain = base_model(attention).generate(input_ids=prompt, **options)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert_same(torch.stack(ours.scores), torch.stack(theirs.scores))
    assert_differs(torch.stack(theirs.scores), torch.stack(plain.scores))
    # linattn's own generator on the LM inside the PeftModel
    lm, reference_lm = model.get_base_model().lm, reference.lm
    ours_lm = torch.stack(list(lm.generate(prompt, 11, temperature=0)), 1)
    assert torch.equal(ours_lm, torch.stack(list(reference_lm.generate(prompt, 11, temperature=0)), 1))
    assert torch.equal(ours_lm, ours.sequences[:, 3:])


def test_saved_adapter_loads_into_a_fresh_base_model_with_the_same_logits(tmp_path):
    attention = MIXES[0]
    model = with_lora(base_model(attention))
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(base_model(attention), tmp_path / "adapter").eval()
    ids = random_ids(2, 11)
    expected = logits(merged(model), ids, False)
    assert_same(logits(loaded, ids, False), expected)
    assert_same(logits(loaded, ids, True), expected)
    assert_differs(expected, logits(base_model(attention), ids, False))


# -- the codebooks under an adapter: saved with it (modules_to_save), the base model's left as they are --------


def _adapter_trainer(model, tmp_path, rows: torch.Tensor):
    """The HF ``Trainer`` over ``rows``: 2 optimizer steps of 2 accumulated micro-batches of 2 rows, with
    ``CodebookUpdateCallback``."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-2, report_to=[],
                             use_cpu=True, save_strategy="no")
    return Trainer(model=model, args=args, train_dataset=[{"input_ids": row, "labels": row} for row in rows],
                   callbacks=[H.CodebookUpdateCallback()])


def _codebook_state(quantizers) -> list[torch.Tensor]:
    return [tensor.clone() for q in quantizers for tensor in (q.codebook, q.ema_counts, q.ema_sums)]


def test_an_adapter_trained_with_the_codebook_callback_carries_its_codebooks_to_a_fresh_base_model(tmp_path):
    """The documented rule: the adapter keeps its own copy of the codebooks (``modules_to_save=["quantizer"]``).
    Two HF ``Trainer`` steps under gradient accumulation move every copy by the EMA update, the base model's
    codebooks stay as they were (switched off, the adapter leaves the base model's logits), and the adapter
    saved and loaded on a fresh base model gives the trained model's logits exactly."""
    attention = "vq,local:4"
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, modules_to_save=["quantizer"])
    model = get_peft_model(base_model(attention), config).train()
    untouched = base_model(attention)
    result = _adapter_trainer(model, tmp_path, random_ids(8, 12, seed=12)).train()
    assert math.isfinite(result.training_loss)
    model.eval()
    quantizers = {name: module for name, module in model.named_modules() if isinstance(module, VectorQuantizer)}
    copies = [q for name, q in quantizers.items() if ".modules_to_save.default" in name]
    originals = [q for name, q in quantizers.items() if name.endswith(".original_module")]
    assert len(copies) == len(originals) == len(untouched.lm.quantizers()) == 2
    for copy_, original, base in zip(copies, originals, untouched.lm.quantizers()):
        assert not torch.equal(copy_.codebook, base.codebook)  # trained: the EMA update reached the copy
        assert all(torch.equal(a, b) for a, b in zip(_codebook_state([original]), _codebook_state([base])))
        assert float(copy_.pending_counts.sum()) == 0.0  # every micro-batch's statistics went into an update
    ids = random_ids(2, 11)
    trained = logits(model, ids, False)
    with model.disable_adapter():  # the base model's fast paths read weights, the adapted ones call them
        assert_same(logits(model, ids, False), logits(untouched, ids, False))
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(base_model(attention), tmp_path / "adapter").eval()
    assert torch.equal(logits(loaded, ids, False), trained)
    assert_differs(trained, logits(untouched, ids, False))


def test_the_codebook_callback_refuses_an_adapter_without_its_own_codebooks_before_any_step(tmp_path):
    """An adapter that does not carry the codebooks would have the callback change the frozen base model in
    place (and a saved adapter would not reproduce the trained model): the ``Trainer`` stops at its start with
    a ValueError naming each quantizer and the ``LoraConfig`` argument that fixes it; nothing has changed."""
    model = with_lora(base_model("vq,local:4")).train()
    before = _codebook_state(model.get_base_model().lm.quantizers())
    adapters = {name: p.clone() for name, p in model.named_parameters() if "lora_" in name}
    with pytest.raises(ValueError, match=r'modules_to_save=\["quantizer"\]') as refusal:
        _adapter_trainer(model, tmp_path, random_ids(8, 12, seed=12)).train()
    for name in ("layers.0.units.0.quantizer", "layers.0.units.1.quantizer"):
        assert name in str(refusal.value)
    after = _codebook_state(model.get_base_model().lm.quantizers())
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(torch.equal(p, adapters[name]) for name, p in model.named_parameters() if "lora_" in name)
    with pytest.raises(ValueError, match="does not carry the VQ codebooks"):  # called directly too
        H.CodebookUpdateCallback().on_step_end(None, None, None, model=model)


def test_the_codebook_callback_updates_a_plain_model_and_finds_the_copies_inside_a_peft_model():
    """Without an adapter the callback updates the model's own codebooks; with one, it reaches the adapter's
    copies inside the ``PeftModel``."""
    plain = base_model("vq").train()
    before = _codebook_state(plain.lm.quantizers())
    plain(random_ids(2, 9))
    H.CodebookUpdateCallback().on_step_end(None, None, None, model=plain)
    assert not any(torch.equal(a, b) for a, b in zip(_codebook_state(plain.lm.quantizers())[::3], before[::3]))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["w_q"], modules_to_save=["quantizer"])
    model = get_peft_model(base_model("vq"), config).train()
    copies = [m for name, m in model.named_modules() if isinstance(m, VectorQuantizer) and "modules_to_save" in name]
    before = _codebook_state(copies)
    model(random_ids(2, 9))
    H.CodebookUpdateCallback().on_step_end(None, None, None, model=model)
    assert not any(torch.equal(a, b) for a, b in zip(_codebook_state(copies)[::3], before[::3]))


def _count_calls(monkeypatch, module, name: str) -> list:
    calls: list = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_fast_paths_are_taken_for_plain_projections_only(monkeypatch):
    """The fused input matmul (no gradients), the one-token VQ decode step and the native
    token loop of ``generate`` serve the plain model; a LoRA model takes the general path
    (calling its projections)."""
    fused = _count_calls(monkeypatch, gau_module, "_fused_input_weight")
    decoded = _count_calls(monkeypatch, gau_module, "decode_token")
    native = _count_calls(monkeypatch, VQGeneration, "step_greedy")
    prompt = random_ids(1, 3)
    plain = base_model("vq").lm
    with torch.no_grad():
        plain(prompt)
        plain(prompt[:, :1], plain(prompt)[1])
    list(plain.generate(prompt, 6, temperature=0))
    assert fused and decoded and native
    fused.clear(), decoded.clear(), native.clear()
    adapted = with_lora(base_model("vq")).get_base_model().lm
    with torch.no_grad():
        adapted(prompt)
        adapted(prompt[:, :1], adapted(prompt)[1])
    list(adapted.generate(prompt, 6, temperature=0))
    assert not fused and not decoded and not native


def _scale_by_a_hook(module: torch.nn.Module) -> None:
    module.register_forward_hook(lambda module, args, output: 1.5 * output)


def _scale_in_its_own_forward(module: torch.nn.Module) -> None:
    """As accelerate's device hooks do: a ``forward`` on the instance."""
    forward = type(module).forward
    module.forward = lambda x: 1.5 * forward(module, x)


@pytest.mark.parametrize("change", [_scale_by_a_hook, _scale_in_its_own_forward])
@pytest.mark.parametrize("attention", GAU_MIXES)
def test_a_projection_whose_call_changes_its_output_is_called_without_gradients(attention, change):
    """A plain ``nn.Linear`` whose forward hook or own ``forward`` changes its output is
    called, not read."""
    model = base_model(attention).lm
    unit = next(m for m in model.modules() if isinstance(m, gau_module.GAU))
    assert_called_when_changed(model, lambda: [change(getattr(unit, name)) for name in ("w_v", "w_o", "w_r")])


def _scale_the_quantized_keys(unit: gau_module.GAU) -> None:
    unit.quantizer.register_forward_hook(lambda module, args, output: (4.0 * output[0], *output[1:]))


@pytest.mark.parametrize("change", [lambda unit: _scale_by_a_hook(unit.norm),
                                    lambda unit: _scale_in_its_own_forward(unit.norm), _scale_the_quantized_keys],
                         ids=["norm hook", "norm forward", "quantizer hook"])
def test_the_vq_decode_step_calls_a_changed_input_norm_or_quantizer(change):
    """The one-token VQ decode step reads the input norm's gain and the codebook too."""
    model = base_model("vq").lm
    unit = next(m for m in model.modules() if isinstance(m, gau_module.GAU))
    assert_called_when_changed(model, lambda: change(unit))


def assert_called_when_changed(model: LM, change) -> None:
    """After ``change()`` (which changes what some submodules compute) the logits without
    gradients, and those of one token decoded from a state, equal those with gradients."""
    ids = random_ids(2, 11)
    plain = logits_of_lm(model, ids, False)
    change()
    hooked = logits_of_lm(model, ids, True)
    assert_differs(hooked, plain)
    assert_same(logits_of_lm(model, ids, False), hooked)
    state = model(ids[:, :9])[1]  # and one token at a time from a state
    with torch.no_grad():
        step = model(ids[:, 9:10], state=state)[0]
    assert_same(step, model(ids[:, :10])[0][:, 9:].detach())


def logits_of_lm(model: LM, ids: torch.Tensor, grad: bool) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        return model(ids)[0].detach()


def test_lora_on_a_tied_embedding_reaches_the_output_head():
    """With tied embeddings the head multiplies by the embedding matrix; with LoRA on the
    embedding that matrix is the adapted one (PEFT's ``.weight`` is the base weight alone)."""
    model = base_model("vq,softmax")
    assert model.lm.head is None
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["embed"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_embedding_" in name:  # PEFT starts A at zero for embeddings
                parameter.copy_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    ids = torch.randint(0, 256, (2, 7), generator=generator)
    adapted = peft_model(input_ids=ids).logits
    plain = base_model("vq,softmax")(input_ids=ids).logits
    assert (adapted - plain).abs().max() > 1e-3  # the adapter changes the output
    reference = merged(peft_model)(input_ids=ids).logits
    torch.testing.assert_close(adapted, reference, rtol=1e-10, atol=1e-10)
