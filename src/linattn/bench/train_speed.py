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

``--device cuda`` (or ``cuda:N``) trains on that GPU: it sets ``train.device``, as
``--set train.device=...`` does (giving both with different devices is an error); without
either the run file's ``train.device`` applies (default cpu).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from .. import reporting
from .._checks import available_device_name, check_cuda_available, positive_int
from ..train import train
from ..train.config import build_configs, load_run_file, parse_override
from .harness import in_fresh_process

MODES = ("eager", "compiled")


def time_training(model_values: dict, train_values: dict, *, compiled: bool, steps: int, warmup: int) -> dict:
    """Train ``steps`` steps in a scratch folder -> one result row (seconds per step from
    the trainer's own per-step log); the process's torch threads are left as they are."""
    with tempfile.TemporaryDirectory(prefix="linattn-bench-train-") as scratch:
        values = {**train_values, "steps": steps, "eval_every": 0, "checkpoint_every": 0, "log_every": 1,
                  "compile": compiled, "threads": None, "out": str(Path(scratch) / "run")}
        model_config, train_config = build_configs(model_values, values)
        train(model_config, train_config, progress=False, echo=lambda *args: None)
        lines = (Path(scratch) / "run" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    tokens_per_step = train_config.batch_size * train_config.context
    seconds = [tokens_per_step / record["tokens_per_second"] for record in records]
    timed = seconds[warmup:]
    step_s = statistics.median(timed)
    return {"case": "compiled" if compiled else "eager", "steps": steps, "warmup_steps": warmup,
            "warmup_s": sum(seconds[:warmup]), "step_s": step_s, "mean_step_s": statistics.fmean(timed),
            "tokens_per_s": tokens_per_step / step_s, "tokens_per_step": tokens_per_step,
            "step_times_s": seconds, "losses": [record["loss"] for record in records],
            "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"]}


HELP = "training speed of a run file's model, eager and compiled (torch.compile)"
DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linattn bench train``."""
    parser.add_argument("--config", type=Path, default=Path("configs/demo.toml"), metavar="FILE.toml",
                        help="run file with [model] and [train] tables (default: %(default)s, make demo's model)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="override a setting of the run file, as for linattn train (repeatable)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="(default: both)")
    parser.add_argument("--steps", type=positive_int, default=30, help="optimizer steps per mode")
    parser.add_argument("--warmup", type=positive_int, default=10,
                        help="first steps left out of the timing (they hold the compilation)")
    parser.add_argument("--device", type=available_device_name,
                        help="cpu, cuda or cuda:N: sets train.device (default: the run file's, else cpu)")
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=Path("results/bench-train"), help="output directory")


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
    rows = [in_fresh_process(time_training, tables["model"], tables["train"], compiled=mode == "compiled",
                              steps=args.steps, warmup=args.warmup, threads=args.threads) for mode in args.modes]
    header = ["mode", "step time (median)", "tokens/s", f"first {args.warmup} steps (warm-up)"]
    cells = [[r["case"], f"{r['step_s'] * 1e3:.0f} ms", f"{r['tokens_per_s']:,.0f}", f"{r['warmup_s']:.1f} s"]
             for r in rows]
    summary = {}
    if len(rows) == 2:
        summary["compiled_speedup"] = rows[0]["step_s"] / rows[1]["step_s"]
    shapes = {"model": tables["model"], "train": tables["train"], "steps": args.steps, "warmup": args.warmup}
    metadata = reporting.collect_metadata(device=train_config.device, command=args.command_line, shapes=shapes)
    text = (f"# bench train\n\n`{args.command_line}`\n\non {metadata['device']} ({metadata['device_name']}): "
            f"{model_config.attention} x {model_config.n_layers} layers, d_model {model_config.d_model}, "
            f"{rows[0]['tokens_per_step']:,} tokens per step; median over steps "
            f"{args.warmup + 1}..{args.steps}\n\n" + "\n".join(reporting.markdown_table_lines(header, cells)) + "\n")
    if "compiled_speedup" in summary:
        text += f"\ncompiled / eager speed: {summary['compiled_speedup']:.2f}x\n"
    args.out.mkdir(parents=True, exist_ok=True)
    reporting.write_json(args.out / "results.json", rows=rows, metadata=metadata, summary=summary)
    reporting.write_markdown(args.out / "results.md", text)
    print(text)
    print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}")
    return 0
