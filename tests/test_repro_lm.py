"""`linattn repro lm`: runs end to end on a tiny corpus and writes the documented files."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from linattn.repro import lm_quality


def _parser():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="experiment", required=True)
    command = sub.add_parser("lm")
    lm_quality.command.add_arguments(command)
    command.set_defaults(handler=lm_quality.command.run_command)
    return parser


@pytest.fixture
def corpus(tmp_path):
    generator = torch.Generator().manual_seed(0)
    words = ["the", "king", "queen", "speaks", "and", "fool", "night", "o", "my", "lord", "sweet"]
    text = " ".join(words[int(i)] for i in torch.randint(len(words), (3000,), generator=generator))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


TINY = ["--steps", "4", "--batch-size", "2", "--context", "16", "--d-model", "16", "--n-layers", "1", "--n-heads",
        "2", "--window", "4", "--codebook-size", "8", "--block-size", "4", "--gau-d-k", "8", "--eval-every", "2",
        "--eval-tokens", "256", "--test-tokens", "200"]


def test_repro_lm_writes_table_json_and_plot(corpus, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    out = tmp_path / "out"
    args = _parser().parse_args(["lm", "--data", str(corpus), "--mechanisms", "vq", "local", *TINY, "--seeds", "1",
                                 "--out", str(out)])
    args.command_line = "linattn repro lm (test)"
    assert args.handler(args) == 0
    document = json.loads((out / "results.json").read_text())
    assert document["metadata"]["command"] == "linattn repro lm (test)"
    rows = document["runs"]
    assert [row["mechanism"] for row in rows] == ["vq", "local"] and [row["seed"] for row in rows] == [0, 0]
    assert [(row["mechanism"], row["n"]) for row in document["rows"]] == [("vq", 1), ("local", 1)]
    for row in rows:
        for key in ("parameters", "validation_bpb", "test_bpb_reset", "test_bpb_schedule", "test_bpb_carried",
                    "train_tokens_per_second",
                    "loss_curve", "validation_curve"):
            assert key in row
        assert 0 < row["test_bpb_reset"] < 16 and 0 < row["test_bpb_carried"] < 16
        assert row["test_tokens"] == 199  # 200 bytes -> 199 predicted
        assert [step for step, _ in row["validation_curve"]] == [0, 2, 4]
    # equal budget: the VQ pair's width is set so its parameter count is close to the block's
    vq, local = rows
    assert abs(vq["parameters"] - local["parameters"]) / local["parameters"] < 0.15
    table = (out / "results.md").read_text()
    for row in rows:  # n = 1: the mean and no spread
        name = f"| {row['mechanism']} | `{row['spec']}` |"
        assert f"{name} {row['parameters']:,} | 1 | {row['validation_bpb']:.3f} ± — |" in table
    assert "n = 1 seed per row (0)." in table and "## Differences" in table
    assert lm_quality.page(json.loads((out / "results.json").read_text())) == table  # from the JSON alone
    assert (out / "loss_curves.png").stat().st_size > 0

    # --resume: both mechanisms are recorded in runs.jsonl, so nothing is trained again.
    def fail(*args, **kwargs):
        raise AssertionError("a recorded mechanism was trained again")

    monkeypatch.setattr(lm_quality, "train", fail)
    args.resume = True
    assert args.handler(args) == 0
    again = json.loads((out / "results.json").read_text())
    assert [r["validation_bpb"] for r in again["runs"]] == [r["validation_bpb"] for r in rows]
    assert "2 of 2 runs were reused" in (out / "results.md").read_text()
    args.resume = False
    with pytest.raises(AssertionError, match="trained again"):
        args.handler(args)


def test_repro_lm_rejects_bad_arguments(corpus, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["lm", "--mechanisms", "nope"])
    assert exit_info.value.code == 2
    for bad in (["--steps", "0"], ["--lr", "-1"], ["--test-tokens", "-1"], ["--context", "x"]):
        with pytest.raises(SystemExit) as exit_info:
            _parser().parse_args(["lm", *bad])
        assert exit_info.value.code == 2
    args = _parser().parse_args(["lm", "--data", str(corpus), "--out", str(tmp_path)])
    args.command_line, args.steps = "x", 0  # a namespace built by hand is checked too
    with pytest.raises(ValueError, match="--steps"):
        args.handler(args)


def test_repro_lm_quick_seeds_2_gives_n_2_with_the_spread_and_the_differences(corpus, tmp_path):
    out = tmp_path / "out"
    args = _parser().parse_args(["lm", "--quick", "--data", str(corpus), "--mechanisms", "vq", "local", *TINY,
                                 "--seeds", "2", "--no-progress", "--out", str(out)])
    args.command_line = "x"
    args.steps = 4  # --quick sets 60 steps and 8k-byte evaluations; keep the test tiny
    args.eval_tokens, args.test_tokens = 256, 200
    args.quick = False
    assert args.handler(args) == 0
    document = json.loads((out / "results.json").read_text())
    assert [(r["mechanism"], r["seed"]) for r in document["runs"]] == [("vq", 0), ("local", 0), ("vq", 1),
                                                                     ("local", 1)]
    table = (out / "results.md").read_text()
    assert "n = 2 seeds per row (0, 1)." in table
    stats = {}
    for row in document["rows"]:
        assert row["n"] == 2 and row["seeds"] == [0, 1]
        bpb = sorted(r["validation_bpb"] for r in document["runs"] if r["mechanism"] == row["mechanism"])
        mean, std = sum(bpb) / 2, abs(bpb[1] - bpb[0]) / 2 ** 0.5
        stats[row["mechanism"]] = (bpb, mean)
        assert f"| 2 | {mean:.3f} ± {std:.3f} ({bpb[0]:.3f}–{bpb[1]:.3f}) |" in table
    (vq_bpb, vq_mean), (local_bpb, local_mean) = stats["vq"], stats["local"]
    apart = vq_bpb[1] < local_bpb[0] or local_bpb[1] < vq_bpb[0]
    assert f"| vq |  | {vq_mean - local_mean:+.3f}{' ✓' if apart else ''} |" in table
