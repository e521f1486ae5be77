"""One rule for weight decay (train/optim.py): matrices decay; vectors, scalars, codebooks and
(unless asked) embeddings do not; each parameter appears once, in model order."""

from __future__ import annotations

import torch

from linattn.models import LM, LMConfig
from linattn.train.optim import parameter_groups


def _names(model, group):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in group["params"]]


def test_groups_follow_the_rule_in_model_order():
    model = LM(LMConfig(d_model=16, n_layers=2, attention="soft-vq,softmax", n_heads=2, gau_d_k=8, codebook_size=8,
                        block_size=4))
    decay, rest = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    decayed, kept = _names(model, decay), _names(model, rest)
    everything = [n for n, _ in model.named_parameters()]
    assert sorted(decayed + kept) == sorted(everything) and len(set(decayed + kept)) == len(everything)
    assert decayed == [n for n in everything if n in decayed] and kept == [n for n in everything if n in kept]
    params = dict(model.named_parameters())
    for name in decayed:
        assert params[name].dim() >= 2 and "codebook" not in name and name != "embed.weight", name
    for name in kept:
        assert params[name].dim() < 2 or "codebook" in name or name == "embed.weight", name
    assert "embed.weight" in kept and any("codebook" in n for n in kept)
    assert any(n.endswith("w_q.weight") for n in decayed) and any(n.endswith("norm.weight") for n in kept)


def test_embeddings_decay_when_asked_and_a_tied_head_counts_once():
    model = LM(LMConfig(d_model=16, n_layers=1, attention="linear:elu", n_heads=2))
    decay, rest = parameter_groups(model, 0.5, decay_embeddings=True)
    assert "embed.weight" in _names(model, decay)
    assert sum(p is model.embed.weight for g in (decay, rest) for p in g["params"]) == 1
    untied = LM(LMConfig(d_model=16, n_layers=1, attention="linear:elu", n_heads=2, tie_embeddings=False))
    decay, rest = parameter_groups(untied, 0.5)
    assert "head.weight" in _names(untied, decay) and "embed.weight" in _names(untied, rest)
    torch.optim.AdamW(parameter_groups(untied, 0.5), lr=1e-3)  # accepted as given
