"""Language models built from the attention layers: ``LMConfig`` and ``LM``."""

from .config import LAYER_SPEC_HELP, LayerSpec, LMConfig, parse_layer_spec
from .lm import LM
from .sampling import sample_next

__all__ = ["LM", "LMConfig", "LayerSpec", "parse_layer_spec", "sample_next", "LAYER_SPEC_HELP"]
