"""One generated token through a VQ ``GAU``, in few operations.

Decoding a token costs little arithmetic and many operator calls, so a step that goes
through the general layer (``GAU.forward`` -> ``VectorQuantizer`` -> ``vq_attention``)
pays more for reshapes, dtype checks and broadcast matmuls than for the maths. This is
the same computation written for ``[B, 1, d_model]`` on 2-D/3-D tensors: one input
matmul, the nearest code, and one softmax over (previous block, current block, S cache
slots) with the relative terms laid onto the window by a flip and a pad. It handles steps
that do not complete a block; ``GAU.forward`` takes the general path for the others, for
gradients, training mode and half precision, so results equal the general path's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..state import VQAttentionState


class DecodeConstants(NamedTuple):
    """What a decoding step reads from the parameters, derived once (``decode_constants``)."""

    input_t: torch.Tensor  # (W diag(g))^T [d_model, 2 d_k + 2 d_v]: the input norm's gain folded in
    input_shift: torch.Tensor | None  # W b, the input norm's bias (paper variant)
    eps: float
    codebook32_t: torch.Tensor  # [d_k, S] float32, for the nearest code
    code_norms32: torch.Tensor  # [S] float32
    codebook: torch.Tensor  # [S, d_k] in the model dtype
    codebook_t: torch.Tensor  # [d_k, S] in the model dtype
    content_bias: torch.Tensor  # u as it enters the scores
    position_keys_reversed_t: torch.Tensor  # P^T with offsets L .. 0, [d_k, L + 1]
    bias_reversed: torch.Tensor  # (w - u).P_delta for delta = L .. 0
    output_t: torch.Tensor  # W_o^T [d_v, d_model]


_MAPS = ("w_q", "w_k", "w_v", "w_g", "w_o", "w_r")


def decode_constants(unit, dtype: torch.dtype) -> DecodeConstants:
    """Everything a one-token VQ decoding step reads from ``unit``'s parameters, in ``dtype``,
    built once while gradients are off and rebuilt when a parameter or the codebook changes
    (``GAU._cached``). The input norm is folded into the fused input matmul:
    ``norm(x) W^T = rsqrt(mean(x^2) + eps) * (x (W diag(g))^T) + W b``."""
    norm = unit.norm
    modules = unit._modules  # the registries themselves: Module.__getattr__ costs a step's worth
    depends = (*norm._parameters.values(), *(modules[name]._parameters["weight"] for name in _MAPS),
               *unit._parameters.values(), modules["quantizer"]._buffers["codebook"])

    def build() -> DecodeConstants:
        weight = unit._input_weight().to(dtype)
        norm_bias = getattr(norm, "bias", None)  # the paper variant's input norm has one
        codebook32 = unit.quantizer.codebook[0].float()
        position_keys, bias = unit._relative_terms(dtype)
        return DecodeConstants(
            input_t=(weight * norm.weight.to(dtype)).t().contiguous(),
            input_shift=None if norm_bias is None else weight @ norm_bias.to(dtype),
            eps=norm.eps if norm.eps is not None else torch.finfo(dtype).eps,
            codebook32_t=codebook32.t().contiguous(), code_norms32=codebook32.pow(2).sum(-1),
            codebook=codebook32.to(dtype), codebook_t=codebook32.to(dtype).t().contiguous(),
            content_bias=(unit._bias_scale() * unit.content_bias).to(dtype),
            position_keys_reversed_t=position_keys.flip(0).t().contiguous(), bias_reversed=bias.flip(0),
            output_t=unit.w_o.weight.to(dtype).t().contiguous(),
        )

    return unit._cached("decode", build, depends, dtype)


def can_decode_token(unit, x: torch.Tensor, state) -> bool:
    """Whether ``decode_token`` applies: a VQ unit in eval mode, no gradient, one float32
    or float64 token continuing a state whose block it does not complete."""
    return (
        unit.attention == "vq" and x.shape[1] == 1 and isinstance(state, VQAttentionState)
        and not unit.training and not torch.is_grad_enabled() and x.dtype in (torch.float32, torch.float64)
        and state.partial_keys.shape[2] + 1 < unit.block_size and state.partial_keys.dtype == x.dtype
        and (state.prev_keys is None or state.prev_keys.shape[2] == unit.block_size)
        and not torch.is_autocast_enabled(x.device.type)
    )


def _inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dimension, keeping it (a sum is cheaper than a mean)."""
    return torch.rsqrt((x * x).sum(-1, keepdim=True).mul_(1.0 / x.shape[-1]).add_(eps))


def decode_token(unit, x: torch.Tensor, state: VQAttentionState) -> tuple[torch.Tensor, VQAttentionState, dict]:
    """``unit(x, state)`` for ``x [B, 1, d_model]`` when ``can_decode_token`` holds.

    With ``p`` positions in the current block and the previous block present, the window
    columns are (previous block: offsets ``L + p .. p + 1``, current block: ``p .. 0``); the
    relative terms ``r_delta = b_delta + q.P_delta`` (``delta = 0..L``) reversed and left-padded
    by ``p`` zeros line up with them (offsets beyond L get none).
    """
    B, d_k, d_v, L = x.shape[0], unit.d_k, unit.d_v, unit.block_size
    c = decode_constants(unit, x.dtype)
    rows_in = x.view(B, -1)
    projected = torch.mm(rows_in, c.input_t).mul_(_inverse_rms(rows_in, c.eps))  # the input norm, after the matmul
    if c.input_shift is not None:
        projected.add_(c.input_shift)
    qk = projected[:, : 2 * d_k].view(B, 2, d_k)
    qk = qk * _inverse_rms(qk, 1e-6).mul_(d_k ** -0.25)
    q, k = qk[:, 0], qk[:, 1]
    vg = F.silu(projected[:, 2 * d_k :])
    v, gate = vg[:, :d_v], vg[:, d_v:]

    k32 = k if k.dtype == torch.float32 else k.float()
    codes = torch.addmm(c.code_norms32, k32, c.codebook32_t, alpha=-2.0).argmin(-1)  # as nearest_codes
    k_hat = c.codebook.index_select(0, codes)
    k_hat32 = k_hat if k_hat.dtype == torch.float32 else k_hat.float()
    commit = F.mse_loss(k32, k_hat32, reduction="sum") * (unit._modules["quantizer"].commitment_weight / B)
    queries = q + c.content_bias
    p = state.partial_keys.shape[2]
    keys = torch.cat([state.partial_keys.reshape(B, p, d_k), k_hat.view(B, 1, d_k)], dim=1)
    values = torch.cat([state.partial_values.reshape(B, p, d_v), v.reshape(B, 1, d_v)], dim=1)
    rows = queries.view(B, 1, d_k)
    relative = torch.addmm(c.bias_reversed, queries, c.position_keys_reversed_t)  # offsets L .. 0
    pieces = [torch.bmm(rows, keys.transpose(1, 2)).view(B, p + 1)]
    has_prev = state.prev_keys is not None
    if has_prev:
        prev_values = state.prev_values.reshape(B, L, d_v)
        pieces.insert(0, torch.bmm(rows, state.prev_keys.reshape(B, L, d_k).transpose(1, 2)).view(B, L))
        relative = F.pad(relative, (p, 0))
    else:
        relative = relative[:, L - p :]
    window = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
    counts = state.cache_counts.reshape(B, -1)
    cache = torch.addmm(counts.log(), queries, c.codebook_t)  # log 0 = -inf: an empty slot gets no weight
    probs = torch.softmax(torch.cat([window.add_(relative), cache], dim=-1), dim=-1).unsqueeze(1)
    columns = window.shape[-1]
    out = torch.bmm(probs[:, :, columns:], state.cache_means.reshape(B, -1, d_v))
    out = torch.baddbmm(out, probs[:, :, columns - p - 1 : columns], values)
    if has_prev:
        out = torch.baddbmm(out, probs[:, :, :L], prev_values)
    y = torch.mm(out.view(B, d_v) * gate, c.output_t).view(B, 1, -1)

    new_state = VQAttentionState(
        partial_keys=keys.view(B, 1, p + 1, d_k), partial_values=values.view(B, 1, p + 1, d_v),
        partial_codes=torch.cat([state.partial_codes, codes.view(B, 1, 1)], dim=2),
        cache_counts=state.cache_counts, cache_means=state.cache_means, prev_keys=state.prev_keys,
        prev_values=state.prev_values, prev_codes=state.prev_codes, steps=state.steps + 1,
    )
    return y, new_state, {"commit_loss": commit, "codes": codes.view(B, 1, 1)}
