"""Transformer-VQ's causal block form on fused Triton kernels (``vq_attention(impl="triton")``).

The same computation as ``vq.py``'s block form, split where memory allows: torch lays the
stream out in blocks (the state's partial block in front, padding behind, the previous
block of block 0 as key rows 0..L-1) and computes, by the prefix sum over blocks that the
batched schedule uses (``vq._block_caches``), the cache every block reads: ``log n_s`` and
the means ``m_s`` per block, ``[B, Hkv, R, S(, E)]`` in float32 (the analogue of the
per-chunk states of chunked linear attention). It also forms the relative terms
``b_delta + scale q_i.P_delta`` per row and offset ``[B, H, N, L + 1]`` (a broadcast view
when there are no position keys). The kernels (``_vq_kernels.py``) then compute every
block's softmax over (previous block, own block, S cache slots) with an online softmax,
never holding more than one tile of its ``2L + S`` columns, and the backward by
recomputation from the row log-sum-exp.

Gradients: the kernels return the gradients of q, the window keys and values, the codebook
(through the cache logits), the per-block ``log n_s`` and ``m_s`` and the relative terms;
torch's autograd carries the last three back through the prefix sum, the code statistics
and the bias/position-key products, so ``grad_scope`` acts exactly as in the torch form:
``"cache"`` and ``"state"`` build the cache from detached values (and detached soft
counts), ``"none"`` does not; ``"state"`` also detaches the carried state and tells the
key kernel to skip what a block sends to its previous block (the one stop-gradient inside
the kernels).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from .._checks import check_choice
from ._vq_cache import mean_values
from ._vq_selfcheck import ENV, forced_impl, verdict

IMPLS = ("auto", "torch", "triton")
AUTO_DEVICE_TYPES = ("cuda",)  # where impl="auto" takes the kernels (after their self-check)
MAX_HEAD_DIM = 256  # largest Dk and Dv the kernels take (one tile holds a whole row)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _kernels():
    """The kernel module, imported at first use (``ImportError`` without triton)."""
    from . import _vq_kernels

    return _vq_kernels


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the kernels cannot run on inputs like ``q`` and ``v``, or None when they can."""
    if q.dtype not in _DTYPES:
        return f"takes float32, bfloat16 or float16 inputs, got {q.dtype}"
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"takes head dims Dk, Dv up to {MAX_HEAD_DIM}, got Dk={q.shape[-1]}, Dv={v.shape[-1]}"
    if q.device.type not in ("cuda", "cpu"):
        return f"runs on CUDA tensors, got a tensor on {q.device}"
    if q.device.type == "cpu" and not _interpreting():
        return ("needs CUDA tensors; CPU tensors run only under the Triton interpreter "
                "(TRITON_INTERPRET=1 set before triton is imported)")
    try:
        kernels = _kernels()
    except ImportError as error:
        return f"needs the triton package (pip install triton==3.9.0): {error}"
    if q.device.type == "cpu" and not kernels.interpreted():
        return ("found triton imported before TRITON_INTERPRET=1 was set (torch._dynamo imports it), so CPU "
                "tensors cannot run its kernels; set it before anything imports triton")
    return None


def resolve_impl(impl: str, q: torch.Tensor, v: torch.Tensor, causal: bool, mode: str) -> str:
    """``"torch"`` or ``"triton"`` for ``vq_attention``'s ``impl`` argument (see its docstring);
    ``impl="auto"`` follows ``LINATTN_VQ_IMPL`` when it is set (``_vq_selfcheck.py``)."""
    check_choice("impl", impl, IMPLS)
    if impl == "torch":
        return impl
    block_form = causal and mode == "block"
    if impl == "auto":
        forced = forced_impl()
        if forced == "torch" or not block_form:
            return "torch"
        if forced == "triton":
            reason = unavailable_reason(q, v)
            if reason is not None:
                raise ValueError(f"{ENV}=triton, but impl='triton' {reason}; unset {ENV} or set it to torch")
            return "triton"
        return "triton" if q.device.type in AUTO_DEVICE_TYPES and unavailable_reason(q, v) is None else "torch"
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
    if device.type not in AUTO_DEVICE_TYPES:
        return "torch", f"the kernels are taken automatically on CUDA only, this is {device.type}"
    if reason is not None:
        return "torch", f"impl='triton' {reason}"
    failure = verdict(device, dtype)
    if failure is not None:
        return "torch", f"the kernels failed their self-check: {failure}"
    return "triton", "CUDA, triton imports, the self-check passed"


def block(q, k_hat, v, codes, codebook, table, positions_k, L, scope, state, scale):
    """``vq._block`` on the kernels. q ``[B, H, T, Dk]`` (unscaled), k_hat, v, codebook in
    q's dtype; table ``[h, g, L + 1]`` and positions_k ``[h, g, L + 1, Dk]`` (float32, each
    may be None); returns (out ``[B, Hkv, G, T, Dv]``, the pieces of the final state)."""
    from .vq import _block_caches, _cut, _owned

    B, H, T, D = q.shape
    Hkv, E, S = k_hat.shape[1], v.shape[-1], codebook.shape[1]
    G = H // Hkv
    io, acc = q.dtype, torch.float32
    cut = scope == "state"
    # The stream continues the state's partial block; queries exist only for new positions.
    k, v_all, codes_all, p = k_hat, v, codes, 0
    if state is not None:
        p = state.partial_keys.shape[2]
        k = torch.cat([state.partial_keys.to(io), k_hat], dim=2)
        v_all = torch.cat([state.partial_values.to(io), v], dim=2)
        codes_all = torch.cat([state.partial_codes.to(codes.dtype), codes], dim=2)
    P = p + T
    R = -(-P // L)
    N, pad = R * L, R * L - P
    has_prev = state is not None and state.prev_keys is not None
    if has_prev:
        first = (_cut(state.prev_keys, cut).to(io), _cut(state.prev_values, cut).to(io), state.prev_codes)
    else:
        first = (k.new_zeros(B, Hkv, L, D), v.new_zeros(B, Hkv, L, E), codes.new_zeros(B, Hkv, L, *codes.shape[3:]))
    k_ext = F.pad(torch.cat([first[0], k], dim=2), (0, 0, 0, pad))  # [B, Hkv, N + L, D]
    v_ext = F.pad(torch.cat([first[1], v_all], dim=2), (0, 0, 0, pad))
    codes_ext = torch.cat([first[2].to(codes.dtype), codes_all], dim=2)
    codes_ext = F.pad(codes_ext, (0, 0, 0, pad)) if codes.is_floating_point() else F.pad(codes_ext, (0, pad))
    q_blocks = F.pad(q.reshape(B, Hkv, G, T, D), (0, 0, p, pad))  # [B, Hkv, G, N, D]

    if state is not None:
        run_counts = _cut(state.cache_counts.to(acc), cut)
        run = (run_counts, _cut(state.cache_means.to(acc), cut) * run_counts.unsqueeze(-1))
    else:
        run = (q.new_zeros(B, Hkv, S, dtype=acc), q.new_zeros(B, Hkv, S, E, dtype=acc))
    full_blocks = P // L
    prev_codes = codes_ext[:, :, :N].reshape(B, Hkv, R, L, *codes.shape[3:])  # block r's previous block
    prev_v = v_ext[:, :, :N].to(acc).reshape(B, Hkv, R, L, E)
    logn, means, final_cache = _block_caches(prev_codes, prev_v, run, has_prev, full_blocks, scope, S)
    rel = _relative_terms(q_blocks, table, positions_k, scale)

    o = _FusedBlocks.apply(q_blocks, k_ext, v_ext, codebook, logn, means, rel, scale, L, has_prev, not cut)
    out = o[:, :, :, p : p + T]

    stream = (k_ext[:, :, L:], v_ext[:, :, L:], codes_ext[:, :, L:])
    start = full_blocks * L
    if full_blocks >= 1:
        prev = tuple(x[:, :, start - L : start] for x in stream)
        prev = _owned(prev[0].to(acc), prev[1].to(acc), prev[2])
    elif has_prev:
        prev = (state.prev_keys, state.prev_values, state.prev_codes)
    else:
        prev = (None, None, None)
    pieces = {
        "partial": _owned(stream[0][:, :, start:P].to(acc), stream[1][:, :, start:P].to(acc), stream[2][:, :, start:P]),
        "prev": prev,
        "cache": (final_cache[0], mean_values(final_cache[1], final_cache[0])),
    }
    return out, pieces


def _relative_terms(q_blocks, table, positions_k, scale):
    """``b_delta + scale q_i.P_delta`` per row and offset 0..L, ``[B, Hkv, G, N, L + 1]``
    float32 (a broadcast view of the table without position keys), or None."""
    rel = None
    if positions_k is not None:
        rel = (q_blocks.to(torch.float32) * scale) @ positions_k.transpose(-1, -2)
    if table is not None:
        rel = table.unsqueeze(-2) if rel is None else rel + table.unsqueeze(-2)
    if rel is None:
        return None
    B, Hkv, G, N = q_blocks.shape[:4]
    return rel.expand(B, Hkv, G, N, rel.shape[-1])


class _FusedBlocks(torch.autograd.Function):
    """Every block's softmax over (previous block, own block, cache) on the kernels.

    q ``[B, Hkv, G, N, D]``, k ``[B, Hkv, N + L, D]``, v ``[B, Hkv, N + L, E]``, codebook
    ``[Hkv, S, D]``, logn ``[B, Hkv, R, S]``, means ``[B, Hkv, R, S, E]``, rel
    ``[B, Hkv, G, N, L + 1]`` or None -> out ``[B, Hkv, G, N, E]`` in q's dtype.
    ``prev_grad=False`` (grad_scope "state"): no gradient from a block to its previous block.
    """

    @staticmethod
    def forward(ctx, q, k, v, codebook, logn, means, rel, scale, L, has_prev, prev_grad):
        kernels = _kernels()
        q, k, v, codebook = (x.contiguous() for x in (q, k, v, codebook))
        logn, means = logn.contiguous(), means.contiguous()
        out, lse = kernels.forward(q, k, v, codebook, logn, means, rel, scale, L, has_prev)
        ctx.save_for_backward(q, k, v, codebook, logn, means, rel, out, lse)
        ctx.options = (scale, L, has_prev, prev_grad)
        return out

    @staticmethod
    def backward(ctx, d_out):
        kernels = _kernels()
        q, k, v, codebook, logn, means, rel, out, lse = ctx.saved_tensors
        scale, L, has_prev, prev_grad = ctx.options
        needs = ctx.needs_input_grad
        d_out = d_out.contiguous()
        # delta_i = do_i.o_i: the softmax backward's row term, dS = P (dP - delta)
        delta = (d_out.to(torch.float32) * out.to(torch.float32)).sum(-1)
        saved = (q, k, v, codebook, logn, means, rel, d_out, lse, delta)
        dq = dk = dv = d_codebook = d_logn = d_means = d_rel = None
        if needs[0] or needs[6]:
            dq, d_rel = kernels.query_grads(*saved, scale, L, has_prev, rel_grad=needs[6])
            dq = dq.to(q.dtype)
        if needs[1] or needs[2]:
            dk, dv = kernels.window_key_grads(*saved, scale, L, has_prev, prev_grad)
            dk, dv = dk.to(k.dtype), dv.to(v.dtype)
        if needs[3] or needs[4] or needs[5]:
            d_codebook, d_logn, d_means = kernels.cache_grads(*saved, scale, L, means_grad=needs[4] or needs[5])
            d_codebook = d_codebook.to(codebook.dtype)
        return dq, dk, dv, d_codebook, d_logn, d_means, d_rel, None, None, None, None
