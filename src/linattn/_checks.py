"""Every input check of the package: tensors entering an op, config fields, CLI arguments.

Each check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong
shape or value) with a message that names the argument, what was seen and what was
expected, so errors read alike wherever a value enters. The argparse types raise
``argparse.ArgumentTypeError``, which the ``linattn`` command turns into exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

# -- scalars ---------------------------------------------------------------------------------


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: object, *, minimum: int = 1, optional: bool = False) -> Any:
    """``value`` is an int ``>= minimum`` (or None when ``optional``); else ValueError naming ``name``."""
    if optional and value is None:
        return value
    if not is_int(value) or value < minimum:
        wanted = (
            "a positive int" if minimum == 1 else ("a non-negative int" if minimum == 0 else f"an int >= {minimum}")
        )
        raise ValueError(f"{name} must be {wanted}{' or None' if optional else ''}, got {value!r}")
    return value


def check_positive_number(name: str, value: object, *, finite: bool = False) -> float:
    """``value`` is a number (not bool) greater than zero, and finite when ``finite``; else
    ValueError naming ``name``."""
    if not is_number(value) or not value > 0 or (finite and not math.isfinite(value)):
        raise ValueError(f"{name} must be a {'finite ' if finite else ''}positive number, got {value!r}")
    return float(value)


def check_fraction(name: str, value: object) -> float:
    """``value`` is a number (not bool) in ``[0, 1]``; else ValueError naming ``name``."""
    if not is_number(value) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_non_negative_number(name: str, value: object) -> float:
    """``value`` is a finite number (not bool) ``>= 0``; else ValueError naming ``name``."""
    if not is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_sampling(*, temperature: object, top_k: object, top_p: object) -> None:
    """Next-token sampling settings: ``temperature`` a finite number ``>= 0`` (0: greedy),
    ``top_k`` a positive int or None, ``top_p`` a number in ``(0, 1]`` or None; else
    ValueError naming the argument."""
    check_non_negative_number("temperature", temperature)
    check_int("top_k", top_k, optional=True)
    if top_p is not None and not (is_number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")


def is_integer_id(value: object) -> bool:
    """A Python or NumPy integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_id_nest(name: str, values: object) -> None:
    """Every leaf of the (nested) list or tuple ``values`` is an integer; else TypeError."""
    for value in values:
        if isinstance(value, (list, tuple)):
            _check_id_nest(name, value)
        elif not is_integer_id(value):
            raise TypeError(f"{name} must hold integer token ids, got {type(value).__name__} {value!r}")


def token_id_tensor(name: str, ids: object) -> torch.Tensor:
    """Token ids given as an integer tensor (returned as it is), a NumPy integer array, or a
    list or tuple of ints (nested for a batch; made int64). Floats and bools are a TypeError
    naming ``name``, never rounded to ids (``torch.as_tensor([1.7], dtype=torch.long)`` would
    read 1); a ragged nest or an int beyond int64 is a ValueError. Shape and range are the
    caller's (``check_token_ids``)."""
    if isinstance(ids, (list, tuple)):
        _check_id_nest(name, ids)
        try:
            tensor = torch.tensor(ids, dtype=torch.int64)
        except (ValueError, RuntimeError, OverflowError) as error:
            raise ValueError(f"{name} must be a rectangular nest of int64 token ids: {error}") from None
        return tensor
    if not isinstance(ids, torch.Tensor) and hasattr(ids, "__array__") and hasattr(ids, "dtype"):
        try:
            ids = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError):
            pass  # refused below, by kind
    if not isinstance(ids, torch.Tensor) or ids.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name} must be an integer tensor or a list of ints, got {type(ids).__name__} "
                        f"{getattr(ids, 'dtype', '')}".rstrip())
    return ids


# -- tensors ---------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class AttentionShapes:
    """Sizes read off validated ``q [B, H, T, Dk]``, ``k [B, Hkv, T, Dk]``, ``v [B, Hkv, T, Dv]``."""

    batch: int
    heads: int
    kv_heads: int
    length: int
    key_dim: int
    value_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 for MHA, H for MQA)."""
        return self.heads // self.kv_heads


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(name: str, value: object, *, ndim: int | None = None, layout: str = "") -> torch.Tensor:
    """Check that ``value`` is a floating-point tensor of rank ``ndim``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' ' + layout if layout else ''}, got {type(value).__name__}")
    if value.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), got dtype {value.dtype}"
        )
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {_shape(value)}")
    return value


def check_same_dtype_device(**tensors: torch.Tensor) -> None:
    """All tensors share one dtype and one device."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first_name} has dtype {first.dtype}; they must match")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; they must match")


def check_batch(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` has at least one row: batch size 0 (the first dimension) is a ValueError
    naming ``name`` (no op, layer or model has anything to compute for it, and the reshapes
    inside would fail with torch's own, opaque errors)."""
    if value.shape[0] == 0:
        raise ValueError(f"{name} has batch size 0 (shape {_shape(value)}); at least one row (batch entry) is required")
    return value


def check_layer_input(x: torch.Tensor, d_model: int) -> None:
    """A layer's input ``x [batch >= 1, length, d_model]``; else ValueError naming ``x``."""
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x must have shape [batch, length, {d_model}], got {list(x.shape)}")
    check_batch("x", x)


def check_head_layout(d_model: int, n_heads: int, n_kv_heads: int | None, head_dim: int | None) -> tuple[int, int]:
    """A multi-head layer's ``(n_kv_heads, head_dim)``: ``n_kv_heads`` (None: ``n_heads``) must be
    >= 1 and divide ``n_heads``; ``head_dim`` (None: ``d_model // n_heads``) must be >= 1."""
    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must be >= 1 and divide n_heads={n_heads}")
    head_dim = d_model // n_heads if head_dim is None else head_dim
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim} (d_model={d_model}, n_heads={n_heads})")
    return n_kv_heads, head_dim


def check_state_batch(name: str, state_batch: object, batch: int) -> None:
    """A carried state of ``state_batch`` rows continues inputs of ``batch`` rows; else
    ValueError naming both batch sizes. ``state_batch`` may be the state's first tensor (its
    first dimension is read; anything else is left to the shape checks) or an int or None
    (the state holds no tensor)."""
    if isinstance(state_batch, torch.Tensor):
        state_batch = state_batch.shape[0] if state_batch.dim() else None
    if is_int(state_batch) and state_batch != batch:
        raise ValueError(f"{name} has batch size {state_batch} but the inputs have batch size {batch}; "
                         "a state continues the rows that made it (select_batch picks rows)")


def check_state_setting(name: str, setting: str, made_with: object, expected: object) -> None:
    """The ``setting`` a carried state was made with (``made_with``; None: unknown, nothing to
    compare) is this call's (``expected``); else ValueError naming the setting and both values."""
    if made_with is not None and made_with != expected:
        raise ValueError(f"{name} was made with {setting}={made_with!r}, but this call has {setting}={expected!r}; "
                         "a state continues only a computation with the settings that made it")


def check_qkv(
    q: object, k: object, v: object, *, same_length: bool = True, key_name: str = "k"
) -> AttentionShapes:
    """Validate the SDPA layout ``q [B, H, T, Dk]``, ``k [B, Hkv, S, Dk]``, ``v [B, Hkv, S, Dv]``.

    ``Hkv`` must divide ``H`` (MQA: ``Hkv = 1``; GQA: in between). With ``same_length``
    the key length ``S`` must equal the query length ``T``. ``B`` must be at least 1.
    """
    q = check_tensor("q", q, ndim=4, layout="[batch, heads, length, key_dim]")
    k = check_tensor(key_name, k, ndim=4, layout="[batch, kv_heads, length, key_dim]")
    v = check_tensor("v", v, ndim=4, layout="[batch, kv_heads, length, value_dim]")
    check_same_dtype_device(**{"q": q, key_name: k, "v": v})
    B, H, T, Dk = q.shape
    check_batch("q", q)
    if T == 0:
        raise ValueError(f"q has length 0 (shape {_shape(q)}); at least one position is required")
    if Dk == 0 or v.shape[-1] == 0:
        raise ValueError(f"q, k and v need a non-empty feature dimension, got q {_shape(q)}, v {_shape(v)}")
    if k.shape[0] != B:
        raise ValueError(
            f"{key_name} has batch size {k.shape[0]} (shape {_shape(k)}) but q has {B}; expected [{B}, Hkv, T, {Dk}]"
        )
    if v.shape[0] != B:
        raise ValueError(f"v has batch size {v.shape[0]} (shape {_shape(v)}) but q has {B}; expected [{B}, Hkv, T, Dv]")
    Hkv = k.shape[1]
    if v.shape[1] != Hkv:
        raise ValueError(f"v has {v.shape[1]} heads (shape {_shape(v)}) but {key_name} has {Hkv}; they must match")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"{key_name} has {Hkv} heads (shape {_shape(k)}), which must divide the {H} heads of q "
            f"(expected Hkv in {{d : {H} % d == 0}})"
        )
    if k.shape[-1] != Dk:
        raise ValueError(
            f"{key_name} has key dimension {k.shape[-1]} (shape {_shape(k)}) but q has {Dk}; "
            f"expected [{B}, {Hkv}, T, {Dk}]"
        )
    S = k.shape[2]
    if S == 0:
        raise ValueError(f"{key_name} has length 0 (shape {_shape(k)}); at least one key is required")
    if v.shape[2] != S:
        raise ValueError(f"v has length {v.shape[2]} (shape {_shape(v)}) but {key_name} has {S}; they must match")
    if same_length and S != T:
        raise ValueError(
            f"{key_name} has length {S} (shape {_shape(k)}) but q has {T}; expected [{B}, {Hkv}, {T}, {Dk}]"
        )
    return AttentionShapes(B, H, Hkv, T, Dk, v.shape[-1])


_ID_SCAN_PIECE = 1 << 24
_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64)


def check_token_ids(name: str, ids: object, vocab_size: int, *, values: bool = True) -> torch.Tensor:
    """``ids`` is an integer tensor whose values lie in ``[0, vocab_size)``.

    The range is read from the values (one pass, and a host sync on a GPU) only when the
    dtype admits ids outside it: uint8 ids need no pass for a vocabulary of 256 or more.
    ``values=False`` checks the type alone, for callers that read the values elsewhere
    (see ``LM.forward``'s ``check_inputs``).
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got {type(ids).__name__} {getattr(ids, 'dtype', '')}")
    if not values or ids.numel() == 0:
        return ids
    info = torch.iinfo(ids.dtype)
    if info.min >= 0 and info.max < vocab_size:
        return ids
    low, high = token_id_range(ids)
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} must lie in [0, {vocab_size}), got values in [{low}, {high}]")
    return ids


def token_id_range(ids: torch.Tensor) -> tuple[int, int]:
    """The smallest and the largest value of the non-empty integer tensor ``ids``, read in
    pieces widened to int64 (uint16/uint32 have no aminmax): a memory-mapped split stays on disk."""
    ranges = [torch.aminmax(piece.to(torch.int64)) for piece in ids.reshape(-1).split(_ID_SCAN_PIECE)]
    return min(int(r.min) for r in ranges), max(int(r.max) for r in ranges)


def check_choice(name: str, value: object, choices: Iterable[object]) -> None:
    """``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")


def env_choice(variable: str, values: tuple[str, ...]) -> str | None:
    """The environment variable ``variable`` that replaces an ``impl="auto"`` choice: one of
    ``values``, or None when unset or empty; another value is a ValueError naming the variable
    and the values it takes."""
    value = os.environ.get(variable, "")
    if value == "":
        return None
    if value not in values:
        raise ValueError(f"{variable} must be {' or '.join(map(repr, values))} (or unset: impl='auto' chooses), "
                         f"got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` is a ``bool`` (not a truthy tensor or int)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_rerope(rerope: object, rotary_base: object, key_dim: int) -> int | None:
    """ReRoPE's window ``rerope``: None (off) or an int ``w >= 1``; ``rotary_base`` a finite number
    ``> 1``; with a window, an even key dimension (rotary turns pairs of features)."""
    if not is_number(rotary_base) or not math.isfinite(rotary_base) or not rotary_base > 1:
        raise ValueError(f"rotary_base must be a finite number > 1, got {rotary_base!r}")
    if rerope is None:
        return None
    if not is_int(rerope) or rerope < 1:
        raise ValueError(f"rerope must be None or the ReRoPE window, an int >= 1, got {rerope!r}")
    if key_dim % 2:
        raise ValueError(f"rerope rotates pairs of key features and needs an even key dimension, got Dk={key_dim}")
    return rerope


def check_positive_int(name: str, value: object) -> int:
    """``value`` is an ``int`` (not bool) greater than zero."""
    if not is_int(value):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def check_state_tensor(name: str, value: object, expected: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A carried-state tensor has the expected shape and lives on ``like``'s device. A tensor of
    the expected rank whose first dimension differs is named as a batch-size mismatch."""
    value = check_tensor(name, value)
    if value.dim() == len(expected) and value.dim() and value.shape[0] != expected[0]:
        raise ValueError(f"{name} has batch size {value.shape[0]} (shape {_shape(value)}) but the inputs have "
                         f"batch size {expected[0]}; a state continues the rows that made it (select_batch picks rows)")
    if tuple(value.shape) != tuple(expected):
        exp = "[" + ", ".join(str(s) for s in expected) + "]"
        raise ValueError(f"{name} has shape {_shape(value)}, expected {exp} for these inputs")
    if value.device != like.device:
        raise ValueError(f"{name} is on {value.device} but the inputs are on {like.device}")
    return value


def check_log_decay(name: str, value: object, *, heads_of: AttentionShapes, channels: int, like: torch.Tensor,
                    values: bool) -> torch.Tensor:
    """Log decays of a gated recurrence (the state is multiplied by ``exp(g)`` each step): a
    floating tensor ``[B, Hkv, T]`` (one per key/value head and step) or ``[B, Hkv, T,
    channels]`` (one per key channel), on ``like``'s device, of ``like``'s dtype or of its
    accumulation dtype (``compute_dtype``: float32 log decays for half-precision inputs).
    With ``values`` (reads them: a host sync on a GPU), every entry is ``<= 0`` and none is
    NaN; ``-inf`` (a full reset: the state is forgotten) is allowed. Else TypeError (kind,
    dtype) or ValueError (shape, device, values) naming ``name``."""
    B, Hkv, T = heads_of.batch, heads_of.kv_heads, heads_of.length
    layout = f"[{B}, {Hkv}, {T}] (one per key/value head and step) or [{B}, {Hkv}, {T}, {channels}] (per key channel)"
    value = check_tensor(name, value, layout=layout)
    allowed = (like.dtype, compute_dtype(like.dtype))
    if value.dtype not in allowed:
        wanted = " or ".join(dict.fromkeys(str(d) for d in allowed))
        raise TypeError(f"{name} has dtype {value.dtype} but q has dtype {like.dtype}; {name} must be {wanted}")
    if tuple(value.shape) not in ((B, Hkv, T), (B, Hkv, T, channels)):
        raise ValueError(f"{name} has shape {_shape(value)}, expected {layout}")
    if value.device != like.device:
        raise ValueError(f"{name} is on {value.device} but q is on {like.device}; they must match")
    if values and value.numel():
        high = float(value.detach().max())  # NaN propagates
        if math.isnan(high):
            raise ValueError(f"{name} holds NaN; log decays must be <= 0 (-inf, a full reset, is allowed)")
        if high > 0:
            raise ValueError(f"{name} must be <= 0 (log decays: the state is multiplied by exp({name})), "
                             f"got a largest value of {high:.4g}")
    return value


def check_first_order_backward(op: str, alternative: str) -> None:
    """Called first in a hand-written ``backward``: grad mode is on there only under
    ``create_graph=True``, which asks for second derivatives that such a backward cannot give
    (it would return first derivatives with no graph); raise, naming ``alternative``."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op} has no second derivatives (its backward is first order, and a backward with "
            f"create_graph=True went through it); use {alternative}"
        )


def check_scale(scale: object, *, also: str = "") -> float:
    """The one rule for an op's ``scale`` given as a number: a finite int or float (not a
    bool) greater than zero; anything else (NaN, an infinity, 0, a negative number, a bool,
    another kind) is a ValueError naming ``scale`` and the value. ``also`` names the other
    forms the op takes (e.g. ``" or None (...)"``), for the message."""
    if not is_number(scale) or not math.isfinite(scale) or not scale > 0:
        raise ValueError(f"scale must be a finite positive number{also}, got {scale!r}")
    return float(scale)


def resolve_scale(scale: object, key_dim: int) -> float:
    """The score scale: ``None`` -> ``key_dim^-1/2``; else ``check_scale``'s number."""
    if scale is None:
        return key_dim ** -0.5
    return check_scale(scale, also=" or None (key_dim^-1/2)")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def records_gradients(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on ``tensors`` (None skipped) records gradients: grad mode on and one of
    them requiring grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# -- config dataclasses ----------------------------------------------------------------------


def check_int_fields(config: object, prefix: str, names: Iterable[str], *, minimum: int,
                     optional: bool = False, note: str = "") -> None:
    """Each field is an int ``>= minimum`` (or None when ``optional``); else ValueError."""
    wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}{note}"
    for name in names:
        value = getattr(config, name)
        if optional and value is None:
            continue
        if not is_int(value) or value < minimum:
            raise ValueError(f"{prefix}.{name} must be {wanted}{' or None' if optional else ''}, got {value!r}")


def check_number_fields(config: object, prefix: str, names: Iterable[str], *, low: float, high: float | None = None,
                        low_inclusive: bool = True, high_inclusive: bool = True, wanted: str) -> None:
    """Each field is a finite number (not bool) between ``low`` and ``high`` (None: unbounded
    above), ends as flagged; else ValueError. inf and NaN are refused whatever the bounds: no
    setting of a config means "unbounded" by infinity, and NaN passes no comparison."""
    for name in names:
        value = getattr(config, name)
        if is_number(value) and not math.isfinite(value):
            raise ValueError(f"{prefix}.{name} must be finite and {wanted}, got {value!r}")
        ok = is_number(value)
        ok = ok and (value >= low if low_inclusive else value > low) and (
            high is None or (value <= high if high_inclusive else value < high)
        )
        if not ok:
            raise ValueError(f"{prefix}.{name} must be {wanted}, got {value!r}")


def check_text_field(config: object, prefix: str, name: str, *, optional: bool = False, hint: str = "") -> None:
    """The field is a ``str`` with a non-blank character (or None when ``optional``): TypeError
    for another kind, ValueError for an empty or whitespace-only string (which a path would
    read as the current directory); ``hint`` says what to pass."""
    value = getattr(config, name)
    if optional and value is None:
        return
    wanted = f"a non-empty str{' or None' if optional else ''}{hint}"
    if not isinstance(value, str):
        raise TypeError(f"{prefix}.{name} must be {wanted}, got {type(value).__name__} {value!r}")
    if not value.strip():
        raise ValueError(f"{prefix}.{name} must be {wanted}, got {value!r}")


def check_bool_fields(config: object, prefix: str, names: Iterable[str]) -> None:
    """Each field is a ``bool`` (not 0/1 or a string); else TypeError."""
    for name in names:
        check_bool(f"{prefix}.{name}", getattr(config, name))


def check_divides(name: str, value: int, of_name: str, of_value: int) -> None:
    """``value`` divides ``of_value`` (both already checked ints); else ValueError naming both."""
    if of_value % value:
        raise ValueError(f"{name} must divide {of_name}, got {value} and {of_value}")


def config_from_dict(cls, values: dict[str, Any], what: str):
    """``cls(**values)`` after rejecting keys that are not fields of the dataclass ``cls``."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {what} config keys {unknown}; valid keys: {sorted(known)}")
    return cls(**values)


# -- command-line arguments ------------------------------------------------------------------


def _int_type(accepts: Callable[[int], bool], wanted: str) -> Callable[[str], int]:
    """An argparse type: an integer for which ``accepts`` holds; the error says ``wanted``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


def int_at_least(minimum: int, what: str = "a count") -> Callable[[str], int]:
    """An argparse type accepting integers ``>= minimum``; ``what`` names the quantity in the error."""
    return _int_type(lambda value: value >= minimum, f"{what} (an integer >= {minimum})")


def int_between(low: int, high: int, what: str = "a count") -> Callable[[str], int]:
    """An argparse type accepting integers in ``[low, high]``; ``what`` names the quantity in the error."""
    return _int_type(lambda value: low <= value <= high, f"{what} in [{low}, {high}]")


def _float_type(accepts: Callable[[float], bool], wanted: str) -> Callable[[str], float]:
    """An argparse type: a finite number for which ``accepts`` holds (``nan`` and ``inf`` are
    refused); the error says ``wanted``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and accepts(value)):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


positive_float = _float_type(lambda value: value > 0, "a positive number")
positive_float.__doc__ = "An argparse type accepting finite numbers > 0."
non_negative_float = _float_type(lambda value: value >= 0, "a finite number >= 0")
non_negative_float.__doc__ = "An argparse type accepting finite numbers >= 0 (a sampling temperature: 0 is greedy)."
positive_fraction = _float_type(lambda value: 0 < value <= 1, "a number in (0, 1]")
positive_fraction.__doc__ = "An argparse type accepting numbers in (0, 1] (a nucleus mass top-p)."


positive_int = int_at_least(1, "a positive count")
non_negative_int = int_at_least(0, "a count")


_DEVICE_HELP = "cpu, cuda or cuda:N"


def check_device(name: str, value: object) -> str:
    """``value`` names a device this package runs on: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    kind, _, index = value.partition(":") if isinstance(value, str) else ("", "", "")
    if kind not in ("cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"{name} must be {_DEVICE_HELP}, got {value!r}")
    return value


def device_name(text: str) -> str:
    """An argparse type for ``--device``: ``cpu``, ``cuda`` or ``cuda:N``."""
    try:
        return check_device("--device", text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a device ({_DEVICE_HELP}), got {text!r}") from None


def _missing_cuda(device: torch.device) -> str | None:
    """Why the CUDA device ``device`` cannot be used in this process (None: it can, or it is
    not a CUDA device)."""
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no CUDA device, or a CPU-only build of torch)"
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"torch.cuda.device_count() is {count}"
    return None


def check_cuda_available(name: str, device: torch.device | str) -> None:
    """A CUDA ``device`` exists here: ``torch.cuda.is_available()`` and, for ``cuda:N``,
    ``N < torch.cuda.device_count()``; else ValueError naming ``name``. Other devices pass."""
    reason = _missing_cuda(torch.device(device))
    if reason is not None:
        raise ValueError(f"{name} {str(device)!r} requested but {reason}")


def available_device_name(text: str) -> str:
    """An argparse type for ``--device`` of a command that runs in this process: ``device_name``'s
    forms, and a CUDA device only where torch sees one, so the command fails before it starts."""
    device_name(text)
    reason = _missing_cuda(torch.device(text))
    if reason is not None:
        raise argparse.ArgumentTypeError(f"{text!r} requested but {reason}")
    return text
