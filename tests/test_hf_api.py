"""``linattn.hf`` through the rest of the Hugging Face API: generate's keyword arguments
(stop strings with a tokenizer), resizing the vocabulary, activation checkpointing through
the HF switches, ``attn_implementation``, the HF ``Trainer`` under gradient accumulation,
the byte tokenizer without ``import linattn.hf``, loading an export with
``trust_remote_code=True`` in a process that never imports ``linattn.hf``, and
``linattn lm-eval`` without a prefix token."""

from __future__ import annotations

import copy

import pytest
import torch

import linattn.hf as H
from test_hf import greedy_ours, random_ids, tiny_lm
from transformers import AutoModelForCausalLM

torch.set_num_threads(1)


# -- generate's own keyword arguments ----------------------------------------------------------


def test_generate_with_stop_strings_and_a_tokenizer_stops_at_the_string():
    """``stop_strings`` need ``tokenizer=``, which generate passes on to forward: it is accepted
    (as by any HF decoder) and generation ends right after the first occurrence of the string
    (sampling from the same seed, so both runs draw the same tokens up to there)."""
    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq,local:4")).eval()
    tokenizer = H.byte_tokenizer()
    prompt = tokenizer(["To be"], return_tensors="pt")
    unprintable = [i for i in range(256) if not (32 <= i < 127)]  # ASCII text: one byte, one character
    options = dict(max_new_tokens=16, do_sample=True, suppress_tokens=unprintable)
    torch.manual_seed(42)
    full = model.generate(**prompt, **options)
    text = tokenizer.decode(full[0])
    assert len(text) == 5 + 16
    stop = text[13:15]
    end = next(j for j in range(6, len(text) + 1) if text[:j].endswith(stop))  # the first stop after the prompt
    assert end < len(text)
    torch.manual_seed(42)
    stopped = model.generate(**prompt, **options, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(stopped[0], full[0, :end])
    with pytest.raises(TypeError, match=r"unexpected arguments \['tokeniser'\]"):
        model(prompt.input_ids, tokeniser=tokenizer)  # a misspelt name is still refused


# -- resize_token_embeddings -------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_resized_vocabulary_trains_and_generates_the_new_ids(tied):
    """``resize_token_embeddings(260)`` resizes the embedding (and an untied head) and the LM's
    own ``vocab_size``: ids 256..259 are accepted, receive gradients in a training step, and
    generate picks them with the model's own logits."""
    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq,delta", tie_embeddings=tied))
    model.resize_token_embeddings(260)
    assert model.lm.config.vocab_size == 260 and model.config.vocab_size == 260
    assert model.lm.embed.num_embeddings == 260
    if not tied:
        assert model.lm.head.out_features == 260
    ids = torch.tensor([[3, 256, 70, 257, 258, 9, 259, 12], [259, 1, 258, 2, 257, 3, 256, 4]])
    model.train()
    before = model.lm.embed.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert float(model.lm.embed.weight.grad[256:].abs().sum(1).min()) > 0
    optimizer.step()
    model.update_codebooks()
    assert not torch.equal(model.lm.embed.weight[256:], before[256:])
    model.eval()
    prompt = ids[:, :5]
    assert torch.allclose(model(prompt).logits, model.lm(prompt)[0], rtol=0, atol=1e-12)
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, suppress_tokens=list(range(256)))
    assert bool((out[:, 5:] >= 256).all())
    for step in range(4):  # each new token is the best of the new ids under the LM's own logits
        logits = model.lm(out[:, :5 + step])[0][:, -1, 256:]
        assert torch.equal(out[:, 5 + step], logits.argmax(-1) + 256), step
    plain = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(plain[:, 5:], greedy_ours(model.lm, prompt, 6))


# -- activation checkpointing ------------------------------------------------------------------


def test_gradient_checkpointing_switch_drives_the_lms_own_and_keeps_loss_and_gradients():
    """``gradient_checkpointing_enable()`` sets ``LM.activation_checkpointing`` (disable clears
    it); the loss and every gradient equal those of the model without checkpointing."""
    lm = tiny_lm("vq,delta,local:4", n_layers=3, commitment_weight=0.5)
    plain = H.LinattnForCausalLM.from_lm(lm).train()
    checkpointed = copy.deepcopy(plain)
    assert checkpointed.supports_gradient_checkpointing
    with pytest.warns(FutureWarning):  # HF's deprecated name still works
        checkpointed.gradient_checkpointing_enable()
    assert checkpointed.lm.activation_checkpointing is True and checkpointed.is_activation_checkpointing
    assert plain.lm.activation_checkpointing is False
    ids = random_ids(2, 11, seed=40)
    losses = []
    for model in (plain, checkpointed):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    assert float(losses[0]) > 0 and torch.allclose(losses[1], losses[0], rtol=0, atol=1e-12)
    grads = {name: p.grad for name, p in plain.named_parameters()}
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0
    for name, p in checkpointed.named_parameters():
        assert torch.allclose(p.grad, grads[name], rtol=0, atol=1e-12), name
    with pytest.warns(FutureWarning):
        checkpointed.gradient_checkpointing_disable()
    assert checkpointed.lm.activation_checkpointing is False and not checkpointed.is_activation_checkpointing
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert checkpointed.lm.activation_checkpointing is True
    checkpointed.activation_checkpointing_disable()
    assert checkpointed.lm.activation_checkpointing is False


@pytest.mark.parametrize("kwargs, match", [
    ({"every_n_layers": 2}, "every_n_layers=2 is not supported"),
    ({"offload": True}, "offload=True is not supported"),
    ({"activation_checkpointing_kwargs": {"use_reentrant": True}}, r"\{'use_reentrant': True\} are not supported"),
    ({"activation_checkpointing_kwargs": {"preserve_rng_state": False}}, "preserve_rng_state"),
])
def test_checkpointing_options_the_lm_does_not_have_are_refused_by_name(kwargs, match):
    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq"))
    with pytest.raises(ValueError, match=match):
        model.activation_checkpointing_enable(**kwargs)
    assert model.lm.activation_checkpointing is False


def test_trainer_activation_checkpointing_sets_the_lms_switch(tmp_path):
    """``TrainingArguments(activation_checkpointing=True)``: the Trainer's switch reaches the LM."""
    from transformers import Trainer, TrainingArguments

    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq").float())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", activation_checkpointing=True)
    trainer = Trainer(model=model, args=args,
                      train_dataset=[{"input_ids": row, "labels": row} for row in random_ids(2, 6)])
    assert model.lm.activation_checkpointing is False
    trainer.train()
    assert model.lm.activation_checkpointing is True


# -- attn_implementation -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    lm = tiny_lm("local:4,vq,delta", n_layers=3)
    out = tmp_path_factory.mktemp("hf_api") / "model"
    H.save_pretrained_lm(lm, out)
    return lm, out


@pytest.mark.parametrize("implementation", [None, "eager", "sdpa"])
def test_eager_and_sdpa_load_and_run_linattns_own_attention(exported, implementation):
    lm, out = exported
    kwargs = {} if implementation is None else {"attn_implementation": implementation}
    model = AutoModelForCausalLM.from_pretrained(out, **kwargs)
    assert model.config._attn_implementation == "eager"
    ids = random_ids(2, 9, seed=41)
    assert torch.equal(model(ids).logits, lm(ids)[0])
    built = AutoModelForCausalLM.from_config(H.LinattnConfig.from_lm_config(lm.config), **kwargs)
    assert built.config._attn_implementation == "eager"
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention", "paged|eager",
                                            "kernels-community/flash-attn", "bogus"])
def test_other_attention_implementations_are_refused_by_name(exported, implementation):
    _, out = exported
    message = f"attn_implementation='{implementation}' is not supported by linattn models"
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        AutoModelForCausalLM.from_pretrained(out, attn_implementation=implementation)
    model = AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        model.set_attn_implementation(implementation)
