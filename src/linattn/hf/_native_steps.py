"""``generate``'s one-token forwards through ``LM.generate``'s native token loops.

Hugging Face's ``generate`` calls ``forward`` once per token with the ``LinattnCache`` that the
previous call returned. Through ``LM._trunk`` such a token costs some hundred Python-level
operator calls per layer; ``LM.generate``'s native loops (``models/_vq_generation.py``,
``models/_block_generation.py``) do that work once, when they start, and each token is then one
call. Here a one-token forward of every row of a single group (no padding, no hidden states, no
loss) starts such a loop from the group's ``LMState`` and hands it on in the cache it returns
(``RowGroup.loop``); the next one-token forward steps it in place. The returned logits are a
copy (the loop's buffer is overwritten by the next step).

The loop is a value of the newest cache only: the cache it was stepped from can no longer be
continued unless its state was read before (``RowGroup.check_current`` names it; ``copy.deepcopy``
a cache to continue it in several ways); a cache whose loop no longer applies (a parameter written, a softmax cache out
of reserved rows) hands its state back and starts a new loop, reading the parameters again.
Softmax layers' KV caches get room for ``max(256, positions so far)`` more rows when a loop
starts (``kv_cache.reserve``: amortised, as a growing list's).
"""

from __future__ import annotations

import torch

from ..models._block_generation import BlockGeneration
from ..models._vq_generation import VQGeneration
from ..ops.softmax import kv_cache
from .cache import RowGroup

_ROOM = 256  # the fewest KV-cache rows reserved when a loop starts


def step(lm, group: RowGroup, ids: torch.Tensor) -> tuple[torch.Tensor, RowGroup] | None:
    """The logits ``[B, 1, vocab]`` after ``ids [B, 1]`` (every row of ``group``, in order) and the
    group holding the loop after them; None where no native loop applies (``group.native_start``
    is then cleared, so the next token does not try again)."""
    group.check_current()
    loop = group.live_loop()
    if loop is not None and not loop.current():  # a parameter changed or a cache is full: its state, a new loop
        group.state  # made from the loop while it still holds this group's tokens
        loop = None
    if loop is None:
        if not group.native_start:
            return None
        state = kv_cache.reserve(group.state, max(_ROOM, group.state.steps))
        batch = ids.shape[0]
        loop = VQGeneration.start(lm, state, batch) or BlockGeneration.start(lm, state, batch)
        if loop is None:
            group.native_start = False
            return None
    logits = loop.step(ids[:, 0]).clone()
    return logits, RowGroup(group.rows, loop=loop)
