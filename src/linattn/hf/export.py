"""Write a linattn model as a Hugging Face model directory (config, safetensors, tokenizer)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from ..data import ByteTokenizer, HFTokenizer
from ..models.lm import LM
from .modeling import LinattnForCausalLM
from .tokenizer import byte_tokenizer


def save_pretrained_lm(lm: LM, out: str | Path, tokenizer: ByteTokenizer | HFTokenizer | None = None) -> Path:
    """Save ``lm`` (weights, codebooks and every buffer) with its tokenizer as a
    ``save_pretrained`` directory that ``AutoModelForCausalLM.from_pretrained(out)`` (after
    ``import linattn.hf``) and ``pipeline("text-generation", model=out)`` load.

    ``tokenizer``: None or a ``ByteTokenizer`` writes the byte tokenizer (the model's
    vocabulary must be 256); an ``HFTokenizer`` (a run's ``tokenizer.json``) is written as a
    ``PreTrainedTokenizerFast`` that ``AutoTokenizer`` loads, left padding, and must have
    the model's vocabulary size.
    """
    if not isinstance(lm, LM):
        raise TypeError(f"lm must be a linattn LM, got {type(lm).__name__}")
    if isinstance(tokenizer, HFTokenizer):
        if tokenizer.vocab_size != lm.config.vocab_size:
            raise ValueError(f"tokenizer: {tokenizer.vocab_size} tokens, but the model has vocab_size="
                             f"{lm.config.vocab_size}")
        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.core, padding_side="left")
    elif tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        if lm.config.vocab_size != 256:
            raise ValueError(f"only byte-vocabulary models (vocab_size=256) can be exported with the byte "
                             f"tokenizer; this model has vocab_size={lm.config.vocab_size}: pass its tokenizer")
        hf_tokenizer = byte_tokenizer()
    else:
        raise TypeError(f"tokenizer must be a ByteTokenizer, an HFTokenizer or None, got {type(tokenizer).__name__}")
    out = Path(out)
    model = LinattnForCausalLM.from_lm(lm)
    model.save_pretrained(out)
    hf_tokenizer.save_pretrained(out)
    return out


def export_run(ckpt: str | Path, out: str | Path) -> Path:
    """``linattn export``: the model of a training run (a run directory or one checkpoint
    folder, its latest complete checkpoint) with the run's tokenizer -> a Hugging Face
    directory at ``out``."""
    from ..train.checkpoint import load_model
    from ..train.run_folder import RunFolderError, check_not_in_use, run_files
    from ..train.run_tokenizer import load_run_tokenizer

    present = run_files(out)
    if present:
        raise RunFolderError(f"--out {out} is a training run's folder ({', '.join(present)}); export into a "
                             f"folder of its own")
    check_not_in_use(out, what="export")
    lm, checkpoint = load_model(ckpt)
    return save_pretrained_lm(lm, out, tokenizer=load_run_tokenizer(checkpoint))
