"""Reproductions keep freed memory for reuse (glibc malloc settings), with identical results."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import linattn.repro.cli
from linattn._malloc import malloc_settings
from linattn.cli import main

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings are Linux-only")

_FREE_64_MIB = textwrap.dedent("""
    import os, sys, torch
    from linattn._malloc import retain_freed_memory
    if sys.argv[1] == "retain":
        retain_freed_memory()
    page = os.sysconf("SC_PAGE_SIZE")
    def resident():
        return int(open("/proc/self/statm").read().split()[1]) * page
    block = torch.ones(64 * 2**20 // 4)
    held = resident()
    del block
    print(held - resident())
""")


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(extra)
    return env


def _released_bytes(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _FREE_64_MIB, mode], env=_clean_env(), capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


@glibc_only
def test_retained_memory_is_not_handed_back_on_free():
    assert _released_bytes("system") > 48 * 2**20  # glibc's default: a large block is munmap'd when freed
    assert _released_bytes("retain") < 8 * 2**20  # kept in the heap for the next step's tensors


@glibc_only
def test_settings_reach_child_processes_and_user_values_win():
    script = textwrap.dedent("""
        import json, os
        from linattn._malloc import retain_freed_memory
        settings = retain_freed_memory()
        print(json.dumps({"settings": settings,
                          "env": {k: os.environ[k] for k in os.environ if k.startswith("MALLOC_")}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], env=_clean_env(MALLOC_TOP_PAD_="131072"),
                          capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    assert result["env"]["MALLOC_MMAP_MAX_"] == "0"  # inherited by spawned workers
    assert result["env"]["MALLOC_TOP_PAD_"] == "131072"  # the user's own value is kept
    assert result["settings"]["MALLOC_MMAP_MAX_"] == "0 (linattn)"
    assert result["settings"]["MALLOC_TOP_PAD_"] == "131072"


def test_malloc_settings_lists_only_the_environment_when_nothing_was_applied(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX_", "2")
    monkeypatch.setenv("MALLOCX", "not a malloc setting")
    settings = malloc_settings()
    assert settings["MALLOC_ARENA_MAX_"] == "2" and "MALLOCX" not in settings


@pytest.mark.parametrize("extra, retained", [([], [True]), (["--system-malloc"], [])])
def test_every_repro_command_keeps_freed_memory_unless_told_not_to(monkeypatch, retained_memory_calls, extra,
                                                                    retained):
    for name, command in linattn.repro.cli.REPRODUCTIONS.items():
        ran = []
        monkeypatch.setattr(command, "run", lambda args: ran.append(args) or 0)
        retained_memory_calls.clear()
        assert main(["repro", name, *extra]) == 0, name
        assert len(ran) == 1 and retained_memory_calls == retained, name


@glibc_only
def test_retained_memory_gives_bit_identical_runs(tmp_path):
    """The same grid with and without the settings: the same evaluation curves, bit for bit."""
    curves = {}
    for mode, extra in (("retain", []), ("system", ["--system-malloc"])):
        out = tmp_path / mode
        subprocess.run([sys.executable, "-m", "linattn.cli", "repro", "fwp-capacity", "--sizes", "40",
                        "--mechanisms", "favor-64", "--max-steps", "60", "--eval-every", "20",
                        "--threads", "1", "--no-progress", "--out", str(out), *extra],
                       env=_clean_env(), capture_output=True, text=True, check=True)
        document = json.loads((out / "results.json").read_text())
        curves[mode] = [row["curve"] for row in document["runs"]]
        assert ("MALLOC_MMAP_MAX_" in document["metadata"]["malloc"]) == (mode == "retain")
    assert curves["retain"] == curves["system"] and len(curves["retain"][0]) == 3
