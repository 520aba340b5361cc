"""Context parallelism over torch.distributed: one sequence sharded along its length over the ranks
of a process group (NCCL on GPUs, gloo on CPUs), attention computed as if on one device.

    >>> import effattn.distributed as ecp
    >>> q, k, v = (ecp.shard(x, group, dim=2, balance="zigzag") for x in (q, k, v))   # (B, H, L/W, D)
    >>> out = ecp.attention(q, k, v, group=group, method="ring", balance="zigzag", causal=True)
    >>> y = ecp.unshard(out, group, dim=2, balance="zigzag")                        # (B, H, L, Dv)

Sharding (``balance``): ``"contiguous"`` gives rank r the tokens ``[r C, (r + 1) C)``, ``C = L / W``;
``"zigzag"`` cuts the sequence into ``2W`` pieces and gives rank r pieces ``r`` and ``2W - 1 - r``, so
every rank holds the same amount of causal work.

Methods:

- ``"ring"``: each rank keeps its queries; key/value shards travel around the ring with
  ``batch_isend_irecv`` while the current step computes. Each (query piece, key piece) pair is one
  ``effattn.attention`` call with its absolute ``positions`` and an fp32 partial output; pairs whose
  key range is empty (causal, window) are skipped, and steps no rank needs are not taken. The partials
  are merged in a fixed order (``effattn.merge_attention``). The backward re-rotates K/V, recomputes
  each pair and runs its backward with the merge's chain rule against the global out / lse
  (`_pair_grads`; ``effattn.ops.attention_backward`` is the same gradient in one reference call), and
  passes fp32 dK/dV around the ring back to their owners: deterministic, bitwise repeatable.
  With ``balance="contiguous"`` and a window reaching at most one shard to each side, the ring becomes
  a **halo exchange**: each rank receives only the ``left`` keys before its shard and the ``right``
  keys after it, and computes one call; gradients of the halo keys go back to their owners.
- ``"ulysses"``: all-to-all from sequence shards to head shards (``H`` divisible by ``W``; key/value
  heads are repeated when ``Hkv`` is not), attention on whole sequences, all-to-all back.
- ``"allgather"``: all-gather K/V (gradients return by reduce-scatter); each query piece attends the
  keys it may see.

`linear_attention`: local states ``(S, z)``, an exclusive prefix over the ranks, one
``effattn.linear_attention`` call with ``initial_state`` (gradients of the states return by
reduce-scatter).

Dropout (every method): rank 0's seed rides along the signature, and every per-rank call draws its
keep-mask with it at its absolute ``positions`` and, for Ulysses' head shards, the global head index
(the backends key dropout on (b, global h, absolute i, absolute j)), so the ranks drop the pairs the
one-device call drops under the same ``torch.manual_seed``; the ring's backward recomputes each pair
with the same seed.

Score terms (every method): softcap, sinks and the ``effattn.bias`` terms ALiBi, Relative and Span.
Ring, halo and all-gather calls place each chunk at its absolute ``positions``, so the terms read the
whole sequence's distances; the ring merges its pairs without the sinks and joins them to the
normalizer once (`_add_sinks`); Ulysses slices the per-head tensors to the rank's heads. Their
gradients are this rank's share (summed over the group: the one-device gradients). A dense bias
tensor (the whole sequence's (L, L) pairs) is refused naming ``bias``. A module's ``position_bias``
(``effattn.nn.MultiheadAttention``) passes its terms through `ContextParallel`.

Before any communication each call all-gathers a small signature (shapes, dtype, options) and raises
on every rank if the ranks disagree: a mismatch is an error, never a hang; so is one rank's own bad
input (its error there, a ValueError naming that rank on the others). `bytes_sent` counts what
this process handed to the group for other ranks (the halo test reads it).
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._call import LINEAR, _fail, make_attn_call, make_linear_call
from .backends import base
from .bias import ALiBi, Dense
from .linear import linear_attention as local_linear
from .merge import merge_attention
from .numerics import compute_dtype
from .packed import public_window
from .score import ScoreTerms
from .visibility import Rule, normalize_window

METHODS = ("ring", "ulysses", "allgather")
BALANCES = ("contiguous", "zigzag")

_STATS = {"bytes_sent": 0}


def bytes_sent() -> int:
    """Bytes this process has handed to process groups for other ranks (point-to-point sends, and its
    share of all-to-all / all-gather / reduce-scatter) since import or `reset_bytes_sent`."""
    return _STATS["bytes_sent"]


def reset_bytes_sent() -> None:
    _STATS["bytes_sent"] = 0


def _count(t: Tensor, fraction: float = 1.0) -> None:
    _STATS["bytes_sent"] += int(t.numel() * t.element_size() * fraction)


def _gather_op():
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _scatter_op():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("effattn.distributed: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first, e.g. under torchrun)")
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _check_balance(balance: str, fn: str) -> None:
    if balance not in BALANCES:
        _fail(ValueError, f"{fn}: balance must be one of {', '.join(map(repr, BALANCES))}, got {balance!r}")


class Piece(NamedTuple):
    start: int      # global position of the piece's first token
    length: int
    local: int      # where it sits in the rank's shard


def pieces(rank: int, world: int, local_len: int, balance: str) -> List[Piece]:
    """The global token ranges a rank's shard of ``local_len`` tokens holds, in shard order."""
    if balance == "contiguous":
        return [Piece(rank * local_len, local_len, 0)]
    c = local_len // 2
    return [Piece(rank * c, c, 0), Piece((2 * world - 1 - rank) * c, c, c)]


def _global_order(world: int, local_len: int, balance: str, device) -> Tensor:
    """Global position of each token of the ranks' shards concatenated in rank order."""
    pos = [torch.arange(p.start, p.start + p.length) for r in range(world) for p in pieces(r, world, local_len, balance)]
    return torch.cat(pos).to(device)


def _divisible(L: int, world: int, balance: str, fn: str, what: str) -> int:
    n = world if balance == "contiguous" else 2 * world
    if L % n:
        _fail(ValueError, f"{fn}: {what} {L} is not divisible by {n} ({'world size' if n == world else '2 x world size'}"
                          f" for balance={balance!r}); pad the sequence to a multiple of {n}")
    return L // world


def shard(x: Tensor, group=None, dim: int = 1, balance: str = "contiguous") -> Tensor:
    """This rank's shard of ``x`` along ``dim`` (the sequence axis): ``L / W`` tokens, contiguous or
    zigzag (pieces ``r`` and ``2W - 1 - r`` of ``2W``). Differentiable (a slice)."""
    _check_balance(balance, "shard")
    group, rank, world = _group(group)
    local = _divisible(x.shape[dim], world, balance, "shard", f"the length of dim {dim},")
    return torch.cat([x.narrow(dim, p.start, p.length) for p in pieces(rank, world, local, balance)], dim)


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 in rank order; the backward reduce-scatters (sums) the gradients."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        x = x.contiguous()
        out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        _count(x, world - 1)
        _gather_op()(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty((grad.shape[0] // ctx.world,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        _count(grad, (ctx.world - 1) / ctx.world)
        _scatter_op()(out, grad, group=ctx.group)
        return out, None, None


def _all_gather(x: Tensor, dim: int, group, world: int) -> Tensor:
    moved = x.movedim(dim, 0)
    return _AllGather.apply(moved, group, world).movedim(0, dim)


def unshard(x: Tensor, group=None, dim: int = 1, balance: str = "contiguous") -> Tensor:
    """The whole tensor from every rank's shard (the inverse of `shard`), on every rank.
    Differentiable: the gradient of a rank's shard is the sum of all ranks' gradients at its tokens."""
    _check_balance(balance, "unshard")
    group, rank, world = _group(group)
    local = x.shape[dim]
    if balance == "zigzag" and local % 2:
        _fail(ValueError, f"unshard: a zigzag shard has an even length, got {local} along dim {dim}")
    dims = list(x.shape) + [0] * (8 - x.dim())
    _agree([x.dim(), dim % max(x.dim(), 1), _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1] + dims[:8] +
           [BALANCES.index(balance), 0], group, world, "unshard", x.device, _SHARD_FIELDS)
    full = _all_gather(x, dim, group, world)
    if world == 1 and balance == "contiguous":
        return full
    order = torch.argsort(_global_order(world, local, balance, x.device))
    return full.index_select(dim, order)


# ------------------------------------------------------------------------------------- agreement

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIELDS = ("B", "H", "Hkv", "local length", "D", "Dv", "dtype", "causal", "window left", "window right",
           "method", "balance", "scale (x1e6)", "dropout_p (x1e6)", "score terms (softcap 1, sinks 2, ALiBi 4, "
           "Relative 8, Span 16)", "softcap (x1e6)")
_TERM_BITS = {"softcap": 1, "sinks": 2, "bias=alibi": 4, "bias=relative": 8, "bias=span": 16}


_SHARD_FIELDS = ("dims", "dim", "dtype") + tuple(f"size {i}" for i in range(8)) + ("balance", "-")


def _agree(sig: List[int], group, world: int, fn: str, device, fields=_FIELDS, shared=(),
           problem: Optional[Exception] = None) -> List[int]:
    """All-gathers this rank's signature and raises on every rank if the ranks disagree. ``shared``:
    int64 values that ride along uncompared (as many on every rank); returns rank 0's (a dropout seed
    every rank then uses). ``problem``: this rank's own error with the call (then ``sig`` is any list
    of its length): raised here, after the gather, and every other rank raises too instead of waiting."""
    if world == 1:
        if problem is not None:
            raise problem
        return list(shared)
    mine = torch.tensor([list(sig) + [int(problem is not None)] + list(shared)], dtype=torch.int64, device=device)
    allsig = torch.empty(world, mine.shape[1], dtype=torch.int64, device=device)
    _gather_op()(allsig, mine, group=group)
    if problem is not None:
        raise problem
    failed = allsig[:, len(sig)].nonzero().flatten().tolist()
    if failed:
        _fail(ValueError, f"{fn}: rank(s) {', '.join(map(str, failed))} rejected the call (their error names the "
                          "argument); every rank raises")
    shared = allsig[0, len(sig) + 1:].tolist()
    allsig = allsig[:, :len(sig)]
    bad = (allsig != allsig[0]).any(0).nonzero().flatten().tolist()
    if bad:
        rows = allsig.tolist()
        what = "; ".join(f"{fields[i]}: " + ", ".join(f"rank {r}={rows[r][i]}" for r in range(world)) for i in bad)
        _fail(ValueError, f"{fn}: the ranks disagree on the call ({what})")
    return shared


def _chunk(q: Tensor, k: Tensor, v: Tensor, *, backend: str, seed: Optional[Tensor], **kw):
    """(out, lse) of one per-rank attention call; with dropout, drawn with the call's shared ``seed``
    (every rank and ring step the same, so that each pair's mask is the one-device call's at its
    absolute ``positions``)."""
    call = make_attn_call(q, k, v, return_lse=True, seed=seed, **kw)
    return base.select("attention", call, backend).run(call)


# ---------------------------------------------------------------------------------- point to point

def _peer(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not dist.group.WORLD else rank


def _exchange(group, sends: List[Tuple[Tensor, int]], recvs: List[Tuple[Tensor, int]]):
    """Starts the sends (tensor, group rank) and receives (buffer, group rank); returns the requests."""
    ops = []
    for t, to in sends:
        _count(t)
        ops.append(dist.P2POp(dist.isend, t, _peer(group, to), group))
    for buf, frm in recvs:
        ops.append(dist.P2POp(dist.irecv, buf, _peer(group, frm), group))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


# ------------------------------------------------------------------------------------------ ring

class _Pair(NamedTuple):
    qp: Piece        # query piece of this rank
    kp: Piece        # key piece of the source rank (positions within the source's shard)
    k0: int          # the visible key range of the pair, within the key piece
    k1: int


def _pairs(rank: int, src: int, world: int, local: int, balance: str, left: int, right: int) -> List[_Pair]:
    out = []
    for qp in pieces(rank, world, local, balance):
        for kp in pieces(src, world, local, balance):
            k0, k1 = Rule(qp.length, kp.length, left, right, q_offset=qp.start - kp.start).key_range(0, qp.length)
            if k1 > k0 and qp.length > 0:
                out.append(_Pair(qp, kp, k0, k1))
    return out


class _RingPlan(NamedTuple):
    group: object
    rank: int
    world: int
    local: int
    balance: str
    left: int
    right: int
    scale: float
    backend: str
    steps: int       # ring steps taken: 1 + the furthest source any rank needs
    dropout_p: float
    seed: Optional[Tensor]   # the call's dropout seed, the same on every rank (None without dropout)
    score: Optional[ScoreTerms] = None   # softcap and bias terms of every pair (sinks join after the merge)

    def pair(self, q, k, v, positions, params=None):
        """(out fp32 (float64 for float64 inputs), lse) of one (query piece, key range) pair at its absolute positions; ``params``:
        the score terms' tensors to use (leaves of the backward's recomputation), else the plan's."""
        terms = {}
        if self.score is not None:
            sc = self.score if params is None else self.score.with_tensors(params)
            terms = dict(softcap=sc.softcap, bias=list(sc.terms) or None)
        return _chunk(q, k, v, **_mask_args(self.left, self.right), scale=self.scale, positions=positions,
                      out_dtype=compute_dtype(q.dtype), dropout_p=self.dropout_p, seed=self.seed, backend=self.backend,
                      **terms)


def _ring_plan(group, rank, world, local, balance, left, right, scale, backend, dropout_p, seed,
               score=None) -> _RingPlan:
    steps = 1
    for s in range(1, world):
        if any(_pairs(r, (r - s) % world, world, local, balance, left, right) for r in range(world)):
            steps = s + 1
    return _RingPlan(group, rank, world, local, balance, left, right, scale, backend, steps, dropout_p, seed, score)


def _rotate(plan: _RingPlan, tensors: List[Tensor]):
    """Starts sending `tensors` to the next rank and receiving the previous rank's; -> (requests, buffers)."""
    bufs = [torch.empty_like(t) for t in tensors]
    nxt, prv = (plan.rank + 1) % plan.world, (plan.rank - 1) % plan.world
    return _exchange(plan.group, [(t, nxt) for t in tensors], [(b, prv) for b in bufs]), bufs


class _RingAttention(torch.autograd.Function):
    """The ring over inputs ``(q, k, v, plan, *params)``, ``params`` the score terms' tensors (softcap and
    bias terms: `plan.score`); returns the merged fp32 output and lse. The backward returns the terms'
    gradients summed over this rank's pairs in the ring's fixed order (this rank's share)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: _RingPlan, *params):
        parts = [[] for _ in pieces(plan.rank, plan.world, plan.local, plan.balance)]
        kv = [k.contiguous(), v.contiguous()]
        for s in range(plan.steps):
            reqs, nxt = _rotate(plan, kv) if s + 1 < plan.steps else ([], None)
            src = (plan.rank - s) % plan.world
            for p in _pairs(plan.rank, src, plan.world, plan.local, plan.balance, plan.left, plan.right):
                a, b = p.kp.local + p.k0, p.kp.local + p.k1
                qi = 0 if p.qp.local == 0 else 1
                parts[qi].append(plan.pair(q[:, :, p.qp.local:p.qp.local + p.qp.length], kv[0][:, :, a:b],
                                           kv[1][:, :, a:b], (p.qp.start, p.kp.start + p.k0)))
            _wait(reqs)
            kv = nxt
        B, H, _, _ = q.shape
        outs, lses = [], []
        for qp, ps in zip(pieces(plan.rank, plan.world, plan.local, plan.balance), parts):
            if ps:
                o, l = merge_attention(ps)
            else:
                o = torch.zeros(B, H, qp.length, v.shape[-1], dtype=compute_dtype(q.dtype), device=q.device)
                l = torch.full((B, H, qp.length), -math.inf, dtype=compute_dtype(q.dtype), device=q.device)
            outs.append(o)
            lses.append(l)
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse, *params)
        ctx.plan = plan
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, *params = ctx.saved_tensors
        plan = ctx.plan
        cdt = compute_dtype(q.dtype)            # float32 sums (float64 for float64 inputs)
        dparams = [torch.zeros(t.shape, dtype=cdt, device=t.device) for t in params]
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        grad_out = grad_out.contiguous()
        for s in range(plan.steps):
            src = (plan.rank - s) % plan.world
            for p in _pairs(plan.rank, src, plan.world, plan.local, plan.balance, plan.left, plan.right):
                a, b = p.kp.local + p.k0, p.kp.local + p.k1
                rows = slice(p.qp.local, p.qp.local + p.qp.length)
                g_lse = grad_lse[:, :, rows] if grad_lse is not None else None
                pdq, pdk, pdv, *pdp = _pair_grads(plan, q[:, :, rows], kv[0][:, :, a:b], kv[1][:, :, a:b],
                                                  (p.qp.start, p.kp.start + p.k0), out[:, :, rows], lse[:, :, rows],
                                                  grad_out[:, :, rows], g_lse, params)
                for acc, g in zip(dparams, pdp):
                    acc += g
                dq[:, :, rows] += pdq
                dk[:, :, a:b] += pdk
                dv[:, :, a:b] += pdv
            if s + 1 < plan.steps:                    # K/V and their gradient sums move on together
                reqs, bufs = _rotate(plan, kv + [dk, dv])
                _wait(reqs)
                kv, (dk, dv) = bufs[:2], bufs[2:]
        if plan.steps > 1:                            # the sums go home to their owners
            owner, mine = (plan.rank - plan.steps + 1) % plan.world, (plan.rank + plan.steps - 1) % plan.world
            bufs = [torch.empty_like(dk), torch.empty_like(dv)]
            _wait(_exchange(plan.group, [(dk, owner), (dv, owner)], [(bufs[0], mine), (bufs[1], mine)]))
            dk, dv = bufs
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None,
                *[g.to(t.dtype) for g, t in zip(dparams, params)])


def _pair_grads(plan, q, k, v, positions, out, lse, dout, dlse, params=()):
    """dq, dk, dv (float32; float64 for float64 inputs) of one ring pair: its forward recomputed on the call's backend and its
    backward through the merge's chain rule. With ``w = exp(lse_r - lse)`` the merged output is
    ``sum_r w_r o_r``, so the pair's output receives ``w dout`` and its lse
    ``w (rowsum(dout * (o_r - out)) + dlse)``; the pair's own backward (flash on the CPU, Triton on a
    GPU) then gives exactly its share of the whole call's gradients (and of the score terms' tensors
    ``params``: zero where the pair does not use one)."""
    cdt = compute_dtype(q.dtype)
    with torch.enable_grad():
        qp, kp, vp = (t.detach().requires_grad_() for t in (q, k, v))
        leaves = [t.detach().requires_grad_() for t in params]
        o, l = plan.pair(qp, kp, vp, positions, leaves or None)  # with dropout: the forward's mask again
        seen = ~torch.isinf(l)
        w = torch.where(seen, torch.exp(torch.where(seen, l.detach(), lse) - lse), torch.zeros_like(l))
        g_l = (dout.to(cdt) * (o.detach().to(cdt) - out)).sum(-1)
        if dlse is not None:
            g_l = g_l + dlse
        grads = torch.autograd.grad((o, l), (qp, kp, vp, *leaves), (w[..., None] * dout.to(cdt), w * g_l),
                                    allow_unused=True)
    return tuple(torch.zeros(t.shape, dtype=cdt, device=t.device) if g is None else g.to(cdt)
                 for g, t in zip(grads, (qp, kp, vp, *leaves)))


# ------------------------------------------------------------------------------------------ halo

class _Halo(torch.autograd.Function):
    """Each rank's keys/values extended by the ``hl`` keys before its shard (from the previous rank)
    and the ``hr`` keys after it (from the next); the backward returns the halo gradients."""

    @staticmethod
    def forward(ctx, k, v, group, rank, world, hl, hr):
        ctx.meta = (group, rank, world, hl, hr)
        has_prev, has_next = rank > 0 and hl > 0, rank < world - 1 and hr > 0
        sends, recvs, got = [], [], {}
        for t in (k, v):
            if rank < world - 1 and hl > 0:
                sends.append((t[:, :, t.shape[2] - hl:].contiguous(), rank + 1))
            if rank > 0 and hr > 0:
                sends.append((t[:, :, :hr].contiguous(), rank - 1))
        for name, t in (("k", k), ("v", v)):
            if has_prev:
                got[name, "prev"] = torch.empty(t.shape[0], t.shape[1], hl, t.shape[3], dtype=t.dtype, device=t.device)
                recvs.append((got[name, "prev"], rank - 1))
            if has_next:
                got[name, "next"] = torch.empty(t.shape[0], t.shape[1], hr, t.shape[3], dtype=t.dtype, device=t.device)
                recvs.append((got[name, "next"], rank + 1))
        _wait(_exchange(group, sends, recvs))
        ctx.sizes = (hl if has_prev else 0, hr if has_next else 0)
        return tuple(torch.cat(([got[n, "prev"]] if has_prev else []) + [t] + ([got[n, "next"]] if has_next else []), 2)
                     for n, t in (("k", k), ("v", v)))

    @staticmethod
    def backward(ctx, gk, gv):
        group, rank, world, hl, hr = ctx.meta
        before, after = ctx.sizes
        sends, recvs, grads = [], [], []
        for g in (gk, gv):
            L = g.shape[2] - before - after
            mid = g[:, :, before:before + L].clone()
            if before:
                sends.append((g[:, :, :before].contiguous(), rank - 1))
            if after:
                sends.append((g[:, :, before + L:].contiguous(), rank + 1))
            from_next = torch.empty_like(mid[:, :, L - hl:]) if rank < world - 1 and hl > 0 else None
            from_prev = torch.empty_like(mid[:, :, :hr]) if rank > 0 and hr > 0 else None
            if from_next is not None:
                recvs.append((from_next, rank + 1))
            if from_prev is not None:
                recvs.append((from_prev, rank - 1))
            grads.append((mid, from_next, from_prev))
        _wait(_exchange(group, sends, recvs))
        out = []
        for mid, from_next, from_prev in grads:
            L = mid.shape[2]
            if from_next is not None:
                mid[:, :, L - hl:] += from_next
            if from_prev is not None:
                mid[:, :, :hr] += from_prev
            out.append(mid)
        return out[0], out[1], None, None, None, None, None


# -------------------------------------------------------------------------------------- all-to-all

class _AllToAll(torch.autograd.Function):
    """all_to_all along dim 0 split in ``world`` equal chunks (its own inverse: the backward is the same)."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return _a2a(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, ctx.group, ctx.world), None, None


def _a2a(x, group, world):
    x = x.contiguous()
    out = torch.empty_like(x)
    _count(x, (world - 1) / world)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: Tensor, group, world: int, order: Tensor) -> Tensor:
    """(B, H, Lloc, D) sequence shards -> (B, H / W, L, D) head shards, tokens in global order."""
    B, H, Lloc, D = x.shape
    y = x.permute(1, 0, 2, 3).reshape(world, H // world, B, Lloc, D)
    y = _AllToAll.apply(y, group, world)                              # (W sources, H/W, B, Lloc, D)
    y = y.permute(2, 1, 0, 3, 4).reshape(B, H // world, world * Lloc, D)
    return y.index_select(2, torch.argsort(order))


def _heads_to_seq(y: Tensor, group, world: int, order: Tensor) -> Tensor:
    """The inverse of `_seq_to_heads`: (B, H / W, L, D) -> (B, H, Lloc, D)."""
    B, Hl, L, D = y.shape
    y = y.index_select(2, order).reshape(B, Hl, world, L // world, D).permute(2, 1, 0, 3, 4)
    y = _AllToAll.apply(y, group, world)                              # (W head groups, H/W, B, Lloc, D)
    return y.reshape(world * Hl, B, L // world, D).permute(1, 0, 2, 3)


# ------------------------------------------------------------------------------------- the driver

def attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, method: str = "ring", balance: str = "contiguous",
              causal: bool = False, window=None, scale: Optional[float] = None, dropout_p: float = 0.0,
              softcap: Optional[float] = None, sinks: Optional[Tensor] = None, bias=None,
              return_lse: bool = False, backend: str = "auto"):
    """Self-attention over a sequence sharded along its length (see the module docstring).

    Args:
        q, k, v: this rank's shards ``(B, H, L/W, D)``, ``(B, Hkv, L/W, D)``, ``(B, Hkv, L/W, Dv)``, as
            `shard` cuts them with the same ``balance``.
        group: the process group (default: the world).
        method: ``"ring"`` (a halo exchange for small windows), ``"ulysses"`` or ``"allgather"``.
        balance: how the sequence was sharded: ``"contiguous"`` or ``"zigzag"``.
        causal, window, scale: as :func:`effattn.attention`, over global positions.
        dropout_p: dropout on the attention probabilities: each pair draws at its absolute (row, key)
            and global head with rank 0's seed (drawn from torch's generator as a one-device call
            would), so the ranks drop exactly the pairs ``effattn.attention`` drops under the same
            ``torch.manual_seed``, forward and backward.
        softcap, sinks, bias: score terms as :func:`effattn.attention` takes them, over global positions
            (every rank passes the same): softcap, sinks ``(H,)`` and the bias terms ``effattn.bias.ALiBi``,
            ``Relative``, ``Span`` (a dense bias tensor is refused: it would be the whole ``(L, L)``
            sequence's). Ring and allgather calls place each chunk at its absolute positions (the
            terms read ``pos(i) - j`` of the whole sequence; the ring adds the sinks once, after its
            merge); Ulysses slices the per-head tensors to the rank's heads. Their gradients are this
            rank's share (sum them over the group, as DDP does for every parameter).
        return_lse: also return this rank's rows of the log-sum-exp (float32).
        backend: the backend of the per-rank attention calls.

    Returns:
        this rank's rows of the output ``(B, H, L/W, Dv)`` (and lse), in shard order.
    """
    fn = "effattn.distributed.attention"
    group, rank, world = _group(group)
    try:           # a rank's bad input: raised on every rank after the agreement's gather, never a hang
        call, left, right = _check_call(q, k, v, method, balance, causal, window, scale, dropout_p, world, fn,
                                        softcap=softcap, sinks=sinks, bias=bias)
        feats = call.score.features() if call.score is not None else set()
        sig, problem = [call.B, call.H, call.Hkv, call.Lq, call.D, call.Dv, _DTYPES.index(q.dtype), int(causal),
                        left, right, METHODS.index(method), BALANCES.index(balance),
                        round(call.scale * 1e6), round(call.dropout_p * 1e6),
                        sum(b for f, b in _TERM_BITS.items() if f in feats), round((softcap or 0) * 1e6)], None
    except (ValueError, TypeError) as e:
        call, sig, problem = None, [0] * len(_FIELDS), e
    # a dropout seed drawn as the one-device call draws it: rank 0's rides along the signature
    seed = call.seed if call is not None else None
    shared = _agree(sig, group, world, fn, q.device, shared=seed.tolist() if seed is not None else (0, 0),
                    problem=problem)
    if seed is not None:
        seed = torch.tensor(shared, dtype=torch.int64)
    local = call.Lq
    drop = dict(dropout_p=call.dropout_p, seed=seed)
    terms = dict(softcap=softcap, sinks=sinks, bias=bias) if call.score is not None else {}
    if method == "ring":
        if balance == "contiguous" and world > 1 and 0 <= left <= local and 0 <= right <= local:
            return _halo_attention(q, k, v, call, left, right, group, rank, world, return_lse, backend,
                                   dict(drop, **terms))
        score = None if call.score is None else ScoreTerms(call.score.softcap, None, call.score.terms)
        plan = _ring_plan(group, rank, world, local, balance, left, right, call.scale, backend, **drop, score=score)
        out, lse = _RingAttention.apply(q, k, v, plan, *(score.tensors() if score is not None else ()))
        if call.score is not None and call.score.sinks is not None:
            out, lse = _add_sinks(out, lse, call.score.sinks)
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out
    return _gathered_attention(q, k, v, call, method, balance, left, right, group, rank, world, return_lse, backend,
                               drop, terms)


def _add_sinks(out: Tensor, lse: Tensor, sinks: Tensor):
    """The ring's merged (out, lse) with each head's sink logit joined to the normalizer once:
    ``lse' = log(exp(lse) + exp(sink))``, ``out' = exp(lse - lse') out`` (a row that saw no key: 0,
    lse' = sink). Differentiable in out, lse and sinks."""
    sk = sinks.to(lse.dtype)[None, :, None].expand_as(lse)
    total = torch.logaddexp(lse, sk)
    return out * torch.exp(lse - total)[..., None], total


def _check_call(q, k, v, method, balance, causal, window, scale, dropout_p, world, fn, **terms):
    """This rank's validated call and the whole sequence's window bounds (or a ValueError / TypeError)."""
    if method not in METHODS:
        _fail(ValueError, f"{fn}: method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    _check_balance(balance, fn)
    bias = terms.get("bias")
    items = list(bias) if isinstance(bias, (list, tuple)) else [bias]
    if any(isinstance(x, (Tensor, Dense)) for x in items):
        _fail(ValueError, f"{fn}: bias: a dense bias tensor cannot be combined with context parallelism (it would "
                          "be the whole sequence's (L, L) pairs); use effattn.bias.ALiBi, Relative or Span")
    call = make_attn_call(q, k, v, causal=causal, window=window, scale=scale, dropout_p=dropout_p, **terms)
    # the whole sequence's window bounds (the shard-sized call clamps a window wider than a shard away)
    left, right = normalize_window(window, causal)
    if call.Lq != call.Lk:
        _fail(ValueError, f"{fn}: q and k must hold the same tokens (self-attention shards), got Lq={call.Lq}, "
                          f"Lk={call.Lk}")
    if balance == "zigzag" and call.Lq % 2:
        _fail(ValueError, f"{fn}: a zigzag shard has an even length (the sequence divisible by 2 x world size "
                          f"{2 * world}), got a local length {call.Lq}")
    if method == "ulysses" and call.H % world:
        _fail(ValueError, f"{fn}: method='ulysses' needs the number of heads H={call.H} divisible by the world "
                          f"size {world}")
    return call, left, right


def _head_slice(call, h0: int, h1: int) -> dict:
    """The score terms' arguments of a head shard (heads ``h0 .. h1``): sinks, ALiBi slopes, relative
    tables and span z sliced along their head dimension (differentiable: the gradients of the other
    heads' entries are zero on this rank)."""
    if call.score is None:
        return {}
    sc = call.score
    bias = []
    for t in sc.terms:
        if isinstance(t, ALiBi):
            bias.append(t.with_params(t.slopes[..., h0:h1]))
        else:                       # Relative (table (H, W)), Span (z (H,))
            bias.append(t.with_params(*[p[h0:h1] for p in t.params()]))
    return dict(softcap=sc.softcap, sinks=None if sc.sinks is None else sc.sinks[h0:h1], bias=bias or None)


def _gathered_attention(q, k, v, call, method, balance, left, right, group, rank, world, return_lse, backend, drop,
                        terms=None):
    """``"ulysses"`` (all-to-all to head shards and back) and ``"allgather"``."""
    terms = terms or {}
    local = call.Lq
    order = _global_order(world, local, balance, q.device)
    if method == "ulysses":
        G = call.H // call.Hkv
        if call.Hkv % world:                 # each head shard needs its key/value heads: repeat them
            k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        qh, kh, vh = (_seq_to_heads(t, group, world, order) for t in (q, k, v))
        # the rank's heads are heads rank * H/W .. of H: dropout draws at the global head index
        h0, h1 = rank * (call.H // world), (rank + 1) * (call.H // world)
        out, lse = _chunk(qh, kh, vh, **_mask_args(left, right), scale=call.scale, backend=backend,
                          heads=(h0, call.H), **drop, **_head_slice(call, h0, h1))
        out = _heads_to_seq(out, group, world, order)
        lse = _heads_to_seq(lse[..., None], group, world, order)[..., 0]
        return (out, lse) if return_lse else out
    kf, vf = (_all_gather(t, 2, group, world).index_select(2, torch.argsort(order)) for t in (k, v))
    outs, lses = [], []
    for p in pieces(rank, world, local, balance):
        rows = slice(p.local, p.local + p.length)
        k0, k1 = Rule(p.length, kf.shape[2], left, right, q_offset=p.start).key_range(0, p.length)
        k0, k1 = (0, 0) if k1 <= k0 else (k0, k1)
        o, l = _chunk(q[:, :, rows], kf[:, :, k0:k1], vf[:, :, k0:k1], **_mask_args(left, right),
                      scale=call.scale, positions=(p.start, k0), backend=backend, **drop, **terms)
        outs.append(o)
        lses.append(l)
    out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
    return (out, lse) if return_lse else out


def _mask_args(left: int, right: int) -> dict:
    """``causal`` / ``window`` of a chunk call with the normalized bounds (``right = 0`` is causal, so
    that a causal chunk takes the backends' causal paths)."""
    causal, window = public_window(left, right, right == 0)
    return dict(causal=causal, window=window)


def _halo_attention(q, k, v, call, left, right, group, rank, world, return_lse, backend, drop):
    local = call.Lq
    ke, ve = _Halo.apply(k, v, group, rank, world, left, right)
    before = left if rank > 0 else 0
    out, lse = _chunk(q, ke, ve, **_mask_args(left, right), scale=call.scale,
                      positions=(rank * local, rank * local - before), backend=backend, **drop)
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------ linear attention

def linear_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool = False, feature_map="elu",
                     normalize: bool = True, eps: float = 1e-6, backend: str = "auto") -> Tensor:
    """:func:`effattn.linear_attention` over a sequence sharded contiguously (``balance="contiguous"``;
    linear attention's cost is the same on every rank). Each rank sums its keys into ``(S, z)``; the
    ranks' states are all-gathered; rank r starts from the sum of ranks ``< r`` (causal) or of all other
    ranks (not causal) as ``initial_state``. Differentiable (the state gradients return by reduce-scatter)."""
    fn = f"effattn.distributed.{LINEAR}"
    group, rank, world = _group(group)
    call = make_linear_call(q, k, v, causal=causal, feature_map=feature_map, normalize=normalize, eps=eps)
    if q.shape[2] != k.shape[2]:
        _fail(ValueError, f"{fn}: q and k must hold the same tokens (self-attention shards), got Lq={q.shape[2]}, "
                          f"Lk={k.shape[2]}")
    B, H, L, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    _agree([B, H, Hkv, L, D, Dv, _DTYPES.index(q.dtype), int(causal), call.num_features, 0, 0, 0,
            round(eps * 1e6)], group, world, fn, q.device)
    cdt = compute_dtype(q.dtype)
    fk = call.phi(k.to(cdt))                                               # (B, Hkv, L, F)
    S = torch.matmul(fk.transpose(-1, -2), v.to(cdt)).repeat_interleave(H // Hkv, 1)   # (B, H, F, Dv)
    z = fk.sum(2).repeat_interleave(H // Hkv, 1)                           # (B, H, F)
    Fdim = S.shape[2]
    flat = torch.cat([S.reshape(B * H * Fdim * Dv), z.reshape(B * H * Fdim)])[None]
    allst = _all_gather(flat, 0, group, world)                             # (W, n)
    # every rank's state enters (weight 0 or 1) so that every rank's backward takes part in the
    # reduce-scatter; summed in a fixed order, ranks ascending
    weight = torch.tensor([float(r < rank if causal else r != rank) for r in range(world)], dtype=cdt,
                          device=q.device)
    init = torch.zeros_like(flat[0])
    for r in range(world):
        init = init + weight[r] * allst[r]
    S0 = init[:B * H * Fdim * Dv].reshape(B, H, Fdim, Dv)
    z0 = init[B * H * Fdim * Dv:].reshape(B, H, Fdim)
    return local_linear(q, k, v, causal=causal, feature_map=feature_map, normalize=normalize, eps=eps,
                        initial_state=(S0, z0), backend=backend)


# ------------------------------------------------------------------------------------------ modules

class ContextParallel:
    """Context parallelism for `effattn.swap_attention(model, context_parallel=ContextParallel(group))`
    (or ``effattn.nn.MultiheadAttention(..., context_parallel=...)``): every swapped self-attention
    module then receives this rank's shard of the sequence (``(B, L/W, E)`` batch-first, as `shard`
    cuts it along the sequence dim with the same ``balance``) and attends over the whole sequence with
    `attention` (``method``) or, for modules built with ``linear=``, `linear_attention` (contiguous
    shards). Projections are per token, so the rest of the model runs on the shard unchanged;
    parameter gradients are this rank's share (sum them over the group, as DDP does)."""

    def __init__(self, group=None, method: str = "ring", balance: str = "contiguous"):
        if method not in METHODS:
            _fail(ValueError, f"ContextParallel: method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
        _check_balance(balance, "ContextParallel")
        self.group, self.method, self.balance = group, method, balance

    def __repr__(self):
        return f"ContextParallel(method={self.method!r}, balance={self.balance!r})"

    def module_attention(self, module, plan, step, q, k, v, cache) -> Tensor:
        """The attention of an effattn.nn.MultiheadAttention call on this rank's shard."""
        fn = "MultiheadAttention(context_parallel=...)"
        if cache is not None:
            _fail(ValueError, f"{fn}: a KV cache cannot be combined with context parallelism")
        if plan.op is None:
            _fail(ValueError, f"{fn}: serves the fused paths only, this call needs {plan.reasons[0]} "
                              "(call with need_weights=False, no attn_mask)")
        if step.kpm is not None:
            _fail(ValueError, f"{fn}: key_padding_mask cannot be combined with context parallelism")
        if plan.op == "linear_attention":
            if self.balance != "contiguous":
                _fail(ValueError, f"{fn}: linear attention needs balance='contiguous'")
            phi = module._modules["feature_map"] if "feature_map" in module._modules else module._linear_spec
            out = linear_attention(q, k, v, group=self.group, causal=step.causal, feature_map=phi,
                                   backend=module.backend)
            return out.to(step.query.dtype)
        return attention(q, k, v, group=self.group, method=self.method, balance=self.balance, causal=step.causal,
                         window=module.window, dropout_p=module.dropout if module.training else 0.0,
                         bias=module._position_terms(), backend=module.backend)
