"""Linformer: keys and values projected along the length axis, then exact softmax.

    K' = E[:, :T] K,   V' = F[:, :T] V          (E, F: [k, max_len])
    out = softmax(scale Q K'^T) V'               ([B, H, T, Dv], O(T k) time and memory)

Every projected key mixes all positions, future ones included, so there is no causal
form; sequences longer than ``max_len`` have no projection columns. Using the first T
columns of E and F equals zero-padding the sequence to ``max_len``.
"""

from __future__ import annotations

import torch

from ..._checks import check_qkv, check_same_dtype_device, check_tensor, compute_dtype, resolve_scale


def linformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    E: torch.Tensor,
    F: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Low-rank (Linformer) attention: ``softmax(scale Q (E K)^T) (F V)`` over k projected positions.

    Args:
        q: the queries, ``[B, H, T, Dk]``.
        k: the keys, ``[B, Hkv, T, Dk]``, ``H % Hkv == 0``.
        v: the values, ``[B, Hkv, T, Dv]``.
        E: the projection of the keys along the length, ``[k, max_len]`` (shared by all heads)
            or ``[Hkv, k, max_len]``; its first T columns are used (``T <= max_len``).
        F: the projection of the values, shaped as ``E``.
        causal: must be False: every projected key mixes all positions, so there is no causal
            form (True is refused with an error saying so).
        scale: score scale, ``None`` = ``Dk^-1/2``.

    Returns:
        ``[B, H, T, Dv]`` in q's dtype.
    """
    if causal:
        raise ValueError(
            "linformer_attention has no causal form: each projected key E K mixes every position, "
            "future ones included; use causal=False (encoders) or another mechanism for decoders"
        )
    shapes = check_qkv(q, k, v)
    B, H, Hkv, T = shapes.batch, shapes.heads, shapes.kv_heads, shapes.length
    for name, P in (("E", E), ("F", F)):
        check_tensor(name, P)
        check_same_dtype_device(q=q, **{name: P})
        if P.dim() not in (2, 3) or (P.dim() == 3 and P.shape[0] != Hkv):
            raise ValueError(f"{name} has shape {list(P.shape)}, expected [k, max_len] or [{Hkv}, k, max_len]")
        if P.shape[-1] < T:
            raise ValueError(f"sequence length T={T} exceeds max_len={P.shape[-1]} of {name} (shape {list(P.shape)})")
    if E.shape[-2] != F.shape[-2]:
        raise ValueError(f"E projects to {E.shape[-2]} positions but F to {F.shape[-2]}; they must match")
    dtype = compute_dtype(q.dtype)
    G = shapes.group_size
    keys = E[..., :T].to(dtype) @ k.to(dtype)  # [B, Hkv, k, Dk]
    values = F[..., :T].to(dtype) @ v.to(dtype)
    qf = q.to(dtype).reshape(B, Hkv, G, T, -1) * resolve_scale(scale, shapes.key_dim)
    scores = qf @ keys.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, T, k]
    out = torch.softmax(scores, dim=-1) @ values.unsqueeze(2)
    return out.reshape(B, H, T, -1).to(q.dtype)
