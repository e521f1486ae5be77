"""Rotary positions (RoPE) and ReRoPE, the rotary embedding with a window (softmax, local and VQ).

``R(p)`` turns the feature pairs ``(x_2m, x_2m+1)`` by the angle ``p * base^(-2m/D)``, so
``(R(i) q).(R(j) k) = (R(i - j) q).k``: the score depends on ``i - j`` only. ReRoPE (seed 004)
keeps that inside a window of w positions and holds every key further back at distance w:

    score_ij = (R(min(i - j, w)) q_i) . k_j          (causal: i >= j)

Two products give it without a rotation per pair: inside the window ``(R(i) q_i).(R(j) k_j)``,
beyond it ``(R(w) q_i).k_j``, merged by the mask ``i - j < w`` (``rerope_scores``; at
``i - j = w`` both are the same number). ``pairwise_rerope_scores`` is the equation itself, one
rotated query per pair, for the reference forms. Only ``i - j`` enters, so the positions may
start anywhere (the forms number them inside a call or a block, which keeps the angles small).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rotary_frequencies(head_dim: int, base: float, scaling: dict[str, Any] | None = None, *,
                       device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``head_dim / 2`` turning rates ``f_m`` of the pairs, in ``dtype``. Without ``scaling``:
    ``base^(-2m/D)``; with it (a checkpoint's rope type, checked and described by
    ``linattn.nn.rotary``), computed in float64 and then cast."""
    steps = torch.arange(0, head_dim, 2, device=device, dtype=dtype if scaling is None else torch.float64)
    frequencies = base ** (-steps / head_dim)
    if scaling is None:
        return frequencies
    if scaling["type"] == "linear":
        return (frequencies / scaling["factor"]).to(dtype)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    length = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / frequencies
    scaled = torch.where(wavelength > length / low, frequencies / factor, frequencies)
    blend = (length / wavelength - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    between = (wavelength >= length / high) & (wavelength <= length / low)
    return torch.where(between, smoothed, scaled).to(dtype)


def rotation(positions: torch.Tensor, dim: int, base: float, dtype: torch.dtype,
             scaling: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[..., D/2]`` of the angles ``p * f_m`` for the positions ``[...]`` (any
    integer or float tensor), ``f_m`` from ``rotary_frequencies``, computed in ``dtype``."""
    angles = positions.to(dtype).unsqueeze(-1) * rotary_frequencies(dim, base, scaling, device=positions.device,
                                                                    dtype=dtype)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` with each pair ``(x_2m, x_2m+1)`` turned by the angle whose cosine and
    sine are ``cos``, ``sin`` ``[..., D/2]`` (broadcast against x's leading dimensions)."""
    pairs = x.unflatten(-1, (x.shape[-1] // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def rotate_at(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """``R(p) x`` for ``x [..., n, D]`` with one position per row, ``positions [n]`` (or one
    position for every row, a 0-d or ``[1]`` tensor)."""
    return rotate(x, *rotation(positions, x.shape[-1], base, x.dtype))


def positions(first: int, count: int, device) -> torch.Tensor:
    """The positions ``first .. first + count - 1`` (int64)."""
    return torch.arange(first, first + count, device=device)


def rerope_scores(q: torch.Tensor, k: torch.Tensor, q_first: int, k_first: int, window: int,
                  base: float) -> torch.Tensor:
    """``(R(min(i - j, w)) q_i) . k_j`` ``[..., T, S]`` as two score products merged by the mask
    ``i - j < w``: ``(R(i) q_i).(R(j) k_j)`` inside the window, ``(R(w) q_i).k_j`` beyond it, each
    computed only where some pair needs it. q ``[..., T, D]`` at positions ``q_first ..``, k
    ``[..., S, D]`` at ``k_first ..`` (leading dimensions broadcast). Offsets ``i - j < 0``
    (future keys) are at their own distance; a causal caller masks them."""
    T, S = q.shape[-2], k.shape[-2]
    nearest, farthest = q_first - (k_first + S - 1), q_first + T - 1 - k_first
    if nearest >= window:  # every key beyond the window
        return far_queries(q, window, base) @ k.transpose(-1, -2)
    q_at, k_at = positions(q_first, T, q.device), positions(k_first, S, q.device)
    scores = rotate_at(q, q_at, base) @ rotate_at(k, k_at, base).transpose(-1, -2)
    if farthest < window:  # every key inside it
        return scores
    near = (q_at[:, None] - k_at[None, :]) < window
    return torch.where(near, scores, far_queries(q, window, base) @ k.transpose(-1, -2))


def far_queries(q: torch.Tensor, window: int, base: float) -> torch.Tensor:
    """``R(w) q``: the queries as every key at distance ``>= w`` sees them."""
    return rotate_at(q, positions(window, 1, q.device), base)  # made on the device: no copy from the host


def pairwise_rerope_scores(q: torch.Tensor, k: torch.Tensor, q_first: int, k_first: int, window: int,
                           base: float) -> torch.Tensor:
    """The equation materialised: ``(R(min(i - j, w)) q_i) . k_j`` ``[..., T, S]`` with one
    rotated query per pair, ``[..., T, S, D]`` (the readable reference; ``rerope_scores``
    computes the same with two products). Positions as in ``rerope_scores``."""
    q_at, k_at = positions(q_first, q.shape[-2], q.device), positions(k_first, k.shape[-2], q.device)
    distance = (q_at[:, None] - k_at[None, :]).clamp_max(window)  # [T, S]
    rotated = rotate_at(q.unsqueeze(-2), distance, base)  # [..., T, S, D]
    return (rotated * k.unsqueeze(-3)).sum(-1)
