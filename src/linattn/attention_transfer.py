"""Attention transfer (LoLCATs, Zhang et al. 2024): the new parameters of a linearized model's
layers fitted, layer by layer, to the attention outputs of the softmax layers they replace.

For every converted layer l the teacher (the softmax model, frozen) gives, on calibration text,
the input of its attention ``x_l`` (the normed residual stream) and its output ``y_l = attn_l(x_l)``;
the student's attention at l reads the same ``x_l``, so each layer is fitted on its own, and the
loss is ``sum_l mean((attn'_l(x_l) - y_l)^2)``. Only the student's new parameters train (gates,
decays, beta, feature maps, a bias table: whatever the teacher had no tensor for); everything the
student keeps from the teacher stays as it is. Adam, ``steps`` steps of ``batch_size`` calibration
windows drawn at random (seeded). The student runs in eval mode throughout: a VQ layer's codebook
gathers no statistics here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .models import LM


@contextmanager
def _recorded_attention(model: LM, layers: list[int]) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """While open, every forward of ``model`` records ``{layer: (mixer input, mixer output)}`` of the
    ``layers`` (the latest call's)."""
    records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for index in layers:
        def hook(module, inputs, output, _index=index):
            records[_index] = (inputs[0].detach(), output[0].detach())

        handles.append(model.layers[index].mixer.register_forward_hook(hook))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def teacher_attention(teacher: LM, layers: list[int], ids: torch.Tensor
                      ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The teacher's attention inputs and outputs ``{layer: (x [B, T, d], y [B, T, d])}`` on ``ids``."""
    teacher.eval()
    with _recorded_attention(teacher, layers) as records:
        teacher(ids, check_inputs=False)
    return dict(records)


def _layer_losses(student: LM, recorded: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Per layer, the mean squared difference of the student's attention output and the teacher's."""
    losses = {}
    for index, (x, y) in recorded.items():
        out, _, _ = student.layers[index].mixer(x)
        losses[index] = (out.float() - y.float()).pow(2).mean()
    return losses


@torch.no_grad()
def transfer_loss(teacher: LM, student: LM, layers: list[int], ids: torch.Tensor, batch_size: int = 8
                  ) -> dict[int, float]:
    """The attention-transfer loss of each layer of ``layers`` over every window of ``ids [N, T]``
    (the mean over the windows, read ``batch_size`` at a time)."""
    student.eval()
    sums = dict.fromkeys(layers, 0.0)
    for rows in ids.split(batch_size):
        for index, loss in _layer_losses(student, teacher_attention(teacher, layers, rows)).items():
            sums[index] += float(loss) * rows.shape[0]
    return {index: total / ids.shape[0] for index, total in sums.items()}


def new_parameters(student: LM, kept: set[str]) -> dict[str, nn.Parameter]:
    """The student's parameters that it did not take from the teacher (names not in ``kept``)."""
    return {name: parameter for name, parameter in student.named_parameters() if name not in kept}


def attention_transfer(teacher: LM, student: LM, layers: list[int], ids: torch.Tensor, trained: list[nn.Parameter],
                       *, steps: int, lr: float, batch_size: int, seed: int = 0) -> dict:
    """Fit ``trained`` (the new parameters of the ``layers`` of ``student``) to the teacher's attention
    on the windows ``ids [N, T]`` (module docstring). Returns the record the converted run keeps:
    ``layers``, ``parameters`` (how many numbers were fitted), ``steps``, ``lr``, ``batch_size`` and the
    per-layer loss over all windows before and after (``loss_before``, ``loss_after``, by layer)."""
    before = transfer_loss(teacher, student, layers, ids, batch_size)
    flags = {id(p): p.requires_grad for p in student.parameters()}
    chosen = {id(p) for p in trained}
    for parameter in student.parameters():
        parameter.requires_grad_(id(parameter) in chosen)
    optimizer = torch.optim.Adam(trained, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    student.eval()
    try:
        for _ in range(steps):
            rows = ids[torch.randint(ids.shape[0], (min(batch_size, ids.shape[0]),), generator=generator)]
            recorded = teacher_attention(teacher, layers, rows)
            loss = sum(_layer_losses(student, recorded).values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    finally:
        for parameter in student.parameters():
            parameter.requires_grad_(flags[id(parameter)])
    after = transfer_loss(teacher, student, layers, ids, batch_size)
    return {"layers": layers, "parameters": sum(p.numel() for p in trained), "steps": steps, "lr": lr,
            "batch_size": batch_size, "loss_before": {str(i): before[i] for i in layers},
            "loss_after": {str(i): after[i] for i in layers}}
