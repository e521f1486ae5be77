"""``linattn bench serve``: linattn models served by vLLM against a Llama in the same engine.

Each model (``--models``: layer specs or comma-separated patterns; ``llama`` is transformers'
Llama) has the parameter count of the softmax model of ``bench lm``'s sizes (``--d-model``,
``--n-layers``, ...; the Llama has that model's widths, so the same count): random weights
(seed 0), exported and served by vLLM (linattn's plugin; the Llama by vLLM's own model) on
the CPU in float32, one engine per model and prompt length, each in a fresh process. An
engine gets ``--concurrency`` requests at once, each a prompt of P random tokens
(``--prompt-lengths``) and ``--new-tokens`` greedy tokens (EOS ignored), after one untimed
warm-up request. Reported per (model, P): requests/s and output tokens/s over the whole
batch's wall time, the median time to first token (vLLM's per-request first-token latency),
and the cache memory one sequence holds at its last token: every state layer's slot (vLLM's
page for it) plus, for paged (softmax) layers, the KV blocks of P + new tokens. The recurrent
models' memory per sequence is flat in P; the Llama's grows with it. Targets of issue 53:
output tokens/s at least the Llama's at 4k and at least 3x at 16k.

Runs in the serving environment (``.venv-serve``, ``make serve-env``), which has vLLM:
``.venv-serve/bin/linattn bench serve``. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .. import reporting
from .._checks import positive_int
from ..models import LM
from .harness import in_fresh_process
from .lm_config import LMBenchConfig

DEFAULT_MODELS = ("vq", "gated-delta", "gated-delta,softmax,gated-delta", "llama")
DEFAULT_PROMPT_LENGTHS = (1024, 4096, 16384)
LLAMA = "llama"

HELP = "linattn models served by vLLM against a Llama of equal parameter count (throughput, TTFT, memory)"
DESCRIPTION = __doc__.split("\n\n", 1)[1]


@dataclasses.dataclass(frozen=True)
class ServeBenchConfig:
    """The sizes and load of one ``bench serve`` run."""

    prompt_lengths: tuple[int, ...] = DEFAULT_PROMPT_LENGTHS
    concurrency: int = 8
    new_tokens: int = 64
    max_batched_tokens: int = 2048
    kv_cache_gb: float = 4.0
    sizes: LMBenchConfig = LMBenchConfig()


QUICK = ServeBenchConfig(prompt_lengths=(32, 64), concurrency=2, new_tokens=4, max_batched_tokens=32,
                         kv_cache_gb=0.05, sizes=dataclasses.replace(LMBenchConfig(), d_model=64, n_layers=2,
                                                                     n_heads=2, gau_d_k=32, codebook_size=16,
                                                                     block_size=16, window=32))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linattn bench serve``."""
    parser.add_argument("--models", nargs="+", metavar="SPEC",
                        help=f"layer specs or patterns, and {LLAMA!r} (default: {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--prompt-lengths", nargs="+", type=positive_int, metavar="P",
                        help=f"prompt lengths (default {' '.join(map(str, DEFAULT_PROMPT_LENGTHS))})")
    parser.add_argument("--concurrency", type=positive_int, help="requests sent at once (default 8)")
    parser.add_argument("--new-tokens", type=positive_int, help="tokens generated per request (default 64)")
    parser.add_argument("--max-batched-tokens", type=positive_int,
                        help="vLLM's max_num_batched_tokens: prompt tokens per engine step (default 2048)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models, prompts of 32 and 64 tokens, 2 requests, for tests; flags given still apply")
    parser.add_argument("--out", type=Path, default=Path("results/bench-serve"), help="output directory")


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """``--quick``'s settings (or the defaults) with the flags given on top."""
    config = QUICK if args.quick else ServeBenchConfig()
    given = {name: getattr(args, name) for name in ("concurrency", "new_tokens", "max_batched_tokens")
             if getattr(args, name) is not None}
    if args.prompt_lengths:
        given["prompt_lengths"] = tuple(sorted(set(args.prompt_lengths)))
    return dataclasses.replace(config, **given)


def export_model(spec: str, config: ServeBenchConfig, folder: Path) -> dict:
    """Write the model ``spec`` to ``folder``; its parameter count and what its cache holds per
    layer: ``{"parameters", "paged_layers", "state_layers", "kv_bytes_per_token"}``."""
    from ..hf import save_pretrained_lm
    from ..serve.config import PAGED_KINDS

    torch.manual_seed(0)
    softmax = config.sizes.model_config("softmax")
    if spec == LLAMA:
        from transformers import LlamaConfig, LlamaForCausalLM

        from ..hf import byte_tokenizer

        head_dim = softmax.d_model // softmax.n_heads
        llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=softmax.vocab_size, hidden_size=softmax.d_model, intermediate_size=softmax.ffn_width,
            num_hidden_layers=softmax.n_layers, num_attention_heads=softmax.n_heads,
            num_key_value_heads=softmax.n_heads, head_dim=head_dim, tie_word_embeddings=True,
            max_position_embeddings=max(config.prompt_lengths) + config.new_tokens + 1, rms_norm_eps=1e-6))
        llama.save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
        return {"parameters": sum(p.numel() for p in llama.parameters()), "paged_layers": softmax.n_layers,
                "state_layers": 0, "kv_bytes_per_token": 2 * softmax.n_heads * head_dim * 4}
    lm = LM(config.sizes.model_config(spec)).eval()
    save_pretrained_lm(lm, folder)
    paged = sum(s.kind in PAGED_KINDS for s in lm.specs)
    kv_bytes = 0
    if paged:  # a model without paged layers may have no heads at all (GAU pairs)
        head_dim = lm.config.head_dim or lm.config.d_model // lm.config.n_heads
        kv_bytes = 2 * (lm.config.n_kv_heads or lm.config.n_heads) * head_dim * 4
    return {"parameters": lm.num_parameters(), "paged_layers": paged, "state_layers": len(lm.specs) - paged,
            "kv_bytes_per_token": kv_bytes}


def serve_case(folder: str, prompt_length: int, config: ServeBenchConfig) -> dict:
    """One engine on ``folder`` serving ``config.concurrency`` prompts of ``prompt_length``
    tokens at once (in this process: ``in_fresh_process`` calls it); the measurements."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from ..serve.cli import check_vllm

    check_vllm()
    llm = LLM(model=folder, dtype="float32", max_model_len=prompt_length + config.new_tokens,
              max_num_seqs=config.concurrency, max_num_batched_tokens=config.max_batched_tokens,
              enable_prefix_caching=False, kv_cache_memory_bytes=int(config.kv_cache_gb * 1e9),
              disable_log_stats=False, seed=0)
    generator = torch.Generator().manual_seed(prompt_length)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (prompt_length,), generator=generator).tolist()}
               for _ in range(config.concurrency + 1)]
    params = SamplingParams(temperature=0.0, max_tokens=config.new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up, untimed
    start = time.perf_counter()
    outputs = llm.generate(prompts[1:], params, use_tqdm=False)
    wall = time.perf_counter() - start
    produced = sum(len(output.outputs[0].token_ids) for output in outputs)
    first_tokens = [output.metrics.first_token_latency for output in outputs if output.metrics is not None]
    cache = llm.llm_engine.vllm_config.cache_config
    return {"wall_s": wall, "requests_per_s": len(outputs) / wall, "output_tokens_per_s": produced / wall,
            "ttft_s": statistics.median(first_tokens) if first_tokens else None, "block_size": cache.block_size,
            "state_page_bytes": cache.mamba_page_size_padded}


def _memory_per_sequence(model: dict, measured: dict, tokens: int, state_row_bytes: int | None) -> int:
    """Cache bytes one sequence of ``tokens`` tokens holds: a slot per state layer (vLLM's page,
    else the row) and the paged layers' KV blocks."""
    state = measured["state_page_bytes"] or state_row_bytes or 0
    blocks = math.ceil(tokens / measured["block_size"])
    return model["state_layers"] * state + model["paged_layers"] * blocks * measured["block_size"] \
        * model["kv_bytes_per_token"]


def _state_row_bytes(spec: str, config: ServeBenchConfig, max_positions: int) -> int | None:
    """The bytes of one state slot row of the linattn model ``spec`` (None for the Llama)."""
    from ..serve.config import PAGED_KINDS
    from ..serve.states import layer_layout

    if spec == LLAMA:
        return None
    lm = LM(config.sizes.model_config(spec)).eval()
    sizes = [layer_layout(layer_spec.kind, layer, lm.config.d_model, max_positions).size * 4
             for layer_spec, layer in zip(lm.specs, lm.layers) if layer_spec.kind not in PAGED_KINDS]
    return max(sizes, default=0)


def run(config: ServeBenchConfig, models: list[str], out_dir: Path, command: str) -> dict:
    """Measure every (model, prompt length), write results.json and results.md."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="linattn-bench-serve-") as scratch:
        for spec in models:
            folder = Path(scratch) / f"model-{len(rows)}"
            model = export_model(spec, config, folder)
            for prompt_length in config.prompt_lengths:
                measured = in_fresh_process(serve_case, str(folder), prompt_length, config, threads=None)
                tokens = prompt_length + config.new_tokens
                row_bytes = _state_row_bytes(spec, config, tokens)
                rows.append({"case": spec, "prompt_length": prompt_length, "parameters": model["parameters"],
                             "memory_per_sequence_bytes": _memory_per_sequence(model, measured, tokens, row_bytes),
                             **measured})
                print(f"bench serve: {spec} P={prompt_length}: {measured['output_tokens_per_s']:.1f} output tokens/s",
                      flush=True)
    shapes = {"prompt_lengths": list(config.prompt_lengths), "concurrency": config.concurrency,
              "new_tokens": config.new_tokens, "max_batched_tokens": config.max_batched_tokens,
              "sizes": dataclasses.asdict(config.sizes), "models": models}
    metadata = reporting.collect_metadata(device="cpu", command=command, shapes=shapes)
    summary = _targets(rows)
    text = page({"metadata": metadata, "rows": rows, "summary": summary})
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [reporting.write_json(out_dir / "results.json", rows=rows, metadata=metadata, summary=summary),
             reporting.write_markdown(out_dir / "results.md", text)]
    return {"text": text, "files": files}


def _targets(rows: list[dict]) -> dict:
    """Each model's output tokens/s over the Llama's at every prompt length both ran:
    ``{"speed_over_llama": {model: {prompt length: ratio}}}``."""
    llama = {r["prompt_length"]: r["output_tokens_per_s"] for r in rows if r["case"] == LLAMA}
    ratios: dict = {}
    for r in rows:
        if r["case"] != LLAMA and r["prompt_length"] in llama:
            ratios.setdefault(r["case"], {})[str(r["prompt_length"])] = (r["output_tokens_per_s"]
                                                                         / llama[r["prompt_length"]])
    return {"speed_over_llama": ratios}


def page(results: dict) -> str:
    """``results.md`` from ``results.json``'s contents: the measurements, then each model's output
    tokens/s over the Llama's per prompt length."""
    metadata, rows, shapes = results["metadata"], results["rows"], results["metadata"]["shapes"]
    header = ["model", "parameters", "prompt", "requests/s", "output tokens/s", "TTFT (median)",
              "memory per sequence"]
    cells = [[r["case"], f"{r['parameters']:,}", str(r["prompt_length"]), f"{r['requests_per_s']:.3g}",
              f"{r['output_tokens_per_s']:.3g}", "—" if r["ttft_s"] is None else f"{r['ttft_s']:.3g} s",
              f"{r['memory_per_sequence_bytes'] / 2**20:.2f} MiB"] for r in rows]
    text = (f"# bench serve\n\n`{metadata['command']}`\n\nvLLM on {metadata['device_name']}, float32; "
            f"{shapes['concurrency']} requests at once, {shapes['new_tokens']} new tokens each, greedy\n\n"
            + "\n".join(reporting.markdown_table_lines(header, cells)) + "\n")
    ratios = results["summary"].get("speed_over_llama", {})
    if ratios:
        lengths = [str(length) for length in shapes["prompt_lengths"]]
        cells = [[model, *(f"{by_length[n]:.2f}x" if n in by_length else "—" for n in lengths)]
                 for model, by_length in ratios.items()]
        text += ("\n## Output tokens/s over the Llama's\n\n"
                 + "\n".join(reporting.markdown_table_lines(["model", *(f"prompt {n}" for n in lengths)], cells))
                 + "\n")
    return text


def run_command(args: argparse.Namespace) -> int:
    """Measure, write the files, print the table."""
    config = config_from_args(args)
    models = list(dict.fromkeys(args.models or DEFAULT_MODELS))
    for spec in models:
        if spec != LLAMA:
            config.sizes.model_config(spec)  # a bad spec is refused before anything runs
    result = run(config, models, args.out, args.command_line)
    print(result["text"])
    print("wrote " + ", ".join(str(p) for p in result["files"]))
    return 0
