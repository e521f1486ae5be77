"""The native nearest-code search (``ops/vq/nearest.py``, ``_native/vq_codes.cpp``) that
``VectorQuantizer.nearest_codes`` runs on CPUs: the torch form's codes (ties and NaN keys
included), the same at 1 and 2 threads, ``LINATTN_VQ_IMPL``, and its self-check made to fail."""

from __future__ import annotations

import warnings

import pytest
import torch

from linattn.nn import VectorQuantizer
from linattn.ops.vq import native_nearest


def _torch_codes(quantizer: VectorQuantizer, k: torch.Tensor, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setenv("LINATTN_VQ_IMPL", "torch")
        return quantizer.nearest_codes(k)


@pytest.fixture
def fresh_verdict():
    native_nearest.reset()
    yield
    native_nearest.reset()


@pytest.mark.parametrize("B, H, T, D, S", [(1, 1, 1, 4, 8), (2, 3, 257, 8, 16), (1, 8, 600, 16, 64), (3, 1, 300, 8, 5)])
def test_the_codes_of_the_torch_form(monkeypatch, B, H, T, D, S):
    g = torch.Generator().manual_seed(T)
    quantizer = VectorQuantizer(H, D, S).eval()
    with torch.no_grad():
        quantizer.codebook.copy_(torch.randn(H, S, D, generator=g))
        quantizer.codebook[:, -1] = quantizer.codebook[:, 0]  # a tie: the first code wins
    k = torch.randn(B, H, T, D, generator=g)
    k[0, 0, 0] = quantizer.codebook[0, 0]
    assert native_nearest.verdict() is None  # its own calls first
    calls = []
    real = native_nearest.nearest_codes
    monkeypatch.setattr(native_nearest, "nearest_codes", lambda *a: calls.append(1) or real(*a))
    codes = quantizer.nearest_codes(k)
    assert calls == [1]
    assert torch.equal(codes, _torch_codes(quantizer, k, monkeypatch))
    assert int(codes[0, 0, 0]) == 0


def test_a_nan_key_gets_the_code_torch_gives_it(monkeypatch):
    quantizer = VectorQuantizer(2, 4, 8).eval()
    k = torch.randn(1, 2, 20, 4, generator=torch.Generator().manual_seed(1))
    k[0, 1, 3, 2] = float("nan")
    codes = quantizer.nearest_codes(k)
    assert torch.equal(codes, _torch_codes(quantizer, k, monkeypatch))


def test_a_nan_code_wins_as_in_torch(monkeypatch):
    """A code gone NaN (a diverged codebook) is every key's nearest in torch's argmin, even after
    a finite minimum: the search gives it too, rather than hiding it."""
    quantizer = VectorQuantizer(2, 4, 8).eval()
    with torch.no_grad():
        quantizer.codebook[1, 5, 0] = float("nan")
    k = torch.randn(1, 2, 20, 4, generator=torch.Generator().manual_seed(3))
    codes = quantizer.nearest_codes(k)
    assert torch.equal(codes, _torch_codes(quantizer, k, monkeypatch))
    assert bool((codes[0, 1] == 5).all())


def test_the_thread_count_does_not_change_a_code():
    quantizer = VectorQuantizer(4, 16, 64).eval()
    k = torch.randn(2, 4, 1000, 16, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(quantizer.nearest_codes(k))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*results)


def test_a_failed_self_check_warns_once_and_torch_searches(monkeypatch, fresh_verdict):
    monkeypatch.setattr(native_nearest, "_run_check", lambda: "key [0, 0, 1]: code 3, the torch form's 2 (on purpose)")
    quantizer = VectorQuantizer(2, 4, 8).eval()
    k = torch.randn(1, 2, 9, 4)
    with pytest.warns(RuntimeWarning, match="the native VQ nearest-code search failed: key"):
        codes = quantizer.nearest_codes(k)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = quantizer.nearest_codes(k)
    assert torch.equal(codes, again) and torch.equal(codes, _torch_codes(quantizer, k, monkeypatch))
    monkeypatch.setenv("LINATTN_VQ_IMPL", "native")
    with pytest.raises(RuntimeError, match="the native VQ nearest-code search failed"):
        quantizer.nearest_codes(k)


def test_the_self_check_fails_a_search_that_differs(monkeypatch, fresh_verdict):
    """The check itself, on a search made wrong: the last minimum instead of the first."""
    assert native_nearest.verdict() is None
    native_nearest.reset()
    real = native_nearest.nearest_codes

    def last_of_ties(keys, codebook, norms):
        flipped = real(keys, codebook.flip(1), norms.flip(1))
        return codebook.shape[1] - 1 - flipped

    monkeypatch.setattr(native_nearest, "nearest_codes", last_of_ties)
    assert "the torch form's" in native_nearest.verdict()


def test_forced_torch_skips_it(monkeypatch):
    monkeypatch.setenv("LINATTN_VQ_IMPL", "torch")
    monkeypatch.setattr(native_nearest, "nearest_codes", lambda *a: pytest.fail("the kernel ran"))
    VectorQuantizer(2, 4, 8).eval().nearest_codes(torch.randn(1, 2, 5, 4))


def test_the_kernel_checks_what_it_is_given():
    with pytest.raises(RuntimeError, match="keys must be a contiguous CPU float32 tensor"):
        native_nearest.nearest_codes(torch.randn(1, 1, 3, 4, dtype=torch.float64), torch.randn(1, 5, 4),
                                     torch.randn(1, 5))
    with pytest.raises(RuntimeError, match=r"codebook \[2, 5, 4\] and norms \[2, 5\] for keys \[1, 1, 3, 4\]"):
        native_nearest.nearest_codes(torch.randn(1, 1, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5))


def test_the_key_check_compares_as_torch_equal_does():
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.float64):
        codebook = torch.randn(2, 6, 4, generator=g, dtype=dtype)
        codebook[0, 1, 2] = 0.0
        codes = torch.randint(0, 6, (3, 2, 7), generator=g)
        codes[0, 0, 0] = 1
        k_hat = codebook[torch.arange(2)[None, :, None], codes]
        assert native_nearest.keys_are_codes(k_hat, codes, codebook) is True
        signed = k_hat.clone()
        signed[0, 0, 0, 2] = -0.0  # equal by value
        assert native_nearest.keys_are_codes(signed, codes, codebook) is True
        for change in ("nan", "next float"):
            changed = k_hat.clone()
            x = changed[2, 1, 6, 3]
            changed[2, 1, 6, 3] = float("nan") if change == "nan" else torch.nextafter(x, x + 1)
            assert native_nearest.keys_are_codes(changed, codes, codebook) is False, change
    assert native_nearest.keys_are_codes(k_hat.half(), codes, codebook.half()) is None  # not computed here


@pytest.mark.parametrize("reduction", ["paper", "mean"])
def test_the_one_call_forward_gives_the_torch_forward(monkeypatch, reduction):
    """Without gradients a quantizer takes codes, rows and the squared error from one native
    call: the same codes and keys as the torch form, the commitment loss within float32 rounding."""
    quantizer = VectorQuantizer(3, 8, 16, commitment_reduction=reduction).eval()
    k = torch.randn(2, 3, 700, 8, generator=torch.Generator().manual_seed(5))
    calls = []
    real = native_nearest.quantize
    monkeypatch.setattr(native_nearest, "quantize", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        k_hat, codes, commit = quantizer(k)
        with monkeypatch.context() as patch:
            patch.setenv("LINATTN_VQ_IMPL", "torch")
            want_k_hat, want_codes, want_commit = quantizer(k)
    assert calls == [1]
    assert torch.equal(codes, want_codes) and torch.equal(k_hat, want_k_hat)
    torch.testing.assert_close(commit, want_commit, rtol=1e-5, atol=0)
