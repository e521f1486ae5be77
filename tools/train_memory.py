"""Peak memory of one training step with and without activation checkpointing.

    python tools/train_memory.py [--config configs/demo.toml] [--context 2048] [--batch-size 8]
                                 [--grad-accum-steps 1] [--device cpu] [--threads N]

The model is the run file's ``[model]`` (default: ``make demo``'s). Each setting runs in a
freshly spawned process: one warm-up step (AdamW's state is allocated), then one measured
step (forward and backward of the micro-batches, clipping, AdamW, codebook update) on random
bytes. Memory is ``reporting.peak_memory``: on CPU the growth of the resident set over the
step (Linux ``VmHWM``), on CUDA ``max_memory_allocated`` above what was allocated before.
"""

from __future__ import annotations

import argparse
import multiprocessing

import torch

from linattn.models import LM, LMConfig
from linattn.reporting import peak_memory
from linattn.train.config import load_run_file
from linattn.train.trainer import accumulate_gradients


def _measure(model_values: dict, checkpointing: bool, args: argparse.Namespace) -> tuple[int | None, float]:
    """-> (peak bytes of the measured step, its final loss) in this (fresh) process."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = LM(LMConfig.from_dict(model_values)).to(device).train()
    model.activation_checkpointing = checkpointing
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.context + 1),
                        generator=torch.Generator().manual_seed(1))
    losses = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss, _, _ = accumulate_gradients(model, ids[:, :-1], ids[:, 1:], [None] * args.grad_accum_steps,
                                          device=device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.update_codebooks()
        losses.append(float(loss))

    step()
    return peak_memory(step, device), losses[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo.toml", help="run file whose [model] is measured")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    model_values, _ = load_run_file(args.config)
    spawn = multiprocessing.get_context("spawn")
    print(f"{args.config} [model], batch {args.batch_size} x context {args.context}, "
          f"{args.grad_accum_steps} micro-batch(es), device {args.device}")
    results = {}
    for checkpointing in (False, True):
        with spawn.Pool(1) as pool:
            results[checkpointing] = pool.apply(_measure, (model_values, checkpointing, args))
        peak, loss = results[checkpointing]
        shown = "n/a" if peak is None else f"{peak / 2**20:,.0f} MiB"
        print(f"activation_checkpointing={str(checkpointing).lower():5}  peak {shown}  (loss {loss:.4f})")
    plain, recomputed = results[False][0], results[True][0]
    if plain and recomputed:
        print(f"checkpointing keeps {recomputed / plain:.0%} of the peak")


if __name__ == "__main__":
    main()
