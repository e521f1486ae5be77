"""Write a linattn model as a Hugging Face model directory (config, safetensors, tokenizer,
and a small module that lets ``trust_remote_code=True`` load it without ``import linattn.hf``)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from .._files import write_text_atomic
from ..data import ByteTokenizer, HFTokenizer
from ..models.lm import LM
from .modeling import LinattnForCausalLM
from .remote_code import MODEL_AUTO_MAP, TOKENIZER_AUTO_MAP
from .tokenizer import LinattnTokenizer, byte_tokenizer, newline_token_id


def save_pretrained_lm(lm: LM, out: str | Path,
                       tokenizer: ByteTokenizer | HFTokenizer | PreTrainedTokenizerBase | None = None) -> Path:
    """Save ``lm`` (weights, codebooks and every buffer) with its tokenizer as a
    ``save_pretrained`` directory that ``AutoModelForCausalLM.from_pretrained(out)`` (after
    ``import linattn.hf``) and ``pipeline("text-generation", model=out)`` load; with
    ``trust_remote_code=True`` they load it without the import (``config.json``'s
    ``auto_map`` names the shipped ``modeling_linattn.py``, which imports the installed
    linattn's classes, or names the version to install where linattn is missing).

    Args:
        lm: the model to save.
        out: the directory to write.
        tokenizer: None or a ``ByteTokenizer`` writes the byte tokenizer (the model's
            vocabulary must be 256); an ``HFTokenizer`` (a run's ``tokenizer.json``) is written
            as a ``LinattnTokenizer``, left padding; a transformers tokenizer (e.g. the one a
            converted checkpoint came with) is written as it is. It must have at most the
            model's vocabulary size (a model imported from a Hugging Face checkpoint may have
            rows past its tokenizer's, as Qwen2's has). ``tokenizer_config.json`` names the
            standard ``TokenizersBackend`` class, which any transformers loads without linattn,
            and ``LinattnTokenizer`` for ``trust_remote_code=True`` (its ``auto_map``).
            ``config.json`` gets the tokenizer's token ids: ``bos_token_id`` its BOS or, without
            one, the newline token (``LinattnTokenizer.bos_token_id``: the token documents start
            after, ``lm_eval``'s prefix token) and ``eos_token_id`` where it has them.

    Returns:
        ``out`` as a Path.
    """
    if not isinstance(lm, LM):
        raise TypeError(f"lm must be a linattn LM, got {type(lm).__name__}")
    hf_tokenizer = _hf_tokenizer(tokenizer, lm.config.vocab_size)
    out = Path(out)
    model = LinattnForCausalLM.from_lm(lm, **_token_ids(hf_tokenizer))
    model.config.auto_map = dict(MODEL_AUTO_MAP)
    model.save_pretrained(out)  # with modeling_linattn.py, which the auto_map names
    hf_tokenizer.save_pretrained(out)
    _name_standard_tokenizer_class(out / "tokenizer_config.json")
    return out


def _hf_tokenizer(tokenizer, vocab_size: int) -> PreTrainedTokenizerBase:
    """The transformers tokenizer an export writes for ``tokenizer`` (see ``save_pretrained_lm``)."""
    if isinstance(tokenizer, (HFTokenizer, PreTrainedTokenizerBase)):
        size = tokenizer.vocab_size if isinstance(tokenizer, HFTokenizer) else len(tokenizer)
        if size > vocab_size:
            raise ValueError(f"tokenizer: {size} tokens, more than the model's vocab_size={vocab_size}")
        if isinstance(tokenizer, PreTrainedTokenizerBase):
            return tokenizer
        return LinattnTokenizer(tokenizer_object=tokenizer.core, padding_side="left")
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        if vocab_size != 256:
            raise ValueError(f"only byte-vocabulary models (vocab_size=256) can be exported with the byte "
                             f"tokenizer; this model has vocab_size={vocab_size}: pass its tokenizer")
        return byte_tokenizer()
    raise TypeError(f"tokenizer must be a ByteTokenizer, an HFTokenizer, a transformers tokenizer or None, got "
                    f"{type(tokenizer).__name__}")


def _token_ids(tokenizer: PreTrainedTokenizerBase) -> dict:
    """The config's ``bos_token_id`` and ``eos_token_id`` the tokenizer has (``bos``: its BOS, else the
    newline when it is one token, see ``LinattnTokenizer``). No pad id: ``generate`` would read that
    token in a prompt as padding; pass ``attention_mask``."""
    bos = tokenizer.bos_token_id
    if bos is None and tokenizer.is_fast:
        bos = newline_token_id(tokenizer)
    ids = {"bos_token_id": bos, "eos_token_id": tokenizer.eos_token_id}
    return {name: value for name, value in ids.items() if value is not None}


def _name_standard_tokenizer_class(path: Path) -> None:
    """Make ``tokenizer_config.json`` name ``TokenizersBackend`` as its class (loaded by any
    transformers from ``tokenizer.json``, no linattn, no remote code) and ``LinattnTokenizer`` for
    ``trust_remote_code=True``, whatever class wrote it."""
    settings = json.loads(path.read_text(encoding="utf-8"))
    settings.update(tokenizer_class="TokenizersBackend", auto_map=TOKENIZER_AUTO_MAP)
    write_text_atomic(path, json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


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
