"""Everything a resume reads is checked: a checkpoint's ``meta.json`` under its own SHA-256
(``meta_sha256``; version-1 checkpoints without it still load), and the data by its absolute
path and the fingerprint each checkpoint records (``data_fingerprint``): changed, moved or
missing data stops ``linattn train --resume`` and ``linattn eval`` (without ``--data``)
before they read a token, unless ``--accept-new-data``. Tiny runs, in-process through
``linattn.cli.main``."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from linattn.cli import main
from linattn.data import fingerprint_changes
from linattn.train import CheckpointError, TrainConfig, load_checkpoint
from linattn.train import distributed
from linattn.train.startup import RelayedError
from linattn.train import trainer as trainer_module
from linattn.train.checkpoint import Checkpoint
from _helpers import english_like, ranks_in_threads
from test_train_cli import run_captured, train_argv

torch.set_num_threads(1)

HASH = "meta_sha256"


def sealed(meta: dict) -> dict:
    """``meta`` with the hash the checkpoint format documents: SHA-256 of
    ``json.dumps(meta without meta_sha256, sort_keys=True)`` in UTF-8."""
    body = {key: value for key, value in meta.items() if key != HASH}
    return {**body, HASH: hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()}


def write_meta(folder: Path, meta: dict, *, seal: bool) -> None:
    """Write a checkpoint's meta.json, with its hash recomputed (``seal``) or as given."""
    (folder / "meta.json").write_text(json.dumps(sealed(meta) if seal else meta, indent=1))


def read_meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def file_record(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def curve(run: Path) -> list[dict]:
    """The logged records without the timings."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_second", "elapsed")} for r in records]


def resume_argv(run: Path, *extra: str) -> list[str]:
    return ["train", "--resume", "--out", str(run), "--no-progress", "--threads", "1", *extra]


def rewind(run: Path, step: int) -> None:
    """Make ``run`` look as if it had stopped after its checkpoint at ``step``."""
    for folder in (run / "checkpoints").glob("step-*"):
        if int(folder.name.split("-")[1]) > step:
            shutil.rmtree(folder)
    (run / "checkpoints" / "latest").write_text(f"step-{step:08d}\n")


def six_steps(data: str | Path, out: Path) -> list[str]:
    """A 6-step run with checkpoints at steps 3 and 6."""
    return train_argv(Path(data), out, steps=6) + ["--checkpoint-every", "3", "--log-every", "1"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 6-step run (checkpoints at 3 and 6) on a text file."""
    root = tmp_path_factory.mktemp("finished")
    corpus = root / "corpus.txt"
    corpus.write_text(english_like(4000))
    run = root / "run"
    code, _, stderr = run_captured(six_steps(corpus, run))
    assert code == 0, stderr
    return root, run


def copy_run(finished, name: str) -> Path:
    root, run = finished
    copy = root / name
    shutil.copytree(run, copy)
    return copy


# ----------------------------------------------------------------------------- meta.json under its hash


def test_meta_json_records_the_sha256_of_its_own_canonical_content(finished):
    _, run = finished
    meta = read_meta(load_checkpoint(run).path)
    assert meta["version"] == 2
    assert meta[HASH] == sealed(meta)[HASH]


EDITS = {
    "step 6 -> 5": lambda meta: meta.update(step=5),
    "train_config.lr": lambda meta: meta["train_config"].update(lr=0.5),
    "model_config.ema_decay": lambda meta: meta["model_config"].update(ema_decay=0.5),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_meta_json_is_refused_by_load_checkpoint_and_by_resume(finished, edit, capsys):
    run = copy_run(finished, f"edited-{edit.split()[0]}")
    folder = run / "checkpoints" / "step-00000006"
    meta = read_meta(folder)
    EDITS[edit](meta)
    write_meta(folder, meta, seal=False)
    with pytest.raises(CheckpointError, match="meta.json was edited or is corrupt"):
        load_checkpoint(folder)
    before = (run / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(resume_argv(run, "--steps", "9")) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'meta.json'} was edited or is corrupt" in err, err
    assert f"linattn train --resume --out {run} --from 3" in err  # the usable earlier checkpoint
    assert (run / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000003", "step-00000006"]
    # the same edit with the hash recomputed the documented way is a checkpoint again
    write_meta(folder, meta, seal=True)
    assert load_checkpoint(folder).meta == sealed(meta)


def test_a_version_1_checkpoint_without_hash_or_fingerprint_still_loads_and_resumes(finished, capsys):
    """A checkpoint as linattn wrote it before meta.json carried its hash (version 1) and a
    fingerprint of the data: it loads, and a resume continues, saying the data went unchecked."""
    run = copy_run(finished, "version-1")
    rewind(run, 3)
    folder = run / "checkpoints" / "step-00000003"
    meta = read_meta(folder)
    old = {key: value for key, value in meta.items() if key not in (HASH, "data_fingerprint")}
    write_meta(folder, {**old, "version": 1}, seal=False)
    assert load_checkpoint(folder).step == 3
    capsys.readouterr()
    assert main(resume_argv(run)) == 0
    out = capsys.readouterr().out
    assert f"{folder} records no fingerprint of its data" in out and "could not be checked" in out, out
    assert curve(run) == curve(finished[1])  # resumed exactly
    latest = read_meta(load_checkpoint(run).path)
    assert latest["version"] == 2 and latest["data_fingerprint"] == meta["data_fingerprint"]


# ----------------------------------------------------------------------------- what latest names


def _point_latest_elsewhere(run: Path, other: Path, how: str) -> str:
    """Make ``run``'s ``checkpoints/latest`` name ``other``'s step 3 (a path or, ``"link"``, a
    ``step-*`` symbolic link to it); returns what ``latest`` (or the link) points to."""
    target = other / "checkpoints" / "step-00000003"
    latest = run / "checkpoints" / "latest"
    if how == "relative":
        text = f"../../{other.name}/checkpoints/step-00000003"
    elif how == "absolute":
        text = str(target)
    else:
        (run / "checkpoints" / "step-00000009").symlink_to(target)
        text = "step-00000009"
    latest.write_text(text + "\n")
    return str(target) if how == "link" else text


@pytest.mark.parametrize("how", ["relative", "absolute", "link"])
def test_latest_naming_another_runs_checkpoint_is_refused(finished, how):
    """``latest`` holds the name of a step folder beside it; one naming a checkpoint of another run
    (by a path, or through a symbolic step-* link) is refused by eval, generate and --resume,
    which would evaluate it, or continue the other run here, in this run's name."""
    other, run = copy_run(finished, f"other-{how}"), copy_run(finished, f"mine-{how}")
    pointed = _point_latest_elsewhere(run, other, how)
    before = (run / "metrics.jsonl").read_bytes()
    for argv in (["eval", "--ckpt", str(run), "--no-progress"],
                 ["generate", "--ckpt", str(run), "--max-new-tokens", "2"],
                 resume_argv(run, "--steps", "12")):
        code, stdout, stderr = run_captured(argv)
        assert code == 2, (argv, stdout, stderr)
        assert str(run / "checkpoints" / "latest") in stderr and pointed in stderr, stderr
    assert (run / "metrics.jsonl").read_bytes() == before
    assert not any((folder / "checkpoints" / "step-00000012").exists() for folder in (run, other))


def test_a_step_link_is_refused_by_from_and_skipped_without_latest(finished):
    other, run = copy_run(finished, "other-from"), copy_run(finished, "mine-from")
    link = run / "checkpoints" / "step-00000009"
    link.symlink_to(other / "checkpoints" / "step-00000006")
    code, _, stderr = run_captured(resume_argv(run, "--from", "9", "--steps", "12"))
    assert code == 2 and str(other / "checkpoints" / "step-00000006") in stderr, stderr
    (run / "checkpoints" / "latest").unlink()
    code, stdout, stderr = run_captured(resume_argv(run, "--steps", "7"))
    assert code == 0, stderr
    assert "resuming from the newest complete checkpoint, step-00000006" in stdout  # its own, not the link


# ----------------------------------------------------------------------------- what metrics.jsonl holds


def test_a_torn_last_metrics_line_is_dropped_with_a_note(finished):
    """A writer killed (or out of space) in the middle of a line leaves it without its newline:
    the resume drops it, says so naming the file, and continues the curve."""
    run = copy_run(finished, "torn")
    rewind(run, 3)
    metrics = run / "metrics.jsonl"
    torn_line = len(metrics.read_text().splitlines()) + 1
    with open(metrics, "a") as handle:
        handle.write('{"step": 7, "loss": 1.2')
    code, stdout, stderr = run_captured(resume_argv(run))
    assert code == 0, stderr
    assert f"dropped the last line of {metrics} (line {torn_line})" in stdout, stdout
    assert curve(run) == curve(finished[1])


@pytest.mark.parametrize("bad", ["not json", "[1, 2]", "7", '{"loss": 1.0}'])
def test_a_bad_metrics_line_is_an_error_naming_the_file_and_line(finished, bad):
    run = copy_run(finished, f"bad-line-{len(bad)}")
    rewind(run, 3)
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([*lines[:2], bad, *lines[2:]]) + "\n")
    code, _, stderr = run_captured(resume_argv(run))
    assert code == 2, stderr
    assert stderr.startswith(f"linattn: error: line 3 of {metrics} ") and stderr.count("\n") == 1, stderr


def test_a_folder_with_only_metrics_is_told_the_command_that_starts_it(finished):
    """A run stopped before its first checkpoint leaves metrics.jsonl alone: --resume cannot
    continue it, and names the command that can start it again."""
    root, _ = finished
    run = root / "metrics-only"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    code, _, stderr = run_captured(resume_argv(run))
    assert code == 2, stderr
    assert "holds no checkpoint to resume" in stderr and f"linattn train --out {run} --overwrite" in stderr, stderr
    code, stdout, stderr = run_captured(six_steps(root / "corpus.txt", run) + ["--overwrite"])
    assert code == 0, stderr
    assert load_checkpoint(run).step == 6 and (root / "metrics-only.old-1" / "metrics.jsonl").is_file()


# ----------------------------------------------------------------------------- the thread count


def test_the_thread_count_is_recorded_and_a_resume_at_another_says_so(finished):
    """Results are bit-exact for a fixed thread count only: each checkpoint records it, and a
    resume at another count warns (one line) naming both."""
    assert load_checkpoint(finished[1]).meta["threads"] == 1
    try:
        for threads, warned in ((2, True), (1, False)):
            run = copy_run(finished, f"threads-{threads}")
            rewind(run, 3)
            code, stdout, stderr = run_captured(resume_argv(run, "--threads", str(threads)))
            assert code == 0, stderr
            warnings = [line for line in stdout.splitlines() if line.startswith("warning:")]
            if warned:
                assert len(warnings) == 1, stdout
                assert "resuming at 2 torch threads" in warnings[0] and "was trained at 1" in warnings[0]
                assert "no longer bit-identical" in warnings[0] and "--threads 1" in warnings[0]
                assert load_checkpoint(run).meta["threads"] == 2
            else:
                assert warnings == [] and curve(run) == curve(finished[1]), stdout
    finally:
        torch.set_num_threads(1)


# ----------------------------------------------------------------------------- the data: path and fingerprint


@pytest.fixture(scope="module")
def two_folders(tmp_path_factory):
    """Folders A and B, each with its own data.txt, and a finished 6-step run trained in A on
    ``--data data.txt`` (relative)."""
    root = tmp_path_factory.mktemp("folders")
    a, b = root / "A", root / "B"
    a.mkdir()
    b.mkdir()
    (a / "data.txt").write_text(english_like(4000, seed=1))
    (b / "data.txt").write_text(english_like(4000, seed=2))
    run = root / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(a)
        code, _, stderr = run_captured(six_steps("data.txt", run))
    assert code == 0, stderr
    return a, b, run


def test_a_relative_data_path_is_recorded_absolute_with_the_datas_fingerprint(two_folders):
    a, _, run = two_folders
    meta = load_checkpoint(run).meta
    assert meta["train_config"]["data"] == str((a / "data.txt").resolve())
    assert meta["data_fingerprint"] == {"kind": "corpus", "files": {"data.txt": file_record(a / "data.txt")}}


def test_a_resume_from_another_folder_reads_the_runs_data_not_the_data_txt_there(two_folders, monkeypatch):
    a, b, run = two_folders
    resumed = run.parent / "resumed-in-b"
    shutil.copytree(run, resumed)
    rewind(resumed, 3)
    monkeypatch.chdir(b)
    code, _, stderr = run_captured(resume_argv(resumed))
    assert code == 0, stderr
    assert curve(resumed) == curve(run)  # B's data.txt (other text) would give another curve
    for name, value in load_checkpoint(run).model.items():
        assert torch.equal(load_checkpoint(resumed).model[name], value), name


@pytest.fixture
def own_data(tmp_path, request):
    """The data file ``tmp_path/A/data.txt`` (its own, so a test may change it), a 6-step run on
    it rewound to step 3, and a copy of the finished run. Trained on ``--data`` given as an
    absolute path, or (``indirect`` parameter ``"relative"``) as ``data.txt`` inside A."""
    a = tmp_path / "A"
    a.mkdir()
    data = a / "data.txt"
    data.write_text(english_like(4000, seed=1))
    run = tmp_path / "run"
    with pytest.MonkeyPatch.context() as patch:
        if getattr(request, "param", "absolute") == "relative":
            patch.chdir(a)
        code, _, stderr = run_captured(six_steps("data.txt" if Path.cwd() == a else data, run))
    assert code == 0, stderr
    reference = tmp_path / "reference"
    shutil.copytree(run, reference)
    rewind(run, 3)
    return data.resolve(), run, reference


@pytest.mark.parametrize("own_data", ["relative"], indirect=True)
def test_data_replaced_at_the_recorded_path_is_refused_and_accepted_with_the_flag(own_data, tmp_path, monkeypatch):
    """The run's data.txt (in A) now holds B's text: a resume from B is refused, naming the
    path, the change and the flag; with --accept-new-data it trains on the new text, says so
    once, and its checkpoints record the new fingerprint."""
    data, run, _ = own_data
    b = tmp_path / "B"
    b.mkdir()
    (b / "data.txt").write_text(english_like(4100, seed=2))
    recorded = file_record(data)
    shutil.copyfile(b / "data.txt", data)
    monkeypatch.chdir(b)
    before = (run / "metrics.jsonl").read_text()
    code, _, stderr = run_captured(resume_argv(run))
    assert code == 2
    assert f"the data {data} is not what" in stderr and "--accept-new-data" in stderr, stderr
    assert (f"data.txt changed: recorded 4000 bytes, SHA-256 {recorded['sha256'][:12]}, now 4100 bytes, SHA-256 "
            f"{file_record(data)['sha256'][:12]}") in stderr, stderr
    assert (run / "metrics.jsonl").read_text() == before and load_checkpoint(run).step == 3
    code, out, stderr = run_captured(resume_argv(run, "--accept-new-data"))
    assert code == 0, stderr
    assert out.count("continuing on changed data (--accept-new-data)") == 1 and str(data) in out, out
    checkpoint = load_checkpoint(run)
    assert checkpoint.step == 6
    assert checkpoint.meta["data_fingerprint"] == {"kind": "corpus", "files": {"data.txt": file_record(data)}}


def test_data_edited_in_place_is_found_on_resume_and_on_eval(own_data, capsys):
    data, run, reference = own_data
    text = data.read_text()
    edited = text[:1000] + ("x" if text[1000] != "x" else "y") + text[1001:]  # one letter, same size
    assert edited != text
    data.write_text(edited)
    capsys.readouterr()
    assert main(resume_argv(run)) == 2
    err = capsys.readouterr().err
    assert f"the data {data} is not what" in err and "data.txt changed: recorded 4000 bytes" in err, err
    eval_argv = ["eval", "--ckpt", str(reference), "--split", "validation", "--json", "--no-progress",
                 "--threads", "1"]
    assert main(eval_argv) == 2
    err = capsys.readouterr().err
    assert f"eval: the data {data} is not what" in err and "--accept-new-data" in err, err
    assert main(eval_argv + ["--accept-new-data"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step"] == 6 and "evaluating on changed data" in captured.err
    assert main(eval_argv + ["--data", str(data)]) == 0  # data named explicitly is not checked


def test_unchanged_data_evaluates_silently(own_data, capsys):
    _, _, reference = own_data
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(reference), "--json", "--no-progress", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step"] == 6 and captured.err == ""
    # the flag is for the run's own data; with --data it means nothing
    assert main(["eval", "--ckpt", str(reference), "--data", "x", "--accept-new-data", "--no-progress"]) == 2
    assert "--accept-new-data: --data names the data to evaluate on" in capsys.readouterr().err


def test_missing_data_is_refused_by_name_on_resume_and_on_eval(own_data, capsys):
    data, run, reference = own_data
    data.rename(data.with_name("moved.txt"))
    capsys.readouterr()
    for argv in (resume_argv(run), resume_argv(run, "--accept-new-data")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"the run's data {data} is missing (moved or deleted" in err, err
    assert main(["eval", "--ckpt", str(reference), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"the run's data {data} is missing" in err and "--data PATH" in err, err


def test_the_python_api_refuses_changed_data_unless_accept_new_data(own_data):
    data, run, _ = own_data
    data.write_text(english_like(3000, seed=5))
    with pytest.raises(ValueError, match=r"accept_new_data=True") as info:
        trainer_module.train(None, None, resume=True, out=run, progress=False, echo=lambda *a: None)
    assert "data.txt changed: recorded 4000 bytes" in str(info.value)
    said = []
    summary = trainer_module.train(None, None, resume=True, out=run, progress=False, echo=said.append,
                                   accept_new_data=True)
    assert summary["step"] == 6 and sum("continuing on changed data" in line for line in said) == 1


def test_accept_new_data_without_resume_is_refused(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(english_like(4000))
    assert main(six_steps(corpus, tmp_path / "run") + ["--accept-new-data"]) == 2
    assert "add --resume" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_changed_shard_folder_is_refused(tmp_path, capsys):
    """Shards prepared again from other text at the same path: their meta.json and .bin sizes
    differ from what the checkpoint recorded."""
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text(english_like(4000, seed=1))
    second.write_text(english_like(5000, seed=2))
    shards = tmp_path / "shards"
    assert main(["data", "prepare", "--data", str(first), "--tokenizer", "bytes", "--out", str(shards)]) == 0
    run = tmp_path / "run"
    assert main(six_steps(shards, run)) == 0
    recorded = load_checkpoint(run).meta["data_fingerprint"]
    assert recorded["kind"] == "shards"
    assert recorded["files"]["meta.json"] == file_record(shards / "meta.json")
    assert recorded["files"]["train.bin"] == file_record(shards / "train.bin")
    rewind(run, 3)
    shutil.rmtree(shards)
    assert main(["data", "prepare", "--data", str(second), "--tokenizer", "bytes", "--out", str(shards)]) == 0
    capsys.readouterr()
    assert main(resume_argv(run)) == 2
    err = capsys.readouterr().err
    assert f"the data {shards} is not what" in err and "meta.json changed" in err, err
    before, after = recorded["files"]["train.bin"]["sha256"], file_record(shards / "train.bin")["sha256"]
    assert (f"train.bin changed: recorded {4000 * 90 // 100} bytes, SHA-256 {before[:12]}, "
            f"now {5000 * 90 // 100} bytes, SHA-256 {after[:12]}") in err, err


def _shards_and_run(tmp_path: Path, *, hashed: bool) -> tuple[Path, Path]:
    """Byte shards of English text (with the hashes of their splits in meta.json, or without, as
    an older linattn wrote them) and a 6-step run on them rewound to step 3."""
    text = tmp_path / "text.txt"
    text.write_text(english_like(4000, seed=1))
    shards = tmp_path / "shards"
    assert main(["data", "prepare", "--data", str(text), "--tokenizer", "bytes", "--out", str(shards)]) == 0
    if not hashed:
        meta = read_meta(shards)
        for split in meta["splits"].values():
            split.pop("sha256", None), split.pop("max_token_id", None)
        (shards / "meta.json").write_text(json.dumps(meta, indent=1))
    run = tmp_path / "run"
    assert main(six_steps(shards, run)) == 0
    rewind(run, 3)
    return shards, run


def _edit_at_the_same_size(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100:110] = b"y" * 10 if data[100:110] == b"x" * 10 else b"x" * 10
    path.write_bytes(bytes(data))


def test_a_shard_edited_at_the_same_size_is_refused_on_resume_on_eval_and_by_a_new_run(tmp_path, capsys):
    """meta.json records the SHA-256 of every split; a split that no longer has it is refused,
    whatever --accept-new-data says (the folder contradicts itself: prepare it again)."""
    shards, run = _shards_and_run(tmp_path, hashed=True)
    recorded = read_meta(shards)["splits"]["train"].get("sha256")
    _edit_at_the_same_size(shards / "train.bin")
    now = file_record(shards / "train.bin")["sha256"]
    capsys.readouterr()
    for argv in (resume_argv(run), resume_argv(run, "--accept-new-data"),
                 ["eval", "--ckpt", str(run), "--no-progress", "--threads", "1"],
                 six_steps(shards, tmp_path / "fresh")):
        code, err = main(argv), capsys.readouterr().err
        assert code == 2 and err.startswith("linattn: error: ") and err.count("\n") == 1, (argv, err)
        assert (f"{shards / 'train.bin'} does not hold the tokens {shards / 'meta.json'} records: SHA-256 "
                f"{now[:12]}, recorded {recorded[:12]}") in err, err
    assert load_checkpoint(run).step == 3 and not (tmp_path / "fresh" / "checkpoints").exists()


def test_a_shard_folder_without_hashes_is_hashed_when_a_run_starts_and_checked_on_resume(tmp_path, capsys):
    """A folder an older linattn prepared (no hashes in meta.json) still trains; the run's
    checkpoints record the SHA-256 of each split, so an edit after that is found on resume."""
    shards, run = _shards_and_run(tmp_path, hashed=False)
    recorded = file_record(shards / "train.bin")
    assert load_checkpoint(run).meta["data_fingerprint"]["files"]["train.bin"] == recorded
    _edit_at_the_same_size(shards / "train.bin")
    capsys.readouterr()
    assert main(resume_argv(run)) == 2
    err = capsys.readouterr().err
    assert (f"train.bin changed: recorded {recorded['bytes']} bytes, SHA-256 {recorded['sha256'][:12]}, now "
            f"{recorded['bytes']} bytes, SHA-256 {file_record(shards / 'train.bin')['sha256'][:12]}") in err, err
    assert main(resume_argv(run, "--accept-new-data")) == 0
    assert load_checkpoint(run).step == 6


def test_a_checkpoint_that_recorded_the_sizes_of_shards_only_compares_their_sizes():
    """Checkpoints of an older linattn recorded each .bin by its size alone."""
    recorded = {"kind": "shards", "files": {"train.bin": {"bytes": 10}}}
    current = {"kind": "shards", "files": {"train.bin": {"bytes": 10, "sha256": "a" * 64}}}
    assert fingerprint_changes(recorded, current) is None
    current["files"]["train.bin"]["bytes"] = 12
    assert fingerprint_changes(recorded, current) == \
        f"train.bin changed: recorded 10 bytes, now 12 bytes, SHA-256 {'a' * 12}"


def test_fingerprint_changes_name_missing_new_and_changed_files_and_another_kind():
    recorded = {"kind": "corpus", "files": {"a.txt": {"bytes": 3, "sha256": "1" * 64},
                                            "b.txt": {"bytes": 4, "sha256": "2" * 64}}}
    assert fingerprint_changes(recorded, json.loads(json.dumps(recorded))) is None
    current = {"kind": "corpus", "files": {"a.txt": {"bytes": 3, "sha256": "3" * 64},
                                           "c.txt": {"bytes": 5, "sha256": "4" * 64}}}
    assert fingerprint_changes(recorded, current) == (
        f"a.txt changed: recorded 3 bytes, SHA-256 {'1' * 12}, now 3 bytes, SHA-256 {'3' * 12}; "
        f"b.txt is missing (recorded 4 bytes, SHA-256 {'2' * 12}); c.txt is new (5 bytes, SHA-256 {'4' * 12})")
    assert fingerprint_changes(recorded, {"kind": "shards", "files": {}}) == \
        "it was a byte corpus, now it is a shard folder"


# ----------------------------------------------------------------------------- every rank the same verdict


def _checkpoint_of(data: Path) -> Checkpoint:
    meta = {"data_fingerprint": {"kind": "corpus", "files": {data.name: file_record(data)}}}
    return Checkpoint(path=data.parent / "step-00000003", meta=meta, model={}, training={})


def test_a_rank_with_good_data_stops_when_another_rank_refuses_and_names_its_problem(tmp_path, monkeypatch):
    """Rank 0's data is what its checkpoint recorded, rank 1's checkpoint recorded other data:
    rank 1 stops with its own refusal, and rank 0 stops too, naming rank 1 and its problem."""
    data = tmp_path / "data.txt"
    data.write_text(english_like(4000))
    recorded_before = _checkpoint_of(data)
    data.write_text(english_like(4000, seed=3))
    recorded_now = _checkpoint_of(data)
    monkeypatch.setattr(distributed, "barrier", lambda context: None)

    def load(context):
        checkpoint = recorded_now if context.rank == 0 else recorded_before
        return trainer_module._load_data(TrainConfig(data=str(data)), context, checkpoint)

    rank0, rank1 = ranks_in_threads(2, tmp_path / "store", load)
    assert isinstance(rank1, ValueError) and "data.txt changed" in str(rank1)
    assert isinstance(rank0, RelayedError)
    assert re.fullmatch(r"rank 1 of 2 \(on .+\) stopped before training: --resume: the data .*data\.txt is not "
                        r"what .* was trained on: data\.txt changed: .*", str(rank0))
