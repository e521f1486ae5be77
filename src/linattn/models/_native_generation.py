"""What ``LM.generate``'s native token loops share (``_vq_generation.py`` for models of VQ GAU
pairs, ``_block_generation.py`` for models of pre-norm blocks): the checks that the model's two
ends compute what their parameters say, the check before every token that nothing the native
object read has changed since, and the step calls.

A token through ``LM._run`` is some hundred Python-level operator calls (module calls, state
checks, a new state object) for little arithmetic; a native loop does those once, when
generation starts, and each token is then one call. ``LM._generate`` asks each loop's
``start`` in turn; where none applies, ``LM._run`` steps every token.
"""

from __future__ import annotations

from operator import attrgetter

import torch
from torch import nn

from ..nn.gau import computes_its_parameters, no_global_hooks
from ..state import LMState

_VERSION = attrgetter("_version")  # bumped by every in-place write


def plain_ends(model) -> bool:
    """Whether the model around its layers computes what its parameters say in eval mode
    without gradients: no hooks on it or globally, a plain embedding, final RMSNorm and head
    (no bias), no inference-mode tensor (which has no version counter: a write to it could not
    be seen)."""
    return (no_global_hooks() and not model.training and not torch.is_grad_enabled()
            and not (model._forward_hooks or model._forward_pre_hooks)
            and computes_its_parameters(model.embed, (nn.Embedding,)) and model.embed.max_norm is None
            and computes_its_parameters(model.norm, (nn.RMSNorm,)) and model.norm.weight is not None
            and (model.head is None or (computes_its_parameters(model.head, (nn.Linear,))
                                        and model.head.bias is None))
            and not any(tensor.is_inference() for tensor in (*model.parameters(), *model.buffers())))


def head_t(model, dtype: torch.dtype) -> torch.Tensor:
    """The head's matrix as the native steps read it, ``[d_model, vocab]`` (the tied embedding's
    transpose, or the head weight's)."""
    head = model._embedding_matrix() if model.head is None else model.head.weight
    return head.to(dtype).t().contiguous()


class NativeGeneration:
    """The state of ``LM.generate`` after the prompt, held in a native object (``self.native``,
    whose ``step(ids, ..., logits, greedy=None)`` a subclass calls in ``_call``).

    ``step(ids [B]) -> logits [B, 1, vocab]``, ``step_greedy(ids [B]) -> tokens [B]``;
    ``current()`` whether what the native object read still holds; ``state()`` the ``LMState``
    after the tokens stepped so far (a subclass's)."""

    def __init__(self, model, state: LMState, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.settings, self.steps = state.model, state.steps
        self.read = (*model.parameters(), *model.buffers())
        self.versions = list(map(_VERSION, self.read))
        self.logits = torch.empty(state.batch_size(), model.config.vocab_size, dtype=dtype)

    def current(self) -> bool:
        """Whether what the native object read still holds: eval mode, no parameter or buffer
        written since ``start`` (an in-place write bumps a tensor's version)."""
        return not self.model.training and list(map(_VERSION, self.read)) == self.versions

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits ``[B, 1, vocab]`` after the tokens ``ids [B]`` (int64, in range), in a
        buffer that the next step overwrites."""
        self._call(ids, None)
        self._advance()
        return self.logits.unsqueeze(1)

    def step_greedy(self, ids: torch.Tensor) -> torch.Tensor:
        """``step``, then the next tokens ``[B]`` as ``sample_next(logits, temperature=0)`` draws
        them (each row's first largest logit; ``NO_TOKEN`` where a row is not all finite)."""
        tokens = torch.empty(ids.shape[0], dtype=torch.int64)
        self._call(ids, tokens)
        self._advance()
        return tokens

    def _call(self, ids: torch.Tensor, tokens: torch.Tensor | None) -> None:
        raise NotImplementedError

    def _advance(self) -> None:
        self.steps += 1

    def state(self) -> LMState:
        raise NotImplementedError
