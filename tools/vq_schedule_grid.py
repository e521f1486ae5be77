"""Loop vs batched schedule of ``vq_attention``'s block form on a grid of shapes, for
``schedule="auto"`` (``ops/vq/schedule.py``'s ``AUTO_SCHEDULE``) and the batched schedule's group
budget (``BATCHED_SCORES``).

For each (rows = batch x heads, block length L, codebook size S, blocks per row R) at
T = R L (``--block-counts``; by default T = 16384, the long sequences of a prefill), Dk = Dv
= 64, with a relative bias and position keys as the GAU layer passes them: the median over
``--rounds`` turns of the loop and of the batched schedule (at each ``--budgets`` group
budget; the schedules take turns, so a slow spell of the machine falls on each), in the
``--modes`` asked for: ``forward`` (under ``no_grad``: prefill, evaluation) and ``train``
(forward + backward). Prints one line per shape with the times and loop/batched ratios,
then (``--emit``) the winners as the Python literal ``AUTO_SCHEDULE`` holds. Run on a
quiet machine, from the repository root:

    .venv/bin/python tools/vq_schedule_grid.py --threads 2 --emit

Short sequences in large batches (training at a small context: few blocks, many rows) are
their own grid, e.g. ``--block-counts 4 --rows 8 64 256 --blocks 32 64 128 --codes 64 512``.
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import time

import torch

import linattn.ops.vq as vq
from linattn.ops.vq import schedule


def vq_call(rows: int, L: int, S: int, schedule: str, mode: str, T: int = 16384, D: int = 64):
    """One call of ``vq_attention``'s block form on ``schedule``: forward under ``no_grad``
    (``mode="forward"``) or forward + backward (``"train"``)."""
    g = torch.Generator().manual_seed(0)
    train = mode == "train"
    q = torch.randn(1, rows, T, D, generator=g, requires_grad=train)
    codebook = torch.randn(rows, S, D, generator=g)
    codes = torch.randint(0, S, (1, rows, T), generator=g)
    k_hat = codebook[torch.arange(rows)[None, :, None], codes].clone().requires_grad_(train)
    v = torch.randn(1, rows, T, D, generator=g, requires_grad=train)
    bias, position_keys = torch.randn(rows, L + 1, generator=g), torch.randn(rows, L + 1, D, generator=g)

    def call() -> None:
        with torch.set_grad_enabled(train):
            out, _ = vq.vq_attention(q, k_hat, v, codes, codebook, block_size=L, bias=bias,
                                     position_keys=position_keys, schedule=schedule, impl="torch",
                                     check_inputs=False)
            if train:
                out.sum().backward()

    return call


# One printed line: "forward rows= 4 L= 64 S=128 T=16384 loop    302 ms | 2^19:    178 ms (1.69x)",
# with one "| 2^B: ..." column per budget tried (files printed before T was a choice have no
# "T=" and were measured at T = 16384).
LONG = 16384
_LINE = re.compile(r"^(forward|train)\s+rows=\s*(\d+) L=\s*(\d+) S=\s*(\d+)(?: T=\s*(\d+))? loop\s+(\d+) ms"
                   r"((?: \| 2\^\d+:\s+\d+ ms \([\d.]+x\))+)$")
_COLUMN = re.compile(r"2\^(\d+):\s+(\d+) ms")


def read_grid(text: str) -> dict[tuple[str, int, int, int, int], dict]:
    """The shapes of a grid this tool printed: ``(mode, rows, L, S, blocks per row R) ->
    {"loop": ms, budget: ms, ...}`` (whole milliseconds, as printed; other lines, such as the
    ``--emit`` literal, are skipped)."""
    grid = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if match:
            mode, rows, L, S, T, loop, columns = match.groups()
            times = {"loop": int(loop), **{1 << int(bits): int(ms) for bits, ms in _COLUMN.findall(columns)}}
            grid[(mode, int(rows), int(L), int(S), int(T or LONG) // int(L))] = times
    return grid


def faster(loop: float, batched: float) -> str | None:
    """The faster schedule of a measured pair, None when the times are equal (as printed,
    whole milliseconds can tie)."""
    return None if loop == batched else "loop" if loop < batched else "batched"


def interleaved_medians(calls: dict, rounds: int) -> dict:
    """Median seconds of each call over ``rounds`` turns, one call of each per turn (after one
    untimed call each), so a slow spell of the machine falls on all of them alike."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(each) for name, each in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=["forward", "train"], default=["forward", "train"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[schedule.BATCHED_SCORES["cpu"]],
                        help="batched schedule group budgets (score entries) to try")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--codes", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--block-counts", type=int, nargs="+", default=None, metavar="R",
                        help=f"blocks per row (T = R L); default: T = {LONG}")
    parser.add_argument("--rounds", type=int, default=5, help="timed turns per shape (default 5)")
    parser.add_argument("--emit", action="store_true", help="print the winners as AUTO_SCHEDULE's literal")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, default_budget = "cpu", schedule.BATCHED_SCORES["cpu"]
    winners = {}
    for mode, rows, L, S, R in itertools.product(args.modes, args.rows, args.blocks, args.codes,
                                                 args.block_counts or [None]):
        T = LONG if R is None else R * L
        calls = {"loop": vq_call(rows, L, S, "loop", mode, T)}
        for budget in args.budgets:
            batched = vq_call(rows, L, S, "batched", mode, T)

            def with_budget(call=batched, budget=budget) -> None:
                schedule.BATCHED_SCORES[device] = budget
                try:
                    call()
                finally:
                    schedule.BATCHED_SCORES[device] = default_budget

            calls[budget] = with_budget
        medians = interleaved_medians(calls, args.rounds)
        loop = medians["loop"]
        line = f"{mode:7s} rows={rows:2d} L={L:3d} S={S:3d} T={T:5d} loop {loop * 1e3:6.0f} ms"
        for budget in args.budgets:
            batched = medians[budget]
            line += f" | 2^{budget.bit_length() - 1}: {batched * 1e3:6.0f} ms ({loop / batched:.2f}x)"
            if budget == default_budget:
                winners[(mode == "train", rows, L, S, T // L)] = faster(loop, batched) or "batched"
        print(line, flush=True)
    if args.emit:
        print("{")
        for key, winner in winners.items():
            print(f"    {key}: {winner!r},")
        print("}")


if __name__ == "__main__":
    main()
