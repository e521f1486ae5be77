"""The Triton VQ kernels check themselves before they are trusted.

``vq_attention(impl="auto")`` takes the fused kernels (``fused.py``, ``triton_kernels.py``)
for CUDA inputs. The first time a process would run them on a device in a dtype, it first
runs one small call both ways, forward and backward: the kernels on inputs of that dtype,
and the torch block form in float64 on the same (rounded) inputs, on the same device. The
call: B 1, H 2, Hkv 1, T 20 in blocks of L = 8 (three blocks, the last partial: previous
blocks and the cache all in use), S 8, Dk = Dv = 16, a bias table and position keys,
``grad_scope="none"`` (every gradient path of the kernels). It compares the output and the
gradients of q, k_hat, v, the codebook, the bias and the position keys, each by its largest
error relative to its largest value:

    max |kernels - torch| <= rtol * max |torch|,  rtol = OUT_RTOL (output), GRAD_RTOL (gradients)

float32: 1e-4 and 1e-3 (IEEE float32 products: a few float32 roundings, 3e-7 seen in
Triton's interpreter); bfloat16: 6e-2 and 1.2e-1 (products of probabilities rounded to
bfloat16: 8e-3 seen); float16: 1e-2 and 2e-2 (7e-4 seen). A kernel that raises, gives a non-finite value or misses a
tolerance fails, and that verdict holds for the device and dtype for the rest of the
process (``_verdicts``; ``reset()`` forgets them, for tests). On a failure ``impl="auto"``
warns once, naming what failed, the device and the dtype, and runs the torch block form
from then on; an explicit ``impl="triton"`` (or ``LINATTN_VQ_IMPL=triton``) raises
``RuntimeError`` with the same text instead, at every call.

``LINATTN_VQ_IMPL``: ``torch``, ``triton`` or ``native`` (``native_block_check.py``) replaces what
``impl="auto"`` chooses for the causal block form (an explicit ``impl=`` argument wins; the other forms are torch only);
``triton`` where the kernels cannot run is a ``ValueError`` naming the variable. Unset (or
empty): the automatic choice.
"""

from __future__ import annotations

import warnings

import torch

from ..._checks import compute_dtype, env_choice, resolve_scale
from . import fused
from .block import block_form
from .relative import relative_inputs

ENV = "LINATTN_VQ_IMPL"
ENV_VALUES = ("torch", "triton", "native")
OUT_RTOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}
GRAD_RTOL = {torch.float32: 1e-3, torch.bfloat16: 1.2e-1, torch.float16: 2e-2}
_SHAPE = dict(B=1, H=2, Hkv=1, T=20, L=8, S=8, D=16)

_verdicts: dict[tuple[str, torch.dtype], str | None] = {}  # None: passed; else what failed
_warned: set[tuple[str, torch.dtype]] = set()


def forced_impl() -> str | None:
    """``LINATTN_VQ_IMPL`` (``"torch"``, ``"triton"`` or ``"native"``), None when unset or empty."""
    return env_choice(ENV, ENV_VALUES)


def reset() -> None:
    """Forget every verdict and warning (tests)."""
    _verdicts.clear()
    _warned.clear()


def verdict(device: torch.device, dtype: torch.dtype) -> str | None:
    """The self-check's verdict for ``device`` and ``dtype``, run at the first ask: None when
    the kernels passed, else what failed."""
    key = (str(device), dtype)
    if key not in _verdicts:
        _verdicts[key] = _run_check(device, dtype)
    return _verdicts[key]


def trusted(device: torch.device, dtype: torch.dtype, strict: bool) -> bool:
    """Whether the kernels may run on ``device`` in ``dtype`` (``verdict``). A failed check
    warns once and returns False, or raises RuntimeError when ``strict`` (the kernels were
    asked for by name)."""
    failure = verdict(device, dtype)
    if failure is None:
        return True
    key = (str(device), dtype)
    message = f"the Triton VQ kernels failed their self-check on {device} in {dtype}: {failure}"
    if strict:
        raise RuntimeError(f"{message}. Use impl='torch' (or impl='auto' without {ENV}=triton)")
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{message}; vq_attention uses the torch block form on {device} in {dtype} from now on",
                      RuntimeWarning, stacklevel=3)
    return False


def _inputs(dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The check's inputs, drawn on the CPU (the same on every device), rounded to ``dtype``."""
    s = _SHAPE
    g = torch.Generator().manual_seed(0)
    codebook = torch.randn(s["Hkv"], s["S"], s["D"], generator=g, dtype=torch.float64)
    codes = torch.randint(0, s["S"], (s["B"], s["Hkv"], s["T"]), generator=g)
    tensors = {
        "q": torch.randn(s["B"], s["H"], s["T"], s["D"], generator=g, dtype=torch.float64),
        "v": torch.randn(s["B"], s["Hkv"], s["T"], s["D"], generator=g, dtype=torch.float64),
        "codebook": codebook,
        "bias": torch.randn(s["H"], s["L"] + 1, generator=g, dtype=torch.float64),
        "position_keys": 0.5 * torch.randn(s["H"], s["L"] + 1, s["D"], generator=g, dtype=torch.float64),
    }
    tensors = {name: t.to(dtype).to(device) for name, t in tensors.items()}
    tensors["codes"] = codes.to(device)
    index = tensors["codes"].unsqueeze(-1).expand(*codes.shape, s["D"])
    tensors["k_hat"] = torch.gather(tensors["codebook"].unsqueeze(0).expand(s["B"], -1, -1, -1), 2, index)
    return tensors


def _forward_backward(tensors: dict[str, torch.Tensor], dtype: torch.dtype, form: str) -> dict[str, torch.Tensor]:
    """The output and every input's gradient of the causal block form in ``dtype``, on the
    kernels (``form="triton"``, ``fused.py``) or in torch (``"torch"``, ``block.py``, the loop)."""
    leaves = {name: t.to(dtype).requires_grad_(True) for name, t in tensors.items() if name != "codes"}
    q, k_hat, v, codebook = (leaves[name] for name in ("q", "k_hat", "v", "codebook"))
    B, H, T, Dk = q.shape
    Hkv, L, scale = k_hat.shape[1], _SHAPE["L"], resolve_scale(None, Dk)
    with torch.enable_grad():
        table, positions_k = relative_inputs(leaves["bias"], leaves["position_keys"], H, Hkv, L, Dk, q,
                                             compute_dtype(dtype))
        if form == "triton":
            out, _ = fused.block_form(q, k_hat, v, tensors["codes"], codebook, table, positions_k, L, "none", None,
                                      scale)
        else:
            queries = q.reshape(B, Hkv, H // Hkv, T, Dk) * scale
            out, _ = block_form(queries, k_hat, v, tensors["codes"], codebook, table, positions_k, L, "none", None,
                                dtype, "loop")
        out = out.reshape(B, H, T, -1)
        weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64, device=out.device).reshape(out.shape)
        grads = torch.autograd.grad((out.to(torch.float64) * weights).sum(), list(leaves.values()))
    return {"output": out.detach(), **{f"d {name}": grad for name, grad in zip(leaves, grads)}}


def _run_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """The self-check (module docstring): None when the kernels pass, else what failed."""
    tensors = _inputs(dtype, device)
    try:
        got = _forward_backward(tensors, dtype, "triton")
    except Exception as error:  # any failure of the kernels is the verdict, reported as it was raised
        return f"{type(error).__name__}: {error}"
    expected = _forward_backward(tensors, torch.float64, "torch")
    for name, want in expected.items():
        have = got[name].to(torch.float64)
        if not bool(torch.isfinite(have).all()):
            return f"{name} has non-finite values"
        rtol = OUT_RTOL[dtype] if name == "output" else GRAD_RTOL[dtype]
        error = float((have - want).abs().max()) / max(float(want.abs().max()), 1e-30)
        if not error <= rtol:
            return f"{name} differs from the torch block form by {error:.3g} of its largest value (tolerance {rtol:g})"
    return None
