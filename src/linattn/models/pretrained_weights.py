"""The tensors of a Hugging Face Llama, Mistral or Qwen2 checkpoint as an ``LM`` state dict.

Reads ``model.safetensors``, or the shards a ``model.safetensors.index.json`` names (never a
pickle: ``pytorch_model.bin`` folders are refused), one tensor at a time, each cast to the
requested dtype as it is read. Names map one to one (``model.layers.N.self_attn.q_proj`` ->
``layers.N.mixer.q_proj``, ``mlp.gate_proj`` -> ``ffn.w_gate``, ``input_layernorm`` ->
``mixer_norm``, ``lm_head`` -> ``head``, ...).

Rotary layout. transformers rotates the two halves of a head (channel ``m`` with channel
``m + D/2``, "rotate half"); linattn's ``apply_rotary`` rotates adjacent pairs (``2m`` with
``2m + 1``) by the same angle. So the rows of the q and k projections (and their biases) are
permuted within each head, ``new[2m] = old[m]``, ``new[2m + 1] = old[m + D/2]``: queries and
keys come out permuted alike, their dot products (and so the attention) are unchanged, and
linattn's rotary math is not touched. Values and the output projection keep their order.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .config import LMConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_LAYER_NAMES = {
    "input_layernorm.weight": "mixer_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn.w_gate.weight",
    "mlp.up_proj.weight": "ffn.w_up.weight",
    "mlp.down_proj.weight": "ffn.w_down.weight",
    **{f"self_attn.{p}_proj.{kind}": f"mixer.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")},
}
_TOP_NAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "head.weight"}
_IGNORED_SUFFIX = ".rotary_emb.inv_freq"  # a buffer older exports saved; transformers recomputes it, as linattn does


def rotate_half_permutation(head_dim: int) -> torch.Tensor:
    """The row order that turns one head's rotate-half channels into adjacent pairs:
    ``[0, D/2, 1, D/2 + 1, ...]`` (new row ``2m`` is old row ``m``, ``2m + 1`` is ``m + D/2``)."""
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], dim=1).flatten()


def _permute_heads(tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``tensor [heads * head_dim, ...]`` with the rows of each head in ``rotate_half_permutation`` order."""
    heads = tensor.unflatten(0, (-1, head_dim))
    return heads[:, rotate_half_permutation(head_dim)].flatten(0, 1).contiguous()


def read_hf_tensors(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``folder`` by its Hugging Face name, in ``dtype``; a
    missing file or shard, a tensor the index names but its shard lacks, or a tensor that is
    not floating point is a ValueError naming it."""
    if (folder / SINGLE_FILE).is_file():
        return _read_file(folder / SINGLE_FILE, None, dtype)
    index = folder / INDEX_FILE
    if not index.is_file():
        pickled = [name for name in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (folder / name).exists()]
        note = f" ({pickled[0]} is there: linattn reads safetensors only, never a pickle)" if pickled else ""
        raise ValueError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}{note}")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{index} is not a safetensors index with a weight_map ({error!r})") from None
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    missing = sorted(shard for shard in shards if not (folder / shard).is_file())
    if missing:
        raise ValueError(f"{index} names the shard(s) {', '.join(missing)}, missing from {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for shard, names in shards.items():
        tensors.update(_read_file(folder / shard, names, dtype))
    return tensors


def _read_file(path: Path, names: list[str] | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (None: all) of one safetensors file, each cast to ``dtype`` in a
    fresh allocation."""
    tensors = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            present = set(handle.keys())
            absent = sorted(set(names or ()) - present)
            if absent:
                raise ValueError(f"{path} lacks the tensor(s) {', '.join(absent)} that the index places there")
            for name in names if names is not None else sorted(present):
                tensor = handle.get_tensor(name)
                if tensor.dtype not in FLOAT_DTYPES:
                    raise ValueError(f"{path}: tensor {name} is {tensor.dtype}; linattn imports float32, bfloat16, "
                                     f"float16 or float64 weights (not quantized ones)")
                tensors[name] = tensor.to(dtype=dtype, copy=True)
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path}: cannot read it as safetensors ({error})") from None
    return tensors


def lm_state_dict(tensors: dict[str, torch.Tensor], config: LMConfig, expected: dict[str, torch.Size]
                  ) -> dict[str, torch.Tensor]:
    """The ``LM`` state dict (names and shapes ``expected``) of the Hugging Face ``tensors``,
    q/k rows permuted (module docstring). A tensor the model lacks or does not use (but the
    ignored rotary buffers, and a tied ``lm_head.weight`` equal to the embedding), or one of
    another shape, is a ValueError naming it."""
    head_dim = config.head_dim or config.d_model // config.n_heads
    state, unused = {}, []
    for name, tensor in tensors.items():
        target = _linattn_name(name, config.n_layers)
        if target is None:
            if not name.endswith(_IGNORED_SUFFIX):
                unused.append(name)
            continue
        if target == "head.weight" and config.tie_embeddings:
            _check_tied_head(tensor, tensors.get("model.embed_tokens.weight"))
            continue
        if target.endswith(("mixer.q_proj.weight", "mixer.q_proj.bias", "mixer.k_proj.weight", "mixer.k_proj.bias")):
            tensor = _permute_heads(tensor, head_dim)
        state[target] = tensor
    if unused:
        raise ValueError(f"the checkpoint holds tensor(s) this model has no place for: {', '.join(sorted(unused))}")
    missing = [_hf_name(name) for name in expected if name not in state]
    if missing:
        raise ValueError(f"the checkpoint lacks the tensor(s) {', '.join(missing)}")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ValueError(f"tensor {_hf_name(name)} has shape {list(state[name].shape)}, but config.json describes "
                             f"{list(shape)}")
    return state


def _linattn_name(name: str, n_layers: int) -> str | None:
    """The ``LM`` name of a Hugging Face tensor name, or None for a name it does not map."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    prefix, _, rest = name.partition(".layers.")
    index, _, inner = rest.partition(".")
    if prefix != "model" or not (index.isdigit() and int(index) < n_layers) or inner not in _LAYER_NAMES:
        return None
    return f"layers.{int(index)}.{_LAYER_NAMES[inner]}"


def _hf_name(name: str) -> str:
    """The Hugging Face name of an ``LM`` state-dict name (for messages)."""
    for hf, ours in _TOP_NAMES.items():
        if name == ours:
            return hf
    _, index, inner = name.split(".", 2)
    return f"model.layers.{index}." + {ours: hf for hf, ours in _LAYER_NAMES.items()}[inner]


def _check_tied_head(head: torch.Tensor, embedding: torch.Tensor | None) -> None:
    """A tied model's saved ``lm_head.weight`` must be the embedding (transformers would use the
    embedding and drop it: a different one would be a second head that is silently ignored)."""
    if embedding is None or head.shape != embedding.shape or not torch.equal(head, embedding):
        raise ValueError("config.json says tie_word_embeddings=true, but the checkpoint's lm_head.weight differs "
                         "from model.embed_tokens.weight")
