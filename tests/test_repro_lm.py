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


def test_repro_lm_writes_table_json_and_plot(corpus, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    out = tmp_path / "out"
    args = _parser().parse_args([
        "lm", "--data", str(corpus), "--mechanisms", "vq", "local", "--steps", "4", "--batch-size", "2",
        "--context", "16", "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--window", "4",
        "--codebook-size", "8", "--block-size", "4", "--gau-d-k", "8", "--eval-every", "2",
        "--eval-tokens", "256", "--test-tokens", "200", "--out", str(out),
    ])
    args.command_line = "linattn repro lm (test)"
    assert args.handler(args) == 0
    document = json.loads((out / "results.json").read_text())
    assert document["metadata"]["command"] == "linattn repro lm (test)"
    rows = document["rows"]
    assert [row["mechanism"] for row in rows] == ["vq", "local"]
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
    assert "| vq |" in table and "| local |" in table
    assert (out / "loss_curves.png").stat().st_size > 0

    # --resume: both mechanisms are recorded in runs.jsonl, so nothing is trained again.
    def fail(*args, **kwargs):
        raise AssertionError("a recorded mechanism was trained again")

    monkeypatch.setattr(lm_quality, "train", fail)
    args.resume = True
    assert args.handler(args) == 0
    again = json.loads((out / "results.json").read_text())
    assert [r["validation_bpb"] for r in again["rows"]] == [r["validation_bpb"] for r in rows]
    assert "2 of 2 mechanisms were reused" in (out / "results.md").read_text()
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
