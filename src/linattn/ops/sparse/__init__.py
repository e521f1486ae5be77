"""Sparse and low-rank baselines: sliding-window (``local.py``), strided and fixed patterns
(``strided.py``), LSH buckets (``lsh.py``) and Linformer's projected keys (``linformer.py``)."""

from .linformer import linformer_attention
from .local import local_attention
from .lsh import lsh_attention
from .strided import strided_attention

__all__ = ["local_attention", "strided_attention", "lsh_attention", "linformer_attention"]
