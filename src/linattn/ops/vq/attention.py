"""Transformer-VQ attention: softmax attention over vector-quantized keys, in linear time.

Every key is a codebook vector, ``k_hat_j = c_{z_j}`` (codebook ``C [Hkv, S, Dk]``,
codes ``z``). The score of query i on key j is ``s_ij = scale q_i.(k_hat_j + P_{i-j}) + b_{i-j}``
with relative terms (a bias table ``b``, position keys ``P``) that are non-zero only for
``0 <= i - j <= L`` (L = block_size).

``mode="parallel"`` (the reference) materialises ``softmax(s) V`` causally.

``mode="block"`` groups positions in blocks of L from the start of the sequence. A query
in block r attends exactly to its own block (causal) and to block r-1 (both with the
bias), and to every older position through a cache: per code s, the count ``n_s`` and
mean value ``m_s`` of the positions in blocks <= r-2 quantized to s. Since all those keys
equal ``c_s`` and carry no bias,

    sum_{j in blocks <= r-2} exp(scale q.k_hat_j) v_j = exp(scale q.c_s + log n_s) m_s   (summed over s)

so one softmax over (own block, previous block, S cache slots) equals the reference exactly
at O(T (2L + S)) cost. ``causal=False``:
``softmax over s of (scale q.c_s + log n_s)`` applied to ``m_s`` (the encoder form
``exp(Q C^T)(Delta^T V)``, normalised).

Gradients (``grad_scope``, the block and decode forms): ``"cache"`` (default) builds the
cache from detached values, so no gradient reaches v through the cache but the exact
window (own and previous block) is differentiated; ``"state"`` is the official code's
training: nothing carried across a block boundary (previous block, cache counts and means)
passes a gradient, only the cache logits reach the codebook and q; ``"none"`` stops
nothing, so the block form's gradients equal the quadratic reference's w.r.t. q, v and
the codebook. The reference form (``mode="parallel"``) is always ``"none"``.

ReRoPE (``rerope=w <= L``, ``rerope.py``): q and k_hat are unrotated and ``q_i.k_hat_j`` becomes
``(R(min(i - j, w)) q_i).k_hat_j``; every cached key is at distance w, so the cache logit is
``scale (R(w) q).c_s + log n_s`` and every form stays exact (the Triton kernels and the native
block form have no ReRoPE form: torch runs it; the native decoding step turns the query once per
distance below w).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...state import VQAttentionState
from ..._checks import check_bool, check_choice, compute_dtype, resolve_scale
from . import fused, native_block_check, resident, selfcheck, triton_choice
from .block import block_form
from .checks import check_arguments, resolve_grad_scope
from .decode import decode_form
from .reference import noncausal, windowed_softmax
from .relative import relative_inputs, relative_terms, reversed_terms
from .rerope import check_vq_rerope
from ..common.versions import tensor_version
from .schedule import SCHEDULES, auto_schedule
from .tensors import as_dtype


def vq_attention(
    q: torch.Tensor,
    k_hat: torch.Tensor,
    v: torch.Tensor,
    codes: torch.Tensor,
    codebook: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_size: int = 128,
    bias: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
    position_keys: torch.Tensor | None = None,
    mode: str | None = None,
    grad_scope: str = "cache",
    cache_grad: bool | None = None,
    initial_state: VQAttentionState | None = None,
    output_final_state: bool = False,
    check_inputs: bool = True,
    schedule: str = "auto",
    impl: str = "auto",
    rerope: int | None = None,
    rotary_base: float = 10000.0,
) -> tuple[torch.Tensor, VQAttentionState | None]:
    """Softmax attention over vector-quantized keys (Transformer-VQ).

    Args:
        q: the queries, ``[B, H, T, Dk]``.
        k_hat: the quantized keys, ``[B, Hkv, T, Dk]`` (equal to ``codebook[h, codes]`` in
            value; ``VectorQuantizer`` gives them with a straight-through gradient).
        v: the values, ``[B, Hkv, T, Dv]``.
        codes: ``[B, Hkv, T]`` int64 code indices.
        codebook: ``[Hkv, S, Dk]``, S codes per key/value head.
        causal: decoder (True) or encoder (False; no bias, no state).
        scale: score scale, ``None`` = ``Dk^-1/2``.
        block_size: L, the block length and the bias window.
        bias: relative bias for offsets ``0..L``: a tensor ``[L + 1]`` or ``[H, L + 1]``, or
            a callable of the offsets (1-D long tensor) returning ``[n]`` or ``[H, n]``.
            Zero for larger offsets.
        position_keys: ``[L + 1, Dk]`` or ``[H, L + 1, Dk]``: adds the query-dependent
            relative term ``scale q_i . P_{i-j}`` for ``0 <= i - j <= L`` (Transformer-XL's
            content-position term; the GAU layer uses it).
        mode: ``"parallel"`` (quadratic reference) or ``"block"`` (linear; default).
        grad_scope: where the block form stops gradients: ``"cache"`` (the values entering
            the cache), ``"state"`` (everything carried across a block boundary: the official
            Transformer-VQ training, ``grad_thru_cache=False``) or ``"none"`` (exact gradients,
            the official ``grad_thru_cache=True``); see the module docstring.
        cache_grad: the former switch, kept as an alias: ``True`` is ``grad_scope="none"``,
            ``False`` is ``"cache"``.
        initial_state: a ``VQAttentionState`` to continue from (block mode).
        output_final_state: also return the final ``VQAttentionState`` (block mode).
        check_inputs: check every argument (types, shapes, the carried state) and that every
            code lies in ``[0, S)`` and ``k_hat`` equals ``codebook[h, codes]`` exactly (the
            block form reads the codebook where the reference reads ``k_hat``, so keys that
            are not their codes would give two answers). ``False`` skips all of it, for callers
            whose inputs are valid by construction: the GAU layer, whose keys come from its
            ``VectorQuantizer``, decodes a token in less time than the checks take.
        schedule: how the block form walks the blocks: ``"loop"`` (one block after another,
            the readable form) or ``"batched"`` (groups of blocks as batched matmuls, each
            block's cache from a prefix sum over the group's blocks, or without gradients one
            running cache: fewer, larger kernels; the faster on CPUs when batch x heads is
            small, by up to 3x).
            ``"auto"``: on a CPU the faster of the two at the nearest point of a measured grid
            of (gradients on or off, batch x heads, L, S, blocks per row) (``AUTO_SCHEDULE``:
            for long sequences batched with gradients but at two near-ties, without them
            batched up to 4 rows, mostly the loop at 32; for a few blocks per row, as in
            training at a small context, mostly the loop), batched on other devices. Same
            results.
        impl: ``"torch"`` (the forms above), ``"triton"`` (the causal block form as fused
            Triton kernels, ``ops/vq/fused.py``: inputs stay in their dtype, float32, bfloat16
            or float16, with float32 accumulation; CUDA tensors, or CPU tensors under the
            Triton interpreter, ``TRITON_INTERPRET=1``), ``"native"`` (the causal block form
            as one C++ call and its gradients as another, ``ops/vq/native_block.py``: CPU
            tensors computed in float32 or float64, hard codes, no ReRoPE, with gradients
            grad_scope ``"cache"`` or ``"state"``; any other call is a ValueError naming what
            it lacks) or ``"auto"`` (triton for CUDA inputs of those
            dtypes when ``triton`` imports; on a CPU native for every call it computes when
            ``schedule="auto"``; torch otherwise; ``LINATTN_VQ_IMPL=torch``, ``triton`` or
            ``native`` replaces this choice). Before the kernels first run on a device in a
            dtype they check themselves against the torch form on a small call
            (``ops/vq/selfcheck.py``): after a failed check ``"auto"`` warns once and uses
            torch there, ``"triton"`` raises ``RuntimeError`` (the native kernel likewise,
            ``ops/vq/native_block_check.py``). Calls whose new positions
            stay inside the current block (decoding steps) use the torch decode form either way;
            ``mode="parallel"``, ``causal=False`` and ``rerope`` are torch only (``"triton"`` with
            ``rerope`` is refused).
        rerope: ReRoPE's window w (None: off), an int ``1 <= w <= block_size``: q and k_hat are
            passed unrotated and the content score of query i on key j is
            ``scale (R(min(i - j, w)) q_i).k_hat_j``, R the rotary rotation of
            ``linattn.nn.rotary`` with ``rotary_base`` (a number > 1): rotary positions inside
            the window, distance w beyond it and for the whole cache (module docstring).
            ``w > block_size`` is refused: the cache keeps no distances. Causal only; bias and
            position keys still add their terms. Every torch form (parallel, block with either
            schedule, decode with and without gradients) computes it exactly.
        rotary_base: the base of the rotary frequencies with ``rerope`` (a number > 1).


    Returns:
        ``(out [B, H, T, Dv] in q's dtype, final state or None)``.
    """
    check_bool("check_inputs", check_inputs)
    check_choice("schedule", schedule, SCHEDULES)
    scope = resolve_grad_scope(grad_scope, cache_grad)
    if check_inputs:
        codes, codebook = check_arguments(q, k_hat, v, codes, codebook, causal, mode, block_size, bias,
                                          position_keys, initial_state, output_final_state)
    rerope = check_vq_rerope(rerope, rotary_base, q.shape[-1], block_size, causal)  # a few ints: always
    rope = None if rerope is None else (rerope, rotary_base)
    mode = mode or "block"
    requested, impl = impl, triton_choice.resolve_impl(impl, q, v, causal, mode, rerope is not None)
    B, H, T, Dk = q.shape
    Hkv, Dv = k_hat.shape[1], v.shape[-1]
    G = H // Hkv
    scale = resolve_scale(scale, Dk)
    dtype = compute_dtype(q.dtype)
    L = block_size
    table, positions_k = relative_inputs(bias, position_keys, H, Hkv, L, Dk, q, dtype)
    filled = initial_state.partial_keys.shape[2] if initial_state is not None else 0
    if impl == "triton" and filled + T > L and selfcheck.trusted(
            q.device, q.dtype, strict=requested == "triton" or selfcheck.forced_impl() == "triton"):
        # the block form on the kernels, inputs in their own dtype
        if torch.is_grad_enabled():
            resident.release(initial_state)
        out, pieces = fused.block_form(q, k_hat, v, codes, codebook, table, positions_k, L, scope, initial_state, scale)
        return _result(out, pieces, q.dtype, initial_state, output_final_state, L, _keys_record(codes, codebook,
                                                                                                initial_state))
    # the native block form (CPUs) scales the products itself
    native_form = impl == "native" and causal and mode == "block" and filled + T > L and (
        schedule == "auto" or requested == "native") and native_block_check.use_native(
        requested == "native" or selfcheck.forced_impl() == "native", q, dtype, codes, rope, scope, initial_state)
    qf = as_dtype(q, dtype).reshape(B, Hkv, G, T, Dk)
    qf = qf * scale if scale != 1.0 and not native_form else qf
    kf, vf, cb = as_dtype(k_hat, dtype), as_dtype(v, dtype), as_dtype(codebook, dtype)

    if not causal:
        if initial_state is not None:
            raise ValueError("causal=False takes no state (the encoder form sees the whole sequence)")
        out = noncausal(qf, codes, vf, cb)
        return as_dtype(out.reshape(B, H, T, Dv), q.dtype), None
    if mode == "parallel":
        out = windowed_softmax(qf, kf, vf, table, positions_k, L, causal, rerope=rope)
        return as_dtype(out.reshape(B, H, T, Dv), q.dtype), None

    if filled + T <= L and not torch.is_grad_enabled():
        relative = reversed_terms(relative_terms(qf, table, positions_k))
        out, state = resident.decode(qf, kf, vf, codes, codebook, relative, L, initial_state, dtype, rope)
        return as_dtype(out.reshape(B, H, T, Dv), q.dtype), (state if output_final_state else None)
    if torch.is_grad_enabled():
        resident.release(initial_state)
    if filled + T <= L:
        out, pieces = decode_form(qf, kf, vf, codes, cb, table, positions_k, L, scope, initial_state, dtype, rope)
    else:
        if native_form:
            schedule = "native"
        elif schedule == "auto":
            blocks = -(-(filled + T) // L)
            schedule = auto_schedule(torch.is_grad_enabled(), B * H, L, cb.shape[1], blocks, q.device)
        out, pieces = block_form(qf, kf, vf, codes, cb, table, positions_k, L, scope, initial_state, dtype, schedule,
                                 rope, scale if native_form else 1.0)
    return _result(out, pieces, q.dtype, initial_state, output_final_state, L,
                   _keys_record(codes, codebook, initial_state))


def _keys_record(codes, codebook, initial_state):
    """``(codebook, version)`` for the state a call returns when its keys are rows of the
    codebook as it is now: hard codes (``k_hat = codebook[codes]``, checked or promised) and
    a continued state recorded so too; None otherwise (``VQAttentionState._keys_from``)."""
    if codes.is_floating_point() or torch.compiler.is_compiling():  # a tensor's version is not traceable
        return None
    if initial_state is not None and not resident.keys_are_rows_of(initial_state._keys_from, codebook):
        return None
    version = tensor_version(codebook)
    return None if version is None else (codebook, version)


def _result(out, pieces, out_dtype, initial_state, output_final_state, block_size: int, keys_from=None):
    """``vq_attention``'s return value from a causal form's output ``[B, Hkv, G, T, Dv]`` and
    the pieces of its final state (made with ``block_size``)."""
    B, Hkv, G, T, Dv = out.shape
    out = as_dtype(out.reshape(B, Hkv * G, T, Dv), out_dtype)
    if not output_final_state:
        return out, None
    counts, means = pieces["cache"]
    partial_k, partial_v, partial_codes = pieces["partial"]
    prev_k, prev_v, prev_codes = pieces["prev"]
    state = VQAttentionState(
        partial_keys=partial_k,
        partial_values=partial_v,
        partial_codes=partial_codes,
        cache_counts=counts,
        cache_means=means,
        prev_keys=prev_k,
        prev_values=prev_v,
        prev_codes=prev_codes,
        steps=(initial_state.steps if initial_state is not None else 0) + T,
        block_size=block_size,
        codebook_size=counts.shape[-1],
    )
    state._keys_from = keys_from
    return out, state
