"""``linattn doctor``: what linattn finds on this machine, what it will run there, and whether
every op family's fast forms agree with their references here.

Sections: versions (linattn, Python, torch and its CUDA runtime, the CUDA driver, triton,
transformers, peft, numpy; read from the installed packages' metadata, nothing imported),
threads, devices (every CUDA device torch sees, with its name, compute capability and
memory), the implementation each op takes on each device and why (``implementations``), and
the self-test of ``_selftest.py`` on each device (the VQ kernels' self-check included on
CUDA). Exit code 0 when every check agrees, 1 when one does not (each named on a ``FAIL``
line and in the last line), 2 for bad arguments. ``--json`` prints the same as one JSON
object instead.

``--build`` does one thing instead: it builds (or loads) the native kernels (the decoding
step, the block form and its gradients, the nearest-code search) for this machine and checks them in each dtype they
compute in (``build_native``), so that a first call compiles nothing (an installation step).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from . import __version__, _selftest
from ._checks import available_device_name
from .models import _block_generation
from .ops.common import native
from .ops.delta import native_chunk
from .ops.kernel import native_scan
from .ops.vq import native_block_check, native_choice, schedule, triton_choice
from .reporting import device_name

_PACKAGES = ("triton", "transformers", "peft", "numpy")
# torch's SDPA backends, by the operator each one runs
_SDPA_BACKENDS = {
    "_scaled_dot_product_flash_attention_for_cpu": "flash attention (CPU kernel)",
    "_scaled_dot_product_flash_attention": "flash attention",
    "_scaled_dot_product_efficient_attention": "memory-efficient attention",
    "_scaled_dot_product_cudnn_attention": "cuDNN attention",
    "_scaled_dot_product_attention_math": "math (materialised scores)",
}


def versions() -> dict[str, str]:
    """Installed versions (``"not installed"`` for a missing package)."""
    found = {"linattn": __version__, "python": platform.python_version(), "torch": torch.__version__,
             "CUDA runtime (torch build)": torch.version.cuda or "none (CPU build)"}
    if torch.cuda.is_available():
        driver = torch._C._cuda_getDriverVersion()  # e.g. 12040 for 12.4
        found["CUDA driver"] = f"{driver // 1000}.{driver % 1000 // 10}"
    for package in _PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def threads() -> dict[str, int | None]:
    return {"torch intra-op threads": torch.get_num_threads(),
            "torch inter-op threads": torch.get_num_interop_threads(), "CPUs": os.cpu_count()}


def devices(selected: list[str] | None = None) -> list[torch.device]:
    """``selected`` (``--device``), or the CPU and every CUDA device torch sees."""
    if selected:
        return list(dict.fromkeys(torch.device(name) for name in selected))
    return [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def describe_device(device: torch.device) -> str:
    """Its name, and for CUDA its compute capability and memory."""
    if device.type != "cuda":
        return device_name(device)
    properties = torch.cuda.get_device_properties(device)
    return (f"{properties.name} (sm_{properties.major}{properties.minor}, "
            f"{properties.total_memory / 2**30:.1f} GiB)")


class _Ops(TorchDispatchMode):
    """The operators that run below autograd (to see which SDPA backend torch picks)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def sdpa_backend(device: torch.device, dtype: torch.dtype, queries: int, keys: int) -> str:
    """The backend torch's ``scaled_dot_product_attention`` runs for a causal prefill
    (``queries == keys``) or a decoding step (one query, no mask) of 8 heads of 64 on ``device``."""
    q = torch.zeros(1, 8, queries, 64, device=device, dtype=dtype)
    k = torch.zeros(1, 8, keys, 64, device=device, dtype=dtype)
    with _Ops() as ops:
        F.scaled_dot_product_attention(q, k, k, is_causal=queries == keys and queries > 1)
    for name in ops.names:
        if name in _SDPA_BACKENDS:
            return _SDPA_BACKENDS[name]
    return _SDPA_BACKENDS["_scaled_dot_product_attention_math"]


def implementations(device: torch.device) -> list[tuple[str, str]]:
    """``(op, what it runs on device and why)`` for each op with a choice."""
    dtypes = (torch.float32,) if device.type == "cpu" else (torch.float32, torch.bfloat16)
    rows = []
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        rows.append((f"softmax_attention ({name})",
                     f"impl='auto': torch SDPA (the tiled form only for a callable bias); SDPA runs "
                     f"{sdpa_backend(device, dtype, 128, 128)} for a causal prefill, "
                     f"{sdpa_backend(device, dtype, 1, 128)} for one decoded token"))
    on_cpu = device.type == "cpu"
    rows.append(("linear_attention", "mode=None: chunk form (chunk_size 64), recurrent for one causal token"
                 + ("; impl='auto': the native chunk kernels for causal chunk calls in float32 / float64 (decayed: "
                    f"without gradients; {native_scan.ENV})" if on_cpu else "")))
    rows.append(("delta_rule", "mode=None: chunk form (WY/UT), recurrent for one token"
                 + ("; impl='auto': the native chunk kernel for chunk calls without gradients in float32 / float64 "
                    f"({native_chunk.ENV})" if on_cpu else "")))
    for dtype in dtypes:
        impl, why = triton_choice.choice(device, dtype)
        rows.append((f"vq_attention ({str(dtype).replace('torch.', '')})", f"impl='auto': {impl} ({why})"))
    for dtype in dtypes:
        impl, why = native_choice.choice(device, dtype)
        rows.append((f"vq_decode_step ({str(dtype).replace('torch.', '')})", f"impl='auto': {impl} ({why})"))
    rows.append(("vq_attention schedule", f"schedule='auto': {_schedule_choice(device)}; "
                                          "decoding steps inside a block: the decode form"))
    rows.append(("KV cache (softmax layers)", "preallocated without gradients: rows written in place, doubling "
                                              "when full; LM.generate reserves prompt + new tokens"))
    return rows


def _schedule_choice(device: torch.device) -> str:
    """What ``vq_attention``'s ``schedule="auto"`` picks on ``device``, from ``AUTO_SCHEDULE``
    (``ops/vq/schedule.py``)."""
    if device.type != "cpu":
        return "batched (groups of blocks as batched matmuls; the grid is measured on CPUs only)"
    parts = []
    for grad, mode in ((False, "without gradients"), (True, "with gradients")):
        winners = [winner for key, winner in schedule.AUTO_SCHEDULE.items() if key[0] == grad]
        parts.append(f"{mode} loop at {winners.count('loop')} and batched at {winners.count('batched')} "
                     f"of {len(winners)} measured shapes")
    return ("the faster of loop and batched at the nearest measured (batch x heads, L, S, blocks per row): "
            + "; ".join(parts))


def _print_section(title: str, rows) -> None:
    print(f"\n{title}")
    rows = list(rows)
    width = max((len(str(key)) for key, _ in rows), default=0)
    for key, value in rows:
        print(f"  {str(key):<{width}}  {value}")


def _result_line(result: _selftest.Result) -> str:
    errors = ("raised" if result.out_error is None
              else f"out {result.out_error:.1e}, grads {result.grad_error:.1e}")
    line = (f"  {'ok  ' if result.ok else 'FAIL'}  {result.family:<28} {result.form:<34} {result.dtype:<9} "
            f"{errors} (tolerance {result.out_rtol:g} / {result.grad_rtol:g})")
    return line if result.ok else f"{line}: {result.detail}"


def run(selected: list[str] | None = None, as_json: bool = False) -> int:
    """Print the report (text, or one JSON object with ``as_json``); 0 when every check agrees."""
    start = time.perf_counter()
    chosen = devices(selected)
    report = {"versions": versions(), "threads": threads(),
              "devices": {str(device): describe_device(device) for device in chosen},
              "implementations": {}, "self_test": {}}
    if not as_json:
        print("linattn doctor")
        _print_section("versions", report["versions"].items())
        _print_section("threads", report["threads"].items())
        _print_section("devices", report["devices"].items())
    failures = []
    for device in chosen:
        rows = implementations(device)
        results = _selftest.run_all(device)
        report["implementations"][str(device)] = dict(rows)
        report["self_test"][str(device)] = [vars(result) for result in results]
        failures += [f"{result.family} {result.form} ({result.dtype}, {device})" for result in results if not result.ok]
        if not as_json:
            _print_section(f"implementations on {device}", rows)
            print(f"\nself-test on {device} (fast form vs reference, relative error, tolerance out / gradients)")
            for result in results:
                print(_result_line(result))
    checked = sum(len(results) for results in report["self_test"].values())
    report["ok"], report["failures"] = not failures, failures
    report["seconds"] = round(time.perf_counter() - start, 2)
    if as_json:
        print(json.dumps(report, indent=2))
    elif failures:
        print(f"\n{len(failures)} of {checked} checks FAILED: {'; '.join(failures)}")
    else:
        print(f"\nall {checked} checks agree ({report['seconds']:.1f} s)")
    sys.stdout.flush()
    return 0 if not failures else 1


def build_native() -> int:
    """Build (or load) the native kernels and run their self-checks in float32 and float64
    (the VQ decoding step's, ``ops/vq/native_choice.py``, the VQ block form's,
    ``ops/vq/native_block_check.py``, the whole-model step of pre-norm blocks',
    ``models/_block_generation.py``, kernel attention's chunk form, ``ops/kernel/native_scan.py``,
    and the delta rule's, ``ops/delta/native_chunk.py``),
    one line each; 0 when they build and agree with the
    torch forms, 1 otherwise (each failure on a ``FAIL`` line)."""
    try:
        native.extension()
    except RuntimeError as error:
        print(f"  FAIL  native kernels: {error}")
        return 1
    print(f"native kernels: built in {native.build_directory()}")
    failed = False
    checks = (("decoding step", native_choice.verdict), ("block form", native_block_check.verdict),
              ("model step of pre-norm blocks", _block_generation.verdict),
              ("kernel attention's chunk form", native_scan.verdict),
              ("the delta rule's chunk form", native_chunk.verdict))
    for kernel, check in checks:
        for dtype in native_choice.DTYPES:
            failure = check(dtype)
            name = str(dtype).replace("torch.", "")
            print(f"  ok    {kernel}, {name}: agrees with the torch form" if failure is None
                  else f"  FAIL  {kernel}, {name}: {failure}")
            failed = failed or failure is not None
    sys.stdout.flush()
    return 1 if failed else 0


def _handle(args: argparse.Namespace) -> int:
    if args.build:
        if args.device or args.json:
            raise ValueError("doctor --build runs alone: it takes no --device or --json")
        return build_native()
    return run(args.device, args.json)


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``linattn doctor``."""
    parser = commands.add_parser(
        "doctor", help="report versions, devices and implementations, and self-test the ops",
        description="What linattn finds on this machine (versions, threads, devices), what each op runs on each "
                    "device and why, and a self-test of every op family's fast forms against their references "
                    "there. Exit code 0 when every check agrees, 1 otherwise.")
    parser.add_argument("--device", action="append", type=available_device_name,
                        help="a device to report and test (repeatable; default: the CPU and every CUDA device)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--build", action="store_true",
                        help="only build (or load) the native kernels for this machine and check them, so "
                             "that a first call compiles nothing (an installation step); exit 0 when they "
                             "build and agree with the torch forms")
    parser.set_defaults(handler=_handle)
