"""``linattn repro linearize --quick``: the teacher is a genuine ``LlamaForCausalLM`` folder that
transformers loads, scored as transformers' own logits score it; every student is converted from it
and fine-tuned with its share of the teacher's tokens; the architectures are trained from scratch with
the teacher's; the gaps, the verdicts and the argument errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from linattn import LM
from linattn.cli import main
from linattn.data import Shards
from linattn.repro import linearize, linearize_report, linearize_teacher
from linattn.train import load_checkpoint

from test_shards import write_plays

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "linearize-teacher.toml"
torch.set_num_threads(1)


def quick(tmp_path: Path, *extra: str) -> list[str]:
    return ["repro", "linearize", "--quick", "--teacher-config", str(CONFIG), "--cache-dir", str(tmp_path / "cache"),
            "--out", str(tmp_path / "out"), "--no-progress", *extra]


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    root = tmp_path_factory.mktemp("linearize")
    write_plays(root / "cache")
    argv = quick(root, "--students", "vq-rerope", "vq-bias", "gated-delta", "--fractions", "0.05", "0.2",
                 "--decode-contexts", "16", "48")
    assert main(argv) == 0
    return root, json.loads((root / "out" / "results.json").read_text())


def _bits_per_byte(model, shards: Shards, context: int, n_tokens: int) -> float:
    """Transformers' logits on windows of ``context`` (each from a fresh start): summed nats of every
    next token over the bytes those tokens stand for, over ln 2."""
    tokens = shards.tokens("validation")[:n_tokens].long()
    lengths = shards.tokenizer.token_bytes()
    nats, n_bytes = 0.0, 0
    with torch.no_grad():
        for start in range(0, tokens.numel() - 1, context):
            window = tokens[start:start + context + 1]
            logits = model(input_ids=window[None, :-1]).logits[0]
            nats += float(F.cross_entropy(logits.double(), window[1:], reduction="sum"))
            n_bytes += int(lengths[window[1:]].sum())
    return nats / n_bytes / math.log(2)


def test_the_teacher_is_a_llama_folder_scored_as_transformers_scores_it(experiment):
    from transformers import AutoModelForCausalLM

    root, results = experiment
    folder = root / "out" / "teachers" / "seed-0"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 32
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    parameters = sum(p.numel() for p in model.parameters())
    teacher = next(run for run in results["runs"] if run["case"] == "teacher")
    assert teacher["parameters"] == parameters == LM.from_hf(folder).num_parameters()
    shards = Shards(root / "out" / "data-bpe300")
    assert teacher["validation_bpb"] == pytest.approx(_bits_per_byte(model, shards, 32, 1024), rel=1e-5)
    assert teacher["tokens"] == 30 * 4 * 32 and set(teacher["decode_ms"]) == {"16", "48"}
    losses = linearize_teacher.teacher_record(folder)["losses"]
    assert losses[-1][0] == 30 and losses[-1][1] < losses[0][1]  # it trained


def test_students_take_their_share_of_the_teachers_tokens_and_report_their_gaps(experiment):
    root, results = experiment
    runs = results["runs"]
    teacher = next(run for run in runs if run["case"] == "teacher")
    converted = [run for run in runs if run["case"] == "converted"]
    assert sorted((run["student"], run["fraction"]) for run in converted) == sorted(
        (name, fraction) for name in ("vq-rerope", "vq-bias", "gated-delta") for fraction in (0.05, 0.2))
    for run in converted:
        steps = max(1, round((run["fraction"] * 3840 - 256) / 128))  # 5%, 20% of 30 x 4 x 32, calibration 256
        folder = root / "out" / "runs" / "seed-0" / f"{run['student']}-{run['fraction']:g}"
        checkpoint = load_checkpoint(folder)
        assert checkpoint.step == steps == run["finetune_steps"] and run["tokens"] == 256 + steps * 128
        assert checkpoint.meta["converted_from"]["to"][0] == linearize.STUDENTS[run["student"]]
        assert run["gap"] == pytest.approx(run["validation_bpb"] - teacher["validation_bpb"])
        assert run["gap_converted"] == pytest.approx(run["validation_bpb_converted"] - teacher["validation_bpb"])
        assert ("decode_ms" in run) == (run["fraction"] == 0.2)
    scratch = {run["student"]: run for run in runs if run["case"] == "scratch"}
    assert set(scratch) == {"vq-rerope", "vq-bias", "gated-delta"}
    for name, run in scratch.items():
        assert load_checkpoint(root / "out" / "runs" / "seed-0" / f"{name}-scratch").step == 30
        assert run["tokens"] == teacher["tokens"]
    page = (root / "out" / "results.md").read_text()
    assert "| teacher | `LlamaForCausalLM` |" in page and "| vq-bias at 20% | `vq-attn:bias` |" in page
    assert "The survey's claim" in page and (root / "out" / "linearize.png").exists()


def test_a_second_invocation_reuses_the_cached_teacher(experiment, monkeypatch, tmp_path):
    root, _ = experiment
    for name in ("teachers", "data-bpe300"):
        shutil.copytree(root / "out" / name, tmp_path / "out" / name)

    def refuse(*args):
        raise AssertionError("the teacher was trained again")

    monkeypatch.setattr(linearize_teacher, "_train_teacher", refuse)
    write_plays(tmp_path / "cache")
    assert main(quick(tmp_path, "--students", "gated-delta", "--fractions", "0.2", "--decode-contexts", "16")) == 0
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert [run["case"] for run in runs] == ["teacher", "converted", "scratch"]


def test_decoding_is_timed_by_a_later_resume_after_no_decode(experiment, monkeypatch, tmp_path):
    """``--no-decode`` leaves the timings out; ``--resume`` without it times them, training nothing again."""
    root, _ = experiment
    for name in ("teachers", "data-bpe300"):
        shutil.copytree(root / "out" / name, tmp_path / "out" / name)
    write_plays(tmp_path / "cache")
    argv = quick(tmp_path, "--students", "gated-delta", "--fractions", "0.2", "--decode-contexts", "16")
    assert main([*argv, "--no-decode"]) == 0
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert [run["case"] for run in runs] == ["teacher", "converted", "scratch"]
    assert not any("decode_ms" in run for run in runs)

    def refuse(*args, **kwargs):
        raise AssertionError("a run was trained again")

    monkeypatch.setattr(linearize, "train", refuse)
    monkeypatch.setattr(linearize, "convert_linear", refuse)
    assert main([*argv, "--resume"]) == 0
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert [run["case"] for run in runs] == ["teacher", "converted", "scratch"]
    assert [set(run.get("decode_ms", ())) for run in runs] == [{"16"}, {"16"}, set()]
    page = (tmp_path / "out" / "results.md").read_text()
    assert "decoding" in page.lower()

def _row(case, student, fraction, bpb, seeds=(0, 1), converted=None, share=None):
    return [{"case": case, "student": student, "fraction": fraction, "spec": student, "parameters": 1, "tokens": 1,
             "token_share": share if share is not None else fraction, "seed": seed, "validation_bpb": value,
             **({"validation_bpb_converted": converted[i]} if converted else {})}
            for i, (seed, value) in enumerate(zip(seeds, bpb))]


def test_verdicts_from_the_numbers():
    runs = [*_row("teacher", "teacher", None, [2.00, 2.02], share=1.0),
            *_row("converted", "vq-rerope", 0.05, [2.03, 2.05], converted=[2.5, 2.6]),
            *_row("converted", "vq-bias", 0.05, [2.20, 2.21], converted=[3.0, 3.1]),
            *_row("converted", "vq-rerope", 0.2, [2.01, 2.03], converted=[2.5, 2.6]),
            *_row("converted", "vq-bias", 0.2, [2.00, 2.02], converted=[3.0, 3.1]),
            *_row("scratch", "vq-rerope", None, [2.10, 2.12], share=1.0)]
    rows = linearize_report.aggregate(linearize_report.with_gaps(runs))
    summary = linearize_report.summarize(rows)
    assert summary["best"]["student"] == "vq-rerope" and summary["best"]["fraction"] == 0.05
    assert summary["best"]["gap"]["mean"] == pytest.approx(0.03) and summary["best"]["within"] is True
    scratch = summary["against_scratch"]["vq-rerope"]["0.05"]
    assert scratch["difference"] == pytest.approx(-0.07) and scratch["resolved"] is True
    survey = summary["survey"]
    assert survey["0.05"]["finetuned"]["difference"] == pytest.approx(0.165)
    assert survey["0.05"]["finetuned"]["resolved"] and not survey["0.2"]["finetuned"]["resolved"]
    assert survey["0.2"]["finetuned"]["difference"] == pytest.approx(-0.01)
    text = linearize_report.conclusions(summary)
    assert "Target 1 (a student within 0.05 bpb of the teacher with at most 5% of its tokens) holds: the best, " \
           "vq-rerope with 5.0% of them, is +0.030 bpb from the teacher." in text
    assert "Target 2 (ahead of its architecture trained from scratch with the teacher's tokens) holds for it: " \
           "-0.070 bpb against scratch (resolved)." in text
    assert "VQ with ReRoPE beats VQ with the bias) holds at 1 of 2 fractions" in text
    assert "5%: +0.165 (resolved); 20%: -0.010 (within the spread); right after conversion +0.500 (resolved)" in text
    worse = [{**run, "validation_bpb": run["validation_bpb"] + 0.1} if run["case"] == "converted" else run
             for run in runs]
    summary = linearize_report.summarize(linearize_report.aggregate(linearize_report.with_gaps(worse)))
    assert summary["best"]["within"] is False
    assert "(a student within 0.05 bpb of the teacher with at most 5% of its tokens) does not hold" in \
        linearize_report.conclusions(summary)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--fractions", "1.5"], "--fractions"),
        (["--fractions", "0"], "--fractions"),
        (["--students", "vq"], "--students"),
        (["--jobs", "2"], "--jobs must be 1"),
        (["--teacher-config", "missing.toml"], "--teacher-config missing.toml: no such file"),
        (["--hybrid", "vq"], "layer 0 would become 'vq'"),
    ],
)
def test_bad_arguments_exit_2_naming_them(extra, named, tmp_path, capsys):
    argv = quick(tmp_path, *extra)
    if "--teacher-config" in extra:
        del argv[3:5]  # the test's own --teacher-config out
    write_plays(tmp_path / "cache")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_decode_timing_generates_untimed_first(monkeypatch):
    """What a process does once (the native token loop's self-check at its first use) is not
    counted: a short generation comes before the timed one, and the clock starts after it."""
    from linattn import LMConfig

    model = LM(LMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, attention="gated-delta"))
    events = []
    original = LM.generate

    def recorded(self, prompt_ids, max_new_tokens, **kwargs):
        events.append(("generate", prompt_ids.shape[1], max_new_tokens, kwargs.get("state") is not None))
        return original(self, prompt_ids, max_new_tokens, **kwargs)

    clock = iter(range(100))
    monkeypatch.setattr(LM, "generate", recorded)
    monkeypatch.setattr(linearize_teacher.time, "perf_counter", lambda: events.append(("clock",)) or next(clock))
    linearize_teacher.decode_ms_per_token(model, torch.randint(0, 32, (1, 20)), 5)
    assert events[0] == ("generate", 8, 4, False)  # the warm-up: the prompt's first tokens, no state
    assert events[1:] == [("clock",), ("generate", 1, 5, True), ("clock",)]
