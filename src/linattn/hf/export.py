"""Write a linattn model as a Hugging Face model directory (config, safetensors, tokenizer,
and a small module that lets ``trust_remote_code=True`` load it without ``import linattn.hf``)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from ..data import ByteTokenizer, HFTokenizer
from ..models.lm import LM
from .modeling import LinattnForCausalLM
from .tokenizer import byte_tokenizer

REMOTE_CODE_FILE = "modeling_linattn.py"

# The module an export ships for ``trust_remote_code=True``: no model code of its own, only the
# installed linattn's classes under the names config.json's ``auto_map`` gives. Subclasses, so
# that what transformers records on a remotely loaded class (``_auto_class``, which makes
# ``save_pretrained`` copy this file along) stays on them and never reaches linattn's own.
_REMOTE_CODE = '''"""linattn model classes for `trust_remote_code=True`.

This folder is a linattn language model. This module holds
no model code: it imports the classes of the installed linattn package (`pip install
"linattn[hf]"`). `import linattn.hf` before loading does the same without remote code:

    import linattn.hf
    model = AutoModelForCausalLM.from_pretrained(folder)
"""

from linattn.hf import LinattnConfig as _LinattnConfig
from linattn.hf import LinattnForCausalLM as _LinattnForCausalLM
from linattn.hf import LinattnModel as _LinattnModel


class LinattnConfig(_LinattnConfig):
    """linattn.hf.LinattnConfig."""


class LinattnModel(_LinattnModel):
    """linattn.hf.LinattnModel."""

    config_class = LinattnConfig


class LinattnForCausalLM(_LinattnForCausalLM):
    """linattn.hf.LinattnForCausalLM."""

    config_class = LinattnConfig
'''

_AUTO_MAP = {
    "AutoConfig": "modeling_linattn.LinattnConfig",
    "AutoModel": "modeling_linattn.LinattnModel",
    "AutoModelForCausalLM": "modeling_linattn.LinattnForCausalLM",
}


def save_pretrained_lm(lm: LM, out: str | Path, tokenizer: ByteTokenizer | HFTokenizer | None = None) -> Path:
    """Save ``lm`` (weights, codebooks and every buffer) with its tokenizer as a
    ``save_pretrained`` directory that ``AutoModelForCausalLM.from_pretrained(out)`` (after
    ``import linattn.hf``) and ``pipeline("text-generation", model=out)`` load; with
    ``trust_remote_code=True`` they load it without the import (``config.json``'s
    ``auto_map`` names the shipped ``modeling_linattn.py``, which imports the installed
    linattn's classes). ``config.bos_token_id`` is the newline token (when the tokenizer has
    one): the token documents start after, ``linattn lm-eval``'s default prefix token.

    Args:
        lm: the model to save.
        out: the directory to write.
        tokenizer: None or a ``ByteTokenizer`` writes the byte tokenizer (the model's
            vocabulary must be 256); an ``HFTokenizer`` (a run's ``tokenizer.json``) is written
            as a ``PreTrainedTokenizerFast`` that ``AutoTokenizer`` loads, left padding, and
            must have at most the model's vocabulary size (a model imported from a Hugging
            Face checkpoint may have rows past its tokenizer's, as Qwen2's has).

    Returns:
        ``out`` as a Path.
    """
    if not isinstance(lm, LM):
        raise TypeError(f"lm must be a linattn LM, got {type(lm).__name__}")
    if isinstance(tokenizer, HFTokenizer):
        if tokenizer.vocab_size > lm.config.vocab_size:
            raise ValueError(f"tokenizer: {tokenizer.vocab_size} tokens, more than the model's vocab_size="
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
    model = LinattnForCausalLM.from_lm(lm, **_start_token(hf_tokenizer))
    model.config.auto_map = dict(_AUTO_MAP)
    model.save_pretrained(out)
    (out / REMOTE_CODE_FILE).write_text(_REMOTE_CODE, encoding="utf-8")
    hf_tokenizer.save_pretrained(out)
    return out


def _start_token(tokenizer: PreTrainedTokenizerFast) -> dict:
    """``{"bos_token_id": id}`` of the newline when it is one token of ``tokenizer``, else ``{}``."""
    ids = tokenizer("\n", add_special_tokens=False).input_ids
    return {"bos_token_id": ids[0]} if len(ids) == 1 else {}


def export_run(ckpt: str | Path, out: str | Path, *, device: str = "cpu") -> Path:
    """``linattn export``: the model of a training run with the run's tokenizer -> a Hugging
    Face directory (``save_pretrained_lm``).

    Args:
        ckpt: a run directory (its latest complete checkpoint) or one checkpoint folder.
        out: the directory to write; not a training run's folder.
        device: where the model is loaded and converted.

    Returns:
        ``out`` as a Path.
    """
    from ..train.checkpoint import load_model
    from ..train.run_folder import check_free_output
    from ..train.run_tokenizer import load_run_tokenizer

    check_free_output(out, what="export")
    lm, checkpoint = load_model(ckpt, device)
    return save_pretrained_lm(lm, out, tokenizer=load_run_tokenizer(checkpoint))
