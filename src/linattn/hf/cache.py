"""``LinattnCache``: the recurrent decode states of a linattn model, carried by ``generate``."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from ..state import LMState


class RowGroup:
    """Batch rows that have consumed the same number of real (unpadded) tokens, and so
    share one ``LMState``: held as one, or, after a one-token ``forward`` on a CPU, by
    ``LM.generate``'s native token loop (``loop``, stepped in place: ``hf/_native_steps.py``).

    Attributes:
        rows: ``[n]`` int64, the batch rows, in the state's batch order.
        state: their ``LMState`` (for a group held by a loop, made from the loop when first
            read, then kept; a ValueError when first read after a later ``forward`` stepped the
            loop past this group).
        loop: the native token loop holding the state, or None.
        native_start: whether a one-token ``forward`` may start a native loop from this group
            (False after a row reordering, or where one did not apply: trying again each token
            would read every parameter each token).
    """

    def __init__(self, rows: torch.Tensor, state: LMState | None = None, loop=None, native_start: bool = True):
        if (state is None) == (loop is None):
            raise ValueError("a RowGroup holds its rows' state either as an LMState or in a native loop")
        self.rows, self._state, self.loop, self.native_start = rows, state, loop, native_start
        self.loop_steps = None if loop is None else loop.steps

    def __repr__(self) -> str:
        return f"RowGroup(rows={self.rows.tolist()}, held={'natively' if self.loop is not None else 'as an LMState'})"

    @property
    def state(self) -> LMState:
        if self._state is None:
            self.check_current()
            self._state = self.loop.state()  # a copy: the loop goes on writing its own
        return self._state

    def live_loop(self):
        """The native loop holding this group's state when it has not been stepped since, else None."""
        return self.loop if self.loop is not None and self.loop.steps == self.loop_steps else None

    def check_current(self) -> None:
        """A ValueError when a later ``forward`` stepped this group's native loop on before its
        state was read (the loop holds the newer cache's state, and this one is gone)."""
        if self._state is None and self.live_loop() is None and self.loop is not None:
            raise ValueError(
                "this LinattnCache was advanced in place by a later forward (a one-token step of the native token "
                "loop updates the cache it is given, as a DynamicCache is updated); to continue one cache in several "
                "ways, copy.deepcopy(cache) before each forward")

    def __deepcopy__(self, memo: dict) -> "RowGroup":
        """An independent group: the state as an ``LMState`` (copied), no loop."""
        return RowGroup(copy.deepcopy(self.rows, memo), copy.deepcopy(self.state, memo), native_start=self.native_start)


class LinattnCache(Cache):
    """Per-row-group ``LMState`` s of a linattn model (one group unless the prompts were
    left-padded to different lengths: a row's state never sees its padding, so rows of
    different real lengths keep separate states).

    ``seen``: columns of ``input_ids`` / ``attention_mask`` consumed, padding included
    (what ``get_seq_length`` reports, so ``generate`` slices new tokens correctly).
    Rows in no group have seen only padding. Beam search and ``num_return_sequences``
    reorder it through ``reorder_cache`` / ``batch_repeat_interleave`` /
    ``batch_select_indices``; it cannot be cropped (a recurrent state cannot forget its
    last tokens), so assisted/speculative decoding is not available.

    Args:
        batch_size: the rows of the batch.
        groups: the ``RowGroup`` s so far (None: none, nothing seen yet).
        seen: ``seen`` above.
    """

    def __init__(self, batch_size: int, groups: list[RowGroup] | None = None, seen: int = 0):
        super().__init__(layers=[])
        self.batch_size_ = batch_size
        self.groups = list(groups or [])
        self.seen = seen

    def __repr__(self) -> str:
        sizes = [int(group.rows.numel()) for group in self.groups]
        return f"LinattnCache(batch_size={self.batch_size_}, seen={self.seen}, group_sizes={sizes})"

    def __len__(self) -> int:
        if not self.groups:
            return 0
        group = self.groups[0]
        return len(group.loop.model.layers) if group._state is None else len(group.state.layers)

    @property
    def batch_size(self) -> int:
        return self.batch_size_

    def whole_group(self) -> RowGroup | None:
        """The one group when it holds every row in batch order (no padding split the rows), else None."""
        if len(self.groups) != 1:
            return None
        rows = self.groups[0].rows.cpu()
        in_order = rows.numel() == self.batch_size_ and bool((rows == torch.arange(rows.numel())).all())
        return self.groups[0] if in_order else None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return bool(self.groups)

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return bool(self.groups)

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_linear(self) -> list[bool]:
        # False: generate then slices a continued prompt by get_seq_length, as for a KV cache
        return [False]

    @property
    def is_dummy(self) -> list[bool]:
        return [False]

    def reset(self) -> None:
        self.groups, self.seen = [], 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("LinattnCache cannot be cropped: a recurrent state cannot forget its last tokens "
                                  "(assisted and speculative decoding need that)")

    def update(self, *args, **kwargs):
        raise NotImplementedError("LinattnCache holds linattn LMStates; it is updated by LinattnModel.forward")

    def select_rows(self, source: torch.Tensor) -> None:
        """Make new row ``i`` a copy of old row ``source[i]`` (``source [B']`` int64)."""
        source = torch.as_tensor(source, dtype=torch.long).flatten()
        group_of = torch.full((self.batch_size_,), -1, dtype=torch.long)
        position = torch.zeros(self.batch_size_, dtype=torch.long)
        for g, group in enumerate(self.groups):
            rows = group.rows.cpu()
            group_of[rows] = g
            position[rows] = torch.arange(rows.numel())
        source = source.cpu()
        groups = []
        for g, group in enumerate(self.groups):
            new_rows = (group_of[source] == g).nonzero().flatten()
            if new_rows.numel():  # reordered rows: no native loop from here (it would start at every reordering)
                groups.append(RowGroup(rows=new_rows, state=group.state.select_batch(position[source[new_rows]]),
                                       native_start=False))
        self.groups, self.batch_size_ = groups, int(source.numel())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(self.batch_size_).repeat_interleave(repeats))
