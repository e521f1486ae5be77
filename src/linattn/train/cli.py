"""``linattn train``, ``linattn eval``, ``linattn generate`` and ``linattn plot``.

Configuration precedence for ``train``: defaults < ``--config FILE.toml`` ([model] and
[train] tables) < the named flags < ``--set table.key=value``; ``--out`` names the run folder
(``train.out``), and a ``--set train.out`` that names another is refused. ``--resume`` takes the
configuration from the run's latest checkpoint. With a shard folder as ``--data``,
``model.vocab_size`` is the tokenizer's (an explicit different value is an error). With
``--resume``, only ``--steps``, ``--parallel``, ``--lora-rank``, ``--threads``,
``--dist-timeout``, ``--batch-size`` (keeping the run's global batch) and ``--set`` of
``train/resharding.py``'s ``RESUME_SETTINGS`` (accumulation, activation checkpointing, the
timeouts) may change the run.

``train --resume`` and ``eval`` without ``--data`` read the data the run trained on (its
absolute path in the checkpoint) and compare it with the checkpoint's fingerprint of it:
data that changed, moved or is missing is an error unless ``--accept-new-data``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .._checks import non_negative_int as _non_negative_int
from .._checks import available_device_name, device_name
from .._checks import non_negative_float as _non_negative_float, positive_fraction as _positive_fraction
from .._checks import positive_float as _positive_float, positive_int as _positive_int
from ..data import (bits_per_byte, check_vocabulary, data_fingerprint, data_vocab_size, evaluated_bytes,
                    fingerprint_changes, open_data)
from ..models.layers import layer_spec_help
from ..models.sampling import NonFiniteLogits
from .checkpoint import Checkpoint, load_model
from .config import TrainConfig, build_configs, load_run_file, parse_override
from .evaluate import check_evaluation_fits, evaluate_bpb
from .run_tokenizer import check_same_tokenizer, load_run_tokenizer
from .trainer import train

# flag -> (table, key); these override the config file
_TRAIN_FLAGS = {
    "attention": ("model", "attention"), "d_model": ("model", "d_model"), "n_layers": ("model", "n_layers"),
    "n_heads": ("model", "n_heads"), "data": ("train", "data"), "steps": ("train", "steps"),
    "batch_size": ("train", "batch_size"), "context": ("train", "context"), "lr": ("train", "lr"),
    "seed": ("train", "seed"), "eval_every": ("train", "eval_every"),
    "checkpoint_every": ("train", "checkpoint_every"), "log_every": ("train", "log_every"),
    "device": ("train", "device"), "cache_dir": ("train", "cache_dir"), "bf16": ("train", "bf16"),
    "compile": ("train", "compile"), "parallel": ("train", "parallel"), "lora_rank": ("train", "lora_rank"),
    "dist_timeout": ("train", "dist_timeout"),
}
# the flags --resume takes (the rest of the configuration is the checkpoint's; --batch-size only
# with the run's global batch, and --set only for resharding.RESUME_SETTINGS)
_RESUME_FLAGS = ("steps", "parallel", "lora_rank", "batch_size", "dist_timeout")


def add_runtime_flags(parser: argparse.ArgumentParser, *, device: str | None = "cpu", progress: bool = True) -> None:
    """The runtime flags of a command that computes: ``--threads`` (torch CPU threads; apply
    them with ``apply_threads``), ``--device`` (default ``device``; a CUDA device only where
    torch sees one, so an unusable one is refused before anything runs) and, with
    ``progress``, ``--no-progress``."""
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="torch CPU threads (default: torch's, usually one per core)")
    parser.add_argument("--device", type=available_device_name, default=device,
                        help="cpu, cuda or cuda:N" + (f" (default: {device})" if device else ""))
    if progress:
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def apply_threads(args: argparse.Namespace) -> None:
    """``torch.set_num_threads(args.threads)`` when ``--threads`` was given."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``train``, ``eval`` and ``generate`` to the top-level subcommands."""
    p = commands.add_parser(
        "train", help="train a language model",
        description="Train an LM on bytes or on token shards (default: byte-level Transformer-VQ on "
                    "Shakespeare). " + layer_spec_help() + ".",
        epilog="Multi-process: torchrun --nproc_per_node N $(which linattn) train ... (gloo on CPU, nccl on GPU; "
               "DistributedDataParallel, or FSDP2 with --parallel fsdp). --resume continues a run at any number of "
               "processes that divides its global batch (batch size x processes), under either strategy. Less "
               "memory per step (also with --resume): "
               "--set train.grad_accum_steps=N, --set train.activation_checkpointing=true. Every process must be "
               "given the same settings and see the same run folder and data (compared before the first step).")
    p.add_argument("--config", metavar="FILE.toml", help="run file with [model] and [train] tables")
    p.add_argument("--attention", metavar="SPEC", help="layer attention spec or comma-separated pattern")
    p.add_argument("--d-model", dest="d_model", type=_positive_int)
    p.add_argument("--n-layers", dest="n_layers", type=_positive_int)
    p.add_argument("--n-heads", dest="n_heads", type=_positive_int)
    p.add_argument("--data", metavar="PATH",
                   help="'shakespeare', a text file, a folder of .txt files, an enwik8-style .zip (all read as "
                        "bytes), or a shard folder written by linattn data prepare (its tokenizer sets vocab_size)")
    p.add_argument("--cache-dir", dest="cache_dir", metavar="DIR",
                   help="corpus cache (default $LINATTN_CACHE or ~/.cache/linattn)")
    p.add_argument("--steps", type=_positive_int)
    p.add_argument("--batch-size", dest="batch_size", type=_positive_int, help="streams per process")
    p.add_argument("--context", type=_positive_int, help="tokens per training window")
    p.add_argument("--lr", type=_positive_float)
    p.add_argument("--seed", type=_non_negative_int)
    p.add_argument("--eval-every", dest="eval_every", type=_non_negative_int,
                   help="steps between evaluations (0: never)")
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=_non_negative_int)
    p.add_argument("--log-every", dest="log_every", type=_positive_int)
    p.add_argument("--device", type=device_name, help="cpu, cuda or cuda:N")
    p.add_argument("--bf16", action="store_true", default=None, help="bfloat16 autocast")
    p.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the model's forward and backward (the first steps take longer; on CPU "
                        "it needs a C++ compiler)")
    p.add_argument("--parallel", choices=("ddp", "fsdp"),
                   help="under torchrun: DistributedDataParallel (the default there) or FSDP2 (sharded); refused "
                        "without torchrun. With --resume: the strategy to continue under (default: the run's)")
    p.add_argument("--dist-timeout", dest="dist_timeout", type=_positive_float, metavar="SECONDS",
                   help="under torchrun: how long the processes wait for each other at start-up, where they meet "
                        "and compare their settings, checkpoint and data (default 120; train.collective_timeout: "
                        "the wait of every collective after that)")
    p.add_argument("--lora-rank", dest="lora_rank", type=_positive_int, metavar="R",
                   help="train LoRA adapters of rank R on the layers' linear maps instead of every parameter "
                        "(with --resume: from the checkpoint on, e.g. to fine-tune a converted run); eval, generate "
                        "and export merge them")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                   help="any [model]/[train] setting, e.g. --set model.codebook_size=256 (repeatable)")
    p.add_argument("--out", required=False, metavar="DIR", help="run folder (checkpoints, metrics.jsonl)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint (with --steps N: to N steps, e.g. to "
                        "extend a finished run; the extra steps train at the schedule's floor learning rate)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in an --out that holds one: the old run is moved aside to OUT.old-N "
                        "(nothing is deleted); without it such a folder is refused")
    p.add_argument("--from", dest="resume_from", metavar="STEP|PATH",
                   help="with --resume: the checkpoint to continue from, a step number or a checkpoint folder "
                        "(default: the latest)")
    p.add_argument("--accept-new-data", dest="accept_new_data", action="store_true",
                   help="with --resume: continue although the run's data changed since the checkpoint (by default "
                        "changed, moved or missing data is refused)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads (default: torch's; with --resume: the run's); results are bit-exact for "
                        "a fixed count")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_train)

    p = commands.add_parser("eval", help="bits per byte of a checkpoint on a split",
                            description="Evaluate a checkpoint in bits per byte, carrying the state across the split. "
                                        "On token shards the loss per token is converted: total nats over the bytes "
                                        "of the scored tokens, over ln 2.")
    p.add_argument("--ckpt", required=True, metavar="DIR", help="run folder or checkpoint folder")
    p.add_argument("--split", choices=("train", "validation", "test"), default="test",
                   help="split to evaluate (default: %(default)s)")
    p.add_argument("--context", type=_positive_int, help="window length (default: the training context)")
    p.add_argument("--batch-size", type=_positive_int, default=1,
                   help="parallel streams (1 = the whole split as one stream, state carried throughout)")
    p.add_argument("--max-tokens", type=_positive_int,
                   help="evaluate only the first N tokens (bytes for byte data)")
    p.add_argument("--no-carry", action="store_true", help="reset the state at every window")
    p.add_argument("--reset-every", type=_non_negative_int, default=0, metavar="N",
                   help="reset the state every N windows (default 0: carry across the whole split)")
    p.add_argument("--data", help="corpus or shard folder (default: the one the model was trained on, checked "
                                  "against the checkpoint's fingerprint of it); shards must use the run's tokenizer")
    p.add_argument("--accept-new-data", dest="accept_new_data", action="store_true",
                   help="without --data: evaluate although the run's data changed since the checkpoint")
    p.add_argument("--cache-dir", metavar="DIR")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    add_runtime_flags(p)
    p.set_defaults(handler=run_eval)

    p = commands.add_parser("generate", help="stream text from a checkpoint",
                            description="Sample text after a prompt, one token at a time with a constant-size state; "
                                        "the run's tokenizer encodes the prompt and decodes the output.")
    p.add_argument("--ckpt", required=True, metavar="DIR")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--max-new-tokens", type=_non_negative_int, default=200)
    p.add_argument("--temperature", type=_non_negative_float, default=0.8, help="0: greedy (default: %(default)s)")
    p.add_argument("--top-k", type=_positive_int)
    p.add_argument("--top-p", type=_positive_fraction, help="nucleus mass in (0, 1]")
    p.add_argument("--seed", type=_non_negative_int, default=0)
    add_runtime_flags(p)
    p.set_defaults(handler=run_generate)

    p = commands.add_parser("plot", help="plot training loss and validation bpb of runs",
                            description="Draw the training loss and the validation bits per byte of one or more runs "
                                        "(read from each run's metrics.jsonl) into one PNG.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (with metrics.jsonl)")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
    p.set_defaults(handler=run_plot)


def _train_values(args: argparse.Namespace) -> tuple[dict, dict]:
    model_values, train_values = load_run_file(args.config) if args.config else ({}, {})
    tables = {"model": model_values, "train": train_values}
    for flag, (table, key) in _TRAIN_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            tables[table][key] = value
    for text in args.overrides:
        table, key, value = parse_override(text)
        if (table, key) == ("train", "out") and args.out is not None and Path(str(value)) != Path(args.out):
            raise ValueError(f"--set train.out={value} and --out {args.out} name two run folders; give one of them")
        tables[table][key] = value
    if args.threads is not None:
        train_values["threads"] = args.threads
    return model_values, train_values


def run_train(args: argparse.Namespace) -> int:
    progress = not args.no_progress
    if args.resume:
        given = [f"--{flag.replace('_', '-')}" for flag in _TRAIN_FLAGS
                 if flag not in _RESUME_FLAGS and getattr(args, flag) is not None]
        given += ["--config"] if args.config else []
        if not args.out:
            raise ValueError("--resume needs --out DIR, the run folder to continue")
        if given:
            raise ValueError(f"--resume takes the configuration from the checkpoint (only --steps, --parallel, "
                             f"--lora-rank, --threads, --dist-timeout, --batch-size keeping the global batch and --set "
                             f"of the settings a resume may change may be given); drop {', '.join(given)}")
        if args.overwrite:
            raise ValueError("--overwrite starts a new run in place of the old one; drop it to --resume the run")
        resume_from = int(args.resume_from) if args.resume_from and args.resume_from.isdigit() else args.resume_from
        summary = train(None, None, resume=True, resume_from=resume_from, steps=args.steps, out=args.out,
                        progress=progress, command=args.command_line, accept_new_data=args.accept_new_data,
                        parallel=args.parallel, threads=args.threads, lora_rank=args.lora_rank,
                        settings=_resume_settings(args))
    else:
        if args.resume_from is not None:
            raise ValueError("--from selects the checkpoint of --resume; add --resume")
        if args.accept_new_data:
            raise ValueError("--accept-new-data lets --resume continue on changed data; add --resume")
        model_values, train_values = _train_values(args)
        data = train_values.get("data", TrainConfig.data)
        if isinstance(data, str) and data.strip():  # else TrainConfig names train.data below
            _vocab_from_data(model_values, data)
        model_config, train_config = build_configs(model_values, train_values)
        summary = train(model_config, train_config, out=args.out, overwrite=args.overwrite, progress=progress,
                        command=args.command_line)
    if summary.get("finished"):
        return 0
    trained = f"{summary['step']} steps trained, {summary['elapsed']:.0f} s this session"
    if summary.get("final_bpb") is not None:
        before = f"{summary['initial_bpb']:.3f} before -> " if summary.get("initial_bpb") is not None else ""
        print(f"validation bpb: {before}{summary['final_bpb']:.3f} at step {summary['final_bpb_step']} ({trained})")
    elif summary["step"] > summary["start_step"]:
        loss = summary["last_loss"]
        unit = "bpb" if summary["byte_tokens"] else "bits per token"
        print(f"last training loss: {loss:.4f} ({loss / math.log(2):.3f} {unit}) at step {summary['step']} "
              f"({trained}; no validation: --eval-every 0)")
    return 0


def _resume_settings(args: argparse.Namespace) -> dict:
    """What a ``--resume`` changes (``train(..., settings=...)``): ``--batch-size``,
    ``--dist-timeout`` and each ``--set train.KEY=VALUE`` (a ``model.*`` key is refused here,
    a ``train.*`` key a resume cannot change by ``resharding.resumed_train_values``)."""
    settings = {key: getattr(args, key) for key in ("batch_size", "dist_timeout") if getattr(args, key) is not None}
    for text in args.overrides:
        table, key, value = parse_override(text)
        if table == "model":
            raise ValueError(f"--resume takes the model from the checkpoint: --set {text} cannot change it")
        settings[key] = value
    return settings


def _vocab_from_data(model_values: dict, data: str) -> None:
    """Set ``model_values["vocab_size"]`` to the tokenizer's when ``data`` is a shard folder
    (refusing a different explicit one); byte corpora leave it alone."""
    vocab = data_vocab_size(data)
    if vocab is not None:
        given = model_values.get("vocab_size")
        if given is not None and given != vocab:
            raise ValueError(f"model.vocab_size={given}, but the tokenizer of {data} has {vocab} tokens; leave "
                             f"vocab_size out (it follows the data) or set it to {vocab}")
        model_values["vocab_size"] = vocab


def _load(args: argparse.Namespace):
    """Apply ``--threads`` and load ``--ckpt`` on ``--device`` -> ``(model, checkpoint)``."""
    apply_threads(args)
    return load_model(args.ckpt, args.device)


def _open_run_data(checkpoint: Checkpoint, cache_dir: str | None, accept_new_data: bool):
    """The data the run trained on, checked against the checkpoint's fingerprint of it:
    changed, moved or missing data is a ValueError unless ``accept_new_data``."""
    spec = checkpoint.meta["train_config"]["data"]
    if spec != "shakespeare" and not Path(spec).exists():
        raise ValueError(f"eval: the run's data {spec} is missing (moved or deleted since {checkpoint.path} was "
                         f"written); put it back there, or evaluate on other data with --data PATH")
    data = open_data(spec, cache_dir=cache_dir)
    recorded = checkpoint.meta.get("data_fingerprint")
    if recorded is None:
        print(f"{checkpoint.path} records no fingerprint of its data (written by an older linattn): {spec} could "
              f"not be checked against the data the run trained on", file=sys.stderr)
        return data
    changes = fingerprint_changes(recorded, data_fingerprint(data))
    if changes is not None and not accept_new_data:
        raise ValueError(f"eval: the data {spec} is not what {checkpoint.path} was trained on: {changes}. Put the "
                         f"run's data back, evaluate on it as it is with --accept-new-data, or name data with --data")
    if changes is not None:
        print(f"evaluating on changed data (--accept-new-data): {spec}: {changes}", file=sys.stderr)
    return data


def run_eval(args: argparse.Namespace) -> int:
    if args.accept_new_data and args.data is not None:
        raise ValueError("--accept-new-data: --data names the data to evaluate on, which is not checked; drop one")
    model, checkpoint = _load(args)
    train_config = checkpoint.meta["train_config"]
    cache_dir = args.cache_dir or train_config.get("cache_dir")
    if args.data is None:
        data = _open_run_data(checkpoint, cache_dir, args.accept_new_data)
    else:
        data = open_data(args.data, cache_dir=cache_dir)
    check_same_tokenizer(checkpoint.meta.get("tokenizer"), data, what="--data")
    check_vocabulary(data, (args.split,), model.config.vocab_size, spec=args.data or train_config["data"])
    tokens = data.tokens(args.split)
    context = args.context or train_config["context"]
    check_evaluation_fits(tokens.numel(), args.max_tokens, batch_size=args.batch_size, context=context,
                          split=args.split, batch_name="--batch-size", budget_name="--max-tokens")
    total = (tokens.numel() if args.max_tokens is None else min(args.max_tokens, tokens.numel())) - 1
    n_bytes = evaluated_bytes(data, tokens[:args.max_tokens], context=context, n_streams=args.batch_size)
    unit = "B" if n_bytes is None else "tok"
    with tqdm(total=total, disable=args.no_progress, desc=f"eval {args.split}", unit=unit, unit_scale=True) as bar:
        result = evaluate_bpb(model, tokens, context=context, batch_size=args.batch_size, max_tokens=args.max_tokens,
                              carry_state=not args.no_carry, reset_every=args.reset_every, progress=bar)
    if not math.isfinite(result["bpb"]):
        raise ValueError(f"eval: {checkpoint.path} gives a loss that is not finite on the {args.split} split "
                         f"({result['bpb']} bits): its forward pass overflows to NaN or inf although its weights are "
                         f"finite; use an earlier checkpoint of the run (a step-* folder of {checkpoint.path.parent})")
    record = {"split": args.split, "bpb": result["bpb"], "tokens": result["tokens"], "context": context,
              "batch_size": args.batch_size, "carry_state": not args.no_carry, "reset_every": args.reset_every,
              "step": checkpoint.step, "checkpoint": str(checkpoint.path)}
    if n_bytes is not None:
        record.update(bpb=bits_per_byte(result, n_bytes), bits_per_token=result["bpb"], bytes=n_bytes)
    if args.json:
        print(json.dumps(record))
    else:
        carried = ("state reset every window" if args.no_carry else
                   f"state reset every {args.reset_every} windows" if args.reset_every else
                   "state carried across the split")
        counted = (f"{result['tokens']:,} bytes" if n_bytes is None else
                   f"bits per byte: {result['bpb']:.4f} bits per token x {result['tokens']:,} tokens / "
                   f"{n_bytes:,} bytes")
        print(f"{args.split} bpb: {record['bpb']:.4f} ({counted}, context {context}, {carried}; "
              f"checkpoint step {checkpoint.step})")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    model, checkpoint = _load(args)
    tokenizer = load_run_tokenizer(checkpoint)
    prompt = tokenizer.encode(args.prompt)
    if prompt.numel() == 0:
        raise ValueError("--prompt must not be empty (give at least one character, e.g. a newline)")
    decoder = tokenizer.stream_decoder()
    tokens = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    sys.stdout.write(args.prompt)
    try:
        for token in tokens:
            sys.stdout.write(decoder.feed(token))
            sys.stdout.flush()
    except NonFiniteLogits as error:
        sys.stdout.write("\n")
        raise ValueError(f"generate: {checkpoint.path}: {error} although its weights are finite; use an earlier "
                         f"checkpoint of the run (a step-* folder of {checkpoint.path.parent})") from None
    sys.stdout.write(decoder.flush() + "\n")
    return 0


def run_plot(args: argparse.Namespace) -> int:
    from .plot import plot_runs

    plot_runs(args.runs, args.out)
    print(f"wrote {args.out}")
    return 0
