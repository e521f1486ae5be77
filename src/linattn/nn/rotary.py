"""Rotary position embedding (RoPE, Su et al. 2021) with a position offset for decoding.

The pair ``m`` of a head turns by ``position * f_m`` with ``f_m = base^(-2m/D)``. ``scaling``
changes these frequencies as Hugging Face's rope types do (``transformers``'
``modeling_rope_utils.py``), so a checkpoint trained with them computes the same attention:

- ``{"type": "linear", "factor": s}``: every ``f_m / s`` (position interpolation);
- ``{"type": "llama3", "factor": s, "low_freq_factor": l, "high_freq_factor": h,
  "original_max_position_embeddings": L}``: with the wavelength ``w_m = 2 pi / f_m``, ``f_m``
  is kept where ``w_m < L / h``, divided by ``s`` where ``w_m > L / l``, and in between
  ``(1 - a) f_m / s + a f_m`` with ``a = (L / w_m - l) / (h - l)`` (Llama 3.1).
"""

from __future__ import annotations

from typing import Any

import torch

from .._checks import check_int, check_positive_number
from ..ops.common.rotary import rotate, rotation

SCALING_TYPES = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def check_rotary_scaling(name: str, scaling: object) -> dict[str, Any] | None:
    """``scaling`` is None or a dict ``{"type": ..., <that type's numbers>}`` (``SCALING_TYPES``)
    with positive finite numbers, an int ``original_max_position_embeddings`` and, for llama3,
    ``high_freq_factor > low_freq_factor``; else ValueError (TypeError for another kind of
    value) naming ``name`` and the key. Returns the dict with its numbers as floats (the
    length as an int)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TypeError(f"{name} must be None or a dict with a 'type', got {type(scaling).__name__} {scaling!r}")
    kind = scaling.get("type")
    if kind not in SCALING_TYPES:
        raise ValueError(f"{name}['type'] must be one of {sorted(SCALING_TYPES)}, got {kind!r}")
    wanted = set(SCALING_TYPES[kind]) | {"type"}
    if set(scaling) != wanted:
        raise ValueError(f"{name} of type {kind!r} takes exactly the keys {sorted(wanted)}, got {sorted(scaling)}")
    checked: dict[str, Any] = {"type": kind}
    for key in SCALING_TYPES[kind]:
        if key == "original_max_position_embeddings":
            checked[key] = check_int(f"{name}['{key}']", scaling[key])
        else:
            checked[key] = check_positive_number(f"{name}['{key}']", scaling[key], finite=True)
    if kind == "llama3" and checked["high_freq_factor"] <= checked["low_freq_factor"]:
        raise ValueError(f"{name}: high_freq_factor must be larger than low_freq_factor, got "
                         f"{checked['high_freq_factor']} and {checked['low_freq_factor']}")
    return checked


def apply_rotary(x: torch.Tensor, offset: int = 0, base: float = 10000.0,
                 scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Rotate ``x [B, H, T, D]`` (D even) at positions ``offset .. offset + T - 1``.

    Pairs ``(x_{2m}, x_{2m+1})`` at position p turn by the angle ``p * f_m`` (``f_m =
    base^(-2m/D)``, or as ``scaling`` changes it: ``rotary_frequencies``), so
    ``rot(q, i) . rot(k, j)`` depends on ``i - j`` only. Computed in float32 (float64 for
    float64 input) and returned in x's dtype. The ops' ReRoPE (``rerope=``) uses the same
    rotation (``ops/common/rotary.py``).
    """
    return apply_rotary_at(x, torch.arange(offset, offset + x.shape[-2], device=x.device), base, scaling)


def apply_rotary_at(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0,
                    scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """``apply_rotary`` with the position of each of the ``T`` rows of ``x [..., T, D]`` given
    by ``positions [T]`` (integers): the rows of a serving engine's flat batch belong to
    several sequences, each at its own position."""
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"rotary embedding needs an even head dimension, got {D}")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return rotate(x.to(dtype), *rotation(positions, D, base, dtype, scaling)).to(x.dtype)
