"""Whether a tensor was written since it was last seen: its version counter, where it has one."""

import torch


def tensor_version(tensor: torch.Tensor) -> int | None:
    """``tensor._version`` (bumped by every in-place write), or None for an inference tensor
    (made under ``torch.inference_mode``), which keeps no version counter: a write to it cannot
    be seen, so whatever was derived from it must not be reused."""
    return None if tensor.is_inference() else tensor._version
