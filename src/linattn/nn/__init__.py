"""Attention layers (``nn.Module``s) built on the functional ops."""

from .attention import Attention
from .delta_net import DeltaNet
from .gau import GAU
from .linformer import LinformerAttention
from .short_conv import ShortConvolution

__all__ = ["Attention", "DeltaNet", "GAU", "LinformerAttention", "ShortConvolution"]
