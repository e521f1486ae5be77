"""``linattn convert``: a trained softmax GAU model becomes a Transformer-VQ model; a Hugging Face
Llama, Mistral or Qwen2 checkpoint becomes a linattn run (``--to softmax``, an exact import:
``pretrained_run.py``); a softmax transformer, imported or a linattn run, becomes a linear-time
model of any layer specs (``--to vq-attn:rerope``, ``gated-delta``, ...: ``linearize.py``).

A ``gau-softmax`` layer and a ``vq`` layer have the same parameters — the VQ unit only adds
a codebook for its keys (seed 000: "VQ the keys and the complexity becomes linear"). So a
run whose layers include ``gau-softmax`` converts by copying every weight and giving each
converted unit a codebook fitted to the keys it actually produces: the model reads
``calibration_tokens`` tokens of the training split (windows of the run's context, no
carried state), each converted unit's keys are collected, and k-means (k-means++ seeds,
``kmeans_iters`` Lloyd iterations, per head) on them gives the codes. For ``vq`` the EMA
statistics start from the final assignment, scaled to one training step's worth of tokens
(``ema_counts`` = counts x tokens per step / N, ``ema_sums`` = codes x ``ema_counts``; a code
no key chose keeps its place with a count of 0.01); ``soft-vq`` takes the centers as its
learned codebook.

The converted run is a run folder like any other (``linattn eval``, ``generate``, ``export``)
holding one checkpoint at the source's step, with the source's data position and a fresh
optimizer state: ``linattn train --resume --out RUN --steps N`` fine-tunes it (a finished
source schedule continues at its floor learning rate). It is written beside ``--out`` and
renamed into place (``run_folder.new_run_folder``), so a convert that is killed leaves no
half-written run there and can be run again.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from .models import LM, LMConfig
from .models.layers import GAUPair
from .nn.codebook import kmeans_codes
from .train.checkpoint import load_checkpoint, load_model, save_checkpoint
from .train.cli import add_runtime_flags, apply_threads
from .train.optim import trainer_adamw
from .linearize import SOURCE_KINDS, LinearizeOptions, calibration_ids, describe, is_hf_folder, linearized_run
from .pretrained_run import import_hf_run
from .train.run_folder import check_free_output, new_run_folder
from .train.run_tokenizer import DATA_META_FILE, TOKENIZER_FILE, copy_tokenizer
from ._checks import check_choice, check_int, non_negative_int, positive_float, positive_int

TARGETS = ("vq", "soft-vq")
IMPORT_TARGET = "softmax"
_GAU_OPTIONS = ("codebook_size", "calibration_tokens", "kmeans_iters", "seed")
_TRANSFER_OPTIONS = ("transfer_steps", "transfer_lr")
_IMPORT_OPTIONS = ("data", "overrides")
_ALL_OPTIONS = (*_GAU_OPTIONS, *_TRANSFER_OPTIONS, *_IMPORT_OPTIONS)
# what each way of converting takes, and why the rest does not apply
_MODES = {
    "import": (_IMPORT_OPTIONS, "an exact import has no codebooks or new parameters"),
    "gau": (_GAU_OPTIONS, "a gau-softmax run converts to vq or soft-vq by its own weights and k-means codebooks; "
                          "--data, --set and attention transfer are for converting a softmax transformer"),
    "linearize": (_ALL_OPTIONS, ""),
}


def converted_config(config: LMConfig, to: str, codebook_size: int | None = None) -> LMConfig:
    """``config`` with every ``gau-softmax`` layer as ``to`` (``vq`` or ``soft-vq``)."""
    check_choice("to", to, TARGETS)
    specs = [str(spec) for spec in config.layer_specs()]
    if not any(spec.split(":")[0] == "gau-softmax" for spec in specs):
        raise ValueError(f"the model has no gau-softmax layer to convert (its layers: {', '.join(specs)}); "
                         f"conversion maps a gau-softmax layer onto {to} with the same weights")
    if any(spec != "gau-softmax" and spec.startswith("gau-softmax:") for spec in specs):
        raise ValueError(f"a gau-softmax layer with options ({specs}) has no VQ twin to convert to")
    values = config.to_dict()
    values["attention"] = [to if spec == "gau-softmax" else spec for spec in specs]
    if codebook_size is not None:
        values["codebook_size"] = check_int("codebook_size", codebook_size, minimum=1)
    return LMConfig.from_dict(values)


def _converted_units(source: LM, model: LM | None = None) -> list:
    """The GAU units of ``model`` (default ``source``) at the places of ``source``'s
    ``gau-softmax`` layers, in order."""
    return [unit for spec, layer in zip(source.specs, (model or source).layers)
            if spec.kind == "gau-softmax" and isinstance(layer, GAUPair) for unit in layer.units]


@torch.no_grad()
def collect_keys(model: LM, ids: torch.Tensor) -> list[torch.Tensor]:
    """The keys each ``gau-softmax`` unit attends with on ``ids [B, T]``: ``[N, d_k]`` per unit."""
    units, keys = _converted_units(model), []
    for unit in units:
        record, attend = [], unit._attend

        def recording(queries, k, *rest, _record=record, _attend=attend):
            _record.append(k.reshape(-1, k.shape[-1]))
            return _attend(queries, k, *rest)

        unit._attend = recording
        keys.append(record)
    try:
        model.eval()(ids)
    finally:
        for unit in units:
            del unit._attend
    return [torch.cat(record) for record in keys]


@torch.no_grad()
def convert_model(source: LM, calibration: torch.Tensor, *, to: str = "vq", codebook_size: int | None = None,
                  kmeans_iters: int = 20, tokens_per_step: int | None = None, seed: int = 0) -> LM:
    """The ``to`` model with ``source``'s weights and codebooks fitted on the keys of
    ``calibration [B, T]`` (see the module docstring)."""
    check_int("kmeans_iters", kmeans_iters, minimum=0)
    config = converted_config(source.config, to, codebook_size)
    target = LM(config).to(next(source.parameters()).device)
    missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
    if unexpected or any(".quantizer." not in name and not name.endswith(".codebook") for name in missing):
        raise ValueError(f"the models differ beyond the codebooks: missing {missing}, unexpected {unexpected}")
    generator = torch.Generator().manual_seed(seed)
    for unit, keys in zip(_converted_units(source, target), collect_keys(source, calibration)):
        centers, counts = kmeans_codes(keys.unsqueeze(0).cpu(), config.codebook_size, kmeans_iters, generator,
                                       tokens_per_step=tokens_per_step)
        if to == "soft-vq":
            unit.codebook.copy_(centers.to(unit.codebook))
        else:
            unit.quantizer.set_codes(centers, counts)
    return target


def convert_run(ckpt: str | Path, out: str | Path, *, to: str = "vq", codebook_size: int | None = None,
                calibration_tokens: int = 65536, kmeans_iters: int = 20, seed: int = 0, command: str = "",
                device: str = "cpu", echo=print) -> Path:
    """Convert the run (or checkpoint) ``ckpt`` into a new run folder ``out`` (the model runs on
    ``device``); returns its checkpoint."""
    out = Path(out)
    check_free_output(out, what="convert")
    source, checkpoint = load_model(ckpt, device)  # a CheckpointError if its tensors do not match its config
    train_config = dict(checkpoint.meta["train_config"])
    context = int(train_config["context"])
    ids = calibration_ids(train_config["data"], calibration_tokens, context,
                          cache_dir=train_config.get("cache_dir")).to(device)
    tokens_per_step = int(train_config["batch_size"]) * context * int(checkpoint.meta.get("world_size", 1))
    model = convert_model(source, ids, to=to, codebook_size=codebook_size, kmeans_iters=kmeans_iters,
                          tokens_per_step=tokens_per_step, seed=seed)
    source_run = checkpoint.path.parent.parent
    meta = {key: value for key, value in checkpoint.meta.items()
            if key not in ("format", "version", "step", "files", "optimizer", "rng", "carry", "threads")}
    meta.update(model_config=model.config.to_dict(), train_config={**train_config, "out": str(out)}, command=command,
                converted_from={"checkpoint": str(checkpoint.path), "step": checkpoint.step, "to": to,
                                "codebook_size": model.config.codebook_size, "calibration_tokens": ids.numel(),
                                "kmeans_iters": kmeans_iters, "seed": seed})

    def copy_run_files(run: Path) -> None:
        for name in (TOKENIZER_FILE, DATA_META_FILE):
            if (source_run / name).is_file():
                shutil.copyfile(source_run / name, run / name)

    path = write_run(out, model, meta, step=checkpoint.step, world_size=int(checkpoint.meta.get("world_size", 1)),
                     command=command, add_files=copy_run_files)
    echo(f"converted {checkpoint.path} ({', '.join(str(s) for s in source.specs)}) to {to} "
         f"(codebook {model.config.codebook_size}, k-means on {ids.numel():,} tokens): {path}")
    return path


def write_run(out: Path, model: LM, meta: dict, *, step: int, world_size: int, command: str,
              add_files: Callable[[Path], None]) -> Path:
    """Write the run folder ``out`` (new or empty): under its lock, the files ``add_files(out)``
    puts there (the run's tokenizer), then one checkpoint at ``step`` holding ``model``, a
    fresh optimizer state for ``meta["train_config"]``, no carried state for each of
    ``world_size`` processes, and ``meta``. Returns the checkpoint folder."""
    train_config = meta["train_config"]
    optimizer = trainer_adamw(model, lr=float(train_config["lr"]), weight_decay=float(train_config["weight_decay"]),
                              betas=(float(train_config["beta1"]), float(train_config["beta2"])))
    with new_run_folder(out, what="convert") as folder:  # written once the conversion has worked
        add_files(folder)
        written = save_checkpoint(folder / "checkpoints", step=step, model_tensors=model.state_dict(),
                                  optimizer_state=optimizer.state_dict(), rng={"torch": torch.get_rng_state()},
                                  carries=[None] * world_size, meta=meta,
                                  keep=int(train_config.get("keep_checkpoints", 2)))
    return Path(out) / "checkpoints" / written.name


def convert_hf(hf_dir: str | Path, out: str | Path, *, data: str | None, overrides: list[str] = (),
               command: str = "", echo=print) -> Path:
    """``linattn convert --ckpt HF_DIR --to softmax``: the run folder ``out`` importing the
    Hugging Face checkpoint ``hf_dir`` (``pretrained_run.py``); returns its checkpoint."""
    out = Path(out)
    check_free_output(out, what="convert")
    run = import_hf_run(hf_dir, out, data=data, overrides=overrides, command=command)
    path = write_run(out, run.model, run.meta, step=0, world_size=1, command=command,
                     add_files=lambda folder: copy_tokenizer(run.data, folder))
    specs = ", ".join(sorted({str(spec) for spec in run.model.specs}))
    echo(f"imported {hf_dir} ({run.meta['imported_from']['architecture']}, {run.model.config.n_layers} layers of "
         f"{specs}, {run.model.num_parameters() / 1e6:.2f}M parameters, vocabulary {run.model.config.vocab_size}) "
         f"with its tokenizer, training on {run.data.folder}: {path}")
    return path


def convert_linear(ckpt: str | Path, out: str | Path, *, to: str, data: str | None = None,
                   overrides: list[str] = (), options: LinearizeOptions = LinearizeOptions(), command: str = "",
                   echo=print) -> Path:
    """``linattn convert --ckpt SRC --to SPEC``: the run folder ``out`` holding the softmax transformer
    ``ckpt`` (a Hugging Face folder or a linattn run) converted to the layers of ``to``
    (``linearize.py``); returns its checkpoint."""
    out = Path(out)
    check_free_output(out, what="convert")
    run = linearized_run(ckpt, out, to=to, data=data, overrides=overrides, options=options, command=command)
    path = write_run(out, run.model, run.meta, step=run.step, world_size=run.world_size, command=command,
                     add_files=run.copy_files)
    echo(describe(run, ckpt, path))
    return path


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``linattn convert``."""
    parser = commands.add_parser(
        "convert", help="make a softmax transformer (a Hugging Face Llama/Mistral/Qwen2 folder or a linattn run) "
                        "linear-time, import one (--to softmax), or turn a gau-softmax model into Transformer-VQ",
        description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--ckpt", required=True,
                        help="the source: a linattn run folder or checkpoint, or a Hugging Face model folder")
    parser.add_argument("--to", default="vq", metavar="SPEC",
                        help="the layers to convert to: a layer spec or comma-separated pattern (e.g. vq-attn:rerope, "
                             "'gated-delta', 'vq-attn:bias,softmax'; a layer given its source's spec is kept); "
                             "'softmax' from a Hugging Face folder imports it exactly; 'vq' or 'soft-vq' from a "
                             "gau-softmax run (default vq)")
    parser.add_argument("--codebook-size", type=positive_int, help="S of the new codebooks (default: the run's)")
    parser.add_argument("--calibration-tokens", type=positive_int,
                        help="training-split tokens whose keys fit the codebooks and on which attention transfer "
                             "fits new parameters (default 65536)")
    parser.add_argument("--kmeans-iters", type=non_negative_int,
                        help="Lloyd iterations after the k-means++ seeds (default 20)")
    parser.add_argument("--seed", type=non_negative_int, help="k-means and attention-transfer seed (default 0)")
    parser.add_argument("--transfer-steps", type=non_negative_int,
                        help="attention-transfer steps fitting the new parameters (gates, decays, feature maps, a "
                             "bias table) to the softmax layers' outputs (default 200; 0: none)")
    parser.add_argument("--transfer-lr", type=positive_float, help="attention transfer's Adam learning rate "
                                                                   "(default 1e-2)")
    parser.add_argument("--data", metavar="DATA",
                        help="calibration and fine-tuning data: from a Hugging Face folder a shard folder tokenized "
                             "with its tokenizer.json (linattn data prepare --tokenizer HF_DIR/tokenizer.json); "
                             "from a run, data of the run's tokenizer (default: the run's own)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="a training setting of the new run (train.KEY=VALUE, e.g. --set train.lr=3e-5) or, when "
                             "converting a softmax transformer, a model setting of the student (e.g. --set "
                             "model.block_size=64); repeatable")
    parser.add_argument("--out", required=True, type=Path, help="the new run folder")
    add_runtime_flags(parser, progress=False)
    parser.set_defaults(handler=_run)


def _mode(ckpt: str, to: str) -> str:
    """``"import"`` (a Hugging Face folder, ``--to softmax``), ``"gau"`` (``--to vq|soft-vq`` from a run
    with gau-softmax layers, or without a softmax or local layer to linearize) or ``"linearize"``
    (everything else: a softmax transformer to ``--to``)."""
    if is_hf_folder(ckpt):
        return "import" if to == IMPORT_TARGET else "linearize"
    if to in TARGETS:
        kinds = {spec.kind for spec in LMConfig.from_saved(load_checkpoint(ckpt).meta["model_config"]).layer_specs()}
        if "gau-softmax" in kinds or not kinds & set(SOURCE_KINDS):
            return "gau"
    return "linearize"


def _run(args: argparse.Namespace) -> int:
    apply_threads(args)
    mode = _mode(args.ckpt, args.to)
    allowed, why = _MODES[mode]
    given = [name for name in _ALL_OPTIONS if name not in allowed and getattr(args, name) not in (None, [])]
    if given:
        flags = ", ".join("--set" if name == "overrides" else f"--{name.replace('_', '-')}" for name in given)
        raise ValueError(f"{flags}: not an option of --to {args.to} from {args.ckpt} ({why})")
    if mode == "import":
        convert_hf(args.ckpt, args.out, data=args.data, overrides=args.overrides, command=args.command_line)
        return 0
    options = {name: getattr(args, name) for name in (*_GAU_OPTIONS, *_TRANSFER_OPTIONS)
               if getattr(args, name) is not None}
    if mode == "gau":
        convert_run(args.ckpt, args.out, to=args.to, command=args.command_line, device=args.device, **options)
        return 0
    convert_linear(args.ckpt, args.out, to=args.to, data=args.data, overrides=args.overrides,
                   options=LinearizeOptions(**options), command=args.command_line)
    return 0
