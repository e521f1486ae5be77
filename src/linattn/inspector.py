"""``linattn inspect``: how a trained model attends, per layer and head, on real text.

The model reads the first ``--tokens`` tokens of a split in one pass (no state). While it
runs, every attention op a layer calls is recorded with its inputs, and for the exact
mechanisms the attention probabilities ``p_t`` of each query t are recomputed from the
op's quadratic reference form (materialised: this bounds ``--tokens``):

- ``softmax`` and ``local`` (``Attention``): ``softmax(s q_t.k_j)`` over the keys query t sees
  (with ReRoPE, ``rerope=w``, ``s (R(min(t - j, w)) q_t).k_j``);
- ``vq``, ``vq-fsq`` and ``gau-softmax`` units (``GAU``): ``vq_attention_weights`` over the
  (quantized) keys, relative terms included; for VQ this is what the linear-time form computes.

Per head, over the queries that see more than one key (n_t keys), averaged over positions:

- entropy ``H_t = -sum_j p_tj log p_tj`` (nats), and its mean per position bucket
  ``[2^i, 2^{i+1})``: how it grows with the context (what the entropy-invariant scale keeps flat);
- l1/l2 sparsity (Hoyer 2004) ``(sqrt(n_t) - |p_t|_1 / |p_t|_2) / (sqrt(n_t) - 1)``: 0 for a
  uniform row, 1 for a one-hot row;
- entropy sparsity ``1 - H_t / log(n_t)``: 0 uniform, 1 one-hot;
- VQ units: the share of attention mass on the window (own and previous block) and on the
  cache (older blocks, read through the codes), over the queries that have a cache;
- quantized units: code use on these tokens — perplexity ``exp(entropy of the code
  histogram)``, codes never chosen, relative quantization error ``|k - k^| / |k|``.

Kernel layers (``linear``, ``favor``, ``delta`` and the gated ``retnet``, ``gla``,
``gated-delta``) have no probabilities to recompute; for them
the effective rank (Roy & Vetterli 2007) ``exp(-sum_i q_i log q_i)``, ``q_i = sigma_i / sum sigma``,
of the final state matrix per head is reported. ``soft-vq`` layers report nothing.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import defaultdict
from pathlib import Path

import torch

from . import reporting
from .data import open_data
from .nn import attention as attention_module
from .nn import delta_net as delta_module
from .nn import gau as gau_module
from .nn import gated_delta_net as gated_delta_module
from .nn import gla as gla_module
from .nn import retention as retention_module
from .nn.fsq import FSQuantizer
from .nn.quantizer import VectorQuantizer
from .ops.common.rotary import pairwise_rerope_scores
from .ops.vq import vq_attention_weights, windowed_weights
from .train.checkpoint import load_model
from .train.cli import add_runtime_flags, apply_threads
from ._checks import positive_int

SPLITS = ("train", "validation", "test")


# -- the measures of one attention row -----------------------------------------------------


def row_measures(probs: torch.Tensor, visible: torch.Tensor) -> dict[str, torch.Tensor]:
    """Entropy (nats), Hoyer's l1/l2 sparsity and the entropy sparsity of each row of
    ``probs [..., n]`` (rows sum to 1) given the number of keys each row sees, ``visible [...]``
    (> 1; see the module docstring for the formulas)."""
    logs = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
    entropy = -(probs * logs).sum(-1)
    n = visible.to(probs.dtype)
    hoyer = (n.sqrt() - 1 / probs.norm(dim=-1)) / (n.sqrt() - 1)  # |p|_1 = 1
    return {"entropy": entropy, "hoyer_sparsity": hoyer, "entropy_sparsity": 1 - entropy / n.log()}


def effective_rank(matrix: torch.Tensor) -> torch.Tensor:
    """``exp(entropy of the normalised singular values)`` of each ``[..., m, n]`` matrix."""
    sigma = torch.linalg.svdvals(matrix.double())
    q = sigma / sigma.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.exp(-(torch.where(q > 0, q * q.log(), torch.zeros_like(q))).sum(-1))


# -- recording what the layers compute -----------------------------------------------------


class _Recorder:
    """Per module (by name): attention probabilities ``[H, T, T]`` and kinds, states, codes."""

    def __init__(self, model):
        self.current: list[str] = []
        self.weights: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.kinds: dict[str, str] = {}
        self.states: dict[str, torch.Tensor] = {}
        self.codes: dict[str, dict] = {}
        self.block_size: dict[str, int] = {}
        self._handles = []
        for name, module in model.named_modules():
            if isinstance(module, (attention_module.Attention, gau_module.GAU, delta_module.DeltaNet,
                                   retention_module.MultiScaleRetention, gla_module.GatedLinearAttention,
                                   gated_delta_module.GatedDeltaNet)):
                self._handles.append(module.register_forward_pre_hook(self._enter(name)))
                self._handles.append(module.register_forward_hook(self._leave))
            if isinstance(module, (VectorQuantizer, FSQuantizer)):
                self._handles.append(module.register_forward_hook(self._quantized(name.rsplit(".", 1)[0], module)))

    def _enter(self, name):
        def hook(module, args):
            self.current.append(name)
        return hook

    def _leave(self, module, args, output):
        self.current.pop()

    def _quantized(self, owner: str, quantizer):
        def hook(module, args, output):
            k, (k_hat, codes, _) = args[0].detach(), output
            error = ((k - k_hat).norm(dim=-1) / k.norm(dim=-1).clamp_min(1e-12)).mean()
            counts = torch.bincount(codes.flatten(), minlength=quantizer.codebook_size).double()
            probs = counts / counts.sum()
            self.codes[owner] = {
                "perplexity": float(torch.exp(-(torch.where(probs > 0, probs * probs.log(), 0.0)).sum())),
                "unused_codes": int((counts == 0).sum()), "codebook_size": int(quantizer.codebook_size),
                "relative_quantization_error": float(error),
            }
        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    @contextlib.contextmanager
    def patched(self):
        """The layers' op calls recorded for the duration (each still computes as before)."""
        targets = [(attention_module, "softmax_attention", self._softmax),
                   (attention_module, "local_attention", self._local),
                   (attention_module, "linear_attention", self._kernel("linear")),
                   (gau_module, "vq_attention", self._vq),
                   (gau_module, "windowed_softmax", self._windowed),
                   (delta_module, "delta_rule", self._kernel("delta")),
                   (retention_module, "linear_attention", self._kernel("retnet")),
                   (gla_module, "linear_attention", self._kernel("gla")),
                   (gated_delta_module, "delta_rule", self._kernel("gated-delta"))]
        originals = [(module, name, getattr(module, name)) for module, name, _ in targets]
        for (module, name, wrap), (_, _, original) in zip(targets, originals):
            setattr(module, name, wrap(original))
        try:
            yield self
        finally:
            for module, name, original in originals:
                setattr(module, name, original)

    def _store(self, kind: str, weights: torch.Tensor) -> None:
        name = self.current[-1]
        self.kinds[name] = kind
        self.weights[name].append(weights.detach()[0].double().cpu())  # first sequence: [H, T, T]

    def _softmax(self, op):
        def recorded(q, k, v, *, causal=False, scale=None, bias=None, **rest):
            if bias is None and causal and k.shape[2] == q.shape[2]:
                self._store("softmax", _exact_weights(q, k, scale, None, rest.get("rerope"), rest.get("rotary_base")))
            return op(q, k, v, causal=causal, scale=scale, bias=bias, **rest)
        return recorded

    def _local(self, op):
        def recorded(q, k, v, *, window, scale=None, initial_state=None, **rest):
            if initial_state is None:
                self._store("local", _exact_weights(q, k, scale, window, rest.get("rerope"), rest.get("rotary_base")))
            return op(q, k, v, window=window, scale=scale, initial_state=initial_state, **rest)
        return recorded

    def _vq(self, op):
        def recorded(q, k_hat, v, codes, codebook, **kw):
            if kw.get("initial_state") is None:
                self.block_size[self.current[-1]] = kw["block_size"]
                weights = vq_attention_weights(q, k_hat, scale=kw.get("scale"), block_size=kw["block_size"],
                                               bias=kw.get("bias"), position_keys=kw.get("position_keys"),
                                               rerope=kw.get("rerope"), rotary_base=kw.get("rotary_base", 10000.0))
                self._store("vq", weights)
            return op(q, k_hat, v, codes, codebook, **kw)
        return recorded

    def _windowed(self, op):
        def recorded(q, k, v, table, positions_k, L, causal, past=0, row_scale=None):
            if past == 0:
                weights = windowed_weights(q, k, table, positions_k, L, causal, past, row_scale)
                self._store("gau-softmax", weights.flatten(1, 2))
            return op(q, k, v, table, positions_k, L, causal, past=past, row_scale=row_scale)
        return recorded

    def _kernel(self, kind: str):
        def wrap(op):
            def recorded(*args, **kw):
                out, state = op(*args, **kw)
                if state is not None:
                    matrix = state.kv if kind in ("linear", "retnet", "gla") else state.memory  # [B, Hkv, F, Dv]
                    self.kinds[self.current[-1]] = kind
                    self.states[self.current[-1]] = matrix.detach()[0].cpu()
                return out, state
            return recorded
        return wrap


def _exact_weights(q, k, scale, window: int | None, rerope: int | None = None, base: float | None = None):
    """Causal softmax probabilities ``[B, H, T, T]`` of ``q [B, H, T, D]`` on ``k [B, Hkv, T, D]``
    (``rerope``: ReRoPE's window, with the rotary ``base``; q and k unrotated)."""
    B, H, T, D = q.shape
    keys = k.repeat_interleave(H // k.shape[1], dim=1).double()
    if rerope is None:
        scores = q.double() @ keys.transpose(-1, -2)
    else:
        scores = pairwise_rerope_scores(q.double(), keys, 0, 0, rerope, 10000.0 if base is None else base)
    scores = scores * (D ** -0.5 if scale is None else scale)
    positions = torch.arange(T, device=q.device)
    offsets = positions[:, None] - positions[None, :]
    hidden = offsets < 0 if window is None else (offsets < 0) | (offsets >= window)
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)


# -- per-head summaries ---------------------------------------------------------------------


def _buckets(T: int) -> list[tuple[int, int]]:
    """Query positions ``[2^i, 2^{i+1})`` (clipped to T), from 1 (position 0 sees one key)."""
    out, start = [], 1
    while start < T:
        out.append((start, min(T, 2 * start)))
        start *= 2
    return out


def head_summaries(weights: torch.Tensor, kind: str, block_size: int | None = None) -> list[dict]:
    """The measures of every head of ``weights [H, T, T]`` (rows: queries; see the docstring)."""
    H, T, _ = weights.shape
    visible = (weights > 0).sum(-1).clamp_min(1)  # [H, T]
    if kind in ("softmax", "vq", "gau-softmax"):  # every earlier key is visible, even at weight 0
        visible = torch.arange(1, T + 1).expand(H, T)
    measures = row_measures(weights[:, 1:], visible[:, 1:])
    heads = []
    for h in range(H):
        head = {"head": h, **{name: float(values[h].mean()) for name, values in measures.items()},
                "entropy_by_position": {f"{a}-{b - 1}": float(measures["entropy"][h, a - 1 : b - 1].mean())
                                        for a, b in _buckets(T)}}
        if kind == "vq" and block_size and T > 2 * block_size:
            rows = torch.arange(2 * block_size, T)
            window_start = (rows // block_size - 1) * block_size  # the previous block's first position
            columns = torch.arange(T)[None, :]
            in_window = (columns >= window_start[:, None]).double()
            mass = (weights[h, rows] * in_window).sum(-1).mean()
            head.update(window_mass=float(mass), cache_mass=float(1 - mass))
        heads.append(head)
    return heads


def inspect_model(model, ids: torch.Tensor) -> list[dict]:
    """Run ``model`` on ``ids [1, T]`` and summarise every layer's heads (one entry per unit).
    The model runs in eval mode; its training mode is restored afterwards."""
    recorder, training = _Recorder(model), model.training
    try:
        with torch.no_grad(), recorder.patched():
            model.eval()(ids)
    finally:
        recorder.close()
        model.train(training)
    entries = []
    for name, kind in recorder.kinds.items():
        entry = {"module": name, "kind": kind}
        if name in recorder.weights:
            weights = torch.cat(recorder.weights[name])
            entry["heads"] = head_summaries(weights, kind, recorder.block_size.get(name))
        if name in recorder.states:
            entry["effective_rank"] = [float(r) for r in effective_rank(recorder.states[name])]
        if name in recorder.codes:
            entry["codes"] = recorder.codes[name]
            if entry["kind"] == "vq" and isinstance(getattr(_module(model, name), "quantizer", None), FSQuantizer):
                entry["kind"] = "vq-fsq"
        entries.append(entry)
    return entries


def _module(model, name: str):
    return dict(model.named_modules())[name]


# -- the command ----------------------------------------------------------------------------


def markdown(entries: list[dict], header: str) -> str:
    lines = [header, "", "| module | kind | head | entropy | Hoyer sparsity | entropy sparsity | window / cache mass "
             "| codes: perplexity, unused, rel. error | state effective rank |", "| --- " * 9 + "|"]
    for entry in entries:
        codes = entry.get("codes")
        code_text = (f"{codes['perplexity']:.1f} of {codes['codebook_size']}, {codes['unused_codes']}, "
                     f"{codes['relative_quantization_error']:.3f}") if codes else ""
        for head in entry.get("heads", []):
            mass = (f"{head['window_mass']:.3f} / {head['cache_mass']:.3f}" if "window_mass" in head else "")
            lines.append(f"| {entry['module']} | {entry['kind']} | {head['head']} | {head['entropy']:.3f} | "
                         f"{head['hoyer_sparsity']:.3f} | {head['entropy_sparsity']:.3f} | {mass} | {code_text} | |")
        for h, rank in enumerate(entry.get("effective_rank", [])):
            lines.append(f"| {entry['module']} | {entry['kind']} | {h} | | | | | | {rank:.2f} |")
    return "\n".join(lines) + "\n"


def _plots(entries: list[dict], out: Path) -> list[Path]:
    plt = reporting.pyplot()
    paths = []
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for entry in entries:
        for head in entry.get("heads", []):
            buckets = list(head["entropy_by_position"])
            starts = [int(b.split("-")[0]) for b in buckets]
            axis.plot(starts, [head["entropy_by_position"][b] for b in buckets], marker=".", alpha=0.7,
                      label=f"{entry['module']} h{head['head']}")
    axis.set(xscale="log", xlabel="query position (bucket start)", ylabel="attention entropy (nats)",
             title="attention entropy vs position")
    axis.grid(True, which="both", alpha=0.3)
    if len(axis.lines) <= 12:
        axis.legend(fontsize=7)
    paths.append(reporting.save_figure(figure, out / "entropy.png"))
    vq = [(f"{e['module']} h{h['head']}", h) for e in entries for h in e.get("heads", []) if "window_mass" in h]
    if vq:
        figure, axis = plt.subplots(figsize=(max(5, len(vq) * 0.6), 4))
        labels = [label for label, _ in vq]
        window = [h["window_mass"] for _, h in vq]
        axis.bar(labels, window, label="window (own + previous block)")
        axis.bar(labels, [1 - w for w in window], bottom=window, label="cache (older blocks)")
        axis.set(ylabel="attention mass", title="VQ: where the attention mass goes")
        axis.tick_params(axis="x", rotation=60)
        axis.legend()
        paths.append(reporting.save_figure(figure, out / "mass.png"))
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, help="run folder or checkpoint")
    parser.add_argument("--split", choices=SPLITS, default="validation")
    parser.add_argument("--tokens", type=positive_int, default=1024,
                        help="tokens read in one pass (probabilities are materialised: T x T per head)")
    parser.add_argument("--data", help="the data to read (default: the run's)")
    parser.add_argument("--out", type=Path, required=True)
    add_runtime_flags(parser, progress=False)


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``linattn inspect``."""
    parser = commands.add_parser("inspect", help="attention entropy, sparsity, VQ window/cache mass, code use",
                                 description=__doc__.split("\n\n", 1)[0])
    add_arguments(parser)
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    apply_threads(args)
    model, checkpoint = load_model(args.ckpt, args.device)
    train_config = checkpoint.meta["train_config"]
    data = open_data(args.data or train_config["data"], cache_dir=train_config.get("cache_dir"))
    split = data.tokens(args.split)
    tokens = split[: args.tokens].long()
    if tokens.numel() < 2:
        raise ValueError(f"inspecting needs 2 tokens; --tokens {args.tokens} of the {args.split} split "
                         f"({split.numel()} tokens) gives {tokens.numel()}")
    entries = inspect_model(model, tokens.unsqueeze(0).to(args.device))
    args.out.mkdir(parents=True, exist_ok=True)
    header = (f"# linattn inspect\n\n`{args.command_line}`\n\n{checkpoint.path} (step {checkpoint.step}), "
              f"{tokens.numel()} tokens of the {args.split} split in one pass")
    text = markdown(entries, header)
    metadata = reporting.collect_metadata(device=args.device, command=args.command_line,
                                          shapes={"tokens": tokens.numel(), "split": args.split})
    reporting.write_json(args.out / "inspect.json", rows=entries, metadata=metadata, summary={})
    reporting.write_markdown(args.out / "inspect.md", text)
    paths = _plots(entries, args.out)
    print(text)
    print("wrote " + ", ".join(str(p) for p in [args.out / "inspect.json", args.out / "inspect.md", *paths]))
    return 0
