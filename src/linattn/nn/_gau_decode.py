"""One generated token through a VQ ``GAU``, in few operations.

Decoding a token costs little arithmetic and many operator calls, so a step that goes
through the general layer (``GAU.forward`` -> ``VectorQuantizer`` -> ``vq_attention``)
pays more for reshapes, dtype checks and broadcast matmuls than for the maths. This is
the same computation written for ``[B, 1, d_model]`` on 2-D/3-D tensors: one input
matmul, the nearest code, and one softmax over (previous block, current block, S cache
slots) read from the state's resident buffer (``ops/vq/resident.py``: the new key and
value are written into it in place, the scores are one matmul). On a CPU the whole unit,
from the input norm to the output matmul, is one call of the native ``vq_gau_step``
(``ops/common/native.py``, chosen as ``vq_decode_step(impl="auto")`` chooses the native step;
``LINATTN_VQ_STEP_IMPL=torch`` takes the torch form). A unit with ReRoPE has no relative
terms: its query scores the window's keys nearer than w turned by their distance and every
other column by ``R(w) q`` (``ops/vq/rerope.py``). A unit with finite scalar quantization
(``attention="fsq"``) takes its key's grid point as the code (``nn/fsq.py``) instead of the
nearest code, and has no commitment loss; a soft-VQ unit (``attention="soft-vq"``) writes its key's
soft assignment and soft key instead (``ops/vq/soft.py``). ``GAU.forward`` takes the
general path for gradients, training mode, half precision and submodules that are not
plain (a PEFT LoRA layer, a subclass, a forward hook); results equal its.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .._checks import compute_dtype
from ..ops.common.native import extension
from ..ops.common.rotary import far_queries, rotary_frequencies
from ..ops.vq.native_choice import use_native
from ..ops.vq.resident import HARD_CODES, add_near_window, state_after, window_for
from ..ops.vq.soft import soft_assignments
from ..state import VQAttentionState
from .fsq import FSQuantizer


class DecodeConstants(NamedTuple):
    """What a decoding step reads from the parameters, derived once (``decode_constants``)."""

    input_t: torch.Tensor  # (W diag(g))^T [d_model, 2 d_k + 2 d_v]: the input norm's gain folded in
    input_shift: torch.Tensor | None  # W b, the input norm's bias (paper variant)
    eps: float
    codebook32_t: torch.Tensor | None  # [d_k, S] float32, for the nearest code (None: a softmax unit's)
    code_norms32: torch.Tensor | None  # [S] float32
    codebook: torch.Tensor | None  # [S, d_k] in the model dtype
    content_bias: torch.Tensor  # u as it enters the scores
    position_keys_reversed_t: torch.Tensor  # P^T with offsets L .. 0, [d_k, L + 1]
    bias_reversed: torch.Tensor  # (w - u).P_delta for delta = L .. 0
    output_t: torch.Tensor  # W_o^T [d_v, d_model]
    native_search_t: torch.Tensor | None  # codebook32_t as [1, d_k, S]: the native step's one kv head
    native_norms: torch.Tensor | None  # code_norms32 as [1, S]
    native_codebook_t: torch.Tensor | None  # [1, d_k, S] in the model dtype (native_search_t itself in float32)
    rerope: int  # ReRoPE's w (0: none; then content_bias, the position keys and the bias are zeros)
    rerope_frequencies: torch.Tensor | None  # [d_k / 2] in the model dtype, with ReRoPE
    fsq: list[torch.Tensor]  # an FSQ unit's w_in [d, d_k], half, offset, shift, radius [d], radix [d] int64; else []
    soft_temperature: float  # a soft-VQ unit's temperature (0: hard codes)


_MAPS = ("w_q", "w_k", "w_v", "w_g", "w_o")
_CODEBOOK_FIELDS = ("codebook32_t", "code_norms32", "codebook", "native_search_t", "native_norms", "native_codebook_t")


def _maps(unit) -> tuple[str, ...]:
    """The linear maps a step reads: the relative position map ``w_r`` too unless ReRoPE replaces it."""
    return _MAPS if unit.rerope is not None else (*_MAPS, "w_r")


def _reads(unit) -> tuple[str, ...]:
    """The submodules a step reads instead of calling (a softmax unit has no quantizer)."""
    return (*_maps(unit), "norm", *(("quantizer",) if unit.quantizer is not None else ()))


def reads_plainly(unit) -> bool:
    """Whether every submodule a step reads is plain (``GAU._reads_plainly``)."""
    return unit._reads_plainly(_reads(unit))


def decode_constants(unit, dtype: torch.dtype) -> DecodeConstants:
    """Everything a one-token VQ decoding step reads from ``unit``'s parameters, in ``dtype``,
    built once while gradients are off and rebuilt when a parameter or the codebook changes
    (``GAU._cached``). The input norm is folded into the fused input matmul:
    ``norm(x) W^T = rsqrt(mean(x^2) + eps) * (x (W diag(g))^T) + W b``."""
    norm = unit.norm
    modules = unit._modules  # the registries themselves: Module.__getattr__ costs a step's worth
    depends = (*norm._parameters.values(), *(modules[name]._parameters["weight"] for name in _maps(unit)),
               *unit._parameters.values(), *_codebook_tensors(modules.get("quantizer")))

    def build() -> DecodeConstants:
        weight = unit._input_weight().to(dtype)
        norm_bias = getattr(norm, "bias", None)  # the paper variant's input norm has one
        books = dict.fromkeys(_CODEBOOK_FIELDS)  # a softmax unit has none
        if unit.attention != "softmax":
            codebook = unit_codebook(unit)[0].detach()  # float32 for VQ; FSQ's and soft VQ's in the weights' dtype
            codebook32 = codebook.float()
            search_t, norms, book = codebook32.t().contiguous(), codebook32.pow(2).sum(-1), codebook.to(dtype)
            books.update(codebook32_t=search_t, code_norms32=norms, codebook=book,
                         native_search_t=search_t.unsqueeze(0), native_norms=norms.unsqueeze(0),
                         native_codebook_t=book.t().contiguous().unsqueeze(0))
        if unit.rerope is None:
            position_keys, bias = unit._relative_terms(dtype)
            content_bias = (unit._bias_scale() * unit.content_bias).to(dtype)
        else:  # ReRoPE replaces the relative terms: zeros of their shapes, read by nothing
            position_keys = weight.new_zeros(unit.block_size + 1, unit.d_k)
            bias, content_bias = weight.new_zeros(unit.block_size + 1), weight.new_zeros(unit.d_k)
        return DecodeConstants(
            input_t=(weight * norm.weight.to(dtype)).t().contiguous(),
            input_shift=None if norm_bias is None else weight @ norm_bias.to(dtype),
            eps=norm_eps(norm, dtype),
            content_bias=content_bias,
            position_keys_reversed_t=position_keys.flip(0).t().contiguous(), bias_reversed=bias.flip(0),
            output_t=unit.w_o.weight.to(dtype).t().contiguous(),
            rerope=unit.rerope or 0,
            rerope_frequencies=None if unit.rerope is None else rotary_frequencies(unit.d_k, unit.rotary_base,
                                                                                   dtype=dtype),
            fsq=_fsq_tensors(unit.quantizer, dtype),
            soft_temperature=float(unit.temperature) if unit.attention == "soft-vq" else 0.0,
            **books,
        )

    return unit._cached("decode", build, depends, dtype)


def _codebook_tensors(quantizer) -> tuple[torch.Tensor, ...]:
    """What a quantizer's codebook is made of: a ``VectorQuantizer``'s buffer, an ``FSQuantizer``'s
    projections (nothing for a softmax unit's None)."""
    if quantizer is None:
        return ()
    if isinstance(quantizer, FSQuantizer):
        return quantizer.w_in, quantizer.w_out
    return (quantizer._buffers["codebook"],)


def _fsq_tensors(quantizer, dtype: torch.dtype) -> list[torch.Tensor]:
    """An ``FSQuantizer``'s code of a key as the native step computes it (``vq_gau_step.cpp``), else []."""
    if not isinstance(quantizer, FSQuantizer):
        return []
    half, offset, shift, radius = quantizer._constants(dtype, quantizer.w_in.device)
    return [quantizer.w_in[0].to(dtype).contiguous(), half, offset, shift, radius, quantizer._radix]


def unit_codebook(unit) -> torch.Tensor:
    """The codebook ``[Hkv, S, d_k]`` of a VQ unit or attention as it is held (the same tensor while it
    is unchanged: a buffer's rows 2L.. copy it): a soft-VQ unit's parameter, its quantizer's otherwise."""
    if getattr(unit, "attention", None) == "soft-vq":
        return unit._parameters["codebook"]
    quantizer = unit._modules["quantizer"]
    return quantizer.codebook if isinstance(quantizer, FSQuantizer) else quantizer._buffers["codebook"]


def code_like(unit, dtype: torch.dtype) -> torch.Tensor:
    """What the unit's states hold as codes (``window_for``'s ``code_like``): soft assignments in
    ``dtype`` for a soft-VQ unit, hard codes otherwise."""
    return torch.zeros((), dtype=dtype) if getattr(unit, "attention", None) == "soft-vq" else HARD_CODES


def norm_eps(norm, dtype: torch.dtype) -> float:
    """The eps an RMS norm computes with: its own, or ``dtype``'s machine epsilon when it has
    none (as ``F.rms_norm``)."""
    return norm.eps if norm.eps is not None else torch.finfo(dtype).eps


def can_decode_token(unit, x: torch.Tensor, state) -> bool:
    """Whether ``decode_token`` applies: a VQ, FSQ or soft-VQ unit (with or without ReRoPE) in eval mode, no
    gradient, one float32 or float64 token continuing a state of this unit's block size, and plain submodules
    (``GAU._reads_plainly``: a step reads their parameters, so a PEFT adapter, a subclass
    or a forward hook sends the token down the general path, which calls them)."""
    return (
        unit.attention in ("vq", "fsq", "soft-vq") and x.shape[1] == 1 and isinstance(state, VQAttentionState)
        and not unit.training and not torch.is_grad_enabled() and x.dtype in (torch.float32, torch.float64)
        and state.partial_keys.shape[2] < unit.block_size and state.partial_keys.dtype == x.dtype
        and (state.prev_keys is None or state.prev_keys.shape[2] == unit.block_size)
        and not torch.is_autocast_enabled(x.device.type) and unit._reads_plainly(_reads(unit))
    )


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dimension, keeping it (one reduction, no
    temporary of x's size)."""
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()


def decode_token(unit, x: torch.Tensor, state: VQAttentionState) -> tuple[torch.Tensor, VQAttentionState, dict]:
    """``unit(x, state)`` for ``x [B, 1, d_model]`` when ``can_decode_token`` holds.

    The buffer's columns are (previous block, current block, S codes); the new token sits at
    column ``L + p``, so columns ``p .. L + p`` have offsets ``L .. 0`` and take the relative
    terms ``r_delta = b_delta + q.P_delta`` reversed (offsets beyond L get none). On a CPU
    (``use_native``) the whole unit is one call of the native ``vq_gau_step``; else the torch
    form below, which is also its reference.
    """
    B, L = x.shape[0], unit.block_size
    c = decode_constants(unit, x.dtype)
    p = state.partial_keys.shape[2]
    window = window_for(state, L, unit_codebook(unit), (B, 1, unit.d_k, unit.d_v), code_like(unit, x.dtype), x.dtype)
    if use_native("auto", x.device, x.dtype):
        y, codes, commit = _native_unit(unit, c, x, window, L, p)
    else:
        y, codes, commit = _torch_unit(unit, c, x, window, L, p)
    window.written = p + 1
    new_state = state_after(window, p + 1, state.prev_keys is not None, state.steps + 1)
    return y, new_state, {"commit_loss": commit, "codes": None if c.soft_temperature else codes.view(B, 1, 1)}


def _torch_unit(unit, c: DecodeConstants, x: torch.Tensor, window, L: int, p: int):
    """``decode_token``'s unit in torch operations: ``(y [B, 1, d_model], codes [B], commit)``,
    the new position written into ``window``'s row ``L + p``."""
    B, d_k, d_v = x.shape[0], unit.d_k, unit.d_v
    rows_in = x.view(B, -1)
    projected = torch.mm(rows_in, c.input_t).mul_(inverse_rms(rows_in, c.eps))  # the input norm, after the matmul
    if c.input_shift is not None:
        projected.add_(c.input_shift)
    qk = projected[:, : 2 * d_k].view(B, 2, d_k)
    qk = qk * inverse_rms(qk, 1e-6).mul_(d_k ** -0.25)
    q, k = qk[:, 0], qk[:, 1]
    vg = F.silu(projected[:, 2 * d_k :])
    v, gate = vg[:, :d_v], vg[:, d_v:]
    if c.soft_temperature:  # the soft assignment and the soft key
        codes = soft_assignments(k.view(B, 1, 1, d_k), c.codebook.unsqueeze(0), c.soft_temperature).view(B, -1)
        k_hat = codes @ c.codebook
    else:
        if c.fsq:
            codes = unit._modules["quantizer"](k.view(B, 1, 1, d_k))[1].view(B)
        else:
            k32 = k if k.dtype == torch.float32 else k.float()
            codes = torch.addmm(c.code_norms32, k32, c.codebook32_t, alpha=-2.0).argmin(-1)  # as nearest_codes
        k_hat = c.codebook.index_select(0, codes)
    window.append_one(p, k_hat, v, codes)
    if c.rerope:  # every column by R(w) q, then the window's columns nearer than w by their turn of q
        rerope = (c.rerope, unit.rotary_base)
        scores = torch.baddbmm(window.mask3, far_queries(q.view(B, 1, d_k), *rerope), window.keys_t)
        add_near_window(scores.view(B, 1, 1, 1, -1), q.view(B, 1, 1, 1, d_k), window, L + p + 1, rerope)
    else:
        queries = q + c.content_bias
        relative = torch.addmm(c.bias_reversed, queries, c.position_keys_reversed_t)  # offsets L .. 0
        scores = torch.baddbmm(window.mask3, queries.view(B, 1, d_k), window.keys_t)  # [B, 1, 2L + S]
        scores.narrow(2, p, L + 1).add_(relative.view(B, 1, L + 1))  # columns p .. L + p: offsets L .. 0
    out = torch.bmm(torch.softmax(scores, dim=-1), window.values3)
    if c.soft_temperature:  # the general layer's zero
        commit = x.new_zeros(())
    elif c.fsq:  # FSQuantizer's: none
        commit = k.new_zeros((), dtype=torch.float32)
    else:
        wide = compute_dtype(k.dtype)  # the quantizer's: float32, float64 for float64 keys
        weight = unit._modules["quantizer"].commitment_weight
        commit = F.mse_loss(k.to(wide), k_hat.to(wide), reduction="sum") * (weight / B)
    y = torch.mm(out.view(B, d_v) * gate, c.output_t).view(B, 1, -1)
    return y, codes, commit


def _native_unit(unit, c: DecodeConstants, x: torch.Tensor, window, L: int, p: int):
    """``_torch_unit`` as one call of the native ``vq_gau_step`` (``ops/vq/_native/vq_gau_step.cpp``)."""
    B, d_model = x.shape[0], x.shape[2]
    y = x.new_empty(B, 1, d_model)
    codes = torch.empty(B, 1, dtype=torch.int64, device=x.device)
    commit = x.new_empty(())
    weight = 0.0 if c.fsq or c.soft_temperature else unit._modules["quantizer"].commitment_weight
    extension().vq_gau_step(
        x.reshape(B, d_model).contiguous(), c.input_t, c.input_shift, c.eps, c.content_bias, c.position_keys_reversed_t,
        c.bias_reversed, c.output_t, c.native_search_t, c.native_norms, c.native_codebook_t, window.keys,
        window.values, window.codes, window.mask, L, p, window.keys_are_codes, weight, c.rerope, c.rerope_frequencies,
        c.fsq, c.soft_temperature, y.view(B, d_model), codes, commit)
    return y, codes, (commit.new_zeros((), dtype=torch.float32) if c.fsq else commit)
