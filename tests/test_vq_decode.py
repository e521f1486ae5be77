"""Transformer-VQ decoding (``vq_attention`` with a carried state and few new positions): the
decode form scores only the new queries, and equals the parallel reference and the block
form in float64 — outputs, every field of the final state, gradients — across block
boundaries, with relative bias and position keys, GQA, batch > 1 and soft codes, both with
gradients on (new tensors per step) and off (the state's resident buffer, written in place:
states stay values, whatever is continued, rebuilt or branched)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._pytree import tree_leaves

import linattn
from _helpers import F64, OpRecorder, assert_close_rel, assert_decodes_as_full_pass, head_fields
from test_vq_attention import gather_codes, make_bias, make_position_keys, make_vq

H, L, DK = 4, 4, 4


def _relative(kind):
    if kind == "none":
        return {}
    return dict(bias=make_bias(H, L), position_keys=make_position_keys(H, L, DK))


def _pieces(q, k_hat, v, codes, codebook, sizes, **kw):
    outs, state, start = [], None, 0
    for n in sizes:
        sl = slice(start, start + n)
        out, state = linattn.vq_attention(q[:, :, sl], k_hat[:, :, sl], v[:, :, sl], codes[:, :, sl], codebook,
                                          block_size=L, initial_state=state, output_final_state=True, **kw)
        outs.append(out)
        start += n
    return torch.cat(outs, dim=2), state


def _assert_same_state(actual, expected):
    assert actual.steps == expected.steps
    for name, value in vars(expected).items():
        if isinstance(value, torch.Tensor):
            got = getattr(actual, name)
            assert got.shape == value.shape, name
            if value.is_floating_point():
                torch.testing.assert_close(got, value, rtol=1e-10, atol=1e-12, msg=name)
            else:
                assert torch.equal(got, value), name
        elif value is None:
            assert getattr(actual, name) is None, name


@pytest.mark.parametrize("gradients", [True, False])
@pytest.mark.parametrize("relative", ["none", "bias+positions"])
@pytest.mark.parametrize("prefill", [0, 3, 4, 9])
def test_prefill_then_token_by_token_equals_one_call(prefill, relative, gradients):
    """A prompt read by one call (block form), then one token at a time (decode form):
    outputs equal the parallel reference, the final state equals one call's."""
    T = 19
    q, k_hat, v, codes, codebook = make_vq(T=T, Dk=DK, seed=31 + prefill)
    kw = _relative(relative)
    reference, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, mode="parallel", **kw)
    _, one_call = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, output_final_state=True, **kw)
    sizes = ([prefill] if prefill else []) + [1] * (T - prefill)
    with torch.set_grad_enabled(gradients):
        out, state = _pieces(q, k_hat, v, codes, codebook, sizes, **kw)
    assert (state._resident is None) == gradients
    assert_close_rel(out, reference, rtol=1e-10, name="decode vs parallel")
    _assert_same_state(state, one_call)


@pytest.mark.parametrize("gradients", [True, False])
@pytest.mark.parametrize("sizes", [[2, 2, 1, 3, 4, 1, 2], [3, 1, 4, 4, 2, 3], [1, 3, 2, 2, 2, 2, 1, 4]])
def test_small_pieces_that_end_exactly_on_block_boundaries(sizes, gradients):
    T = sum(sizes)
    q, k_hat, v, codes, codebook = make_vq(T=T, Dk=DK, seed=T)
    kw = _relative("bias+positions")
    reference, _ = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, mode="parallel", **kw)
    _, one_call = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, output_final_state=True, **kw)
    with torch.set_grad_enabled(gradients):
        out, state = _pieces(q, k_hat, v, codes, codebook, sizes, **kw)
    assert_close_rel(out, reference, rtol=1e-10, name="pieces vs parallel")
    _assert_same_state(state, one_call)


def test_decode_gradients_equal_the_reference():
    """With the state carried undetached and ``cache_grad=True``, token-wise gradients w.r.t.
    q, v, the codebook, bias and position keys equal the parallel reference's."""
    T = 13
    q, _, v, codes, codebook = make_vq(T=T, Dk=DK, seed=41)
    leaves = [t.clone().requires_grad_(True) for t in (q, v, codebook, make_bias(H, L),
                                                        make_position_keys(H, L, DK))]
    weights = torch.randn(q.shape[0], H, T, v.shape[-1], generator=torch.Generator().manual_seed(5), dtype=F64)

    def grads(token_wise):
        qq, vv, cb, bias, pos = leaves
        k_hat = gather_codes(cb, codes)
        kw = dict(bias=bias, position_keys=pos, cache_grad=True)
        if token_wise:
            out, _ = _pieces(qq, k_hat, vv, codes, cb, [5] + [1] * (T - 5), **kw)
        else:
            out, _ = linattn.vq_attention(qq, k_hat, vv, codes, cb, block_size=L, mode="parallel",
                                          bias=bias, position_keys=pos)
        return torch.autograd.grad((out * weights).sum(), leaves)

    for name, got, want in zip(["q", "v", "codebook", "bias", "position_keys"], grads(True), grads(False)):
        assert want.abs().sum() > 0, name
        assert_close_rel(got, want, rtol=1e-9, name=f"grad {name}")


@pytest.mark.parametrize("gradients", [True, False])
def test_soft_codes_decode_equals_one_call(gradients):
    B, Hkv, T, S = 2, 2, 11, 6
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, T, DK, generator=g, dtype=F64)
    k = torch.randn(B, Hkv, T, DK, generator=g, dtype=F64)
    v = torch.randn(B, Hkv, T, 3, generator=g, dtype=F64)
    codebook = torch.randn(Hkv, S, DK, generator=g, dtype=F64)
    kw = dict(temperature=0.7, block_size=L, bias=make_bias(H, L))
    full, full_state = linattn.soft_vq_attention(q, k, v, codebook, output_final_state=True, **kw)
    outs, state = [], None
    with torch.set_grad_enabled(gradients):
        for t in range(T):
            out, state = linattn.soft_vq_attention(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                                                   codebook, initial_state=state, output_final_state=True, **kw)
            outs.append(out)
    assert_close_rel(torch.cat(outs, 2), full, rtol=1e-10, name="soft decode")
    _assert_same_state(state, full_state)


@pytest.mark.parametrize("filled", [5, 63])
def test_one_token_scores_only_its_own_row(filled):
    """A decode step builds no tensor as large as the block form's ``[L, 2L + S]`` scores
    per head: its largest tensor is O(L + S) per head (here the codebook itself), also for
    the step that completes a block (63 positions filled of 64)."""
    L_big, S = 64, 16
    T = 3 * L_big + filled + 1
    q, k_hat, v, codes, codebook = make_vq(B=1, H=2, Hkv=1, T=T, Dk=8, S=S, unused=0, seed=3)
    head = [t[:, :, :-1] for t in (q, k_hat, v, codes)]
    _, state = linattn.vq_attention(*head, codebook, block_size=L_big, output_final_state=True)
    assert state.partial_keys.shape[2] == filled
    step = [t[:, :, -1:] for t in (q, k_hat, v, codes)]
    with OpRecorder() as recorder:
        linattn.vq_attention(*step[:4], codebook, block_size=L_big, initial_state=state, check_inputs=False)
    block_scores = 2 * L_big * (2 * L_big + S)
    assert recorder.max_numel < block_scores // 8, recorder.max_numel


def test_state_after_a_long_prefill_owns_small_tensors():
    """The carried state holds copies of the last blocks, not views that keep the whole
    prompt (or the padded work buffers) alive: its memory is constant in the prompt length."""
    q, k_hat, v, codes, codebook = make_vq(T=203, Dk=DK, seed=9)
    _, state = linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, output_final_state=True)
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), name
    step = [t[:, :, :1].clone() for t in (q, k_hat, v, codes)]
    _, state = linattn.vq_attention(*step, codebook, block_size=L, initial_state=state, output_final_state=True)
    for name in ("partial_keys", "partial_values", "prev_keys"):
        value = getattr(state, name)
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), name


def _step(inputs, t, codebook, state, **kw):
    """Position ``t`` of ``inputs`` (q, k_hat, v, codes) as one decoding step."""
    q, k_hat, v, codes = (x[:, :, t : t + 1] for x in inputs)
    return linattn.vq_attention(q, k_hat, v, codes, codebook, block_size=L, initial_state=state,
                                output_final_state=True, **kw)


def _steps(inputs, n, codebook, **kw):
    """The state after decoding positions ``0 .. n - 1`` of ``inputs`` one at a time."""
    state = None
    for t in range(n):
        _, state = _step(inputs, t, codebook, state, **kw)
    return state


class _NewTensors(OpRecorder):
    """The largest tensor an op allocates (outputs that alias an input, views and in-place
    results, excluded)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs:
            self.max_numel = max(self.max_numel, out.numel())
        return out


def test_no_grad_steps_write_into_one_buffer_per_block():
    """With gradients off, the steps inside a block share one buffer (no copy of the block so
    far per step: the largest tensor a step makes is its queries or scores row), and the state's memory
    does not grow with the prompt."""
    *inputs, codebook = make_vq(B=1, H=2, Hkv=1, T=80, Dk=16, S=4, unused=0, seed=4)
    sizes = []
    for prompt in (9, 41):
        with torch.no_grad():
            _, state = linattn.vq_attention(*(x[:, :, :prompt] for x in inputs[:4]), codebook, block_size=L,
                                            output_final_state=True)
            _, state = _step(inputs, prompt, codebook, state)  # the first step moves the state into a buffer
            buffers = [state._resident]
            for t in range(prompt + 1, prompt + 2 * L):
                with _NewTensors() as recorder:
                    _, state = _step(inputs, t, codebook, state, check_inputs=False)
                if state._resident is not buffers[-1]:
                    buffers.append(state._resident)
                if state.partial_keys.shape[2]:  # not a completed block: the scaled queries [2 heads, Dk]
                    assert recorder.max_numel <= 2 * 16, recorder.max_numel  # a copied block: 3 Dk or more
        assert len(buffers) == 3  # one per block touched
        sizes.append(sum(t.untyped_storage().nbytes() for t in vars(state).values() if isinstance(t, torch.Tensor)))
    assert sizes[0] == sizes[1]


def test_branches_from_one_state_do_not_see_each_other():
    """Continuations of one state (beam search, retries), advanced in turns, and the state
    itself stay independent: each equals its own sequence decoded from scratch."""
    B, T, start = 2, 12, 5
    q, k_hat, v, codes, codebook = make_vq(B=B, T=T, Dk=DK, seed=12)
    other = make_vq(B=B, T=T, Dk=DK, seed=13)
    sources = [(q, k_hat, v, codes), (other[0], gather_codes(codebook, other[3]), other[2], other[3]),
               (q, k_hat, v, codes)]
    kw = _relative("bias+positions")
    with torch.no_grad():
        _, base = linattn.vq_attention(q[:, :, :4], k_hat[:, :, :4], v[:, :, :4], codes[:, :, :4], codebook,
                                       block_size=L, output_final_state=True, **kw)
        _, base = _step(sources[0], 4, codebook, base, **kw)  # one position into a block, in a buffer
        states, outs = [base] * len(sources), [[] for _ in sources]
        for t in range(start, T):  # every branch one step, in turns
            for i, source in enumerate(sources):
                out, states[i] = _step(source, t, codebook, states[i], **kw)
                outs[i].append(out)
    for source, got in zip(sources, outs):
        sequence = [torch.cat([x[:, :, :start], y[:, :, start:]], 2) for x, y in zip(sources[0], source)]
        want, _ = linattn.vq_attention(*sequence, codebook, block_size=L, mode="parallel", **kw)
        assert_close_rel(torch.cat(got, 2), want[:, :, start:], rtol=1e-10, name="branch")


def test_rebuilt_states_start_a_new_buffer():
    """``dataclasses.replace``, ``detach``, ``to`` and ``select_batch`` give states without the
    buffer (they hold other tensors); continuing them is correct and leaves the source intact."""
    q, k_hat, v, codes, codebook = make_vq(T=9, Dk=DK, seed=21)
    inputs = (q, k_hat, v, codes)
    with torch.no_grad():
        state = _steps(inputs, 6, codebook)
        want, _ = _step(inputs, 6, codebook, state)
        rebuilt = {
            "replace": dataclasses.replace(state, steps=state.steps),
            "detach": state.detach(),
            "to": state.to(torch.float64),
            "select_batch": state.select_batch(torch.tensor([0, 1])),
        }
        for name, other in rebuilt.items():
            assert other._resident is None, name
            got, _ = _step(inputs, 6, codebook, other)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        again, _ = _step(inputs, 6, codebook, state)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_a_graph_that_read_a_buffer_survives_later_steps():
    """A step with gradients reads a state whose buffer later no-grad steps from the same
    state would fill; its backward still works and its gradient is the reference's."""
    q, k_hat, v, codes, codebook = make_vq(T=8, Dk=DK, seed=22)
    inputs = (q, k_hat, v, codes)
    with torch.no_grad():
        state = _steps(inputs, 5, codebook)
    q5 = q[:, :, 5:6].clone().requires_grad_(True)
    out, _ = linattn.vq_attention(q5, k_hat[:, :, 5:6], v[:, :, 5:6], codes[:, :, 5:6], codebook, block_size=L,
                                  initial_state=state, output_final_state=True)
    with torch.no_grad():
        continued = state
        for t in range(5, 8):
            _, continued = _step(inputs, t, codebook, continued)
    out.sum().backward()
    q_ref = q[:, :, :6].clone().requires_grad_(True)
    ref, _ = linattn.vq_attention(q_ref, k_hat[:, :, :6], v[:, :, :6], codes[:, :, :6], codebook, block_size=L,
                                  mode="parallel")
    ref[:, :, 5:].sum().backward()
    assert_close_rel(q5.grad, q_ref.grad[:, :, 5:], rtol=1e-10, name="grad q")


def test_a_codebook_written_between_steps_is_read_anew():
    """The buffer holds a copy of the codebook; after an in-place update (an EMA step) the
    next step reads the new codebook, as the block form does."""
    q, k_hat, v, codes, codebook = make_vq(T=13, Dk=DK, seed=23)
    inputs = (q, k_hat, v, codes)
    codebook = codebook.clone()
    with torch.no_grad():
        state = _steps(inputs, 10, codebook)
        codebook.mul_(1.5)
        inputs = (q, gather_codes(codebook, codes), v, codes)
        got, _ = _step(inputs, 10, codebook, state)
    want, _ = _step(inputs, 10, codebook, state.detach())  # gradients on: the functional form
    assert_close_rel(got, want, rtol=1e-10, name="after a codebook update")


@pytest.mark.parametrize("attention", ["vq", "soft-vq", "local:4,vq"])
def test_lm_prefill_then_token_wise_equals_one_pass(attention):
    """A model reads a prompt in one call (block form), then one token per call (decode form):
    the logits equal one pass over the whole sequence, for every block boundary on the way."""
    config = linattn.LMConfig(d_model=16, n_layers=2, attention=attention, gau_d_k=8, codebook_size=8,
                              block_size=4, chunk_size=4, **head_fields(attention, n_heads=2))
    torch.manual_seed(0)
    model = linattn.LM(config).double().eval()
    assert_decodes_as_full_pass(model, torch.randint(0, 256, (2, 23)), prefill=9)


def test_generate_equals_greedy_decoding_by_full_passes():
    """``LM.generate`` (prefill + one-token steps, cached GAU terms, unchecked steps) picks the
    same greedy tokens as re-running the whole sequence for every token."""
    config = linattn.LMConfig(d_model=16, n_layers=1, attention="vq", gau_d_k=8, codebook_size=8, block_size=4)
    torch.manual_seed(1)
    model = linattn.LM(config).double().eval()
    prompt = torch.randint(0, 256, (1, 6))
    generated = list(model.generate(prompt[0], 11, temperature=0))
    sequence = prompt[0].tolist()
    with torch.no_grad():
        for _ in range(11):
            logits, _, _ = model(torch.tensor([sequence]))
            sequence.append(int(logits[0, -1].argmax()))
    assert generated == sequence[6:]


def test_two_continuations_of_one_model_state_in_turns():
    """Two token streams continued from one model state (whose steps write into its
    buffers), advanced in turns, each give the logits of one pass over their sequence."""
    config = linattn.LMConfig(d_model=16, n_layers=2, attention="vq", gau_d_k=8, codebook_size=8, block_size=4)
    torch.manual_seed(3)
    model = linattn.LM(config).double().eval()
    ids = torch.randint(0, 256, (2, 2, 16))  # two streams sharing their first 6 tokens
    ids[1, :, :6] = ids[0, :, :6]
    with torch.no_grad():
        _, state, _ = model(ids[0, :, :5])
        _, state, _ = model(ids[0, :, 5:6], state)  # a decoding step: the state now lives in buffers
        states, logits = [state, state], [[], []]
        for t in range(6, 16):
            for i in range(2):
                out, states[i], _ = model(ids[i, :, t : t + 1], states[i])
                logits[i].append(out)
        for i in range(2):
            full, _, _ = model(ids[i])
            torch.testing.assert_close(torch.cat(logits[i], 1), full[:, 6:], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("change", ["in_place", "load_state_dict", "optimizer"])
def test_no_grad_caches_follow_parameter_updates(change):
    """Without gradients the GAU reuses its stacked input weights and relative terms; any
    change of a parameter (in place, by load_state_dict, by an optimizer step) is seen."""
    torch.manual_seed(2)
    gau = linattn.nn.GAU(8, d_k=8, codebook_size=8, block_size=4, attention="vq").double().eval()
    x = torch.randn(2, 7, 8, dtype=F64)
    with torch.no_grad():
        gau(x)  # fills the caches
    if change == "in_place":
        with torch.no_grad():
            for p in (gau.w_q.weight, gau.w_r.weight, gau.content_bias, gau.w_g.weight):
                p.add_(0.1)
    elif change == "load_state_dict":
        other = linattn.nn.GAU(8, d_k=8, codebook_size=8, block_size=4, attention="vq").double()
        gau.load_state_dict(other.state_dict())
    else:
        optimizer = torch.optim.SGD(gau.parameters(), lr=0.5)
        gau(x)[0].square().sum().backward()
        optimizer.step()
    with torch.no_grad():
        cached, _, _ = gau(x)
    expected, _, _ = gau(x)  # with gradients: nothing cached
    torch.testing.assert_close(cached, expected.detach(), rtol=1e-12, atol=1e-12)
