"""``train.compile``: each entry of ``LM.layers`` compiled on its own.

Compiling the whole model under DDP or FSDP2 puts their machinery into dynamo's way: DDP's
forward and FSDP2's hooks on every layer break the graph, and the layer loop falls back to
eager. Large-scale trainers compile each block instead, and so does linattn: every layer's
``forward`` is replaced, on the instance, by ``torch.compile`` of it, while the module call
around it (FSDP2's unshard and reshard hooks, DDP's gradient hooks on the parameters) stays
eager, and the LM's own code between the layers (embedding, head, loss) runs eagerly too.
The state dict, the parameters and the module tree are unchanged, so checkpoints,
``gradient_sync`` and the optimizer see the same model.

With activation checkpointing the recomputation must happen inside the compiled block: a
compiled forward recomputed from outside would count its codebook statistics twice
(``nn/quantizer.py``, ``_inside_backward``). So the compiled function is the layer's forward
under non-reentrant ``torch.utils.checkpoint`` (when gradients are on), and
``LM.activation_checkpointing`` is switched off while the layers are compiled; the graph
then holds the recomputation, as ``trainer.compile_model`` arranges for side effects.

``eager()`` runs the layers' plain forwards for a while: the step of a pending k-means
initialisation (no compiled graph holds it) and the evaluations. ``restore()`` puts the
model back as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..models import LM


def _checkpointed(forward: Callable) -> Callable:
    """``forward`` recomputed in backward (non-reentrant checkpointing) when gradients are on."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


class CompiledLayers:
    """The layers of ``model`` compiled one by one (``enabled``; else nothing changes).

    ``compile(fn)`` compiles one layer's forward (``trainer.compile_model`` by default).
    ``checkpointing``: recompute each layer in backward, inside its compiled graph (the
    model's ``activation_checkpointing`` is switched off meanwhile).
    """

    def __init__(self, model: LM, *, enabled: bool, checkpointing: bool, compile: Callable[[Callable], Callable]):
        self.model, self.enabled = model, enabled
        self._restore_checkpointing = model.activation_checkpointing
        self._eager: list[Callable] = []
        self._compiled: list[Callable] = []
        if not enabled:
            return
        model.activation_checkpointing = False
        for layer in model.layers:
            eager = _checkpointed(layer.forward) if checkpointing else layer.forward
            self._eager.append(eager)
            self._compiled.append(compile(eager))
        self._install(self._compiled)

    def _install(self, forwards: list[Callable]) -> None:
        for layer, forward in zip(self.model.layers, forwards):
            layer.forward = forward

    @contextmanager
    def eager(self, when: bool = True) -> Iterator[None]:
        """Within (if ``when``): the layers run their forwards uncompiled (with the same
        checkpointing)."""
        if not (self.enabled and when):
            yield
            return
        self._install(self._eager)
        try:
            yield
        finally:
            self._install(self._compiled)

    def restore(self) -> None:
        """The model as it was: the layers' own ``forward`` methods, its activation checkpointing."""
        if not self.enabled:
            return
        for layer in self.model.layers:
            del layer.forward  # the instance attribute; the class's method shows again
        self.model.activation_checkpointing = self._restore_checkpointing
        self.enabled = False
