"""ReRoPE in Transformer-VQ (``vq_attention(rerope=w)``, seed 004): rotary positions inside a
window of w positions, every key further back at distance w.

    s_ij = scale (R(min(i - j, w)) q_i) . k_hat_j  (+ the bias and position-key terms)

with R the rotary rotation (``ops/common/rotary.py``). A block's queries see their own and the
previous block exactly and everything older through the cache; every cached key is more than
L positions behind, so with ``w <= L`` all of them sit at distance w and their sum is still
one term per code: ``exp(scale (R(w) q).c_s + log n_s) m_s``. The block form therefore stays
exact and linear-time: the cache logits read the far queries ``R(w) q``; the window scores
``(R(i) q).(R(j) k_hat)`` for ``i - j < w`` and ``(R(w) q).k_hat`` for the rest, merged by the
mask. With ``w > L`` the cache would hold keys whose distance (between L + 1 and w - 1)
decides their rotation but is gone once they are counted per code: refused.

Positions are numbered inside a block's window (query row a at ``L + a``, window column c,
the previous block then the own one, at c), and in the decode forms from the previous
block's first position: only ``i - j`` enters.
"""

from __future__ import annotations

import torch

from ..._checks import check_rerope
from ..common.rotary import positions, rotate, rotation


def check_vq_rerope(rerope: object, rotary_base: object, key_dim: int, block_size: int, causal: bool) -> int | None:
    """``rerope`` for ``vq_attention`` (``_checks.check_rerope``), at most the block size and causal."""
    rerope = check_rerope(rerope, rotary_base, key_dim)
    if rerope is None:
        return None
    if rerope > block_size:
        raise ValueError(f"rerope={rerope} is larger than block_size={block_size}: Transformer-VQ's cache holds every "
                         "key more than block_size positions back summed per code, so their distances are gone and "
                         "only keys at distance >= w (all rotated by w) can be in it; use rerope <= block_size")
    if not causal:
        raise ValueError("rerope is ReRoPE's causal relative position min(i - j, w); not defined for causal=False")
    return rerope


class WindowReRoPE:
    """The rotations of a block's window for the block form's schedules: queries ``[..., L, D]``
    at positions ``L .. 2L - 1``, window keys ``[..., 2L, D]`` at ``0 .. 2L - 1``, the far
    rotation by w, and ``near [L, 2L]``: the pairs with ``i - j < w``."""

    def __init__(self, window: int, base: float, L: int, dim: int, device, dtype):
        self.window, self.base = window, base
        self.query = rotation(positions(L, L, device), dim, base, dtype)
        self.keys = rotation(positions(0, 2 * L, device), dim, base, dtype)
        self.far = rotation(positions(window, 1, device), dim, base, dtype)
        rows, columns = positions(L, L, device), positions(0, 2 * L, device)
        self.near = (rows[:, None] - columns[None, :]) < window

    def far_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``R(w) q``: how the queries score keys at distance ``>= w`` and the cache's codes."""
        return rotate(q, *self.far)

    def window_scores(self, q: torch.Tensor, keys: torch.Tensor, far_q: torch.Tensor) -> torch.Tensor:
        """Scores ``[..., L, 2L]`` of queries ``q [..., L, D]`` (``far_q = R(w) q``) on their
        window ``keys [..., 2L, D]``: the two products merged by ``near``."""
        near = rotate(q, *self.query) @ rotate(keys, *self.keys).transpose(-1, -2)
        return torch.where(self.near, near, far_q @ keys.transpose(-1, -2))

    def block_scores(self, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``q [..., L, D]`` on ``keys [..., 2L + S, D]`` (the window, then the codebook)."""
        far_q = self.far_queries(q)
        scores = far_q @ keys.transpose(-1, -2)
        two_l = self.near.shape[-1]
        near = rotate(q, *self.query) @ rotate(keys[..., :two_l, :], *self.keys).transpose(-1, -2)
        return torch.cat([torch.where(self.near, near, scores[..., :two_l]), scores[..., two_l:]], dim=-1)
