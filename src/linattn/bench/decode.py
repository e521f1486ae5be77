"""``linattn bench decode``: time per generated token against the context length.

For each mechanism and context length C: the state after C random tokens is built in one
call (not timed), then ``--tokens`` single-token steps are timed one by one, each feeding
the state of the previous; the median step time is reported. Mechanisms with a constant-size
state (Transformer-VQ, kernel attention, the delta rule) should be flat in C; exact
attention with a KV cache (``sdpa-kvcache``: one query against all cached keys) grows
linearly. B=1, H=8, D=64, float32 by default.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import reporting
from ..ops.delta import delta_rule
from ..ops.linear import linear_attention
from ..ops.vq import vq_attention
from ..nn.quantizer import VectorQuantizer
from .harness import median

DEFAULT_CONTEXTS = (1024, 4096, 16384, 65536)

# A decoding case: prefill(q, k, v) -> state; step(q1, k1, v1, state) -> state.
DecodeCase = tuple[Callable, Callable]


def _recurrent(run: Callable) -> DecodeCase:
    """An op with a carried state: prefill is the same call from no state."""
    return (lambda q, k, v: run(q, k, v, None)), run


def _vq(heads: int, dim: int, block_size: int = 128) -> DecodeCase:
    quantizer = VectorQuantizer(heads, dim, 512).eval()

    def run(q, k, v, state):
        k_hat, codes, _ = quantizer(k)
        return vq_attention(q, k_hat, v, codes, quantizer.codebook, block_size=block_size,
                            initial_state=state, output_final_state=True)[1]

    return _recurrent(run)


def _linear(heads: int, dim: int) -> DecodeCase:
    def run(q, k, v, state):
        return linear_attention(q, k, v, feature_map="elu", initial_state=state, output_final_state=True)[1]

    return _recurrent(run)


def _delta(heads: int, dim: int) -> DecodeCase:
    def run(q, k, v, state):
        beta = torch.full(k.shape[:3], 0.5)
        return delta_rule(q, k, v, beta, initial_state=state, output_final_state=True)[1]

    return _recurrent(run)


def _kv_cache(heads: int, dim: int) -> DecodeCase:
    """Exact attention: the state is every key and value so far (the KV cache)."""

    def prefill(q, k, v):
        return k, v

    def step(q, k, v, cache):
        keys, values = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        F.scaled_dot_product_attention(q, keys, values)
        return keys, values

    return prefill, step


DECODE_CASES: dict[str, Callable[[int, int], DecodeCase]] = {
    "vq-b128": _vq,
    "linear-elu": _linear,
    "delta": _delta,
    "sdpa-kvcache": _kv_cache,
}


def measure(name: str, contexts, *, heads: int, dim: int, tokens: int, seed: int = 0) -> list[dict]:
    """Median seconds per decoded token of the case ``name`` at each context length."""
    prefill, step = DECODE_CASES[name](heads, dim)
    rows = []
    with torch.no_grad():
        for context in contexts:
            generator = torch.Generator().manual_seed(seed + context)
            q, k, v = (torch.randn(1, heads, context + tokens, dim, generator=generator) for _ in range(3))
            state = prefill(q[:, :, :context], k[:, :, :context], v[:, :, :context])
            times = []
            for t in range(context, context + tokens):
                one = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
                start = time.perf_counter()
                state = step(*one, state)
                times.append(time.perf_counter() - start)
            rows.append({"case": name, "context": context, "per_token_s": median(times), "times_s": times})
    return rows


HELP = "decoding: time per generated token vs context length (constant-memory states vs a KV cache)"
DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linattn bench decode``."""
    parser.add_argument("--contexts", nargs="+", type=int, default=list(DEFAULT_CONTEXTS), metavar="C")
    parser.add_argument("--cases", nargs="+", choices=list(DECODE_CASES), default=list(DECODE_CASES), metavar="CASE")
    parser.add_argument("--tokens", type=int, default=32, help="timed decoding steps per context (median kept)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/bench-decode"), help="output directory")


def run_command(args: argparse.Namespace) -> int:
    """Measure every case, write results.json and results.md, print the table."""
    if any(c < 1 for c in args.contexts) or args.tokens < 1:
        raise ValueError("--contexts and --tokens must be positive")
    contexts = sorted(set(args.contexts))
    rows = []
    for name in args.cases:
        rows += measure(name, contexts, heads=args.heads, dim=args.dim, tokens=args.tokens)
    lines = ["| case | " + " | ".join(f"C={c}" for c in contexts) + f" | C={contexts[-1]} / C={contexts[0]} |",
             "| --- |" + " --- |" * (len(contexts) + 1)]
    summary = {}
    for name in args.cases:
        times = {r["context"]: r["per_token_s"] for r in rows if r["case"] == name}
        growth = times[contexts[-1]] / times[contexts[0]]
        summary[name] = {"growth": growth, "first_context": contexts[0], "last_context": contexts[-1]}
        cells = " | ".join(f"{times[c] * 1e3:.3g} ms" for c in contexts)
        lines.append(f"| {name} | {cells} | {growth:.2f}x |")
    table = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = {"batch": 1, "heads": args.heads, "dim": args.dim, "dtype": "float32", "contexts": contexts}
    metadata = reporting.collect_metadata(device="cpu", command=args.command_line, shapes=shapes)
    reporting.write_json(args.out / "results.json", rows=rows, metadata=metadata, summary=summary)
    (args.out / "results.md").write_text(f"# bench decode\n\n`{args.command_line}`\n\nper-token time\n\n{table}\n")
    print(table)
    print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}")
    return 0
