"""TensorBoard scalars beside ``metrics.jsonl`` (``train.tensorboard = true``).

Every numeric field of a metrics record becomes the scalar ``<split>/<field>`` at the
record's step (``train/loss``, ``train/lr``, ``validation/bpb``, ...) in
``<run>/tensorboard/``. Each record is flushed as it is written, like the JSONL log. A
resumed run purges the events logged after its checkpoint, as the JSONL log drops those
lines. ``torch.utils.tensorboard`` (and the ``tensorboard`` package it needs) is imported
only when a run asks for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install tensorboard==2.21.0"


class TensorBoardScalars:
    """A ``SummaryWriter`` in ``log_dir`` fed with metrics records."""

    def __init__(self, log_dir: str | Path, *, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ValueError(f"train.tensorboard = true needs the tensorboard package ({error}); "
                             f"{INSTALL_HINT}") from None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, record: dict[str, Any]) -> None:
        """Add the numeric fields of ``record`` (which holds ``step``) as scalars."""
        split = record.get("split", "train")
        for key, value in record.items():
            if key in ("step", "split") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self.writer.add_scalar(f"{split}/{key}", value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
