"""The zygote of the documentation runner (``tools/doc_snippets.py``): the process that
imports ``linattn.cli`` once and forks per request, the messages between it, the runner and
the ``linattn`` shim, and a page's blocks run in one of its forks (:func:`run_blocks`)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence

from doc_snippets_pages import Block, display, parse_page

ZYGOTE_ENV = "LINATTN_SNIPPETS_ZYGOTE"
_OUTPUT_TAIL_CHARS = 4000


def tail(text: str) -> str:
    """``text``, or its last ``_OUTPUT_TAIL_CHARS`` characters after ``...`` (what a report shows of an output)."""
    return text if len(text) <= _OUTPUT_TAIL_CHARS else "...\n" + text[-_OUTPUT_TAIL_CHARS:]


# ----------------------------------------------------------------------------- the zygote's side

def send(conn: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    """``message`` as length-prefixed JSON over ``conn``, with the file descriptors ``fds``."""
    data = json.dumps(message).encode()
    data = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(conn, [data], list(fds)) if fds else conn.send(data)
    conn.sendall(data[sent:])


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One message of ``send`` (and the descriptors sent with it), reading no byte of the next."""
    header, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if not header:
        raise EOFError
    (size,) = struct.unpack("!I", header + _exactly(conn, 4 - len(header)))
    return json.loads(_exactly(conn, size)), fds


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def shim_main() -> None:
    """``linattn`` on a page's ``PATH``: hand the command to the zygote and exit with its code
    (without a zygote: run ``python -m linattn.cli``)."""
    path = os.environ.get(ZYGOTE_ENV)
    if not path or not os.path.exists(path):
        os.execv(sys.executable, [sys.executable, "-m", "linattn.cli", *sys.argv[1:]])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        send(conn, {"kind": "linattn", "argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)},
              fds=(0, 1, 2))
        try:
            message, _ = receive(conn)
        except EOFError:
            print("linattn: the zygote closed the connection without an exit code", file=sys.stderr)
            sys.exit(1)
    code = message["exit"]
    sys.exit(128 - code if code < 0 else code)


def serve(socket_path: str) -> None:
    """The zygote: import ``linattn.cli``, then fork once per request on ``socket_path`` until
    standard input closes (the runner ended). It reaps each fork and sends its exit code (a
    negative number: killed by that signal)."""
    import linattn.cli  # noqa: F401 - imported once, for every fork

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    partial = socket_path + ".partial"
    listener.bind(partial)
    listener.listen(64)
    os.rename(partial, socket_path)
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.02)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1 << 10):
            break
        if listener in readable:
            conn, _ = listener.accept()
            pid = os.fork()
            if pid == 0:
                listener.close()
                _child(conn)  # never returns
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()


def _child(conn: socket.socket) -> None:
    code = 1
    try:
        request, fds = receive(conn)
        if request["kind"] == "linattn":
            code = _run_linattn(conn, request, fds)
        else:
            code = _run_page_request(conn, request)
    except BaseException:  # noqa: BLE001 - reported on the page's output, then the exit code says it
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _run_linattn(conn: socket.socket, request: dict, fds: list[int]) -> int:
    """``linattn.cli.main(argv)`` in the shim's folder, environment and standard streams; the
    fork kills itself when the shim goes away (its shell timed out or was killed)."""
    import threading

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["linattn", *request["argv"]]

    def watch() -> None:
        with contextlib.suppress(OSError):
            conn.recv(1)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    from linattn.cli import main

    try:
        return main(request["argv"])
    except SystemExit as exit_request:
        return exit_request.code if isinstance(exit_request.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _run_page_request(conn: socket.socket, request: dict) -> int:
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    results = run_blocks(parse_page(request["page"]), request["log"], request["block_timeout"])
    send(conn, {"results": results})
    return 0


class _BlockTimeout(Exception):
    pass


def run_blocks(blocks: list[Block], log: str, block_timeout: float) -> list[dict]:
    """Run the code blocks in this process (a fork for the page; see the module docstring) and
    return one ``BlockResult`` as a dict per code block."""
    namespace: dict = {"__name__": "__main__"}
    results: list[dict] = []
    failed = False

    def on_alarm(signum: int, frame: object) -> None:
        raise _BlockTimeout(f"the block ran over {block_timeout:.0f} s")

    signal.signal(signal.SIGALRM, on_alarm)
    for block in blocks:
        if block.kind == "data":
            continue
        result = {"line": block.line, "language": block.language}
        if failed:
            results.append({**result, "status": "not run"})
            continue
        if block.skip is not None:
            results.append({**result, "status": "skipped", "message": block.skip})
            continue
        start, began = os.path.getsize(log), time.monotonic()
        try:
            message = _run_python(block, namespace, block_timeout) if block.kind == "python" \
                else _run_shell(block, block_timeout)
        except BaseException:  # noqa: BLE001 - the block's failure, reported
            message = _block_traceback(block)
        sys.stdout.flush()
        sys.stderr.flush()
        with open(log, "rb") as f:
            f.seek(start)
            output = tail(f.read().decode(errors="replace"))
        failed = message is not None
        results.append({**result, "status": "failed" if failed else "passed", "message": message or "",
                        "seconds": round(time.monotonic() - began, 2), "output": output})
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    return results


def _run_python(block: Block, namespace: dict, timeout: float) -> str | None:
    code = compile(block.script(), str(block.page), "exec")
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(code, namespace)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return None


def _run_shell(block: Block, timeout: float) -> str | None:
    process = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", block.script()], start_new_session=True)
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return f"{block.where}: the block ran over {timeout:.0f} s"
    return None if code == 0 else f"{block.where}: bash exited with {code}"


def _block_traceback(block: Block) -> str:
    """The traceback without this module's frames (those of ``exec``)."""
    kind, error, tb = sys.exc_info()
    frames = [f for f in traceback.extract_tb(tb) if f.filename != __file__]
    last = "".join(traceback.format_exception_only(kind, error)).strip().splitlines()[-1]
    on_page = [f for f in frames if f.filename == str(block.page)]
    where = f"{display(block.page)}:{on_page[-1].lineno}" if on_page else block.where
    text = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(kind, error))
    return f"{where}: {last} (python block at {block.where})\nTraceback (most recent call last):\n{text}"
