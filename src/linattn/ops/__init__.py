"""Functional attention ops: pure functions on tensors (no parameters inside), one package per
mechanism family.

- ``softmax/``: exact attention (reference, SDPA, tiled online softmax) and the KV cache.
- ``kernel/``: kernel ("linear") attention, its feature maps and its decayed forms.
- ``delta/``: the delta rule and the gated delta rule.
- ``vq/``: Transformer-VQ attention (reference, block schedules, decoding, native and Triton
  kernels) and its soft variant.
- ``sparse/``: sliding-window, strided, LSH and Linformer baselines.
- ``common/``: helpers more than one family uses (bias tables, chunked decay arithmetic).

A family imports another only through that family's package (its ``__init__``), and never
``nn/``, ``models/`` or anything above (``tests/test_layering.py``).
"""
