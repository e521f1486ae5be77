"""The training loop: AdamW, warm-up + cosine, clipping, bf16, gradient accumulation,
activation checkpointing, codebook EMA, state carry, bits-per-byte evaluation, JSONL metrics
(and TensorBoard), atomic checkpoints, exact resume, signals, DDP or FSDP2. The data is a
shard folder (``data.open_shards``) or a byte corpus."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import __version__
from ..data import (TokenStreams, bits_per_byte, check_vocabulary, data_fingerprint, evaluated_bytes,
                    fingerprint_changes, fingerprint_fields, load_corpus, open_shards)
from ..models import LM, LMConfig
from . import distributed, lora, parallel, resharding, startup
from .checkpoint import Checkpoint, nonfinite_tensors, save_checkpoint
from .compiling import CompiledLayers
from .config import TrainConfig
from .divergence import NonFiniteGuard, TrainingDiverged, diverged_message, skipped_last_message
from .evaluate import check_evaluation_fits, evaluate_bpb
from .metrics import MetricsLog
from .microbatch import join_states, split_rows, split_state
from .optim import as_fused_state, trainer_adamw
from .parallel import check_launched
from .run_folder import METRICS_FILE, claim_run_folder
from .run_tokenizer import check_run_tokenizer, copy_tokenizer
from .schedule import learning_rate


class _StopRequest:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each step (a second signal
    falls through to the default behaviour)."""

    def __init__(self):
        self.signal_name: str | None = None

    def __call__(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)

    @contextmanager
    def installed(self):
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(s, self)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


# where a run came from (linattn convert), carried from checkpoint to checkpoint
_PROVENANCE = ("imported_from", "converted_from")


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    rng = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def _restore_rng(rng: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(rng["torch"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)


def _absolute_data(spec: str) -> str:
    """``train.data`` as a run records it: ``"shakespeare"`` as it is, a path made absolute
    (symbolic links resolved), so a resume from another working directory reads the same data."""
    return spec if spec == "shakespeare" else str(Path(spec).expanduser().resolve())


def _load_data(train_config: TrainConfig, context: distributed.Context, checkpoint: Checkpoint | None = None,
               *, accept_new_data: bool = False, echo: Callable[[str], None] = print
               ) -> tuple[Any, str, dict[str, Any]]:
    """Open the run's data -> ``(data, its absolute spec, its fingerprint)``. Rank 0 loads
    first (it may download), then the others read the cache.

    When resuming (``checkpoint``), the data must be what the checkpoint's ``data_fingerprint``
    recorded: data that changed, moved or is missing is a ``ValueError`` naming the path and
    what changed, unless ``accept_new_data`` (then ``echo`` says so once and the later
    checkpoints record the new fingerprint); a checkpoint without a fingerprint (an older
    linattn's) is resumed with a note that the data could not be checked. Every process
    opens and checks the data itself, then the processes compare their verdicts and
    fingerprints (``startup.exchange``: as long as any collective may wait, since the others
    read and hash the data meanwhile): a refusal stops every process, none trains alone, and
    data that differs between processes is an error naming its files and the ranks.
    """
    spec = _absolute_data(train_config.data)
    problem: Exception | None = None
    data = fingerprint = note = None
    if not context.is_main:
        distributed.barrier(context)
    try:
        if checkpoint is not None and spec != "shakespeare" and not Path(spec).exists():
            raise ValueError(f"--resume: the run's data {spec} is missing (moved or deleted since {checkpoint.path} "
                             f"was written); put it back at that path (a link will do)")
        data = open_shards(spec) or load_corpus(spec, cache_dir=train_config.cache_dir)
        fingerprint = data_fingerprint(data)
        if checkpoint is not None:
            note = _data_check(spec, checkpoint, fingerprint, accept_new_data)
    except (ValueError, OSError) as error:
        problem = error
    if context.is_main:
        distributed.barrier(context)
    record = None if problem is not None else fingerprint_fields(fingerprint)
    startup.exchange(context, "data", problem, record,
                     timeout=train_config.collective_timeout or distributed.DEFAULT_COLLECTIVE_TIMEOUT)
    if note is not None and context.is_main:
        echo(note)
    return data, spec, fingerprint


def _data_check(spec: str, checkpoint: Checkpoint, fingerprint: dict[str, Any], accept_new_data: bool) -> str | None:
    """Compare the data's ``fingerprint`` with the one ``checkpoint`` recorded: None when they
    match, a note to print when it cannot be checked or the change is accepted, else a ValueError."""
    recorded = checkpoint.meta.get("data_fingerprint")
    if recorded is None:
        return (f"{checkpoint.path} records no fingerprint of its data (written by an older linattn): {spec} could "
                f"not be checked against the data the run trained on")
    changes = fingerprint_changes(recorded, fingerprint)
    if changes is None:
        return None
    if not accept_new_data:
        raise ValueError(f"--resume: the data {spec} is not what {checkpoint.path} was trained on: {changes}. Put "
                         f"the run's data back, or continue on this data with --accept-new-data "
                         f"(train(..., accept_new_data=True) in Python)")
    return (f"continuing on changed data (--accept-new-data): {spec}: {changes}; the next checkpoints record the "
            f"new data")


def _silent(*args) -> None:
    pass


def accumulate_gradients(trained: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, carries: list,
                         *, device: torch.device, bf16: bool = False, forward: Callable | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Forward and backward of one optimizer step, as ``len(carries)`` micro-batches.

    ``inputs``/``targets [B, T]`` are cut into ``n = len(carries)`` row blocks
    (``train/microbatch.py``); block ``m`` starts from ``carries[m]`` (its streams' state, or
    None). Each block backpropagates ``(cross-entropy + commitment loss) / n``, so the
    gradients add up to those of the whole batch's mean loss; under DDP/FSDP they are
    reduced over processes only in the last block's backward. Returns the step's mean
    cross-entropy and mean commitment loss (detached) and the blocks' new states (not yet
    detached: pass them through ``LM.carry``). ``forward`` runs the model (default
    ``trained``; under ``train.compile`` its layers are compiled in place,
    ``train/compiling.py``); the ids are not checked there (``check_inputs=False``): the
    trainer checks the split where it loads it.
    """
    forward = trained if forward is None else forward
    n = len(carries)
    loss_sum = commit_sum = None
    states = []
    for m, (ids, target, carry) in enumerate(zip(split_rows(inputs, n), split_rows(targets, n), carries)):
        with parallel.gradient_sync(trained, enabled=m == n - 1):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits, state, aux = forward(ids.to(device), carry, check_inputs=False)
            loss = F.cross_entropy(logits.flatten(0, 1), target.to(device).flatten())
            ((loss + aux["commit_loss"]) / n).backward()
        loss, commit = loss.detach(), aux["commit_loss"].detach()
        loss_sum = loss if loss_sum is None else loss_sum + loss
        commit_sum = commit if commit_sum is None else commit_sum + commit
        states.append(state)
    return loss_sum / n, commit_sum / n, states


def compile_model(module: torch.nn.Module | Callable, **options) -> Callable:
    """``torch.compile(module, **options)`` for training (``train.compile`` applies it to each
    layer's forward, ``train/compiling.py``). Python state that a training forward
    writes (a codebook's restart candidates) is not written again when activation
    checkpointing recomputes a layer in the backward pass, as in eager mode, where the
    recomputation counts nothing (``nn/quantizer.py``, ``_inside_backward``); dynamo would
    otherwise refuse such writes inside a checkpointed region."""
    compiled = torch.compile(module, **options)
    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)(compiled)


def code_perplexity(model: LM, context: distributed.Context | None = None) -> torch.Tensor | None:
    """Mean over the VQ units of ``exp(entropy)`` of the code histogram of the assignments
    counted since the last codebook update (all heads pooled) -- the step's
    ``codebook_perplexity``, whatever its number of micro-batches. With ``context`` the counts
    are summed over its processes first (one all-reduce): the histogram of the global batch,
    whatever the number of processes; without, this process's tokens. None without VQ."""
    histograms = [quantizer.pending_counts.sum(0) for quantizer in model.quantizers()]
    if not histograms:
        return None
    if context is not None and context.distributed:
        summed = distributed.all_reduce_sum(torch.cat(histograms), context)
        histograms = summed.split([len(counts) for counts in histograms])
    perplexities = []
    for counts in histograms:
        probs = counts / counts.sum()
        perplexities.append(torch.exp(-(probs * probs.clamp_min(1e-30).log()).sum()))
    return torch.stack(perplexities).mean()


def train(
    model_config: LMConfig | None,
    train_config: TrainConfig | None,
    *,
    resume: bool = False,
    resume_from: int | str | Path | None = None,
    steps: int | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    command: str = "",
    echo=print,
    accept_new_data: bool = False,
    parallel: str | None = None,
    threads: int | None = None,
    lora_rank: int | None = None,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train (or with ``resume=True`` continue) a language model; returns a summary dict
    (``initial_bpb``, ``final_bpb``, ``step``, ``interrupted``, ``elapsed``, ... and the
    trained ``model``; ``finished=True`` when a resumed run had nothing left to train).

    ``resume`` reads a checkpoint of the run in ``out`` (the latest, or ``resume_from``: a
    step number or a checkpoint folder; see ``find_resume_checkpoint`` for the fallbacks)
    and takes both configs from it (pass None for them); the loss curve then continues
    exactly as if the run had never stopped. ``steps`` (with ``resume``) sets a new total,
    e.g. to extend a finished run: the original schedule is kept and the extra steps train
    at its floor learning rate. Under ``torchrun`` every process calls this; rank 0 alone
    writes. ``train_config.parallel`` set for a run of one process (not started by
    ``torchrun``) is a ValueError naming ``torchrun``.

    The run folder is claimed first (``train/run_folder.py``): locked against a second
    writer, and for a new run (not ``resume``) refused if it holds a run already, unless
    ``overwrite`` moves that run aside. A step with a non-finite loss or gradient norm is
    never applied (``train/divergence.py``): the run stops with ``TrainingDiverged``, or
    skips up to ``train.max_skipped_steps`` consecutive such steps.

    A run records ``train.data`` as an absolute path and, in each checkpoint, a fingerprint
    of the data (``linattn.data.data_fingerprint``). ``resume`` refuses data that changed,
    moved or is missing since the checkpoint (a ``ValueError`` before training), unless
    ``accept_new_data``: then it continues on the data as it is now.

    ``resume`` continues at any number of processes that shares the checkpoint's global
    batch evenly, and under either strategy (``parallel``: ``"ddp"`` or ``"fsdp"``, default
    the checkpoint's): the per-process batch and the carried states are re-cut, the streams
    stay those of the global batch (``train/resharding.py``). ``settings`` (with ``resume``)
    changes what fits a step into the memory of fewer, fuller processes, or how long they wait
    for each other: ``{"grad_accum_steps": ..., "activation_checkpointing": ...,
    "batch_size": ..., "dist_timeout": ..., "collective_timeout": ...}``
    (``resharding.RESUME_SETTINGS``; a ``batch_size`` that changes the global batch, or another
    setting, is refused by name). ``lora_rank`` (with ``resume``) fine-tunes with LoRA
    adapters of that rank from the checkpoint on (``train/lora.py``).

    Under ``torchrun`` the processes compare, before the first step, the errors each met on
    its own, their settings (both configs as the run records them), the checkpoint they
    resume and their data (``train/startup.py``): every process stops with the same error
    when one could not start or when they disagree, naming the settings, values and ranks,
    and a process that does not arrive within ``train.dist_timeout`` seconds is named.

    ``threads`` (with ``resume``): the torch CPU threads to continue with (default: the run's
    ``train.threads``). Each checkpoint records the thread count it was trained at; a resume
    on the CPU at another count says (one line) that the run stays correct but is no longer
    bit-identical to an uninterrupted one. A start that fails before it wrote anything
    leaves the run folder as it found it (``RunLock.release(discard=True)``).
    """
    if resume and out is None:
        raise ValueError("resume needs the run folder (--out)")
    if not resume and out is None and train_config is None:
        raise ValueError("train needs a TrainConfig (or resume=True with out)")
    if overwrite and resume:
        raise ValueError("--overwrite starts a new run in place of the old one; it cannot be combined with --resume")
    if not resume:
        if parallel is not None or lora_rank is not None or settings:
            name = ("parallel= picks the strategy" if parallel is not None else "lora_rank= sets the LoRA rank"
                    if lora_rank is not None else "settings= changes the settings")
            raise ValueError(f"{name} of a resumed run; for a new run set it in the TrainConfig")
        check_launched("train.parallel", train_config.parallel, distributed.env_world_size())
    elif parallel is not None:
        check_launched("--parallel", parallel, distributed.env_world_size())
    if distributed.env_rank() != 0:  # under torchrun, rank 0 alone speaks and writes
        echo = _silent
    run_dir = Path(out if out is not None else train_config.out)
    claim, refusal = None, None
    if distributed.env_rank() == 0:
        try:
            claim = claim_run_folder(run_dir, fresh=not resume, overwrite=overwrite, command=command, echo=echo)
        except Exception as error:
            if distributed.env_world_size() == 1:
                raise
            refusal = error  # the other ranks learn it in the start-up exchange
    try:
        return _claimed_train(model_config, train_config, run_dir, refusal, resume=resume, resume_from=resume_from,
                              steps=steps, progress=progress, command=command, echo=echo,
                              accept_new_data=accept_new_data, strategy=parallel, threads=threads,
                              lora_rank=lora_rank, settings=settings)
    except BaseException:
        if claim is not None:
            claim.release(discard=True)  # removes the lock's files if nothing else was written
        raise
    finally:
        if claim is not None:
            claim.release()


def _claimed_train(model_config, train_config, run_dir, refusal, *, resume, resume_from, steps, progress, command,
                   echo, accept_new_data, strategy=None, threads=None, lora_rank=None,
                   settings=None) -> dict[str, Any]:
    """``train`` once rank 0 holds the run folder (``refusal``: rank 0's error if it does not):
    resolve the run (its checkpoint and configs), meet the other processes and compare
    (``startup.exchange``), then join the process group and train."""
    problem, checkpoint = refusal, None
    if problem is None:
        try:
            if resume:
                checkpoint, model_config, train_config = resharding.resumed_run(
                    run_dir, resume_from, steps, strategy, threads, lora_rank, settings, echo)
            else:
                train_config = TrainConfig.from_dict({**train_config.to_dict(), "out": str(run_dir)})
            distributed.check_device(train_config.device)
        except Exception as error:  # under torchrun the others learn it in the exchange below
            if distributed.env_world_size() == 1:
                raise
            problem = error
    if train_config is not None and train_config.threads is not None:
        torch.set_num_threads(train_config.threads)
    if problem is None and checkpoint is not None and checkpoint.step < train_config.steps:
        _note_other_threads(checkpoint, train_config, echo)
    wait = train_config.dist_timeout if train_config is not None else (settings or {}).get(
        "dist_timeout", TrainConfig.dist_timeout)
    try:
        context = distributed.join(wait)
    except ValueError:
        if problem is not None:  # the others cannot be told: this process's own error says more
            raise problem from None
        raise
    record = None if problem is not None else startup.run_record(model_config, train_config, checkpoint)
    startup.exchange(context, "configuration", problem, record)
    context = distributed.setup(context, train_config.device, train_config.collective_timeout)
    try:
        with parallel.view_warnings_silenced():
            return _train(model_config, train_config, checkpoint, context, progress, command, echo,
                          accept_new_data)
    finally:
        distributed.teardown(context)


def _note_other_threads(checkpoint: Checkpoint, train_config: TrainConfig, echo: Callable[[str], None]) -> None:
    """Say (one line) when a CPU run resumes at another torch thread count than ``checkpoint``
    recorded (checkpoints written before the count was recorded say nothing)."""
    recorded, now = checkpoint.meta.get("threads"), torch.get_num_threads()
    if recorded is None or recorded == now or torch.device(train_config.device).type != "cpu":
        return
    echo(f"warning: resuming at {now} torch threads, but {checkpoint.path} was trained at {recorded}: the results "
         f"stay correct but are no longer bit-identical to an uninterrupted run (resume with --threads {recorded} "
         f"to keep them so)")


def _train(model_config, train_config, checkpoint, context, progress, command, echo,
           accept_new_data=False) -> dict[str, Any]:
    cfg = train_config
    device = context.device
    run_dir = Path(cfg.out)
    if checkpoint is not None and checkpoint.step >= cfg.steps:
        if context.is_main:
            echo(f"the run in {run_dir} is finished (step {checkpoint.step} of {cfg.steps}); nothing to train. "
                 f"Extend it with: linattn train --resume --out {run_dir} --steps N (N > {cfg.steps})")
        return {"out": str(run_dir), "start_step": checkpoint.step, "step": checkpoint.step, "finished": True,
                "interrupted": None, "final_bpb": None}

    torch.manual_seed(cfg.seed)
    model = LM(model_config).to(device)
    model.activation_checkpointing = cfg.activation_checkpointing
    new_adapters = lora.load_adapted(model, checkpoint.model if checkpoint is not None else None, cfg.lora_rank)
    if cfg.lora_rank and context.is_main:
        echo(lora.adapter_summary(model, cfg.lora_rank))
    trained = parallel.wrap(model, cfg.parallel, context)  # FSDP shards `model` in place
    layers = CompiledLayers(model, enabled=cfg.compile, checkpointing=cfg.activation_checkpointing,
                            compile=compile_model)  # train.compile: each layer on its own
    optimizer = trainer_adamw(model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2))
    start_step, carries = 0, [None] * cfg.grad_accum_steps  # one carried state per micro-batch
    if checkpoint is not None:
        if not new_adapters:  # (new adapters start a fresh optimizer state)
            parallel.load_optimizer_state(model, optimizer, as_fused_state(checkpoint.optimizer_state()))
        _restore_rng(checkpoint.rng(), device)
        start_step = checkpoint.step
        carries = split_state(resharding.rank_carry(checkpoint, context.world_size, context.rank, device),
                              cfg.grad_accum_steps)

    data, data_spec, fingerprint = _load_data(cfg, context, checkpoint, accept_new_data=accept_new_data, echo=echo)
    tokenizer = check_run_tokenizer(data, model_config.vocab_size, checkpoint)
    byte_tokens = tokenizer.get("sha256") is None  # else bits per token are converted to bits per byte
    check_vocabulary(data, ("train", "validation") if cfg.eval_every else ("train",), model_config.vocab_size,
                     spec=cfg.data)
    streams = TokenStreams(data.tokens("train"), batch_size=cfg.batch_size, context=cfg.context,
                           rank=context.rank, world_size=context.world_size)
    validation, validation_bytes = data.tokens("validation"), None
    if cfg.eval_every:
        check_evaluation_fits(validation.numel(), cfg.eval_tokens, batch_size=cfg.eval_batch_size,
                              context=cfg.context, split="validation", batch_name="train.eval_batch_size",
                              budget_name="train.eval_tokens")
        validation_bytes = evaluated_bytes(data, validation[:cfg.eval_tokens], context=cfg.context,
                                           n_streams=cfg.eval_batch_size)
    tokens_per_step = cfg.batch_size * cfg.context * context.world_size
    if context.is_main and checkpoint is None:  # the inputs are checked: the run's first files
        copy_tokenizer(data, run_dir)
    metrics = MetricsLog(run_dir / METRICS_FILE, context.is_main, start_step if checkpoint else None,
                         tensorboard=cfg.tensorboard, echo=echo)
    if context.is_main and checkpoint is None:
        unit = "bytes" if byte_tokens else f"tokens of a {data.vocab_size}-token vocabulary"
        echo(f"model: {model_config.attention} x {model_config.n_layers} layers, d_model {model_config.d_model}, "
             f"{model.num_parameters() / 1e6:.2f}M parameters; data: {cfg.data} "
             f"({data.tokens('train').numel():,} train {unit}, {len(streams)} windows per pass)")

    guard = NonFiniteGuard(device, cfg.max_skipped_steps)
    last_saved = {"path": str(checkpoint.path) if checkpoint is not None else None}  # written by save()

    def stop_diverged(step: int, what: list[str], last_step: int, skipped: int | None = None,
                      evaluation: bool = False) -> TrainingDiverged:
        metrics.write({"step": step, "event": "diverged", "nonfinite": what})
        message = diverged_message(step, what, last_step=last_step, last_checkpoint=last_saved["path"],
                                   run_dir=str(run_dir), skipped=skipped, evaluation=evaluation)
        return TrainingDiverged(message, step=step, what=what, last_checkpoint=last_saved["path"])

    def check_guard(step: int) -> None:
        """Stop mode: raise if a step so far went non-finite (reads the device)."""
        if not guard.max_skipped and guard.diverged(context):
            raise stop_diverged(int(guard.first_step), guard.what(), step)

    def evaluate(step: int) -> float:
        with layers.eager():  # evaluation runs eagerly (its batch and no_grad would be graphs of their own)
            result = evaluate_bpb(model, validation, context=cfg.context, batch_size=cfg.eval_batch_size,
                                  max_tokens=cfg.eval_tokens, carry_state=cfg.carry_state,
                                  reset_every=cfg.carry_windows, dist_context=context, bf16=cfg.bf16)
        record = {"step": step, "split": "validation", "bpb": result["bpb"], "tokens": result["tokens"]}
        if validation_bytes is not None:
            record.update(bpb=bits_per_byte(result, validation_bytes), bits_per_token=result["bpb"],
                          bytes=validation_bytes)
        if not math.isfinite(record["bpb"]):
            raise stop_diverged(step, ["validation bits per byte"], step, evaluation=True)
        metrics.write(record)
        return record["bpb"]

    def save(step: int, carried: list) -> Path | None:
        carry_state = join_states(carried)  # the micro-batches' states stacked: this rank's whole batch
        carries = distributed.gather_objects(None if carry_state is None else carry_state.to("cpu"), context)
        model_tensors = parallel.full_model_state(model, context)  # under FSDP: gathered to rank 0
        optimizer_state = parallel.full_optimizer_state(model, optimizer, context)
        if not context.is_main:
            return None
        nonfinite = nonfinite_tensors(model_tensors)
        if nonfinite:  # finite losses and gradients can still step to inf weights
            raise stop_diverged(step, [f"weights ({', '.join(nonfinite[:3])})"], step)
        meta = {
            "model_config": model_config.to_dict(), "train_config": {**cfg.to_dict(), "data": data_spec},
            "world_size": context.world_size,
            "data": {"window": step % len(streams), "pass": step // len(streams),
                     "streams": cfg.batch_size * context.world_size, "eval_streams": cfg.eval_batch_size},
            "data_fingerprint": fingerprint,
            "tokens_seen": step * tokens_per_step, "tokenizer": tokenizer, "linattn_version": __version__,
            "torch_version": torch.__version__, "command": command, "threads": torch.get_num_threads(),
            **{key: checkpoint.meta[key] for key in _PROVENANCE if checkpoint is not None and key in checkpoint.meta},
        }
        path = save_checkpoint(run_dir / "checkpoints", step=step, model_tensors=model_tensors,
                               optimizer_state=optimizer_state, rng=_rng_state(device),
                               carries=carries, meta=meta, keep=cfg.keep_checkpoints)
        last_saved["path"] = str(path)
        return path

    summary: dict[str, Any] = {"out": str(run_dir), "start_step": start_step, "interrupted": None}
    if start_step == 0 and cfg.eval_every:
        summary["initial_bpb"] = evaluate(0)
        if context.is_main:
            echo(f"validation bpb before training: {summary['initial_bpb']:.3f}")

    bar = tqdm(total=cfg.steps, initial=start_step, disable=not (progress and context.is_main),
               desc="train", unit="step", dynamic_ncols=True)
    stop = _StopRequest()
    step, last_bpb, started = start_step, summary.get("initial_bpb"), time.perf_counter()
    last_bpb_step = 0 if last_bpb is not None else None
    window_time, window_steps, loss_value = time.perf_counter(), 0, float("nan")
    try:
        with stop.installed():
            while step < cfg.steps:
                window = step % len(streams)
                if window == 0 or not cfg.carry_state or (cfg.carry_windows and window % cfg.carry_windows == 0):
                    carries = [None] * cfg.grad_accum_steps
                lr = learning_rate(step, peak=cfg.lr, total_steps=cfg.decay_steps or cfg.steps,
                                   warmup_steps=cfg.warmup_steps, min_ratio=cfg.min_lr_ratio)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.zero_grad(set_to_none=True)
                inputs, targets = streams.window(window)
                # A k-means codebook initialisation (the first step) runs eagerly: no compiled graph holds it.
                with layers.eager(when=any(q.initialization_pending() for q in model.quantizers())):
                    loss, commit_loss, states = accumulate_gradients(trained, inputs, targets, carries,
                                                                     device=device, bf16=cfg.bf16)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.found_inf = guard.observe(step + 1, loss, commit_loss, grad_norm, context)
                optimizer.step()
                logging = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps  # this step is logged
                perplexity = code_perplexity(model, context) if logging else None
                model.update_codebooks(apply=optimizer.found_inf == 0)
                carries = [model.carry(state) if cfg.carry_state else None for state in states]
                step += 1
                window_steps += 1
                bar.update(1)
                if guard.max_skipped and guard.skip(optimizer.found_inf):
                    carries = [None] * cfg.grad_accum_steps  # the step's states are not finite either
                    metrics.write({"step": step, "skipped": True, "nonfinite": guard.what()})
                    if guard.too_many_skipped:
                        raise stop_diverged(step, guard.what(), step, skipped=guard.consecutive)

                logging = step % cfg.log_every == 0 or step == cfg.steps
                evaluating = cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps)
                if logging or evaluating:
                    check_guard(step)

                if logging:
                    reduced = distributed.all_reduce_sum(torch.stack([loss, commit_loss]).double(), context
                                                         ) / context.world_size
                    loss_value = float(reduced[0])
                    now = time.perf_counter()
                    speed = window_steps * tokens_per_step / max(now - window_time, 1e-9)
                    window_time, window_steps = now, 0
                    record = {"step": step, "loss": loss_value, "bpb": loss_value / math.log(2), "lr": lr,
                              "grad_norm": float(grad_norm), "commit_loss": float(reduced[1]),
                              "tokens_per_second": speed, "elapsed": now - started}
                    if not byte_tokens:  # a token's bits are not a byte's
                        record["bits_per_token"] = record.pop("bpb")
                    if guard.max_skipped:
                        record["skipped_steps"] = guard.skipped
                    if perplexity is not None:
                        record["codebook_perplexity"] = float(perplexity)
                    metrics.write(record)
                    postfix = {"loss": f"{loss_value:.3f}", "tok/s": f"{speed:,.0f}"}
                    if last_bpb is not None:  # the latest evaluation, labelled with its step (0: before training)
                        postfix[f"val_bpb@{last_bpb_step}"] = f"{last_bpb:.3f}"
                    bar.set_postfix(postfix, refresh=False)
                if evaluating:
                    last_bpb, last_bpb_step = evaluate(step), step
                    bar.set_postfix({"loss": f"{loss_value:.3f}", f"val_bpb@{step}": f"{last_bpb:.3f}"}, refresh=True)

                stopping = distributed.broadcast_flag(stop.signal_name is not None, context)
                if stopping or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps:
                    if not (logging or evaluating):
                        check_guard(step)
                    path = save(step, carries)
                    if step == cfg.steps and guard.max_skipped and guard.consecutive:  # the final step was skipped
                        raise TrainingDiverged(
                            skipped_last_message(step, guard.what(), skipped=guard.consecutive, checkpoint=path,
                                                 run_dir=str(run_dir)),
                            step=step, what=guard.what(), last_checkpoint=None if path is None else str(path))
                    if stopping:
                        summary["interrupted"] = stop.signal_name or "signal on another rank"
                        if context.is_main:
                            bar.close()
                            echo(f"stopped by {summary['interrupted']} after step {step}; checkpoint saved to {path}; "
                                 f"continue with: linattn train --resume --out {run_dir}")
                        break
    finally:
        bar.close()
        metrics.close()
        layers.restore()
    summary.update(step=step, final_bpb=last_bpb, final_bpb_step=last_bpb_step, last_loss=loss_value,
                   elapsed=time.perf_counter() - started, model=model, byte_tokens=byte_tokens)
    return summary
