"""Milliseconds per decoded token of trained linattn models, with ``LM.generate``'s native token
loops and without them (``LINATTN_BLOCK_STEP_IMPL=torch``: every token through ``LM._run``), timed
as ``linattn repro linearize`` times its students (``decode_ms_per_token``: the prompt read first,
then the greedy tokens timed), each measurement in a fresh process on one thread.

For the converted students of a ``linattn repro linearize`` run (``runs/seed-S/<student>-<fraction>``
under its ``--out``), e.g. after a change to the native loops, without training or timing every
model again. Prints one line per (run folder, way). Run on a quiet machine, from the repository
root:

    .venv/bin/python tools/student_decode_times.py docs/results/repro-linearize/runs/seed-0/hedgehog-0.2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

_TIME = """
import sys, torch
from linattn.repro.linearize_teacher import decode_ms_per_token
from linattn.train import load_model
torch.set_num_threads(1)
model, _ = load_model(sys.argv[1])
prompt = torch.randint(0, model.config.vocab_size, (1, int(sys.argv[2])), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    print(decode_ms_per_token(model, prompt, int(sys.argv[3])))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders holding a trained model's checkpoints")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens before the timed ones")
    parser.add_argument("--tokens", type=int, default=64, help="timed tokens")
    args = parser.parse_args()
    for run in args.runs:
        for way, impl in (("native loop", None), ("LM._run", "torch")):
            env = dict(os.environ)
            env.pop("LINATTN_BLOCK_STEP_IMPL", None)
            if impl is not None:
                env["LINATTN_BLOCK_STEP_IMPL"] = impl
            done = subprocess.run([sys.executable, "-c", _TIME, run, str(args.context), str(args.tokens)], env=env,
                                  capture_output=True, text=True, check=True)
            print(f"{run}  {way}: {float(done.stdout):.3f} ms per token after {args.context}", flush=True)


if __name__ == "__main__":
    main()
