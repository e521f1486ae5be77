"""How the block form walks its blocks: ``schedule="auto"``'s measured grid and the memory
budgets of the batched and running schedules.
"""

from __future__ import annotations

import math

import torch


SCHEDULES = ("auto", "loop", "batched")


# Score entries a group of blocks may hold at once (batched schedule), by device type: on a
# GPU few large kernels (memory stays bounded at 64k); on a CPU 2 MB of float32 scores, the
# fastest of 2^15..2^22 over batch x heads 1..16, L 64/128, Dv 64/256 (docs/results.md).
BATCHED_SCORES = {"cuda": 1 << 22, "cpu": 1 << 19}


# schedule="auto" on a CPU: the faster schedule at the nearest point (in log2 of each
# coordinate) of grids measured with Dk = Dv = 64, bias and position keys, keyed by (gradients
# on, rows = batch x heads, block length L, codebook size S, blocks per row R); quiet machine,
# 2 threads. Long sequences (T = 16384, R = 16384 / L): `.venv/bin/python
# tools/vq_schedule_grid.py --threads 2 --emit` (with gradients:
# docs/benchmarks/vq-schedule-grid/grid-after-running-cache.txt), without them the same with
# `--modes forward` (grid-running-rows.txt). Few blocks in many rows (R = 2, 8):
# `.venv/bin/python tools/vq_schedule_grid.py --threads 2 --block-counts 2 8 --rows 8 64 256
# --blocks 32 64 128 --codes 64 512 --emit` (grid-short.txt). The times are in
# docs/results.md, "VQ block schedules".
AUTO_SCHEDULE = {
    (False, 1, 64, 128, 256): "batched", (False, 1, 64, 512, 256): "batched", (False, 1, 128, 128, 128): "batched",
    (False, 1, 128, 512, 128): "batched", (False, 1, 256, 128, 64): "batched", (False, 1, 256, 512, 64): "batched",
    (False, 4, 64, 128, 256): "batched", (False, 4, 64, 512, 256): "batched", (False, 4, 128, 128, 128): "batched",
    (False, 4, 128, 512, 128): "batched", (False, 4, 256, 128, 64): "batched", (False, 4, 256, 512, 64): "loop",
    (False, 8, 64, 128, 256): "batched", (False, 8, 64, 512, 256): "batched", (False, 8, 128, 128, 128): "batched",
    (False, 8, 128, 512, 128): "batched", (False, 8, 256, 128, 64): "loop", (False, 8, 256, 512, 64): "loop",
    (False, 32, 64, 128, 256): "batched", (False, 32, 64, 512, 256): "batched", (False, 32, 128, 128, 128): "loop",
    (False, 32, 128, 512, 128): "loop", (False, 32, 256, 128, 64): "loop", (False, 32, 256, 512, 64): "batched",
    (False, 8, 32, 64, 2): "loop", (False, 8, 32, 64, 8): "loop", (False, 8, 32, 512, 2): "loop",
    (False, 8, 32, 512, 8): "batched", (False, 8, 64, 64, 2): "loop", (False, 8, 64, 64, 8): "loop",
    (False, 8, 64, 512, 2): "loop", (False, 8, 64, 512, 8): "loop", (False, 8, 128, 64, 2): "loop",
    (False, 8, 128, 64, 8): "loop", (False, 8, 128, 512, 2): "loop", (False, 8, 128, 512, 8): "loop",
    (False, 64, 32, 64, 2): "loop", (False, 64, 32, 64, 8): "loop", (False, 64, 32, 512, 2): "loop",
    (False, 64, 32, 512, 8): "batched", (False, 64, 64, 64, 2): "loop", (False, 64, 64, 64, 8): "loop",
    (False, 64, 64, 512, 2): "loop", (False, 64, 64, 512, 8): "batched", (False, 64, 128, 64, 2): "loop",
    (False, 64, 128, 64, 8): "loop", (False, 64, 128, 512, 2): "loop", (False, 64, 128, 512, 8): "batched",
    (False, 256, 32, 64, 2): "loop", (False, 256, 32, 64, 8): "loop", (False, 256, 32, 512, 2): "loop",
    (False, 256, 32, 512, 8): "batched", (False, 256, 64, 64, 2): "loop", (False, 256, 64, 64, 8): "loop",
    (False, 256, 64, 512, 2): "batched", (False, 256, 64, 512, 8): "batched", (False, 256, 128, 64, 2): "loop",
    (False, 256, 128, 64, 8): "batched", (False, 256, 128, 512, 2): "batched", (False, 256, 128, 512, 8): "batched",
    (True, 1, 64, 128, 256): "batched", (True, 1, 64, 512, 256): "batched", (True, 1, 128, 128, 128): "batched",
    (True, 1, 128, 512, 128): "batched", (True, 1, 256, 128, 64): "batched", (True, 1, 256, 512, 64): "batched",
    (True, 4, 64, 128, 256): "batched", (True, 4, 64, 512, 256): "batched", (True, 4, 128, 128, 128): "batched",
    (True, 4, 128, 512, 128): "batched", (True, 4, 256, 128, 64): "batched", (True, 4, 256, 512, 64): "batched",
    (True, 8, 64, 128, 256): "batched", (True, 8, 64, 512, 256): "batched", (True, 8, 128, 128, 128): "batched",
    (True, 8, 128, 512, 128): "batched", (True, 8, 256, 128, 64): "loop", (True, 8, 256, 512, 64): "batched",
    (True, 32, 64, 128, 256): "batched", (True, 32, 64, 512, 256): "batched", (True, 32, 128, 128, 128): "batched",
    (True, 32, 128, 512, 128): "batched", (True, 32, 256, 128, 64): "loop", (True, 32, 256, 512, 64): "batched",
    (True, 8, 32, 64, 2): "loop", (True, 8, 32, 64, 8): "loop", (True, 8, 32, 512, 2): "loop",
    (True, 8, 32, 512, 8): "loop", (True, 8, 64, 64, 2): "loop", (True, 8, 64, 64, 8): "loop",
    (True, 8, 64, 512, 2): "loop", (True, 8, 64, 512, 8): "loop", (True, 8, 128, 64, 2): "loop",
    (True, 8, 128, 64, 8): "loop", (True, 8, 128, 512, 2): "loop", (True, 8, 128, 512, 8): "loop",
    (True, 64, 32, 64, 2): "loop", (True, 64, 32, 64, 8): "loop", (True, 64, 32, 512, 2): "loop",
    (True, 64, 32, 512, 8): "loop", (True, 64, 64, 64, 2): "loop", (True, 64, 64, 64, 8): "loop",
    (True, 64, 64, 512, 2): "loop", (True, 64, 64, 512, 8): "loop", (True, 64, 128, 64, 2): "loop",
    (True, 64, 128, 64, 8): "loop", (True, 64, 128, 512, 2): "loop", (True, 64, 128, 512, 8): "batched",
    (True, 256, 32, 64, 2): "loop", (True, 256, 32, 64, 8): "loop", (True, 256, 32, 512, 2): "loop",
    (True, 256, 32, 512, 8): "batched", (True, 256, 64, 64, 2): "loop", (True, 256, 64, 64, 8): "loop",
    (True, 256, 64, 512, 2): "loop", (True, 256, 64, 512, 8): "batched", (True, 256, 128, 64, 2): "loop",
    (True, 256, 128, 64, 8): "batched", (True, 256, 128, 512, 2): "batched", (True, 256, 128, 512, 8): "batched",
}


def auto_schedule(grad: bool, rows: int, L: int, S: int, blocks: int, device: torch.device) -> str:
    """``schedule="auto"``'s choice for a call with gradients on or off over ``rows`` =
    batch x heads rows, block length ``L``, ``S`` codes and ``blocks`` blocks per row: on a CPU
    the winner of the nearest ``AUTO_SCHEDULE`` point; elsewhere ``"batched"`` (fewer, larger
    kernels; not measured)."""
    if device.type != "cpu":
        return "batched"
    best, best_distance = "batched", math.inf
    for (key_grad, key_rows, key_L, key_S, key_blocks), winner in AUTO_SCHEDULE.items():  # a plain loop: compiles
        if key_grad == grad:
            distance = (abs(math.log2(key_rows) - math.log2(rows)) + abs(math.log2(key_L) - math.log2(L))
                        + abs(math.log2(key_S) - math.log2(S)) + abs(math.log2(key_blocks) - math.log2(blocks)))
            if distance < best_distance:
                best, best_distance = winner, distance
    return best


def blocks_per_group(device: torch.device, scores_per_block: int) -> int:
    """Blocks the batched schedule takes at once: as many as ``BATCHED_SCORES`` allows."""
    return max(1, BATCHED_SCORES.get(device.type, BATCHED_SCORES["cuda"]) // scores_per_block)


# Cache weights ``p_s / n_s`` the running form holds at once (rows x blocks of a group x
# queries x codes), by device type: it takes as many rows at a time as they allow.
RUNNING_WEIGHTS = {"cuda": 1 << 24, "cpu": 1 << 21}


def rows_at_once(device: torch.device, weights_per_row: int) -> int:
    """Rows ``running_blocks`` takes at once: as many as ``RUNNING_WEIGHTS`` allows."""
    return max(1, RUNNING_WEIGHTS.get(device.type, RUNNING_WEIGHTS["cuda"]) // weights_per_row)
