"""``linattn repro linearize``: a pretrained transformer made linear-time, against training the
linear-time model from scratch (the efficient-attention survey's recipe for Transformer-VQ, seed 004;
LoLCATs' attention transfer for the kernel and gated targets).

The teacher is a genuine ``LlamaForCausalLM`` trained by this command on the Shakespeare plays in a
byte-level BPE (``configs/linearize-teacher.toml``, ``repro/linearize_teacher.py``; cached per seed
in ``--out``). Every student is ``linattn convert`` of it (the teacher's projections and MLP kept,
``vq-attn`` codebooks by k-means on its keys, new parameters by attention transfer on
``--calibration-tokens`` tokens), then fine-tuned (``linattn train --resume``; ``--lora-rank``: LoRA)
with a fraction of the teacher's training tokens (``--fractions``, default 1%, 5% and 20%; the
calibration tokens count in it); the same architecture is also trained from scratch with the
teacher's token budget. Students: ``vq-rerope`` (``vq-attn:rerope``: Transformer-VQ with ReRoPE, the
survey's proposal), ``vq-bias`` (``vq-attn:bias``: with Transformer-VQ's windowed bias instead),
``gated-delta``, ``hedgehog`` (``linear:hedgehog``) and ``hybrid`` (``--hybrid``: Gated DeltaNet
alternating with the teacher's layers as sliding-window attention). Measured: validation bpb of each
(right after conversion and after fine-tuning) and its gap to the teacher's; decoding milliseconds
per token after ``--decode-contexts`` tokens (transformers' ``generate`` with its KV cache for the
teacher), timed by runs of their own after every training run (``--no-decode`` leaves them out, so
that the training can run on a busy machine and a later ``--resume`` times them on a quiet one).
At ``--seeds`` seeds (default 3), each with its own teacher.
"""

from __future__ import annotations

import argparse
import shutil
import time
from functools import partial
from pathlib import Path

from .._checks import int_at_least, positive_float
from ..convert import convert_linear
from ..linearize import LinearizeOptions, student_config
from ..models import LM
from ..models.pretrained import hf_lm_config
from ..train import TrainConfig, load_model, train
from . import framework, grids, linearize_report
from .framework import Experiment, ExperimentSpec
from .grids import Grid
from .linearize_teacher import (decode_ms_per_token, decode_prompt, load_teacher, prepared_data, teacher_folder,
                                teacher_record, teacher_settings, validation_bpb)

STUDENTS = {"vq-rerope": "vq-attn:rerope", "vq-bias": "vq-attn:bias", "gated-delta": "gated-delta",
            "hedgehog": "linear:hedgehog", "hybrid": None}
DEFAULT_HYBRID = "gated-delta,local:64"


def student_spec(name: str, args: argparse.Namespace) -> str:
    """The ``--to`` spec of the student ``name``."""
    return args.hybrid if name == "hybrid" else STUDENTS[name]


def _silent(*args) -> None:
    pass


def _teacher(args: argparse.Namespace, out_dir: Path):
    """``(shards, teacher folder, settings)`` of ``args.seed`` (prepared and trained the first time)."""
    settings = teacher_settings(args.teacher_config, args.quick)
    shards = prepared_data(out_dir, args.data, settings["tokenizer"]["bpe"], args.cache_dir)
    return shards, teacher_folder(out_dir, shards, settings, args.seed), settings


def teacher_tokens(settings: dict) -> int:
    train = settings["train"]
    return train["steps"] * train["batch_size"] * train["context"]


def finetune_steps(fraction: float, settings: dict, calibration_tokens: int) -> int:
    """Fine-tuning steps of a student with ``fraction`` of the teacher's tokens, the calibration
    tokens counted in (at least one step)."""
    train = settings["train"]
    per_step = train["batch_size"] * train["context"]
    return max(1, round((fraction * teacher_tokens(settings) - calibration_tokens) / per_step))


def _decode_times(model, args: argparse.Namespace, shards) -> dict[str, float]:
    return {str(context): decode_ms_per_token(model, decode_prompt(shards, context), args.decode_tokens)
            for context in args.decode_contexts}


def run_case(case: str, name: str | None, fraction: float | None, args: argparse.Namespace, out_dir: Path) -> dict:
    """One row at ``args.seed``: ``"teacher"``, ``"converted"`` (student ``name`` with ``fraction`` of the
    teacher's tokens), ``"scratch"`` (student ``name``'s architecture with all of them) or ``"decode"``
    (the decoding times of the teacher, ``name`` None, or of the converted student ``name`` at
    ``fraction``); ``seconds``: its wall time (the teacher's row: its training included when it
    trained it)."""
    started = time.perf_counter()
    row = _case(case, name, fraction, args, out_dir)
    return {**row, "seconds": time.perf_counter() - started}


def _case(case: str, name: str | None, fraction: float | None, args: argparse.Namespace, out_dir: Path) -> dict:
    shards, folder, settings = _teacher(args, out_dir)
    train_settings, total = settings["train"], teacher_tokens(settings)
    context = train_settings["context"]
    if case == "teacher":
        model = LM.from_hf(folder)
        return {"case": case, "student": "teacher", "spec": "LlamaForCausalLM", "fraction": None, "tokens": total,
                "parameters": model.num_parameters(), "validation_bpb": validation_bpb(model, shards, context,
                                                                                        args.eval_tokens),
                "train_seconds": teacher_record(folder)["seconds"]}
    if case == "decode":
        model = load_teacher(folder) if name is None else load_model(
            framework.run_folder(out_dir, f"{name}-{fraction:g}", args.seed))[0]
        return {"case": case, "student": name or "teacher", "fraction": fraction,
                "decode_ms": _decode_times(model, args, shards)}
    spec = student_spec(name, args)
    if case == "scratch":
        return _scratch(name, spec, args, out_dir, shards, folder, settings)
    run_dir = framework.run_folder(out_dir, f"{name}-{fraction:g}", args.seed)
    shutil.rmtree(run_dir, ignore_errors=True)
    steps = finetune_steps(fraction, settings, args.calibration_tokens)
    overrides = [f"train.{key}={value}" for key, value in (
        ("context", context), ("batch_size", train_settings["batch_size"]), ("lr", args.finetune_lr),
        ("warmup_steps", max(1, steps // 10)), ("steps", steps), ("eval_every", 0), ("checkpoint_every", steps),
        ("log_every", max(1, steps // 20)), ("seed", args.seed))]
    overrides += [f"model.block_size={args.block_size}"]
    options = LinearizeOptions(codebook_size=args.codebook_size, calibration_tokens=args.calibration_tokens,
                               seed=args.seed, transfer_steps=args.transfer_steps, transfer_lr=args.transfer_lr)
    convert_linear(folder, run_dir, to=spec, data=str(shards.folder), overrides=overrides, options=options,
                   echo=_silent)
    converted, checkpoint = load_model(run_dir)
    transfer = checkpoint.meta["converted_from"]["attention_transfer"]
    before = validation_bpb(converted, shards, context, args.eval_tokens)
    summary = train(None, None, resume=True, out=run_dir, progress=False, echo=_silent, lora_rank=args.lora_rank)
    if summary["interrupted"]:
        raise KeyboardInterrupt(f"stopped by {summary['interrupted']}")
    model, _ = load_model(run_dir)
    tokens = args.calibration_tokens + steps * train_settings["batch_size"] * context
    row = {"case": "converted", "student": name, "spec": spec, "fraction": fraction, "tokens": tokens,
           "token_share": tokens / total, "finetune_steps": steps, "parameters": model.num_parameters(),
           "validation_bpb_converted": before, "validation_bpb": validation_bpb(model, shards, context,
                                                                                args.eval_tokens),
           "transfer_loss_before": None if transfer is None else sum(transfer["loss_before"].values()),
           "transfer_loss_after": None if transfer is None else sum(transfer["loss_after"].values())}
    return row


def _scratch(name: str, spec: str, args: argparse.Namespace, out_dir: Path, shards, folder: Path,
             settings: dict) -> dict:
    """The student architecture ``spec`` trained from scratch with the teacher's budget."""
    train_settings = settings["train"]
    run_dir = framework.run_folder(out_dir, f"{name}-scratch", args.seed)
    shutil.rmtree(run_dir, ignore_errors=True)
    config = student_config(LM.from_hf(folder).config, spec, {"block_size": args.block_size,
                                                               "codebook_size": args.codebook_size,
                                                               "kmeans_init": True})
    steps = train_settings["steps"]
    train_config = TrainConfig(
        data=str(shards.folder), out=str(run_dir), steps=steps, batch_size=train_settings["batch_size"],
        context=train_settings["context"], lr=train_settings["lr"], warmup_steps=train_settings["warmup_steps"],
        weight_decay=train_settings["weight_decay"], eval_every=0, checkpoint_every=steps,
        log_every=max(1, steps // 50), seed=args.seed)
    summary = train(config, train_config, progress=False, echo=_silent)
    if summary["interrupted"]:
        raise KeyboardInterrupt(f"stopped by {summary['interrupted']}")
    model = summary["model"]
    return {"case": "scratch", "student": name, "spec": spec, "fraction": None, "tokens": teacher_tokens(settings),
            "parameters": model.num_parameters(),
            "validation_bpb": validation_bpb(model, shards, train_settings["context"], args.eval_tokens)}


# --- the command ----------------------------------------------------------------------------


SPEC = ExperimentSpec(
    name="linearize",
    help="convert a trained Llama to linear time (VQ with ReRoPE or the bias, Gated DeltaNet, Hedgehog, a hybrid) "
         "with 1/5/20%% of its tokens, against training from scratch",
    description=__doc__.split("\n\n", 1)[1],
    grid_axes=("students", "fractions"),
    row="model",
    quick_help="a tiny teacher ([quick.*] of the teacher config: 30 steps), one seed, short contexts (for tests)",
    threads_help="torch CPU threads (default: torch's choice)",
)

_DEFAULTS = dict(calibration_tokens=8192, transfer_steps=50, codebook_size=256, block_size=64, eval_tokens=65536,
                 decode_contexts=[4096, 16384], decode_tokens=32)
_QUICK = dict(calibration_tokens=256, transfer_steps=5, codebook_size=16, block_size=8, eval_tokens=1024,
              decode_contexts=[64, 256], decode_tokens=4)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    positive = int_at_least(1, "a positive integer")
    d = _DEFAULTS
    parser.add_argument("--students", nargs="+", choices=list(STUDENTS), default=list(STUDENTS))
    parser.add_argument("--fractions", nargs="+", type=positive_float, default=[0.01, 0.05, 0.2],
                        help="shares of the teacher's training tokens each student fine-tunes with, calibration "
                             "included (default %(default)s)")
    parser.add_argument("--hybrid", default=DEFAULT_HYBRID, metavar="SPEC",
                        help="the hybrid student's layers (default %(default)s)")
    parser.add_argument("--teacher-config", default="configs/linearize-teacher.toml", metavar="FILE.toml",
                        help="the teacher's configuration (default %(default)s)")
    parser.add_argument("--data", default="shakespeare")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--finetune-lr", type=positive_float, default=3e-4,
                        help="peak learning rate of the fine-tuning (default %(default)s: the teacher's last one)")
    parser.add_argument("--lora-rank", type=positive, default=None,
                        help="fine-tune LoRA adapters of this rank instead of every parameter")
    parser.add_argument("--calibration-tokens", type=positive, default=d["calibration_tokens"])
    parser.add_argument("--transfer-steps", type=int_at_least(0, "a step count"), default=d["transfer_steps"])
    parser.add_argument("--transfer-lr", type=positive_float, default=1e-2)
    parser.add_argument("--codebook-size", type=positive, default=d["codebook_size"])
    parser.add_argument("--block-size", type=positive, default=d["block_size"])
    parser.add_argument("--eval-tokens", type=positive, default=d["eval_tokens"],
                        help="validation tokens every model is scored on (default %(default)s)")
    parser.add_argument("--decode-contexts", nargs="+", type=positive, default=d["decode_contexts"], metavar="C",
                        help="prompt lengths before the timed decoding (default %(default)s)")
    parser.add_argument("--decode-tokens", type=positive, default=d["decode_tokens"],
                        help="tokens generated per timing (default %(default)s)")
    parser.add_argument("--no-decode", dest="decode", action="store_false",
                        help="leave the decoding timings out (a later --resume without it runs them)")


_SETTINGS = ("data", "teacher_config", "quick", "hybrid", "finetune_lr", "lora_rank", "calibration_tokens",
             "transfer_steps", "transfer_lr", "codebook_size", "block_size", "eval_tokens", "decode_contexts",
             "decode_tokens", "fractions", "seed")


def _run_key(run: tuple) -> dict:
    case, name, fraction, args, _ = run
    return {"case": case, "student": name, "fraction": fraction,
            "settings": {key: getattr(args, key) for key in _SETTINGS},
            "teacher": teacher_settings(args.teacher_config, args.quick)}


def _describe(row: dict) -> str:
    if row["case"] == "decode":
        return f"{row['student']} decoding " + ", ".join(f"{ms:.2f} ms at {c}" for c, ms in row["decode_ms"].items())
    return f"{row['student']} {row['case']} {row['validation_bpb']:.3f} bpb"


def _run(args: argparse.Namespace) -> int:
    if args.quick:  # the flags left at their defaults take the --quick values
        for name, value in _QUICK.items():
            if getattr(args, name) == _DEFAULTS[name]:
                setattr(args, name, value)
    if args.jobs != 1:
        raise ValueError("--jobs must be 1: the students of a seed read the teacher its first run trains")
    if any(not 0 < fraction <= 1 for fraction in args.fractions):
        raise ValueError(f"--fractions must lie in (0, 1], got {args.fractions}")
    settings = teacher_settings(args.teacher_config, args.quick)  # refused before anything trains
    teacher = hf_lm_config({**settings["llama"], "model_type": "llama", "vocab_size": settings["tokenizer"]["bpe"]},
                           source=f"--teacher-config {args.teacher_config} [llama]")
    for name in args.students:
        student_config(teacher, student_spec(name, args), {"block_size": args.block_size,
                                                           "codebook_size": args.codebook_size})
    options = framework.run_options(args, SPEC)
    out_dir, command, seeds = options.pop("out_dir"), options.pop("command"), options.pop("seeds")
    metadata = framework.experiment_metadata(device="cpu", command=command, shapes={
        "teacher": settings["llama"], "teacher_train": settings["train"], "bpe": settings["tokenizer"]["bpe"]},
        seeds=seeds, teacher_tokens=teacher_tokens(settings), fractions=args.fractions,
        decode_contexts=args.decode_contexts)
    runs = []
    for seed in seeds:  # a seed's teacher is trained by its first run
        seeded = framework.with_seed(args, seed)
        runs.append(("teacher", None, None, seeded, out_dir))
        for name in args.students:
            runs += [("converted", name, fraction, seeded, out_dir) for fraction in sorted(args.fractions)]
            runs.append(("scratch", name, None, seeded, out_dir))
    for seed in seeds if args.decode else ():  # timed after every training run: --no-decode, then --resume
        seeded = framework.with_seed(args, seed)
        runs.append(("decode", None, None, seeded, out_dir))
        runs += [("decode", name, max(args.fractions), seeded, out_dir) for name in args.students]
    grid = Grid(train=run_case, runs=runs, run_key=_run_key, seed_of=lambda run: run[3].seed, describe=_describe,
                label="repro linearize", unit="run")
    outcome = grids.run_journaled(grid, out_dir, spec=SPEC, **options)
    metadata.update(seconds=outcome.seconds, reused_runs=outcome.reused, grid_runs=outcome.total,
                    report_only=args.report_only)
    runs = linearize_report.with_gaps(linearize_report.with_decode_times(outcome.rows))
    rows = linearize_report.aggregate(runs)
    summary = linearize_report.summarize(rows)
    text = linearize_report.page({"metadata": metadata, "rows": rows, "runs": runs, "summary": summary})
    files = framework.write_results(out_dir, rows=rows, runs=runs, metadata=metadata, markdown=text, summary=summary,
                                    plot=partial(linearize_report.write_plot, rows), plot_name="linearize.png")
    return framework.print_result({"markdown": text, "files": files})


command = Experiment(SPEC, add_arguments=_add_arguments, run=_run, page=linearize_report.page)
