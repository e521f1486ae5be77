"""The self-test of ``linattn doctor``: every op family's fast forms against its reference.

Each check runs one small call (B 2, H 4, Hkv 2 where the op takes grouped heads, T 13: not
a multiple of any block or chunk) of a fast form in the dtype under test and of the
reference form in float64, on the same device and the same inputs (rounded to that dtype
first), forward and backward, and compares the output and the gradient of every
floating-point input by its largest error relative to its largest value:

    max |fast - reference| <= rtol * max |reference|

``TOLERANCES``: float64 1e-9 (outputs and gradients; the forms agree to ~1e-15), float32
1e-3 and 1e-2, bfloat16 5e-2 and 1e-1 (a loose bound on rounding: a wrong form is off by
O(1)). The references are the ops' readable forms (``mode="parallel"``, the recurrence,
``impl="reference"``), or, for ops with one form only, the equation with a dense mask
written out here. On CUDA the VQ kernels' own self-check (``ops/vq/selfcheck.py``) runs too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .ops.delta import delta_rule
from .ops.kernel import linear_attention
from .ops.softmax import softmax_attention
from .ops.sparse import linformer_attention, local_attention, lsh_attention, strided_attention
from .ops.sparse.lsh import SELF_SCORE
from .ops.vq import selfcheck as vq_selfcheck
from .ops.vq import soft_vq_attention, vq_attention

F64 = torch.float64
TOLERANCES = {torch.float64: (1e-9, 1e-9), torch.float32: (1e-3, 1e-2), torch.bfloat16: (5e-2, 1e-1)}
B, H, HKV, T, D = 2, 4, 2, 13, 8
L, S = 4, 6  # VQ block length and codebook size


@dataclass
class Result:
    """One check: ``family`` (the op), ``form`` (what was compared), ``dtype``, the errors of the
    output and of the worst gradient (None when the check raised), the tolerances, ``ok``, and
    ``detail`` (what failed, empty when it passed)."""

    family: str
    form: str
    dtype: str
    out_error: float | None
    grad_error: float | None
    out_rtol: float
    grad_rtol: float
    ok: bool
    detail: str = ""


@dataclass
class Check:
    """``fast`` and ``reference`` map the same keyword tensors (built by ``inputs(generator)``)
    to an output; ``dtypes``: on CUDA, the dtypes the fast form is checked in (CPU: float64)."""

    family: str
    form: str
    inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]
    fast: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=g, dtype=F64)


def _qkv(g: torch.Generator, kv_heads: int = HKV) -> dict[str, torch.Tensor]:
    return {"q": _randn(g, B, H, T, D), "k": _randn(g, B, kv_heads, T, D), "v": _randn(g, B, kv_heads, T, D)}


def _masked(q, k, v, visible: torch.Tensor) -> torch.Tensor:
    """Exact attention with a keep-mask ``visible [T, T]`` (the reference of the sparse ops)."""
    return softmax_attention(q, k, v, bias=visible, impl="reference")


def _offsets() -> torch.Tensor:
    """``i - j`` for every query i and key j, ``[T, T]``."""
    positions = torch.arange(T)
    return positions[:, None] - positions[None, :]


def _on(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(like.device)


def _vq_inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"q": _randn(g, B, H, T, D), "v": _randn(g, B, HKV, T, D), "codebook": _randn(g, HKV, S, D),
            "codes": torch.randint(0, S, (B, HKV, T), generator=g),
            "bias": _randn(g, H, L + 1), "position_keys": _randn(g, H, L + 1, D, scale=0.5)}


def _vq(q, v, codebook, codes, bias, position_keys, **options) -> torch.Tensor:
    """``vq_attention`` on the keys ``codebook[codes]`` (gathered: the gradient reaches the codebook)."""
    k_hat = torch.gather(codebook.unsqueeze(0).expand(B, -1, -1, -1), 2, codes.unsqueeze(-1).expand(*codes.shape, D))
    return vq_attention(q, k_hat, v, codes, codebook, block_size=L, bias=bias, position_keys=position_keys,
                        grad_scope="none", **options)[0]


def _soft_vq_reference(q, k, v, codebook) -> torch.Tensor:
    """The soft Transformer-VQ written out quadratically (tau 0.5, blocks of L): with
    ``a_js = softmax_s(-|k_j - c_s|^2 / 2 tau)`` and soft keys ``k~_j = sum_s a_js c_s``, query i
    weighs key j <= i by ``exp(q_i.k~_j / sqrt(D))`` when j is in i's block or the previous one,
    else by ``sum_s a_js exp(q_i.c_s / sqrt(D))`` (the cache of soft counts and means)."""
    G = H // HKV
    distances = ((k.unsqueeze(-2) - codebook.unsqueeze(0).unsqueeze(2)) ** 2).sum(-1)  # [B, Hkv, T, S]
    weights = torch.softmax(-distances / (2 * 0.5), dim=-1)
    soft_keys = (weights @ codebook.unsqueeze(0)).repeat_interleave(G, 1)
    window = q @ soft_keys.transpose(-1, -2) * D ** -0.5  # [B, H, T, T]
    code_scores = q @ codebook.repeat_interleave(G, 0).transpose(-1, -2) * D ** -0.5  # [B, H, T, S]
    cache = torch.logsumexp(weights.log().repeat_interleave(G, 1).unsqueeze(2) + code_scores.unsqueeze(3), -1)
    blocks = torch.arange(T, device=q.device) // L
    near = (blocks[:, None] - blocks[None, :]) <= 1
    scores = torch.where(near, window, cache).masked_fill(_on(_offsets() < 0, q), float("-inf"))
    return torch.softmax(scores, -1) @ v.repeat_interleave(G, 1)


def _lsh_reference(qk, v) -> torch.Tensor:
    """One bucket holding every position: causal attention on the normalised keys, a
    token's own key scored ``SELF_SCORE``."""
    scores = qk @ F.normalize(qk, dim=-1).transpose(-1, -2) * D ** -0.5
    offsets = _on(_offsets(), qk)
    scores = scores.masked_fill(offsets == 0, SELF_SCORE).masked_fill(offsets < 0, float("-inf"))
    return torch.softmax(scores, -1) @ v


def _linformer_reference(q, k, v, E, F_) -> torch.Tensor:
    """``softmax(Q (E K)^T / sqrt(D)) (F V)`` per head (head h reads key/value head h // 2)."""
    k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    keys, values = E[:, :T] @ k, F_[:, :T] @ v
    return torch.softmax(q @ keys.transpose(-1, -2) * D ** -0.5, -1) @ values


def checks() -> list[Check]:
    """Every check, family by family (the public ops of ``linattn/__init__.py``)."""
    causal = lambda q, k, v: softmax_attention(q, k, v, causal=True, impl="reference")  # noqa: E731
    found = [
        Check("softmax_attention", "sdpa vs reference", _qkv,
              lambda q, k, v: softmax_attention(q, k, v, causal=True, impl="sdpa"), causal,
              (torch.float32, torch.bfloat16)),
        Check("softmax_attention", "tiled vs reference", _qkv,
              lambda q, k, v: softmax_attention(q, k, v, causal=True, impl="tiled", block_size=4), causal),
    ]
    for feature_map in ("elu", "dpfp:2"):
        reference = lambda q, k, v, m=feature_map: linear_attention(q, k, v, feature_map=m, mode="parallel")[0]  # noqa: E731
        for mode in ("chunk", "recurrent"):
            found.append(Check(f"linear_attention:{feature_map}", f"{mode} vs parallel", _qkv,
                               lambda q, k, v, m=feature_map, mode=mode: linear_attention(
                                   q, k, v, feature_map=m, mode=mode, chunk_size=4)[0], reference))

    def delta_inputs(g):
        return {**_qkv(g), "beta": torch.rand(B, HKV, T, generator=g, dtype=F64)}

    found.append(Check("delta_rule", "chunk vs recurrent", delta_inputs,
                       lambda q, k, v, beta: delta_rule(q, k, v, beta.sigmoid(), mode="chunk", chunk_size=4)[0],
                       lambda q, k, v, beta: delta_rule(q, k, v, beta.sigmoid(), mode="recurrent")[0]))
    vq_reference = lambda **x: _vq(**x, mode="parallel")  # noqa: E731
    for schedule in ("loop", "batched"):
        found.append(Check("vq_attention", f"block ({schedule}) vs parallel", _vq_inputs,
                           lambda schedule=schedule, **x: _vq(**x, schedule=schedule, impl="torch"), vq_reference))
    found.append(Check("vq_attention", "impl='auto' vs parallel", _vq_inputs, lambda **x: _vq(**x), vq_reference,
                       (torch.float32, torch.bfloat16)))
    found.append(Check("local_attention", "blocked vs masked reference", _qkv,
                       lambda q, k, v: local_attention(q, k, v, window=4)[0],
                       lambda q, k, v: _masked(q, k, v, _on((_offsets() >= 0) & (_offsets() < 4), q))))
    strided_mask = (_offsets() >= 0) & ((_offsets() < 4) | (_offsets() % 3 == 0))
    found.append(Check("strided_attention", "strided vs masked reference", _qkv,
                       lambda q, k, v: strided_attention(q, k, v, block=4, stride=3),
                       lambda q, k, v: _masked(q, k, v, _on(strided_mask, q))))
    blocks = torch.arange(T) // 4
    fixed_mask = (_offsets() >= 0) & ((blocks[:, None] == blocks[None, :]) | (torch.arange(T) % 4 == 3)[None, :])
    found.append(Check("strided_attention", "fixed vs masked reference", _qkv,
                       lambda q, k, v: strided_attention(q, k, v, pattern="fixed", block=4, summary=1),
                       lambda q, k, v: _masked(q, k, v, _on(fixed_mask, q))))
    found.append(Check("lsh_attention", "one bucket vs exact attention",
                       lambda g: {"qk": _randn(g, B, H, T, D), "v": _randn(g, B, H, T, D)},
                       lambda qk, v: lsh_attention(qk, v, n_hashes=2, bucket_size=T, seed=0), _lsh_reference))
    found.append(Check("linformer_attention", "op vs equation",
                       lambda g: {**_qkv(g), "E": _randn(g, 5, T + 3), "F_": _randn(g, 5, T + 3)},
                       lambda q, k, v, E, F_: linformer_attention(q, k, v, E, F_), _linformer_reference))
    found.append(Check("soft_vq_attention", "block vs quadratic form",
                       lambda g: {**_qkv(g), "codebook": _randn(g, HKV, S, D)},
                       lambda q, k, v, codebook: soft_vq_attention(q, k, v, codebook, temperature=0.5,
                                                                   block_size=L)[0],
                       _soft_vq_reference))
    return found


def _relative_error(have: torch.Tensor, want: torch.Tensor) -> float:
    return float((have.to(F64) - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def _run(fn: Callable[..., torch.Tensor], tensors: dict[str, torch.Tensor], dtype: torch.dtype
         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output of ``fn`` on ``tensors`` in ``dtype`` and the gradients of a fixed weighting
    of it with respect to every floating-point input."""
    leaves = {name: t.to(dtype).requires_grad_(True) if t.is_floating_point() else t for name, t in tensors.items()}
    with torch.enable_grad():
        out = fn(**leaves)
        weights = torch.linspace(-1, 1, out.numel(), dtype=F64, device=out.device).reshape(out.shape)
        grads = torch.autograd.grad((out.to(F64) * weights).sum(), [t for t in leaves.values() if t.requires_grad])
    return out.detach(), list(grads)


def run_check(check: Check, device: torch.device, dtype: torch.dtype) -> Result:
    """``check`` on ``device`` with the fast form in ``dtype`` (the module docstring)."""
    out_rtol, grad_rtol = TOLERANCES[dtype]
    result = Result(check.family, check.form, str(dtype).replace("torch.", ""), None, None, out_rtol, grad_rtol, False)
    tensors = {name: (t.to(dtype).to(F64) if t.is_floating_point() else t).to(device)
               for name, t in check.inputs(torch.Generator().manual_seed(0)).items()}
    try:
        out, grads = _run(check.fast, tensors, dtype)
    except Exception as error:  # reported as a failed check: the doctor's job is to name it
        result.detail = f"{type(error).__name__}: {error}"
        return result
    want, want_grads = _run(check.reference, tensors, F64)
    if not (bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)):
        result.detail = "non-finite values"
        return result
    result.out_error = _relative_error(out, want)
    result.grad_error = max(_relative_error(g, w) for g, w in zip(grads, want_grads))
    result.ok = result.out_error <= out_rtol and result.grad_error <= grad_rtol
    if not result.ok:
        result.detail = (f"output off by {result.out_error:.2g} (tolerance {out_rtol:g}), gradients by "
                         f"{result.grad_error:.2g} (tolerance {grad_rtol:g})")
    return result


def run_all(device: torch.device) -> list[Result]:
    """Every check on ``device``: float64 on the CPU; on CUDA each check's dtypes, then the VQ
    kernels' self-check in float32 and bfloat16."""
    results = []
    for check in checks():
        for dtype in ((F64,) if device.type == "cpu" else check.dtypes):
            results.append(run_check(check, device, dtype))
    if device.type == "cuda":
        for dtype in (torch.float32, torch.bfloat16):
            failure = vq_selfcheck.verdict(device, dtype)
            rtols = vq_selfcheck.OUT_RTOL[dtype], vq_selfcheck.GRAD_RTOL[dtype]
            results.append(Result("vq_attention", "Triton kernels' self-check", str(dtype).replace("torch.", ""),
                                  None, None, *rtols, failure is None, failure or ""))
    return results
