"""Which form ``vq_attention`` runs the causal block form with: the fused Triton kernels
(``fused.py``, ``triton_kernels.py``) where they can run and have passed their self-check
(``selfcheck.py``), the native kernel on CPUs (``native_block.py``, for the calls
``native_block_check.py`` names), else torch (``block.py``); ``impl=`` and ``LINATTN_VQ_IMPL`` decide."""

from __future__ import annotations

import os

import torch

from ..._checks import check_choice, compute_dtype
from . import fused, native_block_check
from .selfcheck import ENV, forced_impl, verdict

IMPLS = ("auto", "torch", "triton", "native")
AUTO_DEVICE_TYPES = ("cuda",)  # where impl="auto" takes the kernels (after their self-check)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernels cannot run on inputs like ``q`` and ``v``, or None when they can."""
    if q.dtype not in _DTYPES:
        return f"takes float32, bfloat16 or float16 inputs, got {q.dtype}"
    if q.device.type not in ("cuda", "cpu"):
        return f"runs on CUDA tensors, got a tensor on {q.device}"
    if q.device.type == "cpu" and not _interpreting():
        return ("needs CUDA tensors; CPU tensors run only under the Triton interpreter "
                "(TRITON_INTERPRET=1 set before triton is imported)")
    try:
        kernels = fused.kernels()
    except ImportError as error:
        return f"needs the triton package (pip install triton==3.9.0): {error}"
    if max(q.shape[-1], v.shape[-1]) > kernels.MAX_HEAD_DIM:
        return f"takes head dims Dk, Dv up to {kernels.MAX_HEAD_DIM}, got Dk={q.shape[-1]}, Dv={v.shape[-1]}"
    if q.device.type == "cpu" and not kernels.interpreted():
        return ("found triton imported before TRITON_INTERPRET=1 was set (torch._dynamo imports it), so CPU "
                "tensors cannot run its kernels; set it before anything imports triton")
    return None


def resolve_impl(impl: str, q: torch.Tensor, v: torch.Tensor, causal: bool, mode: str, rerope: bool = False) -> str:
    """``"torch"``, ``"triton"`` or ``"native"`` for ``vq_attention``'s ``impl`` argument (see its
    docstring); ``impl="auto"`` follows ``LINATTN_VQ_IMPL`` when it is set (``selfcheck.py``) and
    takes ``"native"`` for the causal block form on a CPU (``native_block_check.py`` then decides
    per call). The Triton kernels have no ReRoPE form: with ``rerope`` ``"auto"`` takes torch and
    ``"triton"`` is refused."""
    check_choice("impl", impl, IMPLS)
    if impl == "torch":
        return impl
    block_form = causal and mode == "block"
    if impl == "native":
        if not block_form:
            raise ValueError(f"impl='native' runs the causal block form; causal={causal}, mode={mode!r} is torch only "
                             "(pass impl='torch' or 'auto')")
        return "native"
    if rerope:
        if impl == "triton":
            raise ValueError("impl='triton': the fused VQ kernels have no ReRoPE form (rerope=); pass impl='torch' or "
                             "'auto' (the torch block form computes it)")
        return "torch"
    if impl == "auto":
        forced = forced_impl()
        if forced == "torch" or not block_form:
            return "torch"
        if forced == "native":
            return "native"
        if forced == "triton":
            reason = unavailable_reason(q, v)
            if reason is not None:
                raise ValueError(f"{ENV}=triton, but impl='triton' {reason}; unset {ENV} or set it to torch")
            return "triton"
        if q.device.type in AUTO_DEVICE_TYPES and unavailable_reason(q, v) is None:
            return "triton"
        return "native" if q.device.type == "cpu" and block_form else "torch"
    if not block_form:
        raise ValueError(f"impl='triton' runs the causal block form; causal={causal}, mode={mode!r} is torch only "
                         "(pass impl='torch' or 'auto')")
    reason = unavailable_reason(q, v)
    if reason is not None:
        raise ValueError(f"impl='triton' {reason}; pass impl='torch' or 'auto'")
    return impl


def choice(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """What ``impl="auto"`` takes for the causal block form on ``device`` in ``dtype``, and why
    (for ``linattn doctor``); runs the self-check where it would run the kernels."""
    try:
        forced = forced_impl()
    except ValueError as error:
        return "error", str(error)
    if forced == "torch":
        return "torch", f"{ENV}=torch"
    probe = torch.empty(1, 1, 1, 1, device=device, dtype=dtype)
    reason = unavailable_reason(probe, probe)
    if forced == "triton":
        return ("error", f"{ENV}=triton, but impl='triton' {reason}") if reason else ("triton", f"{ENV}=triton")
    if forced is None and device.type in AUTO_DEVICE_TYPES and reason is None:
        failure = verdict(device, dtype)
        if failure is not None:
            return "torch", f"the kernels failed their self-check: {failure}"
        return "triton", "CUDA, triton imports, the self-check passed"
    if device.type == "cpu":
        failure = native_block_check.verdict(compute_dtype(dtype))
        if failure is not None:
            return ("error" if forced else "torch"), f"the native block form failed: {failure}"
        return "native", ((f"{ENV}=native" if forced else "compiled for this CPU and agrees with the torch form")
                          + ": hard codes, no ReRoPE, with gradients grad_scope 'cache' or 'state'; torch for "
                          "the others")
    if forced == "native":
        return "error", f"{ENV}=native, but the native block form runs on CPU tensors, this is {device.type}"
    if device.type not in AUTO_DEVICE_TYPES:
        return "torch", f"the kernels are taken automatically on CUDA only, this is {device.type}"
    return "torch", f"impl='triton' {reason}"
