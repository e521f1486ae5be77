"""Small helpers shared by the tests: random inputs, tolerant comparisons, feature maps
written out independently of the library, a causality check on Jacobians, a recorder of the
largest tensor an op builds, the tokens a model generates, and the fixture that runs a
module's tests on both chunk forms."""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from linattn import feature_maps as fm
from linattn.models import uses_heads
from linattn.models.config import HEAD_FIELDS

F64 = torch.float64


def both_chunk_forms(variable: str):
    """An autouse fixture that runs every test of the module assigning it twice: ``impl="auto"``
    (the native chunk kernel where it applies, e.g. calls without gradients on a CPU) and the
    torch form (``variable=torch``, e.g. ``LINATTN_LINEAR_IMPL``); the fixture's value is which."""

    @pytest.fixture(autouse=True, params=["auto", "torch"], ids=["chunk-auto", "chunk-torch"])
    def chunk_impl(request, monkeypatch):
        monkeypatch.delenv(variable, raising=False)
        if request.param == "torch":
            monkeypatch.setenv(variable, "torch")
        return request.param

    return chunk_impl
# The project's internal shorthand, which user-facing text must not use: source-document numbers
# ("seed 003") and issue numbers ("issue 21").
SHORTHAND = re.compile(r"\bseeds? 0\d\d\b|\bissues? #?\d+\b", re.IGNORECASE)


def generated(model, prompt: torch.Tensor, tokens: int, **sampling) -> torch.Tensor:
    """``model.generate``'s tokens for a ``[B, T]`` prompt, as ``[B, tokens]``."""
    return torch.stack(list(model.generate(prompt, tokens, **sampling)), 1)


def generated_with_a_write(model, prompt: torch.Tensor, tokens: int, write, after: int = 4) -> torch.Tensor:
    """Greedy ``generated`` tokens, with ``write(model)`` (gradients off) run after token ``after``
    was yielded: what a caller does to the parameters between two tokens."""
    out = []
    for index, token in enumerate(model.generate(prompt, tokens, temperature=0)):
        out.append(token)
        if index == after:
            with torch.no_grad():
                write(model)
    return torch.stack(out, 1)


def head_fields(attention, /, **fields) -> dict:
    """``fields`` (``LMConfig`` fields) without ``n_heads``, ``n_kv_heads`` and ``head_dim``
    when no layer of ``attention`` has heads: a model of GAU pairs refuses them set."""
    return fields if uses_heads(attention) else {k: v for k, v in fields.items() if k not in HEAD_FIELDS}


def make_qkv(B=2, H=4, Hkv=2, T=7, Dk=4, Dv=3, *, S=None, dtype=F64, positive=False, seed=0, requires_grad=False):
    """Random ``q [B, H, T, Dk]``, ``k [B, Hkv, S, Dk]``, ``v [B, Hkv, S, Dv]`` (S = T by default).

    ``positive`` draws q and k from U(0.1, 1) (keeps the identity map's denominators away
    from zero); otherwise q, k, v are standard normal.
    """
    S = T if S is None else S
    g = torch.Generator().manual_seed(seed)
    if positive:
        q = 0.1 + 0.9 * torch.rand(B, H, T, Dk, generator=g, dtype=F64)
        k = 0.1 + 0.9 * torch.rand(B, Hkv, S, Dk, generator=g, dtype=F64)
    else:
        q = torch.randn(B, H, T, Dk, generator=g, dtype=F64)
        k = torch.randn(B, Hkv, S, Dk, generator=g, dtype=F64)
    v = torch.randn(B, Hkv, S, Dv, generator=g, dtype=F64)
    out = [t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v)]
    return tuple(out)


def wide_shift_inputs(key=60.0, query=40.0, at=0):
    """float64 q, k, v for the exp map whose query + key shifts sum to ~100: a late key
    with log-feature 60 sets the key shift, and early queries with log-features up to 40
    see only far weaker keys (true denominators far below eps). In float32 the shifted
    eps term, exp(-100) * eps, is below the float range.

    ``key`` and ``query`` set the two log-features (their sum is the largest shift);
    ``at`` moves the wide queries to positions ``at`` and ``at + 1``, every key before
    them made weak too, so the queries before ``at`` keep ordinary shifts."""
    g = torch.Generator().manual_seed(5)
    T = 13
    q = torch.randn(1, 2, T, 2, generator=g, dtype=F64)
    k = torch.randn(1, 1, T, 2, generator=g, dtype=F64)
    v = torch.randn(1, 1, T, 3, generator=g, dtype=F64)
    k[0, 0, T - 2] = torch.tensor([key, 0.0])
    k[0, 0, :at, 0] = -200.0
    q[0, :, at] = torch.tensor([query, -200.0])
    k[0, 0, at] = torch.tensor([-200.0, 0.0])
    q[0, :, at + 1] = torch.tensor([query - 5.0, 0.0])
    k[0, 0, at + 1] = torch.tensor([-110.0, -75.0])
    return q, k, v


def assert_close_rel(actual, expected, rtol=1e-9, name="tensor"):
    """``max |actual - expected| <= rtol * max |expected|`` (and the same shape).

    Scale-aware, so outputs whose magnitude depends on the feature map compare fairly.
    """
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    scale = expected.abs().max().item()
    err = (actual.to(F64) - expected.to(F64)).abs().max().item()
    assert err <= rtol * max(scale, 1e-30), f"{name}: max abs error {err:.3e} vs scale {scale:.3e} (rtol {rtol})"


# ----------------------------------------------------------------------------- feature maps
# The formulas of docs/design.md section 4, written without the library's code paths. FAVOR's
# projection is random, so it is read from the map; everything after it is recomputed.


def _dpfp(x, nu):
    r = torch.cat([x.clamp_min(0), (-x).clamp_min(0)], dim=-1)
    n = r.shape[-1]
    parts = []
    for j in range(1, nu + 1):
        index = (torch.arange(n) - j) % n  # r rolled right by j: entry i holds r[i - j]
        parts.append(r * r[..., index])
    return torch.cat(parts, dim=-1)


def _taylor(x):
    d = x.shape[-1]
    second = [x[..., a : a + 1] * x[..., b : b + 1] for a in range(d) for b in range(d)]
    return torch.cat([torch.ones_like(x[..., :1]), x / d**0.25] + [s / math.sqrt(2 * d) for s in second], dim=-1)


def _favor(x, fmap):
    d = x.shape[-1]
    W = fmap.projection(d, dtype=x.dtype)
    xs = x / d**0.25
    return torch.exp(xs @ W.T - 0.5 * (xs * xs).sum(-1, keepdim=True)) / math.sqrt(fmap.num_features)


def independent_features(fmap, x):
    """phi(x) for a library feature map, from the formula (unstabilised for exp maps)."""
    fmap = fm.get_feature_map(fmap)
    if isinstance(fmap, fm.EluPlusOne):
        return torch.where(x > 0, x + 1, torch.exp(x))
    if isinstance(fmap, fm.ReLU):
        return torch.where(x > 0, x, torch.zeros_like(x))
    if isinstance(fmap, fm.Identity):
        return x.clone()
    if isinstance(fmap, fm.Exp):
        return torch.exp(x)
    if isinstance(fmap, fm.FAVOR):
        return _favor(x, fmap)
    if isinstance(fmap, fm.DPFP):
        return _dpfp(x, fmap.nu)
    if isinstance(fmap, fm.Taylor):
        return _taylor(x)
    raise AssertionError(f"no independent formula for {fmap!r}")


# ----------------------------------------------------------------------------- causality


def assert_decodes_as_full_pass(model, ids: torch.Tensor, prefill: int) -> None:
    """``model`` (an ``LM`` in eval mode) reads ``ids[:, :prefill]`` in one call, then one token
    per call, with gradients on (new tensors per step) and off (the decoding fast paths): the
    logits equal one pass over all of ``ids`` (float64 tolerances)."""
    full, _, _ = model(ids)
    for gradients in (True, False):
        with torch.set_grad_enabled(gradients):
            logits, state, _ = model(ids[:, :prefill])
            pieces = [logits]
            for t in range(prefill, ids.shape[1]):
                logits, state, _ = model(ids[:, t : t + 1], state)
                pieces.append(logits)
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-12,
                                   msg=lambda m, g=gradients: f"gradients {'on' if g else 'off'}: {m}")


def assert_causal_jacobian(fn, inputs, names):
    """``fn(*inputs)`` returns ``[B, H, T, Dv]``; each input is ``[B, *, T, D]``.

    Asserts that d out[..., i, :] / d input[..., j, :] is exactly zero for every j > i,
    and that the Jacobian is not zero everywhere (so the check can fail).
    """
    jac = torch.autograd.functional.jacobian(fn, tuple(inputs))
    T = inputs[0].shape[2]
    for name, J in zip(names, jac):
        # J: [B, H, T, Dv, B, Hin, T, Din] -> [T_out, T_in, rest]
        Jt = J.movedim(2, 0).movedim(6, 1)
        assert Jt.abs().sum() > 0, f"Jacobian w.r.t. {name} is identically zero"
        for i in range(T):
            future = Jt[i, i + 1 :]
            assert (future == 0).all(), f"output row {i} depends on {name} rows > {i}"


class OpRecorder(TorchDispatchMode):
    """Records the largest numel among op outputs and how often each op ran."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls[func.overloadpacket.__name__] += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


# ------------------------------------------------------------------ a tiny text corpus

WORDS = ("the a of and to in is was he she it that with for as his her on at by this had not are but from king "
         "queen lord lady love night day sword crown heart shall will thou thee my your our good sweet death life "
         "blood fair speak come go hath doth").split()


def write_latin1(path) -> bytes:
    """Write French sentences in Latin-1 (about a fifth of the bytes are not valid UTF-8, none
    is a control byte) to ``path``; return the bytes."""
    data = "Café crème brûlée, naïve façade; déjà vu à Noël.\n".encode("latin-1") * 200
    path.write_bytes(data)
    return data


def english_like(n_bytes: int, seed: int = 0) -> str:
    """Deterministic sentences of common words (learnable structure, a few KB)."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(".!?;.") + ("\n" if rng.random() < 0.3 else " ")
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:n_bytes]


# ------------------------------------------------------------------ host round-trips

# Ops after which the host waits for a device's values: ``_local_scalar_dense`` is ``.item()``,
# ``bool()``, ``int()``, ``float()`` of a tensor (a Python ``if`` on one, a format string);
# the others have an output size that depends on the values.
_SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                "unique_consecutive", "bincount"}
_SYNCING_METHODS = {"tolist", "numpy", "cpu"}
# frames between a call in Python code and the mode that sees it
_MACHINERY = ("/torch/utils/_python_dispatch.py", "/torch/overrides.py", "/torch/_tensor.py", "/torch/_compile.py",
              "/torch/_dynamo/eval_frame.py", "/tests/_helpers.py")


def _linattn_caller() -> str | None:
    """``file:line (function)`` of the Python code that made the call, if it is linattn's
    (a call torch makes for its own reasons, e.g. in an optimizer, is torch's business)."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if path.endswith(_MACHINERY):
            continue
        if "/linattn/" in path and "/tests/" not in path:
            return f"{path.rsplit('/linattn/', 1)[-1]}:{frame.lineno} ({frame.name})"
        return None
    return None


def _boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()))


class _SyncingOps(TorchDispatchMode):
    def __init__(self, found: list):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if (name in _SYNCING_OPS or (name in ("index", "index_put", "index_put_") and _boolean_index(args))
                or (name == "repeat_interleave" and func.name().endswith("Tensor"))):
            where = _linattn_caller()
            if where is not None:
                self.found.append((f"aten.{name}", where))
        return func(*args, **(kwargs or {}))


class _SyncingMethods(torch.overrides.TorchFunctionMode):
    def __init__(self, found: list):
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _SYNCING_METHODS:
            where = _linattn_caller()
            if where is not None:
                self.found.append((f"Tensor.{func.__name__}", where))
        return func(*args, **(kwargs or {}))


class HostRoundTrips:
    """``with HostRoundTrips() as trips:`` records, as ``(what, where)`` pairs in ``trips``,
    every call linattn's code makes inside that would make the host wait for a device's
    values on CUDA: a tensor read as a Python number or bool (``aten._local_scalar_dense``:
    ``.item()``, ``bool()``, ``int()``, ``float()``, an ``if`` on a tensor), ``.tolist()``,
    ``.numpy()``, ``.cpu()``, and ops whose output size depends on values (``nonzero``,
    ``masked_select``, ``unique``, boolean-mask indexing and assignment, ``repeat_interleave``
    with tensor repeats, ``bincount``). It works on CPU tensors, where nothing waits, so a CPU
    run finds the round trips a GPU run would pay for. ``where`` is the linattn source line
    that made the call; calls made inside torch (an optimizer reading its CPU step counter)
    are not linattn's and are left out, and so is ``.to(device)`` (on a CPU run it cannot be
    told from a copy to the host; ``make test-gpu`` adds ``torch.cuda.set_sync_debug_mode``,
    which sees every real synchronisation)."""

    def __enter__(self) -> list:
        self.found: list = []
        self._modes = (_SyncingMethods(self.found), _SyncingOps(self.found))
        for mode in self._modes:
            mode.__enter__()
        return self.found

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def record_state_resets(monkeypatch) -> list[bool]:
    """Patch ``LM.forward`` to append, for each training-mode call, whether it got no state
    (``state is None``: a reset); returns the list it appends to."""
    from linattn.models import LM

    seen: list[bool] = []
    original_forward = LM.forward

    def recording_forward(self, ids, state=None, **options):
        if self.training:
            seen.append(state is None)
        return original_forward(self, ids, state, **options)

    monkeypatch.setattr(LM, "forward", recording_forward)
    return seen


def lm_eval_task(tmp_path, monkeypatch, name: str, docs: list[dict], *, target_delimiter: str | None = None):
    """A local lm-evaluation-harness task ``name``: ``loglikelihood`` perplexity over ``docs``
    (``{"context", "continuation"}`` dicts) written as JSONL under ``tmp_path``, with the
    Hugging Face hub and datasets offline; returns the folder to pass as ``--include_path``."""
    import json

    for variable, value in [("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                            ("HF_DATASETS_CACHE", str(tmp_path / "datasets"))]:
        monkeypatch.setenv(variable, value)
    data = tmp_path / "lines.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs), encoding="utf-8")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    delimiter = "" if target_delimiter is None else f"target_delimiter: '{target_delimiter}'\n"
    (tasks / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\n" + delimiter +
        "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n",
        encoding="utf-8")
    return tasks


def lm_eval_perplexity(lm, docs: list[dict]) -> float:
    """The perplexity lm-evaluation-harness reports for ``lm_eval_task``'s ``docs``, computed from
    ``lm``'s own logits: exp of minus the mean over docs of each continuation's log-probability
    after its context (an empty context: after the newline, the start token)."""
    import math

    total = 0.0
    for doc in docs:
        context = list(doc["context"].encode()) or [10]
        target = list(doc["continuation"].encode())
        with torch.no_grad():
            logp = torch.log_softmax(lm(torch.tensor([context + target]))[0][0].double(), -1)
        total += sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(target))
    return math.exp(-total / len(docs))


def codebook_trainer(model, tmp_path, steps: int, rows: torch.Tensor):
    """An HF ``Trainer`` on the CPU over ``rows`` (each its own labels), batches of 4, ``steps``
    steps at lr 1e-2, with ``CodebookUpdateCallback``."""
    from transformers import Trainer, TrainingArguments

    import linattn.hf as H

    dataset = [{"input_ids": row, "labels": row} for row in rows]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=steps,
                             learning_rate=1e-2, report_to=[], use_cpu=True, logging_steps=1, save_strategy="no")
    return Trainer(model=model, args=args, train_dataset=dataset, callbacks=[H.CodebookUpdateCallback()])


def torchrun_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child ``torchrun`` (or hand-launched ranks): without
    the process-group variables a test runner may have set, one thread, the loopback address,
    and ``extra``."""
    import os

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", **extra)
    return env


def mirrored_exchange(context, name, problem, record, timeout=None) -> None:
    """``startup.exchange`` for rank 0 of processes simulated in one (the others mirror this
    one: they post the same problem and record): this process's problem is raised, else
    every process agrees."""
    if problem is not None:
        raise problem


def ranks_in_threads(world_size: int, store_file, function, timeout: float = 5.0) -> list:
    """``function(context)`` for each rank of ``world_size`` processes simulated by threads of
    this process, which meet through a ``FileStore`` at ``store_file`` (as ranks meet through
    the rendezvous store) -> each rank's result, or the exception it raised."""
    import threading

    import torch.distributed as dist

    from linattn.train.distributed import Context

    outcomes: list = [None] * world_size

    def run(rank: int) -> None:
        context = Context(rank=rank, world_size=world_size, store=dist.FileStore(str(store_file), world_size),
                          timeout=timeout)
        try:
            outcomes[rank] = function(context)
        except Exception as error:  # the outcome a test looks at
            outcomes[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on (for a rendezvous)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def communicate_all(processes: list, timeout: float) -> list:
    """Each of ``processes``' ``subprocess.CompletedProcess`` (its stdout, stderr and exit code),
    in order, each waited for at most ``timeout`` seconds; any still running at the end (a
    timeout) is killed."""
    import subprocess

    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def run_ranks(args, cwd, world: int = 2, timeout: float = 150) -> list:
    """``linattn ARGS`` in ``world`` processes with the environment ``torchrun`` gives them
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``) -> each rank's
    ``subprocess.CompletedProcess``: its own stdout, stderr and exit code. ``args`` and ``cwd``
    may be functions of the rank (a launcher that gives one process other settings; a node that
    sees other files)."""
    import subprocess
    import sys

    base = torchrun_env(MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    processes = [subprocess.Popen([sys.executable, "-m", "linattn.cli", *(args(rank) if callable(args) else args)],
                                  cwd=cwd(rank) if callable(cwd) else cwd, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                 for rank in range(world)]
    return communicate_all(processes, timeout)
