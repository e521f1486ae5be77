"""Each attention op's arithmetic ceiling against causal SDPA, and the share of it measured.

``python tools/arithmetic_ceilings.py`` reads the default ``linattn bench attention`` run
(``docs/benchmarks/bench-attention/results.json``: B 1, H 8, D = E = 64, causal, float32) and
writes ``docs/benchmarks/ceilings/results.json`` and ``results.md``: for every case at T =
16384, the multiply-adds per query position and head of the algorithm the case runs (with its
chunk, feature width, window or block), SDPA's, their ratio (the **ceiling**: the speed-up over
SDPA if both ran their multiply-adds at the same rate), the forward speed-up measured in that run
and the **share** of the ceiling it reaches. Elementwise work (feature maps, decays, softmax
passes, exp) is not counted: a share below 1 is what those passes, smaller products and memory
traffic cost against SDPA's one fused kernel.

Multiply-adds per position (C chunk 64, F feature width, w window, L block, S codes):

- SDPA, causal: ``(T + 1) (D + E) / 2``
- kernel attention, chunk form: ``C (F + E) + 2 F E``, with the normaliser ``C + F`` more (its
  column of the values and its state row) and FAVOR+'s projections ``2 D F``: the chunk's scores
  and values as full C x C blocks, the state read and write.
- scalar and per-channel decay (identity features, no normaliser): ``C (F + E) + 2 F E``.
- delta rule and gated delta rule, WY/UT chunk form: ``C (3 F + 2 E) + C^2 / 2 + 3 F E``: the
  Gram matrix, ``W = A K``, the scores (C F each), ``U = A V``, the scores times the corrected
  values (C E each), the unit-triangular solve (C^2 / 2), ``W S``, ``K^T (U - W S)``, ``Q S``.
- sliding window w: ``w (D + E)``.
- Transformer-VQ, block L, S codes: ``(2 L + S) (D + E) + S D`` (the window and cache scores
  and values, the nearest-code search).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

T, D, E, C = 16384, 64, 64, 64
SDPA = (T + 1) * (D + E) / 2


def _kernel(F: int, normaliser: bool = True, projection: int = 0) -> float:
    return C * (F + E) + 2 * F * E + ((C + F) if normaliser else 0) + projection


def _delta(F: int = D) -> float:
    return C * (3 * F + 2 * E) + C * C / 2 + 3 * F * E


def _vq(L: int, S: int = 512) -> float:
    return (2 * L + S) * (D + E) + S * D


# case -> (what it computes, multiply-adds per position and head)
OPS = {
    "linear-elu": ("kernel attention, elu+1 (F = 64)", _kernel(D)),
    "linear-dpfp1": ("kernel attention, DPFP(1) (F = 128)", _kernel(2 * D)),
    "linear-favor64": ("kernel attention, FAVOR+ (F = 64)", _kernel(64, projection=2 * D * 64)),
    "decay-scalar": ("scalar decay (RetNet, Mamba-2)", _kernel(D, normaliser=False)),
    "decay-channel": ("per-channel decay (GLA)", _kernel(D, normaliser=False)),
    "delta-chunk": ("delta rule (WY/UT)", _delta()),
    "gated-delta": ("gated delta rule (WY/UT)", _delta()),
    "local-256": ("sliding window 256", 256 * (D + E)),
    "vq-b128": ("Transformer-VQ, block 128, S 512", _vq(128)),
    "vq-b256": ("Transformer-VQ, block 256, S 512", _vq(256)),
}


def ceilings(results: dict) -> dict:
    """``{case: {label, macs_per_position, ceiling, measured, share}}`` from a bench attention run."""
    forward = {row["case"]: row["forward_s"] for row in results["rows"] if row["length"] == T and row["forward_s"]}
    summary = {}
    for case, (label, macs) in OPS.items():
        ceiling = SDPA / macs
        measured = forward["sdpa"] / forward[case]
        summary[case] = {"label": label, "macs_per_position": macs, "ceiling": ceiling, "measured": measured,
                         "share": measured / ceiling}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("docs/benchmarks/bench-attention/results.json"))
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/ceilings"))
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    summary = ceilings(results)
    source = {"results": str(args.results), "command": results["metadata"]["command"],
              "date": results["metadata"].get("date"), "T": T, "D": D, "E": E, "chunk": C,
              "sdpa_macs_per_position": SDPA}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"metadata": source, "rows": [], "summary": summary},
                                                      indent=2) + "\n")
    lines = ["# Arithmetic ceilings against causal SDPA", "",
             f"`python tools/arithmetic_ceilings.py` from `{source['command']}` ({source['date']}); forward, "
             f"T = {T}, D = E = {D}, chunk {C}; SDPA: {SDPA:,.0f} multiply-adds per position and head.", "",
             "| case | multiply-adds per position | ceiling | measured | share |", "| --- | --- | --- | --- | --- |"]
    for case, row in summary.items():
        lines.append(f"| {row['label']} (`{case}`) | {row['macs_per_position']:,.0f} | {row['ceiling']:.1f}x | "
                     f"{row['measured']:.2f}x | {row['share']:.0%} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
