"""Language models built from the attention layers: ``LMConfig`` and ``LM``."""

from .config import LMConfig, uses_heads
from .layers import LayerKind, LayerSpec, layer_kinds, layer_spec_help, parse_layer_spec, register_layer_kind
from .lm import LM
from .sampling import sample_next

__all__ = ["LM", "LMConfig", "LayerKind", "LayerSpec", "layer_kinds", "layer_spec_help", "parse_layer_spec",
           "register_layer_kind", "sample_next", "uses_heads"]
