"""A run's ``metrics.jsonl``: one strict JSON object per line, written by rank 0 as the run goes.

- **Strict JSON.** A value that is not finite (a NaN loss of a skipped step) is written as
  ``null``, and the record's ``nonfinite_values`` maps its name to ``"NaN"``, ``"Infinity"``
  or ``"-Infinity"``, so every line parses under a strict JSON reader. ``read_metrics`` gives
  the floats back, and still reads the bare ``NaN``/``Infinity`` tokens of older files.
- **Resume.** ``--resume`` drops what the interrupted run logged after its checkpoint by
  replacing the file atomically (``_files.write_text_atomic``): a kill at that moment leaves
  the old file or the new one.
- **Reading.** A last line without its newline is what a killed or out-of-space writer left:
  it is dropped with a note naming the file. Any other line that is not a JSON object with
  an integer ``step`` is an error naming the file and the line number.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._checks import is_int
from .._files import write_text_atomic

NONFINITE_FIELD = "nonfinite_values"
_SPELLED = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_record(record: dict[str, Any]) -> str:
    """``record`` as one line of strict JSON: its non-finite floats as ``null``, named with
    their spelling in ``record["nonfinite_values"]``."""
    nonfinite = {key: _spelling(value) for key, value in record.items()
                 if isinstance(value, float) and not math.isfinite(value)}
    if nonfinite:
        record = {**{key: None if key in nonfinite else value for key, value in record.items()},
                  NONFINITE_FIELD: nonfinite}
    return json.dumps(record, allow_nan=False)


def _spelling(value: float) -> str:
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _decoded(record: dict[str, Any]) -> dict[str, Any]:
    """A record as written -> its values (``nonfinite_values`` back to floats)."""
    nonfinite = record.pop(NONFINITE_FIELD, None)
    if isinstance(nonfinite, dict):
        record.update({key: _SPELLED[spelled] for key, spelled in nonfinite.items() if spelled in _SPELLED})
    return record


def read_metrics(path: str | Path, *, echo: Callable[[str], None] = print) -> list[tuple[str, dict[str, Any]]]:
    """The lines of the metrics file ``path`` with their records, ``[(line, record)]``, in
    order (blank lines left out). A last line without its newline is dropped and ``echo``
    says so; any other line that is not a JSON object with an integer ``step`` is a
    ``ValueError`` naming ``path`` and the line's number."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    lines = text.split("\n")
    torn = lines.pop()  # "" when the file ends with its newline
    if torn.strip():
        echo(f"note: dropped the last line of {path} (line {len(lines) + 1}): it has no newline at its end, the "
             f"trace of a writer that was stopped while writing it")
    read = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            read.append((line, _parse_line(line, path, number)))
    return read


def _parse_line(line: str, path: Path, number: int) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"line {number} of {path} is not JSON ({error}); remove or repair that line") from None
    if not isinstance(record, dict) or not is_int(record.get("step")) or record["step"] < 0:
        raise ValueError(f"line {number} of {path} is not a metrics record (a JSON object with an integer \"step\"): "
                         f"{line[:80]!r}; remove or repair that line")
    return _decoded(record)


class MetricsLog:
    """Rank 0's ``metrics.jsonl`` (``enabled``; the other ranks write nothing), appended to
    and flushed record by record, and mirrored to TensorBoard with ``tensorboard``.

    A fresh run (``resume_step`` None) starts it empty; a resumed one keeps the records of
    steps up to ``resume_step`` (``echo`` notes a torn last line)."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None, tensorboard: bool = False,
                 echo: Callable[[str], None] = print):
        self.path, self.enabled, self.scalars = path, enabled, None
        if not enabled:
            return
        if tensorboard:
            from .tensorboard import TensorBoardScalars

            purge = None if resume_step is None else resume_step + 1
            self.scalars = TensorBoardScalars(path.parent / "tensorboard", purge_step=purge)
        kept = ""
        if resume_step is not None and path.exists():  # drop what the interrupted run logged after its checkpoint
            kept = "".join(line + "\n" for line, record in read_metrics(path, echo=echo)
                           if record["step"] <= resume_step)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, kept)
        except OSError as error:
            raise self._failed(error) from None

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            try:
                with open(self.path, "a", encoding="utf-8") as handle:
                    handle.write(encode_record(record) + "\n")
            except OSError as error:
                raise self._failed(error) from None
            if self.scalars is not None:
                self.scalars.write(record)

    def close(self) -> None:
        if self.scalars is not None:
            self.scalars.close()

    def _failed(self, error: OSError) -> ValueError:
        return ValueError(f"cannot write {self.path}: {error}; the run's checkpoints are as they were: free space "
                          f"or fix the permissions, then continue with linattn train --resume --out {self.path.parent}")
