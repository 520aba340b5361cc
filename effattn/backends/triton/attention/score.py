"""The Triton backend's path for calls with score terms (`score_kernels`): launchers, the reasons a
call's terms are not served, and the implementation `effattn.score.ScoreAttention` runs.

Served: softcap, sinks and at most one term of each kind (ALiBi, Relative, Span, a dense tensor),
with causal / window / layout / key padding / GQA / dropout, positions (the terms' distances and the
dropout draws absolute; dropout at a head shard's global heads), fp32 outputs and packed sequences
(cu_seqlens: the plain packed kernels' (segment, tile) work lists, `launch._work_items`; the terms
read segment-local distances, dropout draws at the packed rows, and the parameters' partial sums
take one slot per (head, query work item), summed in a fixed order). Tile sizes are fixed (no autotuning):
the result is bitwise the same on every run. The dense bias's gradient goes through a fp32
(B, H, Lq, Lk) buffer (the bias itself is that large before broadcasting)."""
from __future__ import annotations

from typing import List

import torch

from .... import bias as _bias
from ....score import several_of_a_kind, span_left
from ....tiles import cdiv
from ..runtime import _INTERPRET, _next_pow2
from .backward import delta_kernel
from .launch import _on_device, _or_dummy, _work_items, philox_key, plan_for
from .score_kernels import score_bwd_kernel, score_fwd_kernel

_KINDS = (_bias.ALiBi, _bias.Relative, _bias.Span, _bias.Dense)


class TileProbe:
    """A test hook on the constant-tile path (`score_kernels._const_tile`): ``fast = False`` makes
    every tile take the elementwise path; ``count = True`` makes each launch record, per program, how
    many tiles took the constant path, in ``counts`` (kernel name -> int32 tensor). Off by default
    (then the kernels are compiled without the counter)."""
    fast = True
    count = False
    counts: dict = {}


def reasons(call) -> List[str]:
    """Why the score-terms kernels cannot serve `call` (beyond the declared features)."""
    if call.score is None:
        return []
    return several_of_a_kind(call.score, _KINDS, "the kernels")


def describe(call) -> str:
    score = call.score
    if _fast_tiles(score, call.layout is not None, call.key_padding_mask is not None):
        tiles = ("tiles that the window shows whole and on which every term is constant (beyond a table's clip, "
                 "inside a span's flat part) unmasked with one scalar added, the others masked elementwise")
    else:
        why = [n for n, x in (("ALiBi", any(isinstance(t, _bias.ALiBi) for t in score.terms)),
                              ("a dense bias", any(isinstance(t, _bias.Dense) for t in score.terms)),
                              ("a layout", call.layout is not None),
                              ("key padding", call.key_padding_mask is not None)) if x] or ["TileProbe.fast off"]
        tiles = "every visited tile masked elementwise (" + ", ".join(why) + ")"
    packed = "; packed sequences on (segment, tile) work lists" if call.cu_seqlens is not None else ""
    return ("score terms (" + ", ".join(sorted(score.features())) + "): the score-terms kernels, " + tiles
            + ", fixed tiles (no autotuning)" + packed)


def _fast_tiles(score, layout: bool, kpm: bool) -> bool:
    """Whether the kernels' constant-tile path can apply (`score_kernels._const_tile`): no term that
    varies on every tile (ALiBi, a dense bias) and no per-element visibility (layout, padding)."""
    varies = any(isinstance(t, (_bias.ALiBi, _bias.Dense)) for t in score.terms)
    return TileProbe.fast and not (varies or layout or kpm)


def _blocks(D, Dv, backward, score):
    """(BLOCK_M, BLOCK_N, warps) of the score kernels, chosen from offline sm_90 compiles
    (`tools.triton.score_kernel_resources`; not timed on a GPU yet): the forward's 64 x 64 tiles with 4
    warps spill nothing with any one term; the backward's need 8 warps for that, and with several
    terms only 32 x 32 tiles keep spills out of the tile loops."""
    if _INTERPRET:
        return 16, 16, 4
    if max(D, Dv) > 128:
        return 32, 32, 4
    if not backward:
        return 64, 64, 4
    heavy = len(score.terms) + (score.softcap is not None)
    return (64, 64, 8) if heavy <= 1 else (32, 32, 4)


def _term_args(score, q, B, H, Lq, Lk):
    """(the terms' tensor arguments SL, TAB, Z, BIAS by name; their scalar arguments by name; flags;
    the relative table term or None)."""
    dummy = q
    sl = tab = z = dense = None
    for t in score.terms:
        if isinstance(t, _bias.ALiBi):
            sl = t.slopes
        elif isinstance(t, _bias.Relative):
            tab = t
        elif isinstance(t, _bias.Span):
            z = t
        else:
            dense = t._full().expand(B, H, Lq, Lk)
    alibi_b, alibi_h = (0, 0) if sl is None else ((0, sl.stride(0)) if sl.dim() == 1 else tuple(sl.stride()))
    table = tab.table.contiguous() if tab is not None else None
    ptrs = dict(SL=_or_dummy(sl, dummy), TAB=_or_dummy(table, dummy),
                Z=_or_dummy(z.z.contiguous() if z else None, dummy), BIAS=_or_dummy(dense, dummy))
    args = dict(alibi_b=alibi_b, alibi_h=alibi_h, tab_h=table.stride(0) if table is not None else 0,
                bias_strides=dense.stride() if dense is not None else (0, 0, 0, 0), softcap=score.softcap or 1.0,
                max_dist=tab.max_distance if tab else 0, ramp=float(z.ramp) if z else 1.0)
    flags = dict(SOFTCAP=score.softcap is not None, ALIBI=sl is not None, REL=tab is not None,
                 REL_BIDIR=bool(tab.bidirectional) if tab else True, SPAN=z is not None,
                 SPAN_BIDIR=bool(z.bidirectional) if z else False, DENSE=dense is not None)
    return ptrs, args, flags, tab


def _packed(segments, Lq: int, Lk: int):
    """(the kernels' offset, whether the call is packed) of a call's work list: a single segment over
    the whole call (positions, an fp32 output: `effattn.packed`) is a plain call at its offset; any
    other list (cu_seqlens: bottom-right segments) runs on the (segment, tile) work lists."""
    if segments is None:
        return None, False
    if len(segments) == 1 and tuple(segments[0][:4]) == (0, Lq, 0, Lk):
        return segments[0][4], False
    return None, True


def _common(q, k, v, layout_mask, layout_block, kpm, scale, dropout_p, left, right, score, backward=False,
            tf32=False, segments=None, drop_at=None):
    """(the `LaunchPlan`, the meta arguments, the scalar arguments by name) shared by both score
    kernels (`score_kernels`; the C++ `AttnParams` names where it has the field). A packed call's
    ``VARLEN`` launches replace ``Lq`` / ``Lk`` by their work lists' lengths (`_items`)."""
    q_offset, varlen = _packed(segments, q.shape[2], k.shape[2])
    p = plan_for(q, k, v, layout_mask, layout_block, kpm, scale, dropout_p, span_left(left, score),
                 span_left(right, score, future=True), tf32, q_offset=q_offset)
    bm, bn, warps = _blocks(p.D, p.Dv, backward, score)
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=p.block_d, BLOCK_DV=p.block_dv, HAS_LEFT=p.left >= 0,
                HAS_RIGHT=p.right >= 0, HAS_LAYOUT=layout_mask is not None, HAS_KPM=kpm is not None,
                DROPOUT=dropout_p > 0, DOT_PREC=p.dot_prec, INTERP_BF16=p.interp_bf16, IDX64=p.idx64,
                FAST=_fast_tiles(score, layout_mask is not None, kpm is not None), COUNT=TileProbe.count,
                VARLEN=varlen, num_warps=warps, enable_fp_fusion=True)
    args = dict(q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride(), kpm_strides=p.kpm_strides, H=p.H,
                G=p.G, Lq=p.Lq, Lk=p.Lk, D=p.D, Dv=p.Dv, off=p.off, left=p.left, right=p.right, lay_h=p.lay_h,
                lay_nkb=p.lay_nkb, lay_bs=max(layout_block, 1), scale=scale, drop_thresh=p.drop_thresh,
                inv_keep=p.inv_keep, rows_q=p.Lq)
    args.update(zip(("drop_q0", "drop_k0", "drop_h0", "drop_H"), drop_at or (0, 0, 0, p.H)))
    return p, meta, args


def _items(segments, block: int, by_key: bool, causal: bool, device):
    """(number of items, the int32 (segment, tile) work list of a packed call on `device`): the plain
    packed kernels' (`launch._work_items`), causal query tiles heaviest first."""
    items = _work_items(segments, block, by_key, causal and not by_key)
    return len(items), torch.tensor(items or [(0, 0, 0, 0, 0)], dtype=torch.int32).to(device)


def forward(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, score, tf32=False,
            segments=None, out_dtype=None, drop_at=None):
    p, meta, args = _common(q, k, v, layout_mask, layout_block, kpm, scale, dropout_p, left, right, score,
                            tf32=tf32, segments=segments, drop_at=drop_at)
    out = torch.empty((p.B, p.H, p.Lq, p.Dv), dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty((p.B, p.H, p.Lq), dtype=torch.float32, device=q.device)
    if p.Lq == 0 or p.B * p.H == 0:
        return out, lse
    ptrs, term_args, flags, _ = _term_args(score, q, p.B, p.H, p.Lq, p.Lk)
    sinks = score.sinks.contiguous() if score.sinks is not None else None        # the kernel reads SINKS + h
    kpm_u8 = kpm.view(torch.uint8) if kpm is not None else q
    items = q
    if meta["VARLEN"]:
        n, items = _items(segments, meta["BLOCK_M"], False, p.right >= 0, q.device)
        args["Lq"] = n * meta["BLOCK_M"]
    grid = (cdiv(args["Lq"], meta["BLOCK_M"]) * p.B * p.H,)
    cnt = _counter(grid[0], q.device, "fwd")
    with _on_device(q.device):
        score_fwd_kernel[grid](Q=q, K=k, V=v, O=out, LSE=lse, KPM=kpm_u8, LAY=_or_dummy(p.lay, q),
                               SINKS=_or_dummy(sinks, q), **ptrs, CNT=_or_dummy(cnt, lse), ITEMS=items,
                               seed=philox_key(seed) if dropout_p > 0 else 0, **args, **term_args,
                               SINKS_ON=sinks is not None, **flags, **meta)
    return out, lse


def _counter(n: int, device, kernel: str):
    """The constant-tile counter of a launch of `n` programs (`TileProbe.count`), or None."""
    if not TileProbe.count:
        return None
    TileProbe.counts[kernel] = torch.zeros(n, dtype=torch.int32, device=device)
    return TileProbe.counts[kernel]


def backward(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, kpm, seed, scale, dropout_p,
             left, right, score, tf32=False, segments=None, out_dtype=None, drop_at=None):
    """(dq, dk, dv, *gradients of score.tensors()); the terms' gradients are fp32 sums of per-program
    partials taken in a fixed order, cast to each tensor's dtype."""
    p, meta, args = _common(q, k, v, layout_mask, layout_block, kpm, scale, dropout_p, left, right, score, True,
                            tf32, segments, drop_at)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros((p.B, p.Hkv, p.Lk, p.D), dtype=torch.float32, device=q.device)
    dv = torch.zeros((p.B, p.Hkv, p.Lk, p.Dv), dtype=torch.float32, device=q.device)
    ptrs, term_args, flags, tab = _term_args(score, q, p.B, p.H, p.Lq, p.Lk)
    items = (q, q)
    if meta["VARLEN"]:                  # one partial slot per (head, query work item)
        (n_k, items_k), (n_q, items_q) = (_items(segments, meta[b], by_key, p.right >= 0, q.device)
                                          for b, by_key in (("BLOCK_N", True), ("BLOCK_M", False)))
        items = (items_k, items_q)
        args.update(Lq=n_q * meta["BLOCK_M"], Lk=n_k * meta["BLOCK_N"])
    n_mt = cdiv(args["Lq"], meta["BLOCK_M"]) if p.Lq else 0
    n_part = 2 + (tab.width if tab is not None else 0)
    part = torch.zeros((p.B * p.H, n_mt, n_part), dtype=torch.float32, device=q.device)
    dbias = (torch.zeros((p.B, p.H, p.Lq, p.Lk), dtype=torch.float32, device=q.device) if flags["DENSE"]
             else None)
    out, lse = out.contiguous(), lse.contiguous()
    delta = torch.zeros((p.B, p.H, p.Lq), dtype=torch.float32, device=q.device)
    if p.Lq > 0 and p.B * p.H > 0:
        kpm_u8 = kpm.view(torch.uint8) if kpm is not None else q
        with _on_device(q.device):
            grid, delta_args, delta_meta = p.delta_args(grad_out, grad_lse, idx64=p.idx64)
            delta_kernel[grid](O=out, DO=grad_out, DLSE=_or_dummy(grad_lse, lse), DELTA=delta, **delta_args,
                               **delta_meta)
            n_kv = cdiv(args["Lk"], meta["BLOCK_N"]) * p.B * p.Hkv
            grid = (n_kv + n_mt * p.B * p.H,)
            cnt = _counter(grid[0], q.device, "bwd")
            score_bwd_kernel[grid](Q=q, K=k, V=v, DO=grad_out, LSE=lse, DELTA=delta, DQ=dq, DK=dk, DV=dv, KPM=kpm_u8,
                                   LAY=_or_dummy(p.lay, q), **ptrs, PART=part, DBIAS=_or_dummy(dbias, q),
                                   CNT=_or_dummy(cnt, lse), ITEMS1=items[0], ITEMS2=items[1], rows_k=p.Lk,
                                   do_strides=grad_out.stride(), B=p.B, Hkv=p.Hkv,
                                   seed=philox_key(seed) if dropout_p > 0 else 0, n_part=n_part, **args, **term_args,
                                   BLOCK_P=max(16, _next_pow2(n_part)), **flags, **meta)
    else:
        dq.zero_()
    grads = []
    if score.sinks is not None:
        psink = torch.exp(score.sinks.detach().float()[None, :, None] - lse)
        grads.append(-(psink * delta).sum((0, 2)))
    sums = part.view(p.B, p.H, n_mt, n_part).sum(2)              # (B, H, n_part): a fixed-order reduction
    for t in score.terms:
        if isinstance(t, _bias.ALiBi):
            g = sums[..., 0]
            grads.append(g.sum(0) if t.slopes.dim() == 1 else g)
        elif isinstance(t, _bias.Span):
            grads.append(sums[..., 1].sum(0))
        elif isinstance(t, _bias.Relative):
            g = sums[..., 2:].sum(0)
            if t.table.shape[1] > t.width:
                g = torch.nn.functional.pad(g, (0, t.table.shape[1] - t.width))
            grads.append(g)
        else:
            full = t._full()
            dims = tuple(a for a in range(4) if full.shape[a] == 1 and dbias.shape[a] != 1)
            g = dbias.sum(dims, keepdim=True) if dims else dbias
            grads.append(g.reshape(t.tensor.shape))
    params = score.tensors()
    return (dq, dk.to(k.dtype), dv.to(v.dtype), *[g.to(x.dtype) for g, x in zip(grads, params)])


class Kernels:
    """These launchers as an implementation of `effattn.score.ScoreAttention`, with the call's TF32
    setting (read once, at the forward, as the main kernels do) bound for its backward."""

    def __init__(self, tf32: bool):
        self.tf32 = tf32

    def forward(self, *args, **kwargs):
        return forward(*args, **kwargs, tf32=self.tf32)

    def backward(self, *args, **kwargs):
        return backward(*args, **kwargs, tf32=self.tf32)
