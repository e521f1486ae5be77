"""Helpers more than one mechanism family uses: relative-position bias tables (``bias.py``:
softmax and Transformer-VQ) and the chunked decay arithmetic (``decay.py``: kernel attention
with decay and the gated delta rule)."""
