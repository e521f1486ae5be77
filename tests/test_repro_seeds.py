"""Seeds in ``linattn repro``: ``--seeds``, the journal per (row, seed), the aggregation over
seeds, the resolved rule and the Differences tables, and the ``demo`` reproduction."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from linattn.cli import main
from linattn.repro import framework, spread
from linattn.repro.cli import report_page
from linattn.repro.framework import ExperimentSpec, seed_list
from linattn.repro.grids import Grid, run_journaled
from linattn.repro.journal import JOURNAL_NAME
from linattn.repro.spread import aggregate, difference_matrix, format_stats, metric_stats, resolved

from test_train_cli import corpus  # noqa: F401  (the tiny corpus fixture)


def _stats(values):
    return metric_stats(values)


# --- the statistics -------------------------------------------------------------------------


def test_metric_stats_of_a_written_list():
    stats = metric_stats([2.0, 4.0, 9.0])
    # mean 15/3 = 5; deviations -3, -1, 4; sample variance (9 + 1 + 16) / (3 - 1) = 13
    assert stats["n"] == 3 and stats["mean"] == pytest.approx(5.0) and stats["std"] == pytest.approx(math.sqrt(13))
    assert (stats["min"], stats["max"]) == (2.0, 9.0)
    two = metric_stats([1.0, 2.0])  # sample std with ddof=1: sqrt(0.5), not the population 0.5
    assert two["std"] == pytest.approx(math.sqrt(0.5)) and two["std"] != pytest.approx(0.5)
    one = metric_stats([3.25])
    assert one == {"n": 1, "mean": 3.25, "std": None, "min": 3.25, "max": 3.25}
    # None and non-finite values are left out; n counts the rest
    assert metric_stats([None, 1.0, float("nan"), 3.0]) == {"n": 2, "mean": 2.0, "std": pytest.approx(math.sqrt(2)),
                                                             "min": 1.0, "max": 3.0}
    assert metric_stats([None, float("inf")]) == {"n": 0, "mean": None, "std": None, "min": None, "max": None}


def test_aggregate_groups_the_seeds_of_each_row():
    runs = [
        {"mechanism": "a", "seed": 0, "spec": "x", "status": "ok", "bpb": 2.0, "steps": 10, "curve": [[1, 2.0]],
         "carried": None, "per_context": {"64": 1.0}},
        {"mechanism": "b", "seed": 0, "spec": "y", "status": "ok", "bpb": 3.0, "steps": 10, "curve": [[1, 3.0]],
         "carried": None, "per_context": {"64": 5.0}},
        {"mechanism": "a", "seed": 1, "spec": "x", "status": "diverged", "bpb": 4.0, "steps": 7, "curve": [[1, 4.0]],
         "carried": None, "per_context": {"64": 2.0}},
        {"mechanism": "a", "seed": 2, "spec": "x", "status": "ok", "bpb": 9.0, "steps": 10, "curve": [[1, 1.0]],
         "carried": None, "per_context": {"64": 6.0}},
    ]
    rows = aggregate(runs, identity=("mechanism",), metrics=lambda run: {"bpb_64": run["per_context"]["64"]})
    assert [r["mechanism"] for r in rows] == ["a", "b"]
    a, b = rows
    assert a["seeds"] == [0, 1, 2] and a["n"] == 3 and b["seeds"] == [0] and b["n"] == 1
    assert a["spec"] == "x" and b["spec"] == "y"  # the same string at every seed is kept
    assert "status" not in a and b["status"] == "ok"  # a string that differs between seeds is not
    assert "curve" not in a and "carried" not in a and "per_context" not in a  # lists, dicts, None: per seed only
    assert set(a["metrics"]) == {"bpb", "steps", "bpb_64"}
    assert a["metrics"]["bpb"]["mean"] == pytest.approx(5.0) and a["metrics"]["bpb"]["std"] == pytest.approx(
        math.sqrt(13))
    assert a["metrics"]["steps"] == {"n": 3, "mean": pytest.approx(9.0), "std": pytest.approx(math.sqrt(3)),
                                     "min": 7.0, "max": 10.0}
    assert a["metrics"]["bpb_64"]["mean"] == pytest.approx(3.0) and b["metrics"]["bpb_64"]["mean"] == 5.0
    assert b["metrics"]["bpb"]["std"] is None
    with pytest.raises(ValueError, match="seed"):
        aggregate([{"mechanism": "a", "bpb": 1.0}], identity=("mechanism",))


def test_identity_of_several_fields():
    runs = [{"m": "a", "d": 16, "seed": s, "acc": acc} for s, acc in ((0, 0.5), (1, 0.7))]
    runs += [{"m": "a", "d": 32, "seed": 0, "acc": 0.9}]
    rows = aggregate(runs, identity=("m", "d"))
    assert [(r["m"], r["d"], r["n"]) for r in rows] == [("a", 16, 2), ("a", 32, 1)]
    assert rows[0]["metrics"]["acc"]["mean"] == pytest.approx(0.6)


# --- the resolved rule -----------------------------------------------------------------------


def test_resolved_only_when_the_ranges_do_not_overlap_with_two_seeds_each():
    low, high = _stats([2.0, 2.1, 2.2]), _stats([2.3, 2.4])
    assert resolved(low, high) and resolved(high, low)
    overlapping = _stats([2.15, 2.5])
    assert not resolved(low, overlapping) and not resolved(overlapping, low)
    touching = _stats([2.2, 2.6])  # max of one = min of the other: the ranges overlap
    assert not resolved(low, touching)
    single = _stats([9.0])  # n = 1: never resolved, however far
    assert not resolved(low, single) and not resolved(single, _stats([0.0]))
    assert not resolved(low, None) and not resolved(_stats([]), low)


def test_format_stats():
    assert format_stats(_stats([2.0, 4.0, 9.0]), ".2f") == "5.00 ± 3.61 (2.00–9.00)"
    assert format_stats(_stats([2.0])) == "2.000 ± —"
    assert format_stats(_stats([2.0]), bare_single=True) == "2.000"
    assert format_stats(_stats([])) == "—" and format_stats(None) == "—"


def test_difference_matrix_marks_the_resolved_pairs():
    rows = [{"name": "a", "s": _stats([1.0, 1.2])}, {"name": "b", "s": _stats([1.5, 1.7])},
            {"name": "c", "s": _stats([1.1, 1.6])}, {"name": "d", "s": None}]
    lines = difference_matrix(rows, lambda r: r["s"], lambda r: r["name"], "+.2f")
    assert lines[0] == "| row − column | a | b | c |"  # d has no number: left out
    assert lines[2] == "| a |  | -0.50 ✓ | -0.25 |"
    assert lines[3] == "| b | +0.50 ✓ |  | +0.25 |"
    assert lines[4] == "| c | +0.25 | -0.25 |  |"
    section = spread.differences_lines([("caption", lines)])
    assert section[0] == "## Differences" and spread.RESOLVED_RULE in section[2] and "caption" in section


def test_curve_band_over_the_common_steps():
    xs, mean, low, high = spread.curve_band([[(0, 1.0), (10, 3.0), (20, 5.0)], [(0, 3.0), (10, 1.0)]])
    assert (xs, mean, low, high) == ([0, 10], [2.0, 2.0], [1.0, 1.0], [3.0, 3.0])


# --- --seeds --------------------------------------------------------------------------------


def _spec(default_seeds: int = 3) -> ExperimentSpec:
    return ExperimentSpec(name="toy", help="", description="", grid_axes=("rows",), quick_help="",
                          default_seeds=default_seeds)


def _parse(argv, spec=None):
    parser = argparse.ArgumentParser()
    framework.add_shared_arguments(parser, spec or _spec())
    return parser.parse_args(argv)


def test_seed_list_defaults_quick_and_explicit():
    assert seed_list(_parse([]), _spec()) == [0, 1, 2]
    assert seed_list(_parse([]), _spec(1)) == [0]
    assert seed_list(_parse(["--quick"]), _spec()) == [0]
    assert seed_list(_parse(["--quick", "--seeds", "2"]), _spec()) == [0, 1]  # explicit wins over --quick
    assert seed_list(_parse(["--seed", "5", "--seeds", "3"]), _spec(1)) == [5, 6, 7]


@pytest.mark.parametrize("bad", ["0", "-1", "x", "1.5"])
def test_seeds_below_one_exit_2_naming_the_flag(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(["--seeds", bad])
    assert exit_info.value.code == 2 and "--seeds" in capsys.readouterr().err


def test_a_hand_built_namespace_with_zero_seeds_is_named():
    args = _parse([])
    args.seeds = 0
    with pytest.raises(ValueError, match="--seeds must be an integer >= 1"):
        seed_list(args, _spec())


def test_every_reproduction_takes_seeds_with_its_default(capsys):
    defaults = {"lm": 3, "convert": 3, "length-extrapolation": 3, "mqar": 3, "demo": 3, "fwp-capacity": 1,
                "fwp-update-rule": 1, "long-range": 3, "linearize": 3}
    from linattn.repro.cli import REPRODUCTIONS

    assert set(REPRODUCTIONS) == set(defaults)
    for name, command in REPRODUCTIONS.items():
        assert command.spec.default_seeds == defaults[name], name
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        assert seed_list(parser.parse_args(["--seed", "2"]), command.spec) == list(range(2, 2 + defaults[name]))
        assert seed_list(parser.parse_args(["--quick"]), command.spec) == [0]


# --- the journal per (row, seed) ------------------------------------------------------------


CALLS: list[tuple[str, int]] = []


def _toy_train(name: str, seed: int) -> dict:
    CALLS.append((name, seed))
    return {"name": name, "value": 10 * seed + len(name)}


def _toy_grid(seeds, names=("a", "bb")) -> Grid:
    return Grid(train=_toy_train, runs=[(name, seed) for seed in seeds for name in names],
                run_key=lambda run: {"name": run[0], "seed": run[1]}, seed_of=lambda run: run[1],
                describe=str, label="toy")


def test_journal_per_seed_resume_trains_only_the_missing_seeds(tmp_path):
    CALLS.clear()
    first = run_journaled(_toy_grid([0, 1]), tmp_path, spec=_spec(), progress=False)
    assert CALLS == [("a", 0), ("bb", 0), ("a", 1), ("bb", 1)] and first.reused == 0
    assert [(r["name"], r["seed"], r["value"]) for r in first.rows] == [("a", 0, 1), ("bb", 0, 2), ("a", 1, 11),
                                                                         ("bb", 1, 12)]
    CALLS.clear()
    more = run_journaled(_toy_grid([0, 1, 2]), tmp_path, spec=_spec(), progress=False, resume=True)
    assert CALLS == [("a", 2), ("bb", 2)] and more.reused == 4 and more.total == 6
    assert [r["seed"] for r in more.rows] == [0, 0, 1, 1, 2, 2]
    assert [r["value"] for r in more.rows[:4]] == [r["value"] for r in first.rows]
    CALLS.clear()
    interim = run_journaled(_toy_grid([1, 2, 3]), tmp_path, spec=_spec(), progress=False, report_only=True)
    assert CALLS == [] and [(r["name"], r["seed"]) for r in interim.rows] == [("a", 1), ("bb", 1), ("a", 2),
                                                                              ("bb", 2)]
    rows = aggregate(interim.rows, identity=("name",))
    assert [(r["name"], r["seeds"]) for r in rows] == [("a", [1, 2]), ("bb", [1, 2])]
    assert len((tmp_path / JOURNAL_NAME).read_text().splitlines()) == 6
    CALLS.clear()
    run_journaled(_toy_grid([0, 1]), tmp_path, spec=_spec(), progress=False)  # without --resume: all again
    assert len(CALLS) == 4


def test_a_key_without_the_seed_is_refused(tmp_path):
    grid = Grid(train=_toy_train, runs=[("a", 0), ("a", 1)], run_key=lambda run: {"name": run[0]},
                seed_of=lambda run: run[1], describe=str, label="toy")
    with pytest.raises(ValueError, match="same journal key"):
        run_journaled(grid, tmp_path, spec=_spec(), progress=False)
    assert not (tmp_path / JOURNAL_NAME).exists()


# --- one seed's run is the run of --seed alone ----------------------------------------------


LM_TINY = ["--mechanisms", "vq", "local", "--steps", "4", "--batch-size", "2", "--context", "16", "--d-model", "16",
           "--n-layers", "1", "--n-heads", "2", "--window", "4", "--codebook-size", "8", "--block-size", "4",
           "--gau-d-k", "8", "--eval-every", "2", "--eval-tokens", "256", "--test-tokens", "200", "--threads", "1",
           "--no-progress"]
# What a row's training and evaluation determine (not its timings or memory).
LM_RESULT_KEYS = ("mechanism", "parameters", "validation_bpb", "test_bpb_reset", "test_bpb_schedule",
                  "test_bpb_carried", "loss_curve", "validation_curve", "codebook_usage", "test_code_perplexity")


def test_a_seed_of_several_equals_the_run_of_that_seed_alone(corpus, tmp_path):  # noqa: F811
    assert main(["repro", "lm", "--data", str(corpus), "--seeds", "2", "--seed", "0", "--out", str(tmp_path / "two"),
                 *LM_TINY]) == 0
    assert main(["repro", "lm", "--data", str(corpus), "--seeds", "1", "--seed", "1", "--out", str(tmp_path / "one"),
                 *LM_TINY]) == 0
    two, one = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("two", "one"))
    seed_one = [run for run in two["runs"] if run["seed"] == 1]
    assert [[run[key] for key in LM_RESULT_KEYS] for run in seed_one] == [
        [run[key] for key in LM_RESULT_KEYS] for run in one["runs"]]
    seed_zero = [run for run in two["runs"] if run["seed"] == 0]
    assert [run["validation_bpb"] for run in seed_zero] != [run["validation_bpb"] for run in seed_one]
    assert [(r["mechanism"], r["n"], r["seeds"]) for r in two["rows"]] == [("vq", 2, [0, 1]), ("local", 2, [0, 1])]
    assert two["metadata"]["seeds"] == [0, 1]
    for row in two["rows"]:
        bpb = [run["validation_bpb"] for run in two["runs"] if run["mechanism"] == row["mechanism"]]
        assert row["metrics"]["validation_bpb"]["mean"] == pytest.approx(sum(bpb) / 2)
        assert row["metrics"]["validation_bpb"]["std"] == pytest.approx(abs(bpb[0] - bpb[1]) / math.sqrt(2))
    for seed in (0, 1):
        assert (tmp_path / "two" / "runs" / f"seed-{seed}" / "vq" / "metrics.jsonl").exists()


# --- repro demo -------------------------------------------------------------------------------


def _tiny_run_file(path, data) -> str:
    path.write_text(f"""[model]
attention = "vq"
d_model = 16
n_layers = 1
gau_d_k = 8
codebook_size = 8
block_size = 4
kmeans_init = true

[train]
data = "{data}"
steps = 4
batch_size = 2
context = 16
warmup_steps = 1
eval_every = 2
eval_tokens = 256
eval_batch_size = 1
checkpoint_every = 2
""")
    return str(path)


def test_repro_demo_runs_are_linattn_train_of_the_run_file(corpus, tmp_path, monkeypatch):  # noqa: F811
    config = _tiny_run_file(tmp_path / "tiny.toml", corpus)
    out = tmp_path / "demo"
    argv = ["repro", "demo", "--config", config, "--seeds", "2", "--seed", "3", "--out", str(out), "--threads", "1",
            "--no-progress"]
    assert main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    runs = document["runs"]
    assert [run["seed"] for run in runs] == [3, 4] and [run["steps"] for run in runs] == [4, 4]
    # Each seed's run is `linattn train --config FILE` with train.seed set: the same curves and bpb.
    for run in runs:
        alone = tmp_path / f"alone-{run['seed']}"
        assert main(["train", "--config", config, "--out", str(alone), "--set", f"train.seed={run['seed']}",
                     "--threads", "1", "--no-progress"]) == 0
        records = [json.loads(line) for line in (alone / "metrics.jsonl").read_text().splitlines()]
        assert run["validation_curve"] == [[r["step"], r["bpb"]] for r in records if r.get("split") == "validation"]
        assert run["validation_bpb"] == run["validation_curve"][-1][1]
    assert runs[0]["validation_bpb"] != runs[1]["validation_bpb"]
    (row,) = document["rows"]
    bpb = [run["validation_bpb"] for run in runs]
    assert row["seeds"] == [3, 4] and row["metrics"]["validation_bpb"]["mean"] == pytest.approx(sum(bpb) / 2)
    text = (out / "results.md").read_text()
    stats = row["metrics"]["validation_bpb"]
    assert f"| 2 | {stats['mean']:.3f} | {stats['std']:.3f} | {min(bpb):.3f}–{max(bpb):.3f} |" in text
    assert report_page(out) == text  # `linattn repro report`: the page again, from results.json alone
    assert (out / "validation_bpb.png").read_bytes()[:4] == b"\x89PNG"

    # --resume with one more seed trains only that one
    import linattn.repro.demo as demo

    trained = []
    real = demo.train_seed

    def counted(model_values, train_values, run_dir):
        trained.append(train_values["seed"])
        return real(model_values, train_values, run_dir)

    monkeypatch.setattr(demo, "train_seed", counted)
    assert main([*argv[:5], "3", *argv[6:], "--resume"]) == 0
    assert trained == [5]
    assert "2 of 3 runs were reused" in (out / "results.md").read_text()


def test_repro_demo_quick_is_one_seed_and_a_missing_run_file_is_named(corpus, tmp_path, capsys):  # noqa: F811
    config = _tiny_run_file(tmp_path / "tiny.toml", corpus)
    assert main(["repro", "demo", "--quick", "--config", config, "--out", str(tmp_path / "q"), "--no-progress"]) == 0
    assert [r["n"] for r in json.loads((tmp_path / "q" / "results.json").read_text())["rows"]] == [1]
    capsys.readouterr()
    assert main(["repro", "demo", "--config", str(tmp_path / "none.toml"), "--out", str(tmp_path / "x")]) == 2
    assert "none.toml" in capsys.readouterr().err
