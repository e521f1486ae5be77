"""Kernel ("linear") attention: the entry and its float64 guard (``attention.py``), the forms
without decay (``forms.py``), the decayed forms of RetNet, GLA and Mamba-2 (``decay_forms.py``)
and the feature maps (``feature_maps.py``)."""

from .attention import linear_attention
from .feature_maps import FAVOR, FeatureMap, get_feature_map, normalized_features

__all__ = ["linear_attention", "FeatureMap", "FAVOR", "get_feature_map", "normalized_features"]
