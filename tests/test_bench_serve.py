"""``linattn bench serve``'s bookkeeping in the project's environment (no vLLM needed): the
models it exports, the memory it charges a sequence, the ratios to the Llama and the page. The
measurements themselves run in the serving environment (docs/guide/serving.md's snippet)."""

from __future__ import annotations

from linattn.bench import serve as bench_serve

QUICK = bench_serve.QUICK


def _row(case: str, prompt_length: int, tokens_per_s: float) -> dict:
    return {"case": case, "prompt_length": prompt_length, "parameters": 1000, "requests_per_s": 1.0,
            "output_tokens_per_s": tokens_per_s, "ttft_s": 0.5, "memory_per_sequence_bytes": 2**20}


def test_models_without_softmax_layers_are_charged_no_kv_cache(tmp_path):
    vq = bench_serve.export_model("vq", QUICK, tmp_path / "vq")
    assert vq["paged_layers"] == 0 and vq["kv_bytes_per_token"] == 0
    hybrid = bench_serve.export_model("gated-delta,softmax", QUICK, tmp_path / "hybrid")
    config = QUICK.sizes.model_config("gated-delta,softmax")
    head_dim = config.head_dim or config.d_model // config.n_heads
    assert hybrid["paged_layers"] == 1 and hybrid["state_layers"] == 1
    assert hybrid["kv_bytes_per_token"] == 2 * (config.n_kv_heads or config.n_heads) * head_dim * 4


def test_each_model_is_compared_with_the_llama_at_its_own_prompt_length():
    rows = [_row("vq", 1024, 30.0), _row("vq", 4096, 20.0), _row("llama", 1024, 60.0), _row("llama", 4096, 10.0),
            _row("gated-delta", 16384, 5.0)]
    assert bench_serve._targets(rows) == {"speed_over_llama": {"vq": {"1024": 0.5, "4096": 2.0}}}


def test_the_page_holds_the_measurements_and_the_ratios():
    rows = [_row("vq", 1024, 30.0), _row("vq", 4096, 20.0), _row("llama", 1024, 60.0), _row("llama", 4096, 10.0)]
    metadata = {"command": "linattn bench serve", "device_name": "a CPU",
                "shapes": {"concurrency": 8, "new_tokens": 64, "prompt_lengths": [1024, 4096]}}
    text = bench_serve.page({"metadata": metadata, "rows": rows, "summary": bench_serve._targets(rows)})
    assert "| vq | 1,000 | 4096 | 1 | 20 | 0.5 s | 1.00 MiB |" in text
    assert "| model | prompt 1024 | prompt 4096 |" in text and "| vq | 0.50x | 2.00x |" in text
