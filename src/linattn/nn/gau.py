"""The Gated Attention Unit of Transformer-VQ, with VQ, soft-VQ or exact softmax attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from .._checks import (check_choice, check_layer_input, check_positive_number, check_state_batch, check_state_tensor,
                       is_number)
from ..ops.common.versions import tensor_version
from ..ops.softmax import entropy_scale, kv_cache
from ..ops.vq import GRAD_SCOPES, check_vq_rerope, soft_vq_attention, vq_attention, windowed_softmax
from ..state import KVCacheState, VQAttentionState
from ._gau_decode import can_decode_token, decode_token, inverse_rms
from .attention import ATTENTION_SCALES
from .fsq import FSQuantizer
from .quantizer import VectorQuantizer
from ._precision import outside_autocast

_ATTENTIONS = ("vq", "fsq", "soft-vq", "softmax")
GAU_VARIANTS = ("linattn", "paper")
_INPUT_MAPS = ("w_q", "w_k", "w_v", "w_g")  # the maps of the normalised input, fused without gradients


def _sinusoids(length: int, dim: int, wavelength: float = 10000.0) -> torch.Tensor:
    """Transformer-XL's fixed relative encodings ``R [length, dim]`` for offsets t = 0..length-1:
    ``[sin(t / lam^(2i/dim)) for i, then cos(...)]`` with ``lam = wavelength`` (the official
    Transformer-VQ code's ``pe_lam``)."""
    inverse_freq = 1.0 / (wavelength ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inverse_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)[:, :dim].float()


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension (no gain)."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def _fused_input_weight(*projections: nn.Linear) -> torch.Tensor:
    """The weights of several linear maps of one input stacked: one matmul for all of them."""
    return torch.cat([projection.weight for projection in projections], dim=0)


def computes_its_parameters(module: nn.Module, kinds: tuple[type, ...]) -> bool:
    """Whether calling ``module`` computes exactly what its parameters say, so that a fast
    path may read them instead of calling it: it is exactly of one of ``kinds``, has no
    forward hook or pre-hook and no ``forward`` of its own (accelerate's device hooks replace
    the instance's). A subclass, a parametrisation or a wrapper (a PEFT LoRA layer, whose
    ``.weight`` is its base layer's weight and whose adapter only its call adds) computes
    something else. Reads no tensor: a few Python checks, as ``Module.__call__`` does
    before every call."""
    return (type(module) in kinds and not (module._forward_hooks or module._forward_pre_hooks)
            and "forward" not in module.__dict__)


def no_global_hooks() -> bool:
    """No forward hook registered for every module (``register_module_forward_hook``)."""
    return not (_global_forward_hooks or _global_forward_pre_hooks)


def _compute_relative_terms(unit: "GAU", dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``P_delta = W_r R_delta`` ``[L + 1, d_k]`` and the bias ``(w - u).P_delta`` ``[L + 1]``
    (paper variant: ``P = d_k^-1/4 W_r dropout(R)``, u and w scaled by ``d_k^-1/4`` too)."""
    sinusoids = unit.sinusoids.to(dtype)
    if unit.variant == "paper":
        sinusoids = F.dropout(sinusoids, unit.sinusoid_dropout, unit.training)
        position_keys = unit.w_r(sinusoids) * unit.d_k ** -0.25
    else:
        position_keys = unit.w_r(sinusoids)
    return position_keys, (unit._bias_scale() * (unit.position_bias - unit.content_bias)) @ position_keys.T


class _BiasedRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * g + b`` (the official Transformer-VQ input norm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Gain 1, bias 0."""
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps) + self.bias


# The kind each submodule must have exactly for a fast path to read its parameters instead
# of calling it (``GAU._reads_plainly``): without gradients the input maps are one fused
# matmul, the relative terms are cached, and the one-token VQ decode reads them all.
_PLAIN_KINDS = {
    **{name: (nn.Linear,) for name in (*_INPUT_MAPS, "w_o", "w_r")},
    "norm": (nn.RMSNorm, _BiasedRMSNorm),
    "quantizer": (VectorQuantizer, FSQuantizer),
}


class GAU(nn.Module):
    """Single-head gated attention unit (Hua et al. 2022) as used by Transformer-VQ.

    ``x~ = RMSNorm(x)``; ``q, k = RMS(W_q x~), RMS(W_k x~)`` each times ``d_k^-1/4`` (so
    ``|q.k| <= sqrt(d_k)``, scale 1); ``v = SiLU(W_v x~)``, ``g = SiLU(W_g x~)``;
    ``y = W_o(attention(q, k, v) * g)``. No projection biases. The residual is left to the
    caller. Relative positions as in Transformer-XL within the window ``0 <= i - j <= L``:
    ``(q_i + u).k_j + (q_i + w).W_r R_{i-j}`` with learned ``u, w, W_r`` and sinusoids R.

    ``attention``: ``"vq"`` (keys quantized by a ``VectorQuantizer``, linear-time
    ``vq_attention``), ``"fsq"`` (keys quantized by an ``FSQuantizer`` on the grid of
    ``fsq_levels``, the same ``vq_attention``), ``"soft-vq"`` (``soft_vq_attention`` with a codebook learned by
    gradient), ``"softmax"`` (the quadratic twin: same layer, exact keys).

    ``variant="paper"`` is the official code's parameterisation: the input norm has a gain
    and a bias (RMS, eps 1e-6); R has width d_model and ``W_r: d_model -> d_k``; the position
    keys and u, w are scaled by ``d_k^-1/4``; ``sinusoid_dropout`` drops entries of R in
    training. ``sinusoid_wavelength``: the ``lam`` of R's frequencies ``lam^(-2i/width)`` (the
    official ``pe_lam``); None takes the variant's, 1e4 (linattn) or the official 1e5 (paper).
    ``grad_scope`` is the VQ unit's
    ``vq_attention`` gradient scope and
    ``commitment_reduction`` its quantizer's (both only for ``attention="vq"``).

    ``rerope=w`` (``attention="vq"`` or ``"fsq"``, ``1 <= w <= block_size``): ReRoPE replaces
    the Transformer-XL terms (u, w, W_r and the sinusoids are not built): the score is
    ``(R(min(i - j, w)) q_i).k_j``, R the rotary rotation with ``rotary_base``: rotary positions
    inside the window, every key further back (the cache included) at distance w
    (``vq_attention(rerope=)``; the efficient-attention survey: with ReRoPE the bias is not needed). Decoding
    takes the one-token path and the native step as without it (``_gau_decode.py``).
    ``scale="entropy"`` (``attention="softmax"`` only) multiplies query i's logits by
    ``log_512(n_i)``, n_i the keys it sees: the entropy-invariant scale (the logits already
    carry ``d_k^-1/2``).

    ``forward(x [B, T, d_model], state=None) -> (y, state, aux)``; ``aux`` holds
    ``commit_loss`` (VQ; zero otherwise) and ``codes``. ``state`` continues the sequence:
    constant-size for VQ and soft-VQ, a growing ``KVCacheState`` for the softmax twin.

    The VQ unit's codebook learns by an exponential moving average, not by gradient: call
    ``unit.quantizer.update()`` (or ``LM.update_codebooks()``) once after each optimizer step,
    and add ``aux["commit_loss"]`` to the loss.

    Args:
        d_model: the width of the input and output.
        d_k: the query/key width (one head).
        d_v: the value and gate width; None: ``2 d_model``.
        codebook_size: S, the codes of the quantizer (``"vq"``) or of the soft codebook
            (``"soft-vq"``).
        block_size: L, the block length: exact attention to the own and the previous block,
            the codebook cache beyond; also the relative-position window.
        attention: ``"vq"``, ``"fsq"``, ``"soft-vq"`` or ``"softmax"`` (above).
        temperature: the soft assignment's temperature (``"soft-vq"``).
        ema_decay: the decay of the codebook's EMA update (``"vq"``).
        commitment_weight: the weight of the commitment loss in ``aux["commit_loss"]`` (``"vq"``).
        kmeans_init: set the codebook by k-means on the first training batch's keys (``"vq"``).
        dead_code_threshold: codes whose EMA count falls below this restart on recent keys
            (``"vq"``; 0: never).
        variant: ``"linattn"`` or ``"paper"`` (the official code's parameterisation; above).
        sinusoid_dropout: dropout on the sinusoids R in training (``variant="paper"``: 0.2 on enwik8).
        sinusoid_wavelength: the ``lam`` of R's frequencies; None: the variant's (above).
        grad_scope: the VQ unit's ``vq_attention`` gradient scope.
        commitment_reduction: the VQ unit's quantizer's reduction of the commitment loss.
        scale: ``"default"`` or ``"entropy"`` (``attention="softmax"`` only; above).
        fsq_levels: the FSQ grid's levels per dimension (``attention="fsq"``).
        rerope: ReRoPE's window w (``"vq"`` or ``"fsq"``; above); None: Transformer-XL's terms.
        rotary_base: the base of the rotary frequencies of ReRoPE.
    """

    def __init__(
        self,
        d_model: int,
        *,
        d_k: int = 128,
        d_v: int | None = None,
        codebook_size: int = 512,
        block_size: int = 128,
        attention: str = "vq",
        temperature: float = 1.0,
        ema_decay: float = 0.99,
        commitment_weight: float = 1e-4,
        kmeans_init: bool = False,
        dead_code_threshold: float = 0.0,
        variant: str = "linattn",
        sinusoid_dropout: float = 0.0,
        sinusoid_wavelength: float | None = None,
        grad_scope: str = "cache",
        commitment_reduction: str = "mean",
        scale: str = "default",
        fsq_levels: tuple[int, ...] = (8, 5, 5, 5),
        rerope: int | None = None,
        rotary_base: float = 10000.0,
    ):
        super().__init__()
        if attention not in _ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(_ATTENTIONS)}; got {attention!r}")
        self.rerope = check_vq_rerope(rerope, rotary_base, d_k, block_size, True)
        self.rotary_base = float(rotary_base)
        if rerope is not None and attention not in ("vq", "fsq"):
            raise ValueError(f"rerope is for the VQ units (attention='vq' or 'fsq'), got attention={attention!r}")
        if rerope is not None and sinusoid_dropout:
            raise ValueError(f"sinusoid_dropout={sinusoid_dropout!r}: a rerope unit has no sinusoids (ReRoPE replaces "
                             "the relative terms); set it to 0")
        check_choice("variant", variant, GAU_VARIANTS)
        check_choice("scale", scale, ATTENTION_SCALES)
        if scale == "entropy" and attention != "softmax":
            raise ValueError(f"scale='entropy' is for the exact softmax unit (attention='softmax'), got {attention!r}")
        self.scale = scale
        check_choice("grad_scope", grad_scope, GRAD_SCOPES)
        if not is_number(sinusoid_dropout) or not 0.0 <= sinusoid_dropout < 1.0:
            raise ValueError(f"sinusoid_dropout must be in [0, 1), got {sinusoid_dropout!r}")
        self.variant, self.sinusoid_dropout, self.grad_scope = variant, float(sinusoid_dropout), grad_scope
        if sinusoid_wavelength is None:
            sinusoid_wavelength = 1e5 if variant == "paper" else 1e4
        self.sinusoid_wavelength = check_positive_number("sinusoid_wavelength", sinusoid_wavelength, finite=True)
        d_v = 2 * d_model if d_v is None else d_v
        self.d_model, self.d_k, self.d_v, self.block_size = d_model, d_k, d_v, block_size
        self.attention, self.temperature = attention, temperature
        paper = variant == "paper"
        self.norm = _BiasedRMSNorm(d_model) if paper else nn.RMSNorm(d_model)
        self.w_q = nn.Linear(d_model, d_k, bias=False)
        self.w_k = nn.Linear(d_model, d_k, bias=False)
        self.w_v = nn.Linear(d_model, d_v, bias=False)
        self.w_g = nn.Linear(d_model, d_v, bias=False)
        self.w_o = nn.Linear(d_v, d_model, bias=False)
        self._sinusoid_width = d_model if paper else d_k
        if self.rerope is None:  # Transformer-XL's relative terms (ReRoPE replaces them)
            self.w_r = nn.Linear(self._sinusoid_width, d_k, bias=False)
            self.content_bias = nn.Parameter(torch.empty(d_k))  # u
            self.position_bias = nn.Parameter(torch.empty(d_k))  # w
            self.register_buffer("sinusoids", torch.empty(block_size + 1, self._sinusoid_width), persistent=False)
        self.quantizer = None
        self.codebook = None
        if attention == "vq":
            self.quantizer = VectorQuantizer(
                1, d_k, codebook_size, ema_decay=ema_decay, commitment_weight=commitment_weight,
                kmeans_init=kmeans_init, dead_code_threshold=dead_code_threshold, init_scale=d_k ** -0.25,
                commitment_reduction=commitment_reduction,
            )
        elif attention == "fsq":
            self.quantizer = FSQuantizer(1, d_k, fsq_levels, init_scale=d_k ** -0.25)
        elif attention == "soft-vq":
            self.codebook = nn.Parameter(torch.empty(1, codebook_size, d_k))
        # the number of codes S of this unit's states (the FSQ grid's size for "fsq"; None for softmax)
        self.codebook_size = (self.quantizer.codebook_size if self.quantizer is not None
                              else codebook_size if attention == "soft-vq" else None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The unit's own tensors as a new unit has them (its maps, norm and quantizer reset their
        own): the relative biases u and w zero, the sinusoids, and a soft-VQ codebook drawn from
        ``N(0, d_k^-1/2)``."""
        if self.rerope is None:
            nn.init.zeros_(self.content_bias)
            nn.init.zeros_(self.position_bias)
        self._reset_buffers()
        if self.codebook is not None:
            codes = torch.randn(self.codebook.shape, dtype=self.codebook.dtype, device=self.codebook.device)
            self.codebook.copy_(codes * self.d_k ** -0.25)

    @torch.no_grad()
    def _reset_buffers(self) -> None:
        """Recompute the non-persistent ``sinusoids`` (a function of the block size, width and
        wavelength, in the dtype of the weights, where the buffer is), for models materialised
        without them (Hugging Face ``from_pretrained``)."""
        if self.rerope is None:
            self.sinusoids = _sinusoids(self.block_size + 1, self._sinusoid_width, self.sinusoid_wavelength).to(
                dtype=self.w_r.weight.dtype, device=self.sinusoids.device)

    def forward(
        self, x: torch.Tensor, state: VQAttentionState | KVCacheState | None = None
    ) -> tuple[torch.Tensor, VQAttentionState | KVCacheState, dict]:
        check_layer_input(x, self.d_model)
        if state is not None:
            self._check_state(state, x)
        if can_decode_token(self, x, state):
            return decode_token(self, x, state)
        h = self.norm(x)
        scale = self.d_k ** -0.25
        if torch.is_grad_enabled() or not self._reads_plainly(_INPUT_MAPS):  # (an adapter is called)
            q, k, v, gate = self.w_q(h), self.w_k(h), self.w_v(h), self.w_g(h)
            q, k, v, gate = _rms(q) * scale, _rms(k) * scale, F.silu(v), F.silu(gate)
        else:  # one matmul for q, k and the gate, one normalisation for q and k: calls cost
            # v by a matmul of its own, contiguous: the attention reads it in blocks (a column
            # slice of the fused product would be copied there)
            projected = F.linear(h, self._input_weight_without_values())
            v = F.silu(F.linear(h, self.w_v.weight), inplace=True)
            qk, gate = projected.split([2 * self.d_k, self.d_v], dim=-1)
            qk = qk.unflatten(-1, (2, self.d_k))
            qk.mul_(inverse_rms(qk, 1e-6).mul_(scale))  # _rms(qk) * scale, in place: qk is a fresh tensor's view
            q, k = qk.unbind(-2)
            gate = F.silu(gate, inplace=True)  # a view of a fresh tensor
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # [B, 1, T, .]
        # The attention ops keep their own precision (float32 sums and softmax); under
        # autocast they run outside it, on one dtype (that of the projected keys).
        dtype = k.dtype
        if self.rerope is None:
            position_keys, bias = self._relative_terms(x.dtype)
            queries = (q + self._bias_scale() * self.content_bias).to(dtype)
            v, bias, position_keys = v.to(dtype), bias.to(dtype), position_keys.to(dtype)
        else:  # ReRoPE: the op rotates q
            queries, v, bias, position_keys = q.to(dtype), v.to(dtype), None, None
        with outside_autocast(x.device.type):
            out, state, aux = self._attend(queries, k, v, bias, position_keys, state, x.new_zeros(()))
        gated = out.squeeze(1) * gate if torch.is_grad_enabled() else out.squeeze(1).mul_(gate)  # out: a fresh tensor
        y = self.w_o(gated)
        return y, state, aux

    def _reads_plainly(self, names: tuple[str, ...]) -> bool:
        """Whether the fast paths may read the parameters of the submodules ``names`` instead
        of calling them: each is exactly its plain kind (``nn.Linear``, the input norm, the
        VQ quantizer) without forward hooks, and no global forward hook is registered. A PEFT
        LoRA layer, a subclass or a hook sends the layer down the general path, which calls
        every module. Python checks only: no tensor is read, no graph breaks."""
        if not no_global_hooks():
            return False
        modules = self._modules  # the registry itself: Module.__getattr__ costs more than the checks
        for name in names:
            if not computes_its_parameters(modules[name], _PLAIN_KINDS[name]):
                return False
        return True

    def _input_weight(self) -> torch.Tensor:
        """``[W_q; W_k; W_v; W_g]`` ``[2 d_k + 2 d_v, d_model]``, built once while gradients are
        off (for plain projections: ``_reads_plainly``)."""
        maps = (self.w_q, self.w_k, self.w_v, self.w_g)
        return self._cached("input", lambda: _fused_input_weight(*maps), tuple(m.weight for m in maps))

    def _input_weight_without_values(self) -> torch.Tensor:
        """``[W_q; W_k; W_g]`` ``[2 d_k + d_v, d_model]``, as ``_input_weight``."""
        maps = (self.w_q, self.w_k, self.w_g)
        return self._cached("input_qkg", lambda: _fused_input_weight(*maps), tuple(m.weight for m in maps))

    def _bias_scale(self) -> float:
        """The factor of u and w in the scores: ``d_k^-1/4`` in the paper variant, else 1."""
        return self.d_k ** -0.25 if self.variant == "paper" else 1.0

    def _relative_terms(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``P_delta = W_r R_delta`` ``[L + 1, d_k]`` and the bias ``(w - u).P_delta`` ``[L + 1]``.

        They depend on the parameters only, so while gradients are off (decoding, evaluation)
        they are computed once and reused until a parameter changes (its storage or version),
        unless ``w_r`` is not a plain linear map (an adapter's output follows its own weights
        and its on/off switch): then they are computed at every call.
        """
        if (torch.is_grad_enabled() or (self.training and self.sinusoid_dropout > 0)
                or not self._reads_plainly(("w_r",))):
            return _compute_relative_terms(self, dtype)
        depends = (self.w_r.weight, self.content_bias, self.position_bias)
        return self._cached("relative", lambda: _compute_relative_terms(self, dtype), depends, dtype)

    def _check_state(self, state, x: torch.Tensor) -> None:
        """A carried state continues this unit for the rows of ``x``: its kind, the settings it
        was made with (block and codebook size; a softmax cache has no window), its batch size
        and widths. For VQ these are the cheap checks that ``vq_attention(check_inputs=False)``
        and the one-token decode step leave out (comparisons of a few sizes, no tensor read), for
        soft-VQ states too (which ``vq_attention`` checks in full where a step takes it)."""
        batch = x.shape[0]
        if self.attention == "softmax":
            if not isinstance(state, KVCacheState):
                raise TypeError(f"the softmax GAU's state is a KVCacheState, got {type(state).__name__}")
            if state.window is not None:
                raise ValueError(f"state was made by local attention with window={state.window}, but this softmax "
                                 "unit keeps every key (a cache with window=None)")
            check_state_batch("state", state.keys, batch)
            past = state.keys.shape[2] if isinstance(state.keys, torch.Tensor) and state.keys.dim() == 4 else 0
            check_state_tensor("state.keys", state.keys, (batch, 1, past, self.d_k), x)
            check_state_tensor("state.values", state.values, (batch, 1, past, self.d_v), x)
            return
        if not isinstance(state, VQAttentionState):
            raise TypeError(f"the {self.attention} GAU's state is a VQAttentionState, got {type(state).__name__}")
        L, S = self.block_size, self.codebook_size
        settings = (("block_size", state.block_size, L), ("codebook_size", state.codebook_size, S))
        for setting, made_with, ours in settings:
            if made_with is not None and made_with != ours:
                raise ValueError(f"state was made with {setting}={made_with}, but this unit's {setting} is {ours}")
        check_state_batch("state", state.cache_counts, batch)
        if state.partial_keys.shape[2] >= L or (state.prev_keys is not None and state.prev_keys.shape[2] != L):
            raise ValueError(f"state was made with another block size: it holds a partial block of "
                             f"{state.partial_keys.shape[2]} and a previous block of "
                             f"{None if state.prev_keys is None else state.prev_keys.shape[2]} positions, "
                             f"this unit's block_size is {L}")
        if state.cache_counts.shape[-1] != S:
            raise ValueError(f"state was made with codebook_size={state.cache_counts.shape[-1]} (its cache has as "
                             f"many slots), but this unit's codebook_size is {S}")
        if state.partial_keys.shape[-1] != self.d_k or state.cache_means.shape[-1] != self.d_v:
            raise ValueError(f"state holds keys of width {state.partial_keys.shape[-1]} and values of width "
                             f"{state.cache_means.shape[-1]}, but this unit has d_k={self.d_k}, d_v={self.d_v}")

    def train(self, mode: bool = True) -> "GAU":
        """``nn.Module.train``; also forgets the no-grad caches, so weights written through
        ``.data`` (which bumps no version counter) are picked up at the next mode switch."""
        self.__dict__.pop("_no_grad_cache", None)
        return super().train(mode)

    def __setattr__(self, name: str, value) -> None:
        """``nn.Module.__setattr__``; also forgets the no-grad caches. Replacing a submodule is
        how PEFT injects an adapter and how ``merge_and_unload`` puts the base layer back, its
        weight merged through ``.data`` (same storage, no version bump): the cached weights
        would otherwise still be the unmerged ones."""
        self.__dict__.pop("_no_grad_cache", None)
        super().__setattr__(name, value)

    def _cached(self, name: str, compute, depends: tuple[torch.Tensor, ...], *extra):
        """``compute()``, remembered under ``name`` while gradients are off, until one of the
        tensors it ``depends`` on changes (storage or version: the optimizer and
        ``load_state_dict`` write in place and bump the version) or ``extra`` differs.
        Writes through ``.data`` bump no version: they are seen after ``train()``/``eval()``."""
        if torch.compiler.is_compiling():  # storage and version are not traceable; the graph computes it
            return compute()
        versions = [tensor_version(t) for t in depends]
        if None in versions:  # an inference tensor: a write to it could not be seen
            return compute()
        key = (*extra, *((t.data_ptr(), version) for t, version in zip(depends, versions)))
        cache = self.__dict__.setdefault("_no_grad_cache", {})
        if name not in cache or cache[name][0] != key:
            cache[name] = (key, compute())
        return cache[name][1]

    def _attend(self, queries, k, v, bias, position_keys, state, zero):
        """VQ / soft-VQ / exact windowed softmax over ``[B, 1, T, .]`` inputs -> (out, state, aux)."""
        dtype, T = k.dtype, k.shape[2]
        aux = {"commit_loss": zero, "codes": None}
        common = dict(block_size=self.block_size, bias=bias, position_keys=position_keys, scale=1.0)
        if self.attention in ("vq", "fsq"):
            k_hat, codes, aux["commit_loss"] = self.quantizer(k)
            aux["codes"] = codes
            out, state = vq_attention(
                queries, k_hat, v, codes, self.quantizer.codebook.to(dtype), grad_scope=self.grad_scope,
                initial_state=state, output_final_state=True, check_inputs=False, rerope=self.rerope,
                rotary_base=self.rotary_base, **common,
            )
        elif self.attention == "soft-vq":
            wide = torch.float64 if dtype == torch.float64 else torch.float32  # soft keys are built in float32
            common.update(bias=bias.to(wide), position_keys=position_keys.to(wide))
            out, state = soft_vq_attention(
                queries.to(wide), k.to(wide), v.to(wide), self.codebook.to(wide), temperature=self.temperature,
                initial_state=state, output_final_state=True, **common,
            )
            out = out.to(dtype)
        else:
            past = 0 if state is None else state.keys.shape[2]
            state = kv_cache.extend(state, k, v)
            row_scale = None
            if self.scale == "entropy":  # log_512(n): the logits already carry d_k^-1/2
                row_scale = entropy_scale(torch.arange(past + 1, past + T + 1, device=k.device, dtype=dtype), 1)
            out = windowed_softmax(
                queries.unsqueeze(2), state.keys, state.values, bias.reshape(1, 1, -1),
                position_keys.reshape(1, 1, *position_keys.shape), self.block_size, True, past=past,
                row_scale=row_scale,
            ).squeeze(2)
        return out, state, aux
