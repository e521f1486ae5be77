"""Equal parameter counts: the inner width that sizes one model like another."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import LMConfig


def count_parameters(config: LMConfig) -> int:
    """The parameter count of ``LM(config)``, built on the meta device (no memory, no RNG)."""
    from .lm import LM

    with torch.device("meta"):
        return LM(config).num_parameters()


def matched_width(at: Callable[[int], LMConfig], target: int, step: int,
                  count: Callable[[LMConfig], int] = count_parameters) -> int:
    """The width ``w`` (a positive multiple of ``step``) whose model ``at(w)`` has the
    parameter count nearest ``target`` (ties: the smaller width). The count is affine in
    ``w`` (an FFN or GAU value width); a count that does not grow with ``w`` is a ValueError
    whose message says it cannot be matched."""
    first, second = count(at(step)), count(at(2 * step))
    per_width = (second - first) / step
    if per_width <= 0:
        raise ValueError("the parameter count does not grow with the width, so it cannot be matched to the target")
    centre = max(1, round((step + (target - first) / per_width) / step))
    candidates = [step * k for k in (centre - 1, centre, centre + 1) if k >= 1]
    return min(candidates, key=lambda width: (abs(count(at(width)) - target), width))
