"""VectorQuantizer: per-head nearest-code quantization of Transformer-VQ keys.

Forward: ``z_j = argmin_s |k_j - c_s|^2`` (in float32), ``k_hat = sg(c_z) + (k - sg(k))``
(the straight-through estimator: in the forward pass ``k_hat`` *is* ``c_z``, in the backward
pass the gradient reaches k unchanged), and the commitment loss
``beta_c * mean_tokens sum_d (k - sg(c_z))^2``.

The codes are a ``Codebook`` (``nn/codebook.py``), learned by EMA, not a parameter: no
optimizer, weight decay, clipping or LR schedule touches them. Each training forward hands
the assignment counts and key sums of its (unpadded) tokens to the codebook's pending
statistics; ``update()``, called once per optimizer step, sums them over ranks and moves

    counts <- g counts + (1 - g) batch_counts,   sums <- g sums + (1 - g) batch_sums,
    c = sums / max(counts, 0.01)

Every training-mode forward outside a backward pass is counted (use ``.eval()`` for
evaluation); a forward recomputed by activation checkpointing runs inside the backward
pass and adds nothing, so the statistics of a step are counted once. The k-means
initialisation of the first counted forward draws from a fork of the global random state,
so a recomputation, which skips it, redraws the same dropout. The codes and the
statistics stay float32 whatever the module is cast to.
"""

from __future__ import annotations

import torch

from .._checks import check_batch, check_choice, check_non_negative_number, compute_dtype
from ..ops.common.versions import tensor_version
from ..ops.vq import codebook_scores, native_nearest
from .codebook import Codebook, SyncHook


COMMITMENT_REDUCTIONS = ("mean", "paper")


def _inside_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread.

    A forward recomputed by activation checkpointing (reentrant or not) runs inside the
    backward pass, the original forward never does, so this tells the two apart. PyTorch
    has no public query for it; ``torch._C._current_graph_task_id`` (-1 outside backward)
    is what ``torch.utils.checkpoint`` and ``torch.autograd.graph.register_multi_grad_hook``
    use for the same question.

    Under ``torch.compile`` the answer is False: the call is traced once, as the forward,
    and a compiled graph's own recomputation (activation checkpointing inside the compiled
    model) replays no buffer writes. A compiled model must therefore not be recomputed from
    outside (a checkpoint around a compiled module would count its statistics twice).
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class VectorQuantizer(Codebook):
    """Per-head nearest-code quantizer with an EMA codebook ``[H, S, Dk]``.

    The quantizer is its own ``Codebook`` (a subclass), so the EMA buffers ``codebook``,
    ``ema_counts``, ``ema_sums`` and ``initialized`` are the quantizer's buffers and its state
    dict keeps those names.

    Args:
        n_heads: H of the keys ``[B, H, T, Dk]``.
        head_dim: Dk of the keys.
        codebook_size: S codes per head.
        ema_decay: g of the EMA update.
        commitment_weight: beta_c, the weight of the returned commitment loss.
        kmeans_init: initialise the codebook by k-means on the first training batch.
        dead_code_threshold: in ``update()``, codes whose EMA count is strictly below this
            are restarted from keys of the latest batch (0 disables).
        init_scale: standard deviation of the random initial codebook.
        kmeans_iters: Lloyd iterations of the k-means initialisation.
        sync: the collective hook of the ``Codebook`` (default: torch.distributed when
            initialised, else nothing).
        commitment_reduction: ``"mean"`` averages the squared distances over heads and
            real (unmasked) tokens; ``"paper"`` sums over heads and divides by all ``B T``
            positions, masked ones included (the official code's ``l_commit``), H times
            larger at the same weight.
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
        sync: SyncHook | None = None,
        commitment_reduction: str = "mean",
    ):
        super().__init__(
            n_heads, head_dim, codebook_size, ema_decay=ema_decay, kmeans_init=kmeans_init,
            kmeans_iters=kmeans_iters, dead_code_threshold=dead_code_threshold, init_scale=init_scale, sync=sync,
        )
        self.commitment_weight = check_non_negative_number("commitment_weight", commitment_weight)
        check_choice("commitment_reduction", commitment_reduction, COMMITMENT_REDUCTIONS)
        self.commitment_reduction = commitment_reduction

    # -- forward -----------------------------------------------------------------------

    def _check(self, k: torch.Tensor, mask: torch.Tensor | None) -> None:
        if not isinstance(k, torch.Tensor) or not k.is_floating_point():
            raise TypeError(f"k must be a floating-point tensor [B, {self.n_heads}, T, {self.head_dim}]")
        if k.dim() != 4 or k.shape[1] != self.n_heads or k.shape[3] != self.head_dim:
            raise ValueError(f"k has shape {list(k.shape)}, expected [B, {self.n_heads}, T, {self.head_dim}]")
        check_batch("k", k)
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (k.shape[0], k.shape[2])):
            raise ValueError(
                f"mask must be a bool tensor [{k.shape[0]}, {k.shape[2]}], got {mask.dtype} {list(mask.shape)}"
            )

    def nearest_codes(self, k: torch.Tensor) -> torch.Tensor:
        """``[B, H, T]`` index of the nearest code by squared L2 distance, computed in float32.

        ``argmin_s |k - c_s|^2 = argmin_s (|c_s|^2 - 2 k.c_s)``: on a CPU by the native kernel
        (``ops/vq/nearest.py``), else evaluated over as many positions at a time as hold
        ``_DISTANCE_ENTRIES`` distances (``B x H x positions x S``).
        """
        keys = k.detach().float()
        codebook, code_norms = self.codebook.float(), self._code_norms()
        if native_nearest.applies(keys):  # CPUs: one C++ call (ops/vq/nearest.py)
            return native_nearest.nearest_codes(keys, codebook, code_norms)
        B, H, T, D = keys.shape
        if H == 1:  # the keys as rows [B T, Dk] (a view of a projection's slice), chunked as rows
            rows = keys.reshape(B * T, D)
            chunk = max(1, _DISTANCE_ENTRIES // self.codebook_size)
            codes = [_nearest_rows(piece, codebook[0], code_norms[0]) for piece in rows.split(chunk)]
            return (codes[0] if len(codes) == 1 else torch.cat(codes)).view(B, 1, T)
        chunk = max(1, _DISTANCE_ENTRIES // (B * H * self.codebook_size))
        if T <= chunk:
            return _nearest(keys, codebook, code_norms)
        return torch.cat([_nearest(piece, codebook, code_norms) for piece in keys.split(chunk, dim=2)], dim=2)

    def _code_norms(self) -> torch.Tensor:
        """``|c_s|^2`` per head, ``[H, S]``, recomputed only when the codebook changes (its
        storage or version), so decoding one token does not pay for all S norms each step."""
        if torch.compiler.is_compiling():  # storage and version are not traceable; the graph recomputes
            return self.codebook.float().pow(2).sum(-1)
        version = tensor_version(self.codebook)
        if version is None:  # an inference tensor: a write to it could not be seen
            return self.codebook.float().pow(2).sum(-1)
        key = (self.codebook.data_ptr(), version)
        if getattr(self, "_norms_key", None) != key:
            self._norms, self._norms_key = self.codebook.float().pow(2).sum(-1), key
        return self._norms

    def train(self, mode: bool = True) -> "VectorQuantizer":
        """``nn.Module.train``; also forgets the cached code norms (a codebook written through
        ``.data`` bumps no version counter, so it is seen at the next mode switch)."""
        self.__dict__.pop("_norms_key", None)
        return super().train(mode)

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """``codebook[h, codes[b, h, t]]`` -> ``[B, H, T, Dk]``: rows of the codebook as one
        ``[H S, Dk]`` matrix, selected (a gather along Dk would read one entry at a time)."""
        B, H, T = codes.shape
        if H > 1:
            codes = codes + torch.arange(0, H * self.codebook_size, self.codebook_size, device=codes.device)[:, None]
        rows = self.codebook.reshape(H * self.codebook_size, self.head_dim)
        return rows.index_select(0, codes.reshape(-1)).view(B, H, T, self.head_dim)

    def forward(
        self, k: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quantize keys ``k [B, H, T, Dk]`` (``mask [B, T]``: True for real tokens).

        Returns ``(k_hat, codes [B, H, T], commit_loss)``; ``k_hat`` equals the chosen codes
        exactly (in k's dtype) with the straight-through gradient to k. In training mode,
        outside a backward pass, the assignments go to the codebook's pending statistics
        (and the first such forward runs the k-means initialisation if it is pending).
        """
        self._check(k, mask)
        counted = self.training and not _inside_backward()
        if counted and self.initialization_pending():
            # k-means draws from a fork of the random state: the forward's other draws (dropout)
            # are then those of a forward without it, as activation checkpointing recomputes them
            with torch.random.fork_rng(devices=[k.device] if k.device.type == "cuda" else []):
                self.initialize(k, mask)
        one_call = (mask is None and not torch.is_grad_enabled() and k.dtype == torch.float32
                    and self.codebook.dtype == torch.float32 and native_nearest.applies(k))
        if one_call:  # CPUs without gradients: codes, rows and the squared error by one native call
            codes, chosen, total = native_nearest.quantize(k, self.codebook, self._code_norms())
        else:
            codes = self.nearest_codes(k)
            chosen = self.lookup(codes).to(k.dtype)
        k_hat = chosen + (k - k.detach()) if k.requires_grad else chosen
        wide = compute_dtype(k.dtype)  # float32, float64 for float64 keys
        if mask is None and not torch.is_grad_enabled():  # a sum over every entry, in one reduction
            if not one_call:
                total = torch.linalg.vector_norm(k.to(wide) - chosen.to(wide)).square()
            commit = total / (k.shape[0] * k.shape[2] * (1 if self.commitment_reduction == "paper" else self.n_heads))
        else:
            squared = (k.to(wide) - chosen.to(wide)).pow(2).sum(-1)  # [B, H, T]
            if mask is not None:
                squared = squared * mask.unsqueeze(1).to(wide)  # [B, 1, T] weights
            if self.commitment_reduction == "paper":  # summed over heads, over all B T positions
                commit = squared.sum() / (k.shape[0] * k.shape[2])
            elif mask is None:
                commit = squared.mean()
            else:
                commit = squared.sum() / (mask.sum() * self.n_heads).clamp_min(1.0)
        if counted:
            self.accumulate(k, codes, mask)
        return k_hat, codes, self.commitment_weight * commit

    # -- logging -------------------------------------------------------------------------

    @torch.no_grad()
    def usage(self) -> dict[str, torch.Tensor]:
        """Codebook use per head from the EMA counts: ``perplexity`` = exp(entropy of the
        code distribution) (S when all codes are used equally, 1 when one code takes all)
        and ``dead_codes`` = codes with EMA count strictly below ``max(dead_code_threshold, 1e-3)``."""
        probs = self.ema_counts / self.ema_counts.sum(-1, keepdim=True)
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        threshold = max(self.dead_code_threshold, 1e-3)
        return {"perplexity": torch.exp(entropy), "dead_codes": (self.ema_counts < threshold).sum(-1)}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, commitment_weight={self.commitment_weight}"


# Distances the nearest-code search holds at once (4 MiB of float32): big enough that a
# chunk's matmul is not dominated by per-call costs, small enough for the cache.
_DISTANCE_ENTRIES = 1 << 20


def _nearest(keys: torch.Tensor, codebook: torch.Tensor, code_norms: torch.Tensor) -> torch.Tensor:
    """``argmin_s (|c_s|^2 - 2 k.c_s)``: keys ``[B, H, t, Dk]``, codebook ``[H, S, Dk]``,
    code_norms ``[H, S]`` -> ``[B, H, t]`` (the codebook is read in place, never copied per batch)."""
    scores = codebook_scores(keys, codebook)
    return scores.mul_(-2.0).add_(code_norms[None, :, None, :]).argmin(-1)


def _nearest_rows(rows: torch.Tensor, codebook: torch.Tensor, code_norms: torch.Tensor) -> torch.Tensor:
    """``_nearest`` for one head: rows ``[n, Dk]``, codebook ``[S, Dk]``, code_norms ``[S]`` -> ``[n]``,
    the distances in one product (``|c|^2 - 2 k.c`` as the decode step computes them)."""
    return torch.addmm(code_norms, rows, codebook.t(), alpha=-2.0).argmin(-1)
