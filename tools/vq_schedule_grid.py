"""Loop vs batched schedule of ``vq_attention``'s block form, and the batched schedule's group
budget (``ops.vq._BATCHED_SCORES``), on a grid of the shapes whole models hand it.

For each (rows = batch x heads, block length L, value width Dv) at T = 16384, Dk = 64, S = 128,
with a relative bias and position keys as the GAU layer passes them: the median of 3
forward + backward calls on the loop, then on the batched schedule at each group budget
(score entries a group of blocks may hold). Prints one line per shape with the times and
loop/batched ratios. Run on a quiet machine, from the repository root:

    .venv/bin/python tools/vq_schedule_grid.py --threads 2 --budgets 32768 131072 524288 4194304
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

import linattn.ops.vq as vq


def seconds(rows: int, L: int, Dv: int, schedule: str, T: int = 16384, Dk: int = 64, S: int = 128) -> float:
    """Median seconds of 3 forward + backward calls (after one untimed call)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, rows, T, Dk, generator=g, requires_grad=True)
    codebook = torch.randn(rows, S, Dk, generator=g)
    codes = torch.randint(0, S, (1, rows, T), generator=g)
    k_hat = codebook[torch.arange(rows)[None, :, None], codes].clone().requires_grad_()
    v = torch.randn(1, rows, T, Dv, generator=g, requires_grad=True)
    bias, position_keys = torch.randn(rows, L + 1, generator=g), torch.randn(rows, L + 1, Dk, generator=g)

    def call() -> None:
        out, _ = vq.vq_attention(q, k_hat, v, codes, codebook, block_size=L, bias=bias, position_keys=position_keys,
                                 schedule=schedule, check_inputs=False)
        out.sum().backward()

    call()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1 << 15, 1 << 17, 1 << 19, 1 << 22])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cpu"
    for rows, L, Dv in itertools.product(args.rows, [64, 128], [64, 256]):
        loop = seconds(rows, L, Dv, "loop")
        line = f"rows={rows:2d} L={L:3d} Dv={Dv:3d} loop {loop * 1e3:6.0f} ms"
        for budget in args.budgets:
            vq._BATCHED_SCORES[device] = budget
            batched = seconds(rows, L, Dv, "batched")
            line += f" | 2^{budget.bit_length() - 1}: {batched * 1e3:6.0f} ms ({loop / batched:.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
