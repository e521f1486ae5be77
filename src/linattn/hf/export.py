"""Write a linattn model as a Hugging Face model directory (config, safetensors, tokenizer)."""

from __future__ import annotations

from pathlib import Path

from ..models.lm import LM
from .modeling import LinattnForCausalLM
from .tokenizer import byte_tokenizer


def save_pretrained_lm(lm: LM, out: str | Path) -> Path:
    """Save ``lm`` (weights, codebooks and every buffer) with its byte tokenizer as a
    ``save_pretrained`` directory that ``AutoModelForCausalLM.from_pretrained(out)`` (after
    ``import linattn.hf``) and ``pipeline("text-generation", model=out)`` load."""
    if not isinstance(lm, LM):
        raise TypeError(f"lm must be a linattn LM, got {type(lm).__name__}")
    if lm.config.vocab_size != 256:
        raise ValueError(f"only byte-vocabulary models (vocab_size=256) have a tokenizer to export; this model has "
                         f"vocab_size={lm.config.vocab_size}")
    out = Path(out)
    model = LinattnForCausalLM.from_lm(lm)
    model.save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out


def export_run(ckpt: str | Path, out: str | Path) -> Path:
    """``linattn export``: the model of a training run (a run directory or one checkpoint
    folder, its latest complete checkpoint) -> a Hugging Face directory at ``out``."""
    from ..train.checkpoint import load_model

    lm, _ = load_model(ckpt)
    return save_pretrained_lm(lm, out)
