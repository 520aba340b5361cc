"""The torch reference backend for softmax attention: the readable definition of the math, the
test oracle's companion and the CPU fallback.

It is memory-bounded like a fused kernel, only slower: queries are processed in chunks, each chunk
only looks at the key range some query in it may see (causal / window / layout bounds), and the
backward pass recomputes the probabilities chunk by chunk from the saved log-sum-exp
(FlashAttention-2, Dao 2023, Alg. 2), so extra memory is O(chunk x Lk), never O(Lq x Lk).

Statistics and products accumulate in float32 (float64 for float64 inputs); outputs are cast back
to the input dtype. GQA is served by grouping the G = H / Hkv query heads of a key/value head into
one matmul against that head's keys: K and V are never expanded.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from ....numerics import compute_dtype as _compute_dtype
from ....numerics import tile_keep
from ....score import backward_setup
from ....visibility import Rule, seen_keys
from ...autograd import attention_autograd
from ...base import FEATURES, SCORE_FEATURES, Capabilities, Path, register

# Elements of one (B, H, chunk, keys) score tensor; a handful of those live at once in backward.
SCORE_BUDGET = 1 << 23




def _chunk_rows(B: int, H: int, Lq: int, Lk: int, layout_block: int, window_left: int, window_right: int) -> int:
    rows = max(16, SCORE_BUDGET // max(1, B * H * max(Lk, 1)))
    if window_left >= 0 and window_right >= 0:
        # a chunk of r rows computes r x (r + left + right) scores: keep r near the window's span
        rows = min(rows, max(64, window_left + window_right + 1))
    if layout_block > 0:  # whole layout blocks per chunk keep the key-range bounds tight
        rows = max(layout_block, rows // layout_block * layout_block)
    return min(rows, max(Lq, 1))


# layout mask -> (its (nqb, nkb) any-head visibility, {plan key: chunks}): built once per layout,
# not in every forward and backward (a layout's plan reads the mask with a sync per chunk)
_LAYOUT_CACHE = WeakTensorKeyDictionary()


def _layout_entry(layout_mask: Tensor):
    entry = _LAYOUT_CACHE.get(layout_mask)
    if entry is None:
        entry = _LAYOUT_CACHE[layout_mask] = (layout_mask.any(0), {})
    return entry


class _Chunk(NamedTuple):
    i0: int                      # query rows [i0, i1)
    i1: int
    keys: Union[slice, Tensor]   # the keys the chunk computes: a range, or the sorted positions of
                                 # the layout blocks some row of the chunk may see
    pos: Tensor                  # (n,) those keys' positions


def _plan(rule: Rule, rows: int, device) -> List[_Chunk]:
    """The query chunks of a call with the keys each must compute. Causal and window bounds give
    a key range per chunk; a layout then keeps only the key blocks some row of the chunk may see,
    so the work of a block-sparse call scales with its density."""
    Lq, Lk = rule.Lq, rule.Lk
    vis, plans = _layout_entry(rule.layout_mask) if rule.layout_mask is not None else (None, None)
    key = (Lq, Lk, rows, rule.left, rule.right, rule.layout_block)
    if plans is not None and key in plans:
        return plans[key]
    chunks = []
    for i0 in range(0, Lq, rows):
        i1 = min(i0 + rows, Lq)
        k0, k1 = rule.key_range(i0, i1)
        if k1 <= k0:
            continue                                               # no visible key: 0 and -inf
        if vis is None:
            chunks.append(_Chunk(i0, i1, slice(k0, k1), torch.arange(k0, k1, device=device)))
            continue
        bs = rule.layout_block
        kb0, kb1 = k0 // bs, (k1 - 1) // bs + 1
        blocks = vis[i0 // bs:(i1 - 1) // bs + 1, kb0:kb1].any(0).nonzero().flatten() + kb0
        if blocks.numel() == 0:
            continue
        first, last = int(blocks[0]), int(blocks[-1])
        if last - first + 1 == blocks.numel():                     # contiguous: a range, no gather
            a, b = max(k0, first * bs), min(k1, (last + 1) * bs)
            chunks.append(_Chunk(i0, i1, slice(a, b), torch.arange(a, b, device=device)))
        else:
            pos = (blocks[:, None] * bs + torch.arange(bs, device=device)).flatten()
            pos = pos[(pos >= k0) & (pos < k1)]
            chunks.append(_Chunk(i0, i1, pos, pos))
    if plans is not None:
        plans[key] = chunks
    return chunks


def _dropout_keep(seed: Tensor, p: float, c: _Chunk, B: int, H: int, at, device) -> Tensor:
    """Keep-mask (B, H, rows, keys) of one chunk (`effattn.numerics.tile_keep`), at the call's rows,
    keys and heads moved by ``at`` (`AttnCall.drop_at`: the ``positions`` and head shard of a
    context-parallel call; packed calls draw at the packed rows; None: the call's own), so the
    backward regenerates the forward's mask whatever the chunking, and a chunk of a longer sequence
    draws what the whole sequence's call would."""
    q0, k0, h0, hg = at if at is not None else (0, 0, 0, H)
    rows, heads = (c.i0 + q0, c.i1 + q0), (h0, hg)
    if isinstance(c.keys, slice):
        return tile_keep(seed, p, B, H, rows, (c.keys.start + k0, c.keys.stop + k0), heads=heads, device=device)
    first, last = int(c.pos[0]) + k0, int(c.pos[-1]) + k0       # gathered layout blocks
    return tile_keep(seed, p, B, H, rows, (first, last + 1), gather=c.pos + k0, heads=heads, device=device)


def _scores(q, k, c: _Chunk, scale, cdt, G):
    """Scaled scores of the chunk's query rows against its keys: (B, H, rows, keys)."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    qc = q[:, :, c.i0:c.i1].to(cdt).reshape(B, Hkv, G * (c.i1 - c.i0), D)
    kc = k[:, :, c.keys].to(cdt)
    s = torch.matmul(qc, kc.transpose(-1, -2)).mul_(scale)
    return s.view(B, H, c.i1 - c.i0, kc.shape[2]), qc, kc


def _work(q, k, layout_mask, layout_block, window_left, window_right, segments):
    """(rule, chunk in the rule's coordinates, chunk in the call's coordinates) of every chunk: the
    call's plan, or with ``segments`` ((q0, q1, k0, k1, q_offset) of packed sequences or a
    context-parallel chunk, effattn.packed) each segment's plan under its own rule, shifted."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    if segments is None:
        rule = Rule(Lq, Lk, window_left, window_right, layout_mask, layout_block)
        rows = _chunk_rows(B, H, Lq, Lk, layout_block if layout_mask is not None else 0, window_left, window_right)
        for c in _plan(rule, rows, q.device):
            yield rule, c, c
        return
    for q0, q1, k0, k1, off in segments:
        if layout_mask is not None:           # only an fp32 output's one segment, the whole call, has a layout
            if (q0, q1, k0, k1) != (0, Lq, 0, Lk):
                raise ValueError("attention: a layout indexes the whole call, not one of its segments")
            rule = Rule(Lq, Lk, window_left, window_right, layout_mask, layout_block, q_offset=off)
            for c in _plan(rule, _chunk_rows(B, H, Lq, Lk, layout_block, window_left, window_right), q.device):
                yield rule, c, c
            continue
        rule = Rule(q1 - q0, k1 - k0, window_left, window_right, q_offset=off)
        for c in _plan(rule, _chunk_rows(B, H, q1 - q0, k1 - k0, 0, window_left, window_right), q.device):
            keys = slice(c.keys.start + k0, c.keys.stop + k0)
            yield rule, c, _Chunk(c.i0 + q0, c.i1 + q0, keys, c.pos + k0)


def _masked_scores(q, k, layout_mask, layout_block, key_padding_mask, scale, window_left, window_right,
                   segments=None):
    """For each chunk of the call's plan: (chunk, scaled scores with invisible pairs at -inf
    (B, H, rows, keys), the chunk's grouped queries, its keys), in the compute dtype. Forward and
    backward both walk this, so they see the same chunks, keys and masks."""
    H, Hkv = q.shape[1], k.shape[1]
    for rule, local, c in _work(q, k, layout_mask, layout_block, window_left, window_right, segments):
        s, qc, kc = _scores(q, k, c, scale, _compute_dtype(q.dtype), H // Hkv)
        mask = rule.materialize((local.i0, local.i1), local.pos, key_padding_mask=key_padding_mask)
        seen = None
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf)
            seen = seen_keys(mask, Hkv)
            kc = torch.where(seen, kc, 0.0)
        yield c, s, qc, kc, seen


def _values(v: Tensor, c: _Chunk, seen: Optional[Tensor], cdt) -> Tensor:
    """The chunk's values in the compute dtype, zero where no row of the chunk sees the key."""
    vc = v[:, :, c.keys].to(cdt)
    return vc if seen is None else torch.where(seen, vc, 0.0)


def _grouped(x: Tensor, Hkv: int) -> Tensor:
    """(B, H, rows, n) -> (B, Hkv, G*rows, n): the query heads of a kv head side by side."""
    B, H, r, n = x.shape
    return x.reshape(B, Hkv, (H // Hkv) * r, n)


def attention_forward(q, k, v, layout_mask, layout_block, key_padding_mask, seed, scale, dropout_p,
                      window_left, window_right, segments=None, out_dtype=None,
                      drop_at=None) -> Tuple[Tensor, Tensor]:
    B, H, Lq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    cdt = _compute_dtype(q.dtype)
    out = torch.zeros(B, H, Lq, Dv, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.full((B, H, Lq), -math.inf, dtype=cdt, device=q.device)
    for c, s, _, _, seen in _masked_scores(q, k, layout_mask, layout_block, key_padding_mask, scale, window_left,
                                           window_right, segments):
        i0, i1 = c.i0, c.i1
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # empty rows: exp(-inf - 0) = 0
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        lse[:, :, i0:i1] = (m + torch.log(l)).squeeze(-1)        # log(0) = -inf for empty rows
        p = p / torch.where(l > 0, l, torch.ones_like(l))
        if dropout_p > 0:
            p = p * _dropout_keep(seed, dropout_p, c, B, H, drop_at, q.device) / (1.0 - dropout_p)
        o = torch.matmul(_grouped(p, Hkv), _values(v, c, seen, cdt))
        out[:, :, i0:i1] = o.view(B, H, i1 - i0, Dv).to(out.dtype)
    return out, lse.to(torch.float32) if cdt == torch.float32 else lse


def _accumulate(acc: Tensor, keys, x: Tensor) -> None:
    """acc[:, :, keys] += x. Gathered key positions are distinct, so each element receives exactly
    one addition per chunk: deterministic on every device."""
    if isinstance(keys, slice):
        acc[:, :, keys] += x
    else:
        acc.index_add_(2, keys, x)


def attention_backward(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, key_padding_mask,
                       seed, scale, dropout_p, window_left, window_right, segments=None,
                       keep_fp32=False, drop_at=None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of one call; with ``keep_fp32`` dk, dv stay in the compute dtype (context-parallel
    partial gradients, summed over ring steps before the cast); ``drop_at``: the forward's."""
    B, H, Lq, D = q.shape
    Hkv = k.shape[1]
    # Delta_i = sum_j P_ij dP_ij = rowsum(dO * O); a gradient into lse enters as dS += dlse * P.
    cdt, dq, dk, dv, delta, lse, lse_safe = backward_setup(grad_out, grad_lse, q, k, v, out, lse)
    if keep_fp32:
        dq = dq.to(cdt)
    for c, s, qc, kc, seen in _masked_scores(q, k, layout_mask, layout_block, key_padding_mask, scale, window_left,
                                             window_right, segments):
        i0, i1 = c.i0, c.i1
        p = torch.exp(s - lse_safe[:, :, i0:i1, None])           # masked and empty rows give 0
        vc = _values(v, c, seen, cdt)
        do = grad_out[:, :, i0:i1].to(cdt)
        dp = torch.matmul(_grouped(do, Hkv), vc.transpose(-1, -2)).view_as(p)
        if dropout_p > 0:
            keep = _dropout_keep(seed, dropout_p, c, B, H, drop_at, q.device).to(cdt) / (1.0 - dropout_p)
            pd, dp = p * keep, dp * keep
        else:
            pd = p
        _accumulate(dv, c.keys, torch.matmul(_grouped(pd, Hkv).transpose(-1, -2), _grouped(do, Hkv)))
        ds = p * (dp - delta[:, :, i0:i1, None])
        dsg = _grouped(ds, Hkv)
        dq[:, :, i0:i1] = (torch.matmul(dsg, kc) * scale).view(B, H, i1 - i0, D).to(dq.dtype)
        _accumulate(dk, c.keys, torch.matmul(dsg.transpose(-1, -2), qc) * scale)
    return (dq, dk, dv) if keep_fp32 else (dq, dk.to(k.dtype), dv.to(v.dtype))


# ---------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile (the chunk plan reads layout data), with fake
# (meta) implementations for tracing and an autograd formula that calls the backward op.

@torch.library.custom_op("effattn::ref_attention_fwd", mutates_args=())
def ref_attention_fwd(q: Tensor, k: Tensor, v: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                      key_padding_mask: Optional[Tensor], seed: Optional[Tensor], scale: float,
                      dropout_p: float, window_left: int, window_right: int) -> Tuple[Tensor, Tensor]:
    return attention_forward(q, k, v, layout_mask, layout_block, key_padding_mask, seed, scale, dropout_p,
                             window_left, window_right)


@ref_attention_fwd.register_fake
def _(q, k, v, layout_mask, layout_block, key_padding_mask, seed, scale, dropout_p, window_left, window_right):
    B, H, Lq, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(B, H, Lq, v.shape[-1]), q.new_empty(B, H, Lq, dtype=lse_dtype)


@torch.library.custom_op("effattn::ref_attention_bwd", mutates_args=())
def ref_attention_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                      out: Tensor, lse: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                      key_padding_mask: Optional[Tensor], seed: Optional[Tensor], scale: float,
                      dropout_p: float, window_left: int, window_right: int) -> Tuple[Tensor, Tensor, Tensor]:
    return attention_backward(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block,
                              key_padding_mask, seed, scale, dropout_p, window_left, window_right)


@ref_attention_bwd.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, *args):
    # contiguous like the real op's gradients, whatever the inputs' strides
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_setup_context, _backward = attention_autograd(ref_attention_fwd, ref_attention_bwd, prepare=lambda g: g.contiguous())
ref_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _SegmentAttention(torch.autograd.Function):
    """The chunked reference over a segment work list (``call.segments``: packed sequences, positions,
    an fp32 output), forward and backward. A key padding mask comes only with positions or an fp32
    output (one segment starting at key 0), never with cu_seqlens; a layout only with an fp32 output
    (the whole call as its one segment)."""

    @staticmethod
    def forward(ctx, q, k, v, layout_mask, layout_block, kpm, seed, segments, scale, dropout_p, left, right,
                out_dtype, drop_at):
        out, lse = attention_forward(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right,
                                     segments=segments, out_dtype=out_dtype, drop_at=drop_at)
        ctx.save_for_backward(q, k, v, out, lse, layout_mask, kpm, seed)
        ctx.static = (layout_block, segments, scale, dropout_p, left, right, drop_at)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, layout_mask, kpm, seed = ctx.saved_tensors
        layout_block, segments, scale, dropout_p, left, right, drop_at = ctx.static
        dq, dk, dv = attention_backward(grad_out.contiguous(), grad_lse, q, k, v, out, lse, layout_mask,
                                        layout_block, kpm, seed, scale, dropout_p, left, right, segments=segments,
                                        drop_at=drop_at)
        return (dq, dk, dv) + (None,) * 11


def _on_work_list(call) -> bool:
    """Packed sequences / positions / an fp32 output / a head shard's dropout: the segment work list."""
    return call.segments is not None or (call.heads is not None and call.dropout_p > 0)


def _run(call):
    if _on_work_list(call):
        a = call.op_args()
        segments = call.segments or ((0, call.Lq, 0, call.Lk, call.Lk - call.Lq),)
        return _SegmentAttention.apply(a.q, a.k, a.v, a.layout_mask, a.layout_block, a.key_padding_mask, a.seed,
                                       segments, a.scale, a.dropout_p, a.window_left, a.window_right,
                                       call.out_dtype, call.drop_at())
    return ref_attention_fwd(**call.op_args()._asdict())


def _describe(call):
    if _on_work_list(call):
        return ("segment work list of the chunked reference (packed sequences / positions / an fp32 output / "
                "a head shard's dropout)")
    return None


PATH = register(Path(
    backend="torch", op="attention", name="torch/reference", priority=100,
    caps=Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        max_head_dim=256,
        features=FEATURES["attention"] - SCORE_FEATURES),
    run=_run, describe=_describe))
