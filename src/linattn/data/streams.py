"""Consecutive windows over parallel token streams, for Transformer-XL style training.

The tokens ``[N]`` are cut into ``batch_size * world_size`` contiguous streams of
``L = N // (batch_size * world_size)`` tokens each (the remainder at the end is
dropped); rank ``r`` reads streams ``[r * batch_size, (r + 1) * batch_size)``. Window
``w`` gives, per stream, inputs ``stream[w*C : w*C + C]`` and the targets one position
later, so window ``w + 1`` continues window ``w`` exactly and a model can carry its
detached recurrent state from one window to the next. Ranks read disjoint streams.

Windows per epoch: ``(L - 1) // C`` with ``drop_last`` (every window full), else
``ceil((L - 1) / C)`` (the last window is shorter; every token but the first of a
stream is then a target exactly once).
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

import torch


class TokenStreams:
    """Windows ``(inputs [batch_size, context], targets [batch_size, context])`` (int64) of this rank.

    Attributes: ``batch_size``, ``context``, ``rank``, ``world_size``, ``drop_last``,
    ``stream_length`` (``L``), ``tokens_per_window`` (``batch_size * context``, the size
    of a full window on this rank).
    """

    def __init__(self, tokens: torch.Tensor, *, batch_size: int, context: int, rank: int = 0,
                 world_size: int = 1, drop_last: bool = True) -> None:
        _check_tokens(tokens)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.context = _positive_int("context", context)
        self.world_size = _positive_int("world_size", world_size)
        self.rank = _int("rank", rank)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: expected an int in [0, world_size={self.world_size}), got {self.rank}")
        self.drop_last = bool(drop_last)
        n_streams = self.batch_size * self.world_size
        needed = n_streams * (self.context + 1)
        if tokens.numel() < needed:
            raise ValueError(
                f"tokens: the split has {tokens.numel()} tokens, but one window of batch_size={self.batch_size} x "
                f"world_size={self.world_size} streams of context={self.context} needs at least "
                f"batch_size*world_size*(context+1) = {needed}; use a smaller batch size or context")
        self.stream_length = tokens.numel() // n_streams
        streams = tokens[: n_streams * self.stream_length].reshape(n_streams, self.stream_length)
        self._streams = streams[self.rank * self.batch_size: (self.rank + 1) * self.batch_size]
        self.tokens_per_window = self.batch_size * self.context
        span = self.stream_length - 1  # positions that have a next token
        self._num_windows = span // self.context if self.drop_last else -(-span // self.context)

    def __len__(self) -> int:
        """Number of windows per epoch."""
        return self._num_windows

    def window(self, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of window ``w``, each ``[batch_size, c]`` int64 (``c = context``
        except for a shorter last window when ``drop_last=False``)."""
        w = _int("w", w)
        if not 0 <= w < self._num_windows:
            raise ValueError(f"w: expected a window index in [0, {self._num_windows}), got {w}")
        start = w * self.context
        end = min(start + self.context, self.stream_length - 1)
        inputs = self._streams[:, start:end].to(torch.int64)
        targets = self._streams[:, start + 1: end + 1].to(torch.int64)
        return inputs, targets

    def target_bytes(self, token_bytes: torch.Tensor) -> int:
        """The text bytes of every target of this rank's windows: ``sum token_bytes[t]``
        over the targets ``t`` (``token_bytes`` ``[vocab_size]``, the bytes each token
        stands for). With byte tokens this is the number of targets."""
        if not isinstance(token_bytes, torch.Tensor) or token_bytes.dim() != 1:
            raise TypeError(f"token_bytes: expected a 1-D tensor [vocab_size], got {type(token_bytes).__name__}")
        return sum(int(token_bytes[targets].sum()) for _, targets in self)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The windows in order, ``0 .. len(self) - 1``."""
        for w in range(self._num_windows):
            yield self.window(w)

    def __repr__(self) -> str:
        return (f"TokenStreams(batch_size={self.batch_size}, context={self.context}, rank={self.rank}, "
                f"world_size={self.world_size}, stream_length={self.stream_length}, windows={len(self)})")


def _check_tokens(tokens: object) -> None:
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens: expected a 1-D integer tensor, got {type(tokens).__name__}")
    if tokens.dim() != 1:
        raise ValueError(f"tokens: expected a 1-D tensor [N], got shape {list(tokens.shape)}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"tokens: expected an integer dtype (uint8 or int), got {tokens.dtype}")


def _int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}") from None


def _positive_int(name: str, value: object) -> int:
    value = _int(name, value)
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value
