"""``linattn bench lm``: whole language models against the context length.

Every model is a layer spec of ``LMConfig.attention`` (default ``softmax``, ``vq``, ``delta``,
``linear:elu``, ``local`` and the hybrid ``local,local,vq``) at one size (default d_model 128,
3 layers, 4 heads; VQ: d_k 64, 128 codes, block 64; local window 256) with equal parameter
counts: a VQ layer's GAU value width is matched to an attention + SwiGLU block
(``models.config.matched_gau_value_width``). Each model runs in a freshly spawned process
and, for every context length C, measures:

- training step: forward, cross-entropy (+ the VQ commitment loss), backward, gradient
  clipping, AdamW step (the trainer's parameter groups) and the codebook EMA, on
  ``batch = max(1, tokens_per_step // C)`` random windows of C tokens, so every context
  trains on the same tokens per step (C above ``--tokens-per-step``: one window of C);
  tokens/s from the median step time, and the peak extra memory of one step (after the
  warm-up, so the optimizer state already exists);
- prefill: one forward pass under ``no_grad`` over the same batch; tokens/s;
- decode: after a prefill of C tokens (batch 1, not timed), ``LM.generate`` (greedy) reads
  one more token and generates ``--decode-tokens`` tokens from that state; the median
  milliseconds per token, the whole context in the state.

Memory budget: before a context runs, its training-step memory is estimated as the peak
bytes per token of the model's first measured context times the context's tokens per step;
a context whose estimate exceeds ``--memory-gb`` is skipped with the estimate as the reason
(as is every context after one that ran out of memory). Exact softmax runs torch's SDPA,
whose CPU kernel keeps no T x T scores, so the memory of every model grows with the tokens
per step, not with C. ``--profile N`` adds the N operators with the most self time of a
training step, a prefill and a decoding step of each model at its longest measured context.

Rounds: ``--rounds N`` measures every model N times, each time in a fresh process, the
models in alternating order (A B, B A, ...), and pools the timed calls of all rounds
(``pool_rounds``): on a shared machine a slow spell of minutes then falls on every model,
so the ratios between models hold where one round's do not.

Device and precision: ``--device cuda`` (or ``cuda:N``) puts every model, its optimizer, the
tokens and the decoding state on that GPU; each timed call is bracketed by a synchronization
and the peak memory is the CUDA allocator's. ``--dtype bfloat16`` runs the forward passes
under bfloat16 autocast, weights and optimizer state in float32, as the trainer's
``train.bf16``. The timed calls read no values back to the host themselves (the tokens are
drawn in range and not checked again there: ``check_inputs=False``); the model does where it
must: ``LM.generate`` for each sampled token, a VQ model's codebook update once per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch

from .._checks import available_device_name, check_cuda_available, non_negative_int, positive_float, positive_int
from ..models import LM, parse_layer_spec
from .harness import in_fresh_process, median
from .lm_config import DEFAULT_CONTEXTS, DEFAULT_MODELS, DTYPES, QUICK, LMBenchConfig
from .lm_measure import empty_row, measure_model
from .lm_report import write_results
from .lm_report import VIEWS as VIEWS, page as page  # the benchmark-module interface of bench/cli.py


def run(config: LMBenchConfig, models: Sequence[str], *, out_dir: Path, command: str,
        threads: int | None = None) -> dict:
    """Measure every model in its own process; after each, (re)write the result files, so an
    interrupted run keeps the models it finished. Returns ``write_results``'s dict and ``rows``."""
    check_cuda_available("device", config.device)
    for spec in models:  # every configuration is checked before the first measurement
        try:
            config.model_config(spec)
        except ValueError as error:
            raise ValueError(f"--models {spec!r}: {error}") from None
    measured, result = [], None
    for round_index in range(config.rounds):
        order = models if round_index % 2 == 0 else models[::-1]
        settings = config if round_index == 0 else dataclasses.replace(config, profile_top=0)
        for index, spec in enumerate(order):
            started = time.perf_counter()
            try:
                measured += in_fresh_process(measure_model, spec, settings, threads=threads)
            except BrokenProcessPool as error:  # e.g. the kernel's out-of-memory killer
                parameters = LM(config.model_config(spec)).num_parameters()
                for context in sorted(config.contexts):
                    row = empty_row(spec, parameters, context, config.batch(context))
                    row["skip_reason"] = f"the measuring process died ({error})"
                    measured.append(row)
            print(f"bench lm: {spec} measured ({index + 1}/{len(models)}, round {round_index + 1}/{config.rounds}, "
                  f"{time.perf_counter() - started:.0f} s)", flush=True)
            rows = pool_rounds(measured)
            done = [spec for spec in models if any(row["case"] == spec for row in rows)]
            result = write_results(rows, config, out_dir, command=command, models=done)
    return {**result, "rows": rows}


def pool_rounds(rows: Sequence[dict]) -> list[dict]:
    """One row per (model, context) from the rows of several rounds (``--rounds``): the timed
    calls of every round pooled, the medians and tokens/s taken over them, the peak memory
    the largest; a context skipped in any round is skipped, with that round's reason. One
    round's rows come back as they are."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["case"], row["context"]), []).append(row)
    pooled = []
    for group in groups.values():
        first = group[0]
        skipped = next((row for row in group if row["skip_reason"] is not None), None)
        if len(group) == 1 or skipped is not None:
            pooled.append(skipped or first)
            continue
        row = dict(first)
        for part in ("train", "prefill"):
            times = [t for each in group for t in each[f"{part}_times_s"]]
            row[f"{part}_times_s"], row[f"{part}_s"] = times, median(times)
            row[f"{part}_tokens_per_s"] = row["tokens_per_step"] / row[f"{part}_s"]
            peaks = [each[f"{part}_peak_bytes"] for each in group if each[f"{part}_peak_bytes"] is not None]
            row[f"{part}_peak_bytes"] = max(peaks) if peaks else None
        row["decode_times_s"] = [t for each in group for t in each["decode_times_s"]]
        row["decode_ms_per_token"] = median(row["decode_times_s"]) * 1e3
        pooled.append(row)
    return pooled


# --- the command line -----------------------------------------------------------------------


def layer_pattern(text: str) -> str:
    """An argparse type: a comma-separated pattern of layer specs (``vq``, ``local,local,vq``)."""
    try:
        for spec in text.split(","):
            parse_layer_spec(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


HELP = "whole LMs vs context length: training and prefill tokens/s, decode ms/token, peak memory"
DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linattn bench lm``."""
    defaults = LMBenchConfig()
    parser.add_argument("--models", "--mechanisms", dest="models", nargs="+", type=layer_pattern, metavar="SPEC",
                        help=f"layer specs or patterns (default {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--contexts", nargs="+", type=positive_int, metavar="C",
                        help=f"context lengths (default {' '.join(map(str, DEFAULT_CONTEXTS))}; "
                             "add 32768 65536 where memory allows)")
    parser.add_argument("--tokens-per-step", type=positive_int,
                        help=f"tokens per training step and prefill, batch = this / C (default "
                             f"{defaults.tokens_per_step})")
    parser.add_argument("--quick", action="store_true",
                        help=f"a tiny model (d_model {QUICK.d_model}) at contexts "
                             f"{' '.join(map(str, QUICK.contexts))}, for tests; flags given still apply")
    size = parser.add_argument_group("model size (every model the same)")
    for flag, help_text in (("--d-model", "width"), ("--n-layers", "layers (a pattern repeats to fill them)"),
                            ("--n-heads", "heads of the attention blocks"),
                            ("--gau-d-k", "key width of the VQ layers' gated attention units"),
                            ("--codebook-size", "VQ codes per unit"), ("--block-size", "VQ block length"),
                            ("--window", "window of the local layers")):
        name = flag[2:].replace("-", "_")
        size.add_argument(flag, type=positive_int, help=f"{help_text} (default {getattr(defaults, name)})")
    parser.add_argument("--repeats", type=positive_int, help=f"timed calls, median kept (default {defaults.repeats})")
    parser.add_argument("--rounds", type=positive_int,
                        help=f"measure every model this many times, each in a fresh process, the models in "
                             f"alternating order, and pool the timed calls (default {defaults.rounds}): a slow "
                             f"spell of a shared machine then falls on every model")
    parser.add_argument("--warmup", type=non_negative_int, help=f"untimed calls first (default {defaults.warmup})")
    parser.add_argument("--decode-tokens", type=positive_int,
                        help=f"greedy tokens generated per context, median kept (default {defaults.decode_tokens})")
    parser.add_argument("--memory-gb", type=positive_float,
                        help=f"skip a context whose estimated training-step memory exceeds this (10^9 bytes; "
                             f"default {defaults.memory_gb:g})")
    parser.add_argument("--profile", type=positive_int, metavar="N",
                        help="profile a training step, a prefill and a decoding step of each model at its longest "
                             "context; write the N operators with the most self time to profile.md")
    parser.add_argument("--device", type=available_device_name, default="cpu",
                        help="cpu, cuda or cuda:N: models, optimizer, tokens and states there (default %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="bfloat16: forward passes under bfloat16 autocast, float32 weights, as train.bf16 "
                             "(default %(default)s)")
    parser.add_argument("--seed", type=non_negative_int, help="seed of the weights and tokens (default 0)")
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("results/bench-lm"), help="output directory")


_FLAGS = ("contexts", "tokens_per_step", "d_model", "n_layers", "n_heads", "gau_d_k", "codebook_size", "block_size",
          "window", "repeats", "rounds", "warmup", "decode_tokens", "memory_gb", "seed", "device", "dtype")


def config_from_args(args: argparse.Namespace) -> LMBenchConfig:
    """``--quick``'s settings (or the defaults) with the flags given on top."""
    given = {name: getattr(args, name) for name in _FLAGS if getattr(args, name) is not None}
    if "contexts" in given:
        given["contexts"] = tuple(sorted(set(given["contexts"])))
    if args.profile:
        given["profile_top"] = args.profile
    return dataclasses.replace(QUICK if args.quick else LMBenchConfig(), **given)


def run_command(args: argparse.Namespace) -> int:
    """Measure, write the files, print the table and the targets."""
    config = config_from_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    models = list(dict.fromkeys(args.models or DEFAULT_MODELS))
    unequal = [c for c in config.contexts if config.batch(c) * c != config.tokens_per_step]
    if unequal:
        print(f"bench lm: at C = {' '.join(map(str, unequal))} the tokens per step differ from --tokens-per-step "
              f"{config.tokens_per_step} (one window above it; a remainder below); see the batch column", flush=True)
    result = run(config, models, out_dir=args.out, command=args.command_line, threads=args.threads)
    print(result["text"])
    print("wrote " + ", ".join(str(p) for p in result["files"]))
    return 0
