"""``linattn repro long-range``: the task's generator (checked by an independent parse of every
sequence against the definition written here), the local control's reach, the matched
parameter counts, and the command end to end (``--quick --seeds 2``, resume per seed, bad
arguments refused by name)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from linattn.cli import main
from linattn.models import LM
from linattn.repro import long_range
from linattn.repro.long_range import LongRangeConfig, make_long_range_batch
from linattn.repro.query_task import query_logits, query_positions

PNG = b"\x89PNG\r\n\x1a\n"


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the task, by its definition -------------------------------------------------------------


def _parse(tokens: list[int], labels: list[int], num_facts: int, vocab: int, distance: int) -> int:
    """Check one sequence against the task's definition and return p, the first fact's position.

    Keys [0, K), values [K, 2K), filler [2K, V) with K = V // 4; fact i = key at p + 2i, value
    at p + 2i + 1; question i = the same key at p + 2i + d + 2, its target the value; every
    other position filler with target -100; keys distinct, values distinct."""
    K, N, T = vocab // 4, num_facts, len(tokens)
    key_positions = [t for t, token in enumerate(tokens) if token < K]
    assert len(key_positions) == 2 * N, "each key occurs exactly twice: in its fact and its question"
    facts, questions = key_positions[:N], key_positions[N:]
    p = facts[0]
    assert 0 <= p <= T - 2 * N - distance - 1
    value_positions = set()
    for i in range(N):
        assert facts[i] == p + 2 * i, "the facts form one block k0 v0 k1 v1 ..."
        value = tokens[facts[i] + 1]
        assert K <= value < 2 * K, "a value follows its key"
        value_positions.add(facts[i] + 1)
        assert questions[i] == facts[i] + distance + 2, "the question is d tokens after the fact's value"
        assert questions[i] - (facts[i] + 1) - 1 == distance
        assert tokens[questions[i]] == tokens[facts[i]], "the question repeats the fact's key"
        assert labels[questions[i]] == value, "the target of a question is its fact's value"
    assert len({tokens[t] for t in facts}) == N, "keys are distinct within a sequence"
    assert len({tokens[t] for t in value_positions}) == N, "values are distinct within a sequence"
    for t in range(T):
        if t not in questions:
            assert labels[t] == -100, "only the answers are scored"
        if t not in facts and t not in questions and t not in value_positions:
            assert 2 * K <= tokens[t] < vocab, "every other position is filler"
    return p


@pytest.mark.parametrize("seq_len,num_facts,vocab,distance", [(64, 4, 256, 20), (40, 2, 16, 2), (33, 3, 12, 21),
                                                             (300, 4, 256, 256)])
def test_every_sequence_follows_the_definition(seq_len, num_facts, vocab, distance):
    B = 32
    inputs, targets = make_long_range_batch(B, seq_len, distance, num_facts, vocab, _gen(1))
    assert inputs.shape == targets.shape == (B, seq_len) and inputs.dtype == targets.dtype == torch.int64
    for b in range(B):
        _parse(inputs[b].tolist(), targets[b].tolist(), num_facts, vocab, distance)
    assert int((targets != -100).sum()) == B * num_facts


def test_a_distance_per_row_and_the_start_spread_over_its_whole_range():
    distances = torch.tensor([2, 5, 9, 30, 31, 17] * 300)
    inputs, targets = make_long_range_batch(len(distances), 40, distances, 2, 16, _gen(2))
    starts = [_parse(inputs[b].tolist(), targets[b].tolist(), 2, 16, int(distances[b])) for b in range(len(distances))]
    # p is uniform over [0, T - 2N - d - 1]: every start occurs (d = 31 leaves p in 0..4, d = 2 in 0..33)
    for d in (2, 31):
        seen = {p for p, dist in zip(starts, distances.tolist()) if dist == d}
        assert seen == set(range(40 - 4 - d))


def test_the_generator_is_seeded_and_the_filler_covers_its_range():
    a = make_long_range_batch(8, 64, 20, generator=_gen(5))
    b = make_long_range_batch(8, 64, 20, generator=_gen(5))
    c = make_long_range_batch(8, 64, 20, generator=_gen(6))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])
    inputs, targets = make_long_range_batch(256, 64, 20, generator=_gen(7))
    filler = inputs[inputs >= 128]
    assert int(filler.min()) == 128 and int(filler.max()) == 255
    # the questions are not always asked of the same keys in the same places
    positions = query_positions(targets)
    assert len({tuple(row) for row in positions.tolist()}) > 10


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(batch_size=2, seq_len=64, distances=5), "distances must be in .* = \\[6, 55\\]"),  # 2N - 2 = 6
        (dict(batch_size=2, seq_len=64, distances=56), "distances must be in .* = \\[6, 55\\]"),  # T - 2N - 1 = 55
        (dict(batch_size=2, seq_len=64, distances=torch.tensor([6, 60])), "distances must be in"),
        (dict(batch_size=2, seq_len=64, distances=torch.tensor([6, 7, 8])), "int64 tensor of shape \\[2\\]"),
        (dict(batch_size=2, seq_len=64, distances=torch.tensor([6.0, 7.0])), "int64 tensor"),
        (dict(batch_size=2, seq_len=64, distances=6.0), "distances"),
        (dict(batch_size=2, seq_len=64, distances=10, vocab_size=12), "too few"),
        (dict(batch_size=0, seq_len=64, distances=10), "batch_size"),
        (dict(batch_size=2, seq_len=64, distances=10, num_facts=0), "num_facts"),
    ],
)
def test_impossible_batches_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_long_range_batch(**kwargs)


def test_evaluation_reads_whole_sequences_of_d_plus_2n_plus_margin():
    config = LongRangeConfig(num_facts=2, vocab_size=16, eval_sequences=10, eval_batch_size=4, eval_margin=5)
    batches = list(long_range._eval_batches(37, config))
    assert [inputs.shape for inputs, _ in batches] == [(4, 37 + 4 + 5)] * 2 + [(2, 37 + 4 + 5)]
    starts = {_parse(i.tolist(), t.tolist(), 2, 16, 37) for inputs, targets in batches for i, t in zip(inputs, targets)}
    assert starts <= set(range(5))
    again = list(long_range._eval_batches(37, config))  # the same sequences for every mechanism
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))


# --- the local control ------------------------------------------------------------------------

TINY = LongRangeConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, window=4, num_facts=2, codebook_size=8,
                       block_size=4, gau_d_k=8, steps=2, batch_size=4, seq_len=32, min_distance=2, max_distance=12,
                       eval_sequences=4, eval_batch_size=4, eval_margin=4)


def _first_answer_logits(mechanism: str, distance: int, change_value: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = LM(long_range.base_model_config(mechanism, TINY)).double().eval()
    inputs, targets = make_long_range_batch(3, distance + 4 + 6, distance, 2, 32, _gen(3))
    positions = query_positions(targets)
    if change_value:  # the value of the first fact -> a value no fact of its row holds
        value_at = positions[:, 0] - distance - 1
        for b in range(3):
            used = set(targets[b][targets[b] != -100].tolist())
            inputs[b, value_at[b]] = min(set(range(8, 16)) - used)
    logits, _ = query_logits(model, inputs, positions)
    return logits[:, 0]


def test_local_cannot_see_a_value_past_its_reach_but_softmax_can():
    # 2 layers of window 4: each moves information at most 3 positions: reach 6. The value of
    # question 0 sits d + 1 back: out of reach from d = 6 on.
    reach = TINY.n_layers * (TINY.window - 1)
    assert long_range.local_reach(TINY.n_layers, TINY.window) == reach == 6
    same = _first_answer_logits("local", reach, False), _first_answer_logits("local", reach, True)
    torch.testing.assert_close(same[0], same[1], rtol=0, atol=1e-12)
    inside = _first_answer_logits("local", reach - 1, False), _first_answer_logits("local", reach - 1, True)
    assert (inside[0] - inside[1]).abs().max() > 1e-6  # at d = reach - 1 the value is seen
    exact = _first_answer_logits("softmax", reach, False), _first_answer_logits("softmax", reach, True)
    assert (exact[0] - exact[1]).abs().max() > 1e-6  # exact attention sees it at any distance


# --- equal parameter counts -------------------------------------------------------------------


def test_every_model_is_matched_to_the_softmax_parameter_count():
    config = LongRangeConfig()  # the default size
    d, L, V = config.d_model, config.n_layers, config.vocab_size
    ffn = 32 * math.ceil(8 * d / 3 / 32)
    # embedding (tied) + per layer: two RMSNorm gains, q/k/v/o, SwiGLU; final norm
    softmax_parameters = V * d + L * (2 * d + 4 * d * d + 3 * d * ffn) + d
    widths = {}
    for mechanism in long_range.LONG_RANGE_SPECS:
        model_config, target = long_range.matched_model_config(mechanism, config)
        assert target == softmax_parameters
        parameters = LM(model_config).num_parameters()
        assert long_range.count_parameters(model_config) == parameters
        width = model_config.ffn_hidden
        assert width == model_config.gau_d_v and width % long_range.WIDTH_STEP == 0
        # one width step moves SwiGLU blocks by 3 d per layer, GAU pairs by 3 d per unit (2 a layer)
        per_width = L * 3 * d * (2 if mechanism == "vq" else 1)
        assert abs(parameters - target) <= per_width * long_range.WIDTH_STEP / 2, mechanism
        widths[mechanism] = width
    assert widths["softmax"] == widths["local"] == ffn
    assert widths["delta"] < ffn  # its beta projection and short convolutions are paid for
    assert widths["vq"] < 2 * d  # the GAU's default d_v = 2 d would be larger


def test_a_mechanism_whose_count_does_not_follow_the_width_is_refused(monkeypatch):
    monkeypatch.setattr(long_range, "count_parameters", lambda config: 1000)
    with pytest.raises(ValueError, match="cannot be matched"):
        long_range.matched_model_config("delta", LongRangeConfig())


def test_a_new_mechanism_is_one_line_of_the_table(monkeypatch):
    monkeypatch.setitem(long_range.LONG_RANGE_SPECS, "linear-elu", "linear:elu")
    row = long_range.train_run("linear-elu", (2, 9), TINY)
    assert row["mechanism"] == "linear-elu" and row["spec"] == "linear:elu" and row["steps"] == 2
    assert set(row["accuracy"]) == {"2", "9"} and row["eval_queries"] == {"2": 8, "9": 8}
    softmax, target = long_range.matched_model_config("softmax", TINY)
    assert row["target_parameters"] == target == LM(softmax).num_parameters()


# --- the command ------------------------------------------------------------------------------

RESULT_KEYS = ("mechanism", "accuracy", "eval_loss", "final_loss", "loss_curve", "parameters", "width")


def _results(out) -> dict:
    return json.loads((out / "results.json").read_text())


def test_quick_with_two_seeds_resumes_per_seed_and_reports_n_2(tmp_path):
    out = tmp_path / "lr"
    assert main(["repro", "long-range", "--quick", "--out", str(out), "--no-progress"]) == 0
    first = _results(out)
    assert [(r["mechanism"], r["n"]) for r in first["rows"]] == [(m, 1) for m in long_range.LONG_RANGE_SPECS]
    assert len((out / "runs.jsonl").read_text().splitlines()) == len(long_range.LONG_RANGE_SPECS)

    assert main(["repro", "long-range", "--quick", "--seeds", "2", "--resume", "--out", str(out), "--no-progress"]) == 0
    second = _results(out)
    mechanisms = len(long_range.LONG_RANGE_SPECS)
    assert second["metadata"]["reused_runs"] == mechanisms and second["metadata"]["seeds"] == [0, 1]
    assert len((out / "runs.jsonl").read_text().splitlines()) == 2 * mechanisms  # only seed 1 was trained
    assert [run for run in second["runs"] if run["seed"] == 0] == first["runs"]
    assert [(r["mechanism"], r["n"], r["seeds"]) for r in second["rows"]] == [
        (m, 2, [0, 1]) for m in long_range.LONG_RANGE_SPECS]
    for row in second["rows"]:
        mine = [run for run in second["runs"] if run["mechanism"] == row["mechanism"]]
        for d in ("16", "64"):
            values = [run["accuracy"][d] for run in mine]
            stats = row["metrics"][f"accuracy@{d}"]
            assert stats["n"] == 2 and stats["mean"] == pytest.approx(sum(values) / 2)
            assert (stats["min"], stats["max"]) == (min(values), max(values))
    for run in second["runs"]:
        assert set(run["accuracy"]) == {"16", "64"} and all(0 <= a <= 1 for a in run["accuracy"].values())
        assert run["eval_queries"] == {"16": 8 * 4, "64": 8 * 4} and run["steps"] == 8 and run["status"] == "ok"
    markdown = (out / "results.md").read_text()
    assert long_range.page(second) == markdown  # from the JSON alone
    assert "| mechanism | spec | width | parameters | n | d=16 | d=64†‡ |" in markdown
    assert "n = 2 seeds per row (0, 1)" in markdown and "Accuracy at d = 64" in markdown
    assert (out / "accuracy_vs_distance.png").read_bytes()[:8] == PNG

    # a seed's run is the run of that seed alone
    alone = tmp_path / "alone"
    assert main(["repro", "long-range", "--quick", "--seed", "1", "--mechanisms", "vq", "delta", "--out", str(alone),
                 "--no-progress"]) == 0
    seed_one = {run["mechanism"]: [run[key] for key in RESULT_KEYS] for run in second["runs"] if run["seed"] == 1}
    assert [[run[key] for key in RESULT_KEYS] for run in _results(alone)["runs"]] == [seed_one["vq"],
                                                                                      seed_one["delta"]]
    seed_zero = {run["mechanism"]: run["loss_curve"] for run in second["runs"] if run["seed"] == 0}
    assert seed_zero["vq"] != seed_one["vq"][RESULT_KEYS.index("loss_curve")]


def test_the_command_is_registered_with_three_seeds(capsys):
    from linattn.repro.cli import REPRODUCTIONS

    assert REPRODUCTIONS["long-range"].spec.default_seeds == 3
    assert main(["repro", "long-range", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--train-distances" in text and "--distances" in text and "--seeds" in text


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--mechanisms", "mamba"], "--mechanisms"),
        (["--distances", "0"], "--distances"),
        (["--train-distances", "8"], "--train-distances"),
        (["--steps", "0"], "--steps"),
        (["--seeds", "0"], "--seeds"),
        (["--facts", "x"], "--facts"),
        (["--eval-margin", "-1"], "--eval-margin"),
        (["--train-distances", "20", "300"], "--train-distances"),
        (["--train-distances", "30", "20"], "--train-distances"),
        (["--distances", "3"], "--distances"),  # below 2 * facts - 2 = 6
        (["--distances", "64", "64"], "--distances"),
        (["--facts", "70"], "--vocab-size"),
        (["--d-model", "66"], "--d-model"),  # head dimension 33: odd
    ],
)
def test_bad_arguments_are_refused_by_name(argv, flag, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["repro", "long-range", "--quick", *argv, "--out", str(out), "--no-progress"]) == 2
    assert flag in capsys.readouterr().err
    assert not out.exists()
