"""Where the native VQ forward's time goes: the parts behind ``docs/benchmarks.md``'s sentence
on Transformer-VQ's ceiling.

At ``linattn bench attention``'s VQ shape (B 1, H 8, D 64, S 512, block 128, T 16384), the
median of ``--repeats`` calls (after one untimed call), without gradients, of: the quantizer
(``VectorQuantizer``, the native nearest-code search), ``vq_attention`` on its output (the
native block form), and each one's matrix products alone at the shapes the kernels run them
(the search: ``[256, 64] x [64, 512]`` per 256 keys; the block form: ``[128, 64] x [64, 768]``
for the scores and ``[128, 768] x [768, 64]`` for the outputs, per block), repeated as often as
the kernels run them and spread over the threads as the kernels spread their rows. Prints
one line per part. Run on a quiet machine, from the repository root:

    .venv/bin/python tools/vq_forward_parts.py --threads 2
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from linattn import vq_attention
from linattn.bench.harness import median, time_call
from linattn.nn import VectorQuantizer

T, H, D, S, L = 16384, 8, 64, 512, 128


def products(shapes: list[tuple[int, int, int]], count: int, threads: int) -> Callable[[], None]:
    """A call doing ``count`` rounds of the products ``[m, k] x [k, n]`` of ``shapes`` in each of
    ``threads`` threads at once (the kernels run one row per thread), one intra-op thread each."""
    operands = [[(torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)) for m, k, n in shapes]
                for _ in range(threads)]

    def work(index: int) -> None:
        torch.set_num_threads(1)  # OpenMP's thread count is per calling thread: this one's products use one
        for _ in range(count):
            for a, b, c in operands[index]:
                torch.mm(a, b, out=c)

    def call() -> None:
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(work, range(threads)))
        finally:
            torch.set_num_threads(threads)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, T, D, generator=g) for _ in range(3))
    quantizer = VectorQuantizer(H, D, S).eval()
    rows = H // args.threads  # kv heads per thread
    with torch.no_grad():
        k_hat, codes, _ = quantizer(k)
        codebook = quantizer.codebook
        parts = [
            ("quantizer (native nearest-code search)", lambda: quantizer(k)),
            ("  its products alone", products([(256, D, S)], rows * T // 256, args.threads)),
            ("vq_attention (native block form)", lambda: vq_attention(q, k_hat, v, codes, codebook, block_size=L)),
            ("  its products alone", products([(L, D, 2 * L + S), (L, 2 * L + S, D)], rows * T // L,
                                              args.threads)),
        ]
        for name, call in parts:
            seconds = median(time_call(call, repeats=args.repeats, warmup=1, device="cpu"))
            print(f"{name}: {seconds * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
