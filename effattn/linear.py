"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): the public function, its
validated call record, and the torch reference backend.

Softmax's ``exp(q . k)`` is replaced by a kernel ``phi(q) . phi(k)``, so the sum over keys can be
taken before the queries arrive:  ``out_i = phi(q_i) S / (phi(q_i) . z + eps)`` with
``S = sum_j phi(k_j)^T v_j`` (F x Dv) and ``z = sum_j phi(k_j)`` (F). Causal attention restricts the
sums to ``j <= i``; the reference computes it in chunks of C positions (the "chunkwise" form of
e.g. Yang et al. 2024, GLA, sec. 2.2, without gates): within a chunk a masked C x C product, across
chunks the prefix state. No ``(L, F, Dv)`` tensor is ever formed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._call import check_qkv
from .backends.base import Backend, Capabilities, register, select
from .feature_maps import FavorFeatures, feature_map_name, resolve_feature_map, NAMED_FEATURE_MAPS
from ._call import compute_dtype as _compute_dtype

FN = "linear_attention"
CHUNK = 64                       # positions per chunk in the causal reference
LINEAR_FEATURES = frozenset({"causal", "gqa", "state", "no_normalize"})




@dataclass
class LinearCall:
    """A validated linear-attention call. Tensors keep the caller's strides (no copies)."""
    q: Tensor                                  # (B, H, Lq, D)
    k: Tensor                                  # (B, Hkv, Lk, D)
    v: Tensor                                  # (B, Hkv, Lk, Dv)
    causal: bool
    phi: Callable[[Tensor], Tensor]            # (..., D) -> (..., F)
    normalize: bool
    eps: float
    initial_state: Optional[Tuple[Tensor, Tensor]]   # (S0 (B, H, F, Dv), z0 (B, H, F)) or None
    return_state: bool
    num_features: int                          # F
    feature_map_name: str = "callable"         # "elu" | "relu" | "identity" | "favor" | "callable"

    def features(self):
        """Names of the features this call uses (read by backends' capability checks)."""
        f = set()
        if self.causal: f.add("causal")
        if self.q.shape[1] != self.k.shape[1]: f.add("gqa")
        if self.initial_state is not None or self.return_state: f.add("state")
        if not self.normalize: f.add("no_normalize")
        return f


def _feature_dim(phi, name: str, q: Tensor) -> int:
    D = q.shape[-1]
    if isinstance(phi, FavorFeatures):
        if phi.head_dim != D:
            raise ValueError(f"{FN}: feature_map is FavorFeatures(head_dim={phi.head_dim}) but q/k have "
                             f"head dim D={D}")
        return phi.num_features
    if name in NAMED_FEATURE_MAPS:
        return D
    # a user callable: one probe row tells its output width
    with torch.no_grad():
        out = phi(torch.zeros(1, D, dtype=_compute_dtype(q.dtype), device=q.device))
    if not isinstance(out, Tensor) or out.dim() != 2 or out.shape[0] != 1 or out.shape[1] < 1:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"{FN}: feature_map must map (..., D) -> (..., F) with F >= 1; on a (1, {D}) "
                         f"input it returned {got}")
    return out.shape[1]


def make_linear_call(q, k, v, *, causal=False, feature_map="elu", normalize=True, eps=1e-6,
                     initial_state=None, return_state=False) -> LinearCall:
    B, H, Hkv = check_qkv(q, k, v, FN)
    for name, flag in (("causal", causal), ("normalize", normalize), ("return_state", return_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{FN}: {name} must be a bool, got {flag!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{FN}: eps must be a float, got {eps!r}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{FN}: eps must be a finite float >= 0, got {eps!r}")
    phi = resolve_feature_map(feature_map)
    name = feature_map_name(feature_map)
    Fdim = _feature_dim(phi, name, q)
    Dv = v.shape[-1]
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise TypeError(f"{FN}: initial_state must be a pair (S0, z0) of tensors, got "
                            f"{type(initial_state).__name__}")
        S0, z0 = initial_state
        for nm, t, want in (("S0", S0, (B, H, Fdim, Dv)), ("z0", z0, (B, H, Fdim))):
            if not isinstance(t, Tensor):
                raise TypeError(f"{FN}: initial_state {nm} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise TypeError(f"{FN}: initial_state {nm} must be a floating tensor, got {t.dtype}")
            if tuple(t.shape) != want:
                dims = "(B, H, F, Dv)" if nm == "S0" else "(B, H, F)"
                raise ValueError(f"{FN}: initial_state {nm} must have shape {want} {dims} with F={Fdim} "
                                 f"features, got {tuple(t.shape)}")
            if t.device != q.device:
                raise ValueError(f"{FN}: initial_state {nm} is on {t.device}, q on {q.device}")
        initial_state = (S0, z0)
    return LinearCall(q, k, v, causal, phi, normalize, float(eps), initial_state, return_state, Fdim, name)


def linear_attention(q, k, v, *, causal=False, feature_map="elu", normalize=True, eps=1e-6,
                     initial_state=None, return_state=False, backend="auto"):
    r"""Linear attention ``out_i = phi(q_i) S / (phi(q_i) . z + eps)`` in O(L) time and memory.

    ``S = sum_j phi(k_j)^T v_j`` and ``z = sum_j phi(k_j)`` run over all keys, or over ``j <= i``
    when causal (Katharopoulos et al. 2020, eq. 4-6). ``normalize=False`` drops the denominator.

    Args:
        q: ``(B, H, Lq, D)`` queries.
        k: ``(B, Hkv, Lk, D)`` keys; ``H % Hkv == 0``: query head ``h`` uses key/value head
            ``h // (H / Hkv)`` (grouped-query attention; k and v are never expanded).
        v: ``(B, Hkv, Lk, Dv)`` values, ``Dv`` may differ from ``D``. q, k, v share one dtype
            (float16, bfloat16, float32, float64) and may be non-contiguous views.
        causal: query i sees keys ``j <= i + (Lk - Lq)`` (bottom-right alignment, as
            :func:`effattn.attention`). For ``Lq == Lk`` the usual lower triangle; for ``Lk > Lq`` the
            first ``Lk - Lq`` keys are seen by every query (a decoding step: ``Lq=1`` sees all keys);
            for ``Lk < Lq`` the first ``Lq - Lk`` queries see no key (only ``initial_state``)::

                Lq=2, Lk=4:  q0: 1 1 1 .      Lq=4, Lk=2:  q0: . .    q2: 1 .
                             q1: 1 1 1 1                   q1: . .    q3: 1 1
        feature_map: ``"elu"`` (elu(x)+1, default), ``"relu"``, ``"identity"``, an
            :class:`effattn.FavorFeatures` (softmax-kernel random features), or any callable
            ``(..., D) -> (..., F)``. It is applied to q and k upcast to float32 (float64 for float64
            inputs).
        normalize: divide by ``phi(q_i) . z + eps`` (default) or not.
        eps: ``>= 0``, added to the denominator. A query whose denominator is exactly 0 (possible only
            with ``eps=0``) outputs 0.
        initial_state: ``(S0 (B, H, F, Dv), z0 (B, H, F))``, the state returned for a previous segment;
            it is added to the sums of every query (causal: to every prefix). With ``causal=False`` a
            segment then attends to the keys of all previous segments plus all of its own.
        return_state: also return the final ``(S (B, H, F, Dv), z (B, H, F))``: ``S0``/``z0`` plus the
            sums over all keys of this call. So processing a sequence in segments, passing the state
            along, gives the same outputs (causal) and final state as one call. States are per query
            head (for GQA, heads of one group hold the same sums unless their ``S0`` differ) and are
            float32 (float64 for float64 inputs).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"cuda"``.

    Returns:
        ``out (B, H, Lq, Dv)`` in the dtype of q, or ``(out, (S, z))`` with ``return_state=True``.

    Examples::

        >>> q, k, v = (torch.randn(2, 8, 4096, 64) for _ in range(3))
        >>> out = effattn.linear_attention(q, k, v, causal=True)
        >>> # recurrent decoding, one segment at a time
        >>> o1, state = effattn.linear_attention(q[:, :, :2048], k[:, :, :2048], v[:, :, :2048],
        ...                                      causal=True, return_state=True)
        >>> o2, state = effattn.linear_attention(q[:, :, 2048:], k[:, :, 2048:], v[:, :, 2048:],
        ...                                      causal=True, initial_state=state, return_state=True)
    """
    call = make_linear_call(q, k, v, causal=causal, feature_map=feature_map, normalize=normalize, eps=eps,
                            initial_state=initial_state, return_state=return_state)
    out, state = select(FN, call, backend).run(call)
    return (out, state) if call.return_state else out


# ----------------------------------------------------------------------------- torch reference

def _causal_sums(fq: Tensor, fk: Tensor, v: Tensor, chunk: int = CHUNK) -> Tuple[Tensor, Tensor]:
    """Numerator ``sum_{j <= i} (phi_i . phi_j) v_j`` and denominator ``sum_{j <= i} phi_i . phi_j``
    for aligned queries and keys: fq ``(B, Hkv, G, L, F)``, fk ``(B, Hkv, L, F)``, v ``(B, Hkv, L, Dv)``
    -> ``(B, Hkv, G, L, Dv)``, ``(B, Hkv, G, L)``."""
    B, Hkv, G, L, Fd = fq.shape
    Dv = v.shape[-1]
    C = max(1, min(chunk, L))
    n = -(-L // C)
    pad = n * C - L                     # zero features at the end: seen by no real query
    fq_c = F.pad(fq, (0, 0, 0, pad)).reshape(B, Hkv, G, n, C, Fd)
    fk_c = F.pad(fk, (0, 0, 0, pad)).reshape(B, Hkv, n, C, Fd)
    v_c = F.pad(v, (0, 0, 0, pad)).reshape(B, Hkv, n, C, Dv)

    kv = torch.einsum("bhncf,bhncd->bhnfd", fk_c, v_c)                 # each chunk's phi(k)^T v
    ksum = fk_c.sum(3)                                                 # (B, Hkv, n, F)
    # exclusive prefix over chunks: the state every query of chunk c starts from
    S_prev = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1].cumsum(2)], dim=2)
    z_prev = torch.cat([torch.zeros_like(ksum[:, :, :1]), ksum[:, :, :-1].cumsum(2)], dim=2)

    keep = torch.ones(C, C, dtype=torch.bool, device=fq.device).tril()
    A = torch.einsum("bhgncf,bhnsf->bhgncs", fq_c, fk_c) * keep        # intra-chunk, j <= i
    num = torch.einsum("bhgncf,bhnfd->bhgncd", fq_c, S_prev) + torch.einsum("bhgncs,bhnsd->bhgncd", A, v_c)
    den = torch.einsum("bhgncf,bhnf->bhgnc", fq_c, z_prev) + A.sum(-1)
    return num.reshape(B, Hkv, G, n * C, Dv)[..., :L, :], den.reshape(B, Hkv, G, n * C)[..., :L]


def linear_attention_reference(fq: Tensor, fk: Tensor, v: Tensor, *, causal: bool, normalize: bool,
                               eps: float, initial_state: Optional[Tuple[Tensor, Tensor]] = None):
    """The math on features already computed, all in one floating dtype.

    fq ``(B, H, Lq, F)``, fk ``(B, Hkv, Lk, F)``, v ``(B, Hkv, Lk, Dv)``, initial_state per query head.
    Returns ``out (B, H, Lq, Dv)``, ``S (B, H, F, Dv)``, ``z (B, H, F)`` (final states).
    """
    B, H, Lq, Fd = fq.shape
    Hkv, Lk, Dv = fk.shape[1], fk.shape[2], v.shape[-1]
    G = H // Hkv
    fqg = fq.reshape(B, Hkv, G, Lq, Fd)          # the G query heads sharing one kv head, no k/v copy

    S_kv = torch.einsum("bhlf,bhld->bhfd", fk, v)                     # over all keys of this call
    z_kv = fk.sum(2)
    if not causal:
        num = torch.einsum("bhglf,bhfd->bhgld", fqg, S_kv)
        den = torch.einsum("bhglf,bhf->bhgl", fqg, z_kv)
    else:
        off = Lk - Lq                               # bottom-right: query i sees j <= i + off
        if off > 0:                                 # a prefix every query sees, like a state
            S_pre = torch.einsum("bhlf,bhld->bhfd", fk[:, :, :off], v[:, :, :off])
            z_pre = fk[:, :, :off].sum(2)
            num, den = _causal_sums(fqg, fk[:, :, off:], v[:, :, off:])
            num = num + torch.einsum("bhglf,bhfd->bhgld", fqg, S_pre)
            den = den + torch.einsum("bhglf,bhf->bhgl", fqg, z_pre)
        else:                                       # -off leading queries see no key: zero keys
            num, den = _causal_sums(fqg, F.pad(fk, (0, 0, -off, 0)), F.pad(v, (0, 0, -off, 0)))

    S = S_kv[:, :, None].expand(B, Hkv, G, Fd, Dv)
    z = z_kv[:, :, None].expand(B, Hkv, G, Fd)
    if initial_state is not None:
        S0 = initial_state[0].to(fq.dtype).reshape(B, Hkv, G, Fd, Dv)
        z0 = initial_state[1].to(fq.dtype).reshape(B, Hkv, G, Fd)
        num = num + torch.einsum("bhglf,bhgfd->bhgld", fqg, S0)
        den = den + torch.einsum("bhglf,bhgf->bhgl", fqg, z0)
        S, z = S + S0, z + z0

    if normalize:
        den = den + eps
        empty = den == 0
        num = torch.where(empty[..., None], 0.0, num / torch.where(empty, 1.0, den)[..., None])
    return num.reshape(B, H, Lq, Dv), S.reshape(B, H, Fd, Dv), z.reshape(B, H, Fd)


def _torch_run(call: LinearCall):
    dt = _compute_dtype(call.q.dtype)
    B, H, Lq, _ = call.q.shape
    Hkv, Lk = call.k.shape[1], call.k.shape[2]
    fq = call.phi(call.q.to(dt))
    fk = call.phi(call.k.to(dt))
    Fd = call.num_features
    for nm, t, want in (("q", fq, (B, H, Lq, Fd)), ("k", fk, (B, Hkv, Lk, Fd))):
        if not isinstance(t, Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{FN}: feature_map must map (..., D) -> (..., F) consistently; on {nm} it "
                             f"returned {got}, expected {want}")
    out, S, z = linear_attention_reference(fq.to(dt), fk.to(dt), call.v.to(dt), causal=call.causal,
                                           normalize=call.normalize, eps=call.eps,
                                           initial_state=call.initial_state)
    return out.to(call.q.dtype), ((S, z) if call.return_state else None)


TORCH_BACKEND = register(Backend(
    name="torch", op=FN, priority=100,
    caps=Capabilities(devices=frozenset({"cpu", "cuda"}),
                      dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                      max_head_dim=256, features=LINEAR_FEATURES),
    run=_torch_run,
))
