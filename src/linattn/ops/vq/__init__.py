"""Transformer-VQ attention: softmax over vector-quantized keys in linear time.

Where things are: ``attention.py`` (``vq_attention``, the entry: checks, then the form),
``reference.py`` (the quadratic reference and the encoder form), ``block.py`` (the block
form and its loop schedule), ``batched.py``, ``groups.py``, ``running.py`` and
``schedule.py`` (the batched schedules and ``schedule="auto"``), ``cache.py`` (the code
counts and means), ``relative.py`` (the window's bias and position keys), ``decode.py`` and
``resident.py`` (a few new positions, with and without gradients), ``step.py``
(``vq_decode_step``), ``native.py`` (the C++ kernels' build), ``native_choice.py`` (the C++
decoding step), ``native_block.py`` and ``native_block_check.py`` (the C++ block form without
gradients), ``nearest.py`` (the C++ nearest-code search, ``native_nearest``),
``fused.py``, ``triton_kernels.py``, ``triton_choice.py`` and ``selfcheck.py`` (the Triton
kernels), ``soft.py`` (soft assignments), ``rerope.py`` (ReRoPE's window: its check and the
block form's rotations), ``codebook.py``, ``checks.py`` and ``tensors.py``.
"""

from .attention import vq_attention
from .checks import GRAD_SCOPES
from .checks import check_state as check_vq_state
from .codebook import codebook_scores
from . import nearest as native_nearest
from .reference import vq_attention_weights, windowed_softmax, windowed_weights
from .rerope import check_vq_rerope
from .schedule import SCHEDULES
from .soft import soft_assignments, soft_vq_attention
from .step import vq_decode_step

__all__ = ["vq_attention", "vq_decode_step", "soft_vq_attention", "soft_assignments", "vq_attention_weights",
           "windowed_softmax", "windowed_weights", "codebook_scores", "GRAD_SCOPES", "SCHEDULES", "check_vq_rerope",
           "check_vq_state", "native_nearest"]
