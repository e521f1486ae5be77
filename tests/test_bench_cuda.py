"""Every ``linattn bench`` on a CUDA device (``make test-gpu``), at tiny sizes.

What the CPU tests cannot see: the models, inputs and states really live on the GPU (the
CUDA allocator's peak is above zero, allocations happen), each run records the device, and
bfloat16 autocast runs there. Skipped where torch sees no CUDA device.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from linattn.bench import decode
from linattn.cli import main
from _helpers import english_like

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make test-gpu)")


def _load(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def _check_device(result: dict) -> None:
    assert result["metadata"]["device"] == "cuda"
    assert result["metadata"]["device_name"] == torch.cuda.get_device_name(0)


def _allocations() -> int:
    return torch.cuda.memory_stats()["allocation.all.allocated"]


def test_bench_attention_on_cuda(tmp_path):
    args = ["bench", "attention", "--device", "cuda", "--lengths", "64", "128", "--cases", "sdpa", "linear-elu",
            "vq-b128", "vq-b128-triton", "--repeats", "1", "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    result = _load(tmp_path)
    _check_device(result)
    for row in result["rows"]:
        assert row["skip_reason"] is None and row["forward_s"] > 0 and row["forward_backward_s"] > 0
        assert row["forward_backward_peak_bytes"] > 0  # the CUDA allocator's peak: the call ran there


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_lm_on_cuda(dtype, tmp_path):
    args = ["bench", "lm", "--quick", "--device", "cuda", "--dtype", dtype, "--models", "softmax", "vq",
            "--contexts", "16", "32", "--tokens-per-step", "64", "--repeats", "2", "--decode-tokens", "3",
            "--profile", "3", "--out", str(tmp_path)]
    assert main(args) == 0
    result = _load(tmp_path)
    _check_device(result)
    assert result["metadata"]["shapes"]["device"] == "cuda" and result["metadata"]["shapes"]["dtype"] == dtype
    rows = result["rows"]
    assert [(r["case"], r["context"]) for r in rows] == [(m, c) for m in ("softmax", "vq") for c in (16, 32)]
    for row in rows:
        assert row["skip_reason"] is None
        assert row["train_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0 and row["decode_ms_per_token"] > 0
        assert row["train_peak_bytes"] > 0 and row["prefill_peak_bytes"] > 0  # allocated on the GPU
    profiled = [r for r in rows if r["profile"] is not None]
    assert [r["context"] for r in profiled] == [32, 32]
    assert all(part["total_ms"] > 0 for r in profiled for part in r["profile"].values())
    assert "Whole models on cuda (" in (tmp_path / "results.md").read_text()


def test_bench_decode_on_cuda(tmp_path):
    args = ["bench", "decode", "--device", "cuda", "--contexts", "32", "64", "--tokens", "2", "--heads", "2",
            "--dim", "8", "--models", "vq", "softmax", "--prompts", "8", "40", "--batches", "1", "2",
            "--new-tokens", "3", "--out", str(tmp_path)]
    assert main(args) == 0
    result = _load(tmp_path)
    _check_device(result)
    ops = [r for r in result["rows"] if r["kind"] == "op"]
    models = [r for r in result["rows"] if r["kind"] == "model"]
    assert {r["case"] for r in ops} == set(decode.DECODE_CASES) and all(r["per_token_s"] > 0 for r in ops)
    assert len(models) == 2 * 2 * 2 and all(r["tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0 for r in models)


def test_decode_tables_allocate_on_the_gpu():
    """The op table and the model table (in this process here) put their tensors on the GPU."""
    for name in decode.DECODE_CASES:
        before = _allocations()
        (row,) = decode.measure(name, [32], heads=2, dim=8, tokens=2, device="cuda")
        assert row["per_token_s"] > 0 and _allocations() > before
    before = _allocations()
    (row,) = decode.measure_generation("vq", [8], [1], new_tokens=2, device="cuda")
    assert row["tokens_per_s"] > 0 and _allocations() > before


def test_bench_train_on_cuda(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(english_like(4000))
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\nattention = "vq"\nd_model = 16\nn_layers = 1\ngau_d_k = 8\n'
                      f'codebook_size = 8\nblock_size = 8\n\n[train]\ndata = "{corpus}"\nbatch_size = 2\n'
                      f'context = 16\n')
    args = ["bench", "train", "--config", str(config), "--device", "cuda", "--modes", "eager", "--steps", "3",
            "--warmup", "1", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    result = _load(tmp_path / "out")
    _check_device(result)
    assert result["metadata"]["shapes"]["train"]["device"] == "cuda"
    (row,) = result["rows"]
    assert row["step_s"] > 0 and math.isfinite(row["last_loss"])
