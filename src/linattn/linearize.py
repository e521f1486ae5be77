"""``linattn convert --ckpt SRC --to SPEC``: a softmax transformer made linear-time.

SRC is a Hugging Face Llama, Mistral or Qwen2 folder (``LM.from_hf``, trained on ``--data``, a
shard folder tokenized with its ``tokenizer.json``) or a linattn run whose layers are ``softmax`` or
``local`` (its own data unless ``--data`` names other data of its tokenizer). SPEC is a layer
spec list as ``LMConfig.attention`` takes it (one spec for every layer, or a pattern): each layer
whose spec differs from the source's is converted, a layer given its own spec is kept as it is (a
hybrid that keeps some softmax or sliding-window layers). The student takes every tensor of the
teacher (embedding, norms, feed-forward, head, and the q/k/v/o projections of each converted layer);
a target kind that has no place for one of them (``vq``, the GAU pair of the original
Transformer-VQ, which has no q/k/v/o projections) is refused naming the tensor. What is new:

- ``vq-attn:rerope[=W]`` / ``vq-attn:bias`` (``nn/vq_heads.py``): the survey's recipe. Each layer's
  codebooks, one per key/value head, are k-means centers of the keys the teacher computes on the
  first ``calibration_tokens`` training tokens (``calibration_ids``: windows of the run's context):
  the UNROTATED keys ``W_k x``, since ReRoPE rotates inside the attention and the codes must stand
  for a key wherever it sits (``nn.codebook.kmeans_codes``: k-means++ seeds, ``kmeans_iters`` Lloyd
  iterations; the EMA statistics seeded from the final assignment, scaled to one training step).
  ``vq-attn:bias``'s bias table is then fitted by attention transfer.
- every other new parameter (``gated-delta``'s decay, beta and output gate, ``gla``'s decay and gate,
  ``linear:hedgehog``'s feature maps, ...) is fitted by attention transfer (``attention_transfer.py``):
  layer by layer, the teacher's attention outputs on the calibration windows, the teacher frozen,
  only the new parameters trained (``transfer_steps`` Adam steps at ``transfer_lr``). A short
  convolution over q/k/v (``gated-delta``, ``delta``) starts as the identity, so the teacher's
  projections are what the layer reads.

The converted run is a run folder like any other (``convert.write_run``): one checkpoint with a
fresh optimizer state (at step 0 for a Hugging Face source, at the source's step for a run), the
source's tokenizer, and a record of the conversion (``converted_from`` in its ``meta.json``, with
attention transfer's loss per layer before and after). ``linattn train --resume --out RUN``
fine-tunes it (``--lora-rank R``: LoRA adapters, merged by every reader of the checkpoints);
``linattn export`` writes it for transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .attention_transfer import attention_transfer, new_parameters
from .data import data_fingerprint, open_data
from .models import LM, LMConfig, parse_layer_spec
from .models.pretrained import hf_lm_config, read_config_file
from .nn.codebook import kmeans_codes
from .nn.short_conv import ShortConvolution
from .nn.vq_heads import MultiHeadVQAttention
from .pretrained_run import import_hf_run
from .train.checkpoint import load_model
from .train.config import TrainConfig, parse_override
from .train.run_tokenizer import DATA_META_FILE, TOKENIZER_FILE, check_same_tokenizer, copy_tokenizer
from ._checks import check_int, check_positive_number

SOURCE_KINDS = ("softmax", "local")  # the layers a conversion reads (others can only be kept)
_GAU_KINDS = ("vq", "vq-fsq", "soft-vq", "gau-softmax")


@dataclass(frozen=True)
class LinearizeOptions:
    """The settings of a conversion (``linattn convert``'s flags)."""

    codebook_size: int | None = None  # S of the vq-attn codebooks (None: the source model's codebook_size)
    calibration_tokens: int = 65536
    kmeans_iters: int = 20
    seed: int = 0
    transfer_steps: int = 200
    transfer_lr: float = 1e-2

    def __post_init__(self) -> None:
        check_int("codebook_size", self.codebook_size, minimum=1, optional=True)
        check_int("calibration_tokens", self.calibration_tokens, minimum=1)
        check_int("kmeans_iters", self.kmeans_iters, minimum=0)
        check_int("seed", self.seed, minimum=0)
        check_int("transfer_steps", self.transfer_steps, minimum=0)
        check_positive_number("transfer_lr", self.transfer_lr, finite=True)


@dataclass
class ConvertedRun:
    """What ``convert.write_run`` writes: the student, its checkpoint's ``meta``, step and world
    size, and ``copy_files(folder)``, which puts the run's tokenizer there."""

    model: LM
    meta: dict[str, Any]
    step: int
    world_size: int
    copy_files: Callable[[Path], None]


def is_hf_folder(path: str | Path) -> bool:
    """Whether ``path`` is a Hugging Face model folder (a ``config.json``, no linattn run or checkpoint)."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "checkpoints").exists() \
        and not (path / "meta.json").exists()


def calibration_ids(data_spec: str, n_tokens: int, context: int, *, cache_dir=None) -> torch.Tensor:
    """The first ``n_tokens`` tokens of the training split as windows ``[n_tokens // context, context]``."""
    tokens = open_data(data_spec, cache_dir=cache_dir).tokens("train")
    rows = min(n_tokens, tokens.numel()) // context
    if rows < 1:
        raise ValueError(f"--calibration-tokens {n_tokens} gives no whole window of the run's context {context}")
    return tokens[: rows * context].long().reshape(rows, context)


# -- the student's configuration and weights ----------------------------------------------


def student_config(teacher: LMConfig, to: str, overrides: dict[str, Any] | None = None) -> LMConfig:
    """The teacher's ``LMConfig`` with ``attention = to`` (and the ``overrides``, ``--set model.KEY=V``).
    Every layer whose spec changes must be a ``softmax`` or ``local`` layer of the teacher turned into
    a kind that keeps q/k/v/o projections (not a GAU pair), and at least one must change; else a
    ValueError naming the layer and both specs."""
    overrides = dict(overrides or {})
    for name in ("attention", "n_layers"):
        if name in overrides:
            raise ValueError(f"--set model.{name}: the student's layers are the teacher's, with the kinds --to gives")
    try:
        pattern = [parse_layer_spec(text) for text in to.split(",")]
    except ValueError as error:
        raise ValueError(f"--to {to}: {error}") from None
    if len(pattern) > teacher.n_layers:
        raise ValueError(f"--to {to}: {len(pattern)} layer specs for a source of {teacher.n_layers} layers")
    targets = [pattern[i % len(pattern)] for i in range(teacher.n_layers)]
    pairs = list(zip(teacher.layer_specs(), targets))
    for index, (source, target) in enumerate(pairs):
        if source == target:
            continue
        if source.kind not in SOURCE_KINDS:
            raise ValueError(f"--to {to}: layer {index} of the source is {str(source)!r}; only "
                             f"{' and '.join(SOURCE_KINDS)} layers convert (give {str(source)!r} at its place to "
                             "keep it)")
        if target.kind in _GAU_KINDS:
            raise ValueError(f"--to {to}: layer {index} would become {str(target)!r}, Transformer-VQ's pair of gated "
                             "attention units, which has no q/k/v/o projections of a transformer to keep; "
                             "'vq-attn:rerope' and 'vq-attn:bias' are multi-head VQ attention over the teacher's")
    if all(source == target for source, target in pairs):
        raise ValueError(f"--to {to}: every layer of the source already is what --to gives; nothing to convert")
    try:
        return LMConfig.from_dict({**teacher.to_dict(), **overrides, "attention": to})
    except (ValueError, TypeError) as error:
        raise ValueError(f"--to {to}: {error}") from None


def converted_layers(teacher: LMConfig, student: LMConfig) -> list[int]:
    """The indices of the layers whose spec differs between the two configs."""
    return [i for i, (a, b) in enumerate(zip(teacher.layer_specs(), student.layer_specs())) if a != b]


def student_with_teacher_weights(teacher: LM, config: LMConfig, seed: int = 0) -> tuple[LM, set[str]]:
    """The ``LM`` of ``config`` holding every tensor of ``teacher``, and the names of those tensors
    (a tensor the student has no place for, or one of another shape, is a ValueError naming it).
    The new parameters are initialised from ``seed`` (the global random state is left as it was);
    short convolutions over q/k/v in converted layers start as the identity."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        student = LM(config).to(next(teacher.parameters()).device)
    wanted = student.state_dict()
    kept = {}
    for name, tensor in teacher.state_dict().items():
        if name not in wanted or wanted[name].shape != tensor.shape:
            raise ValueError(_no_place(name, tensor, wanted, student))
        kept[name] = tensor
    student.load_state_dict({**wanted, **kept}, strict=True)
    for index in converted_layers(teacher.config, config):
        for module in student.layers[index].modules():
            if isinstance(module, ShortConvolution):
                _identity_convolution(module)
    return student, set(kept)


def _no_place(name: str, tensor: torch.Tensor, wanted: dict[str, torch.Tensor], student: LM) -> str:
    """Why the teacher's tensor ``name`` does not go into the student (a sentence naming it)."""
    where = "the student"
    if name.startswith("layers."):
        index = int(name.split(".")[1])
        where = f"layer {index} ({str(student.specs[index])!r})"
    if name in wanted:
        return (f"--to: the teacher's {name} has shape {list(tensor.shape)} but {where} holds "
                f"{list(wanted[name].shape)} there (a --set model.* setting that changes the shapes?)")
    return f"--to: the teacher's {name} {list(tensor.shape)} has no place in {where}"


@torch.no_grad()
def _identity_convolution(conv: ShortConvolution) -> None:
    """``conv`` passes each channel through unchanged (before its SiLU): the last tap 1, the rest 0."""
    conv.weight.zero_()
    conv.weight[..., -1] = 1.0
    conv.bias.zero_()


# -- codebooks by k-means on the teacher's keys ---------------------------------------------


@torch.no_grad()
def teacher_keys(teacher: LM, layers: list[int], ids: torch.Tensor, batch_size: int = 8) -> dict[int, torch.Tensor]:
    """The unrotated keys ``W_k x`` of the teacher's ``layers`` on the windows ``ids [N, T]``, as
    ``{layer: [n_kv_heads, N T, head_dim]}`` (float32, on the CPU)."""
    records: dict[int, list[torch.Tensor]] = {index: [] for index in layers}
    handles = [teacher.layers[index].mixer.k_proj.register_forward_hook(
        lambda module, inputs, output, _index=index: records[_index].append(output.detach().float().cpu()))
        for index in layers]
    teacher.eval()
    try:
        for rows in ids.split(batch_size):
            teacher(rows, check_inputs=False)
    finally:
        for handle in handles:
            handle.remove()
    keys = {}
    for index, pieces in records.items():
        mixer = teacher.layers[index].mixer
        flat = torch.cat([piece.reshape(-1, piece.shape[-1]) for piece in pieces])
        keys[index] = flat.view(-1, mixer.n_kv_heads, mixer.head_dim).transpose(0, 1).contiguous()
    return keys


def fit_codebooks(teacher: LM, student: LM, layers: list[int], ids: torch.Tensor, *, iters: int,
                  generator: torch.Generator, tokens_per_step: int | None) -> list[int]:
    """Set the codebooks of the student's ``vq-attn`` layers among ``layers`` to ``kmeans_codes`` of
    the teacher's keys there on ``ids``; returns those layers."""
    vq_layers = [i for i in layers if isinstance(student.layers[i].mixer, MultiHeadVQAttention)]
    if not vq_layers:
        return []
    for index, keys in teacher_keys(teacher, vq_layers, ids).items():
        quantizer = student.layers[index].mixer.quantizer
        centers, counts = kmeans_codes(keys, quantizer.codebook_size, iters, generator,
                                       tokens_per_step=tokens_per_step)
        quantizer.set_codes(centers, counts)
    return vq_layers


def linearize_model(teacher: LM, ids: torch.Tensor, to: str, options: LinearizeOptions, *,
                    model_overrides: dict[str, Any] | None = None, tokens_per_step: int | None = None,
                    transfer_batch: int = 8) -> tuple[LM, dict]:
    """The student of ``teacher`` for ``--to to`` (module docstring), with codebooks and new parameters
    fitted on the calibration windows ``ids [N, T]``; and the record of what was done."""
    overrides = dict(model_overrides or {})
    if options.codebook_size is not None:
        overrides["codebook_size"] = options.codebook_size
    config = student_config(teacher.config, to, overrides)
    student, kept = student_with_teacher_weights(teacher, config, options.seed)
    layers = converted_layers(teacher.config, config)
    generator = torch.Generator().manual_seed(options.seed)
    vq_layers = fit_codebooks(teacher, student, layers, ids, iters=options.kmeans_iters, generator=generator,
                              tokens_per_step=tokens_per_step)
    fitted = new_parameters(student, kept)
    transfer_layers = sorted({int(name.split(".")[1]) for name in fitted})
    transfer = None
    if transfer_layers and options.transfer_steps:
        transfer = attention_transfer(teacher, student, transfer_layers, ids, list(fitted.values()),
                                      steps=options.transfer_steps, lr=options.transfer_lr,
                                      batch_size=transfer_batch, seed=options.seed)
    record = {"to": [str(spec) for spec in config.layer_specs()], "converted_layers": layers,
              "kmeans_layers": vq_layers, "codebook_size": config.codebook_size, "calibration_tokens": ids.numel(),
              "kmeans_iters": options.kmeans_iters, "seed": options.seed, "new_parameters": sorted(fitted),
              "attention_transfer": transfer}
    return student.eval(), record


# -- the run -------------------------------------------------------------------------------


def _split_overrides(overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``--set`` texts -> (model settings, the train.* texts as given)."""
    model, train = {}, []
    for text in overrides:
        table, key, value = parse_override(text)
        if table == "model":
            model[key] = value
        else:
            train.append(text)
    return model, train


def _train_overridden(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A run's ``train_config`` with the ``--set train.KEY=VALUE`` overrides (``data``/``out`` refused)."""
    values = dict(values)
    for text in overrides:
        _, key, value = parse_override(text)
        if key in ("data", "out"):
            raise ValueError(f"--set {text}: train.{key} is given by --{key}")
        values[key] = value
    return TrainConfig.from_dict(values).to_dict()


def linearized_run(ckpt: str | Path, out: str | Path, *, to: str, data: str | None, overrides: list[str] = (),
                   options: LinearizeOptions = LinearizeOptions(), command: str = "") -> ConvertedRun:
    """Everything of the run ``out`` that converts ``ckpt`` (module docstring); nothing is written."""
    model_overrides, train_overrides = _split_overrides(list(overrides))
    if options.codebook_size is not None:
        model_overrides["codebook_size"] = options.codebook_size
    if is_hf_folder(ckpt):  # the specs are checked before the weights and the data are read
        student_config(hf_lm_config(read_config_file(Path(ckpt)), str(Path(ckpt) / "config.json")), to,
                       model_overrides)
        imported = import_hf_run(ckpt, out, data=data, overrides=train_overrides, command=command, target=to)
        teacher, meta, train_config, step = imported.model, imported.meta, imported.train_config, 0
        source = {"folder": str(Path(ckpt).resolve()), "architecture": meta["imported_from"]["architecture"]}
        world_size = 1

        def copy_files(folder: Path) -> None:
            copy_tokenizer(imported.data, folder)
    else:
        teacher, checkpoint, meta, train_config, copy_files = _run_source(ckpt, out, data, train_overrides)
        step, world_size = checkpoint.step, int(meta.get("world_size", 1))
        source = {"checkpoint": str(checkpoint.path), "step": step}
    context = int(train_config["context"])
    ids = calibration_ids(train_config["data"], options.calibration_tokens, context,
                          cache_dir=train_config.get("cache_dir"))
    tokens_per_step = int(train_config["batch_size"]) * context * world_size
    student, record = linearize_model(teacher, ids, to, options, model_overrides=model_overrides,
                                      tokens_per_step=tokens_per_step, transfer_batch=int(train_config["batch_size"]))
    meta.update(model_config=student.config.to_dict(), train_config=train_config, command=command,
                converted_from={**source, **record})
    return ConvertedRun(model=student, meta=meta, step=step, world_size=world_size, copy_files=copy_files)


def _run_source(ckpt: str | Path, out: str | Path, data: str | None, train_overrides: list[str]):
    """A linattn run as the teacher: ``(model, checkpoint, meta, train_config, copy_files)``, on its own
    data or on ``data`` (of the run's tokenizer; the data position then restarts)."""
    teacher, checkpoint = load_model(ckpt)
    meta = {key: value for key, value in checkpoint.meta.items()
            if key not in ("format", "version", "step", "files", "optimizer", "rng", "carry")}
    values = {**checkpoint.meta["train_config"], "out": str(out)}
    source_run = checkpoint.path.parent.parent
    opened = None
    if data is not None:
        opened = open_data(data, cache_dir=values.get("cache_dir"))
        check_same_tokenizer(checkpoint.meta.get("tokenizer"), opened, what=f"--data {data}")
        values["data"] = data if data == "shakespeare" else str(Path(data).resolve())
        streams = int(values["batch_size"]) * int(meta.get("world_size", 1))
        meta.update(data_fingerprint=data_fingerprint(opened), tokens_seen=0,
                    data={"window": 0, "pass": 0, "streams": streams})
    train_config = _train_overridden(values, train_overrides)

    def copy_files(folder: Path) -> None:
        if opened is not None:
            copy_tokenizer(opened, folder)
            return
        for name in (TOKENIZER_FILE, DATA_META_FILE):
            if (source_run / name).is_file():
                (folder / name).write_bytes((source_run / name).read_bytes())

    return teacher, checkpoint, meta, train_config, copy_files


def describe(run: ConvertedRun, ckpt: str | Path, path: Path) -> str:
    """The line ``linattn convert`` prints for a conversion."""
    record = run.meta["converted_from"]
    transfer = record["attention_transfer"]
    fitted = "" if transfer is None else (
        f"; attention transfer on {len(transfer['layers'])} layers ({transfer['parameters']:,} parameters, "
        f"{transfer['steps']} steps): loss {sum(transfer['loss_before'].values()):.4g} -> "
        f"{sum(transfer['loss_after'].values()):.4g}")
    codebooks = (f"; codebooks of {record['codebook_size']} codes by k-means on the keys of "
                 f"{record['calibration_tokens']:,} tokens in layers {record['kmeans_layers']}"
                 if record["kmeans_layers"] else "")
    return (f"converted {ckpt} to {', '.join(sorted(set(record['to'])))} (layers {record['converted_layers']} "
            f"converted){codebooks}{fitted}: {path}")
