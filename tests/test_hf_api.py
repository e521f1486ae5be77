"""``linattn.hf`` through the rest of the Hugging Face API: generate's keyword arguments
(stop strings with a tokenizer), resizing the vocabulary, activation checkpointing through
the HF switches, ``attn_implementation``, the HF ``Trainer`` under gradient accumulation,
the byte tokenizer without ``import linattn.hf``, loading an export with
``trust_remote_code=True`` in a process that never imports ``linattn.hf``, and
``linattn lm-eval`` without a prefix token."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import linattn.hf as H
from test_hf import greedy_ours, random_ids, tiny_lm
from transformers import AutoModelForCausalLM, AutoTokenizer
from _helpers import lm_eval_perplexity, lm_eval_task

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


def test_resizing_the_base_model_resizes_its_whole_lm():
    """``LinattnModel`` (AutoModel) holds the whole LM: resizing it resizes an untied head with the
    embedding, and the LM accepts the new ids; a head tied to the embedding is refused as a
    separate output embedding."""
    base = H.LinattnForCausalLM.from_lm(tiny_lm("vq", tie_embeddings=False)).model
    base.resize_token_embeddings(258, mean_resizing=False)
    assert (base.lm.embed.num_embeddings, base.lm.head.out_features, base.lm.config.vocab_size) == (258, 258, 258)
    assert base(torch.tensor([[257, 3, 256]])).last_hidden_state.shape == (1, 3, 16)
    tied = H.LinattnForCausalLM.from_lm(tiny_lm("vq"))
    with pytest.raises(ValueError, match="ties its output head to the embedding"):
        tied.set_output_embeddings(torch.nn.Linear(16, 256, bias=False))


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


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention",
                                            "kernels-community/flash-attn", "bogus"])
def test_other_attention_implementations_are_refused_by_name(exported, implementation):
    _, out = exported
    message = f"attn_implementation='{implementation}' is not supported by linattn models"
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        AutoModelForCausalLM.from_pretrained(out, attn_implementation=implementation)
    model = AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        model.set_attn_implementation(implementation)


def test_continuous_batching_points_to_vllm(exported):
    """transformers' continuous batching (``generate_batch``, what ``transformers serve`` runs)
    asks for a paged attention implementation: refused with why and the vLLM route."""
    _, out = exported
    model = AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(ValueError, match=r"carry their own recurrent states.*`linattn serve DIR`"):
        model.generate_batch(inputs=[[1, 2, 3]])
    with pytest.raises(ValueError, match=r"attn_implementation='paged\|eager': transformers' continuous batching"):
        AutoModelForCausalLM.from_pretrained(out, attn_implementation="paged|eager")


# -- HF Trainer with gradient accumulation -------------------------------------------------------


def test_micro_batch_losses_add_up_to_the_full_batchs_loss():
    """With ``num_items_in_batch`` (the step's counted targets) each micro-batch's loss is its
    share of the step's: the two halves of a batch add up to the whole batch's loss (cross-
    entropy mean plus commitment loss), and so do their gradients."""
    lm = tiny_lm("vq,delta", commitment_weight=0.5)
    model = H.LinattnForCausalLM.from_lm(lm).train()
    ids = random_ids(4, 10, seed=42)
    counted = 4 * 9
    with torch.no_grad():
        logits, _, aux = lm(ids)
    assert float(aux["commit_loss"]) > 1e-3
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) \
        + aux["commit_loss"]
    whole = model(ids, labels=ids, num_items_in_batch=counted).loss
    assert torch.allclose(whole, expected, rtol=1e-12, atol=0)
    whole.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    parts = [model(half, labels=half, num_items_in_batch=torch.tensor(counted)).loss for half in ids.split(2)]
    assert torch.allclose(parts[0] + parts[1], expected, rtol=1e-12, atol=0)
    (parts[0] + parts[1]).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name], rtol=0, atol=1e-12), name


def test_shift_labels_are_each_positions_target_and_replace_labels():
    """transformers 5's loss contract: ``shift_labels [B, T]`` are the targets already aligned with
    the logits (position t predicts ``shift_labels[:, t]``), and replace ``labels``. The loss is the
    cross-entropy written out here plus the commitment loss; ``labels[:, 1:]`` followed by -100 as
    ``shift_labels`` give the loss of ``labels``, also as a micro-batch's share
    (``num_items_in_batch``); changing ``labels`` alongside them changes nothing."""
    lm = tiny_lm("vq,delta", commitment_weight=0.5)
    model = H.LinattnForCausalLM.from_lm(lm).train()
    ids = random_ids(2, 10, seed=45)
    labels = ids.clone()
    labels[0, 6:] = -100
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    with torch.no_grad():
        logits, _, aux = lm(ids)
    assert float(aux["commit_loss"]) > 1e-3
    for num_items in (None, 11):  # the same sum, over one more (ignored) position: equal to rounding
        options = {} if num_items is None else {"num_items_in_batch": num_items}
        assert torch.allclose(model(ids, shift_labels=shifted, **options).loss,
                              model(ids, labels=labels, **options).loss, rtol=1e-14, atol=0)
    targets = random_ids(2, 10, seed=46)  # the last position has a target too
    kept = targets != -100
    expected = torch.nn.functional.cross_entropy(logits[kept], targets[kept]) + aux["commit_loss"]
    loss = model(ids, shift_labels=targets).loss
    assert torch.allclose(loss, expected, rtol=1e-12, atol=0)
    assert torch.equal(model(ids, labels=random_ids(2, 10, seed=47), shift_labels=targets).loss, loss)
    assert not torch.equal(model(ids, shift_labels=shifted).loss, loss)
    with pytest.raises(ValueError, match=r"shift_labels must have shape \[batch, length\] = \[2, 10\]"):
        model(ids, shift_labels=targets[:, 1:])


def test_from_pretrained_returns_the_loading_info_when_asked(exported, tmp_path):
    """``output_loading_info=True`` gives ``(model, loading info)`` as for any transformers model: the
    model is the saved one, and a tensor the folder lacks is listed as missing."""
    from safetensors.torch import load_file, save_file

    lm, out = exported
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model) is H.LinattnForCausalLM
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = random_ids(2, 9, seed=48)
    assert torch.equal(model(ids).logits, lm(ids)[0])
    lacking = tmp_path / "lacking"
    shutil.copytree(out, lacking)
    tensors = load_file(lacking / "model.safetensors")
    del tensors["model.lm.norm.weight"]
    save_file(tensors, lacking / "model.safetensors", metadata={"format": "pt"})
    _, info = H.LinattnForCausalLM.from_pretrained(lacking, output_loading_info=True)
    assert set(info["missing_keys"]) == {"model.lm.norm.weight"}


def _train_one_step(tmp_path, lm, rows, batch: int, accumulation: int):
    """One SGD step of the HF ``Trainer`` on ``rows`` -> (the step's loss: the sum of the losses
    the Trainer backpropagated, in float64, and the trained model)."""
    from transformers import Trainer, TrainingArguments

    class Recording(Trainer):
        losses: list = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.losses.append(loss.detach())
            return loss

    model = H.LinattnForCausalLM.from_lm(lm)
    args = TrainingArguments(output_dir=str(tmp_path / f"out{batch}"), per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0, optim="sgd",
                             lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no",
                             weight_decay=0.0, max_grad_norm=0.0, seed=3)
    trainer = Recording(model=model, args=args, train_dataset=[{"input_ids": row, "labels": row} for row in rows])
    trainer.losses = []
    trainer.train()
    assert len(trainer.losses) == accumulation and trainer.losses[0].dtype == torch.float64
    return float(sum(trainer.losses)), model


def test_hf_trainer_accumulating_two_micro_batches_equals_the_full_batch(tmp_path):
    """One optimizer step of the HF ``Trainer`` over 4 rows, as one batch or as 2 accumulated
    micro-batches of 2 (float64): the same step loss (the full batch's cross-entropy plus its
    commitment loss, counted once) and the same updated weights. (The commitment loss is summed
    in float32, so it is kept small for the 1e-7 comparison.)"""
    lm = tiny_lm("vq,delta", commitment_weight=0.05)
    rows = random_ids(4, 10, seed=43)
    with torch.no_grad():
        logits, _, aux = copy.deepcopy(lm).train()(rows)
    assert float(aux["commit_loss"]) > 1e-3
    expected = float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten())
                     + aux["commit_loss"])
    full_loss, full = _train_one_step(tmp_path, lm, rows, batch=4, accumulation=1)
    split_loss, split = _train_one_step(tmp_path, lm, rows, batch=2, accumulation=2)
    assert full_loss == pytest.approx(expected, rel=0, abs=1e-7)
    assert split_loss == pytest.approx(full_loss, rel=0, abs=1e-7)
    trained = dict(full.named_parameters())
    assert any(not torch.equal(trained[name], p) for name, p in H.LinattnForCausalLM.from_lm(lm).named_parameters())
    for name, p in split.named_parameters():
        assert torch.allclose(p, trained[name], rtol=0, atol=1e-7), name


# -- the byte tokenizer without import linattn.hf ------------------------------------------------

TEXTS = ["To be, or not", "Ā", "a\x00b", "héllo ☃\n\tend ", "ĀĀ\x00Ā"]
BATCH = ["ab", "Ā\x00c", "abcdef"]

# What a tokenizer does with some texts and a padded batch (as JSON-able values); run here and,
# as source, in a fresh process.
_TOKENIZED = """
def tokenized(tokenizer, texts, batch):
    padded = tokenizer(batch, padding=True)
    return {"ids": [tokenizer(text).input_ids for text in texts], "padded": padded.input_ids,
            "mask": padded.attention_mask, "pad": tokenizer.pad_token_id, "side": tokenizer.padding_side,
            "decoded": tokenizer.batch_decode(padded.input_ids),
            "skipped": tokenizer.batch_decode(padded.input_ids, skip_special_tokens=True),
            "special": {token: tokenizer(token).input_ids for token in tokenizer.all_special_tokens}}
"""
_namespace: dict = {}
exec(_TOKENIZED, _namespace)
_tokenized = _namespace["tokenized"]

# AutoTokenizer in a process that never imports linattn.hf: prints what it does as JSON.
_TOKENIZE_ALONE = "import json, sys\nfrom transformers import AutoTokenizer\n" + _TOKENIZED + """
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
texts, batch = json.loads(sys.argv[2])
print()  # after transformers' unanswered prompt about the config's remote code (the tokenizer needs none)
print(json.dumps({"linattn.hf imported": "linattn.hf" in sys.modules, "class": type(tokenizer).__name__,
                  **tokenized(tokenizer, texts, batch)}))
"""


def _src() -> str:
    return str(Path(__file__).resolve().parents[1] / "src")


def _run_python(script: str, *args: str, cwd=None, **env_vars: str) -> str:
    """Run ``script`` in a fresh Python (this worktree's linattn importable, stdin closed so
    transformers' remote-code prompt gets no answer); return its last line of output."""
    env = {**os.environ, "PYTHONPATH": _src(), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env_vars}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_auto_tokenizer_gives_the_same_ids_with_and_without_import_linattn_hf(exported):
    """The saved byte tokenizer needs no linattn code: its class is the standard
    ``TokenizersBackend`` with and without ``import linattn.hf``, and a process that never imports
    ``linattn.hf`` gets the same ids, padding and decoding as ``LinattnByteTokenizer``; they are
    the UTF-8 bytes ("Ā" is the bytes C4 80, never the pad token)."""
    _, out = exported
    alone = json.loads(_run_python(_TOKENIZE_ALONE, str(out), json.dumps([TEXTS, BATCH])))
    assert alone.pop("linattn.hf imported") is False
    assert alone.pop("class") == "TokenizersBackend"
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(tokenizer).__name__ == "TokenizersBackend"
    here = json.loads(json.dumps(_tokenized(H.byte_tokenizer(), TEXTS, BATCH)))
    assert alone == here == json.loads(json.dumps(_tokenized(tokenizer, TEXTS, BATCH)))
    assert here["ids"] == [list(text.encode("utf-8")) for text in TEXTS]
    width = max(len(text.encode()) for text in BATCH)
    assert here["padded"] == [[0] * (width - len(t.encode())) + list(t.encode()) for t in BATCH]
    assert here["pad"] == 0 and here["side"] == "left"


def test_byte_tokenizer_round_trips_u0100_and_skip_special_tokens_drops_padding():
    """"Ā" (U+0100, the NUL byte's byte-level symbol) in a text is its own two bytes and decodes
    back; every special token's string encodes to its own bytes (so none can change what a
    text means); ``skip_special_tokens=True`` drops the padding a batch was given."""
    tokenizer = H.byte_tokenizer()
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert ids == list(text.encode("utf-8")), text
        assert tokenizer.decode(ids) == text
    assert tokenizer("Ā").input_ids == [0xC4, 0x80]
    assert tokenizer.all_special_tokens, "the pad token is special"
    for token in tokenizer.all_special_tokens:
        assert tokenizer(token).input_ids == list(token.encode("utf-8")), repr(token)
    texts = ["ab", "a longer row", "Āé"]
    padded = tokenizer(texts, padding=True, return_tensors="pt")
    assert int((padded.attention_mask == 0).sum()) > 0
    assert tokenizer.batch_decode(padded.input_ids, skip_special_tokens=True) == texts
    assert tokenizer.batch_decode(padded.input_ids)[0] == "\x00" * 10 + "ab"
    assert tokenizer.vocab_size == 256 and len(tokenizer) == 256


# -- loading an export with trust_remote_code=True ---------------------------------------------------

# A fresh process that never imports linattn itself: loads the folder without and with
# trust_remote_code=True and prints what it got as JSON.
_LOAD_REMOTE = """
import json, sys
before = sorted(name for name in sys.modules if name.startswith("linattn"))
import torch
from transformers import AutoModelForCausalLM
folder, ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
try:
    AutoModelForCausalLM.from_pretrained(folder)
    refused = ""
except ValueError as error:
    refused = str(error)
after_refusal = "linattn.hf" in sys.modules
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
with torch.no_grad():
    logits = model(ids).logits
generated = model.generate(ids, max_new_tokens=6, do_sample=False)
print()  # after the unanswered "Do you wish to run the custom code? [y/N] " prompt
print(json.dumps({"before": before, "refused": refused, "after_refusal": after_refusal,
                  "classes": [c.__module__ + "." + c.__qualname__ for c in type(model).__mro__[:2]],
                  "dtype": str(logits.dtype), "logits": logits.tolist(), "generated": generated.tolist()}))
"""


def test_an_export_loads_with_trust_remote_code_in_a_process_that_never_imports_linattn_hf(exported, tmp_path):
    """``config.json``'s ``auto_map`` names the folder's ``modeling_linattn.py``, which imports
    the installed linattn's classes: ``trust_remote_code=True`` loads the export in a process
    that never imported ``linattn.hf``, with the in-process model's exact logits and tokens.
    Without it (and without the import) transformers refuses, naming ``trust_remote_code``."""
    lm, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_linattn.LinattnForCausalLM"
    assert (out / "modeling_linattn.py").is_file()
    ids = random_ids(2, 9, seed=44)
    got = json.loads(_run_python(_LOAD_REMOTE, str(out), json.dumps(ids.tolist()),
                                 HF_MODULES_CACHE=str(tmp_path / "modules")))
    assert got["before"] == []
    assert "trust_remote_code=True" in got["refused"] and got["after_refusal"] is False
    assert got["classes"][0].startswith("transformers_modules.")
    assert got["classes"][1] == "linattn.hf.modeling.LinattnForCausalLM"
    assert got["dtype"] == "torch.float64"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is H.LinattnForCausalLM  # with import linattn.hf: the local classes, no remote code
    with torch.no_grad():  # as the other process computed them (with autograd some kernels differ in the last bit)
        logits = model(ids).logits
    assert torch.equal(torch.tensor(got["logits"], dtype=torch.float64), logits)
    assert got["generated"] == torch.cat([ids, greedy_ours(lm, ids, 6)], 1).tolist()


# -- linattn lm-eval without prefix_token_id -------------------------------------------------------


def test_lm_eval_needs_no_prefix_token_and_knows_the_model_is_causal(exported, tmp_path, monkeypatch, caplog,
                                                                     capsys):
    """``linattn lm-eval`` on an export without ``prefix_token_id``: an empty context is
    conditioned on the export's start token (the newline, config.bos_token_id), the scores are
    the model's own log-probabilities, and lm_eval does not warn that the model type is
    neither causal nor seq2seq."""
    import logging

    from linattn.cli import main

    lm, out = exported
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == 10
    docs = [{"context": "", "continuation": "To be"}, {"context": "Now is the", "continuation": " winter"}]
    tasks = lm_eval_task(tmp_path, monkeypatch, "linattn_api_lines", docs, target_delimiter="")
    results = tmp_path / "results"
    with caplog.at_level(logging.WARNING):
        code = main(["lm-eval", "run", "--model", "hf", "--model_args", f"pretrained={out},dtype=float64",
                     "--tasks", "linattn_api_lines", "--include_path", str(tasks), "--device", "cpu",
                     "--batch_size", "2", "--output_path", str(results)])
    assert code == 0
    printed = caplog.text + "".join(capsys.readouterr())
    assert "neither marked as CausalLM" not in printed
    [result_file] = list(results.rglob("results*.json"))
    scored = json.loads(result_file.read_text())["results"]["linattn_api_lines"]
    assert scored["perplexity,none"] == pytest.approx(lm_eval_perplexity(lm, docs), rel=1e-6)


def test_an_older_exports_tokenizer_loads_as_the_byte_tokenizer(tmp_path):
    """A folder saved by an older linattn (vocabulary entry "Ā" for byte 0, ``pad_token: "Ā"`` in
    tokenizer_config.json) loads, with ``import linattn.hf``, as today's tokenizer: "Ā" in a
    text is C4 80, padding is dropped by ``skip_special_tokens``. Another pad token is refused."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from linattn.hf.tokenizer import _byte_symbols

    old = Tokenizer(models.BPE(vocab={symbol: byte for byte, symbol in enumerate(_byte_symbols())}, merges=[]))
    old.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    old.decoder = decoders.ByteLevel()
    old.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"backend": "tokenizers", "pad_token": "Ā", "padding_side": "left", "tokenizer_class": "LinattnByteTokenizer"}))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(tokenizer, H.LinattnByteTokenizer)
    loaded = _tokenized(tokenizer, TEXTS, BATCH)
    assert loaded == _tokenized(H.byte_tokenizer(), TEXTS, BATCH)
    assert loaded["skipped"] == [text.replace("\x00", "") for text in BATCH]
    assert tokenizer("Ā").input_ids == [0xC4, 0x80] and tokenizer.pad_token_id == 0
    with pytest.raises(ValueError, match="pads with the NUL byte"):
        H.LinattnByteTokenizer(pad_token="<pad>")
