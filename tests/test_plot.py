"""``linattn plot``: the PNG it writes and the data it draws, checked against each run's
metrics.jsonl read here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from linattn.cli import main
from linattn.train.plot import plot_runs
from _helpers import english_like
from test_train_cli import train_argv


def write_metrics(run: Path, records: list[dict]) -> Path:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return run


def curves_of(run: Path) -> tuple[list, list, list, list]:
    """(train steps, losses, validation steps, bpb) of ``run/metrics.jsonl``."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("split") is None]
    validation = [r for r in records if r.get("split") == "validation"]
    return ([r["step"] for r in train], [r["loss"] for r in train], [r["step"] for r in validation],
            [r["bpb"] for r in validation])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A real tiny run and a written-out one."""
    root = tmp_path_factory.mktemp("plot")
    corpus = root / "tiny.txt"
    corpus.write_text(english_like(4000), encoding="utf-8")
    real = root / "real"
    assert main(train_argv(corpus, real, steps=20) + ["--log-every", "2", "--eval-every", "5"]) == 0
    written = write_metrics(root / "written", [
        {"step": 0, "split": "validation", "bpb": 8.0, "tokens": 100},
        *({"step": s, "loss": 5.0 / s, "bpb": 5.0 / s / 0.693, "lr": 1e-3} for s in range(1, 31)),
        {"step": 15, "split": "validation", "bpb": 3.5, "tokens": 100},
        {"step": 30, "split": "validation", "bpb": 2.5, "tokens": 100},
    ])
    return real, written


def test_plot_draws_each_runs_metrics(runs, tmp_path, capsys):
    real, written = runs
    out = tmp_path / "sub" / "curves.png"
    figure = plot_runs([real, written], out)
    loss_axis, bpb_axis = figure.axes
    for axis, (steps, values) in ((loss_axis, (0, 1)), (bpb_axis, (2, 3))):
        assert [line.get_label() for line in axis.get_lines()] == ["real", "written"]
        for line, run in zip(axis.get_lines(), (real, written)):
            expected = curves_of(run)
            assert list(line.get_xdata()) == expected[steps] and list(line.get_ydata()) == expected[values]
    assert len(curves_of(real)[0]) == 10 and curves_of(real)[2] == [0, 5, 10, 15, 20]
    assert "bits per byte" in bpb_axis.get_ylabel() and "nats per token" in loss_axis.get_ylabel()

    image = Image.open(out)
    assert image.format == "PNG" and image.size == (1320, 480)
    pixels = np.asarray(image.convert("RGB")).astype(int)
    blue = np.abs(pixels - [31, 119, 180]).sum(-1) < 30  # matplotlib's first line colour
    orange = np.abs(pixels - [255, 127, 14]).sum(-1) < 30  # its second
    assert blue.sum() > 200 and orange.sum() > 200


def test_plot_cli_and_its_errors(runs, tmp_path, capsys):
    real, written = runs
    out = tmp_path / "cli.png"
    assert main(["plot", str(real), str(written), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n" and Image.open(out).format == "PNG"
    assert main(["plot", str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    assert main(["plot", str(real), "--out", str(tmp_path / "curves.pdf")]) == 2
    assert "expected a .png" in capsys.readouterr().err
    broken = write_metrics(tmp_path / "broken", [])
    (broken / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\nnot json\n')
    assert main(["plot", str(broken), "--out", str(out)]) == 2
    assert "line 2 of" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["[1, 2]", "3", '{"loss": 1.0}'])
def test_a_line_that_is_no_record_is_an_error_naming_it(tmp_path, capsys, bad):
    run = write_metrics(tmp_path / "run", [])
    (run / "metrics.jsonl").write_text(f'{{"step": 1, "loss": 2.0}}\n{bad}\n{{"step": 2, "loss": 1.0}}\n')
    assert main(["plot", str(run), "--out", str(tmp_path / "curves.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"linattn: error: line 2 of {run / 'metrics.jsonl'} ") and err.count("\n") == 1, err


def test_a_last_line_cut_short_is_left_out_with_a_note(tmp_path, capsys):
    """A run killed while writing its metrics leaves a last line without its newline: the plot
    draws the complete lines and says which line it left out."""
    run = write_metrics(tmp_path / "run", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}])
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "lo')
    assert main(["plot", str(run), "--out", str(tmp_path / "curves.png")]) == 0
    err = capsys.readouterr().err
    assert f"dropped the last line of {run / 'metrics.jsonl'} (line 3)" in err, err
    assert read_curves_of(run) == ([1, 2], [2.0, 1.0])


def read_curves_of(run: Path) -> tuple[list, list]:
    from linattn.train.plot import read_curves

    curves = read_curves(run, echo=lambda message: None)
    return curves.train_steps, curves.train_loss


def test_runs_with_the_same_name_are_labelled_by_path(runs, tmp_path):
    _, written = runs
    first = write_metrics(tmp_path / "a" / "run", [{"step": 1, "loss": 1.0}])
    second = write_metrics(tmp_path / "b" / "run", [{"step": 1, "loss": 2.0}])
    figure = plot_runs([first, second], tmp_path / "same.png")
    assert [line.get_label() for line in figure.axes[0].get_lines()] == [str(first), str(second)]
