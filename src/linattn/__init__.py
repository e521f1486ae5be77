"""linattn: linear-time Transformers for PyTorch.

Functional ops follow the layout of ``torch.nn.functional.scaled_dot_product_attention``:
``q [B, H, T, Dk]``, ``k [B, Hkv, T, Dk]``, ``v [B, Hkv, T, Dv]``, ``H % Hkv == 0``.
"""

from . import feature_maps, models, nn
from .models import LM, LayerKind, LMConfig, register_layer_kind
from .ops.delta import delta_rule
from .ops.kernel import linear_attention
from .ops.softmax import softmax_attention
from .ops.sparse import linformer_attention, local_attention, lsh_attention, strided_attention
from .ops.vq import soft_vq_attention, vq_attention, vq_decode_step
from .nn import Codebook, FSQuantizer, VectorQuantizer
from .state import (DeltaNetState, DeltaRuleState, GatedDeltaNetState, GatedLinearAttentionState, KVCacheState,
                    LinearAttentionState, LMState, RetentionState, VQAttentionState)

__version__ = "0.1.0"

__all__ = [
    "softmax_attention",
    "linear_attention",
    "delta_rule",
    "local_attention",
    "linformer_attention",
    "strided_attention",
    "lsh_attention",
    "vq_attention",
    "vq_decode_step",
    "soft_vq_attention",
    "VectorQuantizer",
    "FSQuantizer",
    "Codebook",
    "VQAttentionState",
    "KVCacheState",
    "LinearAttentionState",
    "DeltaRuleState",
    "DeltaNetState",
    "RetentionState",
    "GatedLinearAttentionState",
    "GatedDeltaNetState",
    "LMState",
    "LM",
    "LMConfig",
    "LayerKind",
    "register_layer_kind",
    "models",
    "feature_maps",
    "nn",
    "__version__",
]
