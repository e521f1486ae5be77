"""One Transformer-VQ decoding step from raw keys: quantize the new key, then attend.

``vq_decode_step`` is ``VectorQuantizer`` followed by ``vq_attention`` for one generated
position, without gradients, computed together (``resident.quantize_and_decode``): the
code is ``z = argmin_s |k - c_s|^2`` (in float32, as ``VectorQuantizer.nearest_codes``) and

    out = vq_attention(q, codebook[z], v, z, codebook, initial_state=state, output_final_state=True)

Every key the step attends to is a code, so the query's scores on the window are its
codebook scores ``q.c_s`` gathered at the window's codes; with float32 inputs the query and
the key are scored against the codebook in one matmul, which reads the codebook once.
"""

from __future__ import annotations

import torch

from ...state import VQAttentionState
from ..._checks import check_bool, compute_dtype, records_gradients, resolve_scale
from . import resident
from .checks import check_step
from .native_choice import use_native
from .rerope import check_vq_rerope


def vq_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    codebook: torch.Tensor,
    state: VQAttentionState | None = None,
    *,
    scale: float | None = None,
    block_size: int = 128,
    bias: torch.Tensor | None = None,
    position_keys: torch.Tensor | None = None,
    check_inputs: bool = True,
    impl: str = "auto",
    rerope: int | None = None,
    rotary_base: float = 10000.0,
) -> tuple[torch.Tensor, torch.Tensor, VQAttentionState]:
    """Quantize one new key and attend to it and the past (Transformer-VQ decoding).

    Args:
        q: the query, ``[B, H, 1, Dk]``.
        k: the key *before* quantization, ``[B, Hkv, 1, Dk]``.
        v: the value, ``[B, Hkv, 1, Dv]``.
        codebook: ``[Hkv, S, Dk]`` (``VectorQuantizer.codebook``).
        state: the ``VQAttentionState`` of the positions so far (hard codes), or None.
        scale: score scale, ``None`` = ``Dk^-1/2``.
        block_size: L, the block length (the state's).
        bias: relative bias for offsets ``0..L``, as in ``vq_attention``.
        position_keys: relative position keys, as in ``vq_attention``.
        check_inputs: check shapes, dtypes, devices and the state (``False`` skips it, for
            callers whose inputs are valid by construction).
        impl: ``"auto"`` (default): the native C++ step on CPU tensors computed in float32 or
            float64 once it has built and passed its self-check (``ops/common/native.py``; the
            first build takes about a minute), the torch form otherwise (a failed build or
            check warns once); ``"torch"``; ``"native"`` (an error where it cannot run).
            ``LINATTN_VQ_STEP_IMPL=torch|native`` replaces the automatic choice.
        rerope: ReRoPE's window ``w <= block_size`` (None: off), with ``rotary_base``, as in
            ``vq_attention``: q and k unrotated; both forms (the window's columns nearer than w
            scored by the query turned by their distance, every other column by ``R(w) q``).
        rotary_base: the base of the rotary frequencies with ``rerope`` (a number > 1).


    Returns:
        ``(out [B, H, 1, Dv] in q's dtype, codes [B, Hkv, 1] int64, new state)``, equal to
        ``vq_attention`` on ``k_hat = codebook[h, codes]`` with the same state (the codes
        equal ``VectorQuantizer``'s, except where two codes are equally near in float32).

    A decoding step: no gradients (an input that requires grad while grad mode is on is an
    error; train with ``VectorQuantizer`` and ``vq_attention``).
    """
    check_bool("check_inputs", check_inputs)
    if check_inputs:
        check_step(q, k, v, codebook, state, block_size)
    rerope = check_vq_rerope(rerope, rotary_base, q.shape[-1], block_size, True)
    if records_gradients(q, k, v, codebook):
        raise ValueError("vq_decode_step has no backward: call it under torch.no_grad() (decoding), or use "
                         "VectorQuantizer and vq_attention for gradients")
    native = use_native(impl, q.device, compute_dtype(q.dtype))
    return resident.quantizing_step(q, k, v, codebook, state, resolve_scale(scale, q.shape[-1]), block_size, bias,
                                    position_keys, native, None if rerope is None else (rerope, rotary_base))
