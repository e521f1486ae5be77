"""``linattn bench lm`` end to end at tiny sizes, its memory budget, profile and target summary."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from linattn.bench import lm, lm_measure, lm_report
from linattn.bench.lm_config import LMBenchConfig
from linattn.bench.cli import report_page
from linattn.bench.harness import Measurement
from linattn.cli import main
from linattn.models._vq_generation import VQGeneration
from linattn.models import LM, LMConfig
from linattn.models.config import matched_gau_value_width
from _helpers import head_fields

ROW_KEYS = {
    "case", "label", "parameters", "threads", "context", "batch", "tokens_per_step", "train_s", "train_times_s",
    "train_tokens_per_s", "train_peak_bytes", "prefill_s", "prefill_times_s", "prefill_tokens_per_s",
    "prefill_peak_bytes", "decode_ms_per_token", "decode_times_s", "skip_reason", "profile",
}
TINY = ["--contexts", "16", "32", "--tokens-per-step", "64", "--repeats", "2", "--warmup", "0", "--decode-tokens", "3",
        "--threads", "1"]


def _config(**changes) -> LMBenchConfig:
    base = dict(contexts=(16, 32, 64), tokens_per_step=64, d_model=16, n_heads=2, gau_d_k=8, codebook_size=8,
                block_size=8, window=8, repeats=1, warmup=0, decode_tokens=2)
    return LMBenchConfig(**{**base, **changes})


def test_bench_lm_end_to_end(tmp_path, capsys):
    models = ["softmax", "local,local,vq"]
    assert main(["bench", "lm", "--quick", "--models", *models, *TINY, "--device", "cpu", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "targets:" in printed and "| `softmax` |" in printed

    result = json.loads((tmp_path / "results.json").read_text())
    meta = result["metadata"]
    assert meta["command"].startswith("linattn bench lm --quick --models softmax local,local,vq")
    assert meta["shapes"]["tokens_per_step"] == 64 and meta["shapes"]["d_model"] == 32
    assert meta["device"] == "cpu" and meta["shapes"]["device"] == "cpu"
    assert meta["shapes"]["dtype"] == "float32" and meta["shapes"]["autocast"] is False
    rows = result["rows"]
    assert [(r["case"], r["context"]) for r in rows] == [(m, c) for m in models for c in (16, 32)]
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["skip_reason"] is None and row["profile"] is None
        assert row["threads"] == 1  # each model's own process runs with --threads
        # equal tokens per step: batch = 64 / C
        assert row["batch"] == 64 // row["context"] and row["tokens_per_step"] == 64
        assert len(row["train_times_s"]) == 2 and len(row["prefill_times_s"]) == 2
        assert row["train_s"] == statistics.median(row["train_times_s"])
        assert row["train_tokens_per_s"] == pytest.approx(64 / row["train_s"])
        assert row["prefill_tokens_per_s"] == pytest.approx(64 / row["prefill_s"])
        assert len(row["decode_times_s"]) == 3
        assert row["decode_ms_per_token"] == pytest.approx(1e3 * statistics.median(row["decode_times_s"]))
        assert row["train_peak_bytes"] >= 0 and row["prefill_peak_bytes"] >= 0
    sizes = {}
    for spec in models:
        # --quick's model: d_model 32, 3 layers, 2 heads; VQ d_k 16, 16 codes, block 16; window 32
        config = LMConfig(attention=spec, d_model=32, n_layers=3, gau_d_k=16, codebook_size=16, block_size=16,
                          local_window=32, gau_d_v=matched_gau_value_width(32, 16), **head_fields(spec, n_heads=2))
        sizes[spec] = LM(config).num_parameters()
        assert {r["parameters"] for r in rows if r["case"] == spec} == {sizes[spec]}
    assert max(sizes.values()) / min(sizes.values()) < 1.05, sizes  # equal parameter counts
    assert result["summary"]["parameters"] == sizes

    table = (tmp_path / "results.md").read_text()
    assert f"Whole models on cpu ({meta['device_name']}), float32," in table
    for row in rows:
        assert (f"| `{row['case']}` | {row['parameters']:,} | {row['context']} | {row['batch']} | "
                f"{row['train_tokens_per_s']:,.0f} |") in table
    assert "\n```text\ntargets:" in table  # a fence with a language (tools/doc_snippets.py)
    assert report_page(tmp_path) == table  # the page again, from results.json alone
    for name in ("throughput.png", "decode.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "profile.md").exists()


def test_rounds_alternate_the_models_and_pool_their_calls(monkeypatch, tmp_path):
    """``--rounds 3``: every model measured three times in a fresh process each, in the
    order A B, B A, A B; a row pools the timed calls of its rounds and takes their median; a
    context skipped in any round is skipped."""
    order = []

    def fake_measure(fn, spec, config, threads):
        order.append(spec)
        round_index = order.count(spec)
        rows = []
        for context in config.contexts:
            row = lm_measure.empty_row(spec, 100, context, config.batch(context))
            base = 0.1 * round_index + (0.01 if spec == "softmax" else 0.02)
            times = [base, base + 0.001]
            row.update(train_times_s=times, train_s=statistics.median(times), train_peak_bytes=10 * round_index,
                       prefill_times_s=times, prefill_s=statistics.median(times), prefill_peak_bytes=5,
                       decode_times_s=[base], decode_ms_per_token=base * 1e3)
            row["train_tokens_per_s"] = row["tokens_per_step"] / row["train_s"]
            row["prefill_tokens_per_s"] = row["tokens_per_step"] / row["prefill_s"]
            if spec == "vq" and context == 32 and round_index == 2:
                row["skip_reason"] = "out of memory"
            rows.append(row)
        return rows

    monkeypatch.setattr(lm, "in_fresh_process", fake_measure)
    result = lm.run(_config(contexts=(16, 32), rounds=3), ["softmax", "vq"], out_dir=tmp_path, command="x")
    assert order == ["softmax", "vq", "vq", "softmax", "softmax", "vq"]
    rows = {(r["case"], r["context"]): r for r in result["rows"]}
    assert len(rows) == len(result["rows"]) == 4
    pooled = rows[("softmax", 16)]
    expected = [0.11, 0.111, 0.21, 0.211, 0.31, 0.311]
    assert pooled["train_times_s"] == pytest.approx(expected)
    assert pooled["train_s"] == pytest.approx(statistics.median(expected))
    assert pooled["train_tokens_per_s"] == pytest.approx(pooled["tokens_per_step"] / statistics.median(expected))
    assert pooled["train_peak_bytes"] == 30
    assert pooled["decode_ms_per_token"] == pytest.approx(1e3 * statistics.median([0.11, 0.21, 0.31]))
    assert rows[("vq", 32)]["skip_reason"] == "out of memory"
    assert rows[("vq", 16)]["skip_reason"] is None
    page = (tmp_path / "results.md").read_text()
    assert "3 rounds in alternating order, the timed calls pooled" in page
    with pytest.raises(ValueError, match="rounds"):
        _config(rounds=0)


def test_memory_budget_and_out_of_memory_skip_contexts(monkeypatch):
    """Every timed call is replaced by one whose peak memory is 64,000 bytes (2,000 per token at
    C=16 with 32 tokens per step); the budget of 100,000 bytes fits 32 tokens, not 128."""
    peaks = []

    def fixed_peak(call, *, repeats, warmup, device):
        call()
        peaks.append(64_000)
        return Measurement(0.5, (0.5,), 64_000)

    monkeypatch.setattr(lm_measure, "measure", fixed_peak)
    rows = lm_measure.measure_model("linear:elu", _config(memory_gb=1e-4, contexts=(16, 32, 128), tokens_per_step=32))
    first, second, third = rows
    assert [row["skip_reason"] for row in (first, second)] == [None, None]
    assert second["batch"] == 1 and second["train_tokens_per_s"] == 32 / 0.5 and second["decode_ms_per_token"] > 0
    assert third["tokens_per_step"] == 128 and third["batch"] == 1  # C above the tokens per step: one window
    assert third["skip_reason"] == ("estimated training-step memory 0.000256 GB (2,000 bytes per token at C=16) "
                                    "> --memory-gb 0.0001")
    assert third["train_s"] is None and third["decode_ms_per_token"] is None
    assert len(peaks) == 4  # training and prefill at C=16 and C=32

    def out_of_memory_at_32(call, *, repeats, warmup, device):
        if len(peaks) >= 4 + 2:
            return Measurement(failure="out of memory: no more")
        peaks.append(0)
        return Measurement(0.5, (0.5,), 0)

    monkeypatch.setattr(lm_measure, "measure", out_of_memory_at_32)
    rows = lm_measure.measure_model("linear:elu", _config(contexts=(16, 32, 128), tokens_per_step=32))
    assert [row["skip_reason"] for row in rows] == [
        None, "out of memory: no more", "skipped after out of memory: no more at C=32"]


def test_bfloat16_runs_every_forward_under_autocast(monkeypatch):
    """``dtype="bfloat16"``: the training step, the prefill and every decoding step run their
    forward pass under bfloat16 autocast (as ``train.bf16``); float32 runs none (its decoding
    steps go through ``generate``'s native loop, counted as forward passes too)."""
    under_autocast = []

    class Recording(LM):
        def _run(self, *args, **kwargs):
            under_autocast.append(torch.is_autocast_enabled("cpu")
                                  and torch.get_autocast_dtype("cpu") == torch.bfloat16)
            return super()._run(*args, **kwargs)

    def recorded(step):
        def run(self, ids):
            under_autocast.append(torch.is_autocast_enabled("cpu")
                                  and torch.get_autocast_dtype("cpu") == torch.bfloat16)
            return step(self, ids)
        return run

    monkeypatch.setattr(lm_measure, "LM", Recording)
    for name in ("step", "step_greedy"):  # a float32 VQ model decodes through the native loop
        monkeypatch.setattr(VQGeneration, name, recorded(getattr(VQGeneration, name)))
    for dtype, expected in (("bfloat16", True), ("float32", False)):
        under_autocast.clear()
        (row,) = lm_measure.measure_model("vq", _config(contexts=(16,), dtype=dtype))
        assert row["train_s"] > 0 and row["prefill_s"] > 0 and len(row["decode_times_s"]) == 2
        # the training step and the prefill (one timed call, one for the peak memory each), the
        # prefilled state, and the two decoding steps
        assert len(under_autocast) == 2 + 2 + 1 + 2
        assert set(under_autocast) == {expected}


def test_config_refuses_a_bad_device_or_dtype(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N, got 'gpu'"):
        _config(device="gpu")
    with pytest.raises(ValueError, match="dtype must be one of 'float32', 'bfloat16'; got 'float16'"):
        _config(dtype="float16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda' requested but torch.cuda.is_available\(\) is False"):
        lm.run(_config(device="cuda"), ["vq"], out_dir=tmp_path, command="x")
    assert not any(tmp_path.iterdir())


def test_profile_at_the_longest_context(tmp_path):
    config = _config(contexts=(16, 32), profile_top=3)
    rows = lm_measure.measure_model("vq", config)
    assert rows[0]["profile"] is None
    profile = rows[1]["profile"]
    assert set(profile) == {"train", "prefill", "decode"}
    for part in profile.values():
        assert 1 <= len(part["ops"]) <= 3 and part["total_ms"] >= sum(op["self_ms"] for op in part["ops"])
    result = lm_report.write_results(rows, config, tmp_path, command="linattn bench lm (test)", models=["vq"])
    text = (tmp_path / "profile.md").read_text()
    assert "linattn bench lm (test)" in text and "| operator | self ms | share | calls |" in text
    for part in ("train", "prefill", "decode"):
        assert f"### `vq`, C=32, {part}:" in text
    assert tmp_path / "profile.md" in result["files"]


def _row(case: str, context: int, train: float | None, decode: float | None = None) -> dict:
    return {"case": case, "context": context, "parameters": 100, "train_tokens_per_s": train,
            "decode_ms_per_token": decode}


def _verdicts(rows) -> list[str]:
    return [target["verdict"] for target in lm_report.summarize(rows)["targets"]]


def test_summary_targets_from_the_rows():
    contexts = (512, 1024, 2048, 4096, 8192, 16384)
    softmax = [100, 80, 60, 40, 20, 10]
    passing = ([_row("softmax", c, s, 1.0 * c / 512) for c, s in zip(contexts, softmax)]
               + [_row("vq", c, v, 2.0 + 0.1 * (c == 16384)) for c, v in zip(contexts, [50, 60, 70, 70, 70, 35])])
    summary = lm_report.summarize(passing)
    assert summary["vq_over_softmax_train"] == {"512": 0.5, "1024": 0.75, "2048": 70 / 60, "4096": 1.75,
                                                "8192": 3.5, "16384": 3.5}
    overtake, speedup, decode = summary["targets"]
    assert overtake["value"] == 2048 and overtake["verdict"] == "pass"
    assert speedup["value"] == 3.5 and speedup["verdict"] == "pass"
    assert decode["value"] == pytest.approx(2.1 / 2.0) and decode["verdict"] == "pass"
    assert decode["softmax"] == 32
    assert "from C=2048 on" in lm_report.format_summary(summary)

    # VQ ahead at 2048 but behind again at 8192: it overtakes only at 16384; 2.9x; decode grows 1.5x
    failing = ([_row("softmax", c, s, 1.0) for c, s in zip(contexts, softmax)]
               + [_row("vq", c, v, 1.5 if c == 16384 else 1.0) for c, v in zip(contexts, [50, 60, 70, 30, 19, 29])])
    assert _verdicts(failing) == ["fail", "fail", "fail"]
    assert lm_report.summarize(failing)["targets"][0]["value"] == 16384

    # only short contexts, VQ behind: nothing can be decided yet
    short = [_row("softmax", 512, 100, 1.0), _row("vq", 512, 50, 1.0), _row("softmax", 1024, 90), _row("vq", 1024, 50)]
    assert _verdicts(short) == ["not measured"] * 3
    assert "targets" not in lm_report.summarize([_row("vq", 512, 50, 1.0)])

    # only long contexts (a 32k/64k run), VQ ahead from the first: where it overtook is unknown
    long = [_row("softmax", 32768, 10), _row("vq", 32768, 60), _row("softmax", 65536, 5), _row("vq", 65536, 40)]
    assert _verdicts(long) == ["not measured"] * 3
    behind = [_row("softmax", 32768, 10), _row("vq", 32768, 6), _row("softmax", 65536, 5), _row("vq", 65536, 40)]
    assert _verdicts(behind)[0] == "fail"


def test_context_table_pivots_models_against_contexts():
    """The ``contexts`` view of the documentation: a model per row, METRIC@C per column, growth
    METRIC@C/C0, and a speed-up row (tokens/s a/b, ms b/a); "—" where a context was skipped."""
    rows = [{"case": "softmax", "context": 512, "train_tokens_per_s": 12000.0, "decode_ms_per_token": 2.0,
             "train_peak_bytes": 3 * 2**20},
            {"case": "softmax", "context": 4096, "train_tokens_per_s": 3000.0, "decode_ms_per_token": 8.0,
             "train_peak_bytes": 12 * 2**20},
            {"case": "vq", "context": 512, "train_tokens_per_s": 9000.0, "decode_ms_per_token": 2.5,
             "train_peak_bytes": 5 * 2**20},
            {"case": "vq", "context": 4096, "train_tokens_per_s": None, "decode_ms_per_token": 2.0,
             "train_peak_bytes": None}]
    text = lm.VIEWS["contexts"]({"rows": rows}, columns="train@512,train@4096,decode@4096,decode@4096/512,peak@512",
                                speedup="vq/softmax")
    assert text.splitlines() == [
        "| model | train tok/s 512 | train tok/s 4096 | decode ms 4096 | decode ms 4096 / 512 | step peak MiB 512 |",
        "| --- | --- | --- | --- | --- | --- |",
        "| `softmax` | 12,000 | 3,000 | 8 | 4.00x | 3 |",
        "| `vq` | 9,000 | — | 2 | 0.80x | 5 |",
        f"| vq / softmax | {9000 / 12000:.2f}x |  | {8 / 2:.2f}x |  |  |",
    ]
    for columns, speedup, message in (("train@512,bogus@1", None, "METRIC@C"), ("train@x", None, "METRIC@C"),
                                      ("train@512", "vq/local", "among softmax, vq"),
                                      ("train@512", "vq", "MODEL/MODEL")):
        with pytest.raises(ValueError, match=message):
            lm.VIEWS["contexts"]({"rows": rows}, columns=columns, speedup=speedup)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--models", "softmax", "bogus"], "--models"),
        (["--models", "local:0"], "--models"),
        (["--contexts", "128", "0"], "--contexts"),
        (["--contexts", "-64"], "--contexts"),
        (["--tokens-per-step", "0"], "--tokens-per-step"),
        (["--memory-gb", "-1"], "--memory-gb"),
        (["--repeats", "0"], "--repeats"),
        (["--rounds", "0"], "--rounds"),
        (["--profile", "0"], "--profile"),
        (["--device", "gpu"], "--device"),
        (["--dtype", "float16"], "--dtype"),
        (["--models", "local,local,vq", "--n-layers", "2"], "--models 'local,local,vq'"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(args, named, tmp_path, capsys):
    assert main(["bench", "lm", "--quick", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and named in err and "Traceback" not in err
    assert not (tmp_path / "results.json").exists()
