"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math


def learning_rate(step: int, *, peak: float, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR for optimizer step ``step`` (0-based): ``peak * (step + 1) / warmup`` during warm-up,
    then ``floor + (peak - floor) * (1 + cos(pi * progress)) / 2`` with ``floor = peak * min_ratio``
    and progress running from 0 after warm-up to 1 at ``total_steps - 1``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    floor = peak * min_ratio
    span = max(total_steps - 1 - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
