"""The torch backend's path ``torch/cpu-blocks``: softmax attention on CPU computing only the visible
key blocks, for what torch's flash CPU kernel (``torch/cpu-flash``) does not compute exactly:
windows, block layouts, key padding, bottom-right causal with ``Lq != Lk``, ``Dv != D``. No dropout
(``torch/reference`` serves it, its mask regenerated per chunk from the call's seed).

Queries and keys are cut into blocks; each query block gathers the key blocks it may see (a band for
a window, the layout's blocks for a layout) and a whole group of query blocks is computed by one
batched matmul. The call's key/value heads (or batch entries) run as independent slices on all of
torch's threads, one intra-op thread each (threads.py: many ops on many threads scale badly). The
group size bounds the extra memory, so peak memory stays O(L). The backward recomputes
probabilities from the saved log-sum-exp (FlashAttention-2, Dao 2023, Alg. 2) and scatters key
gradients back with ``index_add_`` (deterministic on CPU).
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from ....numerics import compute_dtype
from ....visibility import Rule
from ...autograd import eager_op_pair
from ...base import FEATURES, PACKED_FEATURES, SCORE_FEATURES, Capabilities, Path, register, switches
from .. import threads

BLOCK = 64               # query/key block of the blocks path when the call has no layout
GROUP_BUDGET = 1 << 22   # score elements (B x H x rows x keys) of the groups computed at once: 16 MiB
                         # in float32; a few tensors of this size live at a time in the backward

# Set to False to send every CPU call to the chunked reference (tests compare the paths).
ENABLED = True
switches(__name__, "ENABLED")
CPU_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def cpu_reasons(call) -> List[str]:
    """Why neither fused CPU path (this one, ``torch/cpu-flash``) takes a call they declare to serve."""
    if not ENABLED:
        return ["fused CPU paths turned off (cpu_blocks.ENABLED is False)"]
    if call.q.numel() == 0 or call.k.numel() == 0 or call.v.numel() == 0:
        return ["an empty shape (torch's flash CPU kernel faults on Lq == 0; the reference serves it)"]
    return []


# ------------------------------------------------------------------------------------ the plan

class _Group(NamedTuple):
    b0: int        # query blocks [b0, b1)
    b1: int
    idx: Tensor    # (Hl, g, M) key blocks each query block gathers; nkb = a padding block (no key)


_PLANS = WeakTensorKeyDictionary()   # layout mask -> {plan key: groups}
_DENSE_PLANS: dict = {}              # plan key -> groups, for calls without a layout


def _plan(Lq, Lk, bs, wl, wr, layout_mask, rows_per_block, budget=GROUP_BUDGET) -> List[_Group]:
    """The groups of query blocks of a call and the key blocks each gathers. Block (i, j) is kept
    when the layout allows it and the window/causal band of some row of i reaches into j."""
    key = (Lq, Lk, bs, wl, wr, rows_per_block, budget)
    cache = _DENSE_PLANS if layout_mask is None else _PLANS.setdefault(layout_mask, {})
    if key in cache:
        return cache[key]
    rule = Rule(Lq, Lk, wl, wr)
    nqb, nkb = -(-Lq // bs), -(-Lk // bs)
    first_row = torch.arange(nqb) * bs
    last_row = torch.clamp(torch.arange(1, nqb + 1) * bs, max=Lq) - 1
    lo, hi = rule.first_key(first_row), rule.last_key(last_row)   # the band of some row of the block
    k0 = torch.zeros(nqb, dtype=torch.long) if lo is None else lo.clamp(min=0)
    k1 = torch.full((nqb,), Lk, dtype=torch.long) if hi is None else (hi + 1).clamp(max=Lk)
    kstart = torch.arange(nkb) * bs
    kend = torch.clamp(torch.arange(1, nkb + 1) * bs, max=Lk) - 1
    vis = (kend[None, :] >= k0[:, None]) & (kstart[None, :] < k1[:, None]) & (k1 > k0)[:, None]
    vis = vis[None] if layout_mask is None else vis[None] & layout_mask.cpu()
    counts = vis.sum(-1).amax(0).tolist()                        # per query block, max over heads
    order = torch.argsort((~vis).to(torch.int8), dim=-1, stable=True)  # visible blocks first, ascending
    groups, b0 = [], 0
    while b0 < nqb:
        b1, M = b0, 0
        while b1 < nqb:
            m = max(M, counts[b1])
            if b1 > b0 and (b1 + 1 - b0) * m * rows_per_block * bs > budget:
                break
            b1, M = b1 + 1, m
        if M > 0:
            idx = order[:, b0:b1, :M].clone()
            idx[~torch.gather(vis[:, b0:b1], 2, idx)] = nkb                  # padding slots
            groups.append(_Group(b0, b1, idx))
        b0 = b1
    if len(cache) > 64:
        cache.clear()
    cache[key] = groups
    return groups


# ----------------------------------------------------------------------------- the blocks path

class _Geometry(NamedTuple):
    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    bs: int
    per_head: bool   # the layout differs per head: gather keys per query head


def _arrange(x: Tensor, g0: _Group, geo: _Geometry) -> Tensor:
    """Rows of query blocks [b0, b1) of x (B, H, Lq, X), zero-padded to whole blocks, as
    (B, heads, g, rows, X): heads = H and rows = bs per query head, or heads = Hkv and rows = G*bs
    (the query heads sharing a key/value head side by side, one matmul against its keys)."""
    B, H, Hkv, Lq, _, bs, per_head = geo
    g = g0.b1 - g0.b0
    r0, r1 = g0.b0 * bs, min(g0.b1 * bs, Lq)
    xs = x[:, :, r0:r1]
    if r1 - r0 < g * bs:
        xs = F.pad(xs, (0, 0, 0, g * bs - (r1 - r0)))
    if per_head:
        return xs.reshape(B, H, g, bs, -1)
    G = H // Hkv
    return xs.reshape(B, Hkv, G, g, bs, -1).transpose(2, 3).reshape(B, Hkv, g, G * bs, -1)


def _unarrange(y: Tensor, g0: _Group, geo: _Geometry) -> Tensor:
    """The inverse of `_arrange`: (B, heads, g, rows, X) -> (B, H, rows of the group, X)."""
    B, H, Hkv, Lq, _, bs, per_head = geo
    g = g0.b1 - g0.b0
    n = min(g0.b1 * bs, Lq) - g0.b0 * bs
    if not per_head:
        y = y.reshape(B, Hkv, g, H // Hkv, bs, -1).transpose(2, 3)
    return y.reshape(B, H, g * bs, -1)[:, :, :n]


def _gather(kb: Tensor, g0: _Group, geo: _Geometry) -> Tensor:
    """Key (or value) blocks kb (B, Hkv, nkb+1, bs, X) gathered for the group: (B, heads, g, M*bs, X)."""
    H, Hkv = geo.H, geo.Hkv
    Hl, g, M = g0.idx.shape
    if geo.per_head:
        head = (torch.arange(H) // (H // Hkv)).view(H, 1, 1)
        out = kb[:, head, g0.idx.expand(H, g, M)]                     # (B, H, g, M, bs, X)
    else:
        out = kb[:, :, g0.idx[0]]                                     # (B, Hkv, g, M, bs, X)
    return out.reshape(out.shape[0], out.shape[1], g, M * geo.bs, -1)


def _key_positions(g0: _Group, bs: int) -> Tensor:
    """(Hl, g, M*bs) positions of the gathered keys (padding slots point past the end)."""
    Hl, g, M = g0.idx.shape
    return (g0.idx[..., None] * bs + torch.arange(bs)).reshape(Hl, g, M * bs)


def _mask(g0: _Group, geo: _Geometry, wl: int, wr: int, kpm_pad: Optional[Tensor]) -> Tensor:
    """Visible (query, key) pairs of the group, broadcastable to its scores (B, heads, g, rows, keys)."""
    bs = geo.bs
    kpos = _key_positions(g0, bs)                                     # (Hl, g, K)
    rule = Rule(geo.Lq, geo.Lk, wl, wr)
    rows = torch.arange(g0.b0 * bs, g0.b1 * bs).view(1, -1, bs, 1)
    lo, hi = rule.first_key(rows), rule.last_key(rows)
    k4 = kpos[:, :, None, :]
    vis = k4 < geo.Lk                                                 # (Hl, g, 1, K)
    if lo is not None:
        vis = vis & (k4 >= lo)
    if hi is not None:
        vis = vis & (k4 <= hi)
    vis = vis[None]                                                   # (1, Hl, g, bs or 1, K)
    if kpm_pad is not None:
        vis = vis & ~kpm_pad[:, kpos][:, :, :, None, :]               # (B, Hl, g, ., K)
    if not geo.per_head:
        G = geo.H // geo.Hkv
        b, hl, g, r, K = vis.shape
        if r > 1 and G > 1:
            vis = vis[:, :, :, None].expand(b, hl, g, G, r, K).reshape(b, hl, g, G * r, K)
    return vis


def _seen_only(x: Tensor, vis: Tensor) -> Tensor:
    """Gathered keys or values ``x (B, heads, g, K, X)`` with zeros for the keys no row of their query
    block sees under ``vis`` (`_mask`), so that whatever an ignored key holds (NaN, inf in padding)
    gives 0 * 0 in a product, never 0 * NaN."""
    return torch.where(vis.any(-2)[..., None], x, 0.0)


def _setup(q, k, v, layout_mask, layout_block, wl, wr):
    """(block size, per-head layout?, slices of the call run in parallel, the plan)."""
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    bs = layout_block if layout_mask is not None else BLOCK
    per_head = layout_mask is not None and layout_mask.shape[0] > 1 and H > 1
    by_heads = Hkv >= B                                          # slice along kv heads, else batch
    slices = threads.ranges(Hkv if by_heads else B, torch.get_num_threads())
    n = max(b - a for a, b in slices)
    rows = (B * n * (H // Hkv) if by_heads else n * H) * bs        # query rows of one block in a slice
    # slices run at once: split the budget so that the extra memory stays the same at any thread count
    budget = max(GROUP_BUDGET // len(slices), 1 << 20)
    return bs, per_head, by_heads, slices, _plan(Lq, Lk, bs, wl, wr, layout_mask, rows, budget)


def _slice(by_heads, a, b, G, *tensors):
    """The part (kv heads [a, b) or batch entries [a, b)) of q-like (heads = G per kv head), k-like
    (heads = 1 per kv head) and batch-only tensors, given as (tensor, kind) pairs."""
    out = []
    for t, kind in tensors:
        if t is None:
            out.append(None)
        elif not by_heads:
            out.append(t[a:b])
        elif kind == "batch":
            out.append(t)
        else:
            m = G if kind == "q" else 1
            out.append(t[:, a * m:b * m])
    return out


def _slice_groups(groups, per_head, by_heads, a, b, G):
    if not (per_head and by_heads):
        return groups
    return [g._replace(idx=g.idx[a * G:b * G]) for g in groups]


def _blocks(kb_source: Tensor, bs: int, nkb: int, cdt) -> Tensor:
    """(B, Hkv, Lk, X) -> (B, Hkv, nkb+1, bs, X) in the compute dtype, zero-padded to whole blocks
    plus the padding block that padding slots of a plan point to."""
    B, Hkv, Lk, X = kb_source.shape
    return F.pad(kb_source.to(cdt), (0, 0, 0, (nkb + 1) * bs - Lk)).view(B, Hkv, nkb + 1, bs, X)


def _slice_setup(q, k, v, kpm, bs, per_head):
    """What a forward and a backward slice both start from: the geometry, the number of key blocks,
    the compute dtype, K and V as blocks, and the key padding mask padded to the same length."""
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    geo = _Geometry(B, H, Hkv, Lq, Lk, bs, per_head)
    nkb, cdt = -(-Lk // bs), compute_dtype(q.dtype)
    kb, vb = _blocks(k, bs, nkb, cdt), _blocks(v, bs, nkb, cdt)
    kpm_pad = None if kpm is None else F.pad(kpm, (0, (nkb + 1) * bs - Lk), value=True)
    return geo, nkb, cdt, kb, vb, kpm_pad


def _forward_slice(q, k, v, kpm, scale, wl, wr, groups, bs, per_head):
    geo, _, cdt, kb, vb, kpm_pad = _slice_setup(q, k, v, kpm, bs, per_head)
    B, H, Lq = geo.B, geo.H, geo.Lq
    out = torch.zeros(B, H, Lq, v.shape[-1], dtype=q.dtype)
    lse = torch.full((B, H, Lq), -math.inf, dtype=cdt)
    qc = q.to(cdt)
    for g0 in groups:
        s = torch.matmul(_arrange(qc, g0, geo), _gather(kb, g0, geo).transpose(-1, -2)).mul_(scale)
        vis = _mask(g0, geo, wl, wr, kpm_pad)
        s.masked_fill_(~vis, -math.inf)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)      # empty rows: exp(-inf - 0) = 0
        p = s.sub_(m).exp_()
        l = p.sum(-1, keepdim=True)
        p.div_(torch.where(l > 0, l, torch.ones_like(l)))
        o = torch.matmul(p, _seen_only(_gather(vb, g0, geo), vis))
        r0, n = g0.b0 * bs, min(g0.b1 * bs, Lq) - g0.b0 * bs
        out[:, :, r0:r0 + n] = _unarrange(o, g0, geo).to(q.dtype)
        lse[:, :, r0:r0 + n] = _unarrange(m + torch.log(l), g0, geo).squeeze(-1)
    return out, lse


def blocks_forward(q, k, v, layout_mask, layout_block, key_padding_mask, scale, wl, wr):
    """out (B, H, Lq, Dv) in q's dtype, lse (B, H, Lq) float32 (float64 for float64 inputs)."""
    bs, per_head, by_heads, slices, groups = _setup(q, k, v, layout_mask, layout_block, wl, wr)
    G = q.shape[1] // k.shape[1]

    def one(a, b):
        qs, ks, vs, kpm = _slice(by_heads, a, b, G, (q, "q"), (k, "k"), (v, "k"), (key_padding_mask, "batch"))
        return _forward_slice(qs, ks, vs, kpm, scale, wl, wr, _slice_groups(groups, per_head, by_heads, a, b, G),
                              bs, per_head)

    parts = threads.run_slices(one, slices)
    dim = 1 if by_heads else 0
    return torch.cat([o for o, _ in parts], dim), torch.cat([l for _, l in parts], dim)


def _backward_slice(grad_out, grad_lse, q, k, v, out, lse, kpm, scale, wl, wr, groups, bs, per_head):
    geo, nkb, cdt, kb, vb, kpm_pad = _slice_setup(q, k, v, kpm, bs, per_head)
    B, H, Hkv, Lq, Lk = geo.B, geo.H, geo.Hkv, geo.Lq, geo.Lk
    delta = (grad_out.to(cdt) * out.to(cdt)).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(cdt)                           # dS += dlse * P
    lse = lse.to(cdt)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    heads = H if per_head else Hkv
    Lpad = (nkb + 1) * bs
    dk = torch.zeros(B, heads * Lpad, q.shape[-1], dtype=cdt)
    dv = torch.zeros(B, heads * Lpad, v.shape[-1], dtype=cdt)
    dq = torch.zeros(q.shape, dtype=q.dtype)
    qc, doc = q.to(cdt), grad_out.to(cdt)
    for g0 in groups:
        qg, dog = _arrange(qc, g0, geo), _arrange(doc, g0, geo)     # padded rows have dO = 0
        kg, vg = _gather(kb, g0, geo), _gather(vb, g0, geo)
        s = torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale)
        vis = _mask(g0, geo, wl, wr, kpm_pad)
        s.masked_fill_(~vis, -math.inf)
        kg, vg = _seen_only(kg, vis), _seen_only(vg, vis)
        # masked and empty rows give 0; s - lse <= 0 exactly, but an lse from another kernel (the
        # flash paths' forward) rounds its scores differently: P is capped at 1 (no exp overflow)
        p = s.sub_(_arrange(lse_safe[..., None], g0, geo)).clamp_(max=0.0).exp_()
        ds = torch.matmul(dog, vg.transpose(-1, -2)).sub_(_arrange(delta[..., None], g0, geo)).mul_(p)
        r0, n = g0.b0 * bs, min(g0.b1 * bs, Lq) - g0.b0 * bs
        dq[:, :, r0:r0 + n] = _unarrange(torch.matmul(ds, kg).mul_(scale), g0, geo).to(q.dtype)
        # key gradients of the gathered blocks, added at their positions in the flattened
        # (heads x padded keys) axis; padding slots land in the padding block, cut off below
        pos = _key_positions(g0, bs)                                  # (Hl, g, K)
        if not per_head:
            pos = pos[:1].expand(heads, -1, -1)                       # one index set for all kv heads
        pos = (pos + torch.arange(heads).view(-1, 1, 1) * Lpad).flatten()
        dk.index_add_(1, pos, torch.matmul(ds.transpose(-1, -2), qg).mul_(scale).reshape(B, -1, dk.shape[-1]))
        dv.index_add_(1, pos, torch.matmul(p.transpose(-1, -2), dog).reshape(B, -1, dv.shape[-1]))
    dk = dk.view(B, heads, Lpad, -1)[:, :, :Lk]
    dv = dv.view(B, heads, Lpad, -1)[:, :, :Lk]
    if per_head and H != Hkv:                                         # sum the query heads of a group
        dk = dk.reshape(B, Hkv, H // Hkv, Lk, -1).sum(2)
        dv = dv.reshape(B, Hkv, H // Hkv, Lk, -1).sum(2)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def blocks_backward(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, key_padding_mask,
                    scale, window_left, window_right):
    """(dq, dk, dv) of `blocks_forward` given the saved out and lse; grad_lse may be None."""
    wl, wr = window_left, window_right
    bs, per_head, by_heads, slices, groups = _setup(q, k, v, layout_mask, layout_block, wl, wr)
    G = q.shape[1] // k.shape[1]

    def one(a, b):
        parts = _slice(by_heads, a, b, G, (grad_out, "q"), (grad_lse, "q"), (q, "q"), (k, "k"), (v, "k"),
                       (out, "q"), (lse, "q"), (key_padding_mask, "batch"))
        return _backward_slice(*parts, scale, wl, wr, _slice_groups(groups, per_head, by_heads, a, b, G), bs,
                               per_head)

    parts = threads.run_slices(one, slices)
    dim = 1 if by_heads else 0
    return tuple(torch.cat([p[i] for p in parts], dim).contiguous() for i in range(3))


# ---------------------------------------------------------------------------------- custom ops
# Opaque to torch.compile like the reference's ops (the plan reads layout data), with fake
# implementations for tracing.

def _fake_fwd(q, v):
    lse_dtype = compute_dtype(q.dtype)
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[-1]), q.new_empty(q.shape[:3], dtype=lse_dtype)


@torch.library.custom_op("effattn::cpu_blocks_fwd", mutates_args=())
def cpu_blocks_fwd(q: Tensor, k: Tensor, v: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                   key_padding_mask: Optional[Tensor], scale: float, window_left: int,
                   window_right: int) -> Tuple[Tensor, Tensor]:
    return blocks_forward(q, k, v, layout_mask, layout_block, key_padding_mask, scale, window_left, window_right)


@cpu_blocks_fwd.register_fake
def _(q, k, v, layout_mask, layout_block, key_padding_mask, scale, window_left, window_right):
    return _fake_fwd(q, v)


@torch.library.custom_op("effattn::cpu_blocks_bwd", mutates_args=())
def cpu_blocks_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                   lse: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                   key_padding_mask: Optional[Tensor], scale: float, window_left: int,
                   window_right: int) -> Tuple[Tensor, Tensor, Tensor]:
    return blocks_backward(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, key_padding_mask,
                           scale, window_left, window_right)


def masked_op_pair(fwd, bwd, fwd_fn, bwd_fn):
    """Registers the fake backward and the autograd formula of a CPU op pair taking this path's
    arguments (the layout, key padding, scale and window, no seed), whose bodies are ``fwd_fn`` and
    ``bwd_fn`` (eager calls run those directly: `eager_op_pair`), and returns the row's ``run``."""
    @bwd.register_fake
    def _(grad_out, grad_lse, q, k, v, *args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    call = eager_op_pair(fwd, bwd, fwd_fn, bwd_fn, prepare=lambda g: g.contiguous())

    def run(c):
        a = c.op_args()
        return call(a.q, a.k, a.v, a.layout_mask, a.layout_block, a.key_padding_mask, a.scale, a.window_left,
                    a.window_right)
    return run


PATH = register(Path(
    backend="torch", op="attention", name="torch/cpu-blocks", priority=95,
    caps=Capabilities(devices=frozenset({"cpu"}), dtypes=CPU_DTYPES,
                      features=FEATURES["attention"] - {"dropout"} - PACKED_FEATURES - SCORE_FEATURES),
    run=masked_op_pair(cpu_blocks_fwd, cpu_blocks_bwd, blocks_forward, blocks_backward), admits=cpu_reasons,
    describe=lambda call: "visible key blocks only, one batched matmul per group of query blocks"))
