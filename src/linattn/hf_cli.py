"""``linattn export`` (a training run -> a Hugging Face model directory) and ``linattn lm-eval``
(lm-evaluation-harness with linattn models registered). ``transformers`` is imported only
when one of them runs."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from .train.cli import add_runtime_flags, apply_threads


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``export`` and ``lm-eval`` to the top-level subcommands."""
    p = commands.add_parser(
        "export", help="write a training run as a Hugging Face model directory",
        description="Write the model of a training run (its latest complete checkpoint, or the checkpoint folder "
                    "named) as a save_pretrained directory: config.json, model.safetensors (weights, codebooks and "
                    "every buffer), the run's tokenizer (the byte tokenizer, or the run's tokenizer.json as a "
                    "PreTrainedTokenizerFast) and modeling_linattn.py. Load it with `import linattn.hf` and "
                    "AutoModelForCausalLM.from_pretrained(DIR), or without the import with "
                    "from_pretrained(DIR, trust_remote_code=True) (modeling_linattn.py imports the installed "
                    "linattn's classes).")
    p.add_argument("--ckpt", required=True, metavar="RUN_DIR", help="run directory or checkpoint folder")
    p.add_argument("--out", required=True, metavar="HF_DIR", help="output directory")
    add_runtime_flags(p, progress=False)
    p.set_defaults(handler=run_export)
    p = commands.add_parser(
        "lm-eval", help="run lm-evaluation-harness with linattn models registered",
        description="lm_eval's own command line, after `import linattn.hf` (so `--model hf --model_args "
                    "pretrained=HF_DIR` loads an exported linattn model as a causal LM). A linattn model's prefix "
                    "token (what lm_eval conditions an empty context on) defaults to its config's bos_token_id, the "
                    "newline in an export; prefix_token_id=ID in --model_args overrides it. Everything after "
                    "`lm-eval` and its own --threads and --device goes to lm_eval, e.g. linattn lm-eval --device cpu "
                    "run --model hf --model_args pretrained=HF_DIR --tasks TASK --include_path TASK_DIR; --device "
                    "is handed to lm_eval (give it there or here, not both).")
    add_runtime_flags(p, device=None, progress=False)
    p.add_argument("harness_args", nargs=argparse.REMAINDER, metavar="ARGS", help="lm_eval arguments")
    p.set_defaults(handler=run_lm_eval)


def run_export(args: argparse.Namespace) -> int:
    from .hf.export import export_run

    apply_threads(args)
    out = export_run(args.ckpt, args.out, device=args.device)
    print(f"wrote {out} (load: import linattn.hf; AutoModelForCausalLM.from_pretrained({str(out)!r}), or "
          f"without the import with trust_remote_code=True)")
    return 0


def run_lm_eval(args: argparse.Namespace) -> int:
    harness_args = list(args.harness_args)
    if args.device is not None:
        if any(arg == "--device" or arg.startswith("--device=") for arg in harness_args):
            raise ValueError(f"--device {args.device} and lm_eval's own --device both name the device; give it once")
        harness_args += ["--device", args.device]
    apply_threads(args)
    import linattn.hf  # noqa: F401 - registers the linattn Auto classes
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm_eval", *harness_args]
    try:
        with _linattn_in_lm_eval():
            cli_evaluate()
    except SystemExit as exit_request:
        return int(exit_request.code or 0)
    finally:
        sys.argv = saved
    return 0


@contextlib.contextmanager
def _linattn_in_lm_eval() -> Iterator[None]:
    """lm_eval's Hugging Face model (``HFLM``) told about linattn models, for this command only:

    - ``model_type="linattn"`` is a causal LM (lm_eval reads transformers' static list of
      causal model types, which a registered model is not in, and warns "neither CausalLM nor
      Seq2SeqLM" before assuming causal);
    - the prefix token of a linattn model whose tokenizer has no BOS/EOS (the byte tokenizer)
      is ``config.bos_token_id`` (an export's newline token) unless ``prefix_token_id`` is
      given; with neither, a ValueError names ``prefix_token_id`` (lm_eval fails later with
      "'None' is not an instance of 'Sequence'").
    """
    from lm_eval.models import huggingface

    causal_names = huggingface.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    harness_prefix = huggingface.HFLM.prefix_token_id

    def prefix_token_id(self) -> int:
        config = getattr(self, "_config", None)
        if self.custom_prefix_token_id is not None or getattr(config, "model_type", None) != "linattn" \
                or self.tokenizer.bos_token_id is not None or self.tokenizer.eos_token_id is not None:
            return harness_prefix.fget(self)
        if config.bos_token_id is None:
            raise ValueError("this linattn model's tokenizer has no BOS or EOS token and its config no "
                             "bos_token_id: name the prefix token in --model_args, e.g. prefix_token_id=10 (the "
                             "newline byte)")
        return config.bos_token_id

    huggingface.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = {**causal_names, "linattn": "LinattnForCausalLM"}
    huggingface.HFLM.prefix_token_id = property(prefix_token_id)
    try:
        yield
    finally:
        huggingface.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = causal_names
        huggingface.HFLM.prefix_token_id = harness_prefix
