"""The checks of ``vq_attention``'s and ``vq_decode_step``'s arguments and carried states.
"""

from __future__ import annotations

import torch

from ...state import VQAttentionState
from . import nearest as native_nearest
from ..._checks import (
    check_bool,
    check_choice,
    check_positive_int,
    check_qkv,
    check_same_dtype_device,
    check_state_setting,
    check_state_tensor,
    check_tensor,
    compute_dtype,
)


MODES = ("parallel", "block")


GRAD_SCOPES = ("cache", "state", "none")


def resolve_grad_scope(grad_scope, cache_grad) -> str:
    """The effective gradient scope from ``grad_scope`` and the older ``cache_grad`` alias."""
    check_choice("grad_scope", grad_scope, GRAD_SCOPES)
    if cache_grad is None:
        return grad_scope
    check_bool("cache_grad", cache_grad)
    implied = "none" if cache_grad else "cache"
    if grad_scope not in ("cache", implied):
        raise ValueError(f"cache_grad={cache_grad} means grad_scope={implied!r}, which contradicts "
                         f"grad_scope={grad_scope!r}; pass grad_scope alone")
    return implied


def check_codebook(codebook, Hkv: int, Dk: int, like: torch.Tensor) -> torch.Tensor:
    """A codebook ``[Hkv, S, Dk]`` in the dtype and on the device of ``like`` (q)."""
    codebook = check_tensor("codebook", codebook, ndim=3, layout="[kv_heads, codebook_size, key_dim]")
    check_same_dtype_device(q=like, codebook=codebook)
    if codebook.shape[0] != Hkv or codebook.shape[2] != Dk:
        raise ValueError(f"codebook has shape {list(codebook.shape)}, expected [{Hkv}, S, {Dk}]")
    return codebook


def check_codes(codes, codebook, B, Hkv, T, like):
    """Hard codes ``[B, Hkv, T]`` (int64) or soft assignment weights ``[B, Hkv, T, S]``."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be an int64 tensor [B, Hkv, T], got {type(codes).__name__}")
    if codes.device != like.device:
        raise ValueError(f"codes is on {codes.device} but q is on {like.device}")
    if codes.is_floating_point():
        S = codebook.shape[1]
        if tuple(codes.shape) != (B, Hkv, T, S):
            raise ValueError(f"soft codes have shape {list(codes.shape)}, expected [{B}, {Hkv}, {T}, {S}]")
        return codes.to(compute_dtype(like.dtype)), codebook
    if codes.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"codes must be an int64 tensor [B, Hkv, T], got dtype {codes.dtype}")
    if tuple(codes.shape) != (B, Hkv, T):
        raise ValueError(f"codes has shape {list(codes.shape)}, expected [{B}, {Hkv}, {T}]")
    return codes.long(), codebook


def check_codes_match_keys(codes: torch.Tensor, codebook: torch.Tensor, k_hat: torch.Tensor) -> None:
    """Hard codes lie in ``[0, S)`` and ``k_hat[b, h, t] == codebook[h, codes[b, h, t]]``."""
    S = codebook.shape[1]
    low, high = torch.aminmax(codes)
    if low < 0 or high >= S:
        raise ValueError(f"codes must lie in [0, {S}) (codebook_size S = {S}), got values in [{int(low)}, {int(high)}]")
    if native_nearest.keys_are_codes(k_hat, codes, codebook):  # None where the kernel does not run
        return
    looked_up = torch.gather(codebook.unsqueeze(0).expand(codes.shape[0], -1, -1, -1), 2,
                             codes.unsqueeze(-1).expand(*codes.shape, codebook.shape[-1]))
    if not torch.equal(looked_up, k_hat.detach()):
        gap = (looked_up - k_hat.detach()).abs().max().item()
        raise ValueError(
            f"k_hat must equal codebook[h, codes] (the quantized keys); they differ by up to {gap:.3g}. "
            "Pass the keys VectorQuantizer returns, or check_inputs=False if they differ on purpose"
        )


def check_arguments(q, k_hat, v, codes, codebook, causal, mode, block_size, bias, position_keys, initial_state,
                     output_final_state):
    """Every check of ``vq_attention``'s arguments; returns the normalised ``(codes, codebook)``."""
    check_bool("causal", causal)
    shapes = check_qkv(q, k_hat, v, key_name="k_hat")
    check_choice("mode", mode, (None,) + MODES)
    check_positive_int("block_size", block_size)
    B, Hkv, T = shapes.batch, shapes.kv_heads, shapes.length
    Dk, Dv, L = shapes.key_dim, shapes.value_dim, block_size
    codes, codebook = check_codes(codes, check_codebook(codebook, Hkv, Dk, q), B, Hkv, T, q)
    S = codebook.shape[1]
    if not codes.is_floating_point():
        check_codes_match_keys(codes, codebook, k_hat)
    if not causal and (bias is not None or position_keys is not None):
        raise ValueError(
            "bias and position_keys act on the causal window 0 <= i - j <= block_size; not defined for causal=False"
        )
    if (mode or "block") == "parallel" and (initial_state is not None or output_final_state):
        raise ValueError("mode='parallel' is the stateless reference; use mode='block' to carry a state")
    if initial_state is None:
        return codes, codebook
    check_state(initial_state, B, Hkv, Dk, Dv, L, S, q, soft=codes.is_floating_point())
    return codes, codebook


def check_state(state: object, B: int, Hkv: int, Dk: int, Dv: int, L: int, S: int, like: torch.Tensor, *,
                 soft: bool) -> None:
    """A carried ``VQAttentionState`` continues this call: made with block size ``L`` and
    codebook size ``S`` (when it records them), ``B`` rows, and tensors of the shapes these
    inputs give (``soft``: soft assignments ``[B, Hkv, p, S]`` in the ``*_codes`` fields,
    else hard codes ``[B, Hkv, p]``)."""
    name = "initial_state"
    if not isinstance(state, VQAttentionState):
        raise TypeError(f"{name} must be a VQAttentionState, got {type(state).__name__}")
    s = state
    check_state_setting(name, "block_size", s.block_size, L)
    check_state_setting(name, "codebook_size", s.codebook_size, S)
    if isinstance(s.cache_counts, torch.Tensor) and s.cache_counts.dim() == 3 and s.cache_counts.shape[2] != S:
        raise ValueError(f"{name}.cache_counts has {s.cache_counts.shape[2]} slots (shape "
                         f"{list(s.cache_counts.shape)}): the state was made with codebook_size="
                         f"{s.cache_counts.shape[2]}, but this call has codebook_size={S}")
    check_state_tensor(f"{name}.cache_counts", s.cache_counts, (B, Hkv, S), like)
    check_state_tensor(f"{name}.cache_means", s.cache_means, (B, Hkv, S, Dv), like)
    p = s.partial_keys.shape[2] if isinstance(s.partial_keys, torch.Tensor) and s.partial_keys.dim() == 4 else -1
    if not 0 <= p < L:
        raise ValueError(f"{name}.partial_keys must hold 0..{L - 1} positions for block_size={L}, got shape "
                         f"{list(getattr(s.partial_keys, 'shape', ()))}")
    check_state_tensor(f"{name}.partial_keys", s.partial_keys, (B, Hkv, p, Dk), like)
    check_state_tensor(f"{name}.partial_values", s.partial_values, (B, Hkv, p, Dv), like)
    _check_state_codes(f"{name}.partial_codes", s.partial_codes, (B, Hkv, p), S, soft, like)
    if s.prev_keys is not None:
        if isinstance(s.prev_keys, torch.Tensor) and s.prev_keys.dim() == 4 and s.prev_keys.shape[2] != L:
            raise ValueError(f"{name}.prev_keys holds a block of {s.prev_keys.shape[2]} positions: the state was "
                             f"made with block_size={s.prev_keys.shape[2]}, but this call has block_size={L}")
        check_state_tensor(f"{name}.prev_keys", s.prev_keys, (B, Hkv, L, Dk), like)
        check_state_tensor(f"{name}.prev_values", s.prev_values, (B, Hkv, L, Dv), like)
        _check_state_codes(f"{name}.prev_codes", s.prev_codes, (B, Hkv, L), S, soft, like)


def _check_state_codes(name: str, codes: object, shape: tuple[int, ...], S: int, soft: bool,
                       like: torch.Tensor) -> None:
    """A state's codes: ``shape`` for hard codes, ``shape + (S,)`` for soft assignments (their
    dtype is not checked: ``.to(dtype)`` casts hard codes too, a step casts them back)."""
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(codes).__name__}")
    expected = (*shape, S) if soft else shape
    if tuple(codes.shape) != expected:
        kind = "soft assignments (soft_vq_attention)" if soft else "hard codes (vq_attention)"
        raise ValueError(f"{name} has shape {list(codes.shape)}, expected {kind} of shape {list(expected)}")
    if codes.device != like.device:
        raise ValueError(f"{name} is on {codes.device} but the inputs are on {like.device}")


def check_step(q, k, v, codebook, state, block_size) -> None:
    """Every check of ``vq_decode_step``'s arguments: one position, a codebook of at least one
    code, and a state that continues these inputs."""
    shapes = check_qkv(q, k, v)
    if shapes.length != 1:
        raise ValueError(f"q has {shapes.length} positions (shape {list(q.shape)}); vq_decode_step takes one, "
                         "[B, H, 1, Dk] (vq_attention reads longer inputs)")
    check_positive_int("block_size", block_size)
    B, Hkv, Dk, Dv = shapes.batch, shapes.kv_heads, shapes.key_dim, shapes.value_dim
    codebook = check_codebook(codebook, Hkv, Dk, q)
    if codebook.shape[1] == 0:
        raise ValueError(f"codebook has shape {list(codebook.shape)}, expected [{Hkv}, S, {Dk}] with S >= 1")
    if state is not None:
        check_state(state, B, Hkv, Dk, Dv, block_size, codebook.shape[1], q, soft=False)
