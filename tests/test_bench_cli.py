"""The benchmark harness, ``linattn bench attention``, ``decode`` and ``train`` end to end at
tiny sizes, and the ``--device`` every benchmark takes (the runs on CUDA: test_bench_cuda.py)."""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linattn import __version__
from linattn._checks import available_device_name
from linattn.bench import attention
from linattn.bench.attention import CASES, default_cases
from linattn.bench.cli import report_page
from linattn.bench import decode
from linattn.bench.decode import DECODE_CASES, MODEL_SPECS
from linattn.bench.lm_config import DEFAULT_MODELS as LM_DEFAULT_MODELS, QUICK as LM_QUICK, LMBenchConfig
from linattn.models.sizes import count_parameters
from linattn.bench.harness import Case, profile_call, run_cases, time_call
from linattn.reporting import peak_memory
from linattn.cli import main
from _helpers import english_like

MIB = 2**20
ROW_KEYS = {
    "case", "label", "length", "forward_s", "forward_times_s", "forward_peak_bytes", "forward_backward_s",
    "forward_backward_times_s", "forward_backward_peak_bytes", "skip_reason", "backward_skip_reason",
    "forward_profile", "forward_backward_profile",
}
PLOTS = ("forward_time.png", "forward_backward_time.png", "peak_memory.png")


def _load(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def test_bench_attention_writes_json_markdown_and_plots(tmp_path, capsys):
    args = ["bench", "attention", "--lengths", "64", "128", "--repeats", "1", "--warmup", "0", "--threads", "1",
            "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| case | T |" in printed and "targets:" in printed
    assert "warning: --warmup 0" in printed  # cold first calls are flagged

    result = _load(tmp_path)
    assert result["summary"]["warning"].startswith("--warmup 0")
    assert set(result) == {"metadata", "rows", "summary"}
    meta = result["metadata"]
    for key in ("torch_version", "device", "threads", "date", "command", "shapes"):
        assert key in meta
    assert meta["torch_version"] == torch.__version__ and meta["threads"] == 1
    assert meta["command"].startswith("linattn bench attention --lengths 64 128")
    expected_shapes = {"batch": 1, "heads": 8, "dim": 64, "dtype": "float32", "causal": True, "lengths": [64, 128]}
    assert meta["shapes"] == expected_shapes

    rows = result["rows"]
    cases = default_cases("cpu")
    assert set(CASES) - set(cases) == {"vq-b128-triton"}  # CUDA only
    assert sorted((r["case"], r["length"]) for r in rows) == sorted((c, t) for c in cases for t in (64, 128))
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["forward_profile"] is None and row["forward_backward_profile"] is None  # no --profile
        assert row["skip_reason"] is None
        assert row["forward_s"] > 0 and len(row["forward_times_s"]) == 1
        assert row["forward_peak_bytes"] >= 0
        if row["case"] == "reference":
            assert row["forward_backward_s"] is None and row["backward_skip_reason"] == "forward only"
        else:
            assert row["forward_backward_s"] > 0 and row["forward_backward_peak_bytes"] >= 0

    summary = result["summary"]
    assert summary["linear_elu_vs_sdpa"]["length"] == 128
    assert summary["linear_elu_vs_sdpa"]["forward_speedup"] > 0
    assert summary["linear_elu_growth"]["from_length"] == 64 and summary["linear_elu_growth"]["to_length"] == 128
    assert summary["tiled_vs_reference_forward_memory"]["length"] == 128

    table = (tmp_path / "results.md").read_text()
    assert "sdpa/case fwd" in table
    assert "\n```text\ntargets:" in table  # a fence with a language (tools/doc_snippets.py)
    for case in default_cases("cpu"):
        assert f"| {case} | 64 |" in table and f"| {case} | 128 |" in table
    assert report_page(tmp_path) == table  # the page again, from results.json alone
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_console_script_runs_a_selected_case(tmp_path):
    script = Path(sys.executable).parent / "linattn"
    assert script.exists(), f"the linattn console script is not installed next to {sys.executable} (run `make test`)"
    command = [str(script), "bench", "attention", "--lengths", "32", "--cases", "sdpa", "linear-elu",
               "--repeats", "1", "--warmup", "0", "--threads", "1", "--out", str(tmp_path), "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| linear-elu | 32 |" in done.stdout
    rows = _load(tmp_path)["rows"]
    assert [(r["case"], r["length"]) for r in rows] == [("sdpa", 32), ("linear-elu", 32)]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["bench", "attention", "--cases", "no-such-case"], "--cases"),
        (["bench", "attention", "--lengths", "64", "-8"], "--lengths"),
        (["bench", "attention", "--repeats", "0"], "--repeats"),
        (["bench", "attention", "--profile", "0"], "--profile"),
        (["no-such-command"], "COMMAND"),
        (["bench", "no-such-benchmark"], "BENCHMARK"),
        (["bench"], "BENCHMARK"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(args, named, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error:" in err and named in err


def _no_cuda(monkeypatch) -> None:
    """Make this process see no CUDA device, as on a CPU-only machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


NO_CUDA = "'cuda' requested but torch.cuda.is_available() is False"


@pytest.mark.parametrize("benchmark", ["attention", "decode", "lm", "train"])
def test_cuda_device_is_refused_at_argument_time_without_cuda(benchmark, monkeypatch, tmp_path, capsys):
    _no_cuda(monkeypatch)
    assert main(["bench", benchmark, "--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"linattn bench {benchmark}: error: argument --device: {NO_CUDA}" in err
    assert "Traceback" not in err and not any(tmp_path.iterdir())


def test_device_argument_names_the_cuda_devices_there_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [available_device_name(text) for text in ("cpu", "cuda", "cuda:1")] == ["cpu", "cuda", "cuda:1"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"'cuda:2' requested but torch.cuda.device_count\(\) is 2"):
        available_device_name("cuda:2")
    with pytest.raises(argparse.ArgumentTypeError, match="expected a device \\(cpu, cuda or cuda:N\\), got 'gpu'"):
        available_device_name("gpu")


def test_library_refuses_cuda_without_cuda(monkeypatch, tmp_path):
    """The Python entry point checks too (a config built without the command line)."""
    _no_cuda(monkeypatch)
    with pytest.raises(ValueError, match=re.escape(f"device {NO_CUDA}")):
        attention.run(attention.AttentionBenchConfig(lengths=(8,), device="cuda"), out_dir=tmp_path, command="x")
    assert not any(tmp_path.iterdir())


def test_cuda_only_case_is_refused_on_cpu(tmp_path, capsys):
    args = ["bench", "attention", "--cases", "vq-b128-triton", "--lengths", "8", "--out", str(tmp_path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("linattn: error: ") and "vq-b128-triton" in err and "CUDA only" in err
    assert "Traceback" not in err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out


def test_time_call_runs_warmup_then_repeats():
    calls = []
    times = time_call(lambda: calls.append(1), repeats=3, warmup=2, device="cpu")
    assert len(calls) == 5 and len(times) == 3 and all(t >= 0 for t in times)


def _ones(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4, dtype=torch.float32)  # written, so resident


def test_peak_memory_sees_an_allocation_once():
    assert peak_memory(lambda: None, "cpu") is not None, "peak memory needs /proc (Linux)"
    assert peak_memory(lambda: _ones(64 * MIB), "cpu") >= 60 * MIB

    def allocate_free_allocate():
        first = _ones(64 * MIB)
        del first
        return _ones(64 * MIB)

    assert 60 * MIB <= peak_memory(allocate_free_allocate, "cpu") < 100 * MIB

    held = _ones(64 * MIB)  # allocated before the call: part of the baseline, not of the peak
    assert peak_memory(lambda: held.sum(), "cpu") < 16 * MIB


def test_runner_skips_over_max_length_and_after_out_of_memory():
    def attend(q, k, v):
        if q.shape[2] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
        return q + k + v

    cases = [
        Case("oom", "fails above T=8", attend),
        Case("short", "limited", lambda q, k, v: q * v, max_length=8, max_length_note="too long"),
        Case("fwd-only", "no backward", lambda q, k, v: q - v, supports_backward=False),
    ]
    rows = run_cases(cases, [4, 16, 32], lambda t: tuple(torch.randn(1, 2, t, 4) for _ in range(3)),
                     repeats=1, warmup=0, device="cpu", progress=False)
    by_key = {(r["case"], r["length"]): r for r in rows}
    assert by_key["oom", 4]["forward_s"] > 0 and by_key["oom", 4]["forward_backward_s"] > 0
    assert by_key["oom", 16]["skip_reason"].startswith("out of memory: CUDA out of memory")
    assert "skipped after out of memory" in by_key["oom", 32]["skip_reason"]
    assert by_key["short", 16]["skip_reason"] == "T=16 > max length 8 (too long)"
    assert by_key["fwd-only", 32]["forward_s"] > 0 and by_key["fwd-only", 32]["forward_backward_s"] is None


def test_speedups_view_gives_time_and_ratio_per_length_and_pass():
    """The ``speedups`` table of the documentation: a case's label per row, ``ms (baseline /
    case)`` per measured (length, pass), the baseline without a ratio, "—" where not measured."""
    def row(case, length, forward, backward):
        return {"case": case, "label": f"{case} label", "length": length, "forward_s": forward,
                "forward_backward_s": backward}

    rows = [row("sdpa", 8, 0.040, 0.120), row("sdpa", 16, 0.160, None), row("fast", 8, 0.010, 0.008),
            row("fast", 16, 0.0125, None), row("slow", 8, 0.080, None)]
    text = attention.VIEWS["speedups"]({"rows": rows, "metadata": {"baseline": "sdpa"}}, cases="fast,sdpa,slow")
    assert text.splitlines() == [
        "| case | T=8 forward | T=8 forward+backward | T=16 forward |",  # no forward+backward at 16
        "| --- | --- | --- | --- |",
        f"| fast label | 10 ms ({0.040 / 0.010:.2f}x) | 8 ms ({0.120 / 0.008:.1f}x) "
        f"| 12.5 ms ({0.160 / 0.0125:.1f}x) |",
        "| sdpa label | 40 ms | 120 ms | 160 ms |",
        f"| slow label | 80 ms ({0.040 / 0.080:.2f}x) | — | — |",
    ]
    assert attention.VIEWS["speedups"]({"rows": rows, "metadata": {"baseline": "sdpa"}}, cases="fast",
                                       lengths="16", baseline="fast").splitlines()[2] == "| fast label | 12.5 ms |"
    for options, message in (({"cases": "nope"}, r"cases \['nope'\] not measured"),
                             ({"lengths": "32"}, r"lengths \[32\] not measured"), ({"lengths": "x"}, "integers")):
        with pytest.raises(ValueError, match=message):
            attention.VIEWS["speedups"]({"rows": rows, "metadata": {"baseline": "sdpa"}}, **options)


def test_bench_decode_writes_rows_and_growth(tmp_path):
    assert main(["bench", "decode", "--contexts", "32", "64", "--tokens", "2", "--models", "--device", "cpu", "--out",
                 str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["metadata"]["device"] == "cpu"
    cases = {row["case"] for row in result["rows"]}
    assert cases == set(DECODE_CASES) >= {"vq-b128", "linear-elu", "delta", "decay-scalar", "decay-channel",
                                          "gated-delta", "sdpa-kvcache"}
    assert all(row["per_token_s"] > 0 and len(row["times_s"]) == 2 for row in result["rows"])
    ops = result["summary"]["ops"]
    assert set(ops) == cases and all(s["growth"] > 0 for s in ops.values())
    text = (tmp_path / "results.md").read_text()
    assert "per-token time" in text and f"on cpu ({result['metadata']['device_name']})" in text
    assert report_page(tmp_path) == text  # the page again, from results.json alone


def test_decode_cases_take_turns_and_keep_their_own_states():
    """Several cases measured together: every (case, context) gets its timed steps."""
    rows = decode.measure(["vq-b128", "vq-b128-two-calls", "linear-elu"], [16, 40], heads=2, dim=8, tokens=5)
    assert {(r["case"], r["context"]) for r in rows} == {
        (c, n) for c in ("vq-b128", "vq-b128-two-calls", "linear-elu") for n in (16, 40)}
    assert all(len(r["times_s"]) == 5 and r["per_token_s"] > 0 for r in rows)


def test_decode_rounds_pool_the_generation_steps():
    row = {"kind": "model", "case": "vq", "prompt": 9, "batch": 2, "parameters": 1, "new_tokens": 3}
    first = dict(row, prefill_s=4.0, steps_s=[0.1, 0.1, 0.1], products_ms=20.0)
    second = dict(row, prefill_s=2.0, steps_s=[0.3, 0.3, 0.3, 0.3], products_ms=40.0)
    other = dict(row, case="softmax", prefill_s=1.0, steps_s=[0.2], tokens_per_s=10.0)
    pooled = {r["case"]: r for r in decode.pool_rounds([first, other, second])}
    assert pooled["softmax"] == other  # one round: as it was
    vq = pooled["vq"]
    assert vq["rounds"] == 2 and vq["steps_s"] == [0.1] * 3 + [0.3] * 4
    assert vq["tokens_per_s"] == pytest.approx(2 / 0.3) and vq["ms_per_step"] == pytest.approx(300)
    assert vq["prefill_s"] == pytest.approx(3.0) and vq["prefill_tokens_per_s"] == pytest.approx(2 * 8 / 3.0)
    assert vq["mean_tokens_per_s"] == pytest.approx(2 * 7 / 1.5)
    assert vq["products_ms"] == pytest.approx(30.0) and vq["over_products"] == pytest.approx(300 / 30.0)


def test_bench_decode_rounds_from_the_command_line(tmp_path):
    assert main(["bench", "decode", "--cases", "--models", "vq", "softmax", "--prompts", "8", "--batches", "1",
                 "--new-tokens", "2", "--rounds", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert [(r["case"], r["rounds"]) for r in result["rows"]] == [("vq", 2), ("softmax", 2)]
    assert all(r["generate_s"] > 0 and r["mean_tokens_per_s"] == pytest.approx(4 / r["generate_s"])
               for r in result["rows"])  # 2 rounds of 2 tokens, batch 1
    assert "2 rounds in alternating order" in (tmp_path / "results.md").read_text()


def test_bench_decode_models_at_equal_size(tmp_path):
    """Every model generates the asked tokens at every prompt and batch; sizes are matched."""
    assert main(["bench", "decode", "--cases", "--models", *MODEL_SPECS, "--prompts", "8", "40", "--batches", "1", "2",
                 "--new-tokens", "3", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["rows"]
    assert {(r["case"], r["prompt"], r["batch"]) for r in rows} == {
        (m, p, b) for m in MODEL_SPECS for p in (8, 40) for b in (1, 2)}
    assert {"retnet", "gla", "gated-delta", "hedgehog", "dpfp", "taylor", "favor", "local-vq",
            "vq-attn", "vq-rerope", "vq-fsq", "soft-vq"} <= set(MODEL_SPECS)
    assert all(r["tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0 and r["new_tokens"] == 3 for r in rows)
    sizes = {r["case"]: r["parameters"] for r in rows}
    assert all(abs(size / sizes["softmax"] - 1) < 0.01 for size in sizes.values()), sizes  # each within 1% of softmax
    assert set(result["summary"]["models"]) == {"vq_over_softmax_batch1", "vq_over_softmax_batch2",
                                                "over_products_batch1", "over_products_batch2"}
    assert all(0 < r["products_ms"] and r["over_products"] == pytest.approx(r["ms_per_step"] / r["products_ms"])
               for r in rows)
    assert (tmp_path / "generation.png").stat().st_size > 0
    assert "generated tokens/s" in (tmp_path / "results.md").read_text()
    assert "each measured alone" in (tmp_path / "results.md").read_text()
    assert report_page(tmp_path) == (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("config, tolerance", [(LMBenchConfig(), 0.01), (LM_QUICK, 0.03)], ids=["default", "quick"])
def test_bench_lm_models_have_equal_parameter_counts(config, tolerance):
    """Every default model of ``bench lm`` (the gated kinds' extra projections paid for by a
    narrower SwiGLU) lies within 1% of the softmax model's parameter count (3% for the
    quick models, where one step of 8 in the SwiGLU width is 5% of the count)."""
    counts = {spec: count_parameters(config.model_config(spec)) for spec in LM_DEFAULT_MODELS}
    assert {"retnet", "gla", "gated-delta"} <= set(counts)
    assert max(abs(n / counts["softmax"] - 1) for n in counts.values()) < tolerance, counts


def test_profile_call_names_the_operators_that_take_the_time():
    a, b = torch.randn(300, 300), torch.randn(300, 300)

    def work():
        for _ in range(5):
            a @ b  # far more time than the one small exp
        torch.exp(a[:2])

    profile = profile_call(work, device="cpu", top=2)
    assert len(profile["ops"]) == 2
    top = profile["ops"][0]
    assert top["op"] == "aten::mm" and top["calls"] == 5
    assert profile["ops"][0]["self_ms"] >= profile["ops"][1]["self_ms"] > 0
    assert 0.5 < top["share"] <= 1 and sum(op["share"] for op in profile["ops"]) <= 1 + 1e-9
    assert profile["total_ms"] >= sum(op["self_ms"] for op in profile["ops"])
    with pytest.raises(ValueError, match="top must be a positive int"):
        profile_call(work, device="cpu", top=0)


def _is_profiled_operator(name: str, *, backward: bool) -> bool:
    """An ATen operator, or an autograd Function of linattn's native kernels (``_Scan``: the
    profiler lists it by its class name, the kernel's time its self time); in a backward pass also
    an autograd node (``TrilBackward0``, or ``torch::autograd::CopySlices`` for an in-place write
    into a view), which the profiler lists with its own self time."""
    return (name.startswith("aten::") or re.fullmatch(r"_[A-Z]\w*", name) is not None
            or (backward and (re.search(r"Backward\d*$", name) is not None or name.startswith("torch::autograd::"))))


def test_bench_attention_profile_writes_the_top_operators(tmp_path):
    args = ["bench", "attention", "--lengths", "32", "--cases", "sdpa", "linear-elu", "--repeats", "1",
            "--warmup", "0", "--profile", "3", "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    rows = _load(tmp_path)["rows"]
    for row in rows:
        for key in ("forward_profile", "forward_backward_profile"):
            ops = row[key]["ops"]
            assert 1 <= len(ops) <= 3
            assert all(_is_profiled_operator(op["op"], backward=key != "forward_profile") for op in ops), ops
            assert [op["self_ms"] for op in ops] == sorted((op["self_ms"] for op in ops), reverse=True)
    sdpa = next(r for r in rows if r["case"] == "sdpa")
    assert any("scaled_dot_product" in op["op"] or "attention" in op["op"] for op in sdpa["forward_profile"]["ops"])
    text = (tmp_path / "profile.md").read_text()
    assert "linattn bench attention" in text
    for case in ("sdpa", "linear-elu"):
        for name in ("forward", "forward+backward"):
            assert f"### {case}, T=32, {name}:" in text
    assert "| operator | self ms | share | calls |" in text


def _run_file(tmp_path: Path, device: str) -> Path:
    """A tiny run file training on ``device``."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(english_like(4000))
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\nattention = "linear:elu"\nd_model = 16\nn_layers = 1\nn_heads = 2\n\n'
                      f'[train]\ndata = "{corpus}"\nbatch_size = 2\ncontext = 16\ndevice = "{device}"\n')
    return config


def test_bench_train_times_the_trainer_after_its_warm_up(tmp_path, monkeypatch, capsys):
    """``bench train`` runs the trainer on the run file's model and data and reports the
    median of the steps after the warm-up (the compiled mode is the trainer's
    ``train.compile``, tested in test_train_units; here only eager, for time). ``--device
    cpu`` overrides the run file's CUDA device, which this process cannot see."""
    _no_cuda(monkeypatch)
    config = _run_file(tmp_path, "cuda")
    argv = ["bench", "train", "--config", str(config), "--modes", "eager", "--steps", "4", "--warmup", "1",
            "--set", "train.batch_size=3", "--device", "cpu", "--threads", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    result = _load(tmp_path / "out")
    assert result["metadata"]["device"] == "cpu" and result["metadata"]["shapes"]["train"]["device"] == "cpu"
    (row,) = result["rows"]
    assert row["case"] == "eager" and row["steps"] == 4 and row["tokens_per_step"] == 3 * 16  # --set applied
    assert row["step_s"] > 0 and row["tokens_per_s"] == pytest.approx(48 / row["step_s"])
    assert row["warmup_s"] > 0 and math.isfinite(row["last_loss"]) and len(row["losses"]) == 4
    assert row["step_s"] == sorted(row["step_times_s"][1:])[1]  # the median of steps 2..4
    text = (tmp_path / "out" / "results.md").read_text()
    assert "| eager |" in text and f"on cpu ({result['metadata']['device_name']}): linear:elu" in text
    assert report_page(tmp_path / "out") == text  # the page again, from results.json alone
    assert main([*argv[:-2], "--warmup", "4", "--out", str(tmp_path / "other")]) == 2
    assert "--warmup (4) must be smaller than --steps (4)" in capsys.readouterr().err


def test_bench_train_layouts_run_the_trainer_in_several_processes(tmp_path, monkeypatch, capsys):
    """``--layouts single ddp:2``: a row per layout (and mode); the DDP row comes from rank 0 of
    2 spawned processes and counts both processes' tokens per step. A malformed layout is an
    argument error."""
    _no_cuda(monkeypatch)
    argv = ["bench", "train", "--config", str(_run_file(tmp_path, "cpu")), "--modes", "eager", "--steps", "3",
            "--warmup", "1", "--threads", "1", "--layouts", "single", "ddp:2", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    rows = _load(tmp_path / "out")["rows"]
    assert [(r["layout"], r["processes"], r["parallel"], r["case"]) for r in rows] == [
        ("single", 1, None, "eager"), ("ddp:2", 2, "ddp", "eager")]
    assert [r["tokens_per_step"] for r in rows] == [2 * 16, 2 * 2 * 16]
    assert all(len(r["losses"]) == 3 and r["tokens_per_s"] > 0 for r in rows)
    text = (tmp_path / "out" / "results.md").read_text()
    assert "| single | eager |" in text and "| ddp:2 | eager |" in text
    for bad in ("ddp:1", "zero:2", "fsdp"):
        assert main([*argv[:-5], "--layouts", bad, "--out", str(tmp_path / "bad")]) == 2
        assert "expected 'single', 'ddp:N' or 'fsdp:N' with N >= 2 processes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # the run file's device, then --set's: library errors before any process starts
        ([], f"train.device {NO_CUDA}"),
        (["--set", "train.device=cpu", "--set", "train.device=cuda"], f"train.device {NO_CUDA}"),
        (["--set", "train.device=cpu", "--device", "cuda:0"], "argument --device: 'cuda:0' requested but"),
        (["--set", "train.device=cuda", "--device", "cpu"],
         "--device cpu and --set train.device=cuda disagree; give the device once"),
    ],
)
def test_bench_train_device_from_the_run_file_set_or_flag(args, message, tmp_path, monkeypatch, capsys):
    _no_cuda(monkeypatch)
    argv = ["bench", "train", "--config", str(_run_file(tmp_path, "cuda")), "--modes", "eager", "--steps", "2",
            "--warmup", "1", *args, "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
