"""The module a saved linattn model ships for ``trust_remote_code=True`` (``modeling_linattn.py``)
and the ``auto_map`` entries of ``config.json`` and ``tokenizer_config.json`` that name its classes.

The module holds no model code: it subclasses the installed linattn's classes under the names the
``auto_map`` gives (subclasses, so that what transformers records on a remotely loaded class,
``_auto_class``, stays on them and never reaches linattn's own). On a machine without the linattn
package it stops with an ImportError that names the exact package to install: the version that
wrote the folder.
"""

from __future__ import annotations

import re
from pathlib import Path

from .. import __version__
from .._files import write_text_atomic

REMOTE_CODE_FILE = "modeling_linattn.py"
_MODULE = REMOTE_CODE_FILE.removesuffix(".py")

MODEL_AUTO_MAP = {
    "AutoConfig": f"{_MODULE}.LinattnConfig",
    "AutoModel": f"{_MODULE}.LinattnModel",
    "AutoModelForCausalLM": f"{_MODULE}.LinattnForCausalLM",
}
TOKENIZER_AUTO_MAP = {"AutoTokenizer": [None, f"{_MODULE}.LinattnTokenizer"]}

_SOURCE = '''"""linattn model classes for `trust_remote_code=True` (written by linattn {version}).

This folder is a linattn language model. This module holds no model code: it imports the
classes of the installed linattn package (`pip install linattn=={version}`).
`import linattn.hf` before loading does the same without remote code:

    import linattn.hf
    model = AutoModelForCausalLM.from_pretrained(folder)
"""

try:  # inside try: transformers' own check would only say `pip install linattn`
    from linattn.hf import LinattnConfig as _LinattnConfig
    from linattn.hf import LinattnForCausalLM as _LinattnForCausalLM
    from linattn.hf import LinattnModel as _LinattnModel
    from linattn.hf import LinattnTokenizer as _LinattnTokenizer
except ModuleNotFoundError as error:
    if error.name != "linattn":
        raise
    raise ImportError("this folder is a linattn model, written by linattn {version}: its classes come from the "
                      "linattn package, which is not installed here. Install it with: "
                      "pip install linattn=={version}") from None


class LinattnConfig(_LinattnConfig):
    """linattn.hf.LinattnConfig."""


class LinattnModel(_LinattnModel):
    """linattn.hf.LinattnModel."""

    config_class = LinattnConfig


class LinattnForCausalLM(_LinattnForCausalLM):
    """linattn.hf.LinattnForCausalLM."""

    config_class = LinattnConfig


class LinattnTokenizer(_LinattnTokenizer):
    """linattn.hf.LinattnTokenizer."""
'''


def remote_code() -> str:
    """The text of ``modeling_linattn.py`` for this linattn version."""
    return _SOURCE.format(version=__version__)


def write_remote_code(folder: str | Path) -> Path:
    """Write ``modeling_linattn.py`` into ``folder``; returns its path."""
    path = Path(folder) / REMOTE_CODE_FILE
    write_text_atomic(path, remote_code())
    return path


def auto_map_modules(auto_map: dict | None) -> set[str]:
    """The module names (``modeling_linattn`` for ``"modeling_linattn.LinattnConfig"``, also with a
    ``"repo--"`` prefix) that an ``auto_map`` refers to."""
    references: list[str] = []
    for value in (auto_map or {}).values():
        references += [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)]
    return {re.sub(r"^.*--", "", reference).rpartition(".")[0] for reference in references}
