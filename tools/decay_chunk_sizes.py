"""Chunk length of the decay chunk forms: the times behind ``ops/common/decay.py``'s
``CHANNEL_CHUNK`` (the most positions in a chunk of kernel attention with a per-channel decay) and
``ops/delta/gated.py``'s ``GATED_CHUNK`` (the same for the gated delta rule).

For each op, length T and chunk length C: the median of ``--repeats`` calls (after one
untimed call) of the op as ``linattn bench attention`` times it (cases ``decay-channel`` and
``gated-delta``: B 1, H 8, D 64, the log decay computed from the keys inside the call), with
the op's cap set to C for the measurement, forward under ``no_grad`` and forward + backward.
Prints one line per (op, T, C). Run on a quiet machine, from the repository root:

    .venv/bin/python tools/decay_chunk_sizes.py --threads 2
"""

from __future__ import annotations

import argparse

import torch

import linattn.ops.common.decay as decay
import linattn.ops.delta.gated as gated
from linattn.bench.attention import CASES, AttentionBenchConfig
from linattn.bench.harness import median, time_call

# op -> (bench case, module holding the cap, the cap's name)
_OPS = {
    "decay-channel": ("decay-channel", decay, "CHANNEL_CHUNK"),
    "gated-delta": ("gated-delta", gated, "GATED_CHUNK"),
}


def seconds(op: str, T: int, chunk: int, train: bool, repeats: int) -> float:
    """Median seconds of the bench case ``op`` at length T with its chunk cap set to ``chunk``."""
    case_name, module, cap = _OPS[op]
    attend = CASES[case_name](AttentionBenchConfig()).fn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, T, 64, generator=g, requires_grad=train) for _ in range(3))

    def call() -> None:
        with torch.set_grad_enabled(train):
            out = attend(q, k, v)
            if train:
                out.sum().backward()

    saved = getattr(module, cap)
    setattr(module, cap, chunk)
    try:
        return median(time_call(call, repeats=repeats, warmup=1, device="cpu"))
    finally:
        setattr(module, cap, saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ops", nargs="+", choices=sorted(_OPS), default=sorted(_OPS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, B 1, H 8, D 64, median of {args.repeats} calls (seconds)")
    print(f"{'op':<14} {'T':>6} {'chunk':>5} {'forward':>9} {'fwd+bwd':>9}")
    for op in args.ops:
        for T in args.lengths:
            for chunk in args.chunks:
                forward = seconds(op, T, chunk, False, args.repeats)
                train = seconds(op, T, chunk, True, args.repeats)
                print(f"{op:<14} {T:>6} {chunk:>5} {forward:>9.3f} {train:>9.3f}", flush=True)


if __name__ == "__main__":
    main()
