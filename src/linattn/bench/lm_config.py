"""The settings of ``linattn bench lm``: the default models and contexts, and
:class:`LMBenchConfig` (model size, contexts, measurement settings, device and precision of
one run; ``QUICK``: the tiny settings of ``--quick``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .._checks import check_choice, check_device, check_positive_int
from ..models import LMConfig, sizes, uses_heads
from ..models.config import matched_gau_value_width

DEFAULT_MODELS = ("softmax", "vq", "delta", "linear:elu", "local", "local,local,vq", "retnet", "gla", "gated-delta")
DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384)
DTYPES = ("float32", "bfloat16")  # bfloat16: autocast, as train.bf16


@dataclass(frozen=True)
class LMBenchConfig:
    """Model size, contexts and measurement settings of one ``bench lm`` run."""

    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    tokens_per_step: int = 16384
    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    gau_d_k: int = 64
    codebook_size: int = 128
    block_size: int = 64
    window: int = 256
    repeats: int = 3
    rounds: int = 1
    warmup: int = 1
    decode_tokens: int = 32
    memory_gb: float = 8.0
    profile_top: int = 0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_device("device", self.device)
        check_choice("dtype", self.dtype, DTYPES)
        check_positive_int("rounds", self.rounds)

    def autocast(self) -> torch.autocast:
        """The precision of the forward passes: bfloat16 autocast on ``device`` when ``dtype``
        is bfloat16 (as ``train.bf16``), else a disabled autocast (float32)."""
        return torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16,
                              enabled=self.dtype == "bfloat16")

    def model_config(self, spec: str) -> LMConfig:
        """The ``LMConfig`` of the model ``spec`` (a layer spec or comma-separated pattern):
        VQ layers with the GAU value width matched to an attention + SwiGLU block; a spec with
        SwiGLU blocks gets the SwiGLU width (a multiple of 8) that gives it the softmax model's
        parameter count (a layer kind with extra projections, such as ``gla``, a narrower one)."""
        base = LMConfig(attention=spec, d_model=self.d_model, n_layers=self.n_layers,
                        n_heads=self.n_heads if uses_heads(spec) else None, local_window=self.window,
                        gau_d_k=self.gau_d_k,
                        gau_d_v=matched_gau_value_width(self.d_model, self.gau_d_k),
                        codebook_size=self.codebook_size, block_size=self.block_size)
        target = sizes.count_parameters(replace(base, attention="softmax", n_heads=self.n_heads))
        try:
            width = sizes.matched_width(lambda w: replace(base, ffn_hidden=w), target, 8)
        except ValueError:  # no SwiGLU block (only VQ layers): the GAU width is the match
            return base
        return replace(base, ffn_hidden=width)

    def batch(self, context: int) -> int:
        """Windows per training step and prefill at ``context``: equal tokens per step."""
        return max(1, self.tokens_per_step // context)


QUICK = LMBenchConfig(contexts=(64, 128), tokens_per_step=256, d_model=32, n_heads=2, gau_d_k=16, codebook_size=16,
                      block_size=16, window=32, repeats=1, warmup=1, decode_tokens=4)
