"""Feature maps phi for kernel attention: ``softmax(q.k) ~ phi(q).phi(k)``.

Every map is a small object with ``dim_out(d)`` (feature dimension for input dimension
``d``) and ``__call__(x, is_query=...)`` mapping ``[..., d] -> [..., dim_out(d)]``.
Exponential maps (``exp``, ``FAVOR``) also give ``log_features``; kernel attention then
applies max-subtraction stabilisers that cancel exactly in the normalised output.

Maps compute in the dtype they are given; ``linear_attention`` hands them float32
(float64 for float64 inputs), so half-precision inputs never overflow here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..._checks import check_int, check_positive_number


class FeatureMap:
    """Base class. Subclasses implement ``dim_out`` and ``__call__`` (or ``log_features``)."""

    name: str = "feature_map"
    #: True when phi(x) = exp(log_features(x)): strictly positive and stabilisable.
    exponential: bool = False

    def dim_out(self, d: int) -> int:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        if self.exponential:
            return torch.exp(self.log_features(x, is_query=is_query))
        raise NotImplementedError

    def log_features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} is not an exponential feature map")

    def prepare(self, d: int) -> None:
        """Draw now whatever the map needs for input dimension ``d`` (FAVOR+: its projection),
        so that no random draw happens inside a ``torch.compile`` region. Layers call it at
        construction; the default does nothing."""

    def describe(self) -> str:
        """The map's identity as text: its name and every parameter that changes phi's values
        (``"elu"``, ``"dpfp:2"``, ``"favor:128:seed=3"``). Kernel-attention states record it,
        so a state is continued only by the map that made it. A subclass without a ``name``
        of its own is described by its class name; one with parameters extends the text."""
        return self.name if self.name != FeatureMap.name else type(self).__qualname__

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class EluPlusOne(FeatureMap):
    """phi(x) = elu(x) + 1 (Katharopoulos et al. 2020); dim d."""

    name = "elu"

    def dim_out(self, d: int) -> int:
        return d

    def __call__(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        return F.elu(x) + 1.0


class ReLU(FeatureMap):
    """phi(x) = max(x, 0); dim d."""

    name = "relu"

    def dim_out(self, d: int) -> int:
        return d

    def __call__(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        return F.relu(x)


class Identity(FeatureMap):
    """phi(x) = x (plain linear attention / fast weights without a kernel); dim d."""

    name = "identity"

    def dim_out(self, d: int) -> int:
        return d

    def __call__(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        return x


class Exp(FeatureMap):
    """phi(x) = exp(x) elementwise; dim d. Exponential, so stabilised by max-subtraction."""

    name = "exp"
    exponential = True

    def dim_out(self, d: int) -> int:
        return d

    def log_features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        return x


class DPFP(FeatureMap):
    """Deterministic parameter-free projection (Schlag et al. 2021), dim ``2 d nu``.

    ``r = [relu(x), relu(-x)]`` (dim 2d), ``phi(x) = concat_{j=1..nu} r * roll(r, j)``.
    Non-negative and sparse.
    """

    name = "dpfp"

    def __init__(self, nu: int = 1):
        check_int("DPFP nu", nu)
        self.nu = nu
        self._identity = f"dpfp:{nu}"

    def dim_out(self, d: int) -> int:
        return 2 * d * self.nu

    def __call__(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
        return torch.cat([r * torch.roll(r, shifts=j, dims=-1) for j in range(1, self.nu + 1)], dim=-1)

    def describe(self) -> str:
        return self._identity

    def __repr__(self) -> str:
        return f"DPFP(nu={self.nu})"


class Taylor(FeatureMap):
    """Second-order Taylor features, dim ``1 + d + d^2``.

    ``phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))]`` so that
    ``phi(q).phi(k) = 1 + s + s^2/2`` with ``s = q.k / sqrt(d)``: the Taylor series of
    ``exp(s)`` to second order (always positive).
    """

    name = "taylor"

    def dim_out(self, d: int) -> int:
        return 1 + d + d * d

    def __call__(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        d = x.shape[-1]
        ones = torch.ones_like(x[..., :1])
        first = x * d ** -0.25
        second = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / (math.sqrt(2.0) * math.sqrt(d))
        return torch.cat([ones, first, second], dim=-1)


class FAVOR(FeatureMap):
    """Performer's FAVOR+: positive orthogonal random features, dim ``num_features``.

    With ``x' = x d^(-1/4)`` and rows ``w_i`` of the projection ``W [m, d]``,
    ``phi(x)_i = exp(w_i.x' - |x'|^2 / 2) / sqrt(m)``, so that
    ``E[phi(q).phi(k)] = exp(q.k / sqrt(d))`` (unbiased softmax-kernel estimate).
    ``W`` stacks blocks of ``d`` orthogonal directions (QR of Gaussian blocks) whose row
    norms are drawn from the chi distribution with ``d`` degrees of freedom, so each
    row is marginally ``N(0, I)``. The draw is a pure function of ``seed`` and ``d``;
    the caller decides when to redraw (``redraw(seed)``).
    """

    name = "favor"
    exponential = True

    def __init__(self, num_features: int = 256, *, seed: int = 0, orthogonal: bool = True):
        check_int("FAVOR num_features", num_features)
        self.num_features = num_features
        self.orthogonal = orthogonal
        self.seed = int(seed)
        self._identity = self._describe()
        self._draws: dict[int, torch.Tensor] = {}  # float64 projections by input dimension
        self._cache: dict[tuple, torch.Tensor] = {}  # converted copies by (d, device, dtype)

    def dim_out(self, d: int) -> int:
        return self.num_features

    def redraw(self, seed: int | None = None) -> None:
        """Draw a new projection: from ``seed``, or from the current seed + 1."""
        self.seed = self.seed + 1 if seed is None else int(seed)
        self._identity = self._describe()
        dims = list(self._draws)
        self._draws.clear()
        self._cache.clear()
        for d in dims:
            self.prepare(d)

    def prepare(self, d: int) -> None:
        if d not in self._draws:
            self._draws[d] = _favor_projection(self.seed, d, self.num_features, self.orthogonal)

    def projection(self, d: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
        """The ``[num_features, d]`` projection for input dimension ``d``."""
        if torch.compiler.is_compiling():  # converted inside the graph, nothing stored
            if d not in self._draws:
                raise RuntimeError(f"FAVOR's projection for dimension {d} is drawn outside torch.compile: call "
                                   f"prepare({d}) before compiling (the Attention layer does it at construction)")
            return self._draws[d].to(device=device, dtype=dtype)
        key = (d, str(device), dtype)
        if key not in self._cache:
            self.prepare(d)
            self._cache[key] = self._draws[d].to(device=device, dtype=dtype)
        return self._cache[key]

    def log_features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        d = x.shape[-1]
        x = x * d ** -0.25
        proj = self.projection(d, device=x.device, dtype=x.dtype)
        # In place on the product (one [.., m] temporary instead of three), and an add of the
        # negated [.., 1] term so that the backward does not negate an [.., m] gradient.
        offset = (x * x).sum(-1, keepdim=True).mul(-0.5).sub_(0.5 * math.log(self.num_features))
        return (x @ proj.T).add_(offset)

    def describe(self) -> str:
        return self._identity  # a string made when the seed is set: a compiled call reads a constant

    def _describe(self) -> str:
        return f"favor:{self.num_features}:seed={self.seed}{'' if self.orthogonal else ':iid'}"

    def __repr__(self) -> str:
        return f"FAVOR(num_features={self.num_features}, seed={self.seed}, orthogonal={self.orthogonal})"


def _favor_projection(seed: int, d: int, m: int, orthogonal: bool) -> torch.Tensor:
    """FAVOR+'s ``[m, d]`` float64 projection drawn from ``seed`` (see ``FAVOR``), on the CPU
    whatever the default device (a model built on the meta device draws real values)."""
    gen = torch.Generator().manual_seed(seed)
    cpu = dict(generator=gen, dtype=torch.float64, device="cpu")
    if not orthogonal:
        return torch.randn(m, d, **cpu)
    blocks = []
    for _ in range(math.ceil(m / d)):
        gaussian = torch.randn(d, d, **cpu)
        q, r = torch.linalg.qr(gaussian)
        # Fix QR's sign convention so the directions are Haar-distributed (unbiased).
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        blocks.append(q.T)
    directions = torch.cat(blocks, dim=0)[:m]
    norms = torch.randn(m, d, **cpu).norm(dim=-1, keepdim=True)
    return directions * norms


class SoftVQ(FeatureMap):
    """Performer as a soft Transformer-VQ: features indexed by a codebook ``C [S, d]``.

    ``phi_q(q)_y = exp(q.c_y - max_y q.c_y)``, ``phi_k(k)_y = softmax_y(-|k - c_y|^2 / 2 tau)``, so
    ``phi_q(q).phi_k(k) -> exp(q.c_z(k) - max)`` as ``tau -> 0``: hard VQ attention's kernel.
    Queries are expected pre-scaled (the map applies no ``d^-1/2``). Dim S.
    """

    name = "soft-vq"

    def __init__(self, codebook: torch.Tensor, temperature: float = 1.0):
        if not isinstance(codebook, torch.Tensor) or codebook.dim() != 2 or not codebook.is_floating_point():
            raise ValueError("SoftVQ codebook must be a floating-point tensor [S, d]")
        check_positive_number("SoftVQ temperature", temperature)
        self.codebook, self.temperature = codebook, float(temperature)
        self._identity = f"soft-vq:{codebook.shape[0]}:temperature={self.temperature}"

    def dim_out(self, d: int) -> int:
        if d != self.codebook.shape[1]:
            raise ValueError(f"SoftVQ codebook has dimension {self.codebook.shape[1]} but the inputs have {d}")
        return self.codebook.shape[0]

    def __call__(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        codebook = self.codebook.to(device=x.device, dtype=x.dtype)
        if is_query:
            logits = x @ codebook.T
            return torch.exp(logits - logits.amax(-1, keepdim=True).detach())
        distances = (x.unsqueeze(-2) - codebook).pow(2).sum(-1)
        return torch.softmax(-distances / (2.0 * self.temperature), dim=-1)

    def describe(self) -> str:
        return self._identity

    def __repr__(self) -> str:
        return f"SoftVQ(codebook_size={self.codebook.shape[0]}, temperature={self.temperature})"


def normalized_features(
    fmap: FeatureMap, x: torch.Tensor, *, is_query: bool, normalize: str | None, eps: float = 1e-6
) -> torch.Tensor:
    """phi(x) normalised per row: ``"sum"`` -> ``phi / (sum(phi) + eps)`` (a softmax over
    the log-features for exponential maps, exact without eps), ``"l2"`` ->
    ``phi / max(|phi|, eps)``, ``None`` -> ``phi``."""
    if normalize == "sum":
        if fmap.exponential:
            return torch.softmax(fmap.log_features(x, is_query=is_query), dim=-1)
        phi = fmap(x, is_query=is_query)
        return phi / (phi.sum(-1, keepdim=True) + eps)
    phi = fmap(x, is_query=is_query)
    if normalize == "l2":
        return phi / phi.norm(dim=-1, keepdim=True).clamp_min(eps)
    return phi


_BY_NAME = {
    "elu": EluPlusOne,
    "relu": ReLU,
    "identity": Identity,
    "exp": Exp,
    "favor": FAVOR,
    "dpfp": DPFP,
    "taylor": Taylor,
}


def get_feature_map(spec: str | FeatureMap) -> FeatureMap:
    """Resolve ``spec``: a ``FeatureMap`` instance, or a name (``"elu"``, ``"relu"``,
    ``"identity"``, ``"exp"``, ``"taylor"``, ``"favor"``/``"favor:M"``, ``"dpfp"``/``"dpfp:NU"``)."""
    if isinstance(spec, FeatureMap):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"feature_map must be a name or a FeatureMap, got {type(spec).__name__}")
    name, _, arg = spec.lower().partition(":")
    if name not in _BY_NAME:
        raise ValueError(
            f"feature_map must be one of {', '.join(sorted(_BY_NAME))} (FAVOR and DPFP take ':N'); got {spec!r}"
        )
    if ":" not in spec:
        return _BY_NAME[name]()
    if name not in ("favor", "dpfp") or not arg.isdigit() or int(arg) < 1:
        raise ValueError(f"feature_map {spec!r}: only 'favor:M' and 'dpfp:NU' take an argument, a positive integer")
    return _BY_NAME[name](int(arg))
