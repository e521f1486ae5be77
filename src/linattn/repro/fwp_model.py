"""The model of the FWP associative-retrieval experiments (``linattn.repro.fwp_retrieval``).

**Model** (one attention layer, one head, as in the paper and its official code,
github.com/ischlag/fast-weight-transformers, ``synthetic/``): write key
``k = W_k [onehot(v); e(key)] + b_k`` (``d_key = 64``), written value ``onehot(v)`` itself,
query ``q = W_q e(query) + b_q``; the retrieved ``v_hat in R^S`` is the attention output at the
query, with no output projection. Loss ``1/2 sum_j (onehot(v*)_j - v_hat_j)^2``, mean over
queries. Embedding size ``int(1.1 * 2S)`` as in the official code (``--emb-dim`` overrides).
Initialisation as there: ``e ~ N(0, 1)``; kernels ``W_k, W_q ~ U(+-1/sqrt(d_key))``; softmax
Xavier-uniform; biases PyTorch's default.

Mechanisms (``RETRIEVAL_MECHANISMS``):

- ``softmax``: ``softmax_attention`` with scale ``d_key^-1/2``.
- sum rule (``linear-elu``, ``dpfp-N``, ``favor-M``, ``sum-dpfp-1``): ``linear_attention`` with
  ``normalize="attention"`` (``phi(q).S / phi(q).z`` -- the official code's "sum" update rule
  divides by ``phi(q).z``; the paper introduces sum normalisation for its delta rule).
  FAVOR+'s random projection is drawn once per run from the run's seed and kept fixed.
- delta rule (``delta-dpfp-N``, ``delta-linear``): ``delta_rule`` with ``normalize="sum"`` and
  output scale 1 (the paper's Eqs. 23-25 with sum normalisation), write strength
  ``beta = sigmoid(W_b [onehot(v); e(key)] + b_b)`` per pair.

**Reading.** All queries of a sequence read the memory after the *last* pair, and never
write: softmax and the sum rule read it as a non-causal call whose keys/values are the pairs
(the non-causal output of kernel attention *is* the read of the final state; the sum rule
takes whichever of ``linear_attention``'s orders is cheaper, ``(phi(Q) phi(K)^T) V`` for the
single training query, ``phi(Q) (phi(K)^T V)`` when many queries share the pairs); the
delta rule writes the pairs with ``output_final_state=True``, then reads the state by a
second ``delta_rule`` call over the queries with ``beta = 0`` (no writes). This is exactly
the query at position L+1 of a causal sequence, and lets the evaluation ask
every key of a sequence at once. Training asks one random query per sequence (batch 32),
as in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..feature_maps import FAVOR, FeatureMap, get_feature_map
from ..ops.delta import delta_rule
from ..ops.kernel import linear_attention
from ..ops.softmax import softmax_attention


@dataclass(frozen=True)
class RetrievalMechanism:
    """How the memory is written and read: ``rule`` is ``"softmax"``, ``"sum"`` or ``"delta"``."""

    name: str
    label: str
    rule: str
    feature_map: str | None = None  # a get_feature_map spec ("elu", "dpfp:2", "favor:64")
    normalize: str | None = None

    def d_dot(self, key_dim: int) -> int | None:
        """Dimension of the memory's key space (None for softmax: no fixed-size memory)."""
        if self.feature_map is None:
            return None
        return get_feature_map(self.feature_map).dim_out(key_dim)

    def make_feature_map(self, seed: int) -> FeatureMap | None:
        """The feature map of one run (FAVOR+: a projection drawn from ``seed``, then fixed)."""
        if self.feature_map is None:
            return None
        fmap = get_feature_map(self.feature_map)
        if isinstance(fmap, FAVOR):
            fmap = FAVOR(fmap.num_features, seed=seed)
        return fmap


def _sum(name: str, label: str, spec: str) -> RetrievalMechanism:
    return RetrievalMechanism(name, label, "sum", spec, "attention")


def _delta(name: str, label: str, spec: str) -> RetrievalMechanism:
    return RetrievalMechanism(name, label, "delta", spec, "sum")


RETRIEVAL_MECHANISMS: dict[str, RetrievalMechanism] = {
    m.name: m
    for m in (
        RetrievalMechanism("softmax", "Softmax", "softmax"),
        _sum("linear-elu", "Linear (elu+1)", "elu"),
        _sum("dpfp-1", "DPFP-1", "dpfp:1"),
        _sum("dpfp-2", "DPFP-2", "dpfp:2"),
        _sum("dpfp-3", "DPFP-3", "dpfp:3"),
        _sum("favor-64", "FAVOR+ (64)", "favor:64"),
        _sum("favor-128", "FAVOR+ (128)", "favor:128"),
        _sum("favor-512", "FAVOR+ (512)", "favor:512"),
        _sum("sum-dpfp-1", "sum rule, DPFP-1", "dpfp:1"),
        _delta("delta-dpfp-1", "delta rule, DPFP-1", "dpfp:1"),
        _delta("delta-dpfp-2", "delta rule, DPFP-2", "dpfp:2"),
        _delta("delta-linear", "delta rule, elu+1", "elu"),
    )
}


class RetrievalModel(nn.Module):
    """One single-head attention layer over (key, one-hot value) pairs; see the module docstring.

    ``forward(keys, values, queries)``: ``[B, L]``, ``[B, L]``, ``[B, Q]`` ids -> ``[B, Q, S]``.
    """

    def __init__(self, num_keys: int, mechanism: RetrievalMechanism, *, key_dim: int = 64, emb_dim: int | None = None,
                 feature_seed: int = 0):
        super().__init__()
        self.num_keys, self.mechanism, self.key_dim = num_keys, mechanism, key_dim
        self.emb_dim = default_emb_dim(num_keys) if emb_dim is None else emb_dim
        self.embedding = nn.Embedding(num_keys, self.emb_dim)
        self.write_key = nn.Linear(num_keys + self.emb_dim, key_dim)  # input [onehot(v); e(key)]
        self.query = nn.Linear(self.emb_dim, key_dim)
        self.beta = nn.Linear(num_keys + self.emb_dim, 1) if mechanism.rule == "delta" else None
        self.feature_map = mechanism.make_feature_map(feature_seed)
        nn.init.normal_(self.embedding.weight, mean=0.0, std=1.0)
        if mechanism.rule == "softmax":
            nn.init.xavier_uniform_(self.write_key.weight)
            nn.init.xavier_uniform_(self.query.weight)
        else:
            bound = key_dim**-0.5
            nn.init.uniform_(self.write_key.weight, -bound, bound)
            nn.init.uniform_(self.query.weight, -bound, bound)

    def _project_pairs(self, linear: nn.Linear, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``linear([onehot(v); e(key)])`` without materialising the one-hot or the embeddings:
        the value block of the weight is looked up, the key block applied to the table once."""
        S = self.num_keys
        value_part = linear.weight[:, :S].t()
        key_part = self.embedding.weight @ linear.weight[:, S:].t()
        return F.embedding(values, value_part) + F.embedding(keys, key_part) + linear.bias

    def forward(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """``keys, values [B, L]``, ``queries [B, Q]`` -> retrieved vectors ``[B, Q, S]``."""
        S = self.num_keys
        k = self._project_pairs(self.write_key, keys, values).unsqueeze(1)  # [B, 1, L, d_key]
        v = k.new_zeros(*values.shape, S).scatter_(-1, values.unsqueeze(-1), 1.0).unsqueeze(1)  # one-hot [B, 1, L, S]
        q = F.embedding(queries, self.embedding.weight @ self.query.weight.t() + self.query.bias).unsqueeze(1)
        rule = self.mechanism.rule
        if rule == "softmax":
            out = softmax_attention(q, k, v, causal=False)
        elif rule == "sum":
            out = self._read_sum_rule(q, k, v)
        else:
            beta = torch.sigmoid(self._project_pairs(self.beta, keys, values)).squeeze(-1).unsqueeze(1)  # [B, 1, L]
            options = dict(feature_map=self.feature_map, normalize=self.mechanism.normalize, scale=1.0)
            # chunk 32: the outputs of the write pass are unused; shorter chunks pad less.
            _, state = delta_rule(k, k, v, beta, output_final_state=True, chunk_size=32, **options)
            # Read the final memory; beta = 0 makes the query positions write nothing.
            no_write = q.new_zeros(q.shape[:3])
            out, _ = delta_rule(q, q, q.new_zeros(*q.shape[:3], S), no_write, initial_state=state, **options)
        return out.squeeze(1)

    def _read_sum_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal kernel attention of the Q queries over all L pairs (= read of the final
        state), in the cheaper order: scores first costs ``Q L (F + S)``, the state ``(L + Q) F S``."""
        num_queries, length, values = q.shape[2], k.shape[2], v.shape[-1]
        features = self.feature_map.dim_out(k.shape[-1])
        scores_first = num_queries * length * (features + values) <= (length + num_queries) * features * values
        out, _ = linear_attention(q, k, v, feature_map=self.feature_map, causal=False,
                                  normalize=self.mechanism.normalize, mode="parallel" if scores_first else "chunk")
        return out


def default_emb_dim(num_keys: int) -> int:
    """The official code's embedding size: 1.1 times its vocabulary of 2S symbols."""
    return int((2 * num_keys) * 1.1)
