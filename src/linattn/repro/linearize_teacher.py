"""The teacher of ``linattn repro linearize`` and what it measures on every model.

The teacher is a genuine ``transformers.LlamaForCausalLM`` checkpoint folder (``save_pretrained``
and the BPE's ``tokenizer.json``), trained here from the committed configuration
(``configs/linearize-teacher.toml``: ``[llama]`` its ``config.json``, ``[tokenizer]`` the BPE,
``[train]`` the run) on the token shards of the corpus, by transformers' own model: AdamW over the
trainer's parameter groups (``train/optim.py``), linear warm-up and cosine to a tenth
(``train/schedule.py``), clipping at 1, one window of ``context`` tokens from each of
``batch_size`` streams per step (``TokenStreams``). It is cached per seed in the output folder
(``teacher.json`` records its settings: a teacher trained with others is trained again).

Every model is scored alike (``validation_bpb``): bits per byte on the first ``eval_tokens``
tokens of the validation split, one stream in windows of the training context, the state reset
every window (a softmax layer keeps nothing across windows either). Decoding speed
(``decode_ms_per_token``): after a prompt of C tokens, read in chunks to build the cache or state,
the milliseconds per generated token, greedy, of transformers' ``generate`` with its KV cache for
the teacher and of ``LM.generate`` with its constant-size state for the students.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..data import Shards, TokenStreams, bits_per_byte, evaluated_bytes, prepare_shards
from ..models import LM
from ..train import evaluate_bpb
from ..train.config import read_toml
from ..train.optim import parameter_groups
from ..train.schedule import learning_rate

TEACHER_TABLES = ("llama", "tokenizer", "train")
_TRAIN_KEYS = ("steps", "batch_size", "context", "lr", "warmup_steps", "weight_decay")
_RECORD = "teacher.json"
_PREFILL_CHUNK = 1024
_WARM_UP_PROMPT, _WARM_UP_TOKENS = 8, 4  # the untimed generation before the timed one


def teacher_settings(path: str | Path, quick: bool) -> dict[str, dict[str, Any]]:
    """The teacher's ``{"llama": ..., "tokenizer": ..., "train": ...}`` from the TOML file ``path``
    (its ``[quick.*]`` tables over them with ``quick``); a missing table or train key is a
    ValueError naming it."""
    document = read_toml(path, "--teacher-config", " (the committed one is configs/linearize-teacher.toml)")
    missing = [name for name in TEACHER_TABLES if not isinstance(document.get(name), dict)]
    if missing:
        raise ValueError(f"--teacher-config {path}: the table(s) {', '.join(missing)} are missing")
    quick_tables = document.get("quick", {}) if quick else {}
    settings = {name: {**document[name], **quick_tables.get(name, {})} for name in TEACHER_TABLES}
    absent = [key for key in _TRAIN_KEYS if key not in settings["train"]]
    if absent or "bpe" not in settings["tokenizer"]:
        raise ValueError(f"--teacher-config {path}: [train] needs {', '.join(_TRAIN_KEYS)} and [tokenizer] needs bpe "
                         f"(missing: {', '.join(absent or ['bpe'])})")
    return settings


def prepared_data(out_dir: Path, data: str, bpe: int, cache_dir: str | None) -> Shards:
    """The token shards of ``data`` with a BPE of ``bpe`` tokens, prepared once into ``out_dir/data``."""
    folder = Path(out_dir) / f"data-bpe{bpe}"
    if not (folder / "meta.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        prepare_shards(data, f"bpe:{bpe}", folder, cache_dir=cache_dir, echo=lambda *a: None)
    return Shards(folder)


def _llama_config(settings: dict[str, Any], vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(**settings, vocab_size=vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def teacher_folder(out_dir: Path, shards: Shards, settings: dict[str, dict[str, Any]], seed: int) -> Path:
    """The trained teacher of ``seed`` (a ``LlamaForCausalLM`` folder with the shards' tokenizer), trained
    here unless ``out_dir/teachers/seed-<seed>`` holds one of the same settings and data."""
    folder = Path(out_dir) / "teachers" / f"seed-{seed}"
    key = {"settings": settings, "seed": seed, "tokenizer": shards.tokenizer_record()}
    record = folder / _RECORD
    if record.is_file() and json.loads(record.read_text(encoding="utf-8")).get("key") == key:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    losses, seconds = _train_teacher(folder, shards, settings, seed)
    record.write_text(json.dumps({"key": key, "losses": losses, "seconds": seconds}, indent=1), encoding="utf-8")
    return folder


def teacher_record(folder: Path) -> dict[str, Any]:
    """What ``teacher_folder`` recorded: ``key`` (settings, seed, tokenizer), ``losses`` [(step, nats)], ``seconds``."""
    return json.loads((Path(folder) / _RECORD).read_text(encoding="utf-8"))


def _train_teacher(folder: Path, shards: Shards, settings: dict[str, dict[str, Any]], seed: int
                   ) -> tuple[list[tuple[int, float]], float]:
    """Train a ``LlamaForCausalLM`` of ``settings`` from ``seed`` and save it (with the tokenizer) into ``folder``."""
    from transformers import LlamaForCausalLM

    train = settings["train"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(settings["llama"], shards.vocab_size)).train()
    optimizer = torch.optim.AdamW(parameter_groups(model, train["weight_decay"]), lr=train["lr"], betas=(0.9, 0.95))
    streams = TokenStreams(shards.tokens("train"), batch_size=train["batch_size"], context=train["context"])
    losses, started = [], time.perf_counter()
    for step in range(train["steps"]):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, peak=train["lr"], total_steps=train["steps"],
                                        warmup_steps=train["warmup_steps"], min_ratio=0.1)
        inputs, targets = streams.window(step % len(streams))
        logits = model(input_ids=inputs.long()).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.long().flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % max(1, train["steps"] // 50) == 0 or step + 1 == train["steps"]:
            losses.append((step + 1, float(loss.detach())))
    seconds = time.perf_counter() - started
    model.eval().save_pretrained(folder)
    shutil.copyfile(shards.tokenizer_file(), folder / "tokenizer.json")
    return losses, seconds


def validation_bpb(model: LM, shards: Shards, context: int, max_tokens: int) -> float:
    """Bits per byte of ``model`` on the first ``max_tokens`` validation tokens (module docstring)."""
    tokens = shards.tokens("validation")[:max_tokens]
    result = evaluate_bpb(model, tokens, context=context, batch_size=1, carry_state=False)
    return bits_per_byte(result, evaluated_bytes(shards, tokens, context=context, n_streams=1))


@torch.no_grad()
def decode_ms_per_token(model, prompt: torch.Tensor, new_tokens: int) -> float:
    """Milliseconds per greedy token after the prompt ``[1, C]``: ``model`` a ``LM`` (its ``generate``,
    state carried) or a transformers causal LM (``generate`` with a ``DynamicCache``); the prompt is
    read in chunks first, the generation of ``new_tokens`` tokens is timed. A short generation
    after the prompt's first tokens comes first, untimed, so that what a process does once (the
    native token loop's self-check at its first use) is not counted in a token's time."""
    warm_up = prompt[:, :_WARM_UP_PROMPT]
    if isinstance(model, LM):
        model.eval()
        for _ in model.generate(warm_up, _WARM_UP_TOKENS, temperature=0):
            pass
        state = None
        for piece in prompt[:, :-1].split(_PREFILL_CHUNK, dim=1):
            _, state, _ = model(piece, state, check_inputs=False)
        started = time.perf_counter()
        for _ in model.generate(prompt[:, -1:], new_tokens, temperature=0, state=state):
            pass
        return (time.perf_counter() - started) * 1000 / new_tokens
    from transformers import DynamicCache

    model.eval()
    model.generate(input_ids=warm_up, attention_mask=torch.ones_like(warm_up), max_new_tokens=_WARM_UP_TOKENS,
                   min_new_tokens=_WARM_UP_TOKENS, do_sample=False, pad_token_id=0)
    cache = DynamicCache()
    for piece in prompt[:, :-1].split(_PREFILL_CHUNK, dim=1):
        cache = model(input_ids=piece, cache=cache, use_cache=True).cache
    started = time.perf_counter()
    model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=cache,
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return (time.perf_counter() - started) * 1000 / new_tokens


def decode_prompt(shards: Shards, length: int) -> torch.Tensor:
    """A prompt of ``length`` tokens ``[1, length]``: the test split repeated as needed."""
    tokens = shards.tokens("test").long()
    repeats = -(-length // tokens.numel())
    return tokens.repeat(repeats)[:length].unsqueeze(0)


def load_teacher(folder: Path):
    """The teacher as transformers loads it (float32, eval)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
