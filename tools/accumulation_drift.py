"""How far gradient accumulation's loss curve drifts from the one-batch run, per layer kind.

    python tools/accumulation_drift.py [--attention vq softmax] [--steps 60] [--micro-batches 2]

Each kind trains twice with the trainer (`linattn.train.train`, float32, one thread, the
same seed and data): one batch of 8 streams per step, and the same 8 streams as
``--micro-batches`` micro-batches. The two steps are equal up to floating-point rounding
(tests/test_grad_accum.py holds them equal in float64); this prints how that rounding grows
over the run: the largest loss difference in the first 10 steps and over all steps, and the
first step whose difference exceeds 1e-4. A VQ layer can amplify it: a rounding change can
move a key across the boundary between two codes, and from then on the runs differ by a
code assignment rather than by rounding.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _helpers import english_like  # noqa: E402  (the tests' small English-like corpus)

from linattn.models import LMConfig, uses_heads  # noqa: E402
from linattn.train import TrainConfig, train  # noqa: E402


def _losses(attention: str, micro_batches: int, steps: int, data: Path, root: Path) -> list[float]:
    model = LMConfig(d_model=32, n_layers=2, n_heads=2 if uses_heads(attention) else None, attention=attention,
                     gau_d_k=16, codebook_size=16, block_size=8, ffn_hidden=64)
    out = root / f"{attention}-{micro_batches}"
    config = TrainConfig(data=str(data), out=str(out), steps=steps, batch_size=8, grad_accum_steps=micro_batches,
                         context=32, lr=3e-3, warmup_steps=5, eval_every=0, log_every=1, checkpoint_every=0,
                         threads=1)
    train(model, config, progress=False, echo=lambda *a: None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention", nargs="+", default=["vq", "softmax"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro-batches", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        data = root / "data.txt"
        data.write_text(english_like(40000, seed=5), encoding="utf-8")
        print("| layers | max abs loss difference, steps 1-10 | over all steps | first step > 1e-4 |")
        print("| --- | ---: | ---: | ---: |")
        for attention in args.attention:
            one = _losses(attention, 1, args.steps, data, root)
            many = _losses(attention, args.micro_batches, args.steps, data, root)
            diffs = [abs(a - b) for a, b in zip(one, many)]
            first = next((i + 1 for i, d in enumerate(diffs) if d > 1e-4), None)
            print(f"| {attention} | {max(diffs[:10]):.1e} | {max(diffs):.1e} | {first or 'none'} |")


if __name__ == "__main__":
    main()
