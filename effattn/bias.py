"""Additive score terms for `effattn.attention(..., bias=...)`: ALiBi, relative-position tables
(T5), adaptive attention span and dense bias tensors.

A term adds ``b(batch, head, d)`` to the scaled (and soft-capped) score of query ``i`` and key
``j``, where ``d = pos(i) - j`` is the query-key distance with the library's bottom-right
positions (``pos(i) = i + Lk - Lq``; ``d >= 0`` for past keys). The order of operations is written
in docs/conventions.md ("Scores"). Terms hold plain tensors; any of them that requires grad gets a
float32 gradient that is bitwise the same on every run (no atomics: sums in a fixed order).

Each term knows its feature name (what a backend declares in its ``Capabilities``), validates
itself against a call, evaluates its values on a block of distances, and reduces the gradient of
the biased scores ``dT`` of a block to the gradients of its tensors. ``effattn.score`` drives them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["ALiBi", "Relative", "RelativeKeys", "Span", "alibi_slopes", "relative_index", "relative_scores",
           "t5_bucket_index"]


def _float_tensor(fn: str, name: str, t, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{fn}: {name} must be a floating-point tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device}, q on {device}")


def _per_head(fn: str, name: str, t: Tensor, B: int, H: int, allow_batch: bool) -> None:
    ok = t.dim() == 1 and t.shape[0] == H
    if allow_batch:
        ok = ok or (t.dim() == 2 and tuple(t.shape) == (B, H))
    if not ok:
        want = f"(H,)=({H},)" + (f" or (B, H)=({B}, {H})" if allow_batch else "")
        raise ValueError(f"{fn}: {name} must have shape {want}, got {tuple(t.shape)}")


def _by_head(x: Tensor) -> Tensor:
    """(H,) -> (1, H, 1, 1); (B, H) -> (B, H, 1, 1)."""
    return x.reshape(-1 if x.dim() == 2 else 1, x.shape[-1], 1, 1)


def _reduce_like(g: Tensor, shape) -> Tensor:
    """Sums g (B, H, ...) over the leading dims that `shape` ((H,) or (B, H)) lacks."""
    return g.sum(0) if len(shape) == 1 else g


class _Term:
    """What the terms share: the names of their tensor fields (``_tensors``), read by `params` and
    replaced by `with_params` (the autograd function rebuilds a term over the tensors it sees)."""
    _tensors: Tuple[str, ...] = ()

    def params(self) -> Tuple[Tensor, ...]:
        return tuple(getattr(self, n) for n in self._tensors)

    def with_params(self, *tensors):
        return dataclasses.replace(self, **dict(zip(self._tensors, tensors)))


# --------------------------------------------------------------------------------------------- ALiBi

def alibi_slopes(num_heads: int) -> Tensor:
    """The geometric ALiBi slopes of Press et al. (2022), float32 (num_heads,): ``2^(-8 k / n)`` for
    ``k = 1..n`` with ``n`` the largest power of two <= num_heads; the remaining heads take the odd
    powers of the next power of two's sequence (as BLOOM and the paper's code do)."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi_slopes: num_heads must be an int >= 1, got {num_heads!r}")
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    if n < num_heads:
        extra = [2.0 ** (-8.0 * k / (2 * n)) for k in range(1, 2 * n + 1, 2)]
        slopes += extra[:num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


@dataclass(frozen=True, eq=False)
class ALiBi(_Term):
    """``-slopes[..., h] * |d|``. ``slopes``: (H,) or (B, H) float tensor (`alibi_slopes` gives the
    paper's); differentiable."""
    slopes: Tensor
    feature = "bias=alibi"

    _tensors = ("slopes",)

    def validate(self, fn, B, H, Lq, Lk, device) -> None:
        _float_tensor(fn, "bias ALiBi.slopes", self.slopes, device)
        _per_head(fn, "bias ALiBi.slopes", self.slopes, B, H, allow_batch=True)


    def values(self, d: Tensor, block, cdt) -> Tensor:
        return -_by_head(self.slopes.to(cdt)) * d.abs().to(cdt)

    def grads(self, dT: Tensor, d: Tensor, block, cdt):
        g = -(dT * d.abs().to(cdt)).sum((2, 3))                    # (B, H)
        return (_reduce_like(g, self.slopes.shape),)


# ------------------------------------------------------------------------------------------ Relative

def t5_bucket_index(num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True) -> Tensor:
    """int64 index from a clipped distance to T5's relative-position bucket: ``(2M+1,)`` with entry
    ``c`` for ``d = c - M`` when bidirectional, ``(M+1,)`` with entry ``d`` otherwise (M =
    max_distance; T5's ``relative_position`` is ``-d``). Beyond ``max_distance`` T5's bucket is
    constant, so ``Relative(t5_weight.T[:, idx], max_distance=M, bidirectional=...)`` with
    ``t5_weight`` the ``(num_buckets, H)`` embedding reproduces T5's bias exactly."""
    for name, x in (("num_buckets", num_buckets), ("max_distance", max_distance)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"t5_bucket_index: {name} must be an int >= 1, got {x!r}")
    M = max_distance
    d = torch.arange(-M, M + 1) if bidirectional else torch.arange(0, M + 1)
    rel = -d                                                     # T5: memory position - query position
    n = num_buckets
    bucket = torch.zeros_like(rel)
    if bidirectional:
        n //= 2
        bucket += (rel > 0).long() * n
        rel = rel.abs()
    else:
        rel = (-rel).clamp_min(0)
    exact = n // 2
    small = rel < exact
    large = exact + (torch.log(rel.double().clamp_min(1) / exact) / math.log(M / exact) * (n - exact)).long()
    large = large.clamp_max(n - 1)
    return bucket + torch.where(small, rel, large)


@dataclass(frozen=True, eq=False)
class Relative(_Term):
    """``table[h, clamp(d, -M, M) + M]`` (bidirectional, table (H, 2M+1)) or ``table[h, clamp(d, 0,
    M)]`` (past only, table (H, M+1): future keys read entry 0), M = ``max_distance``. A table longer
    than needed is cut; a shorter one is an error. Differentiable: the gradient of an entry is the
    sum of the score gradients along the diagonals that read it."""
    table: Tensor
    max_distance: int
    bidirectional: bool = True
    feature = "bias=relative"

    _tensors = ("table",)


    @property
    def width(self) -> int:
        return 2 * self.max_distance + 1 if self.bidirectional else self.max_distance + 1

    def validate(self, fn, B, H, Lq, Lk, device) -> None:
        M = self.max_distance
        if isinstance(M, bool) or not isinstance(M, int) or M < 0:
            raise ValueError(f"{fn}: bias Relative.max_distance must be an int >= 0, got {M!r}")
        if not isinstance(self.bidirectional, bool):
            raise TypeError(f"{fn}: bias Relative.bidirectional must be a bool, got {self.bidirectional!r}")
        _float_tensor(fn, "bias Relative.table", self.table, device)
        t = self.table
        if t.dim() != 2 or t.shape[0] != H:
            raise ValueError(f"{fn}: bias Relative.table must be 2-D (H={H}, {self.width}), got {tuple(t.shape)}")
        if t.shape[1] < self.width:
            what = "2 * max_distance + 1" if self.bidirectional else "max_distance + 1"
            raise ValueError(f"{fn}: bias Relative.table has {t.shape[1]} entries per head, shorter than "
                             f"{what} = {self.width} (max_distance={M})")

    def _index(self, d: Tensor) -> Tensor:
        M = self.max_distance
        return d.clamp(-M, M) + M if self.bidirectional else d.clamp(0, M)

    def values(self, d, block, cdt):
        return self.table[:, :self.width].to(cdt)[:, self._index(d)][None]      # (1, H, rows, keys)

    def grads(self, dT, d, block, cdt):
        # d[a, c] = d0 + a - c: the sums along the diagonals of the block, then per table entry
        d0 = block[0]
        sums = diagonal_sums(dT.sum(0))                                  # (H, r + n - 1), d descending
        rows = dT.shape[2]
        d_hi = d0 + rows - 1
        by_d = sums.flip(-1)                                            # d ascending from d_hi - (W - 1)
        d_lo = d_hi - (by_d.shape[-1] - 1)
        M = self.max_distance
        lo, hi = (-M, M) if self.bidirectional else (0, M)
        g = bin_sums(by_d, d_lo, lo, hi)
        if self.table.shape[1] > self.width:
            g = torch.nn.functional.pad(g, (0, self.table.shape[1] - self.width))
        return (g,)


def diagonal_sums(x: Tensor) -> Tensor:
    """x (..., r, n) -> (..., r + n - 1): entry c is the sum of x[a, b] over b - a = c - (r - 1),
    one reduction over a skewed view (no scatter, deterministic on every device)."""
    *lead, r, n = x.shape
    W = n + r - 1
    xp = torch.nn.functional.pad(x, (r - 1, 0))                     # (..., r, W): x[a, b] at column b + r - 1
    flat = torch.nn.functional.pad(xp.reshape(*lead, r * W), (0, r)).contiguous()
    # skew[a, c] = xp[a, c + a] = flat[a * (W + 1) + c]; where c + a >= W it reads the next row's
    # left padding (zeros), so each column c holds one diagonal
    skew = flat.as_strided((*lead, r, W), (*flat.stride()[:-1], W + 1, 1), flat.storage_offset())
    return skew.sum(-2)


def bin_sums(by_d: Tensor, d_lo: int, lo: int, hi: int) -> Tensor:
    """by_d (..., W): values at distances d_lo .. d_lo + W - 1 -> (..., hi - lo + 1) sums per
    clamped distance clamp(d, lo, hi) - lo. Slices and reductions only: deterministic."""
    W = by_d.shape[-1]
    nb = hi - lo + 1
    out = by_d.new_zeros(*by_d.shape[:-1], nb)
    t_lo = min(max(lo - d_lo + 1, 0), W)       # first t with d > lo
    t_hi = min(max(hi - d_lo, t_lo), W)       # first t with d >= hi (never before t_lo)
    out[..., 0] += by_d[..., :t_lo].sum(-1)
    out[..., nb - 1] += by_d[..., t_hi:].sum(-1)
    if t_hi > t_lo:
        b0 = d_lo + t_lo - lo
        out[..., b0:b0 + (t_hi - t_lo)] += by_d[..., t_lo:t_hi]
    return out


# ---------------------------------------------------------------------------------------------- Span

@dataclass(frozen=True, eq=False)
class Span(_Term):
    """Adaptive attention span (Sukhbaatar et al. 2019) as an additive term:
    ``log clamp((ramp + z[h] - d) / ramp, 0, 1)``: 0 for ``d <= z[h]``, a log ramp over the next
    ``ramp`` distances, and keys with ``d >= z[h] + ramp`` invisible (``-inf``; backends skip them).
    ``bidirectional=True`` (encoders) reads ``|d|`` instead of ``d``: the span is symmetric, keys
    with ``|d| >= z[h] + ramp`` on either side are invisible and their tiles skipped; with the
    default ``False`` future keys (``d < 0``) get 0.
    ``z`` (H,) in tokens, within ``[0, max_span]`` (checked at each call: reading z back is a device
    sync on a GPU); differentiable:
    ``dz[h] = (1 / ramp) * sum over z[h] <= d < z[h] + ramp of exp(s - lse) (dP - Delta)``, with
    ``s`` the score before this term (the one-sided derivative at the ramp's far end, where keys are
    invisible; at ``d == z`` the ramp's slope, as torch's clamp); ``|d|`` for ``d`` when bidirectional."""
    z: Tensor
    ramp: float
    max_span: float
    bidirectional: bool = False
    feature = "bias=span"

    _tensors = ("z",)


    @property
    def horizon(self) -> int:
        """Keys at distance >= this are invisible whatever z is: ceil(max_span + ramp)."""
        return int(math.ceil(self.max_span + self.ramp))

    def validate(self, fn, B, H, Lq, Lk, device) -> None:
        for name, x in (("ramp", self.ramp), ("max_span", self.max_span)):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise TypeError(f"{fn}: bias Span.{name} must be a finite number, got {x!r}")
        if self.ramp <= 0:
            raise ValueError(f"{fn}: bias Span.ramp must be > 0, got {self.ramp!r}")
        if self.max_span < 0:
            raise ValueError(f"{fn}: bias Span.max_span must be >= 0, got {self.max_span!r}")
        if not isinstance(self.bidirectional, bool):
            raise TypeError(f"{fn}: bias Span.bidirectional must be a bool, got {self.bidirectional!r}")
        _float_tensor(fn, "bias Span.z", self.z, device)
        _per_head(fn, "bias Span.z", self.z, B, H, allow_batch=False)
        z = self.z.detach()
        if z.numel() and not bool(((z >= 0) & (z <= self.max_span)).all()):
            raise ValueError(f"{fn}: bias Span.z must lie in [0, max_span={self.max_span}] (clamp it, e.g. "
                             f"effattn.nn.AdaptiveSpan.clamp_()), got values in [{float(z.min())}, {float(z.max())}]")

    def _ratio(self, d, cdt):
        d = d.abs() if self.bidirectional else d
        return ((self.ramp + _by_head(self.z.to(cdt)) - d.to(cdt)) / self.ramp)           # (1, H, rows, keys)

    def values(self, d, block, cdt):
        return torch.log(self._ratio(d, cdt).clamp(0, 1))

    def grads(self, dT, d, block, cdt):
        m = self._ratio(d, cdt)
        ramp = (m > 0) & (m <= 1)
        # dT = m exp(s - lse)(dP - Delta): dT / m is the unbiased factor, without dividing by ~0
        g = torch.where(ramp, dT / torch.where(ramp, m, torch.ones_like(m)), torch.zeros_like(dT))
        return (g.sum((0, 2, 3)) / self.ramp,)


# --------------------------------------------------------------------------------------------- Dense

@dataclass(frozen=True, eq=False)
class Dense(_Term):
    """A tensor broadcastable to (B, H, Lq, Lk) added to the scores (what ``bias=<tensor>`` becomes).
    Its gradient is summed over the broadcast dimensions."""
    tensor: Tensor
    feature = "bias=dense"

    _tensors = ("tensor",)


    def validate(self, fn, B, H, Lq, Lk, device) -> None:
        _float_tensor(fn, "bias (a dense tensor)", self.tensor, device)
        t = self.tensor
        full = (B, H, Lq, Lk)
        try:
            ok = t.dim() <= 4 and torch.broadcast_shapes(t.shape, full) == torch.Size(full)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{fn}: bias tensor of shape {tuple(t.shape)} does not broadcast to (B, H, Lq, Lk)="
                             f"{full}")

    def _full(self):
        t = self.tensor
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))

    def values(self, d, block, cdt):
        _, i0, i1, k0, k1 = block
        t = self._full()
        rows = slice(i0, i1) if t.shape[2] > 1 else slice(0, 1)
        keys = slice(k0, k1) if t.shape[3] > 1 else slice(0, 1)
        return t[:, :, rows, keys].to(cdt)

    def grads(self, dT, d, block, cdt):
        """The chunk's part of the gradient, as (rows slice, keys slice, values) of the 4-D view."""
        _, i0, i1, k0, k1 = block
        t = self._full()
        dims = tuple(a for a in range(4) if t.shape[a] == 1 and dT.shape[a] != 1)
        g = dT.sum(dims, keepdim=True) if dims else dT
        rows = slice(i0, i1) if t.shape[2] > 1 else slice(0, 1)
        keys = slice(k0, k1) if t.shape[3] > 1 else slice(0, 1)
        return ((rows, keys, g),)


# ------------------------------------------------------------------------------ relative keys

def relative_index(Lq: int, Lk: int, n_dist: int, max_distance: Optional[int] = None, device=None) -> Tensor:
    """int64 ``(Lq, Lk)``: the row of ``r`` that query i reads for key j (see the module docstring)."""
    d = torch.arange(Lq, device=device)[:, None] + (Lk - Lq) - torch.arange(Lk, device=device)[None, :]
    if max_distance is None:
        return d.clamp(0, n_dist - 1)
    return d.clamp(-max_distance, max_distance) + max_distance


def relative_scores(query: Tensor, r: Tensor, Lk: int, max_distance: Optional[int] = None) -> Tensor:
    """``query_i . r[h, idx(d_ij)]`` for ``query (B, H, Lq, D)``, ``r (H, n_dist, D)``: ``(B, H, Lq, Lk)``
    (unscaled), computed as ``query @ r^T`` followed by a skewed gather."""
    B, H, Lq, _ = query.shape
    qr = torch.matmul(query, r.transpose(-1, -2).unsqueeze(0))                     # (B, H, Lq, n_dist)
    idx = relative_index(Lq, Lk, r.shape[1], max_distance, query.device)
    return qr.gather(-1, idx.expand(B, H, Lq, Lk))


@dataclass(frozen=True, eq=False)
class RelativeKeys:
    """Relative-position keys (Shaw et al. 2018, Music Transformer, Transformer-XL) as a term of
    ``effattn.attention(..., bias=RelativeKeys(r, ...))``: adds ``query_i . r[h, idx(d_ij)]`` to the
    unscaled scores, ``s_ij = scale (q_i . k_j + query_i . r[h, idx(d_ij)])``, with the index of
    `relative_index` (past distances clamped to ``n_dist - 1`` without ``max_distance``; ``clamp(d,
    -M, M) + M`` with ``max_distance=M``).

    Args:
        r: ``(H, n_dist, D)`` relative keys, q's dtype and device.
        query: ``(B, H, Lq, D)`` query of the term (Transformer-XL passes ``q + v_bias`` here and
            ``q + u_bias`` as q), or None for the call's q.
        max_distance: None (r holds past distances ``0..n_dist-1``; needs causal or a window with
            right = 0) or M (``n_dist = 2M + 1``).

    Unlike the other terms it depends on the query, so it is not a table of distances: `attention`
    runs it on the rows of op ``"relative_attention"`` (the fused Triton kernels, or the blocked
    torch path; `effattn.explain` with the same ``bias=`` lists them), alone (no other term, softcap,
    sinks, layout, packing or positions). r and query receive gradients. ``scores(q, Lk)`` gives the
    unscaled ``(B, H, Lq, Lk)`` term (small shapes, tests).
    """
    r: Tensor
    query: Optional[Tensor] = None
    max_distance: Optional[int] = None

    def scores(self, q: Tensor, Lk: int) -> Tensor:
        return relative_scores(q if self.query is None else self.query, self.r, Lk, self.max_distance)
