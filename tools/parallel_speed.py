"""Training tokens/s under DDP and under FSDP2, each a ``torchrun`` of ``linattn train``.

    python tools/parallel_speed.py [--config configs/demo.toml] [--nproc 2] [--steps 40]
                                   [--log-every 5] [--threads 1] [--device cpu] [--set TABLE.KEY=VALUE ...]

Each strategy trains the run file's model for ``--steps`` steps in ``--nproc`` processes
(``--device cpu``: gloo; ``cuda``: nccl, one GPU each) without evaluation, into a temporary
folder, and reports the median of the logged ``tokens_per_second`` (tokens of all processes
per second of wall time) after the first logged window (warm-up), with its min and max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(strategy: str, out: Path, args: argparse.Namespace) -> list[float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               "-m", "linattn.cli", "train", "--config", args.config, "--out", str(out), "--steps", str(args.steps),
               "--log-every", str(args.log_every), "--eval-every", "0", "--checkpoint-every", "0",
               "--device", args.device, "--no-progress", "--set", f"train.parallel={strategy}"]
    for override in args.overrides:
        command += ["--set", override]
    if args.threads:
        command += ["--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or 1)}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["tokens_per_second"] for r in records if "tokens_per_second" in r][1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo.toml")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE")
    args = parser.parse_args()
    print(f"{args.config}, {args.nproc} processes on {args.device}, {args.steps} steps, "
          f"{args.threads} thread(s) each {' '.join(args.overrides)}")
    with tempfile.TemporaryDirectory() as folder:
        for strategy in ("ddp", "fsdp"):
            speeds = _run(strategy, Path(folder) / strategy, args)
            print(f"{strategy:5}: {statistics.median(speeds):,.0f} tokens/s "
                  f"(min {min(speeds):,.0f}, max {max(speeds):,.0f}, {len(speeds)} windows of {args.log_every} steps)")


if __name__ == "__main__":
    main()
