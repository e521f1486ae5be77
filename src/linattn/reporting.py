"""Result files shared by benchmarks (``linattn bench``) and reproductions (``linattn repro``).

- metadata: ``collect_metadata`` (versions, platform, device, threads, malloc settings, date,
  command, shapes) -- what a reader needs to reproduce or compare a result;
- writers: ``write_json`` (``{"metadata", "rows", "summary"}``), ``write_markdown``,
  ``markdown_table_lines`` (a GitHub table), ``pyplot`` / ``save_figure`` (PNG plots, Agg backend);
- readers: ``read_results`` (a ``results.json``), ``read_results_of`` (with the ``linattn``
  subcommand that wrote it, from its ``metadata.command``) and ``results_page`` (that
  subcommand's page of it);
- ``peak_memory(fn, device)``: the largest extra memory in use while ``fn()`` runs (CPU:
  resident set of the process; CUDA: the caching allocator's allocated bytes).
"""

from __future__ import annotations

import ctypes
import json
import platform
import shlex
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import __version__
from ._files import write_text_atomic
from ._malloc import malloc_settings

# --- metadata ---------------------------------------------------------------------------


def device_name(device: torch.device | str) -> str:
    """Human-readable name of the device: the GPU model, or the CPU model from /proc/cpuinfo."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def collect_metadata(*, device: torch.device | str, command: str, shapes: dict) -> dict:
    """What a reader needs to reproduce or compare a run."""
    return {
        "linattn_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(torch.device(device)),
        "device_name": device_name(device),
        "threads": torch.get_num_threads(),
        "malloc": malloc_settings(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "shapes": shapes,
    }


# --- writers ----------------------------------------------------------------------------


def write_json(path: Path, *, rows: Sequence[dict], metadata: dict, summary: dict | None = None,
               runs: Sequence[dict] | None = None) -> Path:
    """Write ``{"metadata", "rows", "summary"}`` (and ``"runs"`` when given: the per-seed rows
    of a reproduction) as indented JSON (atomically)."""
    path = Path(path)
    document = {"metadata": metadata, "rows": list(rows), "summary": summary or {}}
    if runs is not None:
        document["runs"] = list(runs)
    write_text_atomic(path, json.dumps(document, indent=2) + "\n")
    return path


def write_markdown(path: Path, text: str) -> Path:
    """Write a Markdown page (atomically)."""
    path = Path(path)
    write_text_atomic(path, text)
    return path


def markdown_table_lines(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a GitHub table: ``header``, the ``---`` rule, one line per row of cells."""
    return (["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
            + ["| " + " | ".join(cells) + " |" for cells in rows])


# --- readers ----------------------------------------------------------------------------

RESULTS_NAME = "results.json"


def read_results(out_dir: str | Path, name: str = RESULTS_NAME) -> dict:
    """The contents of ``out_dir/results.json`` (or ``out_dir/name``): ``{"metadata", "rows",
    "summary"}`` (and whatever else the writer added). A ValueError naming the file when it is
    missing, is not JSON, or lacks ``metadata`` (with its ``command``) or ``rows``."""
    path = Path(out_dir) / name
    if not path.is_file():
        raise ValueError(f"{path}: no such file (expected the {RESULTS_NAME} a `linattn bench` or "
                         "`linattn repro` command wrote into its --out directory)")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(results, dict) or not isinstance(results.get("metadata"), dict) or "rows" not in results \
            or not isinstance(results["metadata"].get("command"), str):
        raise ValueError(f"{path}: expected an object with \"metadata\" (holding \"command\") and \"rows\"")
    results.setdefault("summary", {})
    return results


def read_results_of(out_dir: str | Path, group: str, names: Sequence[str]) -> tuple[dict, str]:
    """:func:`read_results` of ``out_dir`` and ``NAME``, where its ``metadata.command`` is
    ``linattn GROUP NAME ...`` (a ValueError naming the file when NAME is not one of ``names``)."""
    results = read_results(out_dir)
    path, command = Path(out_dir) / RESULTS_NAME, results["metadata"]["command"]
    try:
        words = shlex.split(command)
    except ValueError:
        words = []
    if len(words) < 3 or words[:2] != ["linattn", group] or words[2] not in names:
        raise ValueError(f"{path}: metadata.command {command!r} is not a `linattn {group} NAME ...` command with "
                         f"NAME one of {', '.join(names)}")
    return results, words[2]


def results_page(out_dir: str | Path, group: str, pages: dict[str, Callable[[dict], str]]) -> str:
    """The Markdown page of ``out_dir/results.json`` made from that file alone: ``pages[NAME]``
    of its contents (:func:`read_results_of`). A ValueError naming the file when it lacks a
    field the page reads (written by an older version of the command)."""
    results, name = read_results_of(out_dir, group, list(pages))
    try:
        return pages[name](results)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{Path(out_dir) / RESULTS_NAME}: `linattn {group} {name}`'s report cannot be made from this "
                         f"file ({type(error).__name__}: {error}); it was written by an older version of the "
                         "command: run it again") from None


def pyplot():
    """``matplotlib.pyplot`` with the non-interactive Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: Path, *, dpi: int = 120) -> Path:
    """Lay out ``figure``, save it to ``path`` (PNG by its name) and close it."""
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)
    return Path(path)


# --- peak memory ------------------------------------------------------------------------

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    """A ``kB`` field (``VmRSS``, ``VmHWM``) of /proc/self/status, in KiB."""
    for line in _PROC_STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"{field} not in {_PROC_STATUS}")


def _cpu_peak_memory(fn: Callable[[], object]) -> int | None:
    """Peak resident-set growth during ``fn()``: VmHWM after minus VmRSS before.

    Freed heap memory is first handed back to the OS (``malloc_trim``) so it does not
    hide in the baseline, and the high-water mark is reset (``clear_refs`` 5).
    """
    if not (_PROC_STATUS.exists() and _PROC_CLEAR_REFS.exists()):
        return None
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the baseline may include freed-but-kept heap pages
        pass
    try:
        _PROC_CLEAR_REFS.write_text("5")
    except OSError:
        return None
    baseline = _status_kib("VmRSS")
    fn()
    return max(_status_kib("VmHWM") - baseline, 0) * 1024


def _cuda_peak_memory(fn: Callable[[], object], device: torch.device) -> int:
    """Peak allocated CUDA bytes during ``fn()`` above those allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - baseline


def peak_memory(fn: Callable[[], object], device: torch.device | str) -> int | None:
    """Bytes of peak extra memory used while ``fn()`` runs; None where it cannot be measured.

    CPU: process resident set (Linux /proc), so it counts every allocation, torch's or
    not, that is touched. CUDA: ``max_memory_allocated - memory_allocated`` before.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_peak_memory(fn, device)
    if device.type == "cpu":
        return _cpu_peak_memory(fn)
    return None
