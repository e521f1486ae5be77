"""Public home of the kernel-attention feature maps (``linattn.feature_maps.FAVOR`` ...)."""

from .ops.kernel.feature_maps import (
    DPFP,
    FAVOR,
    EluPlusOne,
    Exp,
    FeatureMap,
    Identity,
    ReLU,
    SoftVQ,
    Taylor,
    get_feature_map,
)

__all__ = [
    "FeatureMap", "EluPlusOne", "ReLU", "Identity", "Exp", "FAVOR", "DPFP", "Taylor", "SoftVQ", "get_feature_map",
]
