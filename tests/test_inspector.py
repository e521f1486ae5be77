"""``linattn inspect``: the row measures on hand-made attention rows with known answers, the
recomputed probabilities against the ops they stand for, the VQ window/cache split, and the
command end to end on a tiny run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

import linattn
from linattn import reporting
from linattn.inspector import (_exact_weights, _plots, _Recorder, effective_rank, head_summaries, inspect_model,
                               markdown, row_measures)
from linattn.nn import attention as attention_module
from linattn.nn.quantizer import VectorQuantizer
from linattn.ops.vq import vq_attention_weights
from test_train_cli import corpus, run_captured, trained  # noqa: F401  (the tiny run fixtures)
from test_vq_attention import make_bias, make_position_keys, make_vq

F64 = torch.float64


def test_measures_of_known_rows():
    rows = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0]], dtype=F64)
    got = row_measures(rows, torch.tensor([4, 4, 4]))
    torch.testing.assert_close(got["entropy"], torch.tensor([math.log(4), 0.0, math.log(2)], dtype=F64))
    torch.testing.assert_close(got["hoyer_sparsity"], torch.tensor([0.0, 1.0, 2 - math.sqrt(2)], dtype=F64))
    torch.testing.assert_close(got["entropy_sparsity"], torch.tensor([0.0, 1.0, 0.5], dtype=F64))


def test_effective_rank_of_known_matrices():
    torch.testing.assert_close(effective_rank(torch.eye(5)), torch.tensor(5.0, dtype=F64))
    rank_one = torch.outer(torch.arange(1.0, 4.0), torch.arange(1.0, 6.0))
    torch.testing.assert_close(effective_rank(rank_one), torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(effective_rank(torch.diag(torch.tensor([2.0, 2.0, 0.0]))), torch.tensor(2.0, dtype=F64))


@pytest.mark.parametrize("window", [None, 3])
def test_exact_weights_are_what_the_op_applies(window):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 9, 8, generator=g, dtype=F64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped key/value heads
    weights = _exact_weights(q, k, None, window)
    if window is None:
        want = linattn.softmax_attention(q, k, v, causal=True)
    else:
        want, _ = linattn.local_attention(q, k, v, window=window)
    torch.testing.assert_close(weights @ v.repeat_interleave(2, dim=1), want, rtol=1e-12, atol=1e-12)


def test_vq_weights_are_what_the_block_form_computes():
    q, k_hat, v, codes, codebook = make_vq(T=13, Dk=4, seed=4)
    kw = dict(block_size=4, bias=make_bias(4, 4), position_keys=make_position_keys(4, 4, 4))
    weights = vq_attention_weights(q, k_hat, **kw)
    out, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, **kw)  # the linear-time form
    torch.testing.assert_close(weights @ v.repeat_interleave(2, dim=1), out, rtol=1e-10, atol=1e-12)


def test_window_and_cache_mass_of_uniform_rows():
    """Uniform causal rows: query t (t >= 2L) puts (t - L (t // L - 1) + 1) / (t + 1) of its mass
    on its own and the previous block."""
    T, L = 20, 4
    weights = torch.tril(torch.ones(T, T, dtype=F64))
    weights = (weights / weights.sum(-1, keepdim=True)).unsqueeze(0)
    head = head_summaries(weights, "vq", block_size=L)[0]
    want = sum((t - L * (t // L - 1) + 1) / (t + 1) for t in range(2 * L, T)) / (T - 2 * L)
    assert head["window_mass"] == pytest.approx(want, rel=1e-12)
    assert head["cache_mass"] == pytest.approx(1 - want, rel=1e-12)
    assert head["entropy_sparsity"] == pytest.approx(0.0, abs=1e-12)  # uniform rows
    assert list(head["entropy_by_position"]) == ["1-1", "2-3", "4-7", "8-15", "16-19"]
    assert head["entropy_by_position"]["4-7"] == pytest.approx(sum(math.log(t + 1) for t in range(4, 8)) / 4)


def test_every_layer_kind_is_reported():
    config = linattn.LMConfig(d_model=16, n_layers=10, n_heads=2, gau_d_k=8, block_size=4, codebook_size=8,
                              attention="softmax,local:4,vq,gau-softmax,linear:elu,delta,vq-fsq,retnet,gla,gated-delta",
                              fsq_levels=(3, 3))
    torch.manual_seed(0)
    entries = inspect_model(linattn.LM(config), torch.randint(0, 256, (1, 30)))
    kinds = {entry["module"]: entry["kind"] for entry in entries}
    assert kinds == {"layers.0.mixer": "softmax", "layers.1.mixer": "local", "layers.2.units.0": "vq",
                     "layers.2.units.1": "vq", "layers.3.units.0": "gau-softmax", "layers.3.units.1": "gau-softmax",
                     "layers.4.mixer": "linear", "layers.5.mixer": "delta", "layers.6.units.0": "vq-fsq",
                     "layers.6.units.1": "vq-fsq", "layers.7.mixer": "retnet", "layers.8.mixer": "gla",
                     "layers.9.mixer": "gated-delta"}
    by_name = {entry["module"]: entry for entry in entries}
    assert len(by_name["layers.0.mixer"]["heads"]) == 2 and len(by_name["layers.2.units.0"]["heads"]) == 1
    assert "window_mass" in by_name["layers.2.units.0"]["heads"][0]
    assert all(len(by_name[f"layers.{i}.mixer"]["effective_rank"]) == 2 for i in (4, 7, 8, 9))
    codes = by_name["layers.6.units.0"]["codes"]
    assert codes["codebook_size"] == 9 and 1 <= codes["perplexity"] <= 9


def test_inspect_command_end_to_end(trained, tmp_path):  # noqa: F811
    run, code, _, _ = trained
    assert code == 0
    out = tmp_path / "inspect"
    code, stdout, stderr = run_captured(["inspect", "--ckpt", str(run), "--tokens", "64", "--out", str(out)])
    assert code == 0, stderr
    document = json.loads((out / "inspect.json").read_text())
    assert {row["kind"] for row in document["rows"]} == {"vq", "local"}
    assert "layers.0.units.0" in (out / "inspect.md").read_text() and "entropy" in stdout
    for name in ("entropy.png", "mass.png"):
        with Image.open(out / name) as image:
            assert image.size[0] > 100
    code, _, stderr = run_captured(["inspect", "--ckpt", str(run), "--tokens", "0", "--out", str(out)])
    assert code == 2


def _causal_rows(T, window=None):
    """``[1, T, T]``: each query uniform over the keys it sees (all earlier ones, or the last ``window``)."""
    offsets = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    seen = (offsets >= 0) if window is None else (offsets >= 0) & (offsets < window)
    seen = seen.to(F64)
    return (seen / seen.sum(-1, keepdim=True)).unsqueeze(0)


def test_hoyer_sparsity_is_normalised_by_the_number_of_visible_keys():
    """Hoyer's measure is 0 for a uniform row and 1 for a one-hot row whatever n is (n = 9 and 2
    here, where sqrt(n) - 1 is not 1), and (3 - sqrt 3) / 2 for a row uniform on 3 of 9 keys."""
    nine = torch.zeros(3, 9, dtype=F64)
    nine[0], nine[1, 4], nine[2, :3] = 1 / 9, 1.0, 1 / 3
    got = row_measures(nine, torch.tensor([9, 9, 9]))["hoyer_sparsity"]
    torch.testing.assert_close(got, torch.tensor([0.0, 1.0, (3 - math.sqrt(3)) / 2], dtype=F64))
    two = torch.tensor([[0.5, 0.5], [0.0, 1.0]], dtype=F64)
    torch.testing.assert_close(row_measures(two, torch.tensor([2, 2]))["hoyer_sparsity"],
                               torch.tensor([0.0, 1.0], dtype=F64))


def test_local_rows_count_only_the_keys_in_their_window():
    """For ``local`` the keys a query sees are those of non-zero weight (the window, min(t + 1, w)):
    rows uniform on their window are then neither sparse nor concentrated, and the entropy is
    the mean of log min(t + 1, w) over the queries t >= 1."""
    T, window = 10, 3
    head = head_summaries(_causal_rows(T, window), "local")[0]
    assert head["hoyer_sparsity"] == pytest.approx(0.0, abs=1e-12)
    assert head["entropy_sparsity"] == pytest.approx(0.0, abs=1e-12)
    assert head["entropy"] == pytest.approx(sum(math.log(min(t + 1, window)) for t in range(1, T)) / (T - 1))


def test_softmax_rows_count_every_earlier_key_even_at_weight_zero():
    """For ``softmax`` a query t sees its t + 1 keys even where a weight underflows to 0: a row
    with all its mass on key 0 is one-hot (both sparsities 1), not a row of one visible key."""
    T = 6
    weights = torch.zeros(2, T, T, dtype=F64)
    weights[..., 0] = 1.0
    for head in head_summaries(weights, "softmax"):
        assert head["hoyer_sparsity"] == pytest.approx(1.0, rel=1e-12)
        assert head["entropy_sparsity"] == pytest.approx(1.0, rel=1e-12)
        assert head["entropy"] == 0.0


def test_entropy_buckets_end_at_the_last_query():
    """With T a power of two the last bucket is [T/2, T - 1]: no bucket starts at T (it would have
    no query); each bucket holds the mean of log(t + 1) over its uniform rows."""
    for T, names in [(16, ["1-1", "2-3", "4-7", "8-15"]), (2, ["1-1"])]:
        buckets = head_summaries(_causal_rows(T), "softmax")[0]["entropy_by_position"]
        assert list(buckets) == names
        for name, value in buckets.items():
            a, b = map(int, name.split("-"))
            assert value == pytest.approx(sum(math.log(t + 1) for t in range(a, b + 1)) / (b - a + 1))


def test_window_mass_is_reported_only_for_vq_queries_that_have_a_cache():
    """The window/cache split needs a query t >= 2L (one that has an older block): none at T = 2L,
    one at T = 2L + 1 (query 2L puts (L + 1) / (2L + 1) on its window), and none for a kind other
    than ``vq`` even when given a block size."""
    L = 4
    assert "window_mass" not in head_summaries(_causal_rows(2 * L), "vq", block_size=L)[0]
    head = head_summaries(_causal_rows(2 * L + 1), "vq", block_size=L)[0]
    assert head["window_mass"] == pytest.approx((L + 1) / (2 * L + 1), rel=1e-12)
    assert head["cache_mass"] == pytest.approx(L / (2 * L + 1), rel=1e-12)
    for kind in ("softmax", "local", "gau-softmax"):
        assert "window_mass" not in head_summaries(_causal_rows(5 * L), kind, block_size=L)[0]


def test_code_use_of_a_known_assignment():
    """A quantizer's hook reports what the keys did with the codebook: 4 keys on codes 0, 0, 1, 2 of
    4 give perplexity exp(1.5 log 2), one unused code, and the mean of |k - k^| / |k| per key."""
    quantizer = VectorQuantizer(n_heads=1, head_dim=2, codebook_size=4).eval()
    with torch.no_grad():
        quantizer.codebook.copy_(torch.tensor([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]]))
    unit = torch.nn.Module()
    unit.quantizer = quantizer
    model = torch.nn.ModuleDict({"unit": unit})
    recorder = _Recorder(model)
    keys = torch.tensor([[[[2.0, 0.0], [0.5, 0.0], [0.0, 3.0], [-1.0, 0.5]]]])
    try:
        quantizer(keys)
    finally:
        recorder.close()
    codes = recorder.codes["unit"]
    assert codes["codebook_size"] == 4 and codes["unused_codes"] == 1
    assert codes["perplexity"] == pytest.approx(2 ** 1.5, rel=1e-12)
    want = (1 / 2 + 0.5 / 0.5 + 2 / 3 + 0.5 / math.sqrt(1.25)) / 4
    assert codes["relative_quantization_error"] == pytest.approx(want, rel=1e-6)


def test_inspect_model_leaves_no_hooks_and_the_original_ops():
    """Inspecting a model removes every hook it put on it and puts the layers' ops back, so the
    model computes and is hooked as before."""
    config = linattn.LMConfig(d_model=16, n_layers=3, n_heads=2, gau_d_k=8, block_size=4, codebook_size=8,
                              attention="softmax,vq,delta")
    torch.manual_seed(0)
    model = linattn.LM(config)
    ops = {name: getattr(attention_module, name) for name in ("softmax_attention", "local_attention")}

    def hooks():
        return [(name, len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()]

    before = hooks()
    inspect_model(model, torch.randint(0, 256, (1, 12)))
    assert hooks() == before
    assert all(getattr(attention_module, name) is op for name, op in ops.items())


def test_inspect_model_restores_the_training_mode():
    """The model runs in eval mode for the inspection and is left in the mode it was in."""
    config = linattn.LMConfig(d_model=16, n_layers=2, n_heads=2, gau_d_k=8, block_size=4, codebook_size=8,
                              attention="vq,softmax")
    model = linattn.LM(config)
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    for training in (True, False):
        model.train(training)
        inspect_model(model, torch.randint(0, 256, (1, 8)))
        assert seen[-1] is False
        assert model.training is training and all(m.training is training for m in model.modules())


def test_markdown_lists_the_effective_rank_of_every_head():
    """Kernel layers get one row per head with the state's effective rank (two decimals)."""
    text = markdown([{"module": "layers.0.mixer", "kind": "linear", "effective_rank": [1.5, 2.25]}], "# header")
    assert text.startswith("# header\n")
    assert "| layers.0.mixer | linear | 0 | | | | | | 1.50 |" in text
    assert "| layers.0.mixer | linear | 1 | | | | | | 2.25 |" in text


def _entries(n_heads, window_mass=None):
    heads = [{"head": h, "entropy_by_position": {"1-1": 0.1 * h, "2-3": 0.5, "4-7": 1.0 + 0.1 * h}}
             for h in range(n_heads)]
    if window_mass is not None:
        for head, w in zip(heads, window_mass):
            head.update(window_mass=w, cache_mass=1 - w)
    return [{"module": "layers.0.units.0", "kind": "vq", "heads": heads}]


@pytest.fixture
def figures(monkeypatch):
    """The figures ``_plots`` would save, by file name (closed, not rendered: only their contents are read)."""
    saved = {}

    def capture(figure, path, **kw):
        saved[path.name] = figure
        reporting.pyplot().close(figure)
        return path

    monkeypatch.setattr(reporting, "save_figure", capture)
    return saved


@pytest.mark.filterwarnings("error")
def test_entropy_plot_draws_each_head_on_a_grid(figures, tmp_path):
    """entropy.png has one line per head (bucket starts against the bucket's entropy, labelled
    module and head), a grid, and a legend while there are at most 12 lines; plotting warns of nothing."""
    entries = _entries(3)
    assert _plots(entries, tmp_path) == [tmp_path / "entropy.png"]
    axis = figures["entropy.png"].axes[0]
    assert len(axis.lines) == 3
    for line, head in zip(axis.lines, entries[0]["heads"]):
        assert list(line.get_xdata()) == [1, 2, 4]
        assert list(line.get_ydata()) == list(head["entropy_by_position"].values())
        assert line.get_label() == f"layers.0.units.0 h{head['head']}"
    assert axis.xaxis.get_gridlines() and all(g.get_visible() for g in axis.xaxis.get_gridlines())
    assert all(g.get_visible() for g in axis.yaxis.get_gridlines())
    assert [t.get_text() for t in axis.get_legend().get_texts()] == [f"layers.0.units.0 h{h}" for h in range(3)]


def test_entropy_plot_has_a_legend_up_to_12_lines(figures, tmp_path):
    """12 lines still get a legend; 13 do not (it would hide the plot)."""
    _plots(_entries(12), tmp_path)
    assert len(figures["entropy.png"].axes[0].get_legend().get_texts()) == 12
    _plots(_entries(13), tmp_path)
    assert figures["entropy.png"].axes[0].get_legend() is None


def test_mass_plot_stacks_window_and_cache_per_vq_head(figures, tmp_path):
    """mass.png: per VQ head a window bar of height w and a cache bar of height 1 - w on top of it
    (together 1); the figure is 0.6 inch per head wide, at least 5."""
    window = [0.1 * (h + 1) for h in range(10)]
    paths = _plots(_entries(10, window), tmp_path)
    assert paths == [tmp_path / "entropy.png", tmp_path / "mass.png"]
    figure = figures["mass.png"]
    assert tuple(figure.get_size_inches()) == pytest.approx((6.0, 4.0))
    window_bars, cache_bars = figure.axes[0].containers
    assert [bar.get_height() for bar in window_bars] == pytest.approx(window)
    assert [bar.get_y() for bar in cache_bars] == pytest.approx(window)
    assert [bar.get_height() for bar in cache_bars] == pytest.approx([1 - w for w in window])
    _plots(_entries(2, [0.5, 0.7]), tmp_path)
    assert tuple(figures["mass.png"].get_size_inches()) == pytest.approx((5.0, 4.0))


def test_inspect_command_requires_ckpt_and_out(trained, tmp_path):  # noqa: F811
    """--ckpt and --out are required: without either, argparse refuses by name (exit 2) before
    anything is loaded or written."""
    run, _, _, _ = trained
    code, _, stderr = run_captured(["inspect", "--out", str(tmp_path / "a")])
    assert code == 2 and "the following arguments are required: --ckpt" in stderr
    code, _, stderr = run_captured(["inspect", "--ckpt", str(run), "--tokens", "4"])
    assert code == 2 and "the following arguments are required: --out" in stderr
    assert not (tmp_path / "a").exists()


def test_inspect_command_reads_two_tokens_and_refuses_one(trained, tmp_path):  # noqa: F811
    """Two tokens are enough (query 1 sees two keys); one is refused, naming --tokens."""
    run, _, _, _ = trained
    code, _, stderr = run_captured(["inspect", "--ckpt", str(run), "--tokens", "2", "--out", str(tmp_path / "two")])
    assert code == 0, stderr
    rows = json.loads((tmp_path / "two" / "inspect.json").read_text())["rows"]
    with_heads = [row for row in rows if "heads" in row]
    assert with_heads and all(list(row["heads"][0]["entropy_by_position"]) == ["1-1"] for row in with_heads)
    code, _, stderr = run_captured(["inspect", "--ckpt", str(run), "--tokens", "1", "--out", str(tmp_path / "one")])
    assert code == 2
    assert "inspecting needs 2 tokens; --tokens 1 of the validation split" in stderr and "gives 1" in stderr


def test_inspect_command_creates_nested_out_and_writes_into_an_existing_one(trained, tmp_path):  # noqa: F811
    """--out may name a folder whose parents do not exist yet, and a second run into the same
    folder replaces the files there."""
    run, _, _, _ = trained
    out = tmp_path / "a" / "b" / "inspect"
    for _ in range(2):
        code, _, stderr = run_captured(["inspect", "--ckpt", str(run), "--tokens", "8", "--out", str(out)])
        assert code == 0, stderr
        assert {"inspect.json", "inspect.md", "entropy.png"} <= {p.name for p in out.iterdir()}
