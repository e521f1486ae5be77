"""Codebook: the EMA-learned codes of a vector quantizer, with their statistics.

A ``Codebook`` holds, per head h and code s, the codes ``codebook [H, S, Dk]``, the EMA
assignment counts ``ema_counts [H, S]`` and key sums ``ema_sums [H, S, Dk]`` (all float32
buffers, whatever the module is cast to), and the statistics gathered since the last
update. ``accumulate`` adds the counts ``n [H, S]`` and key sums ``s [H, S, Dk]`` of a
batch's assignments; ``update()`` applies

    counts <- g counts + (1 - g) n,   sums <- g sums + (1 - g) s,   c = sums / max(counts, 0.01)

with n and s summed over ranks first, then restarts dead codes. Several forwards before one
update (micro-batches of gradient accumulation) add up: the update sees the statistics, and
the restart candidates, of all of them. Codes can be initialised by k-means (``kmeans``) on
a first batch of keys.

Every collective goes through one hook, ``sync(op, tensors)``, which works in place on a
list of tensors: ``op="sum"`` all-reduces them (``update()``: the counts and sums), and
``op="broadcast"`` replaces them with rank 0's values (``_replace_codes``: which codes
change and their new values, for a k-means initialisation or a restart, drawn by each rank
from its own keys). The default, ``distributed_sync``, uses the default torch.distributed process group and does
nothing without one.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_int, check_non_negative_number, check_positive_number, check_tensor, is_number

SyncHook = Callable[[str, Sequence[torch.Tensor]], None]

_SYNC_OPS = ("sum", "broadcast")


def distributed_sync(op: str, tensors: Sequence[torch.Tensor]) -> None:
    """In place over the default process group: ``"sum"`` all-reduces each tensor,
    ``"broadcast"`` copies rank 0's values to every rank. Without torch.distributed
    initialised this does nothing (one process is the whole world)."""
    if op not in _SYNC_OPS:
        raise ValueError(f"sync op must be one of {_SYNC_OPS}, got {op!r}")
    if not (dist.is_available() and dist.is_initialized()):
        return
    for tensor in tensors:
        if op == "sum":
            dist.all_reduce(tensor)
        else:
            dist.broadcast(tensor, src=0)


@torch.no_grad()
def kmeans(
    keys: torch.Tensor, n_codes: int, iters: int = 10, generator: torch.Generator | None = None, *,
    seeding: str = "random", return_assignment: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means per head: ``keys [H, N, D]`` -> centers ``[H, n_codes, D]``.

    Each iteration assigns every key to its nearest center (Euclidean) and moves each center
    to the mean of its keys; a center without keys stays.

    Args:
        keys: the points, ``[H, N, D]`` (one set per head, N > 0).
        n_codes: the number of centers per head.
        iters: Lloyd iterations after seeding.
        generator: the random generator of the seeding (None: torch's global one).
        seeding: ``"random"``: ``n_codes`` distinct keys drawn at random (with repetition
            when ``N < n_codes``), the same draw for every head; ``"kmeans++"`` (Arthur &
            Vassilvitskii 2007), per head: the first center a random key, each next one a key
            drawn with probability proportional to its squared distance to the nearest center
            so far (uniformly once every key is a center).
        return_assignment: also return the final assignment ``[H, N]`` (the nearest center of
            each key).

    Returns:
        The centers ``[H, n_codes, D]``, or ``(centers, assignment)``.
    """
    if keys.dim() != 3 or keys.shape[1] == 0:
        raise ValueError(f"keys must have shape [H, N, D] with N > 0, got {list(keys.shape)}")
    if seeding not in ("random", "kmeans++"):
        raise ValueError(f"seeding must be 'random' or 'kmeans++', got {seeding!r}")
    H, n, _ = keys.shape
    if seeding == "kmeans++":
        centers = torch.stack([keys[h, _plus_plus(keys[h], n_codes, generator)] for h in range(H)])
    elif n < n_codes:
        centers = keys[:, torch.randint(n, (n_codes,), device=keys.device, generator=generator)].clone()
    else:
        centers = keys[:, torch.randperm(n, device=keys.device, generator=generator)[:n_codes]].clone()
    for _ in range(iters):
        assign = torch.cdist(keys, centers).argmin(-1)  # [H, N]
        counts = keys.new_zeros(H, n_codes).scatter_add_(1, assign, keys.new_ones(assign.shape))
        sums = torch.zeros_like(centers).scatter_add_(1, assign.unsqueeze(-1).expand_as(keys), keys)
        centers = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp_min(1.0).unsqueeze(-1), centers)
    if return_assignment:
        return centers, torch.cdist(keys, centers).argmin(-1)
    return centers


@torch.no_grad()
def kmeans_codes(keys: torch.Tensor, n_codes: int, iters: int, generator: torch.Generator | None = None, *,
                 tokens_per_step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A codebook fitted to ``keys [H, N, D]``: the ``kmeans`` centers (k-means++ seeds, ``iters``
    Lloyd iterations) ``[H, n_codes, D]`` and the EMA counts to seed it with (``Codebook.set_codes``)
    ``[H, n_codes]``: how many keys chose each center, scaled to ``tokens_per_step`` keys in all (one
    training step's worth, so the first updates move the codes as much as later ones; None: the
    counts as they are), a center no key chose at 0.01 (``update``'s floor)."""
    centers, assignment = kmeans(keys, n_codes, iters, generator, seeding="kmeans++", return_assignment=True)
    counts = torch.zeros(keys.shape[0], n_codes, dtype=torch.float32, device=keys.device)
    counts.scatter_add_(1, assignment, torch.ones(assignment.shape, dtype=torch.float32, device=keys.device))
    if tokens_per_step is not None:
        counts = counts * (tokens_per_step / keys.shape[1])
    return centers, torch.where(counts > 0, counts, torch.full_like(counts, 0.01))


def _plus_plus(keys: torch.Tensor, n_codes: int, generator: torch.Generator | None) -> torch.Tensor:
    """k-means++ seeds of ``keys [N, D]``: ``n_codes`` indices."""
    n = keys.shape[0]
    picks = [int(torch.randint(n, (1,), device=keys.device, generator=generator))]
    nearest = (keys - keys[picks[0]]).pow(2).sum(-1)
    for _ in range(1, n_codes):
        total = nearest.sum()
        if total > 0:
            pick = int(torch.multinomial(nearest / total, 1, generator=generator))
        else:  # every key already is a center
            pick = int(torch.randint(n, (1,), device=keys.device, generator=generator))
        picks.append(pick)
        nearest = torch.minimum(nearest, (keys - keys[pick]).pow(2).sum(-1))
    return torch.tensor(picks, device=keys.device)


def _non_finite_message(where: torch.Tensor) -> str:
    """What ``update()`` says when the statistics at ``where [H, S]`` are not finite."""
    rows = where.nonzero().tolist()
    named = ", ".join(f"(head {h}, code {s})" for h, s in rows[:8])
    more = f" and {len(rows) - 8} more codes" if len(rows) > 8 else ""
    return (f"the EMA statistics of {named}{more} are not finite (a NaN or infinite key was assigned since the last "
            "update); nothing was updated and these statistics are dropped, so the codebook stays finite. Pass "
            "apply (a bool tensor, False for a step with a non-finite loss) to drop such steps without this error")


class Codebook(nn.Module):
    """Per-head codes ``[H, S, Dk]`` learned by EMA of the keys assigned to them.

    Args:
        n_heads: H.
        head_dim: Dk.
        codebook_size: S.
        ema_decay: g of the EMA update, in [0, 1).
        kmeans_init: start uninitialised (``initialized`` False) so that the owner sets the
            codes by ``initialize(keys)``; otherwise start from the random codes.
        kmeans_iters: Lloyd iterations of that initialisation.
        dead_code_threshold: in ``update()``, codes whose EMA count is strictly below this
            are restarted on random keys gathered since the previous update (the latest
            batches with real tokens; 0 disables).
        init_scale: standard deviation of the random initial codes.
        sync: the collective hook ``sync(op, tensors)`` (module docstring); default
            ``distributed_sync``.

    Buffers (state dict): ``codebook``, ``ema_counts`` (initially 1), ``ema_sums``
    (initially the codes) and ``initialized``.
    """

    _FLOAT32_BUFFERS = ("codebook", "ema_counts", "ema_sums", "_pending_counts", "_pending_sums")

    def __init__(
        self,
        n_heads: int,
        head_dim: int,
        codebook_size: int,
        *,
        ema_decay: float = 0.99,
        kmeans_init: bool = False,
        kmeans_iters: int = 10,
        dead_code_threshold: float = 0.0,
        init_scale: float = 1.0,
        sync: SyncHook | None = None,
    ):
        super().__init__()
        for name, value in (("n_heads", n_heads), ("head_dim", head_dim), ("codebook_size", codebook_size),
                            ("kmeans_iters", kmeans_iters)):
            check_int(name, value)
        if not is_number(ema_decay) or not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay!r}")
        check_non_negative_number("dead_code_threshold", dead_code_threshold)
        check_positive_number("init_scale", init_scale)
        self.n_heads, self.head_dim, self.codebook_size = n_heads, head_dim, codebook_size
        self.ema_decay, self.dead_code_threshold = ema_decay, dead_code_threshold
        self.kmeans_init, self.kmeans_iters = kmeans_init, kmeans_iters
        self.sync: SyncHook = distributed_sync if sync is None else sync
        self.init_scale = init_scale
        self.register_buffer("codebook", torch.empty(n_heads, codebook_size, head_dim))
        self.register_buffer("ema_counts", torch.empty(n_heads, codebook_size))
        self.register_buffer("ema_sums", torch.empty(n_heads, codebook_size, head_dim))
        self.register_buffer("initialized", torch.empty((), dtype=torch.bool))
        self.register_buffer("_pending_counts", torch.empty(n_heads, codebook_size), persistent=False)
        self.register_buffer("_pending_sums", torch.empty(n_heads, codebook_size, head_dim), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every buffer as a new codebook has it: random codes ``N(0, init_scale^2)``, ``ema_counts``
        1, ``ema_sums`` the codes, ``initialized`` unless ``kmeans_init``, nothing pending (the
        constructor's initialisation; also a codebook's on the meta device, materialised by
        ``to_empty()``, gets its values here)."""
        initial = torch.randn(self.codebook.shape, dtype=self.codebook.dtype, device=self.codebook.device)
        initial = initial * self.init_scale
        self.codebook.copy_(initial)
        self.ema_sums.copy_(initial)
        self.ema_counts.fill_(1.0)
        self.initialized.fill_(not self.kmeans_init)
        self._reset_buffers()
        self._init_pending = self.kmeans_init  # not initialized, as last read (None: read it next time)

    @torch.no_grad()
    def _reset_buffers(self) -> None:
        """Empty the non-persistent statistics pending the next update, for codebooks
        materialised without them (Hugging Face ``from_pretrained``)."""
        self._pending_counts.zero_()
        self._pending_sums.zero_()
        self._recent_keys: list[torch.Tensor] = []  # [H, N_i, Dk] each, restart candidates
        self._recent_complete = True  # the next batch with real tokens starts a new candidate list
        self._init_pending: bool | None = None

    @property
    def pending_counts(self) -> torch.Tensor:
        """``[H, S]`` assignments counted on this process since the last ``update()`` (read only)."""
        return self._pending_counts.detach()

    def _load_from_state_dict(self, *args, **kwargs):
        """``nn.Module``'s loading, then the loaded ``initialized`` flag is read (on the meta
        device: at its first use)."""
        super()._load_from_state_dict(*args, **kwargs)
        self._init_pending = None if self.initialized.is_meta else self._read_init_pending()

    def initialization_pending(self) -> bool:
        """Whether the k-means initialisation has still to run (``initialized`` is False):
        the next training forward runs it.

        The buffer is read once (a host read) and remembered until ``initialize`` or
        ``load_state_dict`` writes it, so a forward pass does not wait for the device and
        ``torch.compile`` sees a Python bool (a graph for each value). A value written into
        the buffer by hand is seen after ``load_state_dict`` or ``_reset_buffers``.
        """
        if self._init_pending is None:
            self._init_pending = self._read_init_pending()
        return self._init_pending

    @torch.compiler.disable
    def _read_init_pending(self) -> bool:
        return not bool(self.initialized)

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.double()``, ``.half()`` move the codes and statistics but keep them float32."""
        super()._apply(fn, recurse)
        for name in self._FLOAT32_BUFFERS:
            buffer = self._buffers[name]
            if buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        return self

    @staticmethod
    def _unmasked(k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``k [B, H, T, Dk]`` -> float32 keys ``[H, N, Dk]`` of the N real tokens."""
        keys = k.detach().float().transpose(0, 1)  # [H, B, T, Dk]
        if mask is not None:
            keys = keys[:, mask]
        return keys.reshape(k.shape[1], -1, k.shape[3])

    # -- statistics and the EMA update ---------------------------------------------------

    @torch.no_grad()
    def accumulate(self, k: torch.Tensor, codes: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Add the assignments ``codes [B, H, T]`` of keys ``k [B, H, T, Dk]`` to the pending
        statistics: ``n[h, s] += #{j : codes_hj = s}``, ``s[h, s] += sum_{j : codes_hj = s} k_hj``,
        over the tokens with ``mask [B, T]`` True (all without a mask)."""
        keys = self._unmasked(k, mask)  # [H, N, Dk]
        flat = codes.transpose(0, 1)
        flat = (flat[:, mask] if mask is not None else flat).reshape(self.n_heads, -1)  # [H, N]
        self._pending_counts.scatter_add_(1, flat, keys.new_ones(flat.shape))
        self._pending_sums.scatter_add_(1, flat.unsqueeze(-1).expand_as(keys), keys)
        if self.dead_code_threshold > 0 and keys.shape[1] > 0:
            if self._recent_complete:
                self._recent_keys, self._recent_complete = [], False
            self._recent_keys.append(keys)

    @torch.no_grad()
    def update(self, apply: torch.Tensor | None = None) -> None:
        """Apply the EMA update with the statistics gathered since the last call, summed over
        ranks by ``sync("sum", ...)``, then restart dead codes. Without statistics on any rank
        this changes nothing, and neither does ``apply``, a bool tensor, when False (the
        statistics are dropped: the trainer's guard against a non-finite step).

        Statistics that are not finite (a NaN or infinite key was assigned since the last
        update) never reach the codebook, which would stay non-finite for good: with
        ``apply`` they are dropped like a refused step, and no value is read on the host (no
        device sync: the updates are selected with ``torch.where``); without it (a loop with
        no guard) the update reads that one flag on the host and, when it is not finite,
        drops them and raises ValueError naming the heads and codes."""
        counts, sums = self._pending_counts.clone(), self._pending_sums.clone()
        self._pending_counts.zero_()
        self._pending_sums.zero_()
        self._recent_complete = True
        self.sync("sum", [counts, sums])
        finite = torch.isfinite(sums).all(-1) & torch.isfinite(counts)  # [H, S]
        if apply is None and not bool(finite.all()):
            raise ValueError(_non_finite_message(~finite))
        seen = (counts.sum() > 0) & finite.all()
        if apply is not None:
            seen = seen & apply.to(seen.device)
        g = self.ema_decay
        self.ema_counts.copy_(torch.where(seen, torch.add(self.ema_counts * g, counts, alpha=1.0 - g), self.ema_counts))
        self.ema_sums.copy_(torch.where(seen, torch.add(self.ema_sums * g, sums, alpha=1.0 - g), self.ema_sums))
        self.codebook.copy_(torch.where(seen, self.ema_sums / self.ema_counts.clamp_min(0.01).unsqueeze(-1),
                                        self.codebook))
        if self.dead_code_threshold > 0:
            self._restart_dead_codes(seen)

    @torch.no_grad()
    def _restart_dead_codes(self, updated: torch.Tensor) -> None:
        """If ``updated`` (a bool tensor), move every code with ``ema_counts <
        dead_code_threshold`` onto a random recent key (rank 0's draw), restarting its
        statistics there (count 1, sum = key). The candidates are the real tokens' keys of the
        forwards since the previous update, in order (those of the last forwards that had any,
        if none since). One key index is drawn per code, dead or not, so nothing depends on
        how many codes are dead and no value is read on the host."""
        dead = (self.ema_counts < self.dead_code_threshold) & updated  # [H, S], equal on all ranks
        values = self.codebook
        if self._recent_keys:
            recent = torch.cat(self._recent_keys, dim=1) if len(self._recent_keys) > 1 else self._recent_keys[0]
            pick = torch.randint(recent.shape[1], dead.shape, device=recent.device)  # [H, S]
            keys = recent.gather(1, pick.unsqueeze(-1).expand(-1, -1, recent.shape[2]))
            values = torch.where(dead.unsqueeze(-1), keys, self.codebook)
        else:
            dead = torch.zeros_like(dead)
        self._replace_codes(dead, values.clone())

    @torch.no_grad()
    def _replace_codes(self, where: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Set the codes ``where [H, S]`` to ``values [H, S, Dk]`` and restart their statistics
        there: ``codebook = ema_sums = values``, ``ema_counts = 1``. Both come from rank 0
        (``sync("broadcast", ...)``); returns the ``where`` that was applied."""
        chosen = where.float()
        self.sync("broadcast", [values, chosen])
        where = chosen > 0
        self.codebook.copy_(torch.where(where.unsqueeze(-1), values, self.codebook))
        self.ema_sums.copy_(torch.where(where.unsqueeze(-1), values, self.ema_sums))
        self.ema_counts.masked_fill_(where, 1.0)
        return where

    # -- k-means initialisation ----------------------------------------------------------

    @torch.compiler.disable  # once per codebook, data-dependent throughout: it runs eagerly
    @torch.no_grad()
    def initialize(self, k: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Set every code by ``kmeans`` on the real tokens of ``k [B, H, T, Dk]`` (rank 0's
        centers on every rank) and mark the codebook initialized. Without real tokens (on
        rank 0) nothing changes and the codebook stays uninitialised."""
        keys = self._unmasked(k, mask)
        if not bool(torch.isfinite(keys).all()):
            raise ValueError("k holds non-finite values (NaN or inf) at real tokens; the k-means initialisation of "
                             "the codebook needs finite keys (it stays pending)")
        where = torch.full((self.n_heads, self.codebook_size), keys.shape[1] > 0, device=self.codebook.device)
        centers = kmeans(keys, self.codebook_size, self.kmeans_iters) if keys.shape[1] > 0 else self.codebook.clone()
        done = bool(self._replace_codes(where, centers).any())
        self.initialized.fill_(done)
        self._init_pending = not done

    @torch.no_grad()
    def set_codes(self, codes: torch.Tensor, counts: torch.Tensor) -> None:
        """Put fitted codes in place: ``codebook = codes [H, S, Dk]``, the EMA statistics as if
        ``counts [H, S]`` keys had chosen each code (``ema_counts = counts``, ``ema_sums =
        codes * counts``), and the codebook marked initialized (no k-means initialisation runs)."""
        codes = check_tensor("codes", codes, ndim=3, layout="[heads, codebook_size, head_dim]")
        counts = check_tensor("counts", counts, ndim=2, layout="[heads, codebook_size]")
        if tuple(codes.shape) != tuple(self.codebook.shape) or tuple(counts.shape) != tuple(self.ema_counts.shape):
            raise ValueError(f"codes {list(codes.shape)} and counts {list(counts.shape)} must be "
                             f"{list(self.codebook.shape)} and {list(self.ema_counts.shape)}")
        self.codebook.copy_(codes)
        self.ema_counts.copy_(counts)
        self.ema_sums.copy_(codes.to(self.ema_sums) * counts.to(self.ema_sums).unsqueeze(-1))
        self.initialized.fill_(True)
        self._init_pending = False

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads}, head_dim={self.head_dim}, codebook_size={self.codebook_size}, "
            f"ema_decay={self.ema_decay}"
        )
