"""``linattn bench decode``: generation speed against the context length, per op and per model.

Ops: for each mechanism and context length C, the state after C random tokens is built in
one call (not timed), then ``--tokens`` single-token steps are timed one by one, each
feeding the state of the previous, every (mechanism, context) in turns with the others (a
slow spell falls on all alike; a turn is 8 steps, of which the last 4 are timed, after the
case is back to steady decoding); the median step time is reported. Mechanisms with a
constant-size state (Transformer-VQ, kernel attention with or without decay, the delta rule
and the gated delta rule) should be flat in C; exact attention with a KV cache
(``sdpa-kvcache``: the preallocated cache of the softmax layers, one row written in place per
step, then SDPA of one query against all cached keys) grows linearly. B=1, H=8, D=64,
float32 by default.

Models: demo-sized language models (d_model 128, 2 layers, equal parameter counts: the VQ
layers' value width is matched to an attention + SwiGLU block, the other kinds' SwiGLU width
to the softmax model's count) of each mechanism read a
random prompt of P tokens (prefill, timed) and then generate ``--new-tokens`` tokens with
``LM.generate`` (greedy, each step timed), each model in a freshly spawned process: prefill
tokens/s and generation tokens/s from the median step time (robust to a busy machine's
bursts; the mean is in the JSON) for every prompt length and batch size. ``--rounds N``
measures every model N times, the models in alternating order, and pools the steps.
``--generate hf`` reads the prompt with ``LinattnForCausalLM`` and generates with Hugging
Face's ``generate`` from that cache instead (one ``forward`` per token; each step timed between
the tokens its streamer receives).

``--device cuda`` (or ``cuda:N``) runs both tables on that GPU: inputs, states and models
live there, and the clock is read only after the device has finished each timed step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import reporting
from ..models import LM, LMConfig, sizes
from ..models.config import matched_gau_value_width
from ..ops.delta import delta_rule
from ..ops.kernel import linear_attention
from ..ops.softmax import kv_cache
from ..ops.vq import vq_attention, vq_decode_step
from ..nn.quantizer import VectorQuantizer
from .._checks import available_device_name, positive_int
from .decode_parts import products_s, torch_vq_steps
from .harness import in_fresh_process, median, synchronize

DEFAULT_CONTEXTS = (1024, 4096, 16384, 65536)

# A decoding case: prefill(q, k, v) -> state; step(q1, k1, v1, state) -> state; built by a
# factory (heads, dim, device) -> DecodeCase.
DecodeCase = tuple[Callable, Callable]


def _recurrent(run: Callable) -> DecodeCase:
    """An op with a carried state: prefill is the same call from no state."""
    return (lambda q, k, v: run(q, k, v, None)), run


def _vq(heads: int, dim: int, device: torch.device, block_size: int = 128, fused: bool = True,
        impl: str = "auto") -> DecodeCase:
    """Prefill: ``VectorQuantizer`` then ``vq_attention`` over the context (as the GAU layer
    reads a prompt); a step: ``vq_decode_step`` (quantize the new key and attend in one; ``impl``
    as its argument: on a CPU ``auto`` is the native step), or with ``fused=False`` the same two
    calls for the one new position."""
    quantizer = VectorQuantizer(heads, dim, 512).to(device).eval()

    def prefill(q, k, v, state=None):  # the quantizer's keys need no checks
        k_hat, codes, _ = quantizer(k)
        return vq_attention(q, k_hat, v, codes, quantizer.codebook, block_size=block_size, initial_state=state,
                            output_final_state=True, check_inputs=False)[1]

    def step(q, k, v, state):
        return vq_decode_step(q, k, v, quantizer.codebook, state, block_size=block_size, check_inputs=False,
                              impl=impl)[2]

    return prefill, (step if fused else prefill)


def _linear(heads: int, dim: int, device: torch.device) -> DecodeCase:
    def run(q, k, v, state):
        return linear_attention(q, k, v, feature_map="elu", initial_state=state, output_final_state=True)[1]

    return _recurrent(run)


def _delta(heads: int, dim: int, device: torch.device) -> DecodeCase:
    def run(q, k, v, state):  # beta = 0.5 lies in [0, 1]: no check that reads it back
        beta = torch.full(k.shape[:3], 0.5, dtype=k.dtype, device=k.device)
        return delta_rule(q, k, v, beta, initial_state=state, output_final_state=True, check_inputs=False)[1]

    return _recurrent(run)


def _decayed(heads: int, dim: int, device: torch.device, per_channel: bool = False,
             delta: bool = False) -> DecodeCase:
    """Kernel attention with a data-dependent decay (identity features, no normaliser: RetNet,
    Mamba-2, GLA per channel) or the gated delta rule, the decay from the keys as in
    ``bench attention``'s decay cases."""
    def run(q, k, v, state):
        g = F.logsigmoid(k) / 16 if per_channel else F.logsigmoid(k[..., 0])
        if delta:
            beta = torch.full(k.shape[:3], 0.5, dtype=k.dtype, device=k.device)
            return delta_rule(q, k, v, beta, g=g, initial_state=state, output_final_state=True,
                              check_inputs=False)[1]
        return linear_attention(q, k, v, feature_map="identity", normalize=None, scale=dim ** -0.5, g=g,
                                initial_state=state, output_final_state=True, check_inputs=False)[1]

    return _recurrent(run)


def _kv_cache(heads: int, dim: int, device: torch.device, room: int = 4096) -> DecodeCase:
    """Exact attention over a preallocated KV cache (``ops/softmax/kv_cache.py``): the state is every
    key and value so far, in buffers with ``room`` free rows after the prefill, so a step
    writes its row in place and attends with SDPA's fused kernel (as a static cache does)."""

    def prefill(q, k, v):
        return kv_cache.reserve(kv_cache.extend(None, k, v), room)

    def step(q, k, v, cache):
        cache = kv_cache.extend(cache, k, v)
        F.scaled_dot_product_attention(q, cache.keys, cache.values)
        return cache

    return prefill, step


DECODE_CASES: dict[str, Callable[[int, int, torch.device], DecodeCase]] = {
    "vq-b128": _vq,
    "vq-b128-torch": lambda heads, dim, device: _vq(heads, dim, device, impl="torch"),
    "vq-b128-two-calls": lambda heads, dim, device: _vq(heads, dim, device, fused=False),
    "linear-elu": _linear,
    "delta": _delta,
    "decay-scalar": _decayed,
    "decay-channel": lambda heads, dim, device: _decayed(heads, dim, device, per_channel=True),
    "gated-delta": lambda heads, dim, device: _decayed(heads, dim, device, delta=True),
    "sdpa-kvcache": _kv_cache,
}


def measure(names: str | Sequence[str], contexts, *, heads: int, dim: int, tokens: int, seed: int = 0,
            device: torch.device | str = "cpu") -> list[dict]:
    """Median seconds per decoded token of the case ``names`` (one name, or several) at each
    context length, on ``device``. Every (case, context) takes its steps in turns with all the
    others, so a slow spell of a shared machine falls on all of them alike and their ratios
    stay fair. A turn is ``2 * _TURN`` steps, of which the last ``_TURN`` are timed: the first
    ones bring the case back to steady decoding after the others' turns (a step right after a
    switch of case is up to 2x slower, and it takes about four to recover on a CPU)."""
    device = torch.device(device)
    names = [names] if isinstance(names, str) else list(names)
    runs, states, inputs = {}, {}, {}
    with torch.no_grad():
        for name in names:
            prefill, runs[name] = DECODE_CASES[name](heads, dim, device)
            for context in contexts:  # drawn on the CPU: the same numbers on every device and case
                generator = torch.Generator().manual_seed(seed + context)
                states[name, context] = prefill(*(torch.randn(1, heads, context, dim, generator=generator).to(device)
                                                  for _ in range(3)))
                # each step's inputs are their own small tensors, as in generation (a slice of one long
                # tensor would put the heads' rows megabytes apart and slow every step as C grows)
                inputs[name, context] = [[torch.randn(1, heads, 1, dim, generator=generator).to(device)
                                          for _ in range(3)] for _ in range(2 * _TURN)]
        times = {key: [] for key in states}
        while len(times[next(iter(times))]) < tokens:
            for key in states:
                for index in range(2 * _TURN):
                    synchronize(device)
                    start = time.perf_counter()
                    states[key] = runs[key[0]](*inputs[key][index], states[key])
                    synchronize(device)
                    if index >= _TURN:
                        times[key].append(time.perf_counter() - start)
    return [{"kind": "op", "case": name, "context": context, "per_token_s": median(times[name, context][:tokens]),
             "times_s": times[name, context][:tokens]} for name, context in times]


_TURN = 4  # timed steps per turn of a (case, context), after as many untimed ones


# Whole models: CLI name -> layer spec; demo-sized (configs/demo.toml), equal parameter counts.
MODEL_SPECS = {"vq": "vq", "softmax": "softmax", "delta": "delta", "linear-elu": "linear:elu", "local": "local",
               "retnet": "retnet", "gla": "gla", "gated-delta": "gated-delta", "hedgehog": "linear:hedgehog",
               "dpfp": "linear:dpfp", "taylor": "linear:taylor", "favor": "favor",
               "local-vq": "local,vq", "vq-attn": "vq-attn:rerope", "vq-rerope": "vq:rerope", "vq-fsq": "vq-fsq",
               "soft-vq": "soft-vq"}
DEFAULT_MODELS = ("vq", "softmax", "delta", "linear-elu", "local", "retnet", "gla", "gated-delta")
_GAU_PAIRS = ("vq-rerope", "vq-fsq", "soft-vq")  # models of GAU pairs other than vq: matched by their value width
DEFAULT_PROMPTS = (1024, 16384, 65536)


def model_config(name: str) -> LMConfig:
    """The demo-sized model of ``name`` (a ``MODEL_SPECS`` key): d_model 128, 2 layers, 4
    heads (the default) where a layer has heads; VQ layers with the GAU value width matched
    to an attention + SwiGLU block, every other kind with the SwiGLU width (a multiple of 8)
    that gives it the softmax model's parameter count (the other models of GAU pairs, whose
    ReRoPE, FSQ projections or soft codebook change the count, by their GAU value width)."""
    d_model, gau_d_k = 128, 64
    base = LMConfig(d_model=d_model, n_layers=2, attention=MODEL_SPECS[name], gau_d_k=gau_d_k,
                    gau_d_v=matched_gau_value_width(d_model, gau_d_k), codebook_size=128, block_size=64)
    if name == "vq":
        return base
    target = sizes.count_parameters(dataclasses.replace(base, attention="softmax"))
    if name in _GAU_PAIRS:
        return dataclasses.replace(base, gau_d_v=sizes.matched_width(
            lambda w: dataclasses.replace(base, gau_d_v=w), target, 2))
    width = sizes.matched_width(lambda w: dataclasses.replace(base, ffn_hidden=w), target, 8)
    return dataclasses.replace(base, ffn_hidden=width)


GENERATES = ("lm", "hf")  # LM.generate, or Hugging Face's generate through LinattnForCausalLM


class _StepClock:
    """A Hugging Face streamer that times the steps: ``put`` receives the prompt, then each token."""

    def __init__(self, device: torch.device):
        self.device, self.steps, self.last = device, [], None

    def put(self, value) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        if self.last is not None:
            self.steps.append(now - self.last)
        self.last = now

    def end(self) -> None:
        pass


def _generate_steps(model: LM, ids: torch.Tensor, new_tokens: int, device: torch.device, generate: str
                    ) -> tuple[float, list[float], object]:
    """``(prefill seconds, seconds of each generated token, the prompt's state)``: the prompt
    ``ids[:, :-1]`` read in one call, then ``new_tokens`` greedy tokens after ``ids[:, -1]``
    (``generate``: ``"lm"`` or ``"hf"``)."""
    hf = None
    if generate == "hf":
        from ..hf import LinattnForCausalLM

        hf = LinattnForCausalLM.from_lm(model).eval()
    with torch.no_grad():
        synchronize(device)
        start = time.perf_counter()
        if hf is None:
            _, state, _ = model(ids[:, :-1], check_inputs=False)
        else:
            cache = hf(ids[:, :-1]).cache
        synchronize(device)
        prefill_s = time.perf_counter() - start
    if hf is not None:
        clock = _StepClock(device)
        hf.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, streamer=clock, pad_token_id=0)
        return prefill_s, clock.steps, cache.groups[0].state
    steps, start = [], time.perf_counter()
    for _ in model.generate(ids[:, -1:], new_tokens, temperature=0, state=state):
        synchronize(device)
        now = time.perf_counter()
        steps.append(now - start)
        start = now
    return prefill_s, steps, state


def measure_generation(name: str, prompts, batches, *, new_tokens: int, seed: int = 0,
                       device: torch.device | str = "cpu", generate: str = "lm") -> list[dict]:
    """Prefill and generation throughput of the ``name`` model on ``device`` for every prompt
    length and batch, through ``LM.generate`` or (``generate="hf"``) Hugging Face's. The
    prompt's tokens are drawn in range, so the timed prefill does not read them back to check
    them (``check_inputs=False``)."""
    device = torch.device(device)
    torch.manual_seed(seed)
    model = LM(model_config(name)).to(device).eval()
    rows = []
    for batch in batches:
        for prompt in prompts:
            generator = torch.Generator().manual_seed(seed + prompt + batch)
            ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=generator).to(device)
            prefill_s, steps, state = _generate_steps(model, ids, new_tokens, device, generate)
            generate_s = sum(steps)
            median_s = statistics.median(steps)
            with torch_vq_steps():  # the native VQ step is invisible to the recorder (decode_parts.py)
                floor_s = products_s(lambda: model._run(ids[:, -1:], state, with_aux=False))
            rows.append({"kind": "model", "case": name, "prompt": prompt, "batch": batch,
                         "parameters": model.num_parameters(), "prefill_s": prefill_s,
                         "prefill_tokens_per_s": batch * (prompt - 1) / prefill_s, "new_tokens": new_tokens,
                         "generate_s": generate_s, "mean_tokens_per_s": batch * new_tokens / generate_s,
                         "tokens_per_s": batch / median_s, "ms_per_step": median_s * 1e3, "steps_s": steps,
                         "products_ms": floor_s * 1e3, "over_products": median_s / floor_s})
    return rows


def pool_rounds(rows: Sequence[dict]) -> list[dict]:
    """One model row per (model, prompt, batch) from the rows of several rounds (``--rounds``):
    the generation steps of every round pooled and the median taken over them, the prefill
    the median of the rounds' prefills. One round's rows come back as they are."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["case"], row["prompt"], row["batch"]), []).append(row)
    pooled = []
    for group in groups.values():
        row = dict(group[0])
        if len(group) > 1:
            steps = [t for each in group for t in each["steps_s"]]
            batch, prompt = row["batch"], row["prompt"]
            row["prefill_s"] = median([each["prefill_s"] for each in group])
            row["prefill_tokens_per_s"] = batch * (prompt - 1) / row["prefill_s"]
            row["steps_s"], row["generate_s"] = steps, sum(steps)
            row["mean_tokens_per_s"] = batch * len(steps) / sum(steps)
            row["tokens_per_s"], row["ms_per_step"] = batch / median(steps), median(steps) * 1e3
            row["products_ms"] = median([each["products_ms"] for each in group])
            row["over_products"] = row["ms_per_step"] / row["products_ms"]
            row["rounds"] = len(group)
        pooled.append(row)
    return pooled


HELP = "decoding: time per generated token vs context length (ops) and generation throughput (whole models)"
DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``linattn bench decode``."""
    ops = parser.add_argument_group("ops (one attention op, one token per step)")
    ops.add_argument("--contexts", nargs="+", type=positive_int, default=list(DEFAULT_CONTEXTS), metavar="C")
    ops.add_argument("--cases", nargs="*", choices=list(DECODE_CASES), default=list(DECODE_CASES), metavar="CASE",
                     help="op cases (none: skip the op table)")
    ops.add_argument("--tokens", type=positive_int, default=32, help="timed decoding steps per context (median kept)")
    ops.add_argument("--heads", type=positive_int, default=8)
    ops.add_argument("--dim", type=positive_int, default=64)
    models = parser.add_argument_group("models (LM.generate of demo-sized models, equal parameter counts)")
    models.add_argument("--models", nargs="*", choices=list(MODEL_SPECS), default=list(DEFAULT_MODELS), metavar="MODEL",
                        help=f"models, from {', '.join(MODEL_SPECS)} (default: {' '.join(DEFAULT_MODELS)}, the "
                             "others by name; none: skip the model table)")
    models.add_argument("--prompts", nargs="+", type=positive_int, default=list(DEFAULT_PROMPTS), metavar="P",
                        help="prompt lengths")
    models.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8], metavar="B")
    models.add_argument("--new-tokens", type=positive_int, default=128,
                        help="tokens generated after each prompt (enough to average out timer noise)")
    models.add_argument("--rounds", type=positive_int, default=1,
                        help="measure every model this many times, each in a fresh process, the models in "
                             "alternating order, and pool the generation steps (a slow spell of minutes then falls "
                             "on every model)")
    models.add_argument("--generate", choices=GENERATES, default="lm",
                        help="lm: LM.generate; hf: Hugging Face's generate through LinattnForCausalLM, one forward "
                             "per token (default %(default)s)")
    parser.add_argument("--device", type=available_device_name, default="cpu",
                        help="cpu, cuda or cuda:N: both tables run there (default %(default)s)")
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=Path("results/bench-decode"), help="output directory")


def _op_table(rows: list[dict], cases, contexts) -> tuple[str, dict]:
    lines = ["| case | " + " | ".join(f"C={c}" for c in contexts) + f" | C={contexts[-1]} / C={contexts[0]} |",
             "| --- |" + " --- |" * (len(contexts) + 1)]
    summary = {}
    for name in cases:
        times = {r["context"]: r["per_token_s"] for r in rows if r["case"] == name}
        growth = times[contexts[-1]] / times[contexts[0]]
        summary[name] = {"growth": growth, "first_context": contexts[0], "last_context": contexts[-1]}
        cells = " | ".join(f"{times[c] * 1e3:.3g} ms" for c in contexts)
        lines.append(f"| {name} | {cells} | {growth:.2f}x |")
    return "\n".join(lines), summary


def _model_table(rows: list[dict], models, prompts, batches) -> tuple[str, dict]:
    header = ["model", "parameters", "batch"] + [f"P={p} gen tok/s" for p in prompts] + [
        f"P={p} prefill tok/s" for p in prompts]
    cells, summary = [], {}
    for batch in batches:
        for name in models:
            found = {r["prompt"]: r for r in rows if r["case"] == name and r["batch"] == batch}
            cells.append([name, f"{next(iter(found.values()))['parameters']:,}", str(batch)]
                         + [f"{found[p]['tokens_per_s']:,.0f}" for p in prompts]
                         + [f"{found[p]['prefill_tokens_per_s']:,.0f}" for p in prompts])
        if "vq" in models and "softmax" in models:
            speed = {(r["case"], r["prompt"]): r["tokens_per_s"] for r in rows if r["batch"] == batch}
            summary[f"vq_over_softmax_batch{batch}"] = {
                str(p): speed["vq", p] / speed["softmax", p] for p in prompts}
        summary[f"over_products_batch{batch}"] = {
            name: {str(r["prompt"]): r["over_products"] for r in rows if r["case"] == name and r["batch"] == batch}
            for name in models}
    return "\n".join(reporting.markdown_table_lines(header, cells)), summary


def _products_table(rows: list[dict], models, prompts, batches) -> str:
    """Per model, batch and prompt: ms per generated token, the sum of its products measured
    alone (``decode_parts.py``) and their ratio."""
    header = ["model", "batch"] + [f"P={p} ms/token (products, ratio)" for p in prompts]
    cells = []
    for batch in batches:
        for name in models:
            found = {r["prompt"]: r for r in rows if r["case"] == name and r["batch"] == batch}
            cells.append([name, str(batch)] + [
                f"{found[p]['ms_per_step']:.3f} ({found[p]['products_ms']:.3f}, {found[p]['over_products']:.1f}x)"
                for p in prompts])
    return "\n".join(reporting.markdown_table_lines(header, cells))


def _model_plot(rows: list[dict], models, prompts, batches, path: Path) -> Path:
    plt = reporting.pyplot()
    figure, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for axis, batch in zip(axes[0], batches):
        for name in models:
            speed = {r["prompt"]: r["tokens_per_s"] for r in rows if r["case"] == name and r["batch"] == batch}
            axis.plot(prompts, [speed[p] for p in prompts], marker="o", label=name)
        axis.set(xscale="log", yscale="log", xlabel="prompt length", ylabel="generated tokens/s",
                 title=f"LM.generate, batch {batch}")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    return reporting.save_figure(figure, path)


def page(results: dict) -> str:
    """``results.md`` of ``results.json``'s contents: the command, the op table and the model
    table (cases and models in the order they ran; sizes from the metadata's ``shapes``)."""
    metadata, shapes, rows = results["metadata"], results["metadata"]["shapes"], results["rows"]
    op_rows = [r for r in rows if r["kind"] == "op"]
    model_rows = [r for r in rows if r["kind"] == "model"]
    text = f"# bench decode\n\n`{metadata['command']}`\n\non {metadata['device']} ({metadata['device_name']})\n"
    if op_rows:
        cases = list(dict.fromkeys(r["case"] for r in op_rows))
        table = _op_table(op_rows, cases, shapes["contexts"])[0]
        text += f"\nper-token time of one op (B=1, H={shapes['heads']}, D={shapes['dim']})\n\n{table}\n"
    if model_rows:
        models = list(dict.fromkeys(r["case"] for r in model_rows))
        table = _model_table(model_rows, models, shapes["prompts"], shapes["batches"])[0]
        rounds = shapes.get("rounds", 1)
        pooled = "" if rounds == 1 else f"; {rounds} rounds in alternating order, the steps pooled"
        through = "Hugging Face's generate" if shapes.get("generate") == "hf" else "LM.generate"
        text += (f"\nwhole models: generated tokens/s ({through}, greedy, {model_rows[0]['new_tokens']} tokens after "
                 f"the prompt, from the median step time{pooled}) and prefill tokens/s\n\n{table}\n")
        if all("products_ms" in r for r in model_rows):
            table = _products_table(model_rows, models, shapes["prompts"], shapes["batches"])
            text += ("\nms per generated token against the sum of its matrix products and attention kernels, each "
                     f"measured alone (decode_parts.py), and their ratio\n\n{table}\n")
    return text


def run_command(args: argparse.Namespace) -> int:
    """Measure the op cases and the models, write results.json, results.md and a plot, print the tables."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    contexts, prompts, batches = sorted(set(args.contexts)), sorted(set(args.prompts)), sorted(set(args.batches))
    if any(p < 2 for p in prompts):
        raise ValueError(f"--prompts must be at least 2 tokens (one is read with the state), got {prompts}")
    measured = []
    op_rows = measure(args.cases, contexts, heads=args.heads, dim=args.dim, tokens=args.tokens,
                      device=args.device) if args.cases else []
    for round_index in range(args.rounds):
        for name in (args.models if round_index % 2 == 0 else args.models[::-1]):
            measured += in_fresh_process(measure_generation, name, prompts, batches, new_tokens=args.new_tokens,
                                         device=args.device, threads=args.threads, generate=args.generate)
    # the pooled step times are summarised in each row; the lists would make the JSON 8x longer
    model_rows = [{k: v for k, v in row.items() if k != "steps_s"} for row in pool_rounds(measured)]
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = {"heads": args.heads, "dim": args.dim, "dtype": "float32", "contexts": contexts, "prompts": prompts,
              "batches": batches, "rounds": args.rounds, "generate": args.generate,
              "models": {name: model_config(name).to_dict() for name in args.models}}
    metadata = reporting.collect_metadata(device=args.device, command=args.command_line, shapes=shapes)
    summary, files = {"ops": {}, "models": {}}, [args.out / "results.json", args.out / "results.md"]
    if op_rows:
        summary["ops"] = _op_table(op_rows, args.cases, contexts)[1]
    if model_rows:
        summary["models"] = _model_table(model_rows, args.models, prompts, batches)[1]
        files.append(_model_plot(model_rows, args.models, prompts, batches, args.out / "generation.png"))
    text = page({"metadata": metadata, "rows": op_rows + model_rows, "summary": summary})
    reporting.write_json(args.out / "results.json", rows=op_rows + model_rows, metadata=metadata, summary=summary)
    reporting.write_markdown(args.out / "results.md", text)
    print(text)
    print("wrote " + ", ".join(str(f) for f in files))
    return 0
