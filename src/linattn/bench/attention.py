"""``linattn bench attention``: causal attention time and peak memory against length T.

Every mechanism runs in one process on the same random ``q, k, v [B, H, T, D]``
(default B=1, H=8, D=64, float32, causal) and is compared with torch SDPA (``sdpa``,
the baseline): forward time (no grad), forward+backward time, and the peak extra memory
of each, as measured by ``linattn.bench.harness``. The ``reference`` case (materialised
T x T scores, forward only) is there to show what the tiled softmax saves in memory.

To add a mechanism, add a factory ``config -> Case`` to ``CASES``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import reporting
from .._checks import available_device_name, check_cuda_available
from .._checks import non_negative_int as _non_negative_int
from .._checks import positive_float as _positive_float, positive_int as _positive_int
from ..feature_maps import DPFP, FAVOR, EluPlusOne, FeatureMap
from ..ops.delta import delta_rule
from ..ops.kernel import linear_attention
from ..ops.softmax import softmax_attention
from ..ops.sparse import local_attention, lsh_attention, strided_attention
from ..ops.vq import vq_attention
from ..nn.quantizer import VectorQuantizer
from . import report
from .harness import Case, Inputs, run_cases

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_LENGTHS = (512, 1024, 2048, 4096)
BASELINE = "sdpa"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SCORE_BYTES = 4  # softmax_attention materialises float32 scores for every input dtype here


@dataclass(frozen=True)
class AttentionBenchConfig:
    """Shapes and measurement settings of one ``bench attention`` run."""

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    cases: tuple[str, ...] = ()  # empty: default_cases(device)
    batch: int = 1
    heads: int = 8
    dim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 3
    warmup: int = 1
    reference_mem_gb: float = 8.0
    reference_max_length: int = 16384
    recurrent_max_length: int = 4096
    backward_max_length: int | None = None
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    seed: int = 0
    profile_top: int = 0  # > 0: profile one more call per measurement, keep this many operators

    @property
    def shapes(self) -> dict:
        """The input shapes, as recorded in the results metadata."""
        return {"batch": self.batch, "heads": self.heads, "dim": self.dim, "dtype": self.dtype,
                "causal": True, "lengths": list(self.lengths)}


def _softmax_case(name: str, label: str, impl: str, **extra) -> Case:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return softmax_attention(q, k, v, causal=True, impl=impl)

    return Case(name, label, attend, **extra)


def _linear_case(name: str, label: str, feature_map: FeatureMap, impl: str = "auto") -> Case:
    """Kernel attention's causal chunk form: ``impl="auto"`` is the native kernel on a CPU."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return linear_attention(q, k, v, feature_map=feature_map, causal=True, mode="chunk", impl=impl)[0]

    return Case(name, label, attend)


def reference_max_length(config: AttentionBenchConfig) -> tuple[int, str]:
    """Longest T the reference may run: its scores (``2 B H T^2`` float32 values: scores
    and their softmax) fit in ``--reference-mem-gb``, and T <= ``--reference-max-length``."""
    budget = config.reference_mem_gb * 1e9
    by_memory = math.isqrt(int(budget // (2 * config.batch * config.heads * _SCORE_BYTES)))
    if by_memory < config.reference_max_length:
        return by_memory, f"estimated 2*B*H*T^2*4 bytes of scores > --reference-mem-gb {config.reference_mem_gb:g}"
    return config.reference_max_length, "--reference-max-length"


def _reference(config: AttentionBenchConfig) -> Case:
    max_length, note = reference_max_length(config)
    return _softmax_case(
        "reference", "softmax (materialised scores)", "reference",
        max_length=max_length, max_length_note=note, supports_backward=False,
    )


def _delta_case(name: str, label: str, mode: str, impl: str = "auto", **extra) -> Case:
    """Delta rule (identity features, l2-normalised q/k) with a fixed beta = 0.5; ``impl="auto"``
    is the native chunk kernel on a CPU for the forward pass alone."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        beta = torch.full(k.shape[:3], 0.5, dtype=k.dtype, device=k.device)
        return delta_rule(q, k, v, beta, mode=mode, impl=impl)[0]

    return Case(name, label, attend, **extra)


def _decay(k: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """A data-dependent log decay from the keys (part of the timed call, as a layer's gate):
    ``logsigmoid(k[..., 0]) [B, H, T]`` or, per key channel (GLA, temperature 16),
    ``logsigmoid(k) / 16 [B, H, T, D]``."""
    return F.logsigmoid(k) / 16 if per_channel else F.logsigmoid(k[..., 0])


def _decay_case(name: str, label: str, per_channel: bool, delta: bool = False, impl: str = "auto") -> Case:
    """Kernel attention with decay (identity features, no normaliser, scale D^-1/2: RetNet /
    GLA) or the gated delta rule (beta = 0.5), chunk form, the log decay from ``_decay``."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g = _decay(k, per_channel)
        if delta:
            beta = torch.full(k.shape[:3], 0.5, dtype=k.dtype, device=k.device)
            return delta_rule(q, k, v, beta, g=g, mode="chunk", impl=impl)[0]
        return linear_attention(q, k, v, feature_map="identity", normalize=None, scale=q.shape[-1] ** -0.5,
                                g=g, mode="chunk", impl=impl)[0]

    return Case(name, label, attend)


def _vq_case(config: AttentionBenchConfig, block_size: int, codebook_size: int = 512, variant: str = "",
             **options) -> Case:
    """Transformer-VQ: keys quantized (S codes per head, part of the timed call), block form;
    ``options`` (``schedule``, ``impl``) go to ``vq_attention`` and ``variant`` names them."""
    quantizer = VectorQuantizer(config.heads, config.dim, codebook_size).eval().to(config.device)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_hat, codes, _ = quantizer(k)
        codebook = quantizer.codebook.to(q.dtype)
        return vq_attention(q, k_hat, v, codes, codebook, block_size=block_size, mode="block", **options)[0]

    name = f"vq-b{block_size}" + (f"-{variant}" if variant else "")
    how = f", {variant}" if variant else ""
    return Case(name, f"Transformer-VQ (S={codebook_size}, block {block_size}{how})", attend)


CASES: dict[str, Callable[[AttentionBenchConfig], Case]] = {
    "sdpa": lambda config: _softmax_case("sdpa", "softmax (torch SDPA)", "sdpa"),
    "tiled": lambda config: _softmax_case("tiled", "softmax (tiled, online)", "tiled"),
    "reference": _reference,
    "linear-elu": lambda config: _linear_case("linear-elu", "linear elu+1 (chunk)", EluPlusOne()),
    "linear-elu-torch": lambda config: _linear_case("linear-elu-torch", "linear elu+1 (chunk, torch form)",
                                                    EluPlusOne(), impl="torch"),
    "linear-dpfp1": lambda config: _linear_case("linear-dpfp1", "linear DPFP(1) (chunk)", DPFP(1)),
    "linear-favor64": lambda config: _linear_case("linear-favor64", "linear FAVOR+(64) (chunk)", FAVOR(64)),
    "delta-chunk": lambda config: _delta_case("delta-chunk", "delta rule (chunk, WY/UT)", "chunk"),
    "delta-chunk-torch": lambda config: _delta_case("delta-chunk-torch", "delta rule (chunk, torch form)", "chunk",
                                                    impl="torch"),
    "delta-recurrent": lambda config: _delta_case(
        "delta-recurrent", "delta rule (recurrent)", "recurrent",
        max_length=config.recurrent_max_length, max_length_note="--recurrent-max-length",
    ),
    "decay-scalar": lambda config: _decay_case("decay-scalar", "linear, scalar decay (chunk; RetNet, Mamba-2)",
                                               False),
    "decay-channel": lambda config: _decay_case("decay-channel", "linear, per-channel decay (chunk; GLA)", True),
    "gated-delta": lambda config: _decay_case("gated-delta", "gated delta rule (chunk; Gated DeltaNet)", False,
                                              delta=True),
    "gated-delta-torch": lambda config: _decay_case("gated-delta-torch", "gated delta rule (chunk, torch form)",
                                                    False, delta=True, impl="torch"),
    "gated-delta-channel": lambda config: _decay_case("gated-delta-channel", "gated delta rule, per channel (chunk; "
                                                      "KDA)", True, delta=True),
    "local-256": lambda config: Case(
        "local-256", "local softmax (window 256)",
        lambda q, k, v: local_attention(q, k, v, window=256)[0],
    ),
    "strided-128": lambda config: Case(
        "strided-128", "Sparse Transformer strided (block 128)",
        lambda q, k, v: strided_attention(q, k, v, pattern="strided", block=128),
    ),
    "fixed-128": lambda config: Case(
        "fixed-128", "Sparse Transformer fixed (block 128, 8 summary)",
        lambda q, k, v: strided_attention(q, k, v, pattern="fixed", block=128, summary=8),
    ),
    "lsh-4x64": lambda config: Case(
        "lsh-4x64", "Reformer LSH (4 hashes, bucket 64; k = q)",
        lambda q, k, v: lsh_attention(q, v, n_hashes=4, bucket_size=64, seed=0),
    ),
    "vq-b128": lambda config: _vq_case(config, 128),
    "vq-b128-loop": lambda config: _vq_case(config, 128, variant="loop", impl="torch", schedule="loop"),
    "vq-b128-batched": lambda config: _vq_case(config, 128, variant="batched", impl="torch", schedule="batched"),
    "vq-b128-triton": lambda config: _vq_case(config, 128, variant="triton", impl="triton"),
    "vq-b256": lambda config: _vq_case(config, 256),
}
_VQ_CASES = ("vq-b128", "vq-b128-loop", "vq-b128-batched", "vq-b128-triton", "vq-b256")
CUDA_ONLY = ("vq-b128-triton",)  # compiled Triton kernels (on CPU tensors they only run in the interpreter)


def default_cases(device: str) -> tuple[str, ...]:
    """The cases a run on ``device`` measures when none are named: all but the CUDA-only ones off CUDA."""
    on_cuda = torch.device(device).type == "cuda"
    return tuple(name for name in CASES if on_cuda or name not in CUDA_ONLY)


def _make_inputs(config: AttentionBenchConfig) -> Callable[[int], Inputs]:
    def make(length: int) -> Inputs:
        generator = torch.Generator().manual_seed(config.seed + length)
        shape = (config.batch, config.heads, length, config.dim)
        return tuple(
            torch.randn(shape, generator=generator).to(device=config.device, dtype=DTYPES[config.dtype])
            for _ in range(3)
        )

    return make


# --- summary of the run against the project's targets -------------------------------


def _measured(rows: Sequence[dict], case: str, length: int, key: str) -> bool:
    """Whether ``case`` has a value for ``key`` at ``length``."""
    row = report.find_row(rows, case, length)
    return row is not None and row[key] is not None


def _longest_common(rows: Sequence[dict], cases: Sequence[str], key: str) -> int | None:
    """Longest length at which every one of ``cases`` has a value for ``key``."""
    lengths = {r["length"] for r in rows}
    return max((t for t in lengths if all(_measured(rows, c, t, key) for c in cases)), default=None)


def _growth(rows: Sequence[dict], case: str) -> dict | None:
    """Time at the longest length T over time at the measured length nearest T/4."""
    lengths = sorted(r["length"] for r in rows if r["case"] == case and r["forward_s"])
    if len(lengths) < 2:
        return None
    longest = lengths[-1]
    shorter = min(lengths[:-1], key=lambda t: abs(math.log(4 * t / longest)))
    hi, lo = report.find_row(rows, case, longest), report.find_row(rows, case, shorter)
    result = {"from_length": shorter, "to_length": longest, "length_ratio": longest / shorter}
    for key, name in (("forward_s", "forward"), ("forward_backward_s", "forward_backward")):
        result[name] = hi[key] / lo[key] if hi[key] and lo[key] else None
    return result


_GROWTH_CASES = ("linear-elu", "delta-chunk", BASELINE)


def _speedup(rows: Sequence[dict], case: str, baseline: str, length: int) -> dict:
    """baseline time / case time at one length, forward and forward+backward."""
    return {
        "length": length,
        "forward_speedup": report.speed_ratio(rows, case, baseline, length, "forward_s"),
        "forward_backward_speedup": report.speed_ratio(rows, case, baseline, length, "forward_backward_s"),
    }


def summarize(rows: Sequence[dict]) -> dict:
    """Headline numbers: linear-elu and delta-chunk vs sdpa speed at the longest common
    length, delta-chunk vs delta-recurrent, VQ vs sdpa at every length, time growth over a
    4x longer sequence, and tiled vs reference forward peak memory."""
    summary = {}
    for key, case, baseline, measured in (
        ("linear_elu_vs_sdpa", "linear-elu", BASELINE, "forward_s"),
        ("delta_chunk_vs_sdpa", "delta-chunk", BASELINE, "forward_s"),
        ("delta_chunk_vs_recurrent", "delta-chunk", "delta-recurrent", "forward_backward_s"),
        ("local_256_vs_sdpa", "local-256", BASELINE, "forward_s"),
    ):
        length = _longest_common(rows, [case, baseline], measured)
        if length is not None:
            summary[key] = _speedup(rows, case, baseline, length)
    for case in _VQ_CASES:
        lengths = sorted({r["length"] for r in rows})
        common = [
            t for t in lengths if _measured(rows, case, t, "forward_s") and _measured(rows, BASELINE, t, "forward_s")
        ]
        if common:
            summary[f"{case}_vs_sdpa"] = [_speedup(rows, case, BASELINE, t) for t in common]
    for case in _GROWTH_CASES:
        growth = _growth(rows, case)
        if growth is not None:
            summary[f"{case.replace('-', '_')}_growth"] = growth
    length = _longest_common(rows, ["tiled", "reference"], "forward_peak_bytes")
    if length is not None:
        tiled = report.find_row(rows, "tiled", length)["forward_peak_bytes"]
        reference = report.find_row(rows, "reference", length)["forward_peak_bytes"]
        summary["tiled_vs_reference_forward_memory"] = {
            "length": length,
            "tiled_bytes": tiled,
            "reference_bytes": reference,
            "ratio": tiled / reference if reference else None,
        }
    return summary


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def format_summary(summary: dict) -> str:
    """The summary as a few readable lines."""
    lines = ["targets:"]
    if "linear_elu_vs_sdpa" in summary:
        s = summary["linear_elu_vs_sdpa"]
        lines.append(
            f"  linear-elu vs sdpa at T={s['length']}: sdpa/linear-elu forward = {_x(s['forward_speedup'])}, "
            f"forward+backward = {_x(s['forward_backward_speedup'])}"
        )
    for key, case, baseline in (
        ("delta_chunk_vs_sdpa", "delta-chunk", BASELINE),
        ("delta_chunk_vs_recurrent", "delta-chunk", "delta-recurrent"),
        ("local_256_vs_sdpa", "local-256", BASELINE),
    ):
        if key in summary:
            s = summary[key]
            lines.append(
                f"  {case} vs {baseline} at T={s['length']}: {baseline}/{case} forward = "
                f"{_x(s['forward_speedup'])}, forward+backward = {_x(s['forward_backward_speedup'])}"
            )
    for case in _VQ_CASES:
        for s in summary.get(f"{case}_vs_sdpa", []):
            lines.append(
                f"  {case} vs sdpa at T={s['length']}: sdpa/{case} forward = {_x(s['forward_speedup'])}, "
                f"forward+backward = {_x(s['forward_backward_speedup'])}"
            )
    for case in _GROWTH_CASES:
        g = summary.get(f"{case.replace('-', '_')}_growth")
        if g is not None:
            lines.append(
                f"  {case} time growth T={g['from_length']} -> {g['to_length']} ({g['length_ratio']:g}x longer): "
                f"forward {_x(g['forward'])}, forward+backward {_x(g['forward_backward'])}"
            )
    if "tiled_vs_reference_forward_memory" in summary:
        m = summary["tiled_vs_reference_forward_memory"]
        mib = 2**20
        lines.append(
            f"  tiled vs reference forward peak memory at T={m['length']}: {_x(m['ratio'])} "
            f"({m['tiled_bytes'] / mib:.1f} MiB vs {m['reference_bytes'] / mib:.1f} MiB)"
        )
    if len(lines) == 1:
        lines.append("  (not enough cases/lengths measured for a summary)")
    if "warning" in summary:
        lines.append(f"  warning: {summary['warning']}")
    return "\n".join(lines)


def page(results: dict) -> str:
    """``results.md`` of ``results.json``'s contents: the command, the table (speed ratios
    against the metadata's ``baseline``) and the summary."""
    metadata = results["metadata"]
    table = report.markdown_table(results["rows"], baseline=metadata["baseline"])
    return (f"# bench attention\n\n`{metadata['command']}`\n\n{table}\n```text\n{format_summary(results['summary'])}\n"
            "```\n")


def _speedups_view(results: dict, *, cases: str | None = None, lengths: str | None = None,
                   baseline: str | None = None) -> str:
    """``report.speedup_table`` of ``results.json``'s rows (comma-separated ``cases`` and
    ``lengths``; ``baseline`` default the run's): the options of a generated block."""
    try:
        chosen_lengths = [int(t) for t in lengths.split(",")] if lengths else None
    except ValueError:
        raise ValueError(f"lengths={lengths!r}: expected comma-separated integers") from None
    return report.speedup_table(results["rows"], baseline or results["metadata"]["baseline"],
                                cases=cases.split(",") if cases else None, lengths=chosen_lengths)


# Named tables of a results.json for the documentation: name -> view(results, **options).
VIEWS = {"speedups": _speedups_view}


# --- running and the command line ---------------------------------------------------


COLD_START_WARNING = (
    "--warmup 0: each case's first timed call includes one-time costs (allocation, lazy initialisation), so "
    "times at the first lengths, and the growth ratios and speed-ups computed from them, are inflated"
)


def run(config: AttentionBenchConfig, *, out_dir: Path, command: str, progress: bool = True) -> dict:
    """Measure, then write ``results.json``, ``results.md`` and the PNG plots into ``out_dir``.

    Returns ``{"metadata", "rows", "summary", "table", "files"}``.
    """
    unknown = [name for name in config.cases if name not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    check_cuda_available("device", config.device)
    off_cuda = [name for name in config.cases if name in CUDA_ONLY and torch.device(config.device).type != "cuda"]
    if off_cuda:
        raise ValueError(f"case(s) {', '.join(off_cuda)} run on CUDA only (--device cuda)")
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    cases = [CASES[name](config) for name in (config.cases or default_cases(config.device))]
    rows = run_cases(
        cases, config.lengths, _make_inputs(config),
        repeats=config.repeats, warmup=config.warmup, device=config.device, progress=progress,
        backward_max_length=config.backward_max_length, profile_top=config.profile_top,
    )
    metadata = reporting.collect_metadata(device=config.device, command=command, shapes=config.shapes)
    metadata.update(repeats=config.repeats, warmup=config.warmup, baseline=BASELINE, seed=config.seed)
    summary = summarize(rows)
    if config.warmup == 0:
        summary["warning"] = COLD_START_WARNING
    table = report.markdown_table(rows, baseline=BASELINE)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [reporting.write_json(out_dir / "results.json", rows=rows, metadata=metadata, summary=summary),
             reporting.write_markdown(out_dir / "results.md",
                                      page({"metadata": metadata, "rows": rows, "summary": summary}))]
    files += report.write_plots(rows, out_dir, title="causal attention")
    if config.profile_top:
        profile = out_dir / "profile.md"
        profile.write_text(f"# bench attention: where the time goes\n\n`{command}`\n\n{report.profile_markdown(rows)}")
        files.append(profile)
    return {"metadata": metadata, "rows": rows, "summary": summary, "table": table, "files": files}


HELP = "causal attention: forward / forward+backward time and peak memory vs sequence length"
DESCRIPTION = (
    "Runs every attention mechanism on the same random causal q, k, v [B, H, T, D] in one process and "
    "compares it with torch SDPA: median forward time (no grad) and forward+backward time, and the peak "
    "extra memory of each. Writes results.json, results.md and PNG plots to --out and prints the table."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linattn bench attention``."""
    defaults = AttentionBenchConfig()
    parser.add_argument("--lengths", nargs="+", type=_positive_int, metavar="T",
                        help=f"sequence lengths (default {' '.join(map(str, DEFAULT_LENGTHS))})")
    parser.add_argument("--quick", action="store_true",
                        help=f"lengths {' '.join(map(str, QUICK_LENGTHS))} and 2 repeats unless given")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), metavar="CASE",
                        help=f"cases to run (default all but the CUDA-only {' '.join(CUDA_ONLY)} off CUDA: "
                             f"{' '.join(CASES)})")
    parser.add_argument("--repeats", type=_positive_int, help="timed calls per measurement, median kept (default 3)")
    parser.add_argument("--warmup", type=_non_negative_int, default=defaults.warmup, help="untimed calls first")
    parser.add_argument("--device", type=available_device_name, default=defaults.device,
                        help="cpu, cuda or cuda:N (default %(default)s)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=defaults.dtype)
    parser.add_argument("--batch", type=_positive_int, default=defaults.batch)
    parser.add_argument("--heads", type=_positive_int, default=defaults.heads)
    parser.add_argument("--dim", type=_positive_int, default=defaults.dim, help="head dimension of q, k and v")
    parser.add_argument("--reference-mem-gb", type=_positive_float, default=defaults.reference_mem_gb,
                        help="skip the reference case where its scores, 2*B*H*T^2*4 bytes, exceed this (10^9 bytes)")
    parser.add_argument("--reference-max-length", type=_positive_int, default=defaults.reference_max_length,
                        help="longest T for the reference case")
    parser.add_argument("--recurrent-max-length", type=_positive_int, default=defaults.recurrent_max_length,
                        help="longest T for token-by-token (recurrent) cases")
    parser.add_argument("--backward-max-length", type=_positive_int,
                        help="measure forward+backward only up to this T (default: every length)")
    parser.add_argument("--threads", type=_positive_int, help="torch intra-op CPU threads (default: torch's choice)")
    parser.add_argument("--profile", type=_positive_int, metavar="N", default=0,
                        help="also run each measured call once under torch.profiler and write its N operators "
                             "with the most self time to profile.md and results.json")
    parser.add_argument("--out", type=Path, default=Path("results/bench-attention"), help="output directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_command(args: argparse.Namespace) -> int:
    """Run from parsed arguments; print the table and the summary."""
    config = AttentionBenchConfig(
        lengths=tuple(sorted(set(args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)))),
        cases=tuple(dict.fromkeys(args.cases or ())),
        batch=args.batch,
        heads=args.heads,
        dim=args.dim,
        dtype=args.dtype,
        device=args.device,
        repeats=args.repeats or (2 if args.quick else 3),
        warmup=args.warmup,
        reference_mem_gb=args.reference_mem_gb,
        reference_max_length=args.reference_max_length,
        recurrent_max_length=args.recurrent_max_length,
        backward_max_length=args.backward_max_length,
        threads=args.threads,
        profile_top=args.profile,
    )
    result = run(config, out_dir=args.out, command=args.command_line, progress=not args.no_progress)
    print(result["table"])
    print(format_summary(result["summary"]))
    print("wrote " + ", ".join(str(p) for p in result["files"]))
    return 0
