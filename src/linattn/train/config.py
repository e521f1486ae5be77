"""``TrainConfig`` and the TOML run file (``[model]`` + ``[train]`` tables)."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._checks import (check_bool_fields, check_choice, check_device, check_divides, check_int_fields,
                       check_number_fields, check_text_field, config_from_dict)
from ..models.config import LMConfig
from .parallel import STRATEGIES

_DATA_HINT = (": 'shakespeare', a text file, a folder of .txt files, an enwik8-style .zip or a shard folder "
              "written by linattn data prepare")


@dataclass
class TrainConfig:
    """How to train: data, batch, optimiser, schedule, evaluation, checkpoints.

    The learning rate warms up linearly over ``warmup_steps`` to ``lr`` and decays by a
    cosine to ``lr * min_lr_ratio`` at ``decay_steps`` (None: ``steps``); steps past it train
    at that floor (a finished run extended by ``linattn train --resume --steps N`` keeps its
    schedule and continues at the floor). Each optimizer step reads one window of
    ``context`` tokens from each of ``batch_size`` streams per process; the windows of a
    stream are consecutive, and the model's recurrent state is carried (detached) from one
    window to the next (Transformer-XL style) for ``carry_windows`` windows, then reset, so
    a carried state is never older than ``carry_windows`` optimizer steps (states that
    integrate over a whole pass would be dominated by values computed with stale weights,
    and the model would learn to read that stale mixture). Evaluation during training
    resets the state on the same schedule.

    ``grad_accum_steps = n`` splits each step's ``batch_size`` streams into ``n`` micro-batches
    of ``batch_size / n`` streams that run forward and backward one after the other (less
    activation memory, the same step: ``train/microbatch.py``); ``n`` must divide ``batch_size``.
    ``activation_checkpointing`` recomputes each layer's forward during backward
    (``LM.activation_checkpointing``): the same step with the activations of one layer held
    at a time. Under ``torchrun``, ``parallel`` picks DistributedDataParallel (``"ddp"``) or
    FSDP2 (``"fsdp"``: parameters, gradients and optimizer state sharded over the processes);
    None (the default) is ``"ddp"`` there. Set in a run that is one process (no ``torchrun``),
    it is refused by ``train``: it would train one process where several were meant.

    A step whose loss, commitment loss or gradient norm is not finite is never applied: the
    run stops with an error naming the step and the last good checkpoint, or, with
    ``max_skipped_steps = N > 0``, skips such steps (counted in the metrics) until more than
    ``N`` come in a row (``train/divergence.py``).

    Evaluation during training reads ``eval_batch_size`` streams in all, whatever the number of
    processes: the processes share them (rank ``r`` of ``W`` evaluates streams
    ``[r E / W, (r + 1) E / W)``, rounded down) and the per-stream sums are reduced, so the
    validation bits per byte do not depend on the number of processes.

    Under ``torchrun``, ``dist_timeout`` (seconds) bounds each start-up exchange, in which the
    processes meet and compare their settings, checkpoint and data before the first step
    (``train/startup.py``): a process that has not arrived by then is named in the error.
    ``collective_timeout`` (seconds; None: torch's default, 30 minutes under gloo, 10 under
    NCCL) is the process group's timeout (``init_process_group(timeout=...)``): the longest any
    collective of the run waits for the other processes.

    ``lora_rank = r`` trains LoRA adapters of rank r on the layers' linear maps instead of every
    parameter (``train/lora.py``; ``linattn train --resume --lora-rank r`` fine-tunes a converted
    or imported run so); the checkpoints' readers merge them.
    """

    data: str = "shakespeare"
    """What to train on: ``"shakespeare"``, a text file, a folder of .txt files, an enwik8-style
    .zip, or a shard folder written by ``linattn data prepare``."""
    out: str = "runs/latest"
    """The run folder: checkpoints, metrics, the resolved config."""
    steps: int = 1000
    """Optimizer steps to train for."""
    decay_steps: int | None = None
    """The end of the cosine decay; None: ``steps``."""
    batch_size: int = 16
    """Streams per process and optimizer step, each reading one window of ``context`` tokens."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step, each of ``batch_size / grad_accum_steps`` streams."""
    activation_checkpointing: bool = False
    """Recompute each layer's forward in backward (less memory, the same step)."""
    parallel: str | None = None
    """Under ``torchrun``: ``"ddp"`` (replicated; None: the same) or ``"fsdp"`` (FSDP2, sharded)."""
    context: int = 256
    """Tokens per window (the training context)."""
    lr: float = 2e-3
    """The peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """The learning rate at the end of the cosine decay, as a fraction of ``lr``."""
    warmup_steps: int = 100
    """Steps of linear warmup to ``lr``."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay, on the weight matrices (not on biases, norm gains,
    embedding tables or codebooks: ``train/optim.py``)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    grad_clip: float = 1.0
    """The gradient norm is clipped to this."""
    bf16: bool = False
    """Run the forward and backward under bfloat16 autocast."""
    compile: bool = False
    """``torch.compile`` the model's forward and backward (evaluation stays eager)."""
    max_skipped_steps: int = 0
    """Consecutive non-finite steps skipped before the run stops (0: stop at the first)."""
    carry_state: bool = True
    """Carry the model's recurrent state (detached) from one window of a stream to the next."""
    carry_windows: int = 8
    """Windows per carried sequence: the state is reset every N windows (0: the whole pass)."""
    eval_every: int = 200
    """Steps between validation evaluations (0: never)."""
    eval_tokens: int | None = 65536
    """Validation tokens (bytes for byte data) per evaluation; None: the whole split."""
    eval_batch_size: int = 8
    """Validation streams in all, shared by the processes (the result does not depend on their number)."""
    log_every: int = 10
    """Steps between metric lines."""
    checkpoint_every: int = 200
    """Steps between checkpoints (0: only at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in the run folder (the oldest are deleted)."""
    seed: int = 0
    """The seed of the run (``torch.manual_seed`` before the model is built)."""
    device: str = "cpu"
    """The torch device to train on (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...)."""
    threads: int | None = None
    """torch's CPU threads; None: torch's default."""
    cache_dir: str | None = None
    """The corpus cache folder; None: ``$LINATTN_CACHE`` or ``~/.cache/linattn``."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars to ``<out>/tensorboard/``."""
    lora_rank: int | None = None
    """Train LoRA adapters of this rank instead of every parameter (``train/lora.py``)."""
    dist_timeout: float = 120.0
    """Seconds a start-up exchange under ``torchrun`` (the rendezvous, the configuration) waits for
    every process (``--dist-timeout``)."""
    collective_timeout: float | None = None
    """Seconds any collective waits (``init_process_group``'s timeout); None: torch's default."""

    def __post_init__(self) -> None:
        """Check every field, naming it: ValueError for a value out of range (numbers must be
        finite), TypeError for a wrong kind."""
        check_text_field(self, "train", "data", hint=_DATA_HINT)
        check_text_field(self, "train", "out", hint=" (the run folder)")
        check_text_field(self, "train", "cache_dir", optional=True, hint=" (the corpus cache folder)")
        check_int_fields(self, "train", ("steps", "batch_size", "grad_accum_steps", "context", "eval_batch_size",
                                         "log_every", "keep_checkpoints"), minimum=1)
        check_divides("train.grad_accum_steps", self.grad_accum_steps, "train.batch_size", self.batch_size)
        check_int_fields(self, "train", ("warmup_steps", "eval_every", "checkpoint_every", "seed", "carry_windows",
                                         "max_skipped_steps"),
                         minimum=0, note=" (0 = never/none)")
        check_int_fields(self, "train", ("eval_tokens", "threads", "decay_steps", "lora_rank"), minimum=1,
                         optional=True)
        check_number_fields(self, "train", ("lr", "grad_clip"), low=0, low_inclusive=False, wanted="a positive number")
        check_number_fields(self, "train", ("min_lr_ratio",), low=0, high=1, wanted="in [0, 1]")
        check_number_fields(self, "train", ("beta1", "beta2"), low=0, high=1, high_inclusive=False, wanted="in [0, 1)")
        check_number_fields(self, "train", ("weight_decay",), low=0, wanted="a number >= 0")
        timeouts = ("dist_timeout",) + (("collective_timeout",) if self.collective_timeout is not None else ())
        check_number_fields(self, "train", timeouts, low=0, low_inclusive=False, wanted="a positive number of seconds")
        check_device("train.device", self.device)
        check_bool_fields(self, "train", ("bf16", "compile", "carry_state", "activation_checkpointing", "tensorboard"))
        if self.parallel is not None:
            check_choice("train.parallel", self.parallel, STRATEGIES)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TrainConfig":
        return config_from_dict(cls, values, "train")


def read_toml(path: str | Path, flag: str = "--config", hint: str = "") -> dict[str, Any]:
    """The TOML document at ``path``; a missing file or invalid TOML is a ValueError naming
    ``flag`` and the path (``hint`` follows "no such file")."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file{hint}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{flag} {path}: not valid TOML ({error})") from None


def load_run_file(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a TOML run file -> ``(model values, train values)``; only ``[model]`` and ``[train]``."""
    document = read_toml(path)
    unknown = sorted(set(document) - {"model", "train"})
    if unknown:
        raise ValueError(f"--config {path}: unknown tables {unknown}; expected [model] and [train]")
    return dict(document.get("model", {})), dict(document.get("train", {}))


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"model.d_model=128"`` -> ``("model", "d_model", 128)``; the value is read as TOML
    (numbers, booleans, quoted strings, lists), else taken as a bare string."""
    key, sep, raw = text.partition("=")
    table, dot, name = key.strip().partition(".")
    if not sep or not dot or table not in ("model", "train") or not name:
        raise ValueError(f"--set expects model.KEY=VALUE or train.KEY=VALUE, got {text!r}")
    try:
        value = tomllib.loads(f"value = {raw.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return table, name, value


def build_configs(model_values: dict[str, Any], train_values: dict[str, Any]) -> tuple[LMConfig, TrainConfig]:
    return LMConfig.from_dict(model_values), TrainConfig.from_dict(train_values)
