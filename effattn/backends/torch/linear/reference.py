"""The torch reference of linear attention (Katharopoulos et al. 2020): the readable math, the
test oracle's companion and the CPU fallback.

Causal attention is computed in chunks of C positions (the "chunkwise" form of e.g. Yang et al.
2024, GLA, sec. 2.2, without gates): within a chunk a masked C x C product, across chunks the prefix
state. No ``(L, F, Dv)`` tensor is ever formed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...._call import LINEAR as FN
from ...._call import LinearCall, linear_features
from ....numerics import compute_dtype as _compute_dtype
from ...base import FEATURES, Capabilities, Path, register

CHUNK = 64                       # positions per chunk in the causal reference


def _causal_sums(fq: Tensor, fk: Tensor, v: Tensor, chunk: int = CHUNK) -> Tuple[Tensor, Tensor]:
    """Numerator ``sum_{j <= i} (phi_i . phi_j) v_j`` and denominator ``sum_{j <= i} phi_i . phi_j``
    for aligned queries and keys: fq ``(B, Hkv, G, L, F)``, fk ``(B, Hkv, L, F)``, v ``(B, Hkv, L, Dv)``
    -> ``(B, Hkv, G, L, Dv)``, ``(B, Hkv, G, L)``."""
    B, Hkv, G, L, Fd = fq.shape
    Dv = v.shape[-1]
    C = max(1, min(chunk, L))
    n = -(-L // C)
    pad = n * C - L                     # zero features at the end: seen by no real query
    # chunk-major layouts: the G query heads of a kv head side by side, one matmul per chunk
    fq_c = F.pad(fq, (0, 0, 0, pad)).reshape(B, Hkv, G, n, C, Fd).transpose(2, 3).reshape(B, Hkv, n, G * C, Fd)
    fk_c = F.pad(fk, (0, 0, 0, pad)).reshape(B, Hkv, n, C, Fd)
    # the denominator rides along as one more value column of ones: [S | z] in one product
    v1 = F.pad(F.pad(v, (0, 1), value=1.0), (0, 0, 0, pad)).reshape(B, Hkv, n, C, Dv + 1)

    kv = torch.matmul(fk_c.transpose(-1, -2), v1)                      # each chunk's phi(k)^T [v | 1]
    # exclusive prefix over chunks (the state every query of chunk c starts from), as one product
    # with a strictly lower-triangular matrix: cumsum along a middle dimension is far slower
    before = torch.ones(n, n, dtype=fq.dtype, device=fq.device).tril(-1)
    S_prev = torch.matmul(before, kv.reshape(B, Hkv, n, Fd * (Dv + 1))).reshape(kv.shape)

    keep = torch.ones(C, C, dtype=torch.bool, device=fq.device).tril().repeat(G, 1)   # (G*C, C): j <= i
    A = torch.matmul(fq_c, fk_c.transpose(-1, -2)).masked_fill_(~keep, 0)           # intra-chunk
    num = torch.matmul(fq_c, S_prev).add_(torch.matmul(A, v1))       # (B, Hkv, n, G*C, Dv+1)
    num = num.reshape(B, Hkv, n, G, C, Dv + 1).transpose(2, 3).reshape(B, Hkv, G, n * C, Dv + 1)[..., :L, :]
    return num[..., :Dv], num[..., Dv]


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


def _run(call: LinearCall):
    dt = _compute_dtype(call.q.dtype)
    fq, fk = linear_features(call, dt)
    out, S, z = linear_attention_reference(fq, fk, call.v.to(dt), causal=call.causal,
                                           normalize=call.normalize, eps=call.eps,
                                           initial_state=call.initial_state)
    return out.to(call.q.dtype), ((S, z) if call.return_state else None)


DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

PATH = register(Path(
    backend="torch", op=FN, name="torch/linear-chunked", priority=100,
    caps=Capabilities(devices=frozenset({"cpu", "cuda"}), dtypes=DTYPES, max_head_dim=256, features=FEATURES[FN]),
    run=_run))
