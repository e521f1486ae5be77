"""Synthetic associative retrieval of "Linear Transformers Are Secretly Fast Weight Programmers"
(Schlag, Irie & Schmidhuber 2021; seed 001, Sec. 6.1), on top of ``linattn``'s ops.

**Task.** ``S`` keys and ``S`` values. The input is a sequence of ``L`` (key, value) pairs
followed by a query, one of the keys in the sequence; the target is the value paired with
it. Values are fixed one-hot vectors in ``R^S``; keys are learned embeddings ``e(key)``.

- Setting 1 (capacity, ``make_capacity_batch``): ``L = S``, keys and values drawn *without*
  replacement, so each sequence is a random one-to-one pairing of all S keys with all S
  values. A kernel's memory holds ``d_dot`` orthogonal keys: retrieval should fail once S
  exceeds ``d_dot``; softmax attention keeps every pair and holds far longer.
- Setting 2 (update rules, ``make_update_rule_batch``): ``L = 2S``, keys and values drawn
  *with* replacement; the target of a query is the value of the key's *last* occurrence,
  so the memory must overwrite associations. Only the delta rule can.

**Model** (one attention layer, one head, as in the paper and its official code,
github.com/ischlag/fast-weight-transformers, ``synthetic/``): write key
``k = W_k [onehot(v); e(key)] + b_k`` (``d_key = 64``), written value ``onehot(v)`` itself,
query ``q = W_q e(query) + b_q``; the retrieved ``v_hat in R^S`` is the attention output at the
query, with no output projection. Loss ``1/2 sum_j (onehot(v*)_j - v_hat_j)^2``, mean over
queries. Embedding size ``int(1.1 * 2S)`` as in the official code (``--emb-dim`` overrides).
Initialisation as there: ``e ~ N(0, 1)``; kernels ``W_k, W_q ~ U(+-1/sqrt(d_key))``; softmax
Xavier-uniform; biases PyTorch's default.

Mechanisms (``MECHANISMS``):

- ``softmax``: ``softmax_attention`` with scale ``d_key^-1/2``.
- sum rule (``linear-elu``, ``dpfp-N``, ``favor-M``, ``sum-dpfp-1``): ``linear_attention`` with
  ``normalize="attention"`` (``phi(q).S / phi(q).z`` -- the official code's "sum" update rule
  divides by ``phi(q).z``; the paper introduces sum normalisation for its delta rule).
  FAVOR+'s random projection is drawn once per run from the run's seed and kept fixed.
- delta rule (``delta-dpfp-N``, ``delta-linear``): ``delta_rule`` with ``normalize="sum"`` and
  output scale 1 (the paper's Eqs. 23-25 with sum normalisation), write strength
  ``beta = sigmoid(W_b [onehot(v); e(key)] + b_b)`` per pair.

**Reading.** All queries of a sequence read the memory after the *last* pair, and never
write: softmax and the sum rule read it as a non-causal call whose keys/values are the pairs
(the non-causal output of kernel attention *is* the read of the final state; the sum rule
takes whichever of ``linear_attention``'s orders is cheaper, ``(phi(Q) phi(K)^T) V`` for the
single training query, ``phi(Q) (phi(K)^T V)`` when many queries share the pairs); the
delta rule writes the pairs with ``output_final_state=True``, then reads the state by a second ``delta_rule`` call over the queries with ``beta = 0`` (no writes).
This is exactly the query at position L+1 of a causal sequence, and lets the evaluation ask
every key of a sequence at once. Training asks one random query per sequence (batch 32),
as in the paper.

**Training** (as in the official code): Adam, lr 1e-3, batch 32; every 100 steps an
evaluation on fresh sequences asking every key (Setting 2: every distinct key in the
sequence); stop when the evaluation loss is <= 1e-3, after ``patience`` evaluations without
improvement, or at ``max_steps``. The reported loss is that of the last evaluation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import int_at_least as _int_at_least, positive_float as _positive_float
from ..bench import report
from ..feature_maps import FAVOR, FeatureMap, get_feature_map
from ..ops.delta import delta_rule
from ..ops.linear import linear_attention
from ..ops.softmax import softmax_attention
from ._parallel import JOURNAL_NAME, RunJournal, map_runs, reuse_note

# --- data ---------------------------------------------------------------------------


@dataclass
class RetrievalBatch:
    """One batch of retrieval problems.

    ``keys``, ``values``: ``[B, L]`` ids in ``[0, S)`` of the written pairs.
    ``queries``: ``[B, Q]`` key ids asked after the pairs; ``targets``: ``[B, Q]`` value ids
    expected; ``mask``: ``[B, Q]`` which queries count (padding is False).
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor

    def to(self, device) -> "RetrievalBatch":
        return RetrievalBatch(*(getattr(self, f).to(device) for f in ("keys", "values", "queries", "targets", "mask")))


def _check_sizes(batch_size: int, num_keys: int, seq_len: int, num_queries: int | None) -> None:
    for name, value, minimum in (("batch_size", batch_size, 1), ("num_keys", num_keys, 2), ("seq_len", seq_len, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if num_queries is not None and (isinstance(num_queries, bool) or not isinstance(num_queries, int) or num_queries < 1):
        raise ValueError(f"num_queries must be a positive int or None (every key), got {num_queries!r}")


def make_capacity_batch(
    batch_size: int,
    num_keys: int,
    *,
    num_queries: int | None = 1,
    seq_len: int | None = None,
    generator: torch.Generator | None = None,
) -> RetrievalBatch:
    """Setting 1: ``seq_len`` (default ``num_keys``) pairs drawn without replacement.

    Each sequence pairs distinct keys with distinct values (the first ``seq_len`` entries of
    two independent random permutations of ``[0, S)``). ``num_queries=None`` asks every key
    of the sequence (in random order); an int asks that many distinct keys of it.
    """
    seq_len = num_keys if seq_len is None else seq_len
    _check_sizes(batch_size, num_keys, seq_len, num_queries)
    if seq_len > num_keys:
        raise ValueError(f"without replacement seq_len ({seq_len}) cannot exceed num_keys ({num_keys})")
    n = seq_len if num_queries is None else num_queries
    if n > seq_len:
        raise ValueError(f"num_queries ({n}) cannot exceed the {seq_len} distinct keys of a sequence")
    keys = torch.stack([torch.randperm(num_keys, generator=generator)[:seq_len] for _ in range(batch_size)])
    values = torch.stack([torch.randperm(num_keys, generator=generator)[:seq_len] for _ in range(batch_size)])
    positions = torch.stack([torch.randperm(seq_len, generator=generator)[:n] for _ in range(batch_size)])
    return RetrievalBatch(
        keys=keys,
        values=values,
        queries=keys.gather(1, positions),
        targets=values.gather(1, positions),
        mask=torch.ones(batch_size, n, dtype=torch.bool),
    )


def last_occurrence(keys: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[B, S]``: position of the last occurrence of each key id in ``keys [B, L]`` (-1 if absent)."""
    positions = torch.arange(keys.shape[1]).expand_as(keys)
    last = torch.full((keys.shape[0], num_keys), -1, dtype=torch.long)
    return last.scatter_reduce(1, keys, positions, reduce="amax", include_self=True)


def make_update_rule_batch(
    batch_size: int,
    num_keys: int,
    *,
    num_queries: int | None = 1,
    seq_len: int | None = None,
    generator: torch.Generator | None = None,
) -> RetrievalBatch:
    """Setting 2: ``seq_len`` (default ``2 * num_keys``) pairs drawn with replacement.

    The target of a query is the value at the key's *last* occurrence. ``num_queries=1``
    (or any int) draws query positions uniformly, as the official code does (frequent keys
    are asked more often); ``None`` asks every key that occurs, once: ``queries`` is then
    ``[B, S]`` (key id order) with ``mask`` False for the keys absent from the sequence.
    """
    seq_len = 2 * num_keys if seq_len is None else seq_len
    _check_sizes(batch_size, num_keys, seq_len, num_queries)
    keys = torch.randint(num_keys, (batch_size, seq_len), generator=generator)
    values = torch.randint(num_keys, (batch_size, seq_len), generator=generator)
    last = last_occurrence(keys, num_keys)
    if num_queries is None:
        queries = torch.arange(num_keys).expand(batch_size, num_keys).clone()
        mask = last >= 0
        targets = torch.where(mask, values.gather(1, last.clamp(min=0)), torch.zeros_like(last))
        return RetrievalBatch(keys, values, queries, targets, mask)
    positions = torch.randint(seq_len, (batch_size, num_queries), generator=generator)
    queries = keys.gather(1, positions)
    targets = values.gather(1, last.gather(1, queries))
    return RetrievalBatch(keys, values, queries, targets, torch.ones(batch_size, num_queries, dtype=torch.bool))


# --- mechanisms and model -----------------------------------------------------------


@dataclass(frozen=True)
class Mechanism:
    """How the memory is written and read: ``rule`` is ``"softmax"``, ``"sum"`` or ``"delta"``."""

    name: str
    label: str
    rule: str
    feature_map: str | None = None  # a get_feature_map spec ("elu", "dpfp:2", "favor:64")
    normalize: str | None = None

    def d_dot(self, key_dim: int) -> int | None:
        """Dimension of the memory's key space (None for softmax: no fixed-size memory)."""
        if self.feature_map is None:
            return None
        return get_feature_map(self.feature_map).dim_out(key_dim)

    def make_feature_map(self, seed: int) -> FeatureMap | None:
        """The feature map of one run (FAVOR+: a projection drawn from ``seed``, then fixed)."""
        if self.feature_map is None:
            return None
        fmap = get_feature_map(self.feature_map)
        if isinstance(fmap, FAVOR):
            fmap = FAVOR(fmap.num_features, seed=seed)
        return fmap


def _sum(name: str, label: str, spec: str) -> Mechanism:
    return Mechanism(name, label, "sum", spec, "attention")


def _delta(name: str, label: str, spec: str) -> Mechanism:
    return Mechanism(name, label, "delta", spec, "sum")


MECHANISMS: dict[str, Mechanism] = {
    m.name: m
    for m in (
        Mechanism("softmax", "Softmax", "softmax"),
        _sum("linear-elu", "Linear (elu+1)", "elu"),
        _sum("dpfp-1", "DPFP-1", "dpfp:1"),
        _sum("dpfp-2", "DPFP-2", "dpfp:2"),
        _sum("dpfp-3", "DPFP-3", "dpfp:3"),
        _sum("favor-64", "FAVOR+ (64)", "favor:64"),
        _sum("favor-128", "FAVOR+ (128)", "favor:128"),
        _sum("favor-512", "FAVOR+ (512)", "favor:512"),
        _sum("sum-dpfp-1", "sum rule, DPFP-1", "dpfp:1"),
        _delta("delta-dpfp-1", "delta rule, DPFP-1", "dpfp:1"),
        _delta("delta-dpfp-2", "delta rule, DPFP-2", "dpfp:2"),
        _delta("delta-linear", "delta rule, elu+1", "elu"),
    )
}


class RetrievalModel(nn.Module):
    """One single-head attention layer over (key, one-hot value) pairs; see the module docstring."""

    def __init__(self, num_keys: int, mechanism: Mechanism, *, key_dim: int = 64, emb_dim: int | None = None,
                 feature_seed: int = 0):
        super().__init__()
        self.num_keys, self.mechanism, self.key_dim = num_keys, mechanism, key_dim
        self.emb_dim = default_emb_dim(num_keys) if emb_dim is None else emb_dim
        self.embedding = nn.Embedding(num_keys, self.emb_dim)
        self.write_key = nn.Linear(num_keys + self.emb_dim, key_dim)  # input [onehot(v); e(key)]
        self.query = nn.Linear(self.emb_dim, key_dim)
        self.beta = nn.Linear(num_keys + self.emb_dim, 1) if mechanism.rule == "delta" else None
        self.feature_map = mechanism.make_feature_map(feature_seed)
        nn.init.normal_(self.embedding.weight, mean=0.0, std=1.0)
        if mechanism.rule == "softmax":
            nn.init.xavier_uniform_(self.write_key.weight)
            nn.init.xavier_uniform_(self.query.weight)
        else:
            bound = key_dim**-0.5
            nn.init.uniform_(self.write_key.weight, -bound, bound)
            nn.init.uniform_(self.query.weight, -bound, bound)

    def _project_pairs(self, linear: nn.Linear, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``linear([onehot(v); e(key)])`` without materialising the one-hot or the embeddings:
        the value block of the weight is looked up, the key block applied to the table once."""
        S = self.num_keys
        value_part = linear.weight[:, :S].t()
        key_part = self.embedding.weight @ linear.weight[:, S:].t()
        return F.embedding(values, value_part) + F.embedding(keys, key_part) + linear.bias

    def forward(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """``keys, values [B, L]``, ``queries [B, Q]`` -> retrieved vectors ``[B, Q, S]``."""
        S = self.num_keys
        k = self._project_pairs(self.write_key, keys, values).unsqueeze(1)  # [B, 1, L, d_key]
        v = k.new_zeros(*values.shape, S).scatter_(-1, values.unsqueeze(-1), 1.0).unsqueeze(1)  # one-hot [B, 1, L, S]
        q = F.embedding(queries, self.embedding.weight @ self.query.weight.t() + self.query.bias).unsqueeze(1)
        rule = self.mechanism.rule
        if rule == "softmax":
            out = softmax_attention(q, k, v, causal=False)
        elif rule == "sum":
            out = self._read_sum_rule(q, k, v)
        else:
            beta = torch.sigmoid(self._project_pairs(self.beta, keys, values)).squeeze(-1).unsqueeze(1)  # [B, 1, L]
            options = dict(feature_map=self.feature_map, normalize=self.mechanism.normalize, scale=1.0)
            # chunk 32: the outputs of the write pass are unused; shorter chunks pad less.
            _, state = delta_rule(k, k, v, beta, output_final_state=True, chunk_size=32, **options)
            # Read the final memory; beta = 0 makes the query positions write nothing.
            no_write = q.new_zeros(q.shape[:3])
            out, _ = delta_rule(q, q, q.new_zeros(*q.shape[:3], S), no_write, initial_state=state, **options)
        return out.squeeze(1)

    def _read_sum_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal kernel attention of the Q queries over all L pairs (= read of the final
        state), in the cheaper order: scores first costs ``Q L (F + S)``, the state ``(L + Q) F S``."""
        num_queries, length, values = q.shape[2], k.shape[2], v.shape[-1]
        features = self.feature_map.dim_out(k.shape[-1])
        scores_first = num_queries * length * (features + values) <= (length + num_queries) * features * values
        out, _ = linear_attention(q, k, v, feature_map=self.feature_map, causal=False,
                                  normalize=self.mechanism.normalize, mode="parallel" if scores_first else "chunk")
        return out


def default_emb_dim(num_keys: int) -> int:
    """The official code's embedding size: 1.1 times its vocabulary of 2S symbols."""
    return int((2 * num_keys) * 1.1)


def retrieval_loss(pred: torch.Tensor, batch: RetrievalBatch) -> torch.Tensor:
    """``1/2 sum_j (onehot(target)_j - pred_j)^2``, mean over the masked-in queries."""
    target = F.one_hot(batch.targets, pred.shape[-1]).to(pred.dtype)
    per_query = 0.5 * (target - pred).pow(2).sum(-1)
    mask = batch.mask.to(pred.dtype)
    return (per_query * mask).sum() / mask.sum()


# --- training -----------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One of the paper's two settings: its data generator and its sequence length."""

    name: str
    title: str
    make_batch: Callable[..., RetrievalBatch]
    seq_len: Callable[[int], int]


SETTINGS = {
    "capacity": Setting("capacity", "Setting 1: capacity (L = S, without replacement)", make_capacity_batch,
                        lambda s: s),
    "update-rule": Setting("update-rule", "Setting 2: update rules (L = 2S, with replacement, last value wins)",
                           make_update_rule_batch, lambda s: 2 * s),
}


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of every run (defaults: the paper's official code, except max_steps)."""

    key_dim: int = 64
    emb_dim: int | None = None  # None: int(1.1 * 2S)
    batch_size: int = 32
    lr: float = 1e-3
    max_steps: int = 20000
    eval_every: int = 100
    eval_sequences: int = 20
    patience: int = 10
    target_loss: float = 1e-3
    seed: int = 0
    device: str = "cpu"

    def validate(self) -> None:
        for name in ("key_dim", "batch_size", "max_steps", "eval_every", "eval_sequences", "patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.emb_dim is not None and (not isinstance(self.emb_dim, int) or self.emb_dim < 1):
            raise ValueError(f"emb_dim must be a positive int or None, got {self.emb_dim!r}")
        for name in ("lr", "target_loss"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but torch.cuda.is_available() is False")


def _generator(*parts: int) -> torch.Generator:
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def evaluate(model: RetrievalModel, setting: Setting, config: TrainConfig, generator: torch.Generator) -> tuple[float, float]:
    """(loss, accuracy of argmax retrieval) on ``eval_sequences`` fresh sequences, every key asked."""
    model.eval()
    batch = setting.make_batch(config.eval_sequences, model.num_keys, num_queries=None, generator=generator)
    batch = batch.to(config.device)
    pred = model(batch.keys, batch.values, batch.queries)
    loss = retrieval_loss(pred, batch).item()
    hits = (pred.argmax(-1) == batch.targets) & batch.mask
    model.train()
    return loss, (hits.sum() / batch.mask.sum()).item()


def train_run(
    setting: Setting,
    mechanism: Mechanism,
    num_keys: int,
    config: TrainConfig,
    *,
    on_eval: Callable[[int, float], None] | None = None,
) -> dict:
    """Train one model on one size S until the stop criterion; return its result row.

    Data, initialisation and FAVOR+ projection depend on (seed, S) only, so every mechanism
    sees the same sequences at the same S.
    """
    if num_keys < 2:
        raise ValueError(f"the number of keys S must be >= 2, got {num_keys}")
    torch.manual_seed(_generator(config.seed, num_keys, 1).initial_seed())
    model = RetrievalModel(num_keys, mechanism, key_dim=config.key_dim, emb_dim=config.emb_dim,
                           feature_seed=config.seed * 7919 + num_keys).to(config.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    train_data = _generator(config.seed, num_keys, 2)
    eval_data = _generator(config.seed, num_keys, 3)

    curve: list[list[float]] = []
    best, since_best, stop_reason = math.inf, 0, "max_steps"
    accuracy = math.nan
    start, cpu_start = time.perf_counter(), time.process_time()
    step = 0
    for step in range(1, config.max_steps + 1):
        batch = setting.make_batch(config.batch_size, num_keys, num_queries=1, generator=train_data).to(config.device)
        loss = retrieval_loss(model(batch.keys, batch.values, batch.queries), batch)
        if not torch.isfinite(loss):
            stop_reason = "non_finite"
            curve.append([step, math.nan])
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % config.eval_every and step != config.max_steps:
            continue
        eval_loss, accuracy = evaluate(model, setting, config, eval_data)
        curve.append([step, eval_loss])
        if on_eval is not None:
            on_eval(step, eval_loss)
        if eval_loss < best:
            best, since_best = eval_loss, 0
        else:
            since_best += 1
        if eval_loss <= config.target_loss:
            stop_reason = "target"
            break
        if since_best >= config.patience:
            stop_reason = "plateau"
            break
    final = curve[-1][1] if curve else math.nan
    return {
        "mechanism": mechanism.name,
        "label": mechanism.label,
        "rule": mechanism.rule,
        "feature_map": mechanism.feature_map,
        "normalize": mechanism.normalize,
        "d_dot": mechanism.d_dot(config.key_dim),
        "size": num_keys,
        "seq_len": setting.seq_len(num_keys),
        "emb_dim": model.emb_dim,
        "final_eval_loss": final,
        "best_eval_loss": best if math.isfinite(best) else None,
        "final_eval_accuracy": accuracy,
        "steps": step,
        "evaluations": len(curve),
        "stop_reason": stop_reason,
        "train_seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,  # this process, all threads
        "curve": curve,
    }


def _train_named(setting_name: str, mechanism: str, num_keys: int, config: TrainConfig,
                 on_eval: Callable[[int, float], None] | None = None) -> dict:
    """``train_run`` by names (picklable for worker processes)."""
    return train_run(SETTINGS[setting_name], MECHANISMS[mechanism], num_keys, config, on_eval=on_eval)


def _run_key(run: tuple) -> dict:
    """What identifies a run of the grid in the journal: its arguments and configuration."""
    setting_name, mechanism, size, config = run
    return {"setting": setting_name, "mechanism": mechanism, "size": size, "config": asdict(config)}


def check_grid(mechanisms: Sequence[str], sizes: Sequence[int], config: TrainConfig) -> None:
    """Every value of the grid, before anything is trained or written: a ValueError otherwise."""
    unknown = [m for m in mechanisms if m not in MECHANISMS]
    if unknown:
        raise ValueError(f"unknown mechanism(s) {', '.join(unknown)}; choose from {', '.join(MECHANISMS)}")
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 2]
    if bad:
        raise ValueError(f"sizes S must be ints >= 2, got {bad}")
    if not mechanisms or not sizes:
        raise ValueError("need at least one mechanism and one size")
    config.validate()


def run_grid(
    setting: Setting,
    mechanisms: Sequence[str],
    sizes: Sequence[int],
    config: TrainConfig,
    *,
    jobs: int = 1,
    threads: int | None = None,
    progress: bool = True,
    journal: RunJournal | None = None,
    only_recorded: bool = False,
) -> list[dict]:
    """Every (mechanism, S) run, mechanisms outer, with a tqdm bar over runs; ``jobs > 1``
    trains that many at once in worker processes with ``threads`` torch threads each.
    With a ``journal``, runs recorded there are reused and new ones recorded;
    ``only_recorded=True`` returns just the recorded ones, training nothing."""
    from tqdm.auto import tqdm

    check_grid(mechanisms, sizes, config)
    grid = [(setting.name, name, size, config) for name in mechanisms for size in sizes]

    def show_evals(run: tuple):
        _, name, size, _ = run
        return lambda step, loss: bar.set_postfix_str(f"{name} S={size} step {step} loss {loss:.2e}")

    def describe(row: dict) -> str:
        return f"{row['mechanism']} S={row['size']} loss {row['final_eval_loss']:.2e}"

    with tqdm(total=len(grid), desc=f"fwp {setting.name}", unit="run", disable=not progress) as bar:
        return map_runs(_train_named, grid, jobs=jobs, threads=torch.get_num_threads() if threads is None else threads, bar=bar,
                        describe=describe, progress_kwarg="on_eval", show_progress=show_evals,
                        journal=journal, run_key=_run_key, only_recorded=only_recorded)


# --- summary and reports ------------------------------------------------------------


ACCURACY_LEVELS = (0.99, 0.9, 0.5)


def _largest_prefix_size(runs: Sequence[dict], holds) -> int | None:
    """The largest S such that ``holds`` is true for every run up to it (runs sorted by S); None
    when the smallest S already fails."""
    largest = None
    for r in runs:
        if not holds(r):
            break
        largest = r["size"]
    return largest


def summarize(rows: Sequence[dict], *, target_loss: float) -> dict:
    """Per mechanism: d_dot, the sizes whose final loss reached ``target_loss``, the largest S
    up to which every size reached it, the largest S up to which every size's final accuracy is
    at least each of ``ACCURACY_LEVELS``, and the final losses by S."""
    summary = {}
    for name in dict.fromkeys(r["mechanism"] for r in rows):
        mine = sorted((r for r in rows if r["mechanism"] == name), key=lambda r: r["size"])
        summary[name] = {
            "d_dot": mine[0]["d_dot"],
            "solved_sizes": [r["size"] for r in mine if r["final_eval_loss"] <= target_loss],
            "largest_size_all_solved": _largest_prefix_size(mine, lambda r: r["final_eval_loss"] <= target_loss),
            "largest_size_accuracy_at_least": {
                f"{level:g}": _largest_prefix_size(mine, lambda r, level=level: r["final_eval_accuracy"] >= level)
                for level in ACCURACY_LEVELS},
            "final_eval_loss_by_size": {str(r["size"]): r["final_eval_loss"] for r in mine},
        }
    return summary


def _loss(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.1e}"


def _percent(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{100 * value:.1f}%"


def _size(value: int | None) -> str:
    return "—" if value is None else str(value)


_STOP = {"target": "t", "plateau": "p", "max_steps": "m", "non_finite": "nan"}


def markdown_report(rows: Sequence[dict], *, title: str, command: str, setting: Setting, config: TrainConfig,
                    summary: dict) -> str:
    """The Markdown page: final loss per (mechanism, S), steps per run, the summary."""
    sizes = sorted({r["size"] for r in rows})
    names = list(dict.fromkeys(r["mechanism"] for r in rows))
    find = {(r["mechanism"], r["size"]): r for r in rows}
    head = "| mechanism | d_dot | " + " | ".join(f"S={s}" for s in sizes) + " |"
    rule = "|" + "|".join(" --- " for _ in range(len(sizes) + 2)) + "|"
    loss_lines, accuracy_lines, step_lines = [head, rule], [head, rule], [head, rule]
    for name in names:
        d_dot = find[(name, sizes[0])]["d_dot"] if (name, sizes[0]) in find else None
        prefix = f"| {name} | {d_dot if d_dot is not None else '∞'} | "
        cells, accuracies, steps = [], [], []
        for s in sizes:
            r = find.get((name, s))
            cells.append("" if r is None else _loss(r["final_eval_loss"]))
            accuracies.append("" if r is None else _percent(r["final_eval_accuracy"]))
            steps.append("" if r is None else f"{r['steps']}{_STOP[r['stop_reason']]}")
        loss_lines.append(prefix + " | ".join(cells) + " |")
        accuracy_lines.append(prefix + " | ".join(accuracies) + " |")
        step_lines.append(prefix + " | ".join(steps) + " |")
    emb = "int(1.1 * 2S)" if config.emb_dim is None else str(config.emb_dim)
    lines = [
        f"# {title}",
        "",
        f"`{command}`",
        "",
        f"{setting.title}. One attention layer, d_key = {config.key_dim}, d_emb = {emb}; Adam lr {config.lr:g}, "
        f"batch {config.batch_size}; evaluation every {config.eval_every} steps on {config.eval_sequences} fresh "
        f"sequences asking every key; stop at eval loss <= {config.target_loss:g}, after {config.patience} "
        f"evaluations without improvement, or at {config.max_steps} steps; seed {config.seed}.",
        "",
        "## Final evaluation loss (1/2 squared error per query)",
        "",
        *loss_lines,
        "",
        "## Final retrieval accuracy (argmax of the retrieved vector = target value)",
        "",
        *accuracy_lines,
        "",
        "## Training steps (t: reached the target loss, p: plateau, m: step cap)",
        "",
        *step_lines,
        "",
        "## Capacity: the largest S up to which every S met the criterion",
        "",
        "| mechanism | d_dot | loss <= " + f"{config.target_loss:g} | "
        + " | ".join(f"accuracy >= {100 * level:g}%" for level in ACCURACY_LEVELS) + " |",
        "|" + "|".join(" --- " for _ in range(len(ACCURACY_LEVELS) + 3)) + "|",
        *(f"| {name} | {s['d_dot'] if s['d_dot'] is not None else '∞'} | {_size(s['largest_size_all_solved'])} | "
          + " | ".join(_size(s["largest_size_accuracy_at_least"][f"{level:g}"]) for level in ACCURACY_LEVELS) + " |"
          for name, s in summary.items()),
        "",
        "## Summary",
        "",
    ]
    for name, s in summary.items():
        largest = s["largest_size_all_solved"]
        d_dot = s["d_dot"] if s["d_dot"] is not None else "∞"
        solved = ", ".join(map(str, s["solved_sizes"]))
        if not solved:
            text = f"no S reached loss <= {config.target_loss:g}"
        elif largest is None:
            text = f"the smallest S missed loss <= {config.target_loss:g}; reached at S = {solved}"
        else:
            text = f"every S up to {largest} reached loss <= {config.target_loss:g}; reached at S = {solved}"
        lines.append(f"- {name} (d_dot {d_dot}): {text}")
    return "\n".join(lines) + "\n"


def write_plot(rows: Sequence[dict], path: Path, *, title: str, target_loss: float, mark_d_dot: bool) -> Path:
    """Two panels against S, one line per mechanism: the final evaluation loss (log y, like the
    paper's figures) and the final retrieval accuracy (where chance is 1/S)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(14, 5))
    for index, name in enumerate(dict.fromkeys(r["mechanism"] for r in rows)):
        mine = sorted((r for r in rows if r["mechanism"] == name), key=lambda r: r["size"])
        color = f"C{index % 10}"
        xs = [r["size"] for r in mine]
        losses = [max(r["final_eval_loss"], 1e-8) if math.isfinite(r["final_eval_loss"]) else math.nan for r in mine]
        accuracies = [100 * r["final_eval_accuracy"] for r in mine]
        loss_axis.plot(xs, losses, marker="o", markersize=3, color=color, label=mine[0]["label"])
        accuracy_axis.plot(xs, accuracies, marker="o", markersize=3, color=color, label=mine[0]["label"])
        d_dot = mine[0]["d_dot"]
        if mark_d_dot and d_dot is not None and min(xs) <= d_dot <= max(xs):
            for axis in (loss_axis, accuracy_axis):
                axis.axvline(d_dot, color=color, linestyle=":", alpha=0.6)
    loss_axis.axhline(target_loss, color="gray", linestyle="--", linewidth=0.8, label=f"stop criterion {target_loss:g}")
    loss_axis.set_yscale("log")
    loss_axis.set_ylabel("final evaluation loss")
    accuracy_axis.set_ylabel("final retrieval accuracy (%)")
    accuracy_axis.set_ylim(-2, 102)
    for axis in (loss_axis, accuracy_axis):
        axis.set_xlabel("number of unique keys S")
        axis.grid(True, which="both", alpha=0.3)
    loss_axis.legend(fontsize="small")
    figure.suptitle(title + (" (dotted: d_dot)" if mark_d_dot else ""))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


@dataclass(frozen=True)
class ExperimentSpec:
    """A command's defaults: its setting, grid, mechanisms and output names."""

    command: str
    setting: str
    default_sizes: tuple[int, ...]
    quick_sizes: tuple[int, ...]
    default_mechanisms: tuple[str, ...]
    quick_mechanisms: tuple[str, ...]
    default_max_steps: int
    quick_max_steps: int
    plot_name: str
    mark_d_dot: bool
    extra: dict = field(default_factory=dict)


CAPACITY = ExperimentSpec(
    command="fwp-capacity",
    setting="capacity",
    default_sizes=tuple(range(20, 601, 20)),
    quick_sizes=(40, 80, 160),
    default_mechanisms=("linear-elu", "dpfp-1", "dpfp-2", "dpfp-3", "favor-64", "favor-128", "favor-512", "softmax"),
    quick_mechanisms=("linear-elu", "dpfp-1", "dpfp-2", "favor-128", "softmax"),
    default_max_steps=20000,
    quick_max_steps=1000,
    plot_name="fwp_capacity.png",
    mark_d_dot=True,
)

UPDATE_RULE = ExperimentSpec(
    command="fwp-update-rule",
    setting="update-rule",
    default_sizes=tuple(range(20, 201, 20)),
    quick_sizes=(20, 40, 60),
    default_mechanisms=("sum-dpfp-1", "delta-dpfp-1", "delta-dpfp-2", "delta-linear"),
    quick_mechanisms=("sum-dpfp-1", "delta-dpfp-1", "delta-linear"),
    default_max_steps=20000,
    quick_max_steps=1000,
    plot_name="fwp_update_rule.png",
    mark_d_dot=False,
)


def run_experiment(spec: ExperimentSpec, *, mechanisms: Sequence[str], sizes: Sequence[int], config: TrainConfig,
                   out_dir: Path, command: str, jobs: int = 1, threads: int | None = None,
                   progress: bool = True, resume: bool = False, report_only: bool = False) -> dict:
    """Run the grid and write ``results.json``, ``results.md`` and the PNG into ``out_dir``.

    Each finished run is recorded in ``out_dir/runs.jsonl`` at once; ``resume=True`` reuses
    the runs recorded there (same mechanism, S and configuration) instead of training them.
    ``report_only=True`` trains nothing: the report covers the grid's runs recorded so far
    (the journal is only read, so the grid's own process may still be appending to it).
    """
    setting = SETTINGS[spec.setting]
    check_grid(mechanisms, sizes, config)
    out_dir = Path(out_dir)
    journal = RunJournal(out_dir / JOURNAL_NAME, resume=resume, read_only=report_only)
    grid_runs = len(mechanisms) * len(sizes)
    reused = journal.count(_run_key((setting.name, m, s, config)) for m in mechanisms for s in sizes)
    if report_only and not reused:
        raise ValueError(f"--report-only: {journal.path} holds none of this grid's runs "
                         "(same mechanisms, sizes and training settings)")
    started = time.perf_counter()
    rows = run_grid(setting, mechanisms, sizes, config, jobs=jobs, threads=threads, progress=progress,
                    journal=journal, only_recorded=report_only)
    elapsed = time.perf_counter() - started
    cpu = sum(row["cpu_seconds"] for row in rows)  # each run's own process, workers included
    title = f"repro {spec.command}"
    shapes = {"setting": spec.setting, "sizes": list(sizes), "seq_len": [setting.seq_len(s) for s in sizes],
              "key_dim": config.key_dim, "heads": 1}
    metadata = report.collect_metadata(device=config.device, command=command, shapes=shapes)
    metadata.update(config=asdict(config), mechanisms=list(mechanisms), wall_seconds=elapsed, cpu_seconds=cpu,
                    jobs=jobs, threads=threads or metadata["threads"], reused_runs=reused, grid_runs=grid_runs,
                    report_only=report_only,
                    paper="Schlag, Irie & Schmidhuber 2021, Linear Transformers Are Secretly Fast Weight Programmers")
    summary = summarize(rows, target_loss=config.target_loss)
    files = [report.write_json(out_dir / "results.json", rows=rows, metadata=metadata, summary=summary)]
    markdown = markdown_report(rows, title=title, command=command, setting=setting, config=config, summary=summary)
    # The wall time and the processes describe this invocation: said only when it trained runs.
    trained_here = len(rows) - reused if not report_only else 0
    markdown += ((f"\nWall time {elapsed:.0f} s ({jobs} process(es) x {metadata['threads']} thread(s)), "
                  if trained_here else "\n")
                 + f"CPU time of the runs {cpu:.0f} s, on {metadata['device_name']}."
                 + (f" {reuse_note(reused, len(rows))}." if reused and not report_only else "")
                 + (f" Interim report (--report-only): {len(rows)} of the grid's {grid_runs} runs are recorded;"
                    " empty cells are not run yet." if report_only else "") + "\n")
    (out_dir / "results.md").write_text(markdown)
    files.append(out_dir / "results.md")
    files.append(write_plot(rows, out_dir / spec.plot_name, title=f"{setting.title}", target_loss=config.target_loss,
                            mark_d_dot=spec.mark_d_dot))
    return {"metadata": metadata, "rows": rows, "summary": summary, "markdown": markdown, "files": files}


# --- command line -------------------------------------------------------------------




class ExperimentCommand:
    """One ``linattn repro`` subcommand (``HELP``, ``DESCRIPTION``, ``add_arguments``, ``run_command``)."""

    def __init__(self, spec: ExperimentSpec, help_text: str, description: str):
        self.spec, self.HELP, self.DESCRIPTION = spec, help_text, description

    def add_arguments(self, parser) -> None:
        spec, defaults = self.spec, TrainConfig()
        sizes = spec.default_sizes
        parser.add_argument("--sizes", nargs="+", type=_int_at_least(2, "a number of keys S"), metavar="S",
                            help=f"numbers of unique keys S (default {sizes[0]} to {sizes[-1]} step {sizes[1] - sizes[0]}; "
                                 f"--quick: {' '.join(map(str, spec.quick_sizes))})")
        parser.add_argument("--quick", action="store_true",
                            help=f"a few-minute preview: S = {' '.join(map(str, spec.quick_sizes))}, mechanisms "
                                 f"{' '.join(spec.quick_mechanisms)}, at most {spec.quick_max_steps} steps per run "
                                 "(each unless given explicitly)")
        parser.add_argument("--mechanisms", nargs="+", choices=list(MECHANISMS), metavar="NAME",
                            help=f"mechanisms to train (default {' '.join(spec.default_mechanisms)}; "
                                 f"any of {' '.join(MECHANISMS)})")
        parser.add_argument("--max-steps", type=_int_at_least(1, "a step count"),
                            help=f"step cap per run (default {spec.default_max_steps}, --quick {spec.quick_max_steps})")
        parser.add_argument("--eval-every", type=_int_at_least(1, "a step count"), default=defaults.eval_every,
                            help="training steps between evaluations")
        parser.add_argument("--eval-sequences", type=_int_at_least(1, "a count"), default=defaults.eval_sequences,
                            help="fresh sequences per evaluation, every key of each asked")
        parser.add_argument("--patience", type=_int_at_least(1, "a count"), default=defaults.patience,
                            help="stop after this many evaluations without improvement")
        parser.add_argument("--target-loss", type=_positive_float, default=defaults.target_loss,
                            help="stop once the evaluation loss is at most this")
        parser.add_argument("--batch-size", type=_int_at_least(1, "a batch size"), default=defaults.batch_size)
        parser.add_argument("--lr", type=_positive_float, default=defaults.lr, help="Adam learning rate")
        parser.add_argument("--key-dim", type=_int_at_least(1, "a dimension"), default=defaults.key_dim,
                            help="d_key, the dimension of keys and queries before the feature map")
        parser.add_argument("--emb-dim", type=_int_at_least(1, "a dimension"),
                            help="key embedding size (default int(1.1 * 2S), as the paper's code)")
        parser.add_argument("--seed", type=int, default=defaults.seed,
                            help="seed of data, initialisation and FAVOR+ projections")
        parser.add_argument("--device", choices=["cpu", "cuda"], default=defaults.device)
        parser.add_argument("--threads", type=_int_at_least(1, "a thread count"),
                            help="torch intra-op CPU threads per run (default: torch's choice)")
        parser.add_argument("--jobs", type=_int_at_least(1, "a process count"), default=1,
                            help="runs trained at once in worker processes (e.g. --jobs 2 --threads 1 on 2 cores)")
        parser.add_argument("--out", type=Path, default=Path(f"results/repro-{spec.command}"), help="output directory")
        parser.add_argument("--resume", action="store_true",
                            help=f"reuse the runs recorded in --out/{JOURNAL_NAME} by an earlier (interrupted or "
                                 "partial) invocation with the same settings; without it the journal starts empty")
        parser.add_argument("--report-only", action="store_true",
                            help=f"train nothing: write the report of the grid's runs recorded in --out/{JOURNAL_NAME} "
                                 "so far (an interim report; the journal is only read)")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")

    def run_command(self, args) -> int:
        spec = self.spec
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        sizes = tuple(sorted(set(args.sizes or (spec.quick_sizes if args.quick else spec.default_sizes))))
        mechanisms = tuple(dict.fromkeys(args.mechanisms or (spec.quick_mechanisms if args.quick else spec.default_mechanisms)))
        config = TrainConfig(
            key_dim=args.key_dim, emb_dim=args.emb_dim, batch_size=args.batch_size, lr=args.lr,
            max_steps=args.max_steps or (spec.quick_max_steps if args.quick else spec.default_max_steps),
            eval_every=args.eval_every, eval_sequences=args.eval_sequences, patience=args.patience,
            target_loss=args.target_loss, seed=args.seed, device=args.device,
        )
        result = run_experiment(spec, mechanisms=mechanisms, sizes=sizes, config=config, out_dir=args.out,
                                command=getattr(args, "command_line", f"linattn repro {spec.command}"),
                                jobs=args.jobs, threads=args.threads, progress=not args.no_progress,
                                resume=args.resume, report_only=args.report_only)
        print(result["markdown"])
        print("wrote " + ", ".join(str(p) for p in result["files"]))
        return 0


capacity_command = ExperimentCommand(
    CAPACITY,
    "FWP paper Setting 1: retrieval loss vs number of keys S per kernel (capacity ~ d_dot)",
    "Reproduces Setting 1 of 'Linear Transformers Are Secretly Fast Weight Programmers' (seed 001): one "
    "attention layer (d_key 64) reads S one-to-one key/value pairs (L = S, without replacement) and retrieves "
    "the value of a queried key. Trains one model per (mechanism, S) with Adam until the evaluation loss is "
    "<= 1e-3 or stops improving, and writes the final losses and accuracies (results.json, results.md, and "
    "fwp_capacity.png: both against S) to --out. Expected: each kernel fails once S exceeds its d_dot; "
    "softmax holds far longer.",
)

update_rule_command = ExperimentCommand(
    UPDATE_RULE,
    "FWP paper Setting 2: sum rule vs delta rule when keys repeat (L = 2S, last value wins)",
    "Reproduces Setting 2 of 'Linear Transformers Are Secretly Fast Weight Programmers' (seed 001): L = 2S "
    "pairs drawn with replacement, the target is the value at the queried key's last occurrence. Compares the "
    "sum update rule of linear attention (sum-dpfp-1) with the delta rule (delta-dpfp-1, delta-dpfp-2, "
    "delta-linear); writes results.json, results.md and fwp_update_rule.png to --out. Expected: only the delta "
    "rule solves it.",
)
