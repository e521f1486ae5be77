"""``LinattnCache``: the recurrent decode states of a linattn model, carried by ``generate``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from ..state import LMState


@dataclass
class RowGroup:
    """Batch rows that have consumed the same number of real (unpadded) tokens, and so
    share one ``LMState``.

    Attributes:
        rows: ``[n]`` int64, the batch rows, in the state's batch order.
        state: their ``LMState``.
    """
    rows: torch.Tensor
    state: LMState


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
        return len(self.groups[0].state.layers) if self.groups else 0

    @property
    def batch_size(self) -> int:
        return self.batch_size_

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
            if new_rows.numel():
                groups.append(RowGroup(rows=new_rows, state=group.state.select_batch(position[source[new_rows]])))
        self.groups, self.batch_size_ = groups, int(source.numel())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(self.batch_size_).repeat_interleave(repeats))
