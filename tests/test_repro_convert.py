"""``linattn repro convert`` end to end at a tiny size: the rows per seed and over the seeds, the
journal, the files, and the argument errors."""

from __future__ import annotations

import json

from test_train_cli import corpus, run_captured  # noqa: F401  (the tiny corpus fixture)

from linattn.repro import conversion

TINY = ["--steps", "8", "--sizes", "4", "16", "--calibration-tokens", "512", "--eval-tokens", "256", "--test-tokens",
        "256", "--d-model", "16", "--gau-d-k", "8", "--block-size", "8", "--context", "32", "--batch-size", "2",
        "--codebook-size", "8", "--no-progress", "--threads", "1"]


def test_repro_convert_end_to_end(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "convert"
    code, stdout, stderr = run_captured(["repro", "convert", "--data", str(corpus), "--out", str(out), "--seeds", "2",
                                         *TINY])
    assert code == 0, stderr
    document = json.loads((out / "results.json").read_text())
    runs = document["runs"]
    cases = [("softmax", None), ("converted", 4), ("converted", 16), ("scratch", 8)]
    assert [(r["case"], r["codebook_size"], r["seed"]) for r in runs] == [(*c, s) for s in (0, 1) for c in cases]
    assert [r["step"] for r in runs] == [8, 9, 9, 9] * 2  # 10% more steps, at least one
    assert len({r["parameters"] for r in runs}) == 1  # conversion adds no parameters (codebooks are buffers)
    for r in runs:
        if r["case"] == "converted":
            assert r["test_bpb_converted"] > 0 and r["test_bpb"] > 0
    for seed in (0, 1):  # every seed trains its own source and converts it
        assert (out / "runs" / f"seed-{seed}" / "gau-softmax" / "checkpoints" / "latest").exists()
        assert (out / "runs" / f"seed-{seed}" / "converted-16" / "checkpoints" / "latest").exists()
    assert runs[0]["test_bpb"] != runs[4]["test_bpb"]  # the two sources differ
    rows = document["rows"]
    assert [(r["case"], r["codebook_size"], r["n"], r["seeds"]) for r in rows] == [(*c, 2, [0, 1]) for c in cases]
    text = (out / "results.md").read_text()
    assert "n = 2 seeds per row (0, 1)." in text and "| converted, S = 16 |" in text and "## Differences" in text
    for row in rows:
        bpb = sorted(r["test_bpb"] for r in runs if (r["case"], r["codebook_size"]) == (row["case"],
                                                                                        row["codebook_size"]))
        mean, std = sum(bpb) / 2, (bpb[1] - bpb[0]) / 2 ** 0.5
        assert f"| {mean:.3f} ± {std:.3f} ({bpb[0]:.3f}–{bpb[1]:.3f}) |" in text
    assert (out / "conversion.png").stat().st_size > 0
    assert conversion.page(document) == text  # the page again, from results.json alone
    code, _, stderr = run_captured(["repro", "convert", "--data", str(corpus), "--out", str(out), "--resume",
                                    "--seeds", "2", *TINY])
    assert code == 0, stderr  # every case reused from the journal
    assert "8 of 8 runs were reused" in (out / "results.md").read_text()


def test_repro_convert_refuses_parallel_jobs(corpus, tmp_path):  # noqa: F811
    code, _, stderr = run_captured(["repro", "convert", "--data", str(corpus), "--out", str(tmp_path / "x"),
                                    "--jobs", "2", *TINY])
    assert code == 2 and "--jobs must be 1" in stderr
