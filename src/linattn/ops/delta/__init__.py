"""The delta rule (fast weight programmers) and the gated delta rule: the recurrent reference
and the entry (``rule.py``), the chunkwise WY/UT form (``chunk.py``) and the gated forms
(``gated.py``)."""

from .rule import delta_rule

__all__ = ["delta_rule"]
