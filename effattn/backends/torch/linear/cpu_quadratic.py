"""The torch backend's path ``torch/linear-cpu-quadratic``: short causal linear attention in its
quadratic form, ``out = tril(phi(Q) phi(K)^T) [V | 1]`` then the last column divides the others (the
row-sum denominator rides along as a column of ones, as in the chunked reference). Two batched
matmuls over every (query, key) pair, one masking op, one division: a handful of ops that each run
on all of torch's intra-op threads, where the chunked reference runs ~25 ops (its chunk
bookkeeping costs more than the pairs it skips at short lengths, and its slices run one thread each).
The gradients are autograd's through the same ops.

The form reads Lq * Lk pairs and keeps the ``(B, H, Lq, Lk)`` product for the backward, so it takes
only short calls: `MAX_LK` is the rule, measured on the CPU (see there).
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from ...._call import LINEAR, linear_features
from ....numerics import compute_dtype
from ...base import FEATURES, Capabilities, Path, register
from .reference import DTYPES

# ------------------------------------------------------------------------------ the speed rule
# The longest key length (Lk; the form is quadratic in it) at which the quadratic form takes a causal
# call, by torch's thread count (more threads: the largest key listed at or below it). Measured with
# /tmp-free commands in benchmarks/results/cpu/linear_quadratic.md (B=1, H=8, D=64, float32, elu):
# see that file for the instruction counts (1 thread, callgrind) and the interleaved wall times
# (2 threads, with the load) against the chunked reference / slice path and SDPA's causal softmax.
MAX_LK = {1: 512, 2: 512}

# Feature maps whose features are never negative: with eps > 0 the denominator phi(q) . z + eps is
# then > 0 and the division needs no guard for rows that see no key (their numerator is 0).
NONNEGATIVE = frozenset({"elu", "relu", "favor"})


def max_lk(threads: int) -> int:
    """The rule's longest key length at ``threads`` intra-op threads."""
    return MAX_LK[max(t for t in MAX_LK if t <= max(1, threads))]


def _admits(call) -> List[str]:
    if not call.causal:
        return ["not causal (a non-causal call is one reduction over the keys: the other paths are linear in L)"]
    if call.feature_map_name == "favor" and any(t.requires_grad for t in getattr(call.phi, "parameters", lambda: [])()):
        return ["the FAVOR+ projection requires grad"]
    if torch.compiler.is_compiling():
        return ["traced by torch.compile"]
    threads = torch.get_num_threads()
    Lk, limit = call.k.shape[2], max_lk(threads)
    if Lk > limit:
        return [f"Lk = {Lk} > {limit} at {threads} thread(s): measured slower than the chunked form there "
                f"(rule cpu_quadratic.MAX_LK)"]
    return []


def quadratic(call):
    """``out`` ``(B, H, Lq, Dv)`` of a causal call, in the inputs' dtype (differentiable)."""
    dt = compute_dtype(call.q.dtype)
    fq, fk = linear_features(call, dt)
    v = call.v.to(dt)
    B, H, Lq, Fd = fq.shape
    Hkv, Lk, Dv = fk.shape[1], fk.shape[2], v.shape[-1]
    G = H // Hkv
    if call.normalize:
        v = F.pad(v, (0, 1), value=1.0)                  # [V | 1]: the denominator as one more column
    # the G query heads of one key/value head stacked along the rows: one matmul per key/value head
    A = torch.matmul(fq.reshape(B, Hkv, G * Lq, Fd), fk.transpose(-1, -2))
    A.view(B, Hkv, G, Lq, Lk).tril_(Lk - Lq)              # bottom-right: query i sees j <= i + Lk - Lq
    num = torch.matmul(A, v).view(B, H, Lq, v.shape[-1])
    if not call.normalize:
        return num.to(call.q.dtype)
    den = num[..., Dv:] + call.eps
    if call.eps > 0 and call.feature_map_name in NONNEGATIVE:
        out = num[..., :Dv] / den                         # den >= eps > 0; a row seeing no key: 0 / eps
    else:                                                 # den may be 0: such a row outputs 0
        empty = den == 0
        out = torch.where(empty, 0.0, num[..., :Dv] / torch.where(empty, 1.0, den))
    return out.to(call.q.dtype)


def _run(call):
    return quadratic(call), None


def _describe(call) -> str:
    threads = torch.get_num_threads()
    return (f"quadratic form tril(phi(Q) phi(K)^T) [V | 1] as two batched matmuls on all threads; "
            f"Lk = {call.k.shape[2]} <= {max_lk(threads)} at {threads} thread(s) (rule cpu_quadratic.MAX_LK: "
            f"measured faster than the chunked form there)")


PATH = register(Path(
    backend="torch", op=LINEAR, name="torch/linear-cpu-quadratic", priority=94,
    caps=Capabilities(devices=frozenset({"cpu"}), dtypes=DTYPES,
                      features=FEATURES[LINEAR] - {"feature_map=callable", "state"}),
    run=_run, admits=_admits, describe=_describe))
