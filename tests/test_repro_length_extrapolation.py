"""`linattn repro length-extrapolation`: end to end on a tiny corpus, the summary, argument errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from linattn.cli import main
from linattn.data import load_corpus
from linattn.repro import length_extrapolation
from linattn.train.checkpoint import load_model


@pytest.fixture
def corpus(tmp_path):
    generator = torch.Generator().manual_seed(0)
    words = ["the", "king", "queen", "speaks", "and", "fool", "night", "o", "my", "lord", "sweet"]
    text = " ".join(words[int(i)] for i in torch.randint(len(words), (3000,), generator=generator))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def _bpb_in_windows(model, tokens: torch.Tensor, context: int) -> float:
    """Written out: every window of ``context`` bytes read from a fresh state; mean bits per predicted byte."""
    nats, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, tokens.numel() - 1, context):
            window = tokens[start:start + context + 1].long()
            logits, _, _ = model(window[None, :-1])
            nats += F.cross_entropy(logits[0].double(), window[1:], reduction="sum").item()
            count += window.numel() - 1
    return nats / count / math.log(2)


def test_repro_length_extrapolation_end_to_end(corpus, tmp_path, monkeypatch, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "out"
    argv = ["repro", "length-extrapolation", "--quick", "--data", str(corpus), "--variants", "softmax-entropy",
            "hybrid", "vq", "--steps", "4", "--eval-contexts", "64", "128", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "C=32 (trained)" in capsys.readouterr().out
    document = json.loads((out / "results.json").read_text())
    assert document["metadata"]["command"] == "linattn " + " ".join(argv)
    rows = document["rows"]
    assert [r["variant"] for r in rows] == ["softmax-entropy", "hybrid", "vq"]
    # --quick: 3 layers, window 16, trained at 32; the hybrid is local layers then a global NoPE entropy layer
    assert [r["spec"] for r in rows] == ["softmax:entropy", "local:16,local:16,softmax:nope:entropy", "vq"]
    assert [r["recurrent"] for r in rows] == [False, False, True]

    test = load_corpus(str(corpus)).tokens("test")
    for row in rows:
        assert row["train_context"] == 32
        assert [entry["context"] for entry in row["test_bpb"]] == [32, 64, 128]  # the training context is added
        assert {entry["tokens"] for entry in row["test_bpb"]} == {test.numel() - 1} == {row["test_tokens"]}
        model, _ = load_model(out / "runs" / row["variant"])
        for entry in row["test_bpb"]:  # the state really is reset at every window of C
            assert entry["bpb"] == pytest.approx(_bpb_in_windows(model, test, entry["context"]), abs=2e-5)
        if row["recurrent"]:  # carried across the whole stream = one pass over it
            assert row["test_bpb_carried"] == pytest.approx(_bpb_in_windows(model, test, test.numel()), abs=2e-5)
        else:
            assert row["test_bpb_carried"] is None
        assert len(row["loss_curve"]) >= 1 and [s for s, _ in row["validation_curve"]] == [0, 4]
    vq, hybrid = rows[2], rows[1]
    assert abs(vq["parameters"] - hybrid["parameters"]) / hybrid["parameters"] < 0.05  # equal budget

    summary = document["summary"]
    for row in rows:
        bpb = {entry["context"]: entry["bpb"] for entry in row["test_bpb"]}
        rise = max(bpb[64] - bpb[32], bpb[128] - bpb[32])
        assert summary["variants"][row["variant"]]["rise"] == pytest.approx(rise)
        assert summary["variants"][row["variant"]]["extrapolates"] == (rise <= 0.01)
    table = (out / "results.md").read_text()
    for row in rows:
        cells = " | ".join(f"{entry['bpb']:.3f}" for entry in row["test_bpb"])
        line = f"| {row['variant']} | `{row['spec']}` | {row['parameters']:,} | {row['validation_bpb']:.3f} | {cells} |"
        assert line in table
    assert f"| {vq['test_bpb_carried']:.3f} |" in table and "Extrapolate (test bpb at every context up to 128" in table
    assert (out / "bpb_vs_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --resume: every variant is recorded in runs.jsonl, so nothing is trained again
    def fail(*args, **kwargs):
        raise AssertionError("a recorded variant was trained again")

    monkeypatch.setattr(length_extrapolation, "train_model", fail)
    assert main([*argv, "--resume"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert [r["test_bpb"] for r in again["rows"]] == [r["test_bpb"] for r in rows]
    assert "3 of 3 variants were reused" in (out / "results.md").read_text()


def _row(variant: str, bpb: dict[int, float], carried: float | None = None) -> dict:
    return {"variant": variant, "train_context": 256, "test_bpb_carried": carried,
            "test_bpb": [{"context": c, "bpb": b, "tokens": 100} for c, b in bpb.items()]}


def test_summary_and_conclusions_from_the_numbers():
    rows = [
        _row("softmax", {256: 2.0, 1024: 3.5, 4096: 5.0}),
        _row("softmax-entropy", {256: 2.1, 1024: 2.5, 4096: 3.0}),
        _row("softmax-nope-entropy", {256: 2.2, 1024: 2.205, 4096: 2.1}),
        _row("vq", {256: 2.0, 1024: 1.9, 4096: 1.85}, carried=1.8),
    ]
    summary = length_extrapolation.summarize(rows, tolerance=0.01)
    variants = summary["variants"]
    assert variants["softmax"]["rise"] == pytest.approx(3.0) and variants["softmax"]["extrapolates"] is False
    assert variants["softmax-nope-entropy"]["rise"] == pytest.approx(0.005)
    assert variants["softmax-nope-entropy"]["extrapolates"] is True
    assert variants["vq"]["rise"] == pytest.approx(-0.1) and variants["vq"]["extrapolates"] is True
    assert summary["entropy_scale"] == pytest.approx({"256": -0.1, "1024": 1.0, "4096": 2.0})
    text = length_extrapolation.conclusions(rows, summary)
    assert "up to 4096 at most 0.01 above the bpb at the training context 256): softmax-nope-entropy, vq." in text
    assert "Do not (largest rise): softmax (+3.000), softmax-entropy (+0.900)." in text
    assert "The entropy-invariant scale helps rotary softmax at C=4096: 3.000 bpb with it against 5.000" in text
    assert "+2.000 in its favour; -0.100 at the training context" in text
    assert "State carried across the whole stream: vq 1.800 (reset every 256: 2.000)." in text
    # a tolerance of 1 bpb lets softmax-entropy through, not softmax
    loose = length_extrapolation.summarize(rows, tolerance=1.0)["variants"]
    assert [name for name, v in loose.items() if v["extrapolates"]] == ["softmax-entropy", "softmax-nope-entropy", "vq"]


def test_hybrid_spec_follows_the_layer_count():
    assert length_extrapolation.hybrid_spec(3, 128) == "local:128,local:128,softmax:nope:entropy"
    assert length_extrapolation.hybrid_spec(2, 64) == "local:64,softmax:nope:entropy"
    with pytest.raises(ValueError, match="--n-layers >= 2"):
        length_extrapolation.hybrid_spec(1, 64)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--variants", "nope"], "--variants"),
        (["--eval-contexts", "64", "0"], "--eval-contexts"),
        (["--eval-contexts", "x"], "--eval-contexts"),
        (["--context", "0"], "--context"),
        (["--steps", "0"], "--steps"),
        (["--tolerance", "-1"], "--tolerance"),
        (["--variants", "hybrid", "--n-layers", "1"], "--n-layers"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(args, named, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["repro", "length-extrapolation", "--data", str(corpus), *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and named in err and "Traceback" not in err
    assert not out.exists()
