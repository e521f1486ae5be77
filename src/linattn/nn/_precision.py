"""The context in which a layer runs an op that keeps its own precision."""

from __future__ import annotations

import contextlib

import torch


def outside_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast switched off for ``device_type`` when it is on there (the op then runs on its
    inputs' dtype, with its own float32 sums), and no context at all when it is off: a
    ``torch.autocast(enabled=False)`` region is a subgraph of its own under ``torch.export``, whose
    tensors created inside become constants of the exported program (fake ones, which fail it)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
