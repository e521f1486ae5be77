"""Measurement primitives and the (length x case) runner every benchmark shares.

What is measured, per case and sequence length T:

- forward time: wall-clock seconds of ``fn(q, k, v)`` under ``torch.no_grad()``;
- forward+backward time: ``fn(q, k, v).backward(cotangent)`` with gradients on q, k, v
  and a fixed random cotangent (drawn once per length, outside the timed region);
- peak memory of each: the largest amount of memory in use during one call, above what
  was in use just before it (``linattn.reporting.peak_memory``; CPU: resident set size of
  the process; CUDA: the caching allocator's allocated bytes).

Times are medians of ``repeats`` calls after ``warmup`` untimed calls; on CUDA every
call is bracketed by ``torch.cuda.synchronize``.

With ``profile_top > 0`` one more call of each runs under ``torch.profiler``: where the
time goes, as the operators with the most self time (``profile_call``).

Whole-model benchmarks run each model in a freshly spawned process (``in_fresh_process``).
"""

from __future__ import annotations

import gc
import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .._checks import check_int
from ..reporting import peak_memory

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One mechanism under test.

    ``fn(q, k, v)`` returns the attention output ``[B, H, T, Dv]``. Lengths above
    ``max_length`` are skipped (``max_length_note`` says why); ``supports_backward=False``
    measures the forward pass only.
    """

    name: str
    label: str
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    max_length: int | None = None
    max_length_note: str = ""
    supports_backward: bool = True


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(values))


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (CUDA); a no-op on the CPU. Brackets every timed call."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], *, repeats: int, warmup: int = 1, device: torch.device | str) -> list[float]:
    """Seconds taken by each of ``repeats`` calls of ``fn()``, after ``warmup`` untimed calls."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def profile_call(fn: Callable[[], object], *, device: torch.device | str, top: int) -> dict:
    """Run ``fn()`` once under ``torch.profiler``; the ``top`` operators by self time.

    Self time is an operator's own time, without the operators it calls: on CPU the host
    time, on CUDA the time of its kernels on the device. Returns ``{"total_ms", "ops"}``
    with ``ops`` a list of ``{"op", "self_ms", "share", "calls"}`` sorted by ``self_ms``
    (``share`` = ``self_ms / total_ms``, the total over every operator of the call).
    """
    check_int("top", top)
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    synchronize(device)
    with profile(activities=activities) as profiler:
        fn()
        synchronize(device)
    field = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    events = [(e.key, getattr(e, field) / 1e3, e.count) for e in profiler.key_averages()]
    events = [e for e in events if e[1] > 0]
    total = sum(e[1] for e in events)
    events.sort(key=lambda e: e[1], reverse=True)
    ops = [{"op": name, "self_ms": ms, "share": ms / total, "calls": calls} for name, ms, calls in events[:top]]
    return {"total_ms": total, "ops": ops}


def is_out_of_memory(error: BaseException) -> bool:
    """True for CUDA/CPU allocation failures (which a benchmark records as a skip)."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Measurement:
    """Median and every time of the timed calls, the peak extra memory of one more call, or
    why they could not be taken (``failure``, an out-of-memory error's first line)."""

    median_s: float | None = None
    times_s: tuple[float, ...] = ()
    peak_bytes: int | None = None
    failure: str | None = None


def measure(call: Callable[[], object], *, repeats: int, warmup: int, device: torch.device | str) -> Measurement:
    """Time ``call`` (``time_call``) and take its peak memory (one more call); an
    out-of-memory error becomes ``failure`` instead of an exception."""
    device = torch.device(device)
    failure = None
    try:
        times = time_call(call, repeats=repeats, warmup=warmup, device=device)
        peak = peak_memory(call, device)
    except Exception as error:  # noqa: BLE001 - only out-of-memory is swallowed
        if not is_out_of_memory(error):
            raise
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        failure = f"out of memory: {first_line[:200]}"
    if failure is not None:
        _release_memory(device)
        return Measurement(failure=failure)
    return Measurement(median(times), tuple(times), peak)


def _forward_call(fn, inputs: Inputs) -> Callable[[], torch.Tensor]:
    def forward() -> torch.Tensor:
        with torch.no_grad():
            return fn(*inputs)

    return forward


def _forward_backward_call(fn, inputs: Inputs, cotangent: torch.Tensor) -> Callable[[], None]:
    leaves = tuple(t.detach().clone().requires_grad_(True) for t in inputs)

    def forward_backward() -> None:
        fn(*leaves).backward(cotangent)
        for leaf in leaves:  # drop the grads so the next call starts from the same state
            leaf.grad = None

    return forward_backward


def run_cases(
    cases: Sequence[Case],
    lengths: Sequence[int],
    make_inputs: Callable[[int], Inputs],
    *,
    repeats: int,
    warmup: int = 1,
    device: torch.device | str,
    progress: bool = True,
    backward_max_length: int | None = None,
    profile_top: int = 0,
) -> list[dict]:
    """Measure every case at every length; one result row per (length, case).

    ``make_inputs(T)`` returns ``(q, k, v)`` on ``device``; the cotangent of the backward
    pass has the output's shape ``[B, H, T, Dv]``. A case that runs out of memory at some
    length is recorded as skipped there and at every longer length (separately for the
    forward and the forward+backward measurement). Forward+backward is skipped above
    ``backward_max_length``.

    Row keys: ``case``, ``label``, ``length``, ``forward_s``, ``forward_times_s``,
    ``forward_peak_bytes``, ``forward_backward_s``, ``forward_backward_times_s``,
    ``forward_backward_peak_bytes`` (None where not measured), ``skip_reason`` (why the
    case did not run at this length, else None), ``backward_skip_reason``, and
    ``forward_profile`` / ``forward_backward_profile``: ``profile_call``'s top
    ``profile_top`` operators of one more call (None unless ``profile_top > 0``).
    """
    device = torch.device(device)
    forward_failed: dict[str, str] = {}
    backward_failed: dict[str, str] = {}
    rows = []
    pairs = [(length, case) for length in sorted(lengths) for case in cases]
    bar = tqdm(pairs, desc="bench", unit="case", disable=not progress, dynamic_ncols=True)
    inputs = cotangent = None
    current_length = None
    for length, case in bar:
        bar.set_postfix_str(f"T={length} {case.name}")
        if length != current_length:
            inputs = cotangent = None
            _release_memory(device)
            inputs = make_inputs(length)
            q, _, v = inputs
            generator = torch.Generator(device=device).manual_seed(length)
            cotangent = torch.randn(*q.shape[:-1], v.shape[-1], generator=generator, device=device, dtype=q.dtype)
            current_length = length
        row = {
            "case": case.name,
            "label": case.label,
            "length": length,
            "forward_s": None,
            "forward_times_s": [],
            "forward_peak_bytes": None,
            "forward_backward_s": None,
            "forward_backward_times_s": [],
            "forward_backward_peak_bytes": None,
            "skip_reason": None,
            "backward_skip_reason": None,
            "forward_profile": None,
            "forward_backward_profile": None,
        }
        rows.append(row)
        if case.max_length is not None and length > case.max_length:
            note = f" ({case.max_length_note})" if case.max_length_note else ""
            row["skip_reason"] = f"T={length} > max length {case.max_length}{note}"
            continue
        if case.name in forward_failed:
            row["skip_reason"] = forward_failed[case.name]
            continue
        forward = measure(_forward_call(case.fn, inputs), repeats=repeats, warmup=warmup, device=device)
        if forward.failure is not None:
            row["skip_reason"] = forward.failure
            forward_failed[case.name] = f"skipped after {forward.failure} at T={length}"
            continue
        row.update(
            forward_s=forward.median_s, forward_times_s=list(forward.times_s), forward_peak_bytes=forward.peak_bytes
        )
        if profile_top:
            row["forward_profile"] = profile_call(_forward_call(case.fn, inputs), device=device, top=profile_top)

        if not case.supports_backward:
            row["backward_skip_reason"] = "forward only"
            continue
        if backward_max_length is not None and length > backward_max_length:
            row["backward_skip_reason"] = f"T={length} > --backward-max-length {backward_max_length}"
            continue
        if case.name in backward_failed:
            row["backward_skip_reason"] = backward_failed[case.name]
            continue
        step_call = _forward_backward_call(case.fn, inputs, cotangent)
        step = measure(step_call, repeats=repeats, warmup=warmup, device=device)
        if step.failure is not None:
            row["backward_skip_reason"] = step.failure
            backward_failed[case.name] = f"skipped after {step.failure} at T={length}"
            continue
        row.update(
            forward_backward_s=step.median_s,
            forward_backward_times_s=list(step.times_s),
            forward_backward_peak_bytes=step.peak_bytes,
        )
        if profile_top:
            row["forward_backward_profile"] = profile_call(step_call, device=device, top=profile_top)
    bar.close()
    return rows


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)


def in_fresh_process(fn: Callable, *args, threads: int | None, **kwargs):
    """``fn(*args, **kwargs)`` in a newly spawned process (with ``threads`` torch threads):
    a model timed after the op table or after another model's 64k-token prefill ran up to
    1.7x slower in the same process (allocator and cache state), so each starts clean.
    ``fn`` must be importable (a module-level function) and its result picklable."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=_set_threads, initargs=(threads,)) as pool:
        return pool.submit(fn, *args, **kwargs).result()
