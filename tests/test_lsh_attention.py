"""Reformer LSH attention: exact with one chunk, approaches exact attention as hash rounds
grow, causal gradients, padding to any T, errors."""

import pytest
import torch

from _helpers import F64, assert_causal_jacobian, assert_close_rel
from linattn import lsh_attention


def exact_with_self_rule(qk, v, causal):
    """softmax over keys qk/|qk| (scaled by D^-1/2); own key at -1e5; future keys hidden."""
    B, H, T, D = qk.shape
    keys = qk / qk.norm(dim=-1, keepdim=True)
    out = torch.empty(B, H, T, v.shape[-1], dtype=qk.dtype)
    for i in range(T):
        visible = i + 1 if causal else T
        scores = qk[:, :, i : i + 1] @ keys[:, :, :visible].transpose(-1, -2) * D**-0.5
        scores[..., i] = -1e5
        out[:, :, i] = (torch.softmax(scores, dim=-1) @ v[:, :, :visible])[:, :, 0]
    return out


def make(B=2, H=3, T=20, D=8, E=5, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, D, generator=g, dtype=F64) * scale, torch.randn(B, H, T, E, generator=g, dtype=F64)


@pytest.mark.parametrize("T", [1, 7, 50])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_hashes", [1, 3])
def test_one_chunk_is_exact_attention(T, causal, n_hashes):
    qk, v = make(T=T, seed=T)
    out = lsh_attention(qk, v, n_hashes=n_hashes, bucket_size=64, causal=causal, seed=0)
    assert_close_rel(out, exact_with_self_rule(qk, v, causal), rtol=1e-9)


def test_more_hash_rounds_approach_exact_attention():
    qk, v = make(B=1, H=2, T=256, D=16, seed=1, scale=2.0)
    exact = exact_with_self_rule(qk, v, True)
    errors = [(lsh_attention(qk, v, n_hashes=n, bucket_size=16, seed=1) - exact).abs().mean().item()
              for n in (1, 4, 16)]
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[2] < 0.5 * errors[0], errors


def test_same_seed_same_output_and_any_length():
    qk, v = make(T=37, seed=2)
    a = lsh_attention(qk, v, bucket_size=8, seed=5)
    b = lsh_attention(qk, v, bucket_size=8, seed=5)
    c = lsh_attention(qk, v, bucket_size=8, seed=6)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (2, 3, 37, 5) and torch.isfinite(a).all()


def test_causal_jacobian():
    qk, v = make(B=1, H=1, T=12, D=4, E=3, seed=3)
    fn = lambda qk, v: lsh_attention(qk, v, n_hashes=2, bucket_size=4, seed=0)  # noqa: E731
    assert_causal_jacobian(fn, (qk, v), ("qk", "v"))


def test_errors_name_the_argument():
    qk, v = make(T=8)
    with pytest.raises(ValueError, match="v has shape"):
        lsh_attention(qk, v[:, :, :5])
    with pytest.raises(ValueError, match="bucket_size"):
        lsh_attention(qk, v, bucket_size=0)
    with pytest.raises(ValueError, match="qk must have 4 dimensions"):
        lsh_attention(qk[0], v)
    with pytest.raises(TypeError, match="qk"):
        lsh_attention(qk.long(), v)


def lsh_reference(qk, v, *, n_hashes, bucket_size, causal, seed):
    """The Reformer's algorithm written out with loops, one (batch, head) at a time: the same
    seeded rotations; per round, buckets argmax([xR; -xR]) (padding last), positions sorted by
    (bucket, position), chunks of ``bucket_size``, each query attending to its own chunk and the
    previous one (wrapping, when there are several), own key at -1e5, padding and (causal)
    later keys hidden; rounds combined by softmax over their log-sum-exps."""
    B, H, T, D = qk.shape
    C = bucket_size
    n_chunks = -(-T // C)
    Tp = n_chunks * C
    n_buckets = max(2, n_chunks + n_chunks % 2)
    rotations = torch.randn(n_hashes, D, n_buckets // 2, generator=torch.Generator().manual_seed(seed),
                            dtype=torch.float64)
    out = torch.zeros(B, H, T, v.shape[-1], dtype=F64)
    for b in range(B):
        for h in range(H):
            x = torch.cat([qk[b, h], qk.new_zeros(Tp - T, D)])
            keys = torch.nn.functional.normalize(x, dim=-1)
            rounds = []
            for rotation in rotations:
                rotated = keys @ rotation
                bucket = [int(torch.cat([rotated[i], -rotated[i]]).argmax()) if i < T else n_buckets
                          for i in range(Tp)]
                order = sorted(range(Tp), key=lambda i: (bucket[i], i))
                chunk_of = {position: slot // C for slot, position in enumerate(order)}
                outputs, lses = torch.zeros(T, v.shape[-1], dtype=F64), torch.zeros(T, dtype=F64)
                for i in range(T):
                    chunks = {chunk_of[i], (chunk_of[i] - 1) % n_chunks}
                    seen = [j for j in order if chunk_of[j] in chunks and j < T and not (causal and j > i)]
                    scores = torch.stack([x[i] @ keys[j] * D**-0.5 if j != i else torch.tensor(-1e5, dtype=F64)
                                          for j in seen])
                    lses[i] = torch.logsumexp(scores, 0)
                    outputs[i] = torch.softmax(scores, 0) @ v[b, h, seen]
                rounds.append((outputs, lses))
            weights = torch.softmax(torch.stack([lse for _, lse in rounds]), dim=0)
            out[b, h] = sum(w[:, None] * o for w, (o, _) in zip(weights, rounds))
    return out


@pytest.mark.parametrize("T, bucket_size, causal", [(20, 4, True), (23, 4, False), (13, 8, True)])
def test_several_chunks_equal_the_written_out_algorithm(T, bucket_size, causal):
    qk, v = make(B=1, H=2, T=T, D=6, E=3, seed=T)
    out = lsh_attention(qk, v, n_hashes=2, bucket_size=bucket_size, causal=causal, seed=4)
    expected = lsh_reference(qk, v, n_hashes=2, bucket_size=bucket_size, causal=causal, seed=4)
    assert_close_rel(out, expected, rtol=1e-9)
