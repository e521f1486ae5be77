"""``linattn convert --ckpt HF_DIR --to softmax --out RUN``: a tiny random Llama becomes a run
folder that ``linattn eval``, ``generate``, ``train --resume`` and ``export`` use as they use
any run, with the checkpoint's own tokenizer; what does not fit is refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from linattn.data import Shards
from linattn.train import load_checkpoint, load_model
from test_from_hf import TOLERANCE, hf_folder, ids, reference, relative_gap, tiny_tokenizer
from test_shards import write_plays
from test_train_cli import run_captured

torch.set_num_threads(1)

CONTEXT = 16
TRAIN_SETS = ["--set", f"train.context={CONTEXT}", "--set", "train.batch_size=2", "--set", "train.eval_tokens=256",
              "--set", "train.eval_batch_size=2", "--set", "train.lr=1e-3", "--set", "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def prepare(root: Path, tokenizer_file: Path, name: str = "shards") -> Path:
    """``linattn data prepare`` of a 3-play Shakespeare stand-in with ``tokenizer_file``."""
    cache = root / "cache"
    if not cache.exists():
        write_plays(cache)
    code, _, err = run_captured(["data", "prepare", "--data", "shakespeare", "--cache-dir", str(cache), "--tokenizer",
                                 str(tokenizer_file), "--out", str(root / name), "--no-progress"])
    assert code == 0, err
    return root / name


def convert(hf: Path, out: Path, data: Path, *extra: str) -> tuple[int, str, str]:
    return run_captured(["convert", "--ckpt", str(hf), "--to", "softmax", "--out", str(out), "--data", str(data),
                         *TRAIN_SETS, *extra])


@pytest.fixture(scope="module")
def imported(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("import")
    hf = hf_folder(root / "hf", tokenizer, "llama", attention_bias=True)
    shards = prepare(root, hf / "tokenizer.json")
    code, out, err = convert(hf, root / "run", shards)
    assert code == 0, err
    return hf, shards, root / "run", out


def test_the_run_holds_the_import_and_the_checkpoints_tokenizer(imported):
    hf, shards, run, printed = imported
    assert "imported" in printed and "LlamaForCausalLM" in printed
    checkpoint = load_checkpoint(run)
    assert checkpoint.step == 0 and checkpoint.meta["imported_from"]["folder"] == str(hf.resolve())
    assert (run / "tokenizer.json").read_bytes() == (shards / "tokenizer.json").read_bytes()
    recorded = json.loads((shards / "meta.json").read_text())["tokenizer"]
    assert checkpoint.meta["tokenizer"]["sha256"] == recorded["sha256"]
    assert checkpoint.meta["train_config"]["data"] == str(shards.resolve())
    assert checkpoint.meta["train_config"]["context"] == CONTEXT
    model, _ = load_model(run)
    with torch.no_grad():
        assert relative_gap(model(ids())[0], reference(hf)(ids()).logits) <= TOLERANCE


def test_eval_scores_the_run_data_as_transformers_does(imported):
    hf, shards, run, _ = imported
    windows = 3
    code, out, err = run_captured(["eval", "--ckpt", str(run), "--split", "test", "--context", str(CONTEXT),
                                   "--max-tokens", str(windows * CONTEXT + 1), "--no-carry", "--json",
                                   "--no-progress"])
    assert code == 0, err
    record = json.loads(out)
    tokens = Shards(shards).tokens("test")[: windows * CONTEXT + 1].long()
    nats = 0.0
    with torch.no_grad():
        for w in range(windows):
            window = tokens[w * CONTEXT: (w + 1) * CONTEXT + 1]
            logits = reference(hf)(window[None, :-1]).logits[0]
            nats += float(F.cross_entropy(logits, window[1:], reduction="sum"))
    assert record["tokens"] == windows * CONTEXT
    assert record["bits_per_token"] == pytest.approx(nats / (windows * CONTEXT) / math.log(2), rel=1e-5)


def test_generate_speaks_with_the_checkpoints_tokenizer(imported, tokenizer):
    hf, _, run, _ = imported
    prompt = "the king"
    code, out, err = run_captured(["generate", "--ckpt", str(run), "--prompt", prompt, "--max-new-tokens", "20",
                                   "--temperature", "0"])
    assert code == 0, err
    prompt_ids = tokenizer.encode(prompt)[None]
    with torch.no_grad():
        greedy = reference(hf).generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                                        max_new_tokens=20, min_new_tokens=20, pad_token_id=0)[0, prompt_ids.shape[1]:]
    assert out == prompt + tokenizer.decode(greedy) + "\n"


def test_train_resume_fine_tunes_from_step_zero(imported, tmp_path):
    _, _, run, _ = imported
    code, out, err = run_captured(["train", "--resume", "--out", str(run), "--steps", "2", "--no-progress"])
    assert code == 0, err
    assert "resuming" in out and "at step 0" in out
    before, after = load_model(run / "checkpoints" / "step-00000000")[0], load_model(run)[0]
    assert load_checkpoint(run).step == 2
    changed = [name for name, value in after.state_dict().items() if not torch.equal(value, before.state_dict()[name])]
    assert "layers.0.mixer.o_proj.bias" in changed and "embed.weight" in changed


def test_export_loads_in_transformers_with_the_logits_of_the_checkpoint(imported, tokenizer, tmp_path):
    import linattn.hf  # noqa: F401 - registers the linattn classes
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf, _, run, _ = imported
    code, _, err = run_captured(["export", "--ckpt", str(run / "checkpoints" / "step-00000000"),
                                 "--out", str(tmp_path / "exported")])
    assert code == 0, err
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    with torch.no_grad():
        assert relative_gap(exported(ids()).logits, reference(hf)(ids()).logits) <= TOLERANCE
    exported_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert exported_tokenizer("the king", add_special_tokens=False).input_ids == tokenizer.encode("the king").tolist()


def test_a_vocabulary_with_rows_past_the_tokenizers_trains_and_exports(tmp_path, tokenizer):
    """Qwen2's embedding has more rows than its tokenizer has tokens: resume and export accept that."""
    hf = hf_folder(tmp_path / "hf", tokenizer, "qwen2", vocab_size=320)
    shards = prepare(tmp_path, hf / "tokenizer.json")
    assert convert(hf, tmp_path / "run", shards)[0] == 0
    code, _, err = run_captured(["train", "--resume", "--out", str(tmp_path / "run"), "--steps", "1", "--no-progress"])
    assert code == 0, err
    code, _, err = run_captured(["export", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "exported")])
    assert code == 0, err


def test_what_does_not_fit_is_refused_by_name(tmp_path, tokenizer):
    hf = hf_folder(tmp_path / "hf", tokenizer)
    shards = prepare(tmp_path, hf / "tokenizer.json")
    code, _, err = run_captured(["convert", "--ckpt", str(hf), "--to", "softmax", "--out", str(tmp_path / "a")])
    assert code == 2 and "--to softmax needs --data SHARDS" in err and "--tokenizer" in err
    code, _, err = run_captured(["data", "prepare", "--data", "shakespeare", "--cache-dir", str(tmp_path / "cache"),
                                 "--tokenizer", "bpe:260", "--out", str(tmp_path / "bpe"), "--no-progress"])
    assert code == 0, err
    code, _, err = convert(hf, tmp_path / "b", tmp_path / "bpe")
    assert code == 2 and "the data's tokenizer" in err and "is not the run's" in err
    code, _, err = convert(hf, tmp_path / "c", shards, "--set", "model.d_model=8")
    assert code == 2 and "only train.KEY=VALUE" in err
    code, _, err = convert(hf, tmp_path / "d", shards, "--codebook-size", "8")
    assert code == 2 and "--codebook-size: not an option of --to softmax" in err
    small = hf_folder(tmp_path / "small", tokenizer, vocab_size=280)
    code, _, err = convert(small, tmp_path / "e", shards)
    assert code == 2 and "has 300 tokens, more than the model's vocab_size=280" in err
    assert not any((tmp_path / name).exists() for name in "abcde")
