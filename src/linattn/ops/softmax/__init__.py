"""Exact softmax attention: the materialised reference and torch SDPA (``attention.py``), the
tiled online softmax (``tiled.py``) and the preallocated KV cache of decoding (``kv_cache.py``)."""

from .attention import entropy_scale, softmax_attention

__all__ = ["softmax_attention", "entropy_scale"]
