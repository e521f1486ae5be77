"""The processes of a multi-process run agree before the first step (train/startup.py):
settings that differ between them, a process that cannot see the run folder, a checkpoint
that is not the same one, and a process that never comes, each stop every process with an
error that names the settings, values, ranks, path or exchange, instead of a run no
checkpoint describes or a hang.

The launches are ``linattn train`` in 2 processes with the environment torchrun gives them
(``_helpers.run_ranks``; each start costs seconds); the exchanges themselves also run between
threads of this process that meet through a ``FileStore`` (``_helpers.ranks_in_threads``)."""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from linattn.cli import main
from linattn.models import LMConfig
from linattn.train import TrainConfig, load_checkpoint, train
from linattn.train import distributed, startup
from linattn.train.distributed import Context
from _helpers import english_like, free_port, ranks_in_threads, run_ranks
from test_train_parallel import TINY_RUN, model_config, run_config

HOST = socket.gethostname()
START_EVERY = ("Start every process with the same settings (command line, --config file, --set) and the same data, "
               "run folder and checkpoint (only train.threads and train.cache_dir may differ)")


def _quiet(*args) -> None:
    pass


def _error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("linattn")]


def test_a_launcher_giving_rank_1_another_lr_and_checkpoint_every_stops_every_rank_before_a_step(tmp_path):
    """Under the old code this trained rank 0's settings to exit 0 for ``--lr`` and hung both
    processes at the first checkpoint for ``--checkpoint-every``. Now every process refuses
    with the same line, naming both settings, their values and the ranks, before the run
    folder holds anything but its lock; well before the start-up exchange's 120 s wait."""
    (tmp_path / "corpus.txt").write_text(english_like(3000, seed=4))
    common = ["train", "--data", "corpus.txt", "--out", "run", "--steps", "2", "--checkpoint-every", "2",
              "--lr", "0.003", "--eval-every", "0", *TINY_RUN]
    rank0, rank1 = run_ranks(lambda rank: common + (["--lr", "0.001", "--checkpoint-every", "1"] if rank else []),
                             tmp_path, timeout=90)
    assert (rank0.returncode, rank1.returncode) == (2, 2), rank0.stderr[-3000:] + rank1.stderr[-3000:]
    expected = ("the 2 processes of this run disagree on its configuration: train.checkpoint_every is 2 on rank 0, "
                f"1 on rank 1; train.lr is 0.003 on rank 0, 0.001 on rank 1. {START_EVERY}")
    assert _error_lines(rank0) == [f"linattn: error: {expected}"]
    assert _error_lines(rank1) == [f"linattn: error: rank 1: {expected}"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_the_disagreement_names_each_setting_its_values_and_the_ranks_holding_them():
    agreed = {"train.lr": 0.003, "train.seed": 0, "data file a.txt": "3 bytes, SHA-256 111111111111"}
    records = [dict(agreed), {**agreed, "train.lr": 0.001, "train.seed": 1}, dict(agreed),
               {k: v for k, v in agreed.items() if k != "data file a.txt"}, {**agreed, "train.seed": 1}]
    assert startup.disagreement(records, "data") == (
        "the 5 processes of this run disagree on its data: data file a.txt is 3 bytes, SHA-256 111111111111 on "
        "ranks 0-2, 4, (not set) on rank 3; train.lr is 0.003 on ranks 0, 2-4, 0.001 on rank 1; train.seed is 0 on "
        f"ranks 0, 2-3, 1 on ranks 1, 4. {START_EVERY}")
    assert startup.disagreement([dict(agreed), dict(agreed)]) is None


def test_the_record_compared_holds_every_setting_but_those_of_a_host():
    record = startup.run_record(LMConfig(), TrainConfig(threads=3, cache_dir="here"))
    assert record["checkpoint"] == "none (a new run)"
    assert {"train.lr", "train.checkpoint_every", "train.batch_size", "train.steps", "train.seed", "train.data",
            "train.parallel", "train.out", "model.d_model", "model.attention"} <= set(record)
    assert "train.threads" not in record and "train.cache_dir" not in record


@pytest.fixture(scope="module")
def node0_run(tmp_path_factory) -> Path:
    """A run of 2 steps, a checkpoint after each, in ``node0/run`` (its data beside the nodes)."""
    root = tmp_path_factory.mktemp("nodes")
    (root / "corpus.txt").write_text(english_like(3000, seed=5))
    for node in ("node0", "node1"):
        (root / node).mkdir()
    train(model_config(), run_config(root / "corpus.txt", root / "node0" / "run", steps=2, batch_size=2,
                                     checkpoint_every=1, keep_checkpoints=2), progress=False, echo=_quiet)
    return root


def test_a_process_that_cannot_see_the_run_folder_says_so_and_the_others_stop(node0_run):
    """Two "nodes": rank 0 works in node0, which holds the run folder, rank 1 in node1, which
    does not (``--out run`` is not on shared storage). Under the old code rank 1 exited 2
    printing nothing and rank 0 waited for it (30 minutes); now rank 1 names the path and its
    host, and rank 0 stops with rank 1's error, the run untouched."""
    run = node0_run / "node0" / "run"
    metrics = (run / "metrics.jsonl").read_text()
    rank0, rank1 = run_ranks(["train", "--resume", "--out", "run", "--steps", "3", "--threads", "1"],
                             lambda rank: node0_run / f"node{rank}", timeout=90)
    assert (rank0.returncode, rank1.returncode) == (2, 2), rank0.stderr[-3000:] + rank1.stderr[-3000:]
    problem = (f"--resume: the run folder {node0_run / 'node1' / 'run'} does not exist on {HOST}: every process reads "
               f"the checkpoint, so --out must be on storage that every node mounts at the same path")
    assert _error_lines(rank1) == [f"linattn: error: rank 1: {problem}"]
    assert _error_lines(rank0) == [f"linattn: error: rank 1 of 2 (on {HOST}) stopped before training: {problem}"]
    assert (run / "metrics.jsonl").read_text() == metrics
    assert not (node0_run / "node1" / "run").exists()


def test_processes_resuming_different_checkpoints_are_refused_naming_them(node0_run, tmp_path):
    """A node that sees an older copy of the run (its latest checkpoint is step 1, the others'
    step 2): every process refuses, naming both checkpoints by the SHA-256 their meta.json records."""
    run = node0_run / "node0" / "run"
    newest, older = load_checkpoint(run), load_checkpoint(run / "checkpoints" / "step-00000001")
    model, config = LMConfig.from_saved(newest.meta["model_config"]), TrainConfig.from_dict(newest.meta["train_config"])

    def resume(context):
        checkpoint = newest if context.rank == 0 else older
        startup.exchange(context, "configuration", None, startup.run_record(model, config, checkpoint))

    outcomes = ranks_in_threads(2, tmp_path / "store", resume)
    seen = [f"step-0000000{step} (SHA-256 {c.meta['meta_sha256'][:16]})" for step, c in ((2, newest), (1, older))]
    expected = (f"the 2 processes of this run disagree on its configuration: checkpoint is {seen[0]} on rank 0, "
                f"{seen[1]} on rank 1. {START_EVERY}")
    assert [type(outcome) for outcome in outcomes] == [ValueError, ValueError]
    assert [str(outcome) for outcome in outcomes] == [expected, expected]


def test_processes_reading_other_data_of_the_same_size_are_refused_naming_the_file(tmp_path, monkeypatch):
    """Each "node" has its own corpus.txt, as long as the other's but not the same text (the
    old code trained on both): every process refuses, naming the file by size and SHA-256."""
    from linattn.data import data_fingerprint, load_corpus
    from linattn.train import trainer as trainer_module

    corpora = []
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
        corpora.append(tmp_path / f"node{rank}" / "corpus.txt")
        corpora[-1].write_text(english_like(4000, seed=rank))
    assert corpora[0].stat().st_size == corpora[1].stat().st_size
    monkeypatch.setattr(distributed, "barrier", lambda context: None)
    outcomes = ranks_in_threads(2, tmp_path / "store", lambda context: trainer_module._load_data(
        TrainConfig(data=str(corpora[context.rank])), context))
    files = [data_fingerprint(load_corpus(str(path)))["files"]["corpus.txt"] for path in corpora]
    seen = [f"{f['bytes']} bytes, SHA-256 {f['sha256'][:12]}" for f in files]
    expected = (f"the 2 processes of this run disagree on its data: data file corpus.txt is {seen[0]} on rank 0, "
                f"{seen[1]} on rank 1. {START_EVERY}")
    assert [str(outcome) for outcome in outcomes] == [expected, expected]


def test_a_process_that_does_not_arrive_is_named_when_the_exchange_times_out(tmp_path):
    def meet(context):
        if context.rank == 2:
            return "never came"
        startup.exchange(context, "configuration", None, {"train.lr": 0.003})

    outcomes = ranks_in_threads(3, tmp_path / "store", meet, timeout=0.5)
    for rank in (0, 1):
        assert isinstance(outcomes[rank], startup.ExchangeTimeout)
        assert str(outcomes[rank]) == (
            f"rank {rank}: the start-up exchange 'configuration' timed out after 0.5 s: rank 2 of 3 did not arrive "
            "(still starting or reading, stuck, or stopped without reaching it: see their own output). "
            "--dist-timeout SECONDS (train.dist_timeout) sets the wait")


def test_a_rendezvous_that_the_other_processes_never_reach_ends_after_dist_timeout(tmp_path, monkeypatch, capsys):
    """Rank 0 of 2 launched alone: ``--dist-timeout 1`` ends its wait at the rendezvous with the
    address, the wait and how many processes came (the old code had no such option: it
    waited torch's 30 minutes)."""
    port = free_port()
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    (tmp_path / "corpus.txt").write_text(english_like(3000, seed=4))
    code = main(["train", "--data", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "run"), "--steps", "2",
                 "--dist-timeout", "1", *TINY_RUN])
    error = capsys.readouterr().err
    assert code == 2
    assert error.startswith(f"linattn: error: rank 0 of 2: the rendezvous at 127.0.0.1:{port} (MASTER_ADDR:"
                            f"MASTER_PORT) did not bring the 2 processes together within 1 s (")
    assert "1/2 clients joined" in error and error.endswith("--dist-timeout SECONDS (train.dist_timeout) sets the "
                                                            "wait\n")


def test_collective_timeout_is_the_process_group_s_timeout(tmp_path, monkeypatch):
    """``train.collective_timeout`` reaches ``init_process_group`` (None: torch's default per
    backend), which creates the group over the rendezvous store."""
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **options: seen.append((backend, options)))
    store = dist.FileStore(str(tmp_path / "store"), 2)
    for timeout in (7.5, None):
        distributed.setup(Context(rank=1, world_size=2, store=store), "cpu", timeout)
    assert [(backend, options["timeout"], options["rank"], options["world_size"]) for backend, options in seen] == [
        ("gloo", timedelta(seconds=7.5), 1, 2), ("gloo", None, 1, 2)]
    with pytest.raises(ValueError, match=r"^train\.collective_timeout must be a positive number of seconds, got 0$"):
        TrainConfig(collective_timeout=0)
    with pytest.raises(ValueError, match=r"^train\.dist_timeout must be finite and a positive number of seconds"):
        TrainConfig(dist_timeout=float("inf"))
    assert json.dumps(TrainConfig().to_dict())  # the timeouts are recorded with the run


def test_another_rank_prints_its_own_errors_and_a_relayed_one_as_the_first_process_of_its_node(monkeypatch,
                                                                                               capsys):
    """Rank 1's output is silenced, but not its errors: an argument it cannot parse and an error
    it met are printed, prefixed with its rank; an error it learned from another process only
    when it is its node's first process (the old code printed none of them)."""
    from linattn import cli

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(["train", "--lr", "fast"]) == 2
    assert capsys.readouterr().err == ("linattn: error: rank 1: linattn train: error: argument --lr: expected a "
                                       "positive number, got 'fast'\n")
    for local_rank, error, printed in (("1", ValueError("no data here"), True),
                                       ("1", startup.RelayedError("rank 0 of 2 (on a) stopped"), False),
                                       ("0", startup.RelayedError("rank 0 of 2 (on a) stopped"), True)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)

        def fails(args, error=error):
            print("progress and summaries stay silent")
            raise error

        monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(fails))
        assert main(["train"]) == 2
        assert capsys.readouterr() == ("", f"linattn: error: rank 1: {error}\n" if printed else "")


def _parser_running(handler):
    import argparse

    parser = argparse.ArgumentParser(prog="linattn")
    parser.add_argument("command")
    parser.set_defaults(handler=handler)
    return parser
