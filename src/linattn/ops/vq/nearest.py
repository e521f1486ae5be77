"""Keys and codes on CPUs by the native kernels (``_native/vq_codes.cpp``, built by
``native.py``): the nearest code of every key (``VectorQuantizer.nearest_codes``' search as one
C++ call, a matrix product per chunk of keys and one pass over each key's distances: the torch
form spends more on ``argmin`` and the distances' elementwise passes than on the product), and
whether keys are the codebook's rows at their codes (``vq_attention``'s check of ``k_hat``, one
pass without the gathered copy the torch check makes).

The search runs for CPU float32 keys (the quantizer searches in float32) outside
``torch.compile`` and ``torch.export``, the key check for float32 and float64 ones, after a self-check per process
(``_run_check``: codes equal to the torch form's on random keys, a NaN key and tied codes
included); a failure warns once and the torch form runs from then on. ``LINATTN_VQ_IMPL=torch``
skips it, ``=native`` makes its failure an error.
"""

from __future__ import annotations

import torch

from ..common import native
from .codebook import codebook_scores
from .selfcheck import forced_impl

_CHUNK = 256  # keys per product in the kernel (kChunk): the error sums come one per chunk


def reset() -> None:
    """Forget the self-check's verdict and warning (tests)."""
    _trust.reset()


def applies(keys: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether the native search (or, with ``dtypes`` float32 and float64, the key check) runs
    for ``keys`` (module docstring)."""
    if keys.device.type != "cpu" or keys.dtype not in dtypes or native.tracing():
        return False
    forced = forced_impl()
    if forced == "torch":
        return False
    return _trust.trusted(None, forced == "native", "the native VQ nearest-code search failed",
                          "Unset LINATTN_VQ_IMPL or set it to torch",
                          "the quantizers search with torch from now on (LINATTN_VQ_IMPL=torch chooses it without "
                          "trying the kernel)")


def nearest_codes(keys: torch.Tensor, codebook: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """``argmin_s (|c_s|^2 - 2 k.c_s)`` ``[B, H, T]`` of float32 keys ``[B, H, T, D]``, codebook
    ``[H, S, D]`` and its squared norms ``[H, S]`` (the first minimum; a NaN distance wins)."""
    B, H, T, _ = keys.shape
    codes = torch.empty(B, H, T, dtype=torch.long)
    native.extension().vq_nearest_codes(keys.contiguous(), codebook.contiguous(), norms.contiguous(), codes, None,
                                        None)
    return codes


def quantize(keys: torch.Tensor, codebook: torch.Tensor, norms: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``nearest_codes``, the chosen codes' rows ``codebook[h, codes]`` ``[B, H, T, D]`` and the sum
    of the squared errors ``sum |k - c_z|^2`` over every key (float32, summed in float64), in
    one call; float32 keys and codebook."""
    B, H, T, D = keys.shape
    codes = torch.empty(B, H, T, dtype=torch.long)
    chosen = torch.empty(B, H, T, D, dtype=torch.float32)
    errors = torch.empty(B * H * -(-T // _CHUNK), dtype=torch.float64)
    native.extension().vq_nearest_codes(keys.contiguous(), codebook.contiguous(), norms.contiguous(), codes, chosen,
                                        errors)
    return codes, chosen, errors.sum().float()


def keys_are_codes(k_hat: torch.Tensor, codes: torch.Tensor, codebook: torch.Tensor) -> bool | None:
    """Whether ``k_hat [B, H, T, D] == codebook[h, codes]`` everywhere (``torch.equal``'s
    comparison; codes already in ``[0, S)``), by the native kernel; None where it does not run."""
    if not applies(k_hat, (torch.float32, torch.float64)) or codebook.dtype != k_hat.dtype:
        return None
    return native.extension().vq_keys_are_codes(k_hat.detach().contiguous(), codes.contiguous(),
                                                codebook.detach().contiguous())


def verdict() -> str | None:
    """None when the kernel builds and agrees with the torch form, else what failed (checked once)."""
    return _trust.verdict(None)


def _torch_codes(keys: torch.Tensor, codebook: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    return codebook_scores(keys, codebook).mul_(-2.0).add_(norms[None, :, None, :]).argmin(-1)


def _run_check() -> str | None:
    """Codes of random keys (300 per row: two chunks; one key NaN; two equal codes, so ties)
    by the kernel and by the torch form: None when equal, else the first difference."""
    g = torch.Generator().manual_seed(0)
    codebook = torch.randn(3, 16, 8, generator=g)
    codebook[1, 9] = codebook[1, 3]
    keys = torch.randn(2, 3, 300, 8, generator=g)
    keys[1, 2, 7] = float("nan")
    keys[0, 1, 5] = codebook[1, 3]
    norms = codebook.pow(2).sum(-1)
    got, want = nearest_codes(keys, codebook, norms), _torch_codes(keys, codebook, norms)
    if not torch.equal(got, want):
        index = (got != want).nonzero()[0].tolist()
        return f"key {index}: code {int(got[tuple(index)])}, the torch form's {int(want[tuple(index)])}"
    return None


_trust = native.Trust(lambda key: _run_check())
