"""``linattn repro convert`` end to end at a tiny size: the rows, the journal, the files, and
the argument errors."""

from __future__ import annotations

import json

from test_train_cli import corpus, run_captured  # noqa: F401  (the tiny corpus fixture)

TINY = ["--steps", "8", "--sizes", "4", "16", "--calibration-tokens", "512", "--eval-tokens", "256", "--test-tokens",
        "256", "--d-model", "16", "--gau-d-k", "8", "--block-size", "8", "--context", "32", "--batch-size", "2",
        "--codebook-size", "8", "--no-progress", "--threads", "1"]


def test_repro_convert_end_to_end(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "convert"
    code, stdout, stderr = run_captured(["repro", "convert", "--data", str(corpus), "--out", str(out), *TINY])
    assert code == 0, stderr
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["case"], r["codebook_size"]) for r in rows] == [("softmax", None), ("converted", 4),
                                                               ("converted", 16), ("scratch", 8)]
    assert [r["step"] for r in rows] == [8, 9, 9, 9]  # 10% more steps, at least one
    assert len({r["parameters"] for r in rows}) == 1  # conversion adds no parameters (codebooks are buffers)
    for r in rows[1:3]:
        assert r["test_bpb_converted"] > 0 and r["test_bpb"] > 0
    assert (out / "conversion.png").stat().st_size > 0 and "converted, S = 16" in (out / "results.md").read_text()
    code, _, stderr = run_captured(["repro", "convert", "--data", str(corpus), "--out", str(out), "--resume", *TINY])
    assert code == 0, stderr  # every case reused from the journal


def test_repro_convert_refuses_parallel_jobs(corpus, tmp_path):  # noqa: F811
    code, _, stderr = run_captured(["repro", "convert", "--data", str(corpus), "--out", str(tmp_path / "x"),
                                    "--jobs", "2", *TINY])
    assert code == 2 and "--jobs must be 1" in stderr
