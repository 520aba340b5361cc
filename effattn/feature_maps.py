"""Feature maps phi for linear attention: `phi(q) . phi(k)` stands in for the softmax kernel.

Named maps (``"elu"``, ``"relu"``, ``"identity"``), Performer's FAVOR+ random features
(:class:`FavorFeatures`), or any callable ``(..., D) -> (..., F)``. Named maps and FAVOR+ compute in
float32 (float64 for float64 inputs) whatever the input dtype, so that the sums over keys in
linear attention never see float16 rounding.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .numerics import compute_dtype as _compute_dtype


def elu_feature_map(x: Tensor) -> Tensor:
    """``elu(x) + 1`` (Katharopoulos et al. 2020, "Transformers are RNNs", eq. 7): positive, smooth."""
    return F.elu(x.to(_compute_dtype(x.dtype))) + 1.0


def relu_feature_map(x: Tensor) -> Tensor:
    """``max(x, 0)``: non-negative; a query whose coordinates are all negative sees nothing."""
    return F.relu(x.to(_compute_dtype(x.dtype)))


def identity_feature_map(x: Tensor) -> Tensor:
    """``x`` itself: plain (unnormalized-kernel) linear attention. Features can be negative, so with
    ``normalize=True`` the denominator ``phi(q) . z`` can approach 0; mostly useful with
    ``normalize=False``."""
    return x.to(_compute_dtype(x.dtype))


NAMED_FEATURE_MAPS = {
    "elu": elu_feature_map,
    "relu": relu_feature_map,
    "identity": identity_feature_map,
}

# The one name -> code table of the feature maps the linear kernels apply on load (Triton and CUDA;
# csrc/linear/linear.h mirrors the codes: enum LinMap). FMAP_IDENTITY also marks features computed before the
# kernels (FAVOR+, a callable): the kernels then read them as they are.
FMAP_IDENTITY, FMAP_ELU, FMAP_RELU = 0, 1, 2
KERNEL_MAPS = {"identity": FMAP_IDENTITY, "elu": FMAP_ELU, "relu": FMAP_RELU}

# A FAVOR+ exponent is capped here (see FavorFeatures): one feature is at most e^30 / sqrt(F), a
# product phi(q)_i phi(k)_i at most e^60, so sums over 10^12 keys x |v| stay inside float32.
FAVOR_MAX_EXPONENT = 30.0


class FavorFeatures(nn.Module):
    r"""Performer FAVOR+ positive orthogonal random features (Choromanski et al. 2021, "Rethinking
    Attention with Performers", Lemma 1 and sec. 2.4) for the softmax kernel
    ``exp(scale * q . k)``::

        phi(x) = exp(w_i . x' - |x'|^2 / 2) / sqrt(F),   x' = sqrt(scale) * x,   i = 1..F

    so that ``E[phi(q) . phi(k)] = exp(scale * q . k)`` for rows ``w_i ~ N(0, I_D)``. With
    ``orthogonal=True`` the rows come in blocks of ``D`` exactly orthogonal directions (QR of a
    Gaussian ``D x D`` matrix, made Haar-uniform by fixing the signs), each rescaled by the norm of
    an independent Gaussian vector (a chi(D) variable) so that every row still has the ``N(0, I_D)``
    marginal; orthogonality lowers the estimator's variance (the paper's "ORF").

    Args:
        head_dim: ``D``, the last dim of the inputs.
        num_features: ``F``; default ``max(D, round(D * ln D))`` (the paper's ``m = Theta(d log d)``;
            44 for D=16, 266 for D=64, 621 for D=128).
        orthogonal: orthogonal blocks (default) or i.i.d. Gaussian rows.
        seed: seed of the module's own generator; ``None`` draws one from torch's default generator,
            so ``torch.manual_seed`` makes construction reproducible.
        scale: softmax temperature, default ``D ** -0.5`` (as in attention); inputs are multiplied
            by ``scale ** 0.5`` so that ``phi(q) . phi(k) ~ exp(scale * q . k)``.

    The projection ``(F, D)`` is a float32 buffer: saved in ``state_dict``, moved by ``.to()``, fixed
    until :meth:`redraw`.

    Numerical stabilization. The FAVOR+ reference implementation subtracts the maximum over the
    data of the keys' exponents, which would make the features of one key depend on the other keys:
    state passing across segments (``initial_state``) and causal chunking would no longer be exact.
    Here every feature is a function of its own input only, with the same formula for queries and
    keys. We keep the natural scale (``phi(q) . phi(k)`` is an unbiased estimate of the kernel, so
    ``eps`` in linear attention's denominator stays negligible) and cap each exponent at
    ``FAVOR_MAX_EXPONENT = 30``. The cap cannot change anything while ``|w_i|^2 / 2 <= 30`` (the
    exponent's maximum over x), i.e. for typical rows at ``D <= 32``; above, it only acts on
    inputs of very large norm aligned with a projection row, where the exact kernel is beyond
    ``e^30`` and exp would otherwise overflow float32. A data-independent subtracted constant
    ``c = max_i |w_i|^2 / 2`` would also rule out overflow, but it multiplies every ``phi(q).phi(k)``
    by ``exp(-2c)`` (about ``e^-100`` at D=64): the products underflow float32 and ``eps`` dominates
    the denominator, so it is not used.

    Examples::

        >>> phi = effattn.FavorFeatures(64, 256, seed=0)
        >>> out = effattn.linear_attention(q, k, v, feature_map=phi, causal=True)
        >>> phi.redraw()        # a fresh projection (Performer redraws it every few steps in training)
    """

    projection: Tensor

    def __init__(self, head_dim: int, num_features: Optional[int] = None, orthogonal: bool = True,
                 seed: Optional[int] = None, scale: Optional[float] = None):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"FavorFeatures: head_dim must be a positive int, got {head_dim!r}")
        if num_features is None:
            num_features = max(head_dim, round(head_dim * math.log(head_dim)))
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"FavorFeatures: num_features must be a positive int, got {num_features!r}")
        if scale is None:
            scale = head_dim ** -0.5
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"FavorFeatures: scale must be a positive finite float, got {scale!r}")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.head_dim = head_dim
        self.num_features = num_features
        self.orthogonal = bool(orthogonal)
        self.scale = float(scale)
        self.seed = int(seed)
        self._generator = torch.Generator().manual_seed(self.seed)
        self.register_buffer("projection", self._draw())

    def _draw(self) -> Tensor:
        D, Fn, g = self.head_dim, self.num_features, self._generator
        if not self.orthogonal:
            return torch.randn(Fn, D, generator=g, dtype=torch.float64).float()
        blocks = []
        for _ in range(-(-Fn // D)):
            q, r = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
            # sign fix: q * sign(diag r) is Haar-distributed (Mezzadri 2007); its columns are the rows
            q = q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)
            blocks.append(q.T)
        directions = torch.cat(blocks)[:Fn]                                   # unit rows
        norms = torch.randn(Fn, D, generator=g, dtype=torch.float64).norm(dim=1, keepdim=True)
        return (directions * norms).float()

    @torch.no_grad()
    def redraw(self, seed: Optional[int] = None) -> None:
        """Draws a new projection from the module's generator (which continues its own stream, so
        successive redraws differ), reseeded first when ``seed`` is given."""
        if seed is not None:
            self._generator.manual_seed(int(seed))
        self.projection.copy_(self._draw())

    def forward(self, x: Tensor) -> Tensor:
        """``(..., D) -> (..., F)`` positive features, float32 (float64 for float64 inputs)."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"FavorFeatures: input last dim must be head_dim={self.head_dim}, got "
                             f"shape {tuple(x.shape)}")
        dt = _compute_dtype(x.dtype)
        x = x.to(dt) * math.sqrt(self.scale)
        w = self.projection.to(device=x.device, dtype=dt)
        # Lemma 1 of the paper: exp(w.x - |x|^2/2), capped (see the class docstring)
        exponent = x @ w.T - 0.5 * (x * x).sum(-1, keepdim=True)
        return torch.exp(exponent.clamp(max=FAVOR_MAX_EXPONENT)) * (self.num_features ** -0.5)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_features={self.num_features}, "
                f"orthogonal={self.orthogonal}, scale={self.scale:.4g}, seed={self.seed}")


def resolve_feature_map(feature_map) -> Callable[[Tensor], Tensor]:
    """``"elu"`` / ``"relu"`` / ``"identity"``, a :class:`FavorFeatures`, or any callable
    ``(..., D) -> (..., F)`` -> the callable linear attention applies to q and k."""
    if isinstance(feature_map, str):
        fn = NAMED_FEATURE_MAPS.get(feature_map)
        if fn is None:
            names = ", ".join(repr(n) for n in NAMED_FEATURE_MAPS)
            raise ValueError(f"linear_attention: unknown feature_map {feature_map!r}; expected one of {names}, "
                             "an effattn.FavorFeatures or a callable (..., D) -> (..., F)")
        return fn
    if callable(feature_map):
        return feature_map
    raise TypeError(f"linear_attention: feature_map must be a name ('elu', 'relu', 'identity'), an "
                    f"effattn.FavorFeatures or a callable (..., D) -> (..., F); got {type(feature_map).__name__}")


def feature_map_name(feature_map) -> str:
    """``"elu"`` / ``"relu"`` / ``"identity"`` / ``"favor"`` / ``"callable"``: for backends that only
    fuse some maps."""
    if isinstance(feature_map, str):
        return feature_map
    for name, fn in NAMED_FEATURE_MAPS.items():
        if feature_map is fn:
            return name
    if isinstance(feature_map, FavorFeatures):
        return "favor"
    return "callable"
