"""``linattn convert --ckpt HF_DIR --to softmax``: a Hugging Face checkpoint as a linattn run.

The model is ``LM.from_hf(HF_DIR)`` (float32): the checkpoint's own computation, every layer
exact softmax attention (``local:W`` for Mistral's sliding window). The run keeps the
checkpoint's tokenizer (``HF_DIR/tokenizer.json``) and trains on ``--data``, a shard folder
tokenized with it (``linattn data prepare --tokenizer HF_DIR/tokenizer.json``): the shards'
``tokenizer.json`` must be that tokenizer (same SHA-256 of its serialized form). The run's
training settings are ``TrainConfig``'s defaults with ``train.data`` the shards, changed by
``--set train.KEY=VALUE`` (a pretrained model wants a smaller ``train.lr`` than the default).

The run folder is like any other (``convert.write_run``): one checkpoint at step 0, with a
fresh optimizer state, the data's fingerprint and the tokenizer record, so ``linattn eval``,
``generate``, ``train --resume`` (fine-tuning, from step 0) and ``export`` work on it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .data import HFTokenizer, Shards, data_fingerprint, open_shards
from .models import LM
from .train.config import TrainConfig, parse_override
from .train.run_tokenizer import TOKENIZER_FILE, check_same_tokenizer


@dataclass
class ImportedRun:
    """What ``convert.write_run`` writes for an import: the model, its data (whose tokenizer
    file the run copies), the training settings and the checkpoint's ``meta``."""

    model: LM
    data: Shards
    train_config: dict[str, Any]
    meta: dict[str, Any]


def import_hf_run(hf_dir: str | Path, out: str | Path, *, data: str | None, overrides: list[str] = (),
                  command: str = "", target: str = "softmax") -> ImportedRun:
    """Everything of the run ``out`` that imports ``hf_dir`` (module docstring); nothing is written.
    ``target``: the ``--to`` the import is for (named when ``--data`` is missing)."""
    folder = Path(hf_dir)
    model = LM.from_hf(folder)
    tokenizer_path = folder / TOKENIZER_FILE
    tokenizer = HFTokenizer.from_file(tokenizer_path)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"{tokenizer_path} has {tokenizer.vocab_size} tokens, more than the model's vocab_size="
                         f"{model.config.vocab_size} (config.json)")
    shards = _training_data(data, folder, target)
    record = {"kind": "file", "vocab_size": tokenizer.vocab_size,
              "sha256": hashlib.sha256(tokenizer.to_json().encode("utf-8")).hexdigest()}
    check_same_tokenizer(record, shards, what=f"--data {data}")
    train_config = _train_config(shards, out, overrides)
    meta = {
        "model_config": model.config.to_dict(), "train_config": train_config, "world_size": 1,
        "data": {"window": 0, "pass": 0, "streams": train_config["batch_size"]},
        "data_fingerprint": data_fingerprint(shards), "tokens_seen": 0, "tokenizer": shards.tokenizer_record(),
        "linattn_version": __version__, "torch_version": torch.__version__, "command": command,
        "imported_from": {"folder": str(folder.resolve()), "architecture": model.config.extra["imported_from"]},
    }
    return ImportedRun(model=model, data=shards, train_config=train_config, meta=meta)


def _training_data(spec: str | None, folder: Path, target: str) -> Shards:
    """The shard folder ``--data`` names; without one, or with a corpus, a ValueError that says
    how to prepare it with the checkpoint's tokenizer."""
    prepare = (f"prepare one with the checkpoint's tokenizer: linattn data prepare --data CORPUS --tokenizer "
               f"{folder / TOKENIZER_FILE} --out SHARDS")
    if spec is None:
        raise ValueError(f"--to {target} needs --data SHARDS, the run's training data tokenized with the checkpoint's "
                         f"tokenizer (eval and train --resume read it); {prepare}")
    shards = open_shards(spec)
    if shards is None:
        raise ValueError(f"--data {spec} is not a shard folder; {prepare}")
    return shards


def _train_config(shards: Shards, out: str | Path, overrides: list[str]) -> dict[str, Any]:
    """``TrainConfig``'s defaults on ``shards`` into ``out``, with the ``--set train.KEY=VALUE`` overrides."""
    values: dict[str, Any] = {"data": str(shards.folder.resolve()), "out": str(out)}
    for text in overrides:
        table, key, value = parse_override(text)
        if table != "train":
            raise ValueError(f"--set {text}: the model is the checkpoint's; only train.KEY=VALUE settings can be set")
        if key in ("data", "out"):
            raise ValueError(f"--set {text}: train.{key} is given by --{key}")
        values[key] = value
    return TrainConfig.from_dict(values).to_dict()
