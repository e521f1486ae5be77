"""The commands of docs/guide/scale.md's "Several machines" section, run as two local "nodes":
two ``torchrun --nnodes 2`` on 127.0.0.1 (gloo, one process each, a tiny model), each in its
own folder, with ``/shared`` standing for a folder both see. The new run trains on both and
rank 0 writes a 2-process checkpoint; the resume, with node 1's ``/shared`` another folder
(its storage not shared), stops both nodes: node 1 naming the path it cannot see, node 0
naming rank 1 and its error, instead of waiting for it.

The commands are read from the page (the block whose skip directive names this file), so
the documented flags are the ones that run; only the address, the process count, the model
and the paths are replaced."""

from __future__ import annotations

import importlib
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from linattn.train import load_checkpoint
from _helpers import communicate_all, english_like, free_port, torchrun_env
from test_train_parallel import TINY_RUN

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guide" / "scale.md"
HOST = socket.gethostname()


def _documented_commands() -> list[str]:
    """The ``torchrun`` commands of the block whose skip directive names this file, each on one line."""
    tools = str(ROOT / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    pages = importlib.import_module("doc_snippets_pages")
    [block] = [b for b in pages.parse_page(PAGE) if b.skip and "tests/test_multinode.py" in b.skip]
    lines = block.code.replace("\\\n", " ").splitlines()
    return [" ".join(line.split()) for line in lines if line.startswith("torchrun")]


def _local(command: str, port: int, shared: Path) -> list[str]:
    """A documented command for this machine: node 0 at 127.0.0.1:``port``, one CPU process per
    node, the tiny model of the parallel tests, ``shared`` for ``/shared`` (the data: its
    ``corpus.txt``)."""
    text = (command.replace("node0:29500", f"127.0.0.1:{port}").replace("--nproc-per-node 8", "--nproc-per-node 1")
            .replace("--config run.toml --device cuda", shlex.join(["--steps", "2", "--eval-every", "0",
                                                                    "--no-progress", *TINY_RUN]))
            .replace("/shared/data/shards", "/shared/corpus.txt").replace("/shared", str(shared))
            .replace("$(which linattn)", "-m linattn.cli"))
    words = shlex.split(text)
    assert words[0] == "torchrun" and "$" not in text, text
    return [sys.executable, "-m", "torch.distributed.run", *words[1:]]


def _run_nodes(commands: list[list[str]], folders: list[Path]) -> list[subprocess.CompletedProcess]:
    return communicate_all([subprocess.Popen(command, cwd=folder, env=torchrun_env(), text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                            for command, folder in zip(commands, folders)], timeout=150)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multinode")
    for name in ("shared", "elsewhere", "node0", "node1"):
        (root / name).mkdir()
    (root / "shared" / "corpus.txt").write_text(english_like(3000, seed=4))
    return root


def test_the_page_documents_a_new_run_and_its_resume_on_two_nodes():
    commands = _documented_commands()
    assert len(commands) == 4
    assert [("--node-rank 0" in c, "--resume" in c) for c in commands] == [(True, False), (False, False),
                                                                         (True, True), (False, True)]


def test_the_documented_commands_train_on_two_nodes_and_a_node_without_the_run_folder_stops_both(nodes):
    new0, new1, resume0, resume1 = _documented_commands()
    port = free_port()
    node0, node1 = _run_nodes([_local(new0, port, nodes / "shared"), _local(new1, port, nodes / "shared")],
                              [nodes / "node0", nodes / "node1"])
    assert (node0.returncode, node1.returncode) == (0, 0), node0.stderr[-3000:] + node1.stderr[-3000:]
    checkpoint = load_checkpoint(nodes / "shared" / "runs" / "big")
    assert checkpoint.step == 2 and checkpoint.meta["world_size"] == 2 and len(checkpoint.meta["carry"]) == 2

    port = free_port()
    node0, node1 = _run_nodes([_local(resume0, port, nodes / "shared"), _local(resume1, port, nodes / "elsewhere")],
                              [nodes / "node0", nodes / "node1"])
    assert node0.returncode != 0 and node1.returncode != 0
    problem = (f"--resume: the run folder {nodes / 'elsewhere' / 'runs' / 'big'} does not exist on {HOST}: every "
               f"process reads the checkpoint, so --out must be on storage that every node mounts at the same path")
    assert f"linattn: error: rank 1: {problem}\n" in node1.stderr
    assert f"linattn: error: rank 1 of 2 (on {HOST}) stopped before training: {problem}\n" in node0.stderr
    assert load_checkpoint(nodes / "shared" / "runs" / "big").step == 2
