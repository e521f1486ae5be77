"""Finite scalar quantization of keys (Mentzer et al. 2023, "Finite Scalar Quantization:
VQ-VAE Made Simple"): a codebook that is not learned but implied by a grid of levels.

Per head, a key ``k [Dk]`` is projected to ``d = len(levels)`` numbers, each bounded and
rounded to its own set of levels, and projected back:

    z = W_in k                                          [d]
    b_i = tanh(z_i + s_i) h_i - o_i                     h_i = (1 + 1e-3)(L_i - 1) / 2, o_i = 1/2 if L_i is even else 0,
                                                        s_i = atanh(o_i / h_i)  (so b_i(0) = 0)
    r_i = round(b_i) in {-floor(L_i / 2), .., ceil(L_i / 2) - 1}
    z^_i = r_i / floor(L_i / 2)                         in [-1, 1]
    k^ = W_out z^                                       [Dk]

The rounding passes the gradient straight through (``b + (round(b) - b).detach()``). The
code of a key is its grid point in mixed radix, ``sum_i (r_i + floor(L_i / 2)) prod_{j<i} L_j``,
and the implicit codebook is ``W_out`` applied to all ``S = prod L_i`` grid points, so
``vq_attention`` runs unchanged on (k^, codes, codebook). ``k^`` equals its codebook row
exactly in value. No EMA, no commitment loss, no dead codes: every grid point stays reachable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .._checks import check_batch, check_positive_int
from ..ops.common.versions import tensor_version


def _same_values(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether ``new`` holds exactly ``old``'s values (shape, dtype, device and every element)."""
    return old.shape == new.shape and old.dtype == new.dtype and old.device == new.device and torch.equal(old, new)


def check_levels(levels) -> tuple[int, ...]:
    levels = tuple(levels) if isinstance(levels, (list, tuple)) else levels
    if (not isinstance(levels, tuple) or not levels
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in levels)):
        raise ValueError(f"levels must be a non-empty sequence of integers >= 2 (e.g. (8, 5, 5, 5)), got {levels!r}")
    return levels


class FSQuantizer(nn.Module):
    """FSQ with learned in/out projections per head: the ``VectorQuantizer`` interface
    (``forward(k) -> (k_hat, codes, loss)``, ``codebook [H, S, Dk]``) without its EMA state.

    Args:
        n_heads: H, key heads, each with its own projections.
        head_dim: Dk.
        levels: levels per bounded dimension; ``S = prod(levels)`` codes.
        init_scale: the typical size of one key coordinate (``d_k^-1/4`` in the GAU), which
            sets the initial projections so that ``z`` is O(1) and ``k^`` as large as k.
    """

    def __init__(
        self, n_heads: int, head_dim: int, levels: Sequence[int] = (8, 5, 5, 5), init_scale: float = 1.0
    ):
        super().__init__()
        self.n_heads, self.head_dim = check_positive_int("n_heads", n_heads), check_positive_int("head_dim", head_dim)
        self.levels = check_levels(levels)
        d = len(self.levels)
        self.codebook_size = math.prod(self.levels)
        self.init_scale = init_scale
        self.w_in = nn.Parameter(torch.empty(n_heads, d, head_dim))
        self.w_out = nn.Parameter(torch.empty(n_heads, head_dim, d))
        self.register_buffer("_radix", torch.empty(d, dtype=torch.int64), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The projections drawn as the class docstring's ``init_scale`` says (``z`` O(1), ``k^``
        as large as k), and the code radix."""
        d = len(self.levels)
        like = dict(dtype=self.w_in.dtype, device=self.w_in.device)
        self.w_in.copy_(torch.randn(self.w_in.shape, **like) / (self.init_scale * math.sqrt(self.head_dim)))
        self.w_out.copy_(torch.randn(self.w_out.shape, **like) * (self.init_scale / math.sqrt(d)))
        self._reset_buffers()

    @torch.no_grad()
    def _reset_buffers(self) -> None:
        """The non-persistent code radix (the mixed-radix place value of each grid dimension)."""
        self._radix.copy_(torch.cumprod(torch.tensor((1, *self.levels[:-1])), 0))

    def _constants(self, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        """``(h, o, s, floor(L / 2))`` per dimension in ``dtype`` (derived in float64, kept per dtype)."""
        key = (dtype, device)
        cache = self.__dict__.setdefault("_constants_cache", {})
        if key not in cache:
            L = torch.tensor(self.levels, dtype=torch.float64)
            half = (1 + 1e-3) * (L - 1) / 2  # a margin as in the paper: o/h < 1 even for L = 2
            offset = torch.where(L % 2 == 0, 0.5, 0.0).double()
            values = (half, offset, torch.atanh(offset / half), torch.floor(L / 2))
            cache[key] = tuple(t.to(dtype=dtype, device=device) for t in values)
        return cache[key]

    def grid(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Every grid point, normalised, in code order: ``[S, d]`` (``z^`` of code s in row s)."""
        dtype = dtype or self.w_out.dtype
        codes = torch.arange(self.codebook_size, device=self._radix.device)
        digits = (codes[:, None] // self._radix) % torch.tensor(self.levels, device=codes.device)
        radius = self._constants(dtype, codes.device)[3]
        return (digits - radius.long()) / radius

    @property
    def codebook(self) -> torch.Tensor:
        """``[H, S, Dk]``: ``W_out`` on every grid point (differentiable in ``W_out``). With
        gradients off it is computed once until ``W_out`` changes, so decoding reads one tensor.
        That tensor is never an inference tensor (made outside ``torch.inference_mode``, as
        serving engines run models): it outlives the call, and decoding reads its version."""
        if torch.is_grad_enabled():
            return self._codebook()
        version = tensor_version(self.w_out)
        if version is None:  # an inference tensor: a write to it could not be seen
            with torch.inference_mode(False):
                return self._codebook()
        key = (self.w_out.data_ptr(), version, self.w_out.dtype)
        cached = self.__dict__.get("_cached_codebook")
        if cached is None or cached[0] != key:
            with torch.inference_mode(False):
                fresh = self._codebook()
            if cached is not None and _same_values(cached[1], fresh):
                fresh = cached[1]  # the same tensor: states whose keys are its rows stay so
            self.__dict__["_cached_codebook"] = cached = (key, fresh)
        return cached[1]

    def _codebook(self) -> torch.Tensor:
        return self.grid() @ self.w_out.transpose(-1, -2)  # [S, d] @ [H, d, Dk] -> [H, S, Dk]

    def train(self, mode: bool = True) -> "FSQuantizer":
        """``nn.Module.train``; also has the cached codebook computed again at its next read
        (``W_out`` written through ``.data`` bumps no version), kept where its values are unchanged."""
        cached = self.__dict__.get("_cached_codebook")
        if cached is not None:
            self.__dict__["_cached_codebook"] = (None, cached[1])
        return super().train(mode)

    def forward(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quantize ``k [B, H, T, Dk]`` -> ``(k_hat [B, H, T, Dk], codes [B, H, T] int64, zero loss)``."""
        if k.dim() != 4 or k.shape[1] != self.n_heads or k.shape[3] != self.head_dim:
            raise ValueError(f"k has shape {list(k.shape)}, expected [B, {self.n_heads}, T, {self.head_dim}]")
        check_batch("k", k)
        half, offset, shift, radius = self._constants(k.dtype, k.device)
        z = torch.einsum("bhtk,hdk->bhtd", k, self.w_in.to(k.dtype))
        bounded = torch.tanh(z + shift) * half - offset
        rounded = torch.round(bounded)
        codes = ((rounded.detach().long() + radius.long()) * self._radix).sum(-1)
        normalised = (bounded + (rounded - bounded).detach()) / radius
        projected = torch.einsum("bhtd,hkd->bhtk", normalised, self.w_out.to(k.dtype))
        codebook = self.codebook.detach().to(k.dtype)
        chosen = torch.gather(codebook.unsqueeze(0).expand(k.shape[0], -1, -1, -1), 2,
                              codes.unsqueeze(-1).expand(*codes.shape, self.head_dim))
        k_hat = chosen + (projected - projected.detach()) if projected.requires_grad else chosen
        return k_hat, codes, k.new_zeros((), dtype=torch.float32)

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, head_dim={self.head_dim}, levels={self.levels}, "
                f"codebook_size={self.codebook_size}")
