"""The torch backend's path ``torch/linear-cpu-chunks``: causal linear attention in the chunked form
(chunks of C positions: a masked C x C product inside a chunk, the prefix state across chunks, as the
reference), written as a dozen batched ops over every chunk of every head at once (at one thread; at
more, `SLICED_FROM`, on slices of key/value heads, one intra-op thread per slice, as the slice path):

    A    = tril(phi(Q_c) phi(K_c)^T)                one bmm, one in-place mask
    num  = A [V_c | 1]                              one bmm (the denominator as a column of ones)
    kv   = phi(K_c)^T [V_c | 1]                     one bmm: each chunk's sums
    S_c  = sum_{c' < c} kv_c'                       one matmul with a strictly lower-triangular n x n
    num += phi(Q_c) S_c                             one in-place baddbmm
    out  = num[:Dv] / num[Dv]

With C = L it is the quadratic form (one chunk, no state); measured, C = 32 or 64 is faster at every
length (the quadratic form does twice the work of C = 64 at L = 256, and its backward more). The
chunked reference computes the same sums with ~25 ops (G query heads interleaved, a state einsum,
where-guards). The gradients are autograd's through the same ops (on slices: each slice's forward
recomputed and differentiated in its worker, `cpu_slices`). `CHUNK_*`, `MAX_L` and `SLICED_FROM` are
the rule, measured on the CPU (see there).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from ...._call import LINEAR, linear_features
from ....numerics import compute_dtype
from ...base import FEATURES, Capabilities, Path, register
from . import cpu_slices
from .reference import DTYPES

# ------------------------------------------------------------------------------ the speed rule
# Measured 2026-11-27 23:40-00:20 UTC on this repository's 2-core AMD EPYC (Zen 5, AVX-512) VM, shared
# with other jobs (1-minute load 12-22), torch 2.13, B=1, H=8, D=64, float32, elu, one thread: the
# thread's CPU time (time.thread_time, which the load does not stretch as it does wall time), median
# of 15-21 interleaved runs, ms (fwd / fwd+bwd); commands and tables in
# benchmarks/results/cpu/linear_cpu_chunks.md:
#   1 thread     SDPA causal   chunked ref.   quadratic      C = 16        C = 32        C = 64
#   L = 256      1.69 / 5.98   2.49 / 6.14    2.11 / 10.08   2.05 / 7.12   1.31 / 4.23   1.34 / 4.70
#   L = 512      6.41 / 22.45  5.03 / 12.22   8.10 / 41.66   3.76 / 15.33  2.97 / 9.18   2.82 / 10.26
#   L = 2048     59.7 / 207.7  21.95 / 46.42  166.8 / 642.7  27.34 / 73.13 15.22 / 42.44 14.10 / 38.65
#   L = 4096     208.0 / 759.0 38.71 / 97.61  671.1 / 2705   93.75 / 210.0 35.66 / 97.08 29.08 / 84.68
# (instructions at L = 256, callgrind, one thread, per call, fwd / fwd+bwd: SDPA causal 20.6 M / 70.9 M,
# the quadratic form 23.8 M / 73.0 M, the chunked reference 22.7 M / 52.9 M). So chunks of 32 up to
# L = 512, of 64 above, and this path before the chunked reference at every length.
# MAX_L: the longest L this path takes, by torch's thread count (more threads: the largest count
# listed at or below). At 2 threads both paths run on slices, one thread each (`SLICED_FROM`), this
# one doing the per-slice work measured above at one thread, less than the chunked reference's; idle
# 2-thread wall times could not be measured on the loaded machine (SDPA itself took 20x its idle
# time), so MAX_L[2] rests on that 1-thread work (PREDICTION: at least as fast as the slice path at 2
# threads on an idle machine); setting it to 0 sends 2-thread calls back to the slice path.
CHUNK_SHORT, CHUNK_LONG, SHORT_L = 32, 64, 512
MAX_L: Dict[int, int] = {1: 1 << 62, 2: 1 << 62}
# From this many threads the ops run on slices of key/value heads (or batch entries), one intra-op
# thread per slice, as the slice path does (threads.py: every op's barrier waits for a descheduled
# thread). Measured 2026-11-28 00:18 UTC, `python3 -m benchmarks.cpu_vs_sdpa --lengths 256 512 --cases
# "causal linear elu" --runs 7`, 2 threads, wall ms forward (fwd+bwd), load 8-10: all ops on both
# intra-op threads 220 (633) at L = 256 and 201 (646) at L = 512; on slices 40 (144) and 48 (168); SDPA
# 16 (144-160). Idle (load 0.9-1.0, 2026-11-28 00:58 UTC, the same command at L = 256..4096, --runs 5-9)
# the intra-op form is the faster one at every length: 0.6 (2.0) ms at L = 256 against the slices' 1.6
# (6.5) and SDPA's 0.8 (2.8); 1.4 (4.0) at 512 against 3.3 (12.3); ratio to SDPA 0.72 / 0.44 / 0.34 /
# 0.26 / 0.15 forward from L = 256 to 4096. None: never on slices (a number turns them on from that many
# threads, for a machine whose threads are often descheduled).
SLICED_FROM: Optional[int] = None

# Feature maps whose features are never negative: with eps > 0 the denominator phi(q) . z + eps is
# then > 0 and the division needs no guard.
NONNEGATIVE = frozenset({"elu", "relu", "favor"})


def chunk_size(L: int) -> int:
    """The rule's chunk length for a call of length L."""
    return CHUNK_SHORT if L <= SHORT_L else CHUNK_LONG


def max_l(threads: int) -> int:
    """The rule's longest L at ``threads`` intra-op threads."""
    return MAX_L[max(t for t in MAX_L if t <= max(1, threads))]


def _admits(call) -> List[str]:
    if not call.causal:
        return ["not causal (a non-causal call is one reduction over the keys: the slice path's)"]
    if call.q.shape[2] != call.k.shape[2]:
        return [f"Lq = {call.q.shape[2]} != Lk = {call.k.shape[2]}"]
    if call.feature_map_name == "favor" and any(t.requires_grad for t in getattr(call.phi, "parameters", lambda: [])()):
        return ["the FAVOR+ projection requires grad"]
    if torch.compiler.is_compiling():
        return ["traced by torch.compile"]
    if min(call.q.shape) == 0 or min(call.k.shape) == 0:
        return ["an empty shape"]
    threads, L = torch.get_num_threads(), call.q.shape[2]
    if L > max_l(threads):
        return [f"L = {L} > {max_l(threads)} at {threads} thread(s): the slice path's there (rule cpu_chunks.MAX_L)"]
    return []


_BEFORE: Dict[tuple, torch.Tensor] = {}     # (n, dtype) -> strictly lower-triangular ones (n, n)
_UPPER: Dict[tuple, torch.Tensor] = {}      # (C, G) -> bool (G*C, C): True above the diagonal


def _before(n: int, dtype: torch.dtype) -> torch.Tensor:
    m = _BEFORE.get((n, dtype))
    if m is None:
        m = _BEFORE[(n, dtype)] = torch.ones(n, n, dtype=dtype).tril_(-1)
    return m


def _upper(C: int, G: int) -> torch.Tensor:
    m = _UPPER.get((C, G))
    if m is None:
        m = _UPPER[(C, G)] = torch.ones(C, C, dtype=torch.bool).triu_(1).repeat(G, 1)
    return m


def chunked(call, C: int):
    """``out`` ``(B, H, L, Dv)`` of a causal call with ``Lq == Lk``, in the inputs' dtype (differentiable)."""
    dt = compute_dtype(call.q.dtype)
    fq, fk = linear_features(call, dt)
    v = call.v.to(dt)
    B, H, L, Fd = fq.shape
    Hkv, Dv = fk.shape[1], v.shape[-1]
    G = H // Hkv
    if call.normalize:
        v = F.pad(v, (0, 1), value=1.0)                   # [V | 1]: the denominator as one more column
    W = v.shape[-1]
    C = min(C, L)
    n = -(-L // C)
    pad = n * C - L
    if pad:                                               # zero features at the end: seen by no real query
        fq, fk, v = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v))
    # chunk-major, the G query heads of a key/value head side by side: (B*Hkv*n, G*C, F); a copy only for GQA
    qc = fq.reshape(B, Hkv, G, n, C, Fd).transpose(2, 3).reshape(B * Hkv * n, G * C, Fd)
    kc, vc = fk.reshape(B * Hkv * n, C, Fd), v.reshape(B * Hkv * n, C, W)
    A = torch.bmm(qc, kc.transpose(1, 2))
    if G == 1:
        A.tril_()
    else:
        A.masked_fill_(_upper(C, G), 0)
    num = torch.bmm(A, vc)
    if n > 1:                                             # the state of the chunks before each chunk
        kv = torch.bmm(kc.transpose(1, 2), vc).view(B * Hkv, n, Fd * W)
        prev = torch.matmul(_before(n, dt), kv).view(B * Hkv * n, Fd, W)
        num.baddbmm_(qc, prev)
    num = num.view(B, Hkv, n, G, C, W).transpose(2, 3).reshape(B, H, n * C, W)
    if pad:
        num = num[:, :, :L]
    if not call.normalize:
        return num.to(call.q.dtype)
    den = num[..., Dv:] + call.eps
    if call.eps > 0 and call.feature_map_name in NONNEGATIVE:
        out = num[..., :Dv] / den                         # den >= eps > 0
    else:                                                 # den may be 0: such a row outputs 0
        empty = den == 0
        out = torch.where(empty, 0.0, num[..., :Dv] / torch.where(empty, 1.0, den))
    return out.to(call.q.dtype)


def _slice(call, q, k, v, S0, z0):
    """One slice's output (`cpu_slices.run_slices`' math; no state)."""
    return chunked(dataclasses.replace(call, q=q, k=k, v=v), chunk_size(q.shape[2])), None, None


def _run(call):
    if _sliced(call):
        return cpu_slices.run_slices(call, _slice)[0], None
    return chunked(call, chunk_size(call.q.shape[2])), None


def _sliced(call) -> bool:
    """Whether the call runs on slices, one intra-op thread each (`SLICED_FROM`)."""
    return SLICED_FROM is not None and torch.get_num_threads() >= max(2, SLICED_FROM) and \
        max(call.k.shape[0], call.k.shape[1]) > 1


def _describe(call) -> str:
    threads, L = torch.get_num_threads(), call.q.shape[2]
    how = ("on slices of key/value heads (or batch entries) in parallel, one thread each (rule cpu_chunks.SLICED_FROM)"
           if _sliced(call) else "on all threads")
    limit = max_l(threads)
    bound = "no length limit" if limit >= 1 << 62 else f"L = {L} <= {limit}"
    return (f"chunked form as batched ops {how}, chunks of {min(chunk_size(L), L)} (rule cpu_chunks.CHUNK_*: "
            f"{CHUNK_SHORT} up to L = {SHORT_L}, else {CHUNK_LONG}); {bound} at {threads} thread(s) "
            f"(rule cpu_chunks.MAX_L)")


PATH = register(Path(
    backend="torch", op=LINEAR, name="torch/linear-cpu-chunks", priority=94,
    caps=Capabilities(devices=frozenset({"cpu"}), dtypes=DTYPES,
                      features=FEATURES[LINEAR] - {"feature_map=callable", "state"}),
    run=_run, admits=_admits, describe=_describe))
