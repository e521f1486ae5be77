"""Checks shared by the configuration dataclasses (``LMConfig``, ``TrainConfig``): every
message names the field as ``<prefix>.<name>``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int_fields(config: object, prefix: str, names: Iterable[str], *, minimum: int,
                     optional: bool = False, note: str = "") -> None:
    """Each field is an int ``>= minimum`` (or None when ``optional``); else ValueError."""
    wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}{note}"
    for name in names:
        value = getattr(config, name)
        if optional and value is None:
            continue
        if not _is_int(value) or value < minimum:
            raise ValueError(f"{prefix}.{name} must be {wanted}{' or None' if optional else ''}, got {value!r}")


def check_number_fields(config: object, prefix: str, names: Iterable[str], *, low: float, high: float | None = None,
                        low_inclusive: bool = True, high_inclusive: bool = True, wanted: str) -> None:
    """Each field is a number (not bool) between ``low`` and ``high`` (None: unbounded), ends as flagged."""
    for name in names:
        value = getattr(config, name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and (value >= low if low_inclusive else value > low) and (high is None or (value <= high if high_inclusive else value < high))
        if not ok:
            raise ValueError(f"{prefix}.{name} must be {wanted}, got {value!r}")


def config_from_dict(cls, values: dict[str, Any], what: str):
    """``cls(**values)`` after rejecting keys that are not fields of the dataclass ``cls``."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {what} config keys {unknown}; valid keys: {sorted(known)}")
    return cls(**values)
