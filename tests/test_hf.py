"""``linattn.hf``: linattn models through the Hugging Face API (forward, loss, generate with a
recurrent cache, left padding, beam search, save/load, Auto classes, tokenizer, pipeline,
``linattn export`` and lm-evaluation-harness), against linattn's own ``LM``."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import linattn.hf as H
from linattn import LM, LMConfig
from linattn.cli import main
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline
from _helpers import codebook_trainer, head_fields, lm_eval_perplexity, lm_eval_task

torch.set_num_threads(1)

KINDS = ["vq", "soft-vq", "gau-softmax", "softmax", "linear:elu", "linear:relu", "linear:dpfp", "linear:taylor",
         "favor", "delta", "delta:dpfp", "delta:elu", "retnet", "gla", "gated-delta", "local:4", "local:4,vq,delta",
         "vq-attn:rerope", "vq-attn:bias", "linear:hedgehog"]


def tiny_lm(attention: str = "vq", seed: int = 0, **overrides) -> LM:
    """A float64 model small enough for exact comparisons; blocks/chunks/windows of 4 so a
    few tokens cross several of them."""
    torch.manual_seed(seed)
    values = dict(d_model=16, n_layers=max(2, attention.count(",") + 1), n_heads=2, attention=attention,
                  gau_d_k=8, codebook_size=8, block_size=4, chunk_size=4, local_window=4, favor_features=8)
    values.update(overrides)
    model = LM(LMConfig(**head_fields(values["attention"], **values))).double().eval()
    if any(q is not None for q in model.quantizers()):
        with torch.no_grad():  # spread the EMA state away from its init, so a lost buffer shows
            for q in model.quantizers():
                q.codebook.add_(0.1 * torch.randn_like(q.codebook))
                q.ema_counts.mul_(3.0)
    return model


def greedy_ours(lm: LM, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` greedy tokens after ``prompt [B, T]`` by linattn's own generator."""
    return torch.stack(list(lm.generate(prompt, n, temperature=0)), 1)


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


# -- config ------------------------------------------------------------------------------


def test_config_round_trips_every_lm_field(tmp_path):
    lm_config = LMConfig(d_model=48, n_layers=3, attention=["local:8", "vq", "delta"], n_heads=4, n_kv_heads=2,
                         head_dim=16, ffn_hidden=96, rotary_base=500.0, chunk_size=8, favor_features=16,
                         feature_seed=3, delta_short_conv=None, softmax_memory=5, gau_d_k=24, gau_d_v=40,
                         codebook_size=32, block_size=16, commitment_weight=0.5, ema_decay=0.9, kmeans_init=True,
                         dead_code_threshold=0.25, soft_vq_temperature=2.0, tie_embeddings=False, init_std=0.01,
                         extra={"note": "x"})
    config = H.LinattnConfig.from_lm_config(lm_config)
    assert config.to_lm_config() == lm_config
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, H.LinattnConfig)
    assert loaded.to_lm_config() == lm_config
    lm_fields = {f for f in LMConfig.__dataclass_fields__}
    assert lm_fields <= set(json.loads((tmp_path / "config.json").read_text()))


def test_config_exposes_the_hugging_face_names():
    config = H.LinattnConfig(d_model=48, n_layers=3, attention="softmax", n_heads=4, n_kv_heads=2,
                             tie_embeddings=False)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (48, 3, 4)
    assert (config.num_key_value_heads, config.tie_word_embeddings, config.vocab_size) == (2, False, 256)
    assert H.LinattnConfig(attention="delta", n_heads=4).num_key_value_heads == 4
    assert H.LinattnConfig(attention="delta").num_attention_heads == 4  # unset: 4, as LMConfig resolves it
    assert H.LinattnConfig(attention="vq").num_attention_heads is None  # GAU pairs have no heads
    config.hidden_size = 64
    assert config.d_model == 64 and config.to_lm_config().d_model == 64
    assert config.model_type == "linattn"


def test_config_rejects_an_unknown_layer_kind():
    with pytest.raises(ValueError, match="unknown layer attention spec 'bogus'"):
        H.LinattnConfig(attention="vq,bogus")
    with pytest.raises(TypeError, match="config must be an LMConfig"):
        H.LinattnConfig.from_lm_config({"d_model": 16})


# -- forward, loss, generate against LM ------------------------------------------------------


@pytest.mark.parametrize("attention", KINDS)
def test_forward_and_greedy_generation_equal_linattn(attention):
    lm = tiny_lm(attention)
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(2, 11)
    expected = lm(ids)[0]
    output = model(ids)
    assert output.logits.dtype == torch.float64
    assert torch.allclose(output.logits, expected, rtol=0, atol=1e-12)
    prompt, n = ids[:, :5], 9
    ours = greedy_ours(lm, prompt, n)
    cached = model.generate(prompt, max_new_tokens=n, do_sample=False)
    uncached = model.generate(prompt, max_new_tokens=n, do_sample=False, use_cache=False)
    assert torch.equal(cached[:, :5], prompt)
    assert torch.equal(cached[:, 5:], ours)
    assert torch.equal(uncached, cached)


def test_cache_carries_the_lm_state():
    lm = tiny_lm("vq,delta")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(2, 9)
    first = model(ids[:, :6], use_cache=True)
    assert isinstance(first.cache, H.LinattnCache) and first.cache.get_seq_length() == 6
    second = model(ids[:, 6:], cache=first.cache)
    full, state, _ = lm(ids)
    assert torch.allclose(second.logits, full[:, 6:], rtol=0, atol=1e-12)
    carried = H.lm_state_of(second.cache)
    assert carried.steps == state.steps == 9
    next_ids = random_ids(2, 1, seed=5)
    assert torch.allclose(lm(next_ids, carried)[0], lm(next_ids, state)[0], rtol=0, atol=1e-12)
    assert model(ids, use_cache=False).cache is None


def test_sampling_generates_valid_tokens_reproducibly():
    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq")).eval()
    prompt = random_ids(2, 4)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=20, temperature=0.8))
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape == (2, 10) and int(runs[0].max()) < 256


@pytest.mark.parametrize("train_mode", [False, True])
def test_loss_is_the_trainers_number(train_mode):
    lm = tiny_lm("vq,local:4", commitment_weight=0.5)
    model = H.LinattnForCausalLM.from_lm(lm)
    lm.train(train_mode)
    model.train(train_mode)
    ids = random_ids(2, 10)
    logits, _, aux = lm(ids)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()) + aux["commit_loss"]
    assert float(aux["commit_loss"].detach()) > 0
    loss = model(ids, labels=ids).loss
    assert torch.allclose(loss, expected.to(loss.dtype), rtol=1e-12, atol=0)
    labels = ids.clone()
    labels[0, 4:] = -100
    kept = labels[:, 1:] != -100
    ce = F.cross_entropy(logits[:, :-1][kept], ids[:, 1:][kept], reduction="sum")
    summed = model(ids, labels=labels, num_items_in_batch=7).loss  # a micro-batch of 12 targets in a step of 7
    share = int(kept.sum()) / 7
    assert int(kept.sum()) == 12
    assert torch.allclose(summed, (ce / 7 + aux["commit_loss"] * share).to(summed.dtype), rtol=1e-12, atol=0)
    loss.backward()
    assert model.lm.embed.weight.grad is not None and float(model.lm.embed.weight.grad.abs().sum()) > 0


def test_hidden_states_and_inputs_embeds():
    lm = tiny_lm("vq,delta")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(2, 7)
    output = model(ids, output_hidden_states=True)
    assert len(output.hidden_states) == lm.config.n_layers + 1
    assert torch.equal(output.hidden_states[0], lm.embed(ids))
    first_layer, _, _ = lm.layers[0](lm.embed(ids))
    assert torch.allclose(output.hidden_states[1], first_layer, rtol=0, atol=1e-12)
    # the last entry is the normed output (as in HF decoders), with and without padding (the grouped path)
    assert torch.allclose(output.hidden_states[-1], model.model(ids).last_hidden_state, rtol=0, atol=1e-12)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    padded = model(ids, attention_mask=mask, output_hidden_states=True)
    assert torch.allclose(padded.hidden_states[-1][1], output.hidden_states[-1][1], rtol=0, atol=1e-12)
    base = model.model(ids)
    assert torch.allclose(lm.logits(base.last_hidden_state), output.logits, rtol=0, atol=1e-12)
    embedded = model(inputs_embeds=lm.embed(ids))
    assert torch.allclose(embedded.logits, output.logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("call, match", [
    (lambda m, ids: m(ids, output_attentions=True), "output_attentions"),
    (lambda m, ids: m(ids, position_ids=torch.arange(5)[None]), "position_ids"),
    (lambda m, ids: m(ids, attention_mask=torch.tensor([[1, 0, 1, 1, 1]] * 2)), "pad on the left"),
    (lambda m, ids: m(ids, attention_mask=torch.tensor([[1, 1, 1, 0, 0]] * 2)), "pad on the left"),
    (lambda m, ids: m(ids, attention_mask=torch.ones(2, 4)), r"attention_mask must have shape \[batch, past"),
    (lambda m, ids: m(ids, attention_mask=torch.full((2, 5), 2)), "only 0"),
    (lambda m, ids: m(ids, labels=ids[:, :3]), "labels must have shape"),
    (lambda m, ids: m(ids, unknown_flag=1), "unexpected arguments"),
    (lambda m, ids: m(ids + 300), r"ids must lie in \[0, 256\)"),
    (lambda m, ids: m(ids, inputs_embeds=torch.zeros(2, 5, 16)), "exactly one of input_ids"),
])
def test_bad_input_is_named(call, match):
    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq")).eval()
    with pytest.raises((ValueError, TypeError), match=match):
        call(model, random_ids(2, 5))


# -- left padding and beam search ----------------------------------------------------------


@pytest.mark.parametrize("attention", ["vq", "softmax", "delta", "local:4", "linear:elu", "local:4,vq,delta",
                                       "retnet,gla,gated-delta"])
def test_left_padded_batch_generates_what_each_prompt_generates_alone(attention):
    lm = tiny_lm(attention)
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    short, long = random_ids(1, 3, seed=2)[0], random_ids(1, 9, seed=3)[0]
    ids = torch.stack([torch.cat([torch.zeros(6, dtype=torch.long), short]), long])
    mask = torch.stack([torch.cat([torch.zeros(6, dtype=torch.long), torch.ones(3, dtype=torch.long)]),
                        torch.ones(9, dtype=torch.long)])
    n = 7
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
    assert torch.equal(batched[0, 9:], greedy_ours(lm, short[None], n)[0])
    assert torch.equal(batched[1, 9:], greedy_ours(lm, long[None], n)[0])
    uncached = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, use_cache=False)
    assert torch.equal(uncached, batched)
    logits = model(ids, attention_mask=mask).logits
    assert torch.allclose(logits[0, 6:], lm(short[None])[0][0], rtol=0, atol=1e-12)
    assert torch.equal(logits[0, :6], torch.zeros_like(logits[0, :6]))


def test_tokenizer_padding_feeds_generate():
    lm = tiny_lm("vq,local:4")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    tokenizer = H.byte_tokenizer()
    texts = ["To be", "or not to be, that"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    for row, text in enumerate(texts):
        alone = greedy_ours(lm, torch.tensor([list(text.encode())]), 5)[0]
        assert torch.equal(out[row, -5:], alone)


@torch.no_grad()
def _beam_reference(lm: LM, prompt: list[int], beams: int, steps: int) -> list[int]:
    """Beam search by full recomputation: keep the ``beams`` highest total log-probabilities."""
    hypotheses = [(0.0, list(prompt))]
    for _ in range(steps):
        candidates = []
        for score, tokens in hypotheses:
            logp = torch.log_softmax(lm(torch.tensor([tokens]))[0][0, -1].float(), -1)
            top = logp.topk(beams)
            candidates += [(score + float(v), tokens + [int(i)]) for v, i in zip(top.values, top.indices)]
        hypotheses = sorted(candidates, key=lambda c: -c[0])[:beams]
    return hypotheses[0][1]


@pytest.mark.parametrize("attention", ["vq", "local:4,delta"])
def test_beam_search_equals_a_recomputing_reference(attention):
    lm = tiny_lm(attention, seed=4)
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    prompt = random_ids(1, 5, seed=6)
    out = model.generate(prompt, max_new_tokens=6, num_beams=2, do_sample=False)
    assert out[0].tolist() == _beam_reference(lm, prompt[0].tolist(), beams=2, steps=6)


def test_cache_row_selection_moves_every_state_tensor():
    lm = tiny_lm("vq,softmax,delta,local:4,favor", n_layers=5)
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    prompts = random_ids(3, 6, seed=8)
    cache = model(prompts).cache
    cache.reorder_cache(torch.tensor([2, 0, 0, 1]))
    step = random_ids(4, 2, seed=9)
    got = model(step, cache=cache).logits
    for row, source in enumerate([2, 0, 0, 1]):
        full = lm(torch.cat([prompts[source], step[row]])[None])[0][0, 6:]
        assert torch.allclose(got[row], full, rtol=0, atol=1e-12)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(1)


# -- save / load, tokenizer, pipeline --------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory, request):
    """A saved model of three kinds (``request.param``: other kinds, for a test that asks)."""
    lm = tiny_lm(getattr(request, "param", "local:4,vq,delta"), n_layers=3, tie_embeddings=False)
    out = tmp_path_factory.mktemp("hf") / "model"
    H.save_pretrained_lm(lm, out)
    return lm, out


@pytest.mark.parametrize("saved", ["local:4,vq,delta", "retnet,gla,gated-delta"], indirect=True)
def test_save_and_load_give_identical_logits_tokens_and_buffers(saved):
    lm, out = saved
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(loaded, H.LinattnForCausalLM) and loaded.dtype == torch.float64
    reference = dict(lm.named_buffers()) | dict(lm.named_parameters())
    restored = dict(loaded.lm.named_buffers()) | dict(loaded.lm.named_parameters())
    assert set(restored) == set(reference)
    for name, tensor in reference.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name
    ids = random_ids(2, 10)
    assert torch.equal(loaded(ids).logits, lm(ids)[0])
    prompt = ids[:, :4]
    assert torch.equal(loaded.generate(prompt, max_new_tokens=8, do_sample=False)[:, 4:], greedy_ours(lm, prompt, 8))
    direct = H.LinattnForCausalLM.from_pretrained(out)
    assert torch.equal(direct(ids).logits, lm(ids)[0])
    base = AutoModel.from_pretrained(out)
    assert isinstance(base, H.LinattnModel)
    assert torch.equal(base.lm.embed.weight, lm.embed.weight)


def test_a_corrupted_weights_file_fails_clearly(saved, tmp_path):
    _, out = saved
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception, match="(?i)safetensor|incomplete|deserializ|header"):
        AutoModelForCausalLM.from_pretrained(broken)


def test_a_config_naming_an_unknown_layer_kind_fails_clearly(saved, tmp_path):
    _, out = saved
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((out / "config.json").read_text())
    config["attention"] = "vq,warp-drive"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown layer attention spec 'warp-drive'"):
        AutoModelForCausalLM.from_pretrained(bad)


def test_byte_tokenizer_is_lossless_and_pads_with_zero(saved):
    _, out = saved
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(tokenizer).__name__ == "TokenizersBackend"  # what tokenizer_config.json names
    text = "héllo, Āwörld\x00 ☃ \t end "
    ids = tokenizer(text).input_ids
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.pad_token_id == 0 and tokenizer.padding_side == "left"
    assert tokenizer(["ab", "abcd"], padding=True).input_ids == [[0, 0, 97, 98], [97, 98, 99, 100]]


def test_pipeline_generates_text(saved):
    _, out = saved
    generator = pipeline("text-generation", model=str(out))
    text = generator("ROMEO.", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    assert text.startswith("ROMEO.") and len(text.encode()) >= len("ROMEO.") + 1


def test_export_cli_writes_the_runs_model(tmp_path, capsys):
    from _helpers import english_like
    from test_train_cli import train_argv
    from linattn.train import load_model

    corpus = tmp_path / "tiny.txt"
    corpus.write_text(english_like(4000), encoding="utf-8")
    run = tmp_path / "run"
    assert main(train_argv(corpus, run, steps=4)) == 0
    assert main(["export", "--ckpt", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert "AutoModelForCausalLM.from_pretrained" in capsys.readouterr().out
    lm, _ = load_model(run)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = random_ids(2, 12)
    assert torch.equal(exported(ids).logits, lm(ids)[0])
    assert main(["export", "--ckpt", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) != 0


# -- lm-evaluation-harness ------------------------------------------------------------------


def test_lm_eval_scores_an_exported_model_on_a_local_task(saved, tmp_path, monkeypatch):
    lm, out = saved
    docs = [{"context": "To be, or not to", "continuation": " be"},
            {"context": "Now is the winter of our", "continuation": " discontent"},
            {"context": "A horse! a horse! my kingdom for", "continuation": " a horse"}]
    tasks = lm_eval_task(tmp_path, monkeypatch, "linattn_lines", docs)
    results = tmp_path / "results"
    model_args = f"pretrained={out},dtype=float64,prefix_token_id=10"
    code = main(["lm-eval", "run", "--model", "hf", "--model_args", model_args,
                 "--tasks", "linattn_lines", "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2",
                 "--output_path", str(results)])
    assert code == 0
    [result_file] = list(results.rglob("results*.json"))
    scored = json.loads(result_file.read_text())["results"]["linattn_lines"]
    assert scored["perplexity,none"] == pytest.approx(lm_eval_perplexity(lm, docs), rel=1e-6)


def test_hf_module_registers_without_remote_code():
    assert os.environ.get("TRANSFORMERS_TRUST_REMOTE_CODE") is None
    assert AutoConfig.for_model("linattn").model_type == "linattn"
    assert isinstance(AutoModelForCausalLM.from_config(H.LinattnConfig(d_model=16, n_layers=1, gau_d_k=8,
                                                                       codebook_size=8)),
                      H.LinattnForCausalLM)


def test_codebook_callback_updates_codebooks():
    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq")).train()
    before = [q.codebook.clone() for q in model.lm.quantizers()]
    model(random_ids(2, 9))
    H.CodebookUpdateCallback().on_step_end(None, None, None, model=model)
    after = [q.codebook for q in model.lm.quantizers()]
    assert any(not torch.equal(a, b) for a, b in zip(after, before))


def test_hf_trainer_trains_a_vq_model_and_updates_its_codebooks(tmp_path):
    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq,local:4").float())
    before = [q.codebook.clone() for q in model.lm.quantizers()]
    result = codebook_trainer(model, tmp_path, 3, random_ids(8, 12, seed=12)).train()
    assert math.isfinite(result.training_loss)
    assert all(not torch.equal(q.codebook, b) for q, b in zip(model.lm.quantizers(), before))
    with torch.no_grad():
        pending = [float(q._pending_counts.sum()) for q in model.lm.quantizers()]
    assert pending == [0.0] * len(pending)  # every batch's statistics went into an update


def test_config_defaults_are_lm_config_defaults():
    assert H.LinattnConfig().to_lm_config() == LMConfig()


def test_cache_reports_what_generate_reads():
    """The answers HF code reads from a cache: one entry per layer, no maximum length (-1,
    HF's unbounded convention), not croppable, not sliding/linear/dummy (so generate slices a
    continued prompt by get_seq_length)."""
    lm = tiny_lm("vq,delta")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    empty = H.LinattnCache(batch_size=2)
    assert len(empty) == 0 and not empty.is_initialized and empty.get_seq_length() == 0
    cache = model(random_ids(2, 5)).cache
    assert len(cache) == lm.config.n_layers and cache.is_initialized and cache.get_seq_length() == 5
    assert cache.get_max_length() == -1 and not cache.is_croppable and not cache.is_compileable
    assert cache.is_sliding == [False] and cache.is_linear == [False] and cache.is_dummy == [False]


def test_generate_continues_from_a_cache_given_the_whole_sequence():
    lm = tiny_lm("local:4,vq,delta")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    prompt = random_ids(2, 7, seed=13)
    cache = model(prompt[:, :5]).cache
    continued = model.generate(prompt, cache=cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(continued[:, 7:], greedy_ours(lm, prompt, 6))


def test_cache_row_selection_keeps_padding_only_rows_stateless():
    lm = tiny_lm("vq,delta")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(3, 4, seed=14)
    mask = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1]])
    cache = model(ids, attention_mask=mask).cache
    assert sorted(int(r) for g in cache.groups for r in g.rows) == [1, 2]
    cache.select_rows(torch.arange(3))
    assert sorted(int(r) for g in cache.groups for r in g.rows) == [1, 2]
    step = random_ids(3, 1, seed=15)
    logits = model(step, cache=cache, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)).logits
    assert torch.allclose(logits[0], lm(step[:1])[0][0], rtol=0, atol=1e-12)  # row 0 starts fresh
    assert torch.allclose(logits[1], lm(torch.cat([ids[1:2, 2:], step[1:2]], 1))[0][0, -1:], rtol=0, atol=1e-12)


# -- mutation-testing gaps of hf/modeling.py (2026-12-01 run) -----------------------------------


def test_a_legacy_config_gradient_checkpointing_flag_turns_on_the_lms_checkpointing():
    """A config carrying the legacy ``gradient_checkpointing=True`` builds a model whose LM
    checkpoints its layers (HF consumes the flag, so it is not saved again)."""
    legacy = H.LinattnConfig(d_model=16, n_layers=1, gau_d_k=8, codebook_size=8,
                             gradient_checkpointing=True)
    built = H.LinattnForCausalLM(legacy)
    assert built.lm.activation_checkpointing is True
    assert not hasattr(built.config, "gradient_checkpointing")
    plain = H.LinattnForCausalLM(H.LinattnConfig(d_model=16, n_layers=1, gau_d_k=8, codebook_size=8))
    assert plain.lm.activation_checkpointing is False


@pytest.mark.parametrize("decoding", [{"prompt_lookup_num_tokens": 2}, "assistant"])
def test_assisted_and_prompt_lookup_decoding_are_refused_up_front(decoding):
    """A recurrent state cannot take back rejected draft tokens: generate refuses candidate-based
    decoding by name (``_is_stateful``), before anything runs."""
    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq")).eval()
    kwargs = {"assistant_model": model} if decoding == "assistant" else decoding
    with pytest.raises(ValueError, match="assisted generation is not supported with stateful models"):
        model.generate(random_ids(1, 4), max_new_tokens=3, do_sample=False, **kwargs)


@pytest.mark.parametrize("implementation", ["static", "sliding_window"])
def test_generate_ignores_a_kv_cache_implementation_and_carries_its_own_cache(implementation):
    """``generate`` must not build a KV cache for this model: a ``cache_implementation`` asking for
    one is ignored, and the tokens and the returned cache are linattn's."""
    lm = tiny_lm("vq,delta")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    prompt = random_ids(2, 5, seed=16)
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, cache_implementation=implementation,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences[:, 5:], greedy_ours(lm, prompt, 4))
    assert isinstance(out.cache, H.LinattnCache)


def _write_header_padded(path, data_start_mod_64: int) -> None:
    """Rewrite a safetensors file with its JSON header padded by spaces (the format allows it)
    so that the tensor data starts at ``data_start_mod_64`` modulo 64 bytes of the file."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header, data = raw[8:8 + size].rstrip(b" "), raw[8 + size:]
    padding = (data_start_mod_64 - 8 - len(header)) % 64
    header = header + b" " * padding
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


@pytest.mark.parametrize("data_start_mod_64", [0, 8])
def test_a_loaded_model_owns_fresh_aligned_memory(saved, tmp_path, data_start_mod_64):
    """``from_pretrained`` copies every loaded tensor to a fresh allocation: all are 64-byte aligned
    whatever the file's layout, and rewriting the file in place afterwards changes nothing."""
    lm, out = saved
    copy = tmp_path / "model"
    shutil.copytree(out, copy)
    weights = copy / "model.safetensors"
    _write_header_padded(weights, data_start_mod_64)
    loaded = H.LinattnForCausalLM.from_pretrained(copy)
    tensors = dict(loaded.lm.named_parameters()) | dict(loaded.lm.named_buffers())
    assert [name for name, t in tensors.items() if t.data_ptr() % 64] == []
    size = int.from_bytes(weights.read_bytes()[:8], "little")
    with open(weights, "r+b") as f:  # same length, same header, every weight byte zero
        f.seek(8 + size)
        f.write(bytes(weights.stat().st_size - 8 - size))
    reference = dict(lm.named_parameters()) | dict(lm.named_buffers())
    assert [name for name, t in reference.items() if not torch.equal(tensors[name], t)] == []


def test_base_model_continues_from_a_cache_passed_as_cache_or_past_key_values():
    """``LinattnModel.forward`` takes the cache under either name; continuing gives the hidden
    states of the whole sequence at once."""
    lm = tiny_lm("vq,delta")
    base = H.LinattnForCausalLM.from_lm(lm).eval().model
    ids = random_ids(2, 9, seed=17)
    full = base(ids).last_hidden_state
    for name in ("cache", "past_key_values"):
        first = base(ids[:, :6])
        second = base(ids[:, 6:], **{name: first.cache})
        assert torch.allclose(second.last_hidden_state, full[:, 6:], rtol=0, atol=1e-12), name
        assert second.cache.get_seq_length() == 9


def test_a_cache_of_another_kind_is_refused_unless_it_is_empty():
    """Generic HF code may pass an empty ``DynamicCache``: it is taken as no cache. A filled one,
    or something that is no ``Cache`` at all, is refused naming the type."""
    from transformers import DynamicCache

    lm = tiny_lm("vq")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(2, 5)
    output = model(ids, cache=DynamicCache())
    assert torch.allclose(output.logits, lm(ids)[0], rtol=0, atol=1e-12)
    assert isinstance(output.cache, H.LinattnCache) and output.cache.get_seq_length() == 5
    filled = DynamicCache()
    filled.update(torch.zeros(2, 2, 3, 8, dtype=torch.float64), torch.zeros(2, 2, 3, 8, dtype=torch.float64), 0)
    with pytest.raises(TypeError, match="cache must be a LinattnCache .*got DynamicCache"):
        model(ids, cache=filled)
    with pytest.raises(TypeError, match="cache must be a LinattnCache .*got tuple"):
        model(ids, past_key_values=((torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8)),))


def test_rows_padded_by_the_same_amount_compute_what_they_compute_alone():
    """Every row left-padded by the same amount (one group that is not the whole input): the
    padding enters no state, so the real columns and a continuation equal the unpadded run."""
    lm = tiny_lm("vq,delta")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(2, 7, seed=18)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]] * 2)
    padded = model(ids, attention_mask=mask)
    assert torch.allclose(padded.logits[:, 2:], lm(ids[:, 2:])[0], rtol=0, atol=1e-12)
    assert torch.equal(padded.logits[:, :2], torch.zeros_like(padded.logits[:, :2]))
    step = random_ids(2, 1, seed=19)
    continued = model(step, cache=padded.cache, attention_mask=torch.cat([mask, torch.ones(2, 1).long()], 1))
    expected = lm(torch.cat([ids[:, 2:], step], 1))[0][:, -1:]
    assert torch.allclose(continued.logits, expected, rtol=0, atol=1e-12)


def test_hidden_states_of_a_left_padded_batch_are_each_rows_own():
    """With rows of different real lengths (the grouped path) every hidden state (embedding,
    each layer, the normed output) of a row equals that row's alone, and is zero on padding."""
    lm = tiny_lm("vq,delta")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(2, 7, seed=20)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    hidden = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(hidden) == lm.config.n_layers + 1
    for row, pad in [(0, 3), (1, 0)]:
        alone = []
        normed, _, _, _ = lm._trunk(lm.embed(ids[row:row + 1, pad:]), None, alone)
        alone[-1] = normed  # HF's convention: the last entry is the normed output
        assert len(alone) == len(hidden)
        for i, (got, want) in enumerate(zip(hidden, alone)):
            assert torch.allclose(got[row, pad:], want[0], rtol=0, atol=1e-12), (row, i)
            assert torch.equal(got[row, :pad], torch.zeros_like(got[row, :pad])), (row, i)


def test_commit_loss_of_a_left_padded_batch_is_the_token_weighted_mean_of_its_rows():
    """The VQ commitment term of a batch whose rows run as groups is the mean over real tokens:
    each row's own commitment loss weighted by its real length (as one unpadded batch counts)."""
    lm = tiny_lm("vq,delta", commitment_weight=0.5)
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(3, 8, seed=21)
    pad = 5
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    labels = ids.clone()
    labels[0, :pad + 1] = -100  # no target is predicted from a padded position
    with torch.no_grad():
        loss = model(ids, attention_mask=mask, labels=labels).loss
    nll, counted, commit, tokens = 0.0, 0, 0.0, 0
    for row, start in [(0, pad), (1, 0), (2, 0)]:
        with torch.no_grad():
            logits, _, aux = lm(ids[row:row + 1, start:])
        targets = ids[row, start + 1:]
        nll += float(F.cross_entropy(logits[0, :-1], targets, reduction="sum"))
        counted += targets.numel()
        commit += float(aux["commit_loss"]) * (8 - start)
        tokens += 8 - start
    assert commit > 0
    assert float(loss) == pytest.approx(nll / counted + commit / tokens, rel=1e-6)


@pytest.mark.parametrize("embeds", [
    lambda: torch.zeros(2, 5, 16).tolist(),  # not a tensor
    lambda: torch.zeros(5, 16, dtype=torch.float64),  # 2-D
    lambda: torch.zeros(2, 5, 8, dtype=torch.float64),  # width is not d_model
    lambda: torch.zeros(2, 0, 16, dtype=torch.float64),  # no positions
], ids=["list", "2-D", "width", "empty"])
def test_inputs_embeds_that_are_not_batch_length_d_model_are_refused_by_name(embeds):
    """``inputs_embeds`` must be a ``[batch, length >= 1, d_model]`` tensor; anything else is a
    ValueError naming the argument, before any layer runs."""
    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq")).eval()
    with pytest.raises(ValueError, match=r"inputs_embeds must have shape \[batch, length >= 1, 16\]"):
        model(inputs_embeds=embeds())


@pytest.mark.parametrize("mask, match", [
    ([[1] * 5] * 2, r"attention_mask must have shape \[batch, past"),  # a list, not a tensor
    (torch.ones(2, 5, 1), r"attention_mask must have shape \[batch, past"),  # 3-D
    (torch.ones(3, 5), r"attention_mask must have shape \[batch, past"),  # three rows for a batch of two
    (torch.tensor([[0, 1, 0, 1, 1]] * 2), "pad on the left"),  # padding after a token, the row starting padded
], ids=["list", "3-D", "batch", "gap"])
def test_attention_masks_of_the_wrong_type_shape_or_order_are_refused_by_name(mask, match):
    """A mask that is not a ``[batch, past + length]`` 0/1 tensor padding on the left only is a
    ValueError naming ``attention_mask``."""
    model = H.LinattnForCausalLM.from_lm(tiny_lm("vq")).eval()
    with pytest.raises(ValueError, match=match):
        model(random_ids(2, 5), attention_mask=mask)


def test_padding_in_a_continued_row_is_refused_but_fresh_rows_may_still_be_padded():
    """A row that holds tokens cannot be padded later (its state cannot skip them); a row that has
    seen only padding may go on padding, then starts fresh beside the continued rows."""
    lm = tiny_lm("vq,delta")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(2, 6, seed=22)
    cache = model(ids[:, :4]).cache
    with pytest.raises(ValueError, match="pads a row that already holds tokens"):
        model(ids[:, 4:], cache=cache, attention_mask=torch.tensor([[0, 1]] * 2))  # a [batch, length] mask
    mask = torch.tensor([[0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1]])
    cache = model(ids[:, :4], attention_mask=mask[:, :4]).cache
    logits = model(ids[:, 4:], cache=cache, attention_mask=mask).logits
    assert torch.allclose(logits[0, 1:], lm(ids[:1, 5:])[0][0], rtol=0, atol=1e-12)
    assert torch.allclose(logits[1], lm(ids[1:])[0][0, 4:], rtol=0, atol=1e-12)


def test_a_left_padded_batch_with_rows_of_equal_length_continues_from_its_cache():
    """Three rows, two of one length and one shorter (two groups, the first of two rows): every
    continued row, and the loss of the continuation, are each row's own."""
    lm = tiny_lm("vq,delta", commitment_weight=0.5)
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(3, 6, seed=23)
    mask = torch.tensor([[1] * 6, [1] * 6, [0, 0, 0, 1, 1, 1]])
    cache = model(ids, attention_mask=mask).cache
    step = random_ids(3, 2, seed=24)
    logits = model(step, cache=cache, attention_mask=torch.cat([mask, torch.ones(3, 2).long()], 1)).logits
    for row, start in [(0, 0), (1, 0), (2, 3)]:
        expected = lm(torch.cat([ids[row, start:], step[row]])[None])[0][0, -2:]
        assert torch.allclose(logits[row], expected, rtol=0, atol=1e-12), row


def test_loss_of_each_step_continued_from_the_cache_is_the_trainers_number():
    """Step by step from a cache (one group holding every row), each chunk's loss is exactly what
    linattn's LM gives for that chunk with the carried state: cross-entropy plus its commitment loss."""
    lm = tiny_lm("vq,delta", commitment_weight=0.5)
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(3, 16, seed=25)
    cache, state = model(ids[:, :4]).cache, lm(ids[:, :4])[1]
    for start in range(4, 16, 2):
        chunk = ids[:, start:start + 2]
        with torch.no_grad():
            output = model(chunk, cache=cache, labels=chunk)
            logits, state, aux = lm(chunk, state)
        expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), chunk[:, 1:].flatten()) + aux["commit_loss"]
        assert torch.allclose(output.loss, expected.to(output.loss.dtype), rtol=1e-12, atol=0), start
        cache = output.cache


def test_logits_to_keep_returns_the_logits_of_the_last_positions():
    """``logits_to_keep=k`` (what generate passes) returns the logits of the last k positions only;
    0 keeps all of them."""
    lm = tiny_lm("vq")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(2, 7, seed=26)
    expected = lm(ids)[0]
    for keep in (1, 3):
        got = model(ids, logits_to_keep=keep).logits
        assert got.shape == (2, keep, 256)
        assert torch.allclose(got, expected[:, -keep:], rtol=0, atol=1e-12), keep
    assert torch.allclose(model(ids, logits_to_keep=0).logits, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mean_loss_skips_labels_of_minus_100_and_counts_every_other_label(dtype):
    """Without ``num_items_in_batch`` the loss is the mean next-token cross-entropy over the labels
    that are not -100 (a label of 100 is an ordinary token), computed on every position but the
    last in float32 and float64 models alike."""
    lm = tiny_lm("vq,local:4", commitment_weight=0.5).to(dtype)
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(2, 9, seed=27)
    labels = ids.clone()
    labels[0, 2:5] = -100
    labels[1, 3] = 100
    with torch.no_grad():
        loss = model(ids, labels=labels).loss
        logits, _, aux = lm(ids)
    logp = torch.log_softmax(logits.double(), -1)
    terms = [-logp[b, t, labels[b, t + 1]] for b in range(2) for t in range(8) if labels[b, t + 1] != -100]
    assert len(terms) == 13
    expected = torch.stack(terms).mean() + aux["commit_loss"].double()
    assert loss.dtype == dtype
    assert float(loss) == pytest.approx(float(expected), rel=1e-6 if dtype == torch.float32 else 1e-12)


def test_lm_state_of_refuses_padded_caches_and_returns_rows_in_batch_order():
    """``lm_state_of`` needs one group holding every row (a row of padding only is not in it), and
    returns the state in batch order when the group lists its rows in another order (a swap, whose
    sorting permutation is itself, and a cycle)."""
    lm = tiny_lm("vq,delta")
    model = H.LinattnForCausalLM.from_lm(lm).eval()
    ids = random_ids(3, 5, seed=28)
    for mask in ([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], [[0, 0, 1, 1, 1], [1] * 5, [1] * 5]):
        cache = model(ids, attention_mask=torch.tensor(mask)).cache
        with pytest.raises(ValueError, match="the cache holds rows of different lengths"):
            H.lm_state_of(cache)
    _, state, _ = lm(ids)  # state row i holds the history of ids[i]
    step = random_ids(3, 1, seed=29)
    for rows in ([1, 0, 2], [1, 2, 0]):  # state row i is batch row rows[i]
        cache = H.LinattnCache(3, [H.RowGroup(rows=torch.tensor(rows), state=state)], seen=5)
        logits = lm(step, H.lm_state_of(cache))[0]
        for row in range(3):
            source = rows.index(row)
            expected = lm(torch.cat([ids[source], step[row]])[None])[0][0, -1]
            assert torch.allclose(logits[row, -1], expected, rtol=0, atol=1e-12), (rows, row)


def test_groups_run_longest_first_after_the_continued_rows():
    """Rows run as groups in a fixed order: groups continued from the cache, then new rows longest
    first. In training the first group's keys initialise a pending k-means codebook, so a
    left-padded batch initialises it from its longest rows, as ``LM`` does on those rows alone."""
    lm = tiny_lm("vq", kmeans_init=True)
    model = H.LinattnForCausalLM.from_lm(lm).train()
    ids = random_ids(2, 8, seed=30)
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [1] * 8])
    torch.manual_seed(31)
    cache = model(ids, attention_mask=mask).cache
    assert [g.rows.tolist() for g in cache.groups] == [[1], [0]]
    alone = copy.deepcopy(lm).train()
    torch.manual_seed(31)
    alone(ids[1:])
    for got, want in zip(model.lm.quantizers(), alone.quantizers()):
        assert torch.equal(got.codebook, want.codebook)
    model.eval()
    first = torch.tensor([[1, 1, 1], [0, 0, 0], [0, 0, 0]])
    cache = model(random_ids(3, 3, seed=32), attention_mask=first).cache
    later = torch.cat([first, torch.tensor([[1, 1, 1], [0, 0, 1], [1, 1, 1]])], 1)
    cache = model(random_ids(3, 3, seed=33), cache=cache, attention_mask=later).cache
    assert [g.rows.tolist() for g in cache.groups] == [[0], [2], [1]]
