"""Scores of many vectors against a per-head codebook, without copying the codebook per batch."""

from __future__ import annotations

import torch


def codebook_scores(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``x [B, H, n, D] . codebook [H, S, D]^T -> [B, H, n, S]``.

    A broadcast matmul would expand the codebook over B and copy it; here the (small) rows
    are regrouped per head instead, so the codebook is read in place.
    """
    B, H, n, D = x.shape
    if B == 1:
        return x @ codebook.transpose(-1, -2)
    rows = x.transpose(0, 1).reshape(H, B * n, D)
    return (rows @ codebook.transpose(-1, -2)).reshape(H, B, n, -1).transpose(0, 1)
