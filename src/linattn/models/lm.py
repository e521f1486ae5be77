"""``LM``: a decoder-only byte-level language model over any mix of attention mechanisms."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_int
from ..nn.attention import Attention, truncate_cache
from ..nn.delta_net import DeltaNet
from ..nn.gau import GAU
from ..ops.feature_maps import FAVOR
from ..state import KVCacheState, LMState
from .config import GAU_KINDS, LayerSpec, LMConfig
from .sampling import sample_next


class _SwiGLU(nn.Module):
    """``W_down(SiLU(W_gate x) * W_up x)``, no biases."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


def _mixer(config: LMConfig, spec: LayerSpec, index: int) -> nn.Module:
    """The token mixer of a pre-norm block for ``spec`` (every kind except the GAU pairs)."""
    heads = dict(n_kv_heads=config.n_kv_heads, head_dim=config.head_dim)
    if spec.kind == "delta":
        feature_map = spec.option or "identity"
        normalize = "l2" if feature_map == "identity" else "sum"
        return DeltaNet(config.d_model, config.n_heads, feature_map=feature_map, normalize=normalize,
                        short_conv=config.delta_short_conv, chunk_size=config.chunk_size, **heads)
    common = dict(chunk_size=config.chunk_size, rotary_base=config.rotary_base, **heads)
    if spec.kind == "linear":
        return Attention(config.d_model, config.n_heads, mechanism="linear", feature_map=spec.option, **common)
    if spec.kind == "favor":
        features = FAVOR(int(spec.option or config.favor_features), seed=config.feature_seed + index)
        return Attention(config.d_model, config.n_heads, mechanism="linear", feature_map=features, **common)
    if spec.kind == "local":
        window = int(spec.option or config.local_window)
        return Attention(config.d_model, config.n_heads, mechanism="local", window=window, **common)
    return Attention(config.d_model, config.n_heads, mechanism="softmax", **common)


class _Block(nn.Module):
    """Pre-norm block: ``x + mixer(norm(x))`` then ``x + SwiGLU(norm(x))``."""

    def __init__(self, config: LMConfig, spec: LayerSpec, index: int):
        super().__init__()
        self.spec = spec
        self.mixer_norm = nn.RMSNorm(config.d_model)
        self.mixer = _mixer(config, spec, index)
        self.ffn_norm = nn.RMSNorm(config.d_model)
        self.ffn = _SwiGLU(config.d_model, config.ffn_width)

    def forward(self, x, state):
        mixed, state = self.mixer(self.mixer_norm(x), state)
        x = x + mixed
        return x + self.ffn(self.ffn_norm(x)), state, []


class _GAUPair(nn.Module):
    """Transformer-VQ's layer: two gated attention units, each ``x + GAU(x)`` (pre-norm inside)."""

    def __init__(self, config: LMConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        options = dict(
            d_k=config.gau_d_k, d_v=config.gau_d_v, codebook_size=config.codebook_size,
            block_size=config.block_size, attention=GAU_KINDS[spec.kind],
            temperature=config.soft_vq_temperature, ema_decay=config.ema_decay,
            commitment_weight=config.commitment_weight, kmeans_init=config.kmeans_init,
            dead_code_threshold=config.dead_code_threshold,
        )
        self.units = nn.ModuleList([GAU(config.d_model, **options) for _ in range(2)])

    def forward(self, x, state):
        states, auxes = [], []
        for unit, unit_state in zip(self.units, state or (None, None)):
            y, unit_state, aux = unit(x, unit_state)
            x = x + y
            states.append(unit_state)
            auxes.append(aux)
        return x, tuple(states), auxes


class LM(nn.Module):
    """Decoder-only language model: token embedding, ``n_layers`` layers (each a GAU pair or
    a pre-norm attention + SwiGLU block, per ``config.attention``), final RMSNorm, output
    head (tied to the embedding by default).

    ``forward(ids [B, T] int64, state=None) -> (logits [B, T, vocab], LMState, aux)``
    (logits in float32, or float64 for a float64 model)
    where ``aux`` holds ``commit_loss`` (sum of the VQ commitment losses, already weighted;
    add it to the training loss) and ``codebook_perplexity`` (mean over VQ units of
    exp(entropy) of this batch's code histogram; None without VQ layers). Passing the
    returned state back continues the sequence: token-by-token decoding equals the full pass.
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.specs = config.layer_specs()
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(
            _GAUPair(config, spec) if spec.is_gau else _Block(config, spec, i) for i, spec in enumerate(self.specs)
        )
        self.norm = nn.RMSNorm(config.d_model)
        self.head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        output_std = self.config.init_std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                last = name.rsplit(".", 1)[-1]
                std = output_std if last in ("o_proj", "w_o", "w_down") else self.config.init_std
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _check_ids(self, ids: torch.Tensor) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32, torch.uint8, torch.int16):
            raise TypeError(f"ids must be an integer tensor [batch, length], got {type(ids).__name__} "
                            f"{getattr(ids, 'dtype', '')}")
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must have shape [batch, length] with length >= 1, got {list(ids.shape)}")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(f"ids must lie in [0, {self.config.vocab_size}), got values in [{low}, {high}]")

    def forward(self, ids: torch.Tensor, state: LMState | None = None) -> tuple[torch.Tensor, LMState, dict]:
        self._check_ids(ids)
        if state is not None and (not isinstance(state, LMState) or len(state.layers) != len(self.layers)):
            raise ValueError(f"state must be the LMState this model returned ({len(self.layers)} layers), "
                             f"got {type(state).__name__}")
        x = self.embed(ids.long())
        layer_states = state.layers if state is not None else (None,) * len(self.layers)
        new_states, unit_aux = [], []
        for layer, layer_state in zip(self.layers, layer_states):
            x, layer_state, aux = layer(x, layer_state)
            new_states.append(layer_state)
            unit_aux.extend(aux)
        h = self.norm(x)
        logits = h @ self.embed.weight.T if self.head is None else self.head(h)
        steps = ids.shape[1] + (state.steps if state is not None else 0)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return logits, LMState(layers=tuple(new_states), steps=steps), self._aux(x, unit_aux)

    def _aux(self, x: torch.Tensor, unit_aux: list[dict]) -> dict:
        commit = x.new_zeros((), dtype=torch.float32)
        perplexities = []
        for aux in unit_aux:
            commit = commit + aux["commit_loss"].float()
            if aux["codes"] is not None:
                counts = torch.bincount(aux["codes"].flatten(), minlength=self.config.codebook_size).float()
                probs = counts / counts.sum()
                perplexities.append(torch.exp(-(probs * probs.clamp_min(1e-30).log()).sum()))
        perplexity = torch.stack(perplexities).mean() if perplexities else None
        return {"commit_loss": commit, "codebook_perplexity": perplexity}

    # -- training helpers ------------------------------------------------------------------

    def quantizers(self) -> list[nn.Module]:
        return [unit.quantizer for layer in self.layers if isinstance(layer, _GAUPair)
                for unit in layer.units if unit.quantizer is not None]

    @torch.no_grad()
    def update_codebooks(self) -> None:
        """The EMA codebook update of every VQ unit; call once per optimizer step."""
        for quantizer in self.quantizers():
            quantizer.update()

    def codebook_usage(self) -> dict[str, float] | None:
        """Mean EMA code perplexity and total dead codes over the VQ units (None without any)."""
        quantizers = self.quantizers()
        if not quantizers:
            return None
        usages = [q.usage() for q in quantizers]
        return {
            "perplexity": float(torch.stack([u["perplexity"].float().mean() for u in usages]).mean()),
            "dead_codes": int(sum(int(u["dead_codes"].sum()) for u in usages)),
        }

    def carry(self, state: LMState) -> LMState:
        """The state to pass to the next training/eval window: detached (Transformer-XL),
        exact-softmax caches (``softmax`` and ``gau-softmax`` layers) cut to the last
        ``config.softmax_memory`` keys so memory and time per window stay bounded."""
        layers = []
        for spec, layer_state in zip(self.specs, state.detach().layers):
            if spec.kind == "softmax":
                layer_state = truncate_cache(layer_state, self.config.softmax_memory)
            elif spec.kind == "gau-softmax":
                layer_state = tuple(truncate_cache(unit, self.config.softmax_memory) for unit in layer_state)
            layers.append(layer_state)
        return LMState(layers=tuple(layers), steps=state.steps)

    # -- generation ------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor | list[int],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        state: LMState | None = None,
    ) -> Iterator:
        """Stream ``max_new_tokens`` sampled tokens after the prompt.

        ``prompt_ids``: ``[T]`` (yields ints) or ``[B, T]`` (yields ``[B]`` tensors). The
        prompt is read in one pass, then one token per step with the carried state, so the
        memory per step is constant for every recurrent mechanism (VQ, linear, FAVOR,
        delta, local) and grows only for exact softmax's KV cache. ``temperature=0`` is
        greedy; ``top_k``/``top_p`` filter before sampling; ``seed`` makes it reproducible.
        The model is in eval mode while generating (no codebook statistics).
        """
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=self.embed.weight.device)
        single = ids.dim() == 1
        if single:
            ids = ids.unsqueeze(0)
        check_int("max_new_tokens", max_new_tokens, minimum=0)
        generator = torch.Generator(device=ids.device)
        generator.manual_seed(torch.seed() if seed is None else seed)
        was_training = self.training
        self.eval()
        try:
            logits, state, _ = self(ids, state)
            for _ in range(max_new_tokens):
                token = sample_next(logits[:, -1], temperature=temperature, top_k=top_k, top_p=top_p,
                                    generator=generator)
                yield int(token[0]) if single else token
                logits, state, _ = self(token.unsqueeze(1), state)
        finally:
            self.train(was_training)
