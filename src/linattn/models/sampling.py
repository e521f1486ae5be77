"""Next-token sampling: temperature, top-k and nucleus (top-p) filtering."""

from __future__ import annotations

import torch

from .._checks import check_sampling

NO_TOKEN = -1  # what sample_next draws from a row of logits that are not all finite


class NonFiniteLogits(ValueError):
    """The model's logits for the next token are not finite (NaN or inf): its forward pass
    overflowed, and no token can be drawn."""


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one token per row of ``logits [B, V]`` -> ``[B]`` int64.

    ``temperature == 0`` takes the argmax. Otherwise the logits, less their row's largest, are
    divided by the temperature (finite: inf would flatten every row to uniform, NaN poison it;
    any positive one works, a tiny one is the argmax: the largest stays 0, so nothing
    overflows); ``top_k`` keeps the k largest; ``top_p`` keeps the smallest set of tokens whose
    probability mass reaches p (always at least the most likely one). A row whose logits are
    not all finite (a model whose forward pass overflowed) draws no token: its entry is
    ``NO_TOKEN`` (-1), found without reading the device. Bad settings are a ValueError naming
    the argument (``_checks.check_sampling``).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [batch, vocab], got {type(logits).__name__} "
                         f"{list(getattr(logits, 'shape', []))}")
    check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = logits.float()
    finite = torch.isfinite(logits).all(-1)
    if temperature == 0:
        return torch.where(finite, logits.argmax(-1), NO_TOKEN)
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.where(finite.unsqueeze(-1), logits.softmax(-1), 1.0)  # a row that draws no token: any weights
    draws = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.where(finite, draws, NO_TOKEN)
