"""LoRA fine-tuning of a converted run (``linattn train --resume --lora-rank R``): only the adapters
train, the checkpoints hold them beside the untouched base weights, a resume continues them, and
every reader (``load_model``: eval, generate, export) gets the merged model, ``W + (alpha / r) B A``
with ``alpha = 2 r`` computed here; the export loads in transformers with the merged logits."""

from __future__ import annotations

import pytest
import torch

from linattn import LM
from linattn.models import LMConfig
from linattn.train import load_checkpoint, load_model

from test_convert_hf import prepare
from test_from_hf import hf_folder, relative_gap, tiny_tokenizer
from test_train_cli import run_captured

torch.set_num_threads(1)

RANK = 4
SETS = ["--set", "train.context=16", "--set", "train.batch_size=2", "--set", "train.eval_tokens=256",
        "--set", "train.eval_batch_size=2", "--set", "train.lr=1e-2", "--set", "train.warmup_steps=0",
        "--set", "model.block_size=8", "--set", "model.codebook_size=8"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny Llama converted to ``vq-attn:rerope,gated-delta``, its step-0 tensors, then 3 LoRA steps."""
    root = tmp_path_factory.mktemp("lora")
    hf = hf_folder(root / "hf", tiny_tokenizer(), "llama")
    shards = prepare(root, hf / "tokenizer.json")
    run = root / "run"
    code, _, err = run_captured(["convert", "--ckpt", str(hf), "--to", "vq-attn:rerope,gated-delta", "--out", str(run),
                                 "--data", str(shards), "--calibration-tokens", "256", "--transfer-steps", "2", *SETS])
    assert code == 0, err
    base = dict(load_checkpoint(run).model)
    code, out, err = run_captured(["train", "--resume", "--out", str(run), "--steps", "3", "--lora-rank", str(RANK),
                                   "--no-progress"])
    assert code == 0, err
    return run, base, out


def merged_by_hand(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain state dict of adapted tensors: ``W + 2 B A`` for every adapted map."""
    merged = {}
    for name, tensor in tensors.items():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            module = name.split(".base_layer.")[0]
            if name.endswith(".weight"):
                a, b = tensors[f"{module}.lora_A.default.weight"], tensors[f"{module}.lora_B.default.weight"]
                tensor = tensor + 2.0 * b @ a
            name = name.replace(".base_layer.", ".")
        merged[name] = tensor
    return merged


def test_only_the_adapters_train_and_the_base_weights_stay(lora_run):
    run, base, printed = lora_run
    assert f"LoRA adapters of rank {RANK} (alpha {2 * RANK}) on 17 linear maps" in printed
    checkpoint = load_checkpoint(run)
    assert checkpoint.step == 3 and checkpoint.meta["train_config"]["lora_rank"] == RANK
    tensors = checkpoint.model
    adapters = [name for name in tensors if ".lora_" in name]
    assert len(adapters) == 2 * 17 and all(tensors[n].shape[0] == RANK for n in adapters if ".lora_A." in n)
    assert any(tensors[n].abs().max() > 0 for n in adapters if ".lora_B." in n)  # PEFT starts B at zero
    for name, tensor in tensors.items():
        plain = name.replace(".base_layer.", ".")
        if ".quantizer." in name:  # the codebooks are no parameters: their EMA goes on
            assert name.endswith(".initialized") or not torch.equal(tensor, base[plain]), name
        elif ".lora_" not in name:
            assert torch.equal(tensor, base[plain]), name  # frozen: the base weights, norms, decays
    assert {name.replace(".base_layer.", ".") for name in tensors if ".lora_" not in name} == set(base)


def test_readers_get_the_merged_model_and_the_export_its_logits(lora_run, tmp_path):
    import linattn.hf  # noqa: F401 - registers the linattn classes
    from transformers import AutoModelForCausalLM

    run, _, _ = lora_run
    model, checkpoint = load_model(run)
    expected = LM(LMConfig.from_saved(checkpoint.meta["model_config"])).eval()
    expected.load_state_dict(merged_by_hand(checkpoint.model), strict=True)
    for name, tensor in expected.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = expected(ids)[0]
        assert relative_gap(model(ids)[0], theirs) < 1e-5
    code, _, err = run_captured(["export", "--ckpt", str(run), "--out", str(tmp_path / "exported")])
    assert code == 0, err
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    with torch.no_grad():
        assert relative_gap(exported(ids).logits, theirs) < 1e-5
    code, _, err = run_captured(["eval", "--ckpt", str(run), "--max-tokens", "100", "--no-progress"])
    assert code == 0, err


def test_a_resume_continues_the_adapters_and_keeps_their_rank(lora_run):
    run, _, _ = lora_run
    before = load_checkpoint(run)
    code, out, err = run_captured(["train", "--resume", "--out", str(run), "--steps", "4", "--no-progress"])
    assert code == 0, err
    after = load_checkpoint(run)
    assert after.step == 4 and after.meta["train_config"]["lora_rank"] == RANK
    assert before.optimizer_state()["state"] and after.optimizer_state()["state"]
    changed = [name for name in after.model if not torch.equal(after.model[name], before.model[name])]
    assert changed and all(".lora_" in name or ".quantizer." in name for name in changed)
    code, _, err = run_captured(["train", "--resume", "--out", str(run), "--steps", "5", "--lora-rank", "8"])
    assert code == 2 and "--lora-rank 8: the run trains LoRA adapters of rank 4 already" in err
    code, _, err = run_captured(["train", "--resume", "--out", str(run), "--steps", "5", "--lora-rank", "0"])
    assert code == 2 and "--lora-rank" in err
