"""Attention layers (``nn.Module``s) built on the functional ops, and the VQ quantizer."""

from .attention import Attention
from .codebook import Codebook, kmeans
from .delta_net import DeltaNet
from .fsq import FSQuantizer
from .gated_delta_net import GatedDeltaNet
from .gau import GAU
from .gla import GatedLinearAttention
from .hedgehog import HedgehogFeatureMap
from .linformer import LinformerAttention
from .quantizer import VectorQuantizer
from .retention import MultiScaleRetention
from .short_conv import ShortConvolution
from .vq_heads import MultiHeadVQAttention

__all__ = [
    "Attention", "Codebook", "DeltaNet", "FSQuantizer", "GAU", "GatedDeltaNet", "GatedLinearAttention",
    "HedgehogFeatureMap", "LinformerAttention", "MultiHeadVQAttention", "MultiScaleRetention", "ShortConvolution",
    "VectorQuantizer", "kmeans",
]
