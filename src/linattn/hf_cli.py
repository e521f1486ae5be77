"""``linattn export`` (a training run -> a Hugging Face model directory) and ``linattn lm-eval``
(lm-evaluation-harness with linattn models registered). ``transformers`` is imported only
when one of them runs."""

from __future__ import annotations

import argparse
import sys


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``export`` and ``lm-eval`` to the top-level subcommands."""
    p = commands.add_parser(
        "export", help="write a training run as a Hugging Face model directory",
        description="Write the model of a training run (its latest complete checkpoint, or the checkpoint folder "
                    "named) as a save_pretrained directory: config.json, model.safetensors (weights, codebooks and "
                    "every buffer) and the run's tokenizer (the byte tokenizer, or the run's tokenizer.json as a "
                    "PreTrainedTokenizerFast). Load it with `import linattn.hf` and "
                    "AutoModelForCausalLM.from_pretrained(DIR).")
    p.add_argument("--ckpt", required=True, metavar="RUN_DIR", help="run directory or checkpoint folder")
    p.add_argument("--out", required=True, metavar="HF_DIR", help="output directory")
    p.set_defaults(handler=run_export)
    p = commands.add_parser(
        "lm-eval", help="run lm-evaluation-harness with linattn models registered",
        description="lm_eval's own command line, after `import linattn.hf` (so `--model hf --model_args "
                    "pretrained=HF_DIR` loads an exported linattn model). Everything after `lm-eval` goes to lm_eval, "
                    "e.g. linattn lm-eval run --model hf --model_args pretrained=HF_DIR --tasks TASK "
                    "--include_path TASK_DIR --device cpu.")
    p.add_argument("harness_args", nargs=argparse.REMAINDER, metavar="ARGS", help="lm_eval arguments")
    p.set_defaults(handler=run_lm_eval)


def run_export(args: argparse.Namespace) -> int:
    from .hf.export import export_run

    out = export_run(args.ckpt, args.out)
    print(f"wrote {out} (load: import linattn.hf; AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def run_lm_eval(args: argparse.Namespace) -> int:
    import linattn.hf  # noqa: F401 - registers the linattn Auto classes
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm_eval", *args.harness_args]
    try:
        cli_evaluate()
    except SystemExit as exit_request:
        return int(exit_request.code or 0)
    finally:
        sys.argv = saved
    return 0
