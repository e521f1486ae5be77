"""One Transformer-VQ decoding step from raw keys: quantize the new key, then attend.

``vq_decode_step`` is ``VectorQuantizer`` followed by ``vq_attention`` for one generated
position, without gradients, computed together (``_vq_resident.quantize_and_decode``): the
code is ``z = argmin_s |k - c_s|^2`` (in float32, as ``VectorQuantizer.nearest_codes``) and

    out = vq_attention(q, codebook[z], v, z, codebook, initial_state=state, output_final_state=True)

Every key the step attends to is a code, so the query's scores on the window are its
codebook scores ``q.c_s`` gathered at the window's codes; with float32 inputs the query and
the key are scored against the codebook in one matmul, which reads the codebook once.
"""

from __future__ import annotations

import torch

from ..state import VQAttentionState
from . import _vq_resident as resident
from ._vq_native import use_native
from .vq import _as, _check_codebook, _check_state, _relative_inputs, _relative_terms, _reversed
from .._checks import check_bool, check_positive_int, check_qkv, compute_dtype, resolve_scale


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
) -> tuple[torch.Tensor, torch.Tensor, VQAttentionState]:
    """Quantize one new key and attend to it and the past (Transformer-VQ decoding).

    Args:
        q: ``[B, H, 1, Dk]``; k: ``[B, Hkv, 1, Dk]`` the key *before* quantization;
            v: ``[B, Hkv, 1, Dv]``; codebook: ``[Hkv, S, Dk]`` (``VectorQuantizer.codebook``).
        state: the ``VQAttentionState`` of the positions so far (hard codes), or None.
        scale: score scale, ``None`` = ``Dk^-1/2``.
        block_size: L, the block length (the state's).
        bias: relative bias for offsets ``0..L``, as in ``vq_attention``.
        position_keys: relative position keys, as in ``vq_attention``.
        check_inputs: check shapes, dtypes, devices and the state (``False`` skips it, for
            callers whose inputs are valid by construction).
        impl: ``"auto"`` (default): the native C++ step on CPU tensors computed in float32 or
            float64 once it has built and passed its self-check (``ops/_vq_native.py``; the
            first build takes about a minute), the torch form otherwise (a failed build or
            check warns once); ``"torch"``; ``"native"`` (an error where it cannot run).
            ``LINATTN_VQ_STEP_IMPL=torch|native`` replaces the automatic choice.

    Returns:
        ``(out [B, H, 1, Dv] in q's dtype, codes [B, Hkv, 1] int64, new state)``, equal to
        ``vq_attention`` on ``k_hat = codebook[h, codes]`` with the same state (the codes
        equal ``VectorQuantizer``'s, except where two codes are equally near in float32).

    A decoding step: no gradients (an input that requires grad while grad mode is on is an
    error; train with ``VectorQuantizer`` and ``vq_attention``).
    """
    check_bool("check_inputs", check_inputs)
    if check_inputs:
        _check_step(q, k, v, codebook, state, block_size)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, codebook)):
        raise ValueError("vq_decode_step has no backward: call it under torch.no_grad() (decoding), or use "
                         "VectorQuantizer and vq_attention for gradients")
    B, H, _, Dk = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    G, L = H // Hkv, block_size
    dtype = compute_dtype(q.dtype)
    native = use_native(impl, q.device, dtype)
    scale = resolve_scale(scale, Dk)
    queries = _as(q, dtype).reshape(B, Hkv, G, Dk)
    relative = None
    if bias is not None or position_keys is not None:
        table, positions_k = _relative_inputs(bias, position_keys, H, Hkv, L, Dk, q, dtype)
        relative = _reversed(_relative_terms(queries.unsqueeze(3) * scale, table, positions_k))
    out, codes, new_state = resident.quantize_and_decode(
        queries, _as(k, dtype).reshape(B, Hkv, Dk), _as(v, dtype).reshape(B, Hkv, Dv), codebook, scale, relative, L,
        state, dtype, native)
    return _as(out.view(B, H, 1, Dv), q.dtype), codes.view(B, Hkv, 1), new_state


def _check_step(q, k, v, codebook, state, block_size) -> None:
    shapes = check_qkv(q, k, v)
    if shapes.length != 1:
        raise ValueError(f"q has {shapes.length} positions (shape {list(q.shape)}); vq_decode_step takes one, "
                         "[B, H, 1, Dk] (vq_attention reads longer inputs)")
    check_positive_int("block_size", block_size)
    B, Hkv, Dk, Dv = shapes.batch, shapes.kv_heads, shapes.key_dim, shapes.value_dim
    codebook = _check_codebook(codebook, Hkv, Dk, q)
    if codebook.shape[1] == 0:
        raise ValueError(f"codebook has shape {list(codebook.shape)}, expected [{Hkv}, S, {Dk}] with S >= 1")
    if state is not None:
        _check_state(state, B, Hkv, Dk, Dv, block_size, codebook.shape[1], q, soft=False)
