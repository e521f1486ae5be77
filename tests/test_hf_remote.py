"""A linattn export outside the process that wrote it: saved again after loading (the modeling file
its ``auto_map`` names goes with it), loaded with ``trust_remote_code=True`` on a machine without
linattn (an error naming the version to install), its tokenizer (a standard class, and linattn's
for remote code, whose ``bos_token_id`` is the start token), plain ``lm_eval`` without
``prefix_token_id``, and a tokenizer's EOS in the exported config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import linattn
import linattn.hf as H
from linattn.hf.tokenizer import _byte_core
from test_hf import random_ids, tiny_lm
from _helpers import lm_eval_perplexity, lm_eval_task

torch.set_num_threads(1)

SRC = str(Path(__file__).resolve().parents[1] / "src")

# Run first in a fresh process that must not find linattn: every sys.path entry holding a linattn
# package goes (this tree's src/, an editable install's), as on a machine where it is not installed.
_WITHOUT_LINATTN = """
import os, sys
sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or os.getcwd(), "linattn"))]
import importlib.util
assert importlib.util.find_spec("linattn") is None
"""


def fresh_python(script: str, *args: str, cwd: Path, linattn_installed: bool = True, **env: str) -> str:
    """Run ``script`` in a new Python (with this tree's linattn, or none at all), stdin closed so that
    transformers' remote-code prompt gets no answer; its last line of output."""
    code = script if linattn_installed else _WITHOUT_LINATTN + script
    environment = {**os.environ, "PYTHONPATH": SRC if linattn_installed else "", "OMP_NUM_THREADS": "1",
                   "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(cwd / "modules"), **env}
    done = subprocess.run([sys.executable, "-c", code, *args], env=environment, cwd=cwd, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A saved model of a VQ GAU pair and a Gated DeltaNet, with the byte tokenizer."""
    lm = tiny_lm("vq,gated-delta")
    return lm, H.save_pretrained_lm(lm, tmp_path_factory.mktemp("remote") / "model")


# -- save_pretrained writes the module its auto_map names -------------------------------------------

def remote_class(folder: Path):
    """``LinattnForCausalLM`` as ``trust_remote_code=True`` imports it: from the folder's
    ``modeling_linattn.py``, a module under ``transformers_modules``."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    return get_class_from_dynamic_module("modeling_linattn.LinattnForCausalLM", str(folder))


def test_a_model_loaded_from_an_export_and_saved_again_loads_as_remote_code(exported, tmp_path, monkeypatch):
    """Loaded after ``import linattn.hf`` (the local classes) and saved, the model keeps its
    ``auto_map`` and the folder gets the ``modeling_linattn.py`` it names; that folder loads through
    its remote code, and a model loaded so and saved again writes the file too, with the saved
    model's logits throughout. (An export loading with ``trust_remote_code=True`` in a process that
    never imports linattn: tests/test_hf_api.py.)"""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    lm, out = exported
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is H.LinattnForCausalLM
    model.save_pretrained(tmp_path / "again")
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_linattn.LinattnForCausalLM"
    shipped = (out / "modeling_linattn.py").read_text()
    assert (tmp_path / "again" / "modeling_linattn.py").read_text() == shipped
    remote = remote_class(tmp_path / "again").from_pretrained(tmp_path / "again")
    assert type(remote).__module__.startswith("transformers_modules.")
    remote.save_pretrained(tmp_path / "third")
    assert (tmp_path / "third" / "modeling_linattn.py").read_text() == shipped
    ids = random_ids(2, 9, seed=50)
    with torch.no_grad():
        expected = lm(ids)[0]
        for folder in ("again", "third"):
            assert torch.equal(remote_class(tmp_path / folder).from_pretrained(tmp_path / folder)(ids).logits,
                               expected)


def test_an_auto_map_naming_a_module_the_folder_lacks_is_refused_on_save(exported, tmp_path):
    _, out = exported
    model = AutoModelForCausalLM.from_pretrained(out)
    model.config.auto_map = {**model.config.auto_map, "AutoModel": "my_modeling.MyModel"}
    with pytest.raises(ValueError, match=r"config.auto_map names the modules \['my_modeling'\]"):
        model.save_pretrained(tmp_path / "mine")


# -- on a machine without linattn: the tokenizer loads, the model names the version to install ----------

_WITHOUT = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
texts = json.loads(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=False)
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
    refusal = "loaded"
except ImportError as error:
    refusal = str(error)
print(json.dumps({"class": type(tokenizer).__name__, "bos": tokenizer.bos_token_id, "refusal": refusal,
                  "ids": [tokenizer(t).input_ids for t in texts],
                  "decoded": [tokenizer.decode(tokenizer(t).input_ids, skip_special_tokens=True) for t in texts]}))
"""
TEXTS = ["To be,\nor not", "a\x00b\n", "Ā\n\n"]


def test_without_linattn_the_tokenizer_loads_and_the_model_names_the_version_to_install(exported, tmp_path):
    """Where linattn is not installed: ``tokenizer_config.json`` names the standard
    ``TokenizersBackend``, which loads the tokenizer (``trust_remote_code=False``: no prompt, no
    remote code) with the UTF-8 bytes as ids; the model, loaded with ``trust_remote_code=True``, stops
    with an ImportError naming the package and the version that wrote the folder, as the command to
    run."""
    _, out = exported
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    got = json.loads(fresh_python(_WITHOUT, str(out), json.dumps(TEXTS), cwd=tmp_path, linattn_installed=False))
    assert got["class"] == "TokenizersBackend" and got["bos"] is None
    assert got["ids"] == [list(text.encode()) for text in TEXTS]
    assert got["decoded"] == [text.replace("\x00", "") for text in TEXTS]
    assert f"written by linattn {linattn.__version__}" in got["refusal"]
    assert got["refusal"].endswith(f"pip install linattn=={linattn.__version__}")


def test_the_remote_tokenizer_names_the_start_token_as_its_bos_token_id(exported, tmp_path, monkeypatch):
    """With ``trust_remote_code=True`` the tokenizer is linattn's, whose ``bos_token_id`` is the
    newline (the token documents start after, the config's ``bos_token_id``) and no special token:
    texts encode and decode as the standard class does, newlines kept by ``skip_special_tokens``."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    _, out = exported
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert [c.__name__ for c in type(tokenizer).__mro__[:2]] == ["LinattnTokenizer", "LinattnTokenizer"]
    assert type(tokenizer).__module__.startswith("transformers_modules.")
    assert tokenizer.bos_token_id == 10 == json.loads((out / "config.json").read_text())["bos_token_id"]
    assert tokenizer.bos_token is None and 10 not in tokenizer.all_special_ids
    assert [tokenizer(t).input_ids for t in TEXTS] == [list(text.encode()) for text in TEXTS]
    assert [tokenizer.decode(list(t.encode()), skip_special_tokens=True) for t in TEXTS] == \
        [text.replace("\x00", "") for text in TEXTS]


# -- plain lm_eval ------------------------------------------------------------------------------------

def test_plain_lm_eval_with_trust_remote_code_needs_no_prefix_token(exported, tmp_path, monkeypatch):
    """lm_eval's own command line (not ``linattn lm-eval``), ``run --model hf --model_args
    pretrained=EXPORT,trust_remote_code=True``: the tokenizer is linattn's remote class, an empty
    context is conditioned on its ``bos_token_id``, the newline, and the perplexity is the model's
    own, computed here from its log-probabilities."""
    from lm_eval.__main__ import cli_evaluate

    lm, out = exported
    docs = [{"context": "", "continuation": "To be"}, {"context": "Now is the", "continuation": " winter"}]
    tasks = lm_eval_task(tmp_path, monkeypatch, "linattn_plain_lines", docs, target_delimiter="")
    results = tmp_path / "results"
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "argv", ["lm_eval", "run", "--model", "hf", "--model_args",
                                      f"pretrained={out},trust_remote_code=True,dtype=float64", "--tasks",
                                      "linattn_plain_lines", "--include_path", str(tasks), "--device", "cpu",
                                      "--batch_size", "2", "--output_path", str(results)])
    cli_evaluate()
    [result_file] = list(results.rglob("results*.json"))
    scored = json.loads(result_file.read_text())["results"]["linattn_plain_lines"]
    assert scored["perplexity,none"] == pytest.approx(lm_eval_perplexity(lm, docs), rel=1e-6)


# -- a tokenizer's EOS in the exported config -----------------------------------------------------------


def test_the_exported_config_names_the_eos_of_a_tokenizer_that_has_one(tmp_path):
    """Exported with a transformers tokenizer that has an EOS token (id 256 after the bytes), the
    config's ``eos_token_id`` is that id (``generate``'s stop token); the byte tokenizer has none, and
    its export names none."""
    core = _byte_core()
    core.add_special_tokens([AddedToken("</s>", special=True, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="\x00",
                                        padding_side="left")
    assert tokenizer.eos_token_id == 256
    H.save_pretrained_lm(tiny_lm("vq,delta", vocab_size=257), tmp_path / "eos", tokenizer=tokenizer)
    config = json.loads((tmp_path / "eos" / "config.json").read_text())
    assert config["eos_token_id"] == 256 and config["bos_token_id"] == 10
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "eos").generation_config.eos_token_id == 256
    H.save_pretrained_lm(tiny_lm("vq"), tmp_path / "bytes")
    assert json.loads((tmp_path / "bytes" / "config.json").read_text())["eos_token_id"] is None
