"""Resumable reproduction grids: the run journal (``runs.jsonl``) and ``--resume``."""

from __future__ import annotations

import argparse
import json
import shutil
import threading
from pathlib import Path

import pytest

import linattn.repro.cli
from linattn.cli import main
from linattn.repro import fwp_retrieval as fwp, mqar
from linattn.repro.grids import map_runs
from linattn.repro.journal import JOURNAL_NAME, RunJournal


class _Bar:
    """The part of a tqdm bar that map_runs uses."""

    def __init__(self):
        self.n, self.postfixes = 0, []

    def update(self, n):
        self.n += n

    def set_postfix_str(self, text):
        self.postfixes.append(text)


def _square(x: int) -> dict:
    return {"x": x, "y": x * x}


def test_journal_skips_a_torn_last_line_and_keeps_the_rest(tmp_path):
    path = tmp_path / JOURNAL_NAME
    journal = RunJournal(path, resume=False)
    journal.record({"x": 1}, {"y": 1})
    journal.record({"x": 2}, {"y": 4})
    with open(path, "a") as handle:
        handle.write('{"key": {"x": 3}, "row": {"y"')  # a crash in the middle of a write
    resumed = RunJournal(path, resume=True)
    assert len(resumed) == 2 and resumed.get({"x": 2}) == {"y": 4} and resumed.get({"x": 3}) is None
    assert [json.loads(line)["key"] for line in path.read_text().splitlines()] == [{"x": 1}, {"x": 2}]
    assert len(RunJournal(path, resume=False)) == 0 and path.read_text() == ""


def test_processes_sharing_a_journal_never_rewrite_it_from_a_cut_read(tmp_path):
    """One process per seed, one journal: a process opening it with --resume while another
    holds its lock (rewriting or appending) waits, then loads everything, the other's rows
    included, so its own rewrite drops nothing."""
    path = tmp_path / JOURNAL_NAME
    first = RunJournal(path, resume=False)
    first.record({"seed": 0}, {"bpb": 1.0})
    opened = []
    with first._locked():  # another process, in the middle of a write
        thread = threading.Thread(target=lambda: opened.append(RunJournal(path, resume=True)))
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive() and not opened  # waiting for the lock, nothing read or rewritten
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"key": {"seed": 1}, "row": {"bpb": 2.0}}) + "\n")
    thread.join(timeout=30)
    assert len(opened[0]) == 2
    assert len(RunJournal(path, resume=True)) == 2


def test_map_runs_trains_only_what_the_journal_lacks(tmp_path):
    calls = []

    def train(x):
        calls.append(x)
        return _square(x)

    journal = RunJournal(tmp_path / JOURNAL_NAME, resume=False)
    grid = [(x,) for x in range(4)]
    first = map_runs(train, grid[:2], jobs=1, threads=1, bar=_Bar(), describe=str, journal=journal,
                     run_key=lambda args: {"x": args[0]})
    assert calls == [0, 1] and first == [_square(0), _square(1)]
    bar = _Bar()
    resumed = RunJournal(tmp_path / JOURNAL_NAME, resume=True)
    rows = map_runs(train, grid, jobs=1, threads=1, bar=bar, describe=str, journal=resumed,
                    run_key=lambda args: {"x": args[0]})
    assert calls == [0, 1, 2, 3] and rows == [_square(x) for x in range(4)] and bar.n == 4
    with pytest.raises(ValueError, match="journal and run_key"):
        map_runs(train, grid, jobs=1, threads=1, bar=_Bar(), describe=str, journal=resumed)


def _fwp_rows(out, monkeypatch, *, resume, max_steps=20, calls=None):
    if calls is not None:
        real = fwp._train_named

        def counted(*args, **kwargs):
            calls.append(args[1:3])
            return real(*args, **kwargs)

        monkeypatch.setattr(fwp, "_train_named", counted)
    config = fwp.RetrievalTrainConfig(max_steps=max_steps, eval_every=10, seed=1)
    result = fwp.run_experiment(fwp.CAPACITY, mechanisms=["softmax", "linear-elu"], sizes=[4, 6], config=config,
                                out_dir=out, command="test", progress=False, resume=resume)
    monkeypatch.undo()
    return result


def test_interrupted_fwp_grid_resumes_to_the_same_results(tmp_path, monkeypatch):
    full = _fwp_rows(tmp_path / "full", monkeypatch, resume=False)
    lines = (tmp_path / "full" / JOURNAL_NAME).read_text().splitlines()
    assert len(lines) == 4 and full["metadata"]["reused_runs"] == 0

    # An interrupted run: two runs recorded, the third cut off mid-line.
    out = tmp_path / "cut"
    out.mkdir()
    (out / JOURNAL_NAME).write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])
    calls = []
    resumed = _fwp_rows(out, monkeypatch, resume=True, calls=calls)
    assert len(calls) == 2 and resumed["metadata"]["reused_runs"] == 2
    keys = ("mechanism", "size", "final_eval_loss", "steps", "stop_reason", "curve")
    assert [[r[k] for k in keys] for r in resumed["runs"]] == [[r[k] for k in keys] for r in full["runs"]]
    assert "2 of 4 runs were reused" in (out / "results.md").read_text()
    assert len((out / JOURNAL_NAME).read_text().splitlines()) == 4

    # Another configuration is another run: nothing reused; without --resume nothing either.
    calls = []
    _fwp_rows(out, monkeypatch, resume=True, max_steps=10, calls=calls)
    assert len(calls) == 4
    calls = []
    _fwp_rows(out, monkeypatch, resume=False, max_steps=10, calls=calls)
    assert len(calls) == 4


def test_mqar_resume_reuses_recorded_runs(tmp_path, monkeypatch):
    config = mqar.MQARConfig(steps=2, batch_size=4, eval_batches=1, vocab_size=64, window=8)
    grid = (["softmax", "local"], [16], [(32, 2)], config)
    first = mqar.run_experiment(*grid, out_dir=tmp_path, command="test", progress=False)
    calls = []
    real = mqar.train_run

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(mqar, "train_run", counted)
    again = mqar.run_experiment(*grid, out_dir=tmp_path, command="test", progress=False, resume=True)
    assert calls == [] and again["metadata"]["reused_runs"] == 2
    text = (tmp_path / "results.md").read_text()
    assert "Wall time" not in text and "2 of 2 runs were reused" in text
    assert [r["accuracy"] for r in again["runs"]] == [r["accuracy"] for r in first["runs"]]
    mqar.run_experiment(*grid, out_dir=tmp_path, command="test", progress=False)
    assert calls == ["softmax", "local"]


@pytest.mark.parametrize("argv", [
    ["fwp-capacity", "--sizes", "4", "--mechanisms", "softmax", "--max-steps", "10", "--eval-every", "10"],
    ["mqar", "--mechanisms", "local", "--d-models", "16", "--lengths", "32", "--steps", "2", "--batch-size", "4",
     "--eval-batches", "1", "--window", "8", "--seeds", "1"],
])
def test_resume_flag_of_the_commands(tmp_path, monkeypatch, capsys, argv):
    parser = argparse.ArgumentParser()
    linattn.repro.cli.register(parser.add_subparsers(dest="command", required=True))
    argv = ["repro", *argv, "--threads", "1", "--no-progress", "--out", str(tmp_path)]
    args = parser.parse_args(argv)
    assert args.handler(args) == 0
    module = fwp if argv[1].startswith("fwp") else mqar
    name = "_train_named" if module is fwp else "train_run"

    def fail(*args, **kwargs):
        raise AssertionError("a recorded run was trained again")

    monkeypatch.setattr(module, name, fail)
    args = parser.parse_args(argv + ["--resume"])
    assert args.handler(args) == 0
    assert "1 of 1 runs were reused" in capsys.readouterr().out
    args = parser.parse_args(argv)
    with pytest.raises(AssertionError, match="trained again"):
        args.handler(args)


def test_grid_split_by_mechanism_assembles_from_concatenated_journals(tmp_path, monkeypatch):
    config = fwp.RetrievalTrainConfig(max_steps=10, eval_every=10, seed=2)
    parts = {"a": ["softmax"], "b": ["linear-elu"]}
    for name, mechanisms in parts.items():
        fwp.run_experiment(fwp.CAPACITY, mechanisms=mechanisms, sizes=[4], config=config, out_dir=tmp_path / name,
                           command="test", progress=False)
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / JOURNAL_NAME).write_text("".join((tmp_path / name / JOURNAL_NAME).read_text() for name in parts))

    def fail(*args, **kwargs):
        raise AssertionError("a recorded run was trained again")

    monkeypatch.setattr(fwp, "_train_named", fail)
    result = fwp.run_experiment(fwp.CAPACITY, mechanisms=["softmax", "linear-elu"], sizes=[4], config=config,
                                out_dir=whole, command="test", progress=False, resume=True)
    assert [r["mechanism"] for r in result["rows"]] == ["softmax", "linear-elu"]
    assert result["metadata"]["reused_runs"] == 2
    # Nothing was trained here: no wall time or process count of this invocation is reported.
    last = result["markdown"].rstrip().splitlines()[-1]
    assert "Wall time" not in last and "process(es)" not in last and "wall time" not in last
    assert last.startswith("CPU time of the runs") and "2 of 2 runs were reused" in last


def test_worker_runs_report_their_steps_to_the_parent():
    config = fwp.RetrievalTrainConfig(max_steps=30, eval_every=10, seed=1, target_loss=1e-12)
    grid = [("capacity", "softmax", 4, config), ("capacity", "linear-elu", 6, config)]
    seen = []

    def show(args):
        return lambda step, loss: seen.append((args[1], args[2], step, loss))

    bar = _Bar()
    rows = map_runs(fwp._train_named, grid, jobs=2, threads=1, bar=bar, describe=lambda row: row["mechanism"],
                    progress_kwarg="on_eval", show_progress=show)
    assert bar.n == 2 and sorted(bar.postfixes[-2:]) == ["linear-elu", "softmax"]
    for (_, name, size, _), row in zip(grid, rows):
        # Every evaluation of every worker run reached the parent, in order, with its loss.
        assert [(s, loss) for n, k, s, loss in seen if (n, k) == (name, size)] == [tuple(c) for c in row["curve"]]


def test_report_only_reports_the_recorded_runs_and_trains_nothing(tmp_path, monkeypatch):
    config = fwp.RetrievalTrainConfig(max_steps=20, eval_every=10, seed=1)
    grid = dict(mechanisms=["softmax", "linear-elu"], config=config, command="test", progress=False)
    with pytest.raises(ValueError, match="--report-only: .* holds none of this grid's runs"):
        fwp.run_experiment(fwp.CAPACITY, sizes=[4, 6], out_dir=tmp_path, report_only=True, **grid)
    first = fwp.run_experiment(fwp.CAPACITY, sizes=[4], out_dir=tmp_path, **grid)
    journal = (tmp_path / JOURNAL_NAME).read_text()

    def no_training(*args, **kwargs):
        raise AssertionError("--report-only trained a run")

    monkeypatch.setattr(fwp, "_train_named", no_training)
    interim = fwp.run_experiment(fwp.CAPACITY, sizes=[4, 6], out_dir=tmp_path, report_only=True, **grid)
    assert [(r["mechanism"], r["size"]) for r in interim["runs"]] == [("softmax", 4), ("linear-elu", 4)]
    assert [r["final_eval_loss"] for r in interim["runs"]] == [r["final_eval_loss"] for r in first["runs"]]
    assert interim["metadata"]["grid_runs"] == 4 and interim["metadata"]["report_only"] is True
    text = (tmp_path / "results.md").read_text()
    assert "Interim report (--report-only): 2 of the grid's 4 runs are recorded" in text
    assert "Wall time" not in text  # this invocation trained nothing
    assert "| S=4 | S=6 |" not in text  # only the sizes with recorded runs get a column
    assert fwp.page(fwp.CAPACITY, json.loads((tmp_path / "results.json").read_text())) == text  # from the JSON
    assert (tmp_path / JOURNAL_NAME).read_text() == journal  # read, not rewritten
    with pytest.raises(RuntimeError, match="read-only"):
        RunJournal(tmp_path / JOURNAL_NAME, resume=True, read_only=True).record({"x": 1}, {})


def test_report_only_flag_on_the_command_line(tmp_path, monkeypatch, capsys):
    parser = argparse.ArgumentParser()
    linattn.repro.cli.register(parser.add_subparsers(dest="command", required=True))
    argv = ["repro", "fwp-update-rule", "--sizes", "4", "--mechanisms", "sum-dpfp-1", "--max-steps", "10",
            "--eval-every", "10", "--threads", "1", "--no-progress", "--out", str(tmp_path)]
    args = parser.parse_args(argv)
    assert args.handler(args) == 0

    def fail(*args, **kwargs):
        raise AssertionError("--report-only trained a run")

    monkeypatch.setattr(fwp, "_train_named", fail)
    capsys.readouterr()
    args = parser.parse_args(argv[:3] + ["4", "5"] + argv[4:] + ["--report-only"])  # S = 5 never ran
    assert args.handler(args) == 0
    assert "1 of the grid's 2 runs are recorded" in capsys.readouterr().out


RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


@pytest.mark.parametrize("name, argv, train", [
    ("repro-fwp-update-rule", ["fwp-update-rule", "--max-steps", "3000"], (fwp, "_train_named")),
    ("repro-mqar", ["mqar", "--seeds", "1"], (mqar, "train_run")),
])
def test_report_only_regenerates_a_committed_report_from_its_journal(tmp_path, monkeypatch, name, argv, train):
    """A journal committed under docs/results still reads: --report-only rebuilds its runs of seed 0
    (the journal keys of one seed's runs are those of the runs before --seeds) and its page."""
    committed = RESULTS / name
    out = tmp_path / name
    out.mkdir()
    shutil.copy(committed / JOURNAL_NAME, out / JOURNAL_NAME)
    journal = (out / JOURNAL_NAME).read_bytes()

    def fail(*args, **kwargs):
        raise AssertionError("--report-only trained a run")

    monkeypatch.setattr(*train, fail)
    assert main(["repro", *argv, "--report-only", "--no-progress", "--out", str(out)]) == 0
    assert (out / JOURNAL_NAME).read_bytes() == journal
    document = json.loads((out / "results.json").read_text())
    old = json.loads((committed / "results.json").read_text())
    # A results.json written before --seeds has one row per run (all of seed 0) and no "runs".
    committed_runs = old["runs"] if "runs" in old else [{**row, "seed": 0} for row in old["rows"]]
    assert document["runs"] == [run for run in committed_runs if run["seed"] == 0] != []
    assert {row["n"] for row in document["rows"]} == {1}
    text = (out / "results.md").read_text()
    assert "n = 1 seed per row (0)." in text and "Interim report (--report-only)" in text.splitlines()[-1]
