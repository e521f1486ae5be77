"""VectorQuantizer: per-head codebooks for Transformer-VQ keys, learned by EMA.

Forward: ``z_j = argmin_s |k_j - c_s|^2`` (in float32), ``k_hat = sg(c_z) + (k - sg(k))``
(the straight-through estimator: in the forward pass ``k_hat`` *is* ``c_z``, in the backward
pass the gradient reaches k unchanged), and the commitment loss
``beta_c * mean_tokens sum_d (k - sg(c_z))^2``.

The codebook is not a parameter: no optimizer, weight decay, clipping or LR schedule touches
it. Each training forward adds the assignment counts and key sums of its (unpadded) tokens
to pending statistics; ``update()``, called once per optimizer step, all-reduces them under
torch.distributed and moves the exponential moving averages

    counts <- g counts + (1 - g) batch_counts,   sums <- g sums + (1 - g) batch_sums,
    c = sums / max(counts, 0.01)

Every training-mode forward outside a backward pass is counted (use ``.eval()`` for
evaluation); a forward recomputed by activation checkpointing runs inside the backward
pass and adds nothing, so the statistics of a step are counted once. The codebook and the
statistics stay float32 whatever the module is cast to.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _inside_backward() -> bool:
    """True while the autograd engine runs a backward pass (checkpoint recomputation)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class VectorQuantizer(nn.Module):
    """Per-head nearest-code quantizer with an EMA codebook ``[H, S, Dk]``.

    Args:
        n_heads, head_dim: H and Dk of the keys ``[B, H, T, Dk]``.
        codebook_size: S codes per head.
        ema_decay: g of the EMA update.
        commitment_weight: beta_c, the weight of the returned commitment loss.
        kmeans_init: initialise the codebook by k-means on the first training batch.
        dead_code_threshold: in ``update()``, codes whose EMA count falls below this are
            restarted from keys of the latest batch (0 disables).
        init_scale: standard deviation of the random initial codebook.
    """

    def __init__(
        self,
        n_heads: int,
        head_dim: int,
        codebook_size: int = 512,
        *,
        ema_decay: float = 0.99,
        commitment_weight: float = 1e-4,
        kmeans_init: bool = False,
        dead_code_threshold: float = 0.0,
        init_scale: float = 1.0,
        kmeans_iters: int = 10,
    ):
        super().__init__()
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay}")
        self.n_heads, self.head_dim, self.codebook_size = n_heads, head_dim, codebook_size
        self.ema_decay, self.commitment_weight = ema_decay, commitment_weight
        self.kmeans_init, self.dead_code_threshold, self.kmeans_iters = kmeans_init, dead_code_threshold, kmeans_iters
        initial = torch.randn(n_heads, codebook_size, head_dim) * init_scale
        self.register_buffer("codebook", initial.clone())
        self.register_buffer("ema_counts", torch.ones(n_heads, codebook_size))
        self.register_buffer("ema_sums", initial.clone())
        self.register_buffer("initialized", torch.tensor(not kmeans_init))
        self.register_buffer("_pending_counts", torch.zeros(n_heads, codebook_size), persistent=False)
        self.register_buffer("_pending_sums", torch.zeros(n_heads, codebook_size, head_dim), persistent=False)
        self._recent_keys: torch.Tensor | None = None

    _FLOAT32_BUFFERS = ("codebook", "ema_counts", "ema_sums", "_pending_counts", "_pending_sums")

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.double()``, ``.half()`` move the codebook and statistics but keep them float32."""
        super()._apply(fn, recurse)
        for name in self._FLOAT32_BUFFERS:
            buffer = self._buffers[name]
            if buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        return self

    # -- forward -----------------------------------------------------------------------

    def _check(self, k: torch.Tensor, mask: torch.Tensor | None) -> None:
        if not isinstance(k, torch.Tensor) or not k.is_floating_point():
            raise TypeError(f"k must be a floating-point tensor [B, {self.n_heads}, T, {self.head_dim}]")
        if k.dim() != 4 or k.shape[1] != self.n_heads or k.shape[3] != self.head_dim:
            raise ValueError(f"k has shape {list(k.shape)}, expected [B, {self.n_heads}, T, {self.head_dim}]")
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (k.shape[0], k.shape[2])):
            raise ValueError(f"mask must be a bool tensor [{k.shape[0]}, {k.shape[2]}], got {mask.dtype} {list(mask.shape)}")

    def nearest_codes(self, k: torch.Tensor) -> torch.Tensor:
        """``[B, H, T]`` index of the nearest code by squared L2 distance, computed in float32.

        ``argmin_s |k - c_s|^2 = argmin_s (|c_s|^2 - 2 k.c_s)``, evaluated 1024 positions at a time.
        """
        keys = k.detach().float()
        codebook = self.codebook.float()
        code_norms = codebook.pow(2).sum(-1)[None, :, None, :]  # [1, H, 1, S]
        codes = []
        for chunk in keys.split(1024, dim=2):
            scores = chunk @ codebook.transpose(-1, -2).unsqueeze(0)  # [B, H, t, S]
            codes.append(scores.mul_(-2.0).add_(code_norms).argmin(-1))
        return torch.cat(codes, dim=2)

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """``codebook[h, codes[b, h, t]]`` -> ``[B, H, T, Dk]``."""
        B, H, T = codes.shape
        index = codes.unsqueeze(-1).expand(B, H, T, self.head_dim)
        return torch.gather(self.codebook.unsqueeze(0).expand(B, -1, -1, -1), 2, index)

    def forward(
        self, k: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quantize keys ``k [B, H, T, Dk]`` (``mask [B, T]``: True for real tokens).

        Returns ``(k_hat, codes [B, H, T], commit_loss)``; ``k_hat`` equals the chosen codes
        exactly (in k's dtype) with the straight-through gradient to k.
        """
        self._check(k, mask)
        if self.training and not bool(self.initialized) and not _inside_backward():
            self._kmeans(k, mask)
        codes = self.nearest_codes(k)
        chosen = self.lookup(codes).to(k.dtype)
        k_hat = chosen + (k - k.detach())
        weights = None if mask is None else mask.unsqueeze(1).to(torch.float32)  # [B, 1, T]
        squared = (k.float() - chosen.float()).pow(2).sum(-1)  # [B, H, T]
        if weights is None:
            commit = squared.mean()
        else:
            commit = (squared * weights).sum() / (weights.sum() * self.n_heads).clamp_min(1.0)
        if self.training and not _inside_backward():
            self._accumulate(k, codes, mask)
        return k_hat, codes, self.commitment_weight * commit

    # -- statistics and the EMA update ---------------------------------------------------

    @torch.no_grad()
    def _accumulate(self, k: torch.Tensor, codes: torch.Tensor, mask: torch.Tensor | None) -> None:
        keys = k.detach().float()
        weights = torch.ones(codes.shape, device=k.device) if mask is None else mask.unsqueeze(1).expand_as(codes).float()
        counts = torch.zeros_like(self._pending_counts).unsqueeze(0).expand(k.shape[0], -1, -1).clone()
        counts.scatter_add_(-1, codes, weights)
        sums = torch.zeros(k.shape[0], self.n_heads, self.codebook_size, self.head_dim, device=k.device)
        index = codes.unsqueeze(-1).expand(*codes.shape, self.head_dim)
        sums.scatter_add_(2, index, keys * weights.unsqueeze(-1))
        self._pending_counts += counts.sum(0)
        self._pending_sums += sums.sum(0)
        if self.dead_code_threshold > 0:
            flat = keys.transpose(0, 1).reshape(self.n_heads, -1, self.head_dim)
            keep = weights[:, 0].reshape(-1) > 0
            self._recent_keys = flat[:, keep]

    @torch.no_grad()
    def update(self) -> None:
        """Apply the EMA update with the statistics gathered since the last call.

        Call once per optimizer step (after ``optimizer.step()``), outside autocast. Under
        torch.distributed the statistics are summed over ranks first, so every rank ends
        with the same codebook. Without new statistics this does nothing.
        """
        counts, sums = self._pending_counts.clone(), self._pending_sums.clone()
        if _distributed():
            dist.all_reduce(counts)
            dist.all_reduce(sums)
        if counts.sum() == 0:
            return
        g = self.ema_decay
        self.ema_counts.mul_(g).add_(counts, alpha=1.0 - g)
        self.ema_sums.mul_(g).add_(sums, alpha=1.0 - g)
        self.codebook.copy_(self.ema_sums / self.ema_counts.clamp_min(0.01).unsqueeze(-1))
        if self.dead_code_threshold > 0:
            self._restart_dead_codes()
        self._pending_counts.zero_()
        self._pending_sums.zero_()

    @torch.no_grad()
    def _restart_dead_codes(self) -> None:
        """Move codes with EMA count below the threshold onto random recent keys."""
        recent = self._recent_keys
        if recent is None or recent.shape[1] == 0:
            return
        dead = self.ema_counts < self.dead_code_threshold  # [H, S]
        for h in range(self.n_heads):
            idx = dead[h].nonzero().flatten()
            if idx.numel() == 0:
                continue
            pick = torch.randint(recent.shape[1], (idx.numel(),), device=recent.device)
            self.codebook[h, idx] = recent[h, pick]
            self.ema_sums[h, idx] = recent[h, pick]
            self.ema_counts[h, idx] = 1.0
        if _distributed():  # ranks drew different keys: take rank 0's
            for tensor in (self.codebook, self.ema_sums, self.ema_counts):
                dist.broadcast(tensor, src=0)

    @torch.no_grad()
    def _kmeans(self, k: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Initialise each head's codebook by k-means (Lloyd) on this batch's keys."""
        keys = k.detach().float().transpose(0, 1)  # [H, B, T, D]
        if mask is not None:
            keys = keys[:, mask]
        keys = keys.reshape(self.n_heads, -1, self.head_dim)
        n = keys.shape[1]
        pick = torch.randint(n, (self.codebook_size,), device=k.device) if n < self.codebook_size else torch.randperm(n, device=k.device)[: self.codebook_size]
        centers = keys[:, pick].clone()
        for _ in range(self.kmeans_iters):
            distances = torch.cdist(keys, centers)
            assign = distances.argmin(-1)  # [H, n]
            counts = torch.zeros(self.n_heads, self.codebook_size, device=k.device).scatter_add_(
                1, assign, torch.ones_like(assign, dtype=torch.float32)
            )
            sums = torch.zeros_like(centers).scatter_add_(1, assign.unsqueeze(-1).expand_as(keys), keys)
            centers = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp_min(1.0).unsqueeze(-1), centers)
        if _distributed():
            dist.broadcast(centers, src=0)
        self.codebook.copy_(centers)
        self.ema_sums.copy_(centers)
        self.ema_counts.fill_(1.0)
        self.initialized.fill_(True)

    # -- logging -------------------------------------------------------------------------

    @torch.no_grad()
    def usage(self) -> dict[str, torch.Tensor]:
        """Codebook use per head from the EMA counts: ``perplexity`` = exp(entropy of the
        code distribution) (S when all codes are used equally, 1 when one code takes all)
        and ``dead_codes`` = codes with EMA count below ``max(dead_code_threshold, 1e-3)``."""
        probs = self.ema_counts / self.ema_counts.sum(-1, keepdim=True)
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        threshold = max(self.dead_code_threshold, 1e-3)
        return {"perplexity": torch.exp(entropy), "dead_codes": (self.ema_counts < threshold).sum(-1)}

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads}, head_dim={self.head_dim}, codebook_size={self.codebook_size}, "
            f"ema_decay={self.ema_decay}, commitment_weight={self.commitment_weight}"
        )
