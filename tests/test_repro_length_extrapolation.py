"""`linattn repro length-extrapolation`: end to end on a tiny corpus, the summary, argument errors."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from linattn.cli import main
from linattn.data import load_corpus
from linattn.models import LM
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
    rows = document["runs"]  # --quick: one seed, so one run per variant
    assert [r["seed"] for r in rows] == [0, 0, 0] and [r["n"] for r in document["rows"]] == [1, 1, 1]
    assert [r["variant"] for r in rows] == ["softmax-entropy", "hybrid", "vq"]
    # --quick: 3 layers, window 16, trained at 32; the hybrid is local layers then a global NoPE entropy layer
    assert [r["spec"] for r in rows] == ["softmax:entropy", "local:16,local:16,softmax:nope:entropy", "vq"]
    assert [r["recurrent"] for r in rows] == [False, False, True]

    test = load_corpus(str(corpus)).tokens("test")
    for row in rows:
        assert row["train_context"] == 32
        assert [entry["context"] for entry in row["test_bpb"]] == [32, 64, 128]  # the training context is added
        assert {entry["tokens"] for entry in row["test_bpb"]} == {test.numel() - 1} == {row["test_tokens"]}
        model, _ = load_model(out / "runs" / "seed-0" / row["variant"])
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
        assert summary["variants"][row["variant"]]["rise"]["mean"] == pytest.approx(rise)
        assert summary["variants"][row["variant"]]["extrapolates"] == (rise <= 0.01)
    table = (out / "results.md").read_text()
    for row in rows:  # n = 1: each cell is the run's number and "± —"
        cells = " | ".join(f"{entry['bpb']:.3f} ± —" for entry in row["test_bpb"])
        line = (f"| {row['variant']} | `{row['spec']}` | {row['parameters']:,} | 1 | {row['validation_bpb']:.3f} ± — | "
                f"{cells} |")
        assert line in table
    assert f"| {vq['test_bpb_carried']:.3f} ± — |" in table
    assert "Extrapolate (test bpb at every context up to 128" in table and "## Differences" in table
    assert "Test bpb at C=128, the longest context (lower is better):" in table
    assert (out / "bpb_vs_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["repro", "report", str(out)]) == 0  # the page again, from results.json alone
    assert capsys.readouterr().out == table

    # --resume: every variant is recorded in runs.jsonl, so nothing is trained again
    def fail(*args, **kwargs):
        raise AssertionError("a recorded variant was trained again")

    monkeypatch.setattr(length_extrapolation, "train_model", fail)
    assert main([*argv, "--resume"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert [r["test_bpb"] for r in again["runs"]] == [r["test_bpb"] for r in rows]
    assert "3 of 3 runs were reused" in (out / "results.md").read_text()


def test_quick_with_two_seeds_reports_n_2_per_variant(corpus, tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "out"
    assert main(["repro", "length-extrapolation", "--quick", "--seeds", "2", "--data", str(corpus), "--variants",
                 "local", "vq", "--steps", "4", "--eval-contexts", "64", "--out", str(out), "--no-progress"]) == 0
    document = json.loads((out / "results.json").read_text())
    runs = document["runs"]
    assert [(r["variant"], r["seed"]) for r in runs] == [("local", 0), ("vq", 0), ("local", 1), ("vq", 1)]
    table = (out / "results.md").read_text()
    assert "n = 2 seeds per row (0, 1)." in table
    for row in document["rows"]:
        mine = [r for r in runs if r["variant"] == row["variant"]]
        assert row["n"] == 2 and row["seeds"] == [0, 1]
        at_64 = sorted(entry["bpb"] for r in mine for entry in r["test_bpb"] if entry["context"] == 64)
        mean, std = sum(at_64) / 2, (at_64[1] - at_64[0]) / 2 ** 0.5
        assert f"{mean:.3f} ± {std:.3f} ({at_64[0]:.3f}–{at_64[1]:.3f})" in table
        rises = [max(e["bpb"] for e in r["test_bpb"] if e["context"] > 32)
                 - next(e["bpb"] for e in r["test_bpb"] if e["context"] == 32) for r in mine]
        variant = document["summary"]["variants"][row["variant"]]
        assert variant["extrapolating_seeds"] == sum(rise <= 0.01 for rise in rises)
        assert variant["extrapolates"] == all(rise <= 0.01 for rise in rises)
    assert (out / "runs" / "seed-1" / "vq" / "metrics.jsonl").exists()


def _run(variant: str, bpb: dict[int, float], carried: float | None = None, seed: int = 0) -> dict:
    return {"variant": variant, "seed": seed, "train_context": 256, "test_bpb_carried": carried, "spec": variant,
            "parameters": 100, "test_tokens": 100, "validation_bpb": bpb[256],
            "test_bpb": [{"context": c, "bpb": b, "tokens": 100} for c, b in bpb.items()]}


def _summary(runs, tolerance=0.01):
    rows = length_extrapolation.aggregate(runs)
    return rows, length_extrapolation.summarize(rows, runs, tolerance=tolerance)


def test_summary_and_conclusions_from_the_numbers():
    runs = [
        _run("softmax", {256: 2.0, 1024: 3.5, 4096: 5.0}),
        _run("softmax-entropy", {256: 2.1, 1024: 2.5, 4096: 3.0}),
        _run("softmax-nope-entropy", {256: 2.2, 1024: 2.205, 4096: 2.1}),
        _run("vq", {256: 2.0, 1024: 1.9, 4096: 1.85}, carried=1.8),
    ]
    rows, summary = _summary(runs)
    variants = summary["variants"]
    assert variants["softmax"]["rise"]["mean"] == pytest.approx(3.0) and variants["softmax"]["extrapolates"] is False
    assert variants["softmax-nope-entropy"]["rise"]["mean"] == pytest.approx(0.005)
    assert variants["softmax-nope-entropy"]["extrapolates"] is True
    assert variants["vq"]["rise"]["mean"] == pytest.approx(-0.1) and variants["vq"]["extrapolates"] is True
    gains = {c: v["gain"] for c, v in summary["entropy_scale"].items()}
    assert gains == pytest.approx({"256": -0.1, "1024": 1.0, "4096": 2.0})
    assert not any(v["resolved"] for v in summary["entropy_scale"].values())  # n = 1: nothing is resolved
    text = length_extrapolation.conclusions(rows, summary)
    assert "up to 4096 at most 0.01 above the bpb at the training context 256): softmax-nope-entropy, vq." in text
    assert "Do not (largest rise): softmax (+3.000), softmax-entropy (+0.900)." in text
    assert "The entropy-invariant scale helps rotary softmax at C=4096: 3.000 bpb with it against 5.000" in text
    assert "+2.000 in its favour, within the spread; -0.100 at the training context, within the spread" in text
    assert "State carried across the whole stream: vq 1.800 (reset every 256: 2.000)." in text
    # a tolerance of 1 bpb lets softmax-entropy through, not softmax
    loose = _summary(runs, tolerance=1.0)[1]["variants"]
    assert [name for name, v in loose.items() if v["extrapolates"]] == ["softmax-entropy", "softmax-nope-entropy", "vq"]


def test_over_seeds_a_variant_extrapolates_at_every_seed_and_gains_resolve_by_range():
    runs = [
        _run("softmax", {256: 2.0, 4096: 5.0}, seed=0), _run("softmax", {256: 2.2, 4096: 4.8}, seed=1),
        _run("softmax-entropy", {256: 2.1, 4096: 3.0}, seed=0), _run("softmax-entropy", {256: 2.3, 4096: 3.2}, seed=1),
        _run("local", {256: 2.5, 4096: 2.505}, seed=0), _run("local", {256: 2.5, 4096: 2.621}, seed=1),
    ]
    rows, summary = _summary(runs)
    local = summary["variants"]["local"]
    # rises 0.005 and 0.121: one of the two seeds extrapolates, so the variant does not
    assert local["extrapolating_seeds"] == 1 and local["extrapolates"] is False and local["n"] == 2
    assert local["rise"]["mean"] == pytest.approx(0.063) and local["rise"]["min"] == pytest.approx(0.005)
    scale = summary["entropy_scale"]
    # at 4096: 4.8-5.0 against 3.0-3.2, disjoint; at 256: 2.0-2.2 against 2.1-2.3, overlapping
    assert scale["4096"]["gain"] == pytest.approx(1.8) and scale["4096"]["resolved"] is True
    assert scale["256"]["gain"] == pytest.approx(-0.1) and scale["256"]["resolved"] is False
    text = length_extrapolation.conclusions(rows, summary)
    assert "at the training context 256, at every seed): none." in text
    assert "local (+0.063; extrapolates at 1 of 2 seeds)" in text
    assert "+1.800 in its favour, resolved; -0.100 at the training context, within the spread" in text
    metadata = {"command": "c", "date": "d", "device_name": "cpu", "threads": 1, "torch_version": "t"}
    table = length_extrapolation.markdown(rows, metadata, summary, runs=len(runs))
    assert "| local | `local` | 100 | 2 | 2.500 ± 0.000 (2.500–2.500) | 2.500 ± 0.000 (2.500–2.500) | " \
           "2.563 ± 0.082 (2.505–2.621) | — | at 1 of 2 seeds (mean rise +0.063) |" in table
    assert "| softmax |  | +1.800 ✓ | " in table  # the matrix at C=4096: softmax minus softmax-entropy, resolved


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
        (["--variants", "softmax-rerope", "--rerope-window", "0"], "--rerope-window"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(args, named, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["repro", "length-extrapolation", "--data", str(corpus), *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and named in err and "Traceback" not in err
    assert not out.exists()


# --- ReRoPE (seed 004): the rotary model read with ReRoPE, and the model trained with it ------


def test_rerope_rows_read_the_rotary_model_with_rerope(corpus, tmp_path, monkeypatch, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "out"
    evaluated = []  # the model evaluate_bpb reads, per call
    original = length_extrapolation.evaluate_bpb

    def recording(model, *args, **kwargs):
        evaluated.append(model)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(length_extrapolation, "evaluate_bpb", recording)
    argv = ["repro", "length-extrapolation", "--quick", "--data", str(corpus), "--variants", "softmax",
            "softmax-rerope", "softmax-rerope-trained", "--steps", "4", "--eval-contexts", "64", "--out", str(out),
            "--no-progress"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    runs = json.loads((out / "results.json").read_text())["runs"]
    # --quick: ReRoPE's window is 16 (half the training context 32)
    assert [(r["variant"], r["spec"], r["evaluation_spec"]) for r in runs] == [
        ("softmax", "softmax", "softmax"), ("softmax-rerope", "softmax", "softmax:rerope=16"),
        ("softmax-rerope-trained", "softmax:rerope=16", "softmax:rerope=16")]
    assert runs[0]["validation_bpb"] == runs[1]["validation_bpb"]  # the same training: the rotary model
    assert "| softmax-rerope | `softmax`, read as `softmax:rerope=16` |" in table
    test = load_corpus(str(corpus)).tokens("test")
    for run in runs:
        trained, _ = load_model(out / "runs" / "seed-0" / run["variant"])
        assert trained.config.attention == run["spec"]
        reader = LM(dataclasses.replace(trained.config, attention=run["evaluation_spec"])).eval()
        reader.load_state_dict(trained.state_dict())
        for entry in run["test_bpb"]:
            assert entry["bpb"] == pytest.approx(_bpb_in_windows(reader, test, entry["context"]), abs=2e-5)
    # what was evaluated: the trained weights, in layers that apply ReRoPE where the row says so
    per_run = len(evaluated) // len(runs)
    for run, model in zip(runs, evaluated[::per_run]):
        trained, _ = load_model(out / "runs" / "seed-0" / run["variant"])
        rerope = None if run["evaluation_spec"] == "softmax" else 16
        assert [layer.mixer.rerope for layer in model.layers] == [rerope] * len(model.layers)
        for name, tensor in trained.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), name
    summary = json.loads((out / "results.json").read_text())["summary"]
    bpb = [{e["context"]: e["bpb"] for e in run["test_bpb"]} for run in runs]
    assert {int(c): g["gain"] for c, g in summary["rerope"].items()} == pytest.approx(
        {c: bpb[0][c] - bpb[1][c] for c in (32, 64)})
    assert "ReRoPE at evaluation" in table


def test_evaluated_model_moves_the_weights_into_rerope_layers():
    """A rotary model read as ``softmax:rerope=W``: the same weights, ReRoPE in every layer, other
    logits (q and k made large enough that positions matter)."""
    args = SimpleNamespace(d_model=32, n_layers=2, n_heads=2, window=16, codebook_size=16, block_size=8, gau_d_k=16)
    model = LM(length_extrapolation.model_config("softmax", args)).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.mixer.q_proj.weight.mul_(30.0)
            layer.mixer.k_proj.weight.mul_(30.0)
    reader = length_extrapolation.evaluated_model(model, "softmax:rerope=2", args)
    assert isinstance(reader, LM) and reader.config == dataclasses.replace(model.config, attention="softmax:rerope=2")
    assert [layer.mixer.rerope for layer in reader.layers] == [2, 2] and not reader.training
    assert all(torch.equal(reader.state_dict()[k], v) for k, v in model.state_dict().items())
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reader(ids)[0] - model(ids)[0]).abs().max() > 1e-3
    assert length_extrapolation.evaluated_model(model, "softmax", args) is model


def test_rerope_conclusion_from_the_numbers():
    runs = [_run("softmax", {256: 2.0, 1024: 3.5, 4096: 5.0}),
            _run("softmax-rerope", {256: 2.05, 1024: 2.2, 4096: 2.3})]
    rows, summary = _summary(runs)
    assert {c: g["gain"] for c, g in summary["rerope"].items()} == pytest.approx(
        {"256": -0.05, "1024": 1.3, "4096": 2.7})
    assert "entropy_scale" not in summary
    text = length_extrapolation.conclusions(rows, summary)
    assert ("ReRoPE at evaluation helps the rotary softmax model at C=4096: 2.300 bpb read with it against 5.000 "
            "without (+2.700 in its favour, within the spread; -0.050 at the training context, within the spread)."
            in text)
    assert "rerope" not in _summary(runs[:1])[1]  # no ReRoPE row, no comparison
