"""``linattn bench train``: training speed of a run file's model, eager and compiled.

The trainer itself runs (``linattn.train.train``, what ``linattn train --config FILE`` runs)
for ``--steps`` optimizer steps on the run's data, batch and context, without evaluation or
intermediate checkpoints, logging every step; each mode (``eager``; ``compiled``:
``train.compile = true``) in a freshly spawned process. The first ``--warmup`` steps are
left out of the timing: they hold the compilation (a graph for a window without a carried
state, one with it, one more once the carried position is treated as a symbolic size, and
for k-means codebooks a graph before and one after the initialisation) and the allocator's
warm-up. Reported per mode: the median step time and tokens/s of the remaining steps, and
the warm-up time (for the compiled mode mostly compilation).

``--layouts`` runs each mode in one process (``single``) and in ``N`` processes of a
strategy (``ddp:N``, ``fsdp:N``; spawned like ``torchrun`` would, gloo on CPU, nccl on
GPUs ``cuda:0 .. cuda:N-1``). Each process reads the run file's ``batch_size`` streams, so
tokens/s counts all processes' tokens (a DDP run of 2 processes does twice the work of one
per step). The compiled mode compiles each layer on its own (``train/compiling.py``), as it
does under DDP and FSDP.

``--device cuda`` (or ``cuda:N``) trains on that GPU: it sets ``train.device``, as
``--set train.device=...`` does (giving both with different devices is an error); without
either the run file's ``train.device`` applies (default cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import reporting
from .._checks import available_device_name, check_cuda_available, positive_int
from ..train import train
from ..train.config import build_configs, load_run_file, parse_override
from .harness import in_fresh_process

MODES = ("eager", "compiled")
STRATEGIES = ("ddp", "fsdp")


def parse_layout(text: str) -> tuple[str, str | None, int]:
    """``"single"`` -> ``("single", None, 1)``; ``"ddp:2"``/``"fsdp:4"`` -> ``(text, strategy, N)``
    (``N >= 2``); anything else is an ``argparse.ArgumentTypeError``."""
    if text == "single":
        return text, None, 1
    strategy, _, count = text.partition(":")
    if strategy not in STRATEGIES or not count.isdigit() or int(count) < 2:
        raise argparse.ArgumentTypeError(f"expected 'single', 'ddp:N' or 'fsdp:N' with N >= 2 processes, got {text!r}")
    return text, strategy, int(count)


def time_training(model_values: dict, train_values: dict, *, compiled: bool, steps: int, warmup: int,
                  scratch: str | None = None) -> dict:
    """Train ``steps`` steps in a scratch folder (``scratch``, else a temporary one) -> one
    result row (seconds per step from the trainer's own per-step log; None on a rank other
    than 0 of several processes); the process's torch threads are left as they are."""
    with tempfile.TemporaryDirectory(prefix="linattn-bench-train-") as temporary:
        run = Path(scratch or temporary) / "run"
        values = {**train_values, "steps": steps, "eval_every": 0, "checkpoint_every": 0, "log_every": 1,
                  "compile": compiled, "threads": None, "out": str(run)}
        model_config, train_config = build_configs(model_values, values)
        train(model_config, train_config, progress=False, echo=lambda *args: None)
        if int(os.environ.get("RANK", "0")) != 0:
            return None
        lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    tokens_per_step = train_config.batch_size * train_config.context * int(os.environ.get("WORLD_SIZE", "1"))
    seconds = [tokens_per_step / record["tokens_per_second"] for record in records]
    timed = seconds[warmup:]
    step_s = statistics.median(timed)
    return {"case": "compiled" if compiled else "eager", "steps": steps, "warmup_steps": warmup,
            "warmup_s": sum(seconds[:warmup]), "step_s": step_s, "mean_step_s": statistics.fmean(timed),
            "tokens_per_s": tokens_per_step / step_s, "tokens_per_step": tokens_per_step,
            "step_times_s": seconds, "losses": [record["loss"] for record in records],
            "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"]}


def _rank(rank: int, world_size: int, folder: str, model_values: dict, train_values: dict, options: dict,
          threads: int | None) -> None:
    """One process of a multi-process measurement (``torch.multiprocessing.spawn``): joins the
    process group as ``torchrun`` would set it up, times the training, and rank 0 writes its
    row to ``folder/row.json``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if threads is not None:
        torch.set_num_threads(threads)
    backend = "nccl" if str(train_values.get("device", "cpu")).startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"file://{Path(folder) / 'init'}", rank=rank,
                            world_size=world_size)
    try:
        row = time_training(model_values, train_values, scratch=folder, **options)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        (Path(folder) / "row.json").write_text(json.dumps(row), encoding="utf-8")


def time_layout(layout: str, model_values: dict, train_values: dict, *, compiled: bool, steps: int, warmup: int,
                threads: int | None) -> dict:
    """One row: ``time_training`` in a fresh process (``single``) or in the layout's processes."""
    name, strategy, world_size = parse_layout(layout)
    options = {"compiled": compiled, "steps": steps, "warmup": warmup}
    if world_size == 1:
        row = in_fresh_process(time_training, model_values, train_values, threads=threads, **options)
    else:
        values = {**train_values, "parallel": strategy}
        if str(values.get("device", "cpu")).startswith("cuda"):
            values["device"] = "cuda"  # each process its own GPU (LOCAL_RANK)
        with tempfile.TemporaryDirectory(prefix="linattn-bench-train-") as folder:
            mp.spawn(_rank, args=(world_size, folder, model_values, values, options, threads), nprocs=world_size,
                     join=True)
            row = json.loads((Path(folder) / "row.json").read_text(encoding="utf-8"))
    return {**row, "layout": name, "processes": world_size, "parallel": strategy}


HELP = "training speed of a run file's model, eager and compiled (torch.compile)"
DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linattn bench train``."""
    parser.add_argument("--config", type=Path, default=Path("configs/demo.toml"), metavar="FILE.toml",
                        help="run file with [model] and [train] tables (default: %(default)s, make demo's model)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="override a setting of the run file, as for linattn train (repeatable)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="(default: both)")
    parser.add_argument("--layouts", nargs="+", type=parse_layout, default=[parse_layout("single")],
                        metavar="single|ddp:N|fsdp:N",
                        help="one process, or N processes under DDP or FSDP2 (default: single)")
    parser.add_argument("--steps", type=positive_int, default=30, help="optimizer steps per mode")
    parser.add_argument("--warmup", type=positive_int, default=10,
                        help="first steps left out of the timing (they hold the compilation)")
    parser.add_argument("--device", type=available_device_name,
                        help="cpu, cuda or cuda:N: sets train.device (default: the run file's, else cpu)")
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads (of each process)")
    parser.add_argument("--out", type=Path, default=Path("results/bench-train"), help="output directory")


def page(results: dict) -> str:
    """``results.md`` of ``results.json``'s contents: the command, the model and tokens per step
    (from the run file's tables its metadata records), the table and the compiled speed-ups."""
    metadata, shapes, rows = results["metadata"], results["metadata"]["shapes"], results["rows"]
    model_config, train_config = build_configs(shapes["model"], shapes["train"])
    warmup, steps = shapes["warmup"], shapes["steps"]
    header = ["layout", "mode", "step time (median)", "tokens/s (all processes)", f"first {warmup} steps (warm-up)"]
    cells = [[r["layout"], r["case"], f"{r['step_s'] * 1e3:.0f} ms", f"{r['tokens_per_s']:,.0f}",
              f"{r['warmup_s']:.1f} s"] for r in rows]
    text = (f"# bench train\n\n`{metadata['command']}`\n\non {metadata['device']} ({metadata['device_name']}): "
            f"{model_config.attention} x {model_config.n_layers} layers, d_model {model_config.d_model}, "
            f"{train_config.batch_size * train_config.context:,} tokens per step and process; median over steps "
            f"{warmup + 1}..{steps}\n\n" + "\n".join(reporting.markdown_table_lines(header, cells)) + "\n")
    if "compiled_speedup" in results["summary"]:
        text += "\ncompiled / eager speed: " + ", ".join(f"{layout} {speedup:.2f}x" for layout, speedup
                                                        in results["summary"]["compiled_speedup"].items()) + "\n"
    return text


def run_command(args: argparse.Namespace) -> int:
    """Time each mode, write results.json and results.md, print the table."""
    if args.warmup >= args.steps:
        raise ValueError(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    tables = dict(zip(("model", "train"), load_run_file(args.config)))
    overridden = {}
    for text in args.overrides:
        table, key, value = parse_override(text)
        tables[table][key] = overridden[table, key] = value
    if args.device is not None:
        if overridden.get(("train", "device"), args.device) != args.device:
            raise ValueError(f"--device {args.device} and --set train.device={overridden['train', 'device']} "
                             "disagree; give the device once")
        tables["train"]["device"] = args.device
    model_config, train_config = build_configs(tables["model"], tables["train"])  # refuse a bad run before spawning
    check_cuda_available("train.device", train_config.device)
    for name, _, world_size in args.layouts:
        if world_size > 1 and train_config.device.startswith("cuda"):
            if torch.cuda.device_count() < world_size:
                raise ValueError(f"--layouts {name}: {world_size} processes need {world_size} GPUs, "
                                 f"torch.cuda.device_count() is {torch.cuda.device_count()}")
    rows = [time_layout(name, tables["model"], tables["train"], compiled=mode == "compiled", steps=args.steps,
                        warmup=args.warmup, threads=args.threads)
            for name, _, _ in args.layouts for mode in args.modes]
    summary = {}
    if len(args.modes) == 2:
        summary["compiled_speedup"] = {r["layout"]: r["step_s"] / c["step_s"]
                                       for r, c in zip(rows[::2], rows[1::2])}
    shapes = {"model": tables["model"], "train": tables["train"], "steps": args.steps, "warmup": args.warmup,
              "layouts": [name for name, _, _ in args.layouts]}
    metadata = reporting.collect_metadata(device=train_config.device, command=args.command_line, shapes=shapes)
    text = page({"metadata": metadata, "rows": rows, "summary": summary})
    args.out.mkdir(parents=True, exist_ok=True)
    reporting.write_json(args.out / "results.json", rows=rows, metadata=metadata, summary=summary)
    reporting.write_markdown(args.out / "results.md", text)
    print(text)
    print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}")
    return 0
