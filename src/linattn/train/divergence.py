"""The divergence guard: a step whose loss, commitment loss or gradient norm is not finite is
never applied, and the run stops (or, if asked, skips a bounded number of such steps).

The guard watches the three numbers on the device, so it adds no host round trip to a
step. The optimizer's update is gated there too: the trainer's AdamW is the fused one, whose
step takes ``found_inf`` (the protocol of ``torch.amp.GradScaler``): with it set, parameters,
moments and step counts stay as they were. The codebook EMA is gated the same way
(``LM.update_codebooks(apply=...)``).

- ``max_skipped=0`` (``train.max_skipped_steps``, the default): the first non-finite step and
  every step after it are left unapplied; the trainer reads the guard where it reads values
  anyway (the log line, an evaluation, a checkpoint, the end) and stops there with
  ``TrainingDiverged``, before writing anything of the diverged run.
- ``max_skipped=N > 0``: each non-finite step is skipped (its update and codebook statistics
  dropped, the carried state reset) and counted; the run stops once more than ``N``
  consecutive steps were skipped. Deciding to reset the carried state reads one flag per
  step (a host sync on a GPU).
"""

from __future__ import annotations

import torch

from . import distributed

QUANTITIES = ("loss", "commitment loss", "gradient norm")


class TrainingDiverged(RuntimeError):
    """Training stopped because a step's loss, commitment loss or gradient norm was not finite.

    ``step``: the first such step; ``what``: the names of the quantities that were not
    finite; ``last_checkpoint``: the newest checkpoint written before it (None if none).
    """

    def __init__(self, message: str, *, step: int, what: list[str], last_checkpoint: str | None) -> None:
        super().__init__(message)
        self.step, self.what, self.last_checkpoint = step, what, last_checkpoint

    def __reduce__(self):
        """Pickled with its fields, so that a worker process can hand it to its parent
        (``linattn bench train`` trains in fresh processes)."""
        return _diverged, (self.args[0], self.step, self.what, self.last_checkpoint)


def _diverged(message: str, step: int, what: list[str], last_checkpoint: str | None) -> TrainingDiverged:
    return TrainingDiverged(message, step=step, what=what, last_checkpoint=last_checkpoint)


class NonFiniteGuard:
    """Per-step watch over ``QUANTITIES`` on ``device``; see the module docstring."""

    def __init__(self, device: torch.device, max_skipped: int = 0) -> None:
        self.max_skipped = max_skipped
        self.found = torch.zeros((), dtype=torch.float32, device=device)  # stop mode: 1 once a step went bad
        self.first_step = torch.zeros((), dtype=torch.int64, device=device)
        self.first_what = torch.zeros(len(QUANTITIES), dtype=torch.bool, device=device)
        self.skipped, self.consecutive = 0, 0

    def observe(self, step: int, loss: torch.Tensor, commit_loss: torch.Tensor, grad_norm: torch.Tensor,
                context: distributed.Context | None = None) -> torch.Tensor:
        """Record step ``step``'s numbers; returns the float32 ``found_inf`` flag for the
        optimizer (1: leave this step unapplied). Reads nothing on the host. With several
        processes (``context``) the verdict is summed over them, so a loss that is not finite
        on one process leaves the step unapplied on all. Under FSDP the gradient norm is a
        replicated ``DTensor``; its local value is the norm."""
        if hasattr(grad_norm, "to_local"):
            grad_norm = grad_norm.to_local()
        bad = ~torch.stack([loss.isfinite(), commit_loss.isfinite(), grad_norm.isfinite()])
        if context is not None and context.distributed:
            bad = distributed.all_reduce_sum(bad.float(), context) > 0
        step_bad = bad.any()
        if self.max_skipped:
            self.first_what = bad  # what() names this step's quantities; the trainer knows the step
            return step_bad.float()
        new = step_bad & (self.found == 0)
        self.first_step = torch.where(new, torch.full_like(self.first_step, step), self.first_step)
        self.first_what = torch.where(new, bad, self.first_what)
        self.found = torch.maximum(self.found, step_bad.float())
        return self.found

    def what(self) -> list[str]:
        """The quantities that were not finite at the recorded step (reads the device)."""
        return [name for name, bad in zip(QUANTITIES, self.first_what.tolist()) if bad]

    def diverged(self, context: distributed.Context) -> bool:
        """Stop mode: whether a step went non-finite on any process (reads the device)."""
        flag = self.found.detach().clone().reshape(1)
        return bool(distributed.all_reduce_sum(flag, context).item() > 0)

    def skip(self, found_inf: torch.Tensor) -> bool:
        """Skip mode: whether this step was skipped (reads the flag); counts it, and raises
        nothing: the trainer stops when ``too_many_skipped``."""
        skipped = bool(found_inf.item() > 0)
        self.consecutive = self.consecutive + 1 if skipped else 0
        self.skipped += skipped
        return skipped

    @property
    def too_many_skipped(self) -> bool:
        return self.consecutive > self.max_skipped


def diverged_message(step: int, what: list[str], *, last_step: int, last_checkpoint: str | None, run_dir: str,
                     skipped: int | None = None, evaluation: bool = False) -> str:
    """The error a diverged run stops with: the step, what was not finite, what was (not) applied
    and written, the last good checkpoint and what to do. ``evaluation``: the validation loss
    of the model after ``step`` was not finite; ``skipped``: the run had skipped that many
    consecutive steps."""
    names = " and ".join(what)
    verb = "were" if len(what) > 1 else "was"
    if evaluation:
        happened = f"after step {step} the {names} {verb} not finite (NaN or inf)"
    elif skipped is not None:
        happened = (f"at step {step} the {names} {verb} not finite (NaN or inf), and {skipped} consecutive steps "
                    f"went so, more than train.max_skipped_steps allows; none of them was applied")
    else:
        later = "" if last_step <= step else f" (nor the {last_step - step} computed after it)"
        happened = f"at step {step} the {names} {verb} not finite (NaN or inf); that step was not applied{later}"
    if last_checkpoint is None:
        saved = "no checkpoint of this run had been written"
    else:
        saved = (f"no checkpoint was written after the last good one, {last_checkpoint} (linattn train --resume "
                 f"--out {run_dir} continues from it and repeats the same steps)")
    if evaluation and step == 0:
        return ("the model's output is not finite before any training (its validation bits per byte are NaN or "
                "inf): check the model settings (e.g. model.rotary_base, model.init_std)")
    return (f"training diverged: {happened}, and {saved}. Start a new run with a lower train.lr (or a longer "
            f"train.warmup_steps), or let the run skip such steps with --set train.max_skipped_steps=N")


def skipped_last_message(step: int, what: list[str], *, skipped: int, checkpoint, run_dir: str) -> str:
    """The error of a run (skip mode) whose final step ``step`` was not finite and so skipped,
    the last ``skipped`` steps in a row: the run has no finite final loss; ``checkpoint``, the
    final one, holds the weights of the last step that was applied."""
    names = " and ".join(what)
    verb = "were" if len(what) > 1 else "was"
    return (f"training ended on a step that was not finite: at the final step, {step}, the {names} {verb} not "
            f"finite (NaN or inf), so the last {skipped} step(s) were skipped (train.max_skipped_steps) and the run "
            f"has no finite final loss; the final checkpoint {checkpoint} holds the weights of step "
            f"{step - skipped}. Train on past it with linattn train --resume --out {run_dir} --steps N (N > {step}), "
            f"or start a new run with a lower train.lr")
