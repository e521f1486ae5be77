"""``linattn repro fwp-capacity`` / ``fwp-update-rule``: data generators, the retrieval model
against the paper's update rules written out by hand, training, and the commands end to end."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn.functional as F

import linattn.repro.cli
from linattn.feature_maps import get_feature_map
from linattn.repro import fwp_retrieval as fwp, mqar, spread

PNG = b"\x89PNG\r\n\x1a\n"


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- data ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_queries", [1, 3, None])
def test_capacity_batch_pairs_a_permutation_and_targets_the_paired_value(num_queries):
    S, B = 9, 6
    batch = fwp.make_capacity_batch(B, S, num_queries=num_queries, generator=_gen())
    Q = S if num_queries is None else num_queries
    assert batch.keys.shape == batch.values.shape == (B, S)
    assert batch.queries.shape == batch.targets.shape == batch.mask.shape == (B, Q)
    assert batch.mask.all()
    for b in range(B):
        keys, values = batch.keys[b].tolist(), batch.values[b].tolist()
        assert sorted(keys) == list(range(S)) and sorted(values) == list(range(S))  # without replacement
        paired = dict(zip(keys, values))
        queries = batch.queries[b].tolist()
        assert len(set(queries)) == len(queries)
        if num_queries is None:
            assert sorted(queries) == list(range(S))  # every key asked
        for q, t in zip(queries, batch.targets[b].tolist()):
            assert t == paired[q]
    # The pairing is random (not the identity), and a seed reproduces the batch.
    assert any(batch.keys[b].tolist() != batch.values[b].tolist() for b in range(B))
    again = fwp.make_capacity_batch(B, S, num_queries=num_queries, generator=_gen())
    assert torch.equal(again.keys, batch.keys) and torch.equal(again.targets, batch.targets)
    other = fwp.make_capacity_batch(B, S, num_queries=num_queries, generator=_gen(1))
    assert not torch.equal(other.keys, batch.keys)


def _last_values(keys: list[int], values: list[int]) -> dict[int, int]:
    last = {}
    for k, v in zip(keys, values):  # later occurrences overwrite earlier ones
        last[k] = v
    return last


@pytest.mark.parametrize("num_queries", [1, 4, None])
def test_update_rule_batch_targets_the_value_of_the_last_occurrence(num_queries):
    S, B = 6, 40
    batch = fwp.make_update_rule_batch(B, S, num_queries=num_queries, generator=_gen(3))
    assert batch.keys.shape == batch.values.shape == (B, 2 * S)
    overwritten = 0
    for b in range(B):
        keys, values = batch.keys[b].tolist(), batch.values[b].tolist()
        last = _last_values(keys, values)
        first = {}
        for k, v in zip(keys, values):
            first.setdefault(k, v)
        for q, t, m in zip(batch.queries[b].tolist(), batch.targets[b].tolist(), batch.mask[b].tolist()):
            if num_queries is None:
                assert m == (q in last)  # every occurring key asked, absent ones masked out
            else:
                assert m
            if m:
                assert q in keys
                assert t == last[q]
                overwritten += first[q] != last[q]
        if num_queries is None:
            assert batch.queries[b].tolist() == list(range(S))
    assert overwritten > 0  # the task is not solvable by the first occurrence
    assert len(set(batch.keys[0].tolist())) < 2 * S  # drawn with replacement


def test_last_occurrence_matches_a_python_loop():
    keys = torch.randint(5, (7, 13), generator=_gen(4))
    last = fwp.last_occurrence(keys, 5)
    for b in range(7):
        expected = [-1] * 5
        for position, k in enumerate(keys[b].tolist()):
            expected[k] = position
        assert last[b].tolist() == expected


def test_generators_reject_bad_sizes():
    with pytest.raises(ValueError, match="num_keys"):
        fwp.make_capacity_batch(2, 1)
    with pytest.raises(ValueError, match="seq_len"):
        fwp.make_capacity_batch(2, 4, seq_len=5)
    with pytest.raises(ValueError, match="num_queries"):
        fwp.make_capacity_batch(2, 4, num_queries=5)
    with pytest.raises(ValueError, match="batch_size"):
        fwp.make_update_rule_batch(0, 4)


# --- model --------------------------------------------------------------------------


def test_softmax_model_retrieves_with_orthogonal_keys():
    """Keys = scaled one-hot embeddings of the key, query = the same: softmax attention
    returns the paired one-hot value exactly."""
    S = 5
    model = fwp.RetrievalModel(S, fwp.RETRIEVAL_MECHANISMS["softmax"], key_dim=S, emb_dim=S)
    with torch.no_grad():
        model.embedding.weight.copy_(10.0 * torch.eye(S))
        model.write_key.weight.zero_()
        model.write_key.weight[:, S:] = torch.eye(S)  # k = e(key), the value part ignored
        model.write_key.bias.zero_()
        model.query.weight.copy_(torch.eye(S))
        model.query.bias.zero_()
    batch = fwp.make_capacity_batch(3, S, num_queries=None, generator=_gen())
    pred = model(batch.keys, batch.values, batch.queries)
    assert pred.shape == (3, S, S)
    torch.testing.assert_close(pred, F.one_hot(batch.targets, S).float(), atol=1e-6, rtol=0)
    assert fwp.retrieval_loss(pred, batch).item() < 1e-10


def _reference_read(model: fwp.RetrievalModel, batch: fwp.RetrievalBatch) -> torch.Tensor:
    """The paper's update rules, step by step (the official code's "sum" and "ours")."""
    S, mech = model.num_keys, model.mechanism
    k = model._project_pairs(model.write_key, batch.keys, batch.values)
    q = F.embedding(batch.queries, model.embedding.weight @ model.query.weight.t() + model.query.bias)
    v = F.one_hot(batch.values, S).float()
    fmap = get_feature_map(mech.feature_map)
    phi_k, phi_q = fmap(k, is_query=False), fmap(q, is_query=True)
    if mech.rule == "sum":
        W = torch.einsum("blv,blp->bvp", v, phi_k)
        z = phi_k.sum(1)
        return torch.einsum("bvp,bqp->bqv", W, phi_q) / (torch.einsum("bp,bqp->bq", z, phi_q).unsqueeze(-1) + 1e-6)
    beta = torch.sigmoid(model._project_pairs(model.beta, batch.keys, batch.values))  # [B, L, 1]
    W = torch.zeros(k.shape[0], S, phi_k.shape[-1])
    for i in range(k.shape[1]):
        key = phi_k[:, i] / (phi_k[:, i].sum(-1, keepdim=True) + 1e-6)
        v_bar = torch.einsum("bvp,bp->bv", W, key)
        W = W + torch.einsum("bv,bp->bvp", beta[:, i] * (v[:, i] - v_bar), key)
    return torch.einsum("bvp,bqp->bqv", W, phi_q / (phi_q.sum(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("name", ["linear-elu", "dpfp-2", "delta-dpfp-1", "delta-linear"])
def test_kernel_models_match_the_papers_update_rules(name):
    torch.manual_seed(0)
    S = 6
    model = fwp.RetrievalModel(S, fwp.RETRIEVAL_MECHANISMS[name], key_dim=8)
    batch = fwp.make_update_rule_batch(3, S, num_queries=None, generator=_gen(5))
    with torch.no_grad():
        pred = model(batch.keys, batch.values, batch.queries)
        torch.testing.assert_close(pred, _reference_read(model, batch), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(fwp.RETRIEVAL_MECHANISMS))
def test_queries_read_the_final_memory_and_never_write(name):
    """Asking more queries changes no answer (queries do not write, nor see each other)."""
    torch.manual_seed(0)
    S = 7
    model = fwp.RetrievalModel(S, fwp.RETRIEVAL_MECHANISMS[name], key_dim=8)
    batch = fwp.make_update_rule_batch(2, S, num_queries=None, generator=_gen(6))  # Q = S < L = 2S
    with torch.no_grad():
        every = model(batch.keys, batch.values, batch.queries)
        for j in (0, 3, S - 1):
            one = model(batch.keys, batch.values, batch.queries[:, j : j + 1])
            torch.testing.assert_close(one[:, 0], every[:, j], atol=1e-5, rtol=1e-5)
        # More queries than pairs; a single query takes the scores-first order of the sum rule.
        short = batch.keys[:, :3], batch.values[:, :3]
        many = model(*short, batch.queries)
        for j in range(S):
            torch.testing.assert_close(
                many[:, j], model(*short, batch.queries[:, j : j + 1])[:, 0], atol=1e-5, rtol=1e-5
            )


def test_favor_projection_is_fixed_within_a_run_and_seeded():
    mech = fwp.RETRIEVAL_MECHANISMS["favor-64"]
    a, b = mech.make_feature_map(3), mech.make_feature_map(3)
    torch.testing.assert_close(a.projection(16), b.projection(16))
    assert not torch.equal(a.projection(16), mech.make_feature_map(4).projection(16))
    model = fwp.RetrievalModel(6, mech, key_dim=16, feature_seed=3)
    batch = fwp.make_capacity_batch(2, 6, num_queries=None, generator=_gen())
    with torch.no_grad():
        torch.testing.assert_close(model(batch.keys, batch.values, batch.queries),
                                   model(batch.keys, batch.values, batch.queries))


def test_d_dot_of_each_mechanism():
    d = {name: m.d_dot(64) for name, m in fwp.RETRIEVAL_MECHANISMS.items()}
    assert d["linear-elu"] == 64 and d["dpfp-1"] == 128 and d["dpfp-2"] == 256 and d["dpfp-3"] == 384
    assert d["favor-64"] == 64 and d["favor-512"] == 512 and d["softmax"] is None and d["delta-dpfp-2"] == 256


# --- training -----------------------------------------------------------------------


def test_training_reaches_the_target_loss_on_a_small_problem():
    torch.set_num_threads(1)
    config = fwp.RetrievalTrainConfig(max_steps=1500, eval_every=50, seed=0)
    row = fwp.train_run(fwp.SETTINGS["capacity"], fwp.RETRIEVAL_MECHANISMS["softmax"], 4, config)
    assert row["stop_reason"] == "target", row
    assert row["final_eval_loss"] <= 1e-3 and row["final_eval_accuracy"] == 1.0
    assert row["steps"] < 1500 and row["steps"] % 50 == 0
    assert row["curve"][-1] == [row["steps"], row["final_eval_loss"]]


def test_training_stops_on_a_plateau():
    config = fwp.RetrievalTrainConfig(max_steps=10_000, eval_every=1, patience=2, lr=1e-12, seed=0)
    row = fwp.train_run(fwp.SETTINGS["update-rule"], fwp.RETRIEVAL_MECHANISMS["sum-dpfp-1"], 4, config)
    assert row["stop_reason"] == "plateau" and row["steps"] < 200


# --- commands -----------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    linattn.repro.cli.register(sub)
    args = parser.parse_args(argv)
    args.command_line = "test"
    return args


ROW_KEYS = {"mechanism", "label", "rule", "feature_map", "normalize", "d_dot", "size", "seq_len", "emb_dim",
            "final_eval_loss", "best_eval_loss", "final_eval_accuracy", "steps", "evaluations", "stop_reason",
            "train_seconds", "cpu_seconds", "curve"}


@pytest.mark.parametrize("command, plot, length", [("fwp-capacity", "fwp_capacity.png", 1),
                                                   ("fwp-update-rule", "fwp_update_rule.png", 2)])
def test_command_writes_json_markdown_and_plot(tmp_path, capsys, command, plot, length):
    args = _parse(["repro", command, "--quick", "--seeds", "2", "--sizes", "4", "8", "--mechanisms", "softmax",
                   "linear-elu", "--max-steps", "20", "--eval-every", "10", "--threads", "1", "--no-progress", "--out",
                   str(tmp_path)])
    assert args.handler(args) == 0
    assert "| mechanism | d_dot | S=4 | S=8 |" in capsys.readouterr().out

    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result) == {"metadata", "rows", "runs", "summary"}
    meta = result["metadata"]
    assert meta["command"] == "test" and meta["threads"] == 1 and meta["mechanisms"] == ["softmax", "linear-elu"]
    assert meta["shapes"]["sizes"] == [4, 8] and meta["config"]["max_steps"] == 20 and meta["seeds"] == [0, 1]
    rows = result["runs"]
    assert sorted((r["mechanism"], r["size"], r["seed"]) for r in rows) == sorted(
        (m, s, seed) for m in ("softmax", "linear-elu") for s in (4, 8) for seed in (0, 1))
    for row in rows:
        assert set(row) == ROW_KEYS | {"seed"}
        assert row["seq_len"] == length * row["size"]
        assert 10 <= row["steps"] <= 20 and row["evaluations"] == len(row["curve"]) >= 1
        assert row["stop_reason"] in {"target", "plateau", "max_steps"}
        assert row["final_eval_loss"] == row["curve"][-1][1] >= 0
    assert set(result["summary"]) == {"softmax", "linear-elu"}

    markdown = (tmp_path / "results.md").read_text()
    assert markdown.startswith(f"# repro {command}") and "`test`" in markdown
    assert linattn.repro.cli.REPRODUCTIONS[command].page(result) == markdown  # from the JSON alone
    assert "| softmax | ∞ |" in markdown and "| linear-elu | 64 |" in markdown
    assert "n = 2 seeds per row (0, 1)." in markdown
    for row in result["rows"]:  # aggregated over the two seeds
        assert row["n"] == 2 and row["seeds"] == [0, 1] and row["d_dot"] == (None if row["mechanism"] == "softmax"
                                                                              else 64)
        losses = sorted(r["final_eval_loss"] for r in rows if (r["mechanism"], r["size"]) == (row["mechanism"],
                                                                                            row["size"]))
        assert row["metrics"]["final_eval_loss"]["min"] == losses[0] and row["metrics"]["final_eval_loss"]["max"] == \
            losses[1]
        assert f"({losses[0]:.1e}–{losses[1]:.1e})" in markdown
    image = (tmp_path / plot).read_bytes()
    assert image[:8] == PNG
    width, height = int.from_bytes(image[16:20], "big"), int.from_bytes(image[20:24], "big")
    assert width >= 2 * height  # two panels side by side: loss and accuracy against S


def test_registry_lists_both_commands():
    assert {"fwp-capacity", "fwp-update-rule"} <= set(linattn.repro.cli.REPRODUCTIONS)
    for command in linattn.repro.cli.REPRODUCTIONS.values():
        assert command.HELP and command.DESCRIPTION and callable(command.run_command)


@pytest.mark.parametrize("argv", [
    ["repro", "fwp-capacity", "--mechanisms", "nope"],
    ["repro", "fwp-capacity", "--sizes", "1"],
    ["repro", "fwp-update-rule", "--sizes", "0", "4"],
    ["repro", "fwp-update-rule", "--max-steps", "0"],
    ["repro", "fwp-capacity", "--lr", "-1"],
])
def test_bad_arguments_exit_with_code_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv)
    assert exit_info.value.code == 2


def test_bad_values_raise_value_error(tmp_path):
    setting, config = fwp.SETTINGS["capacity"], fwp.RetrievalTrainConfig(max_steps=1)
    with pytest.raises(ValueError, match="unknown mechanism"):
        fwp.run_grid(setting, ["nope"], [4], config, progress=False)
    with pytest.raises(ValueError, match=">= 2"):
        fwp.run_grid(setting, ["softmax"], [1], config, progress=False)
    with pytest.raises(ValueError, match="max_steps"):
        fwp.run_grid(setting, ["softmax"], [4], fwp.RetrievalTrainConfig(max_steps=0), progress=False)


def test_worker_processes_give_the_same_rows():
    setting, config = fwp.SETTINGS["update-rule"], fwp.RetrievalTrainConfig(max_steps=20, eval_every=10, seed=3)
    grid = dict(mechanisms=["sum-dpfp-1", "delta-linear"], sizes=[4, 6])
    serial = fwp.run_grid(setting, **grid, config=config, progress=False)
    parallel = fwp.run_grid(setting, **grid, config=config, jobs=2, threads=1, progress=False)
    keys = ("mechanism", "size", "final_eval_loss", "steps", "stop_reason", "curve")
    assert [[r[k] for k in keys] for r in parallel] == [[r[k] for k in keys] for r in serial]
    assert [(r["mechanism"], r["size"]) for r in serial] == [(m, s) for m in grid["mechanisms"] for s in grid["sizes"]]


@pytest.mark.parametrize("bad", [{"jobs": 0}, {"jobs": 1.5}, {"threads": 0}, {"threads": True}])
def test_bad_jobs_or_threads_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        fwp.run_grid(
            fwp.SETTINGS["capacity"], ["softmax"], [4], fwp.RetrievalTrainConfig(max_steps=1), progress=False, **bad
        )
    with pytest.raises(ValueError, match=next(iter(bad))):
        mqar.run_grid(["softmax"], [16], [(32, 2)], mqar.MQARConfig(steps=1), progress=False, **bad)


def _run(mechanism, d_dot, size, loss, accuracy=1.0, seed=0):
    return {"mechanism": mechanism, "label": mechanism, "d_dot": d_dot, "size": size, "final_eval_loss": loss,
            "final_eval_accuracy": accuracy, "steps": 100, "stop_reason": "target", "seq_len": size, "seed": seed,
            "rule": "sum", "feature_map": "x", "normalize": False, "emb_dim": 8}


def _aggregate(runs):
    return spread.aggregate(runs, identity=fwp.ROW_IDENTITY, constants=fwp.ROW_CONSTANTS)


def test_summary_names_the_capacity_and_a_mechanism_that_never_solves():
    runs = [_run("dpfp-1", 128, 40, 1e-4), _run("dpfp-1", 128, 80, 5e-4), _run("dpfp-1", 128, 160, 0.1, 0.95),
            _run("linear-elu", 64, 40, 0.2, 0.6), _run("linear-elu", 64, 80, 0.3, 0.4),
            _run("linear-elu", 64, 160, 1e-4, 1.0)]
    rows = _aggregate(runs)
    config = fwp.RetrievalTrainConfig()
    summary = fwp.summarize(rows, target_loss=config.target_loss)
    assert summary["dpfp-1"]["largest_size_all_solved"] == 80 and summary["dpfp-1"]["solved_sizes"] == [40, 80]
    assert summary["linear-elu"]["largest_size_all_solved"] is None and summary["linear-elu"]["solved_sizes"] == [160]
    # Accuracy levels count the unbroken run of sizes from the smallest: elu's late 100% does not.
    assert summary["dpfp-1"]["largest_size_accuracy_at_least"] == {"0.99": 80, "0.9": 160, "0.5": 160}
    assert summary["linear-elu"]["largest_size_accuracy_at_least"] == {"0.99": None, "0.9": None, "0.5": 40}
    text = fwp.markdown_report(rows, runs, title="t", command="c", setting=fwp.SETTINGS["capacity"], config=config,
                               summary=summary)
    assert "n = 1 seed per row (0)." in text and "| dpfp-1 | 128 | 1.0e-04 | 5.0e-04 | 1.0e-01 |" in text
    assert "| dpfp-1 | 128 | 100.0% | 100.0% | 95.0% |" in text and "| dpfp-1 | 128 | 100t | 100t | 100t |" in text
    assert "| mechanism | d_dot | loss <= 0.001 | accuracy >= 99% | accuracy >= 90% | accuracy >= 50% |" in text
    assert "| dpfp-1 | 128 | 80 | 80 | 160 | 160 |" in text and "| linear-elu | 64 | — | — | — | 40 |" in text
    assert "- dpfp-1 (d_dot 128): every S up to 80 reached loss <= 0.001; reached at S = 40, 80" in text
    assert "- linear-elu (d_dot 64): the smallest S missed loss <= 0.001; reached at S = 160" in text
    never = fwp.summarize(rows[3:5], target_loss=config.target_loss)
    text = fwp.markdown_report(rows[3:5], runs[3:5], title="t", command="c", setting=fwp.SETTINGS["capacity"],
                               config=config, summary=never)
    assert "- linear-elu (d_dot 64): no S reached loss <= 0.001" in text


def test_with_several_seeds_a_size_is_solved_only_when_every_seed_solved_it():
    runs = [_run("dpfp-1", 128, 40, 1e-4, seed=0), _run("dpfp-1", 128, 40, 2e-4, 0.995, seed=1),
            _run("dpfp-1", 128, 80, 5e-4, seed=0), _run("dpfp-1", 128, 80, 0.2, 0.95, seed=1),
            _run("dpfp-1", 128, 160, float("nan"), seed=0), _run("dpfp-1", 128, 160, 1e-4, seed=1)]
    rows = _aggregate(runs)
    summary = fwp.summarize(rows, target_loss=1e-3)["dpfp-1"]
    # S = 80: seed 1 missed; S = 160: seed 0's loss is not a number, so not every seed reached it
    assert summary["solved_sizes"] == [40] and summary["largest_size_all_solved"] == 40
    assert summary["largest_size_accuracy_at_least"] == {"0.99": 40, "0.9": 160, "0.5": 160}
    assert summary["final_eval_loss_by_size"]["80"] == pytest.approx((5e-4 + 0.2) / 2)
    text = fwp.markdown_report(rows, runs, title="t", command="c", setting=fwp.SETTINGS["capacity"],
                               config=fwp.RetrievalTrainConfig(target_loss=1e-3), summary={"dpfp-1": summary})
    assert "n = 2 seeds per row (0, 1)." in text and "a size meets a criterion when every seed of it does" in text
    assert "| dpfp-1 | 128 | 100 (tt) | 100 (tt) | 100 (tt) |" in text
    assert "- dpfp-1 (d_dot 128): every S up to 40 reached loss <= 0.001 at every seed; reached at S = 40" in text
