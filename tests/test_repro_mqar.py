"""``linattn repro mqar``: the MQAR generator (checked by an independent loop over each
sequence), the query-only logits, and the command end to end on a tiny grid."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch

from linattn.models import LM
from linattn.repro import mqar, spread

PNG = b"\x89PNG\r\n\x1a\n"


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="x", required=True)
    command = sub.add_parser("mqar", help=mqar.command.HELP, description=mqar.command.DESCRIPTION)
    mqar.command.add_arguments(command)
    command.set_defaults(handler=mqar.command.run_command)
    return parser


# --- data ---------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len,num_pairs,vocab", [(64, 4, 8192), (33, 8, 64), (16, 4, 12), (128, 16, 8192)])
def test_mqar_batch_layout_checked_by_an_independent_loop(seq_len, num_pairs, vocab):
    B = 24
    inputs, targets = mqar.make_mqar_batch(B, seq_len, num_pairs, vocab_size=vocab, generator=_gen(1))
    assert inputs.shape == targets.shape == (B, seq_len)
    assert inputs.dtype == targets.dtype == torch.int64
    assert int(inputs.min()) >= 0 and int(inputs.max()) < vocab
    half = vocab // 2
    for b in range(B):
        tokens, labels = inputs[b].tolist(), targets[b].tolist()
        pairs = {}
        for i in range(num_pairs):
            key, value = tokens[2 * i], tokens[2 * i + 1]
            assert 1 <= key < half, "keys come from the lower half (0 excluded)"
            assert half <= value < vocab, "values come from the upper half"
            assert key not in pairs, "keys are distinct within a sequence"
            pairs[key] = value
        assert len(set(pairs.values())) == num_pairs, "values are distinct within a sequence"
        asked = []
        for t in range(seq_len):
            if t < 2 * num_pairs:
                assert labels[t] == -100, "no target inside the pair section"
            elif labels[t] != -100:
                assert (t - 2 * num_pairs) % 2 == 0, "query slots are at even offsets after the pairs"
                assert tokens[t] in pairs, "a query is a key of the pair section"
                assert labels[t] == pairs[tokens[t]], "the target is the value paired with the queried key"
                asked.append(tokens[t])
        assert len(asked) == num_pairs, "exactly num_pairs query positions"
        assert sorted(asked) == sorted(pairs), "every key is asked exactly once"
    # targets are -100 everywhere else
    assert int((targets != -100).sum()) == B * num_pairs


def test_mqar_batch_is_seeded_random_and_gaps_follow_a_power_law():
    a1, t1 = mqar.make_mqar_batch(8, 64, 4, generator=_gen(5))
    a2, t2 = mqar.make_mqar_batch(8, 64, 4, generator=_gen(5))
    b1, _ = mqar.make_mqar_batch(8, 64, 4, generator=_gen(6))
    assert torch.equal(a1, a2) and torch.equal(t1, t2)
    assert not torch.equal(a1, b1)
    # Many sequences: small gaps are far more frequent than large ones (p ∝ gap^(a-1)), the
    # filler is spread over the whole vocabulary, and the key order differs from the query order.
    inputs, targets = mqar.make_mqar_batch(2000, 128, 4, generator=_gen(7))
    positions = mqar.query_positions(targets)
    slots = (positions - 8) // 2  # slot index g of each query
    counts = torch.bincount(slots.flatten(), minlength=60).float()
    assert counts[0] > 5 * counts[10:20].mean() and counts[10:20].mean() > counts[50:60].mean()
    assert int(slots.max()) > 40  # the tail is reached
    asked_first = inputs.gather(1, positions[:, :1]).squeeze(1)
    assert (asked_first != inputs[:, 0]).float().mean() > 0.5
    filler = torch.ones_like(targets, dtype=torch.bool)
    filler[:, :8] = False
    filler.scatter_(1, positions, False)
    assert int(inputs[filler].max()) > 8192 * 0.9 and int(inputs[filler].min()) < 8192 * 0.1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(batch_size=2, seq_len=15, num_pairs=4), "seq_len must be >= 4 \\* num_pairs"),
        (dict(batch_size=2, seq_len=64, num_pairs=17), "seq_len must be >= 4 \\* num_pairs"),
        (dict(batch_size=2, seq_len=64, num_pairs=0), "num_pairs"),
        (dict(batch_size=0, seq_len=64, num_pairs=4), "batch_size"),
        (dict(batch_size=2, seq_len=64, num_pairs=4, vocab_size=8), "too few"),
        (dict(batch_size=2, seq_len=64, num_pairs=4, power_a=0.0), "power_a"),
        (dict(batch_size=2, seq_len=64.0, num_pairs=4), "seq_len"),
    ],
)
def test_mqar_batch_rejects_impossible_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mqar.make_mqar_batch(**kwargs)


def test_smallest_possible_sequence_asks_every_slot():
    inputs, targets = mqar.make_mqar_batch(4, 8, 2, vocab_size=16, generator=_gen())
    assert (targets[:, 4] != -100).all() and (targets[:, 6] != -100).all()
    assert int((targets != -100).sum()) == 8


# --- model helpers ------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", ["softmax", "vq", "local"])
def test_query_logits_equal_the_full_forward_at_the_query_positions(mechanism):
    config = mqar.MQARConfig(vocab_size=64, window=8, block_size=8, codebook_size=8, gau_d_k=16)
    torch.manual_seed(0)
    model = LM(mqar.model_config(mechanism, 16, config)).eval()
    inputs, targets = mqar.make_mqar_batch(3, 32, 4, vocab_size=64, generator=_gen())
    positions = mqar.query_positions(targets)
    logits, aux = mqar.query_logits(model, inputs, positions)
    full, _, full_aux = model(inputs)
    assert logits.shape == (3, 4, 64)
    expected = full.gather(1, positions.unsqueeze(-1).expand(-1, -1, 64))
    torch.testing.assert_close(logits, expected)
    torch.testing.assert_close(aux["commit_loss"], full_aux["commit_loss"])
    assert not model.norm._forward_pre_hooks  # the hook is removed again


def test_model_config_maps_the_mechanisms():
    config = mqar.MQARConfig(window=24)
    specs = {name: mqar.model_config(name, 64, config).attention for name in mqar.MQAR_LAYER_SPECS}
    assert specs == {"softmax": "softmax", "vq": "vq", "delta": "delta", "linear-elu": "linear:elu",
                     "favor": "favor", "local": "local:24", "retnet": "retnet", "gla": "gla",
                     "gated-delta": "gated-delta"}
    vq = mqar.model_config("vq", 64, config)
    assert vq.kmeans_init and vq.dead_code_threshold == 0.5 and vq.n_layers == 2 and vq.vocab_size == 8192
    with pytest.raises(ValueError, match="unknown mechanism"):
        mqar.model_config("mamba", 64, config)


def test_a_short_softmax_run_learns_beyond_chance():
    # Tiny vocabulary and one pair: the model must at least learn to answer with a value.
    config = mqar.MQARConfig(steps=60, batch_size=32, lr=1e-2, vocab_size=16, eval_batches=2)
    row = mqar.train_run("softmax", 32, 16, 1, config)
    assert row["steps"] == 60 and row["status"] == "ok"
    assert row["accuracy"] > 3 / 8  # chance among the 8 values is 1/8
    assert row["final_loss"] < 2.0


# --- command line -------------------------------------------------------------------


def test_command_runs_end_to_end_on_a_tiny_grid(tmp_path):
    out = tmp_path / "mqar"
    args = _parser().parse_args(["mqar", "--quick", "--seeds", "2", "--mechanisms", "softmax", "local", "--d-models",
                                 "16", "--lengths", "32", "--steps", "3", "--batch-size", "4", "--eval-batches", "1",
                                 "--window", "8", "--no-progress", "--out", str(out)])
    args.command_line = "linattn repro mqar --tiny"
    assert args.handler(args) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["metadata"]["command"] == "linattn repro mqar --tiny"
    assert data["metadata"]["config"]["steps"] == 3 and data["metadata"]["seeds"] == [0, 1]
    rows = data["runs"]
    assert [(r["mechanism"], r["d_model"], r["seq_len"], r["num_pairs"], r["seed"]) for r in rows] == [
        ("softmax", 16, 32, 2, 0), ("local", 16, 32, 2, 0), ("softmax", 16, 32, 2, 1), ("local", 16, 32, 2, 1)]
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["steps"] == 3 and r["seconds"] > 0 and r["final_loss"] > 0
        assert r["eval_queries"] == 4 * 2
        for key in ("spec", "eval_loss", "parameters", "loss_curve", "status"):
            assert key in r
    assert rows[1]["spec"] == "local:8"
    markdown = (out / "results.md").read_text()
    assert "| mechanism | d=16, T=32, 2 pairs |" in markdown and "n = 2 seeds per row (0, 1)." in markdown
    means = {}
    for row in data["rows"]:  # aggregated: n = 2, the cell is mean ± std (min–max) of the two seeds' accuracies
        accuracy = sorted(r["accuracy"] for r in rows if r["mechanism"] == row["mechanism"])
        assert row["n"] == 2 and row["seeds"] == [0, 1] and row["spec"] == rows[0 if row["mechanism"] == "softmax"
                                                                                  else 1]["spec"]
        mean, std = sum(accuracy) / 2, abs(accuracy[1] - accuracy[0]) / 2 ** 0.5
        means[row["mechanism"]] = mean
        assert f"| {row['mechanism']} | {mean:.3f} ± {std:.3f} ({accuracy[0]:.3f}–{accuracy[1]:.3f}) |" in markdown
    assert "## Differences" in markdown and "Accuracy, d=16, T=32, 2 pairs (higher is better):" in markdown
    assert f"| softmax |  | {means['softmax'] - means['local']:+.3f}" in markdown
    assert mqar.page(data) == markdown  # from the JSON alone
    assert (out / "mqar_accuracy.png").read_bytes()[:8] == PNG


def test_pairs_option_and_vq_run(tmp_path):
    out = tmp_path / "vq"
    args = _parser().parse_args(["mqar", "--mechanisms", "vq", "--d-models", "16", "--lengths", "32", "48",
                                 "--pairs", "3", "--steps", "2", "--batch-size", "4", "--eval-batches", "1",
                                 "--vocab-size", "64", "--codebook-size", "8", "--block-size", "8", "--gau-d-k", "16",
                                 "--seeds", "1", "--no-progress", "--out", str(out)])
    assert args.handler(args) == 0
    rows = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["seq_len"], r["num_pairs"]) for r in rows] == [(32, 3), (48, 3)]
    assert rows[0]["codebook_usage"] is not None


@pytest.mark.parametrize(
    "argv",
    [
        ["--mechanisms", "mamba"],
        ["--d-models", "0"],
        ["--d-models", "512"],
        ["--lengths", "2"],
        ["--steps", "0"],
        ["--lr", "-1"],
        ["--batch-size", "x"],
    ],
)
def test_bad_arguments_exit_with_code_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["mqar", *argv])
    assert exit_info.value.code == 2


def test_impossible_grids_raise_value_error(tmp_path):
    parser = _parser()
    args = parser.parse_args(["mqar", "--mechanisms", "softmax", "--d-models", "16", "--lengths", "32",
                              "--pairs", "9", "--steps", "1", "--no-progress", "--out", str(tmp_path / "a")])
    with pytest.raises(ValueError, match="seq_len must be >= 4"):
        args.handler(args)
    args = parser.parse_args(["mqar", "--d-models", "18", "--n-heads", "4", "--lengths", "32", "--steps", "1",
                              "--no-progress", "--out", str(tmp_path / "b")])
    with pytest.raises(ValueError, match="divisible by n_heads"):
        args.handler(args)
    args = parser.parse_args(["mqar", "--lengths", "32", "64", "--pairs", "1", "2", "3", "--no-progress",
                              "--out", str(tmp_path / "c")])
    with pytest.raises(ValueError, match="--pairs needs"):
        args.handler(args)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="unknown mechanism"):
        mqar.check_grid(["mamba"], [64], [(64, 4)], mqar.MQARConfig())
    with pytest.raises(ValueError, match="d_model must be an int"):
        mqar.check_grid(["softmax"], [0], [(64, 4)], mqar.MQARConfig())


def test_worker_processes_give_the_same_rows(tmp_path):
    config = mqar.MQARConfig(steps=3, batch_size=4, eval_batches=1, vocab_size=64, window=8)
    grid = dict(mechanisms=["softmax", "linear-elu"], d_models=[16], tasks=[(32, 2)], seeds=[3, 4])
    serial = mqar.run_grid(**grid, config=config, progress=False)
    parallel = mqar.run_grid(**grid, config=config, jobs=2, progress=False)  # the seeds share the pool
    keys = ("mechanism", "d_model", "seq_len", "num_pairs", "accuracy", "eval_loss", "final_loss", "loss_curve")
    assert [[r[k] for k in keys] for r in parallel] == [[r[k] for k in keys] for r in serial]
    assert [r["mechanism"] for r in serial] == ["softmax", "linear-elu"] * 2
    assert serial[0]["loss_curve"] != serial[2]["loss_curve"]  # seeds 3 and 4 are different runs
    alone = mqar.run_grid(grid["mechanisms"], [16], [(32, 2)], replace(config, seed=4), progress=False)
    assert [[r[k] for k in keys] for r in alone] == [[r[k] for k in keys] for r in serial[2:]]


def test_a_diverged_run_is_reported_not_raised(tmp_path):
    config = mqar.MQARConfig(steps=2, batch_size=4, eval_batches=1, vocab_size=64, lr=1e30)
    row = mqar.train_run("softmax", 16, 32, 2, config)
    assert row["status"] == "non_finite" and row["accuracy"] == 0.0 and row["eval_loss"] is None
    runs = [{**row, "seed": 0}]
    rows = spread.aggregate(runs, identity=mqar.ROW_IDENTITY)
    text = mqar.markdown_report(rows, runs, command="x", config=config, metadata={"device_name": "cpu", "threads": 1})
    assert "| softmax | 0.000 ± — (diverged) |" in text
    json.dumps(row, allow_nan=False)
