"""``linattn repro mqar``: multi-query associative recall (Zoology, Arora et al. 2023) per mechanism.

**Task** (``make_mqar_batch``; Zoology's ``multiquery_ar`` generator, same conventions).
Vocabulary ``V`` (default 8192), split in two: keys are drawn from ``[1, V/2)`` (id 0 is
left out, as Zoology reserves it as its "empty" marker before filling), values from
``[V/2, V)``; within a sequence the ``N`` keys are distinct, and so are the ``N`` values.
The first ``2N`` positions hold ``k1 v1 k2 v2 ... kN vN``. Each key is then asked once in
the remaining ``T - 2N`` positions: with ``space = (T - 2N) // 2`` slots at the even offsets
``2N + 2g`` (``g = 0 .. space-1``), the ``N`` slots are drawn without replacement with
probability proportional to ``(g + 1)^(a - 1)`` (``a = power_a``, default 0.01: a power law,
so most queries come soon after the pairs and a few far later), and the keys are assigned
to the drawn slots in random order. At a query position the input is the key and the
target -- the next-token prediction made there -- is the value paired with it; every other
position has target -100 (ignored). All non-pair, non-query positions are filler tokens
drawn uniformly from the whole vocabulary ``[0, V)`` (Zoology's ``random_non_queries=True``;
a filler token may therefore equal a key or a value, which only makes the task a little
noisier). ``T >= 4N`` is required (so that ``space >= N``), as in Zoology.

**Models.** A 2-layer ``linattn.models.LM`` (vocab ``V``, tied embeddings) per mechanism:
``softmax``, ``vq`` (Transformer-VQ GAU pairs; k-means codebook init, dead-code restart
below an EMA count of 0.5), ``delta`` (DeltaNet), ``linear-elu`` (kernel attention with
elu+1), ``favor`` (FAVOR+, fixed random features) and ``local`` (sliding-window softmax;
its window, default 32, is smaller than the sequences, so it must fail on long gaps). Widths
``d_model`` from a grid. Only the query positions are scored, so the model's output
projection is applied at those positions only (``query_logits``; the hidden states of every
position are still computed by ``LM.forward``) -- the full ``[B, T, V]`` logits would cost
more than the rest of the model.

**Training.** One model per (mechanism, d_model, (T, N)): AdamW (peak lr 1e-2, weight decay
0.1 on matrices, betas 0.9/0.98), batch 64, a fixed number of steps (default 3000) with linear
warm-up over the first 10 % and cosine decay to 10 % of the peak, gradient clipping at 1.0,
a fresh batch every step from a generator seeded by (seed, T, N) -- every mechanism and
width sees the same data at the same (T, N). Loss: cross-entropy over the query positions
plus the VQ commitment loss; ``update_codebooks()`` after every optimizer step. Evaluation:
accuracy (argmax over the whole vocabulary) on the query positions of fresh held-out
batches from a differently seeded generator. Chance is about 1 / (V/2). The lr is one
documented choice, not a sweep: on softmax, d_model 64, (T, N) = (64, 4), lr 3e-3 reached
loss 7.0 after 400 steps, 1e-2 reached 6.1, and 1e-2 over 2000 steps went through the
induction-style phase transition (near step 1700) to 57 % accuracy; 3e-2 was no faster.

**Budget.** MQAR at V = 8192 is learned late: softmax at d_model 64, (64, 4) needs about
1500-2000 steps of 64 sequences before its accuracy leaves the ~10-25 % plateau of
"answer with some value of the context". The default grid is the CPU-sized one whose
results are published (docs/results.md): d_model 64, (T, N) in {(64, 4), (128, 8)},
3000 steps, past the transition -- about 1.3 CPU-hours for the six mechanisms at
(64, 4) and roughly twice that at (128, 8), i.e. ~2 h with ``--jobs 2`` on 2 cores
(``--resume`` continues an interrupted grid). ``--quick`` is d_model 64, (64, 4), 300
steps (~480 CPU-seconds), a smoke test that stops before any mechanism has learned the
task. The Zoology-sized grid ``--d-models 64 128 --lengths 64 128 256`` costs about 32
CPU-seconds per step for all six mechanisms: ~27 CPU-hours at 3000 steps.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .._checks import int_at_least as _int_at_least, positive_float as _positive_float
from ..bench import report
from ..models import LM, LMConfig
from ..train.schedule import learning_rate
from ._parallel import JOURNAL_NAME, RunJournal, map_runs, reuse_note

HELP = "multi-query associative recall (Zoology): accuracy per mechanism, width and sequence length"
DESCRIPTION = __doc__.split("\n\n", 1)[1]

IGNORE = -100

# CLI name -> LMConfig attention spec ("local" gets its window appended).
MECHANISMS = {
    "softmax": "softmax",
    "vq": "vq",
    "delta": "delta",
    "linear-elu": "linear:elu",
    "favor": "favor",
    "local": "local",
}

DEFAULT_LENGTHS = (64, 128)
DEFAULT_D_MODELS = (64,)
QUICK_LENGTHS = (64,)
QUICK_D_MODELS = (64,)
D_MODEL_RANGE = (16, 256)  # the documented grid uses 64..256; smaller widths are for smoke tests


# --- data ---------------------------------------------------------------------------


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def make_mqar_batch(
    batch_size: int,
    seq_len: int,
    num_pairs: int,
    vocab_size: int = 8192,
    power_a: float = 0.01,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MQAR batch (see the module docstring for the layout).

    Returns ``(inputs [B, T] int64, targets [B, T] int64)``; ``targets`` is -100 except at
    the ``num_pairs`` query positions of each row, where it is the value paired with the key
    at that position. ``generator`` (a CPU ``torch.Generator``) makes it reproducible.
    """
    _check_int("batch_size", batch_size, 1)
    _check_int("num_pairs", num_pairs, 1)
    _check_int("seq_len", seq_len, 4)
    _check_int("vocab_size", vocab_size, 4)
    if seq_len < 4 * num_pairs:
        raise ValueError(f"seq_len must be >= 4 * num_pairs (the pairs, and a query slot for each key at an even "
                         f"offset after them); got seq_len={seq_len}, num_pairs={num_pairs} "
                         f"(needs seq_len >= {4 * num_pairs})")
    half = vocab_size // 2
    if num_pairs > min(half - 1, vocab_size - half):
        raise ValueError(f"vocab_size={vocab_size} has {half - 1} key ids [1, {half}) and {vocab_size - half} value "
                         f"ids [{half}, {vocab_size}); too few for {num_pairs} distinct pairs")
    if not (isinstance(power_a, (int, float)) and not isinstance(power_a, bool) and math.isfinite(power_a)
            and power_a > 0):
        raise ValueError(f"power_a must be a positive number, got {power_a!r}")

    B, T, N = batch_size, seq_len, num_pairs
    # Distinct keys in [1, half) and distinct values in [half, V) per row.
    # (the N largest of i.i.d. uniforms: a uniformly random N-subset in uniformly random order)
    keys = 1 + torch.rand(B, half - 1, generator=generator).topk(N, dim=1).indices
    values = half + torch.rand(B, vocab_size - half, generator=generator).topk(N, dim=1).indices
    inputs = torch.randint(vocab_size, (B, T), generator=generator)  # filler
    inputs[:, 0 : 2 * N : 2] = keys
    inputs[:, 1 : 2 * N : 2] = values
    # Query slots: offsets 2N + 2g, g drawn without replacement with p(g) ∝ (g+1)^(a-1).
    space = (T - 2 * N) // 2
    weights = torch.arange(1, space + 1, dtype=torch.float64).pow(power_a - 1)
    gaps = torch.multinomial(weights.expand(B, space), N, replacement=False, generator=generator)
    positions = 2 * N + 2 * gaps  # [B, N]; key i is asked at positions[:, i]
    inputs.scatter_(1, positions, keys)
    targets = torch.full((B, T), IGNORE, dtype=torch.long)
    targets.scatter_(1, positions, values)
    return inputs, targets


def query_positions(targets: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` sorted positions where ``targets != -100`` (every row must have the same count)."""
    mask = targets != IGNORE
    counts = mask.sum(1)
    if counts.numel() == 0 or not bool((counts == counts[0]).all()) or int(counts[0]) == 0:
        raise ValueError(f"every row needs the same number (>= 1) of query positions, got {counts.tolist()}")
    return mask.nonzero()[:, 1].view(targets.shape[0], int(counts[0]))


def query_logits(model: LM, inputs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``model(inputs)``'s logits at ``positions [B, N]`` only: ``([B, N, V], aux)``.

    ``LM.forward`` runs unchanged except that a pre-hook on the final norm keeps only the
    hidden states of the query positions, so the ``[B, T, V]`` output projection (the bulk of
    the cost at V = 8192) is never built. Equal to ``model(inputs)[0].gather(...)``.
    """
    index = positions.unsqueeze(-1).expand(-1, -1, model.config.d_model)

    def keep_queries(_module, args):
        return (args[0].gather(1, index),)

    handle = model.norm.register_forward_pre_hook(keep_queries)
    try:
        logits, _, aux = model(inputs)
    finally:
        handle.remove()
    return logits, aux


# --- models and training ------------------------------------------------------------


@dataclass(frozen=True)
class MQARConfig:
    """Hyper-parameters shared by every run of a grid."""

    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-2
    weight_decay: float = 0.1
    warmup_fraction: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_batches: int = 4
    vocab_size: int = 8192
    power_a: float = 0.01
    n_heads: int = 2
    window: int = 32
    favor_features: int = 64
    codebook_size: int = 64
    block_size: int = 32
    gau_d_k: int = 64
    seed: int = 0

    def validate(self) -> None:
        for name in ("steps", "batch_size", "eval_batches", "vocab_size", "n_heads", "window", "favor_features",
                     "codebook_size", "block_size", "gau_d_k"):
            _check_int(name, getattr(self, name), 1)
        for name in ("lr", "power_a", "grad_clip"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in ("weight_decay", "warmup_fraction", "min_lr_ratio"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value <= 1):
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def attention_spec(mechanism: str, config: MQARConfig) -> str:
    """The ``LMConfig.attention`` spec of a mechanism name (``local`` -> ``local:WINDOW``)."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"unknown mechanism {mechanism!r}; choose from {', '.join(MECHANISMS)}")
    spec = MECHANISMS[mechanism]
    return f"local:{config.window}" if spec == "local" else spec


def model_config(mechanism: str, d_model: int, config: MQARConfig) -> LMConfig:
    """The 2-layer LM of one run."""
    _check_int("d_model", d_model, 1)
    if d_model % config.n_heads:
        raise ValueError(f"d_model={d_model} must be divisible by n_heads={config.n_heads}")
    return LMConfig(
        vocab_size=config.vocab_size, d_model=d_model, n_layers=2, attention=attention_spec(mechanism, config),
        n_heads=config.n_heads, favor_features=config.favor_features, feature_seed=config.seed,
        codebook_size=config.codebook_size, block_size=config.block_size, gau_d_k=config.gau_d_k,
        kmeans_init=True, dead_code_threshold=0.5, chunk_size=32,
    )


def _generator(*parts: int) -> torch.Generator:
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


def default_pairs(seq_len: int) -> int:
    """Pairs for a length when ``--pairs`` is not given: ``T / 16`` (at least 1)."""
    return max(1, seq_len // 16)


@torch.no_grad()
def evaluate(model: LM, seq_len: int, num_pairs: int, config: MQARConfig, generator: torch.Generator) -> dict:
    """Accuracy and mean cross-entropy on the query positions of ``eval_batches`` fresh batches."""
    was_training = model.training
    model.eval()  # no codebook statistics
    hits = total = 0
    loss_sum = 0.0
    try:
        for _ in range(config.eval_batches):
            inputs, targets = make_mqar_batch(config.batch_size, seq_len, num_pairs, config.vocab_size,
                                              config.power_a, generator)
            positions = query_positions(targets)
            logits, _ = query_logits(model, inputs, positions)
            wanted = targets.gather(1, positions)
            loss_sum += F.cross_entropy(logits.flatten(0, 1), wanted.flatten(), reduction="sum").item()
            hits += int((logits.argmax(-1) == wanted).sum())
            total += wanted.numel()
    finally:
        model.train(was_training)
    return {"accuracy": hits / total, "loss": loss_sum / total, "queries": total}


def train_run(
    mechanism: str,
    d_model: int,
    seq_len: int,
    num_pairs: int,
    config: MQARConfig,
    *,
    on_step: Callable[[int, float], None] | None = None,
) -> dict:
    """Train one model for ``config.steps`` steps, evaluate it, return its result row."""
    model_cfg = model_config(mechanism, d_model, config)
    make_mqar_batch(1, seq_len, num_pairs, config.vocab_size, config.power_a)  # validate the sizes up front
    torch.manual_seed(_generator(config.seed, d_model, seq_len, num_pairs, 1).initial_seed())
    model = LM(model_cfg)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms, biases
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.98),
    )
    train_data = _generator(config.seed, seq_len, num_pairs, 2)
    eval_data = _generator(config.seed, seq_len, num_pairs, 3)
    warmup = max(1, round(config.warmup_fraction * config.steps))
    log_every = max(1, config.steps // 50)
    curve: list[list[float]] = []
    recent: list[float] = []
    steps_taken = 0
    status = "ok"
    start = time.perf_counter()
    for step in range(1, config.steps + 1):
        lr = learning_rate(step - 1, peak=config.lr, total_steps=config.steps, warmup_steps=warmup,
                           min_ratio=config.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = make_mqar_batch(config.batch_size, seq_len, num_pairs, config.vocab_size,
                                          config.power_a, train_data)
        positions = query_positions(targets)
        logits, aux = query_logits(model, inputs, positions)
        task_loss = F.cross_entropy(logits.flatten(0, 1), targets.gather(1, positions).flatten())
        loss = task_loss + aux["commit_loss"]
        if not torch.isfinite(loss):
            status = "non_finite"
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        model.update_codebooks()
        steps_taken += 1
        value = task_loss.item()
        recent = (recent + [value])[-20:]
        if step % log_every == 0 or step == config.steps:
            curve.append([step, value])
            if on_step is not None:
                on_step(step, value)
    train_seconds = time.perf_counter() - start
    # A diverged run scores 0 and has no evaluation loss (None keeps results.json strict JSON).
    result = evaluate(model, seq_len, num_pairs, config, eval_data) if status == "ok" else None
    if result is None or not math.isfinite(result["loss"]):
        status = "non_finite"
        result = {"accuracy": 0.0, "loss": None, "queries": 0 if result is None else result["queries"]}
    usage = model.codebook_usage()
    if usage is not None and not math.isfinite(usage["perplexity"]):
        usage["perplexity"] = None
    return {
        "mechanism": mechanism,
        "spec": model_cfg.attention,
        "d_model": d_model,
        "seq_len": seq_len,
        "num_pairs": num_pairs,
        "accuracy": result["accuracy"],
        "eval_loss": result["loss"],
        "eval_queries": result["queries"],
        "final_loss": sum(recent) / len(recent) if recent else None,  # mean train CE of the last 20 steps
        "steps": steps_taken,
        "status": status,
        "seconds": time.perf_counter() - start,
        "train_seconds": train_seconds,
        "parameters": model.num_parameters(),
        "codebook_usage": usage,
        "loss_curve": curve,
    }


def run_grid(
    mechanisms: Sequence[str],
    d_models: Sequence[int],
    tasks: Sequence[tuple[int, int]],
    config: MQARConfig,
    *,
    jobs: int = 1,
    threads: int = 1,
    progress: bool = True,
    journal: RunJournal | None = None,
) -> list[dict]:
    """Every (mechanism, d_model, (T, N)) run, in grid order, with a tqdm bar over runs.

    ``jobs > 1`` trains that many runs at once in worker processes (spawned, ``threads``
    torch threads each). Runs are independent and seeded, so the rows do not depend on
    ``jobs``. With a ``journal``, runs recorded there are reused and new ones recorded.
    """
    from tqdm.auto import tqdm

    check_grid(mechanisms, d_models, tasks, config)
    grid = [(name, d, t, n, config) for name in mechanisms for d in d_models for t, n in tasks]

    def show_steps(run: tuple):
        name, d_model, seq_len, num_pairs, _ = run
        return lambda step, loss: bar.set_postfix_str(f"{name} d={d_model} T={seq_len} N={num_pairs} "
                                                      f"step {step} loss {loss:.3f}")

    def describe(row: dict) -> str:
        return (f"{row['mechanism']} d={row['d_model']} T={row['seq_len']} N={row['num_pairs']} "
                f"acc {row['accuracy']:.3f}")

    with tqdm(total=len(grid), desc="repro mqar", unit="run", disable=not progress) as bar:
        return map_runs(train_run, grid, jobs=jobs, threads=threads, bar=bar, describe=describe,
                        progress_kwarg="on_step", show_progress=show_steps,
                        journal=journal, run_key=_run_key)


def _run_key(run: tuple) -> dict:
    """What identifies a run of the grid in the journal: its arguments and configuration."""
    mechanism, d_model, seq_len, num_pairs, config = run
    return {"mechanism": mechanism, "d_model": d_model, "seq_len": seq_len, "num_pairs": num_pairs,
            "config": asdict(config)}


def check_grid(mechanisms: Sequence[str], d_models: Sequence[int], tasks: Sequence[tuple[int, int]],
               config: MQARConfig) -> None:
    """Every value of the grid, before anything is trained: a clear ValueError otherwise."""
    if not mechanisms or not d_models or not tasks:
        raise ValueError("need at least one mechanism, one d_model and one sequence length")
    unknown = [m for m in mechanisms if m not in MECHANISMS]
    if unknown:
        raise ValueError(f"unknown mechanism(s) {', '.join(map(repr, unknown))}; choose from {', '.join(MECHANISMS)}")
    config.validate()
    low, high = D_MODEL_RANGE
    for d in d_models:
        if isinstance(d, bool) or not isinstance(d, int) or not low <= d <= high:
            raise ValueError(f"d_model must be an int in [{low}, {high}], got {d!r}")
        if d % config.n_heads:
            raise ValueError(f"d_model={d} must be divisible by n_heads={config.n_heads}")
    for seq_len, num_pairs in tasks:
        make_mqar_batch(1, seq_len, num_pairs, config.vocab_size, config.power_a)


# --- reports ------------------------------------------------------------------------


def _number(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.3f}"


def _task_label(seq_len: int, num_pairs: int) -> str:
    return f"T={seq_len}, {num_pairs} pairs"


def markdown_report(rows: Sequence[dict], *, command: str, config: MQARConfig, metadata: dict) -> str:
    """Accuracy table (rows: mechanism; columns: (T, pairs) per d_model) and per-run details."""
    names = list(dict.fromkeys(r["mechanism"] for r in rows))
    d_models = sorted({r["d_model"] for r in rows})
    tasks = sorted({(r["seq_len"], r["num_pairs"]) for r in rows})
    find = {(r["mechanism"], r["d_model"], r["seq_len"], r["num_pairs"]): r for r in rows}
    columns = [(d, t) for d in d_models for t in tasks]
    head = "| mechanism | " + " | ".join(f"d={d}, {_task_label(*t)}" for d, t in columns) + " |"
    lines = [
        "# repro mqar: multi-query associative recall (Zoology)",
        "",
        f"`{command}`",
        "",
        f"2-layer LM, vocab {config.vocab_size}, {config.n_heads} heads; AdamW lr {config.lr:g} (warm-up "
        f"{config.warmup_fraction:.0%}, cosine to {config.min_lr_ratio:g}x), weight decay {config.weight_decay:g}, "
        f"batch {config.batch_size}, {config.steps} steps; power-law query gaps a = {config.power_a:g}; local window "
        f"{config.window}; FAVOR+ {config.favor_features} features; VQ codebook {config.codebook_size}, block "
        f"{config.block_size}, d_k {config.gau_d_k}; seed {config.seed}. Accuracy on the query positions of "
        f"{config.eval_batches} x {config.batch_size} held-out sequences (chance ~ {2 / config.vocab_size:.1e}).",
        "",
        "## Accuracy",
        "",
        head,
        "|" + "|".join(" --- " for _ in range(len(columns) + 1)) + "|",
    ]
    for name in names:
        cells = []
        for d, (t, n) in columns:
            r = find.get((name, d, t, n))
            cells.append("" if r is None else f"{r['accuracy']:.3f}" + ("" if r["status"] == "ok" else " (diverged)"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Runs",
        "",
        "| mechanism | spec | d_model | T | pairs | parameters | accuracy | eval loss | final train loss | steps | "
        "seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['mechanism']} | `{r['spec']}` | {r['d_model']} | {r['seq_len']} | {r['num_pairs']} | "
            f"{r['parameters']:,} | {r['accuracy']:.3f} | {_number(r['eval_loss'])} | {_number(r['final_loss'])} | "
            f"{r['steps']} | {r['seconds']:.0f} |"
        )
    lines += [
        "",
        (f"Wall time: {metadata.get('seconds', 0):.0f} s on {metadata['device_name']} "
         f"({metadata.get('jobs', 1)} process(es) x {metadata['threads']} thread(s))."
         if metadata.get("reused_runs", 0) < len(rows) else f"Runs on {metadata['device_name']}.")
        + (f" {reuse_note(metadata['reused_runs'], len(rows))}." if metadata.get("reused_runs") else ""),
    ]
    return "\n".join(lines) + "\n"


def write_plot(rows: Sequence[dict], path: Path) -> Path:
    """Accuracy against sequence length, one line per mechanism, one panel per d_model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d_models = sorted({r["d_model"] for r in rows})
    names = list(dict.fromkeys(r["mechanism"] for r in rows))
    figure, axes = plt.subplots(1, len(d_models), figsize=(5.5 * len(d_models), 4.5), squeeze=False, sharey=True)
    for axis, d in zip(axes[0], d_models):
        lengths = sorted({r["seq_len"] for r in rows if r["d_model"] == d})
        for index, name in enumerate(names):
            mine = sorted((r for r in rows if r["mechanism"] == name and r["d_model"] == d),
                          key=lambda r: (r["seq_len"], r["num_pairs"]))
            if mine:
                axis.plot([r["seq_len"] for r in mine], [r["accuracy"] for r in mine], marker="o",
                          color=f"C{index % 10}", label=name)
        if len(lengths) > 1:
            axis.set_xscale("log", base=2)
        pairs = {t: sorted({r["num_pairs"] for r in rows if r["d_model"] == d and r["seq_len"] == t}) for t in lengths}
        axis.set_xticks(lengths, [f"{t}\n({'/'.join(map(str, pairs[t]))} pairs)" for t in lengths])
        axis.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        axis.set_ylim(-0.03, 1.03)
        axis.set_xlabel("sequence length T")
        axis.set_title(f"d_model = {d}")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    axes[0][0].set_ylabel("query accuracy")
    figure.suptitle("MQAR: accuracy vs sequence length")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return Path(path)


def run_experiment(mechanisms: Sequence[str], d_models: Sequence[int], tasks: Sequence[tuple[int, int]],
                   config: MQARConfig, *, out_dir: Path, command: str, jobs: int = 1, threads: int = 1,
                   progress: bool = True, resume: bool = False) -> dict:
    """Run the grid and write ``results.json``, ``results.md`` and ``mqar_accuracy.png`` into ``out_dir``.

    Each finished run is recorded in ``out_dir/runs.jsonl`` at once; ``resume=True`` reuses
    the runs recorded there (same mechanism, d_model, task and configuration).
    """
    check_grid(mechanisms, d_models, tasks, config)
    out_dir = Path(out_dir)
    journal = RunJournal(out_dir / JOURNAL_NAME, resume=resume)
    reused = journal.count(_run_key((m, d, t, n, config)) for m in mechanisms for d in d_models for t, n in tasks)
    started = time.perf_counter()
    rows = run_grid(mechanisms, d_models, tasks, config, jobs=jobs, threads=threads, progress=progress,
                    journal=journal)
    shapes = {"n_layers": 2, "vocab_size": config.vocab_size, "d_models": list(d_models),
              "tasks": [{"seq_len": t, "num_pairs": n} for t, n in tasks]}
    metadata = report.collect_metadata(device="cpu", command=command, shapes=shapes)
    metadata.update(seconds=time.perf_counter() - started, config=asdict(config), mechanisms=list(mechanisms),
                    jobs=jobs, threads=threads, reused_runs=reused,
                    paper="Arora et al. 2023, Zoology: Measuring and Improving Recall in Efficient Language Models")
    files = [report.write_json(out_dir / "results.json", rows=rows, metadata=metadata)]
    markdown = markdown_report(rows, command=command, config=config, metadata=metadata)
    (out_dir / "results.md").write_text(markdown)
    files.append(out_dir / "results.md")
    files.append(write_plot(rows, out_dir / "mqar_accuracy.png"))
    return {"metadata": metadata, "rows": rows, "markdown": markdown, "files": files}


# --- command line -------------------------------------------------------------------



def _d_model(text: str) -> int:
    low, high = D_MODEL_RANGE
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected a d_model in [{low}, {high}], got {text!r}")
    return value



QUICK_STEPS = 300
DEFAULT_STEPS = MQARConfig().steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MQARConfig()
    parser.add_argument("--mechanisms", nargs="+", choices=list(MECHANISMS), metavar="NAME",
                        help=f"mechanisms (default all: {' '.join(MECHANISMS)})")
    parser.add_argument("--d-models", nargs="+", type=_d_model, metavar="D",
                        help=f"model widths (default {' '.join(map(str, DEFAULT_D_MODELS))}; --quick "
                             f"{' '.join(map(str, QUICK_D_MODELS))})")
    parser.add_argument("--lengths", nargs="+", type=_int_at_least(4, "a sequence length"), metavar="T",
                        help=f"sequence lengths (default {' '.join(map(str, DEFAULT_LENGTHS))}; --quick "
                             f"{' '.join(map(str, QUICK_LENGTHS))})")
    parser.add_argument("--pairs", nargs="+", type=_int_at_least(1, "a number of pairs"), metavar="N",
                        help="key-value pairs per length (one per --lengths entry, or one for all; default T/16)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a few minutes: d_model {' '.join(map(str, QUICK_D_MODELS))}, T "
                             f"{' '.join(map(str, QUICK_LENGTHS))}, {QUICK_STEPS} steps (unless given explicitly)")
    parser.add_argument("--steps", type=_int_at_least(1, "a step count"),
                        help=f"training steps per run (default {DEFAULT_STEPS}; --quick {QUICK_STEPS})")
    parser.add_argument("--batch-size", type=_int_at_least(1, "a batch size"), default=d.batch_size,
                        help="sequences per training step (default %(default)s)")
    parser.add_argument("--lr", type=_positive_float, default=d.lr,
                        help="peak AdamW learning rate (default %(default)s)")
    parser.add_argument("--eval-batches", type=_int_at_least(1, "a count"), default=d.eval_batches,
                        help="held-out batches (of --batch-size sequences) for the accuracy (default %(default)s)")
    parser.add_argument("--vocab-size", type=_int_at_least(4, "a vocabulary size"), default=d.vocab_size,
                        help="keys from [1, V/2), values from [V/2, V) (default %(default)s, as Zoology)")
    parser.add_argument("--power-a", type=_positive_float, default=d.power_a,
                        help="power-law exponent a of the query gaps (p ∝ gap^(a-1); default %(default)s)")
    parser.add_argument("--n-heads", type=_int_at_least(1, "a head count"), default=d.n_heads,
                        help="heads of the attention blocks (default %(default)s)")
    parser.add_argument("--window", type=_int_at_least(1, "a window"), default=d.window,
                        help="window of the local mechanism (default %(default)s)")
    parser.add_argument("--favor-features", type=_int_at_least(1, "a feature count"), default=d.favor_features,
                        help="FAVOR+ random features (default %(default)s)")
    parser.add_argument("--codebook-size", type=_int_at_least(1, "a codebook size"), default=d.codebook_size,
                        help="VQ codes per layer (default %(default)s)")
    parser.add_argument("--block-size", type=_int_at_least(1, "a block size"), default=d.block_size,
                        help="VQ block length L (default %(default)s)")
    parser.add_argument("--gau-d-k", type=_int_at_least(1, "a dimension"), default=d.gau_d_k,
                        help="key width of the VQ layers' gated attention units (default %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="seed of data, initialisation and features (default %(default)s)")
    parser.add_argument("--jobs", type=_int_at_least(1, "a process count"), default=1,
                        help="runs trained at once in worker processes (default 1; use 2 on a 2-core machine)")
    parser.add_argument("--threads", type=_int_at_least(1, "a thread count"), default=1,
                        help="torch intra-op CPU threads per run (default 1: at these sizes more threads gain "
                             "little and stall badly on a busy machine)")
    parser.add_argument("--out", type=Path, default=Path("results/repro-mqar"),
                        help="output directory (default %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help=f"reuse the runs recorded in --out/{JOURNAL_NAME} by an earlier (interrupted or "
                             "partial) invocation with the same settings; without it the journal starts empty")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def resolve_tasks(lengths: Sequence[int], pairs: Sequence[int] | None) -> list[tuple[int, int]]:
    """(T, N) per length: ``pairs`` has one entry per length, a single entry for all, or None (T/16)."""
    if pairs is None:
        return [(t, default_pairs(t)) for t in lengths]
    if len(pairs) == 1:
        pairs = list(pairs) * len(lengths)
    if len(pairs) != len(lengths):
        raise ValueError(f"--pairs needs one value or one per length ({len(lengths)}), got {len(pairs)}")
    return list(dict.fromkeys(zip(lengths, pairs)))


def run_command(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    mechanisms = list(dict.fromkeys(args.mechanisms or MECHANISMS))
    d_models = list(dict.fromkeys(args.d_models or (QUICK_D_MODELS if args.quick else DEFAULT_D_MODELS)))
    lengths = list(args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS))
    tasks = resolve_tasks(lengths, args.pairs)
    config = MQARConfig(
        steps=args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS), batch_size=args.batch_size, lr=args.lr,
        eval_batches=args.eval_batches, vocab_size=args.vocab_size, power_a=args.power_a, n_heads=args.n_heads,
        window=args.window, favor_features=args.favor_features, codebook_size=args.codebook_size,
        block_size=args.block_size, gau_d_k=args.gau_d_k, seed=args.seed,
    )
    result = run_experiment(mechanisms, d_models, tasks, config, out_dir=args.out,
                            command=getattr(args, "command_line", "linattn repro mqar"), jobs=args.jobs,
                            threads=args.threads, progress=not args.no_progress, resume=args.resume)
    print(result["markdown"])
    print("wrote " + ", ".join(str(p) for p in result["files"]))
    return 0
