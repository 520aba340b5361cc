"""Launchers: from a call's tensors to kernel launches.

`LaunchPlan` turns a call into the kernels' sizes, strides and flags (no device work); `fwd` and `bwd`
allocate the outputs, read the tile plan (`effattn.tiles`) for block layouts, pick a config
(`configs`, autotuned once per kind of call) and launch.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict

import torch
from triton.testing import do_bench

from ....numerics import LOG2E, drop_threshold, philox_key
from ....splits import sm_count  # 0 off the GPU: no split
from ....tiles import cdiv, layout_plan, layout_tile_lists
from ....visibility import clamp_window
from ..runtime import _I32_MAX, _INTERPRET, _log, _next_pow2
from .backward import bwd_kernel, delta_kernel, dq_reduce_kernel
from .configs import INTERPRET_CONFIGS, candidates, delta_block, five_fits, five_product, head_class
from .forward import fwd_kernel

_TUNED: Dict[tuple, tuple] = {}      # (kernel,) + LaunchPlan.tune_key -> config, for the process

try:  # the compiler's "does not fit" (shared memory, registers); anything else is unexpected
    from triton.runtime.errors import OutOfResources as _OutOfResources
except ImportError:  # pragma: no cover
    _OutOfResources = ()


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _launch_tuned(kind: str, p: "LaunchPlan", launch, device, usable=None, key_extra=()) -> None:
    """Launches `kind` with its config for this call's key, chosen once per process: the
    interpreter's; else the fastest candidate by ``do_bench``; with ``EFFATTN_TRITON_AUTOTUNE=0`` or
    while the stream is being captured into a CUDA graph, the first candidate that runs, untimed
    (not cached when capturing). Candidates the compiler or the GPU reject (e.g. out of shared
    memory for fp32 at head dim 256) are skipped and logged. ``usable``: a predicate on the
    candidates (those it refuses are not tried, e.g. the five-product backward's for packed
    calls); ``key_extra`` keys its choice apart."""
    key = (kind,) + p.tune_key + tuple(key_extra)
    cfg = _TUNED.get(key)
    if cfg is None and _INTERPRET:
        cfg = INTERPRET_CONFIGS[kind]
    if cfg is not None:
        launch(cfg)
        return
    capturing = _capturing(device)
    tune = not capturing and os.environ.get("EFFATTN_TRITON_AUTOTUNE", "1") != "0"
    timed, error = [], None
    for c in candidates(kind, head_class(max(p.block_d, p.block_dv)), p.element_size, gqa=p.G > 1):
        if usable is not None and not usable(c):
            continue
        try:
            if tune:
                timed.append((do_bench(lambda: launch(c), warmup=5, rep=20, return_mode="median"), c))
                continue
            launch(c)
        except Exception as e:  # noqa: BLE001 - a config that does not fit this GPU is skipped
            error = e
            (_log.info if isinstance(e, _OutOfResources) else _log.warning)(
                "effattn triton: %s config %s skipped for %s: %s: %s", kind, c, p.tune_key, type(e).__name__,
                str(e)[:300])
            continue
        if not capturing:
            _TUNED[key] = c
        return
    if not timed:
        raise RuntimeError(f"effattn triton backend: no {kind} config runs for {p.tune_key}") from error
    cfg = min(timed, key=lambda tc: tc[0])[1]
    _TUNED[key] = cfg
    launch(cfg)


# ---------------------------------------------------------------------------------------------
# Launch plans: everything a launch needs but the tensors' addresses, built once per kind of call

_PLANS: Dict[tuple, "LaunchPlan"] = {}   # calls without a layout; a layout's live in its LayoutPlan
_MAX_PLANS = 256                         # a process that sees more shapes rebuilds (cheap) instead
# L2 bytes the K and V of a group of concurrently scheduled (b, h) slices may take (H100/H200: 50 MB)
_L2_BUDGET = 32 << 20


def _span(shape, strides, dims) -> int:
    """Largest element offset within one (batch, head) slice along `dims`: the kernels' int32
    in-tile offsets (row x stride + column x stride) stay at or below it."""
    return sum((shape[d] - 1) * abs(strides[d]) for d in dims if shape[d] > 0)


def _wide(*tensors) -> bool:
    """Whether one of `tensors` (None: skipped) spans more than int32 offsets along its axes past
    (batch, head)."""
    return any(t is not None and _span(t.shape, t.stride(), range(2, t.dim())) > _I32_MAX for t in tensors)


def plan_for(q, k, v, layout_mask, layout_block, kpm, scale, dropout_p, left, right, tf32=False,
             q_offset=None) -> "LaunchPlan":
    """The cached `LaunchPlan` of a call: a repeated kind of call (same shapes, strides, dtype,
    layout, flags) reuses it, so its host work is a dictionary lookup."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, layout_block,
           None if kpm is None else (kpm.shape, kpm.stride()), scale, dropout_p, left, right, tf32, q_offset)
    cache = layout_plan(layout_mask).backend_cache if layout_mask is not None else _PLANS
    p = cache.get(key)
    if p is None:
        if len(cache) >= _MAX_PLANS:
            cache.clear()
        p = cache[key] = LaunchPlan(q, k, v, layout_mask, layout_block, kpm, scale, dropout_p, left, right, tf32,
                                    q_offset)
    return p


class LaunchPlan:
    """Sizes, flags and kernel arguments of a kind of call (no tensors of the call: those are
    passed at each launch). Cheap to build (no device work) and cached by `plan_for`."""

    def __init__(self, q, k, v, layout_mask, layout_block, kpm, scale, dropout_p, left, right, tf32=False,
                 q_offset=None):
        self.B, self.H, self.Lq, self.D = q.shape
        self.Hkv, self.Lk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
        self.G = self.H // self.Hkv
        # query i sits at key position i + off: bottom-right, or the call's positions (q_start - k_start)
        self.off = self.Lk - self.Lq if q_offset is None else q_offset
        # a window wider than the sequences is no window (the op may be called with any window):
        # -1 keeps the kernels' int32 bound arithmetic (pos + right + 1, ...) from overflowing
        self.left, self.right = clamp_window(left, right, self.Lq, self.Lk, q_offset)
        self.block_d = max(16, _next_pow2(self.D))
        self.block_dv = max(16, _next_pow2(self.Dv))
        self.scale = scale
        self.qk_scale = scale * LOG2E
        self.dropout_p = dropout_p
        self.drop_thresh = drop_threshold(dropout_p) if dropout_p > 0 else 0
        self.inv_keep = 1.0 / (1.0 - dropout_p) if dropout_p > 0 else 1.0
        self.layout_mask, self.layout_block = layout_mask, layout_block
        self.has_kpm = kpm is not None
        self.kpm_strides = (kpm.stride(0), kpm.stride(1)) if kpm is not None else (0, 0)
        self.dot_prec = "tf32" if (tf32 and q.dtype == torch.float32 and not _INTERPRET) else "ieee"
        self.interp_bf16 = _INTERPRET and q.dtype == torch.bfloat16
        self.element_size = q.element_size()
        lay_per_head = 0
        if layout_mask is not None:
            plan = layout_plan(layout_mask)
            self.lay = plan.mask_u8
            self.lay_h = plan.mask_u8.stride(0) if plan.mask_u8.shape[0] > 1 else 0
            self.lay_nkb = plan.mask_u8.shape[2]
            lay_per_head = plan.mask_u8.shape[1] * plan.mask_u8.shape[2]
        else:
            self.lay, self.lay_h, self.lay_nkb = None, 0, 1
        kpm_span = _span(kpm.shape, kpm.stride(), (1,)) if kpm is not None else 0
        self.idx64 = max(_span(q.shape, q.stride(), (2, 3)), _span(k.shape, k.stride(), (2, 3)),
                         _span(v.shape, v.stride(), (2, 3)), kpm_span, lay_per_head) > _I32_MAX
        # a layout's block size decides which tiles nest in its blocks (no per-element lookup)
        mode = f"layout{layout_block}" if layout_mask is not None else ("window" if left >= 0 else
                                                                        ("causal" if right == 0 else "dense"))
        # lengths bucketed separately: a decode call (Lq = 1) is not tuned like a prefill of its Lk
        # GQA apart from MHA: G = 1 is a constant in the compiled kernels, G > 1 a runtime value
        self.tune_key = (self.block_d, self.block_dv, q.dtype, self.dot_prec, mode, dropout_p > 0,
                         kpm is not None, min(_next_pow2(self.Lq), 8192), min(_next_pow2(self.Lk), 8192),
                         self.G > 1)
        self._args: Dict[tuple, tuple] = {}

    def lists(self, block_m, block_n, by_key):
        """The layout's packed tile lists (`effattn.tiles.TileLists`) for these tiles as kernel
        arguments: (tensor, stride per layout head, stride per row, full slots); without a layout
        (None, 0, 0, 0)."""
        if self.layout_mask is None:
            return None, 0, 0, 0
        packed, full_slots = layout_tile_lists(self.layout_mask, self.layout_block, self.Lq, self.Lk, block_m,
                                               block_n, self.left, self.right, by_key)
        return packed, (packed.stride(0) if packed.shape[0] > 1 else 0), packed.stride(1), full_slots

    def layout_mask_needed(self, block_m: int, block_n: int) -> bool:
        """Whether partial tiles must read the layout per element. Not when the kernel tiles nest in
        the layout's blocks (the block size a multiple of both): a listed tile then lies in one
        block that is on, and it is partial only through the window, causal or length bounds."""
        bs = self.layout_block
        return self.layout_mask is not None and (bs % block_m != 0 or bs % block_n != 0)

    def order(self, kind: str, n_split: int = 1):
        """(ORDER, heads per group) of `program_tile` for kernel `kind` ("fwd", or the backward's
        "dkdv" / "dq" programs; the dK/dV ones with the group's heads split `n_split` ways): heaviest
        programs first where the work per tile varies (causal / windowed), dense calls in plain order."""
        if kind == "dkdv":      # key tile t is seen by query tiles from about t on (causal): shrinking work
            order = -1 if self.right >= 0 else (1 if self.left >= 0 else 0)
            slices = self.B * self.Hkv * n_split                                              # Q, dO of the split
            per_slice = cdiv(self.G, n_split) * self.Lq * (self.D + self.Dv)
        else:                   # query tile t sees key tiles up to about t (causal): growing work
            order = 1 if self.right >= 0 else (-1 if self.left >= 0 else 0)
            slices, per_slice = self.B * self.H, self.Lk * (self.D + self.Dv) // self.G      # K, V (shared in GQA)
        group = max(1, min(slices, _L2_BUDGET // max(1, per_slice * self.element_size)))
        return order, group

    def flags(self, cfg, idx64=None):
        block_m, block_n, warps, stages = cfg[:4]
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=self.block_d, BLOCK_DV=self.block_dv,
                    HAS_LEFT=self.left >= 0, HAS_RIGHT=self.right >= 0,
                    HAS_LAYOUT=self.layout_mask is not None, LAYOUT_MASK=self.layout_mask_needed(block_m, block_n),
                    HAS_KPM=self.has_kpm,
                    DROPOUT=self.dropout_p > 0, PAD_D=self.block_d != self.D, PAD_DV=self.block_dv != self.Dv,
                    DOT_PREC=self.dot_prec, INTERP_BF16=self.interp_bf16,
                    IDX64=self.idx64 if idx64 is None else idx64, FOLD_SCALE=self.qk_scale > 0,
                    num_warps=warps, num_stages=stages, enable_fp_fusion=True)

    def fwd_args(self, cfg, q, k, v, counts):
        """(grid, the LISTS tensor or None, the forward kernel's scalar arguments by name (the C++
        `AttnParams` field names; the seed and the tensors are the launch's), the meta arguments)
        for config `cfg`, built once per plan and config."""
        key = ("fwd", cfg, counts)
        got = self._args.get(key)
        if got is None:
            lists, list_h, list_t, list_wf = self.lists(cfg[0], cfg[1], by_key=False)
            order, group = self.order("fwd")
            args = dict(q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride(),
                        kpm_strides=self.kpm_strides, H=self.H, G=self.G, Lq=self.Lq,
                        Lk=self.Lk, D=self.D, Dv=self.Dv, off=self.off, left=self.left, right=self.right,
                        lay_h=self.lay_h, lay_nkb=self.lay_nkb, lay_bs=max(self.layout_block, 1), list_h=list_h,
                        list_t=list_t, list_wf=list_wf, qk_scale=self.qk_scale, drop_thresh=self.drop_thresh,
                        inv_keep=self.inv_keep, heads_per_group=group, rows_out=self.Lq)
            grid = (cdiv(self.Lq, cfg[0]) * self.B * self.H,)
            trials = {}
            if len(cfg) > 4:        # switches of the forward (forward.py): "tma", "ws"; "r<N>": maxnreg N
                trials = dict(KV_TMA="tma" in cfg[4:], WARP_SPEC="ws" in cfg[4:])
                trials.update({"maxnreg": int(t[1:]) for t in cfg[4:] if t[:1] == "r" and t[1:].isdigit()})
            got = self._args[key] = (grid, lists, args, dict(self.flags(cfg), COUNT=counts, ORDER=order,
                                                             **trials))
        return got

    def bwd_args(self, cfg, q, k, v, dout, dq, dk, dv, dlse, counts, n_split):
        """As `fwd_args`, for the backward's `bwd_kernel` with config
        ``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, warps, stages)``: (grid, the number of dK/dV
        programs, the LISTS pair, the scalar arguments by name, the meta arguments). ``dk`` / ``dv``
        are the outputs, or with ``n_split > 1`` the fp32 partial buffers ``(n_split, B, Hkv, Lk, D)``.
        The LISTS are a pair: by key (dK/dV programs), by query (dQ programs). int64 offsets if one
        of the backward's own tensors needs them."""
        key = ("bwd", cfg, counts, n_split, dout.stride(), None if dlse is None else dlse.stride())
        got = self._args.get(key)
        if got is None:
            m1, n1, m2, n2, warps, stages = cfg[:6]
            five = five_product(cfg)
            if five:                           # no dQ programs: their tile numbers are unused
                m2, n2 = m1, n1
            idx64 = self.idx64 or _wide(dout, dq, dk, dv, dlse)
            lists1, listk_h, listk_t, listk_wf = self.lists(m1, n1, by_key=True)
            lists2, list_h, list_t, list_wf = (None, 0, 0, 0) if five else self.lists(m2, n2, by_key=False)
            order1, group1 = self.order("dkdv", n_split)
            order2, group2 = self.order("dq")
            split = n_split > 1                # the partial buffers' leading (split) stride, else none
            args = dict(q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride(), do_strides=dout.stride(),
                        dq_strides=dq.stride(), dk_strides=dk.stride() if split else (0, *dk.stride()),
                        dv_strides=dv.stride() if split else (0, *dv.stride()),
                        dqp_strides=self.dq_partial_strides(n1) if five else (0, 0, 0, 0),
                        kpm_strides=self.kpm_strides,
                        B=self.B, H=self.H, Hkv=self.Hkv, G=self.G, Lq=self.Lq, Lk=self.Lk, D=self.D, Dv=self.Dv,
                        off=self.off, left=self.left, right=self.right, lay_h=self.lay_h, lay_nkb=self.lay_nkb,
                        lay_bs=max(self.layout_block, 1), listk_h=listk_h, listk_t=listk_t, listk_wf=listk_wf,
                        list_h=list_h, list_t=list_t, list_wf=list_wf, scale=self.scale, qk_scale=self.qk_scale,
                        drop_thresh=self.drop_thresh, inv_keep=self.inv_keep, n_split=n_split, group1=group1,
                        group2=group2, rows_out=self.Lq)
            n_kv = cdiv(self.Lk, n1) * self.B * self.Hkv * n_split
            n = n_kv if five else n_kv + cdiv(self.Lq, m2) * self.B * self.H
            meta = self.flags((m1, n1, warps, stages), idx64)
            for name in ("BLOCK_M", "BLOCK_N", "LAYOUT_MASK"):
                del meta[name]
            meta.update(BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2,
                        LAYOUT_MASK1=self.layout_mask_needed(m1, n1), LAYOUT_MASK2=self.layout_mask_needed(m2, n2),
                        COUNT=counts, ORDER1=order1, ORDER2=order2, FIVE=five)
            got = self._args[key] = ((n,), n_kv, (lists1, lists2), args, meta)
        return got

    def dq_partial_shape(self, block_n: int) -> tuple:
        """The five-product backward's fp32 dQ partial buffer: one (B, H, Lq, D) slot per key tile."""
        return (cdiv(self.Lk, block_n), self.B, self.H, self.Lq, self.D)

    def dq_partial_strides(self, block_n: int) -> tuple:
        """(per key tile, batch, head, row) strides of the contiguous `dq_partial_shape` buffer."""
        _, B, H, Lq, D = self.dq_partial_shape(block_n)
        return (B * H * Lq * D, H * Lq * D, Lq * D, D)

    def dq_reduce_args(self, cfg, dq, counts):
        """(grid, LISTS, the scalar arguments by name, the meta arguments) of `dq_reduce_kernel` after a
        five-product backward with config ``cfg``: its query tiles are the dK/dV programs' (BLOCK_M1 x
        BLOCK_N1), whose key tiles it reads from the forward-ordered tile lists for those tiles."""
        m1, n1 = cfg[:2]
        lists, list_h, list_t, list_wf = self.lists(m1, n1, by_key=False)
        args = dict(dqp_strides=self.dq_partial_strides(n1), dq_strides=dq.stride(), H=self.H, Lq=self.Lq,
                    Lk=self.Lk, D=self.D, off=self.off, left=self.left, right=self.right, list_h=list_h,
                    list_t=list_t, list_wf=list_wf, scale=self.scale)
        meta = dict(BLOCK_M=m1, BLOCK_N=n1, BLOCK_D=self.block_d, HAS_LEFT=self.left >= 0,
                    HAS_RIGHT=self.right >= 0, HAS_LAYOUT=self.layout_mask is not None, COUNT=counts,
                    INTERP_BF16=self.interp_bf16)
        return (cdiv(self.Lq, m1) * self.B * self.H,), lists, args, meta

    def delta_args(self, dout, dlse, idx64=None):
        """(grid, the scalar arguments by name, the meta arguments) of `delta_kernel` for the
        gradient ``dout`` and the lse gradient ``dlse`` (None: none). ``idx64``: int64 offsets
        (default: the plan's, or wider if dout / dlse need them)."""
        block = delta_block(self.block_dv)
        args = dict(do_strides=dout.stride(), dl_strides=dlse.stride() if dlse is not None else (0, 0, 0), H=self.H,
                    Lq=self.Lq, Dv=self.Dv)
        meta = dict(BLOCK_M=block, BLOCK_DV=self.block_dv, HAS_DLSE=dlse is not None,
                    IDX64=(self.idx64 or _wide(dout, dlse)) if idx64 is None else idx64, enable_fp_fusion=True)
        return (cdiv(self.Lq, block) * self.B * self.H,), args, meta


def gqa_splits(n_kv_programs: int, G: int, n_sm: int) -> int:
    """Into how many runs the backward splits each key tile's G query heads (GQA): 1 when the
    ``n_kv_programs`` dK/dV programs (B * Hkv * key tiles) already fill ``n_sm`` SMs (0: unknown,
    e.g. the CPU), else the fewest runs of equal length (at most G) that make them fill the SMs.
    A dK/dV program loops over its heads, so too few of them leave SMs idle at the end of the
    launch; each split costs a fp32 partial dK, dV to write and add up."""
    if n_sm <= 0 or G <= 1 or n_kv_programs >= n_sm:
        return 1
    want = min(G, cdiv(n_sm, max(n_kv_programs, 1)))
    return cdiv(G, cdiv(G, want))


# ---------------------------------------------------------------------------------------------
# Launchers

def fwd(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, tf32=False,
        q_offset=None, out_fp32=False, drop_q0=0, drop_k0=0, drop_h0=0, drop_H=0, config=None, counts=False,
        q_pos=None, k_pos=None, pos_causal=False):
    """out (B, H, Lq, Dv) in q's dtype and lse (B, H, Lq) fp32. With ``counts``, also an int32
    (B*H, n_query_tiles) tensor of the key tiles each program visited. Nothing is launched when
    there is no query row (Lq = 0 or B*H = 0); Lk = 0 launches and writes out = 0, lse = -inf.
    ``q_offset``: query i at key position ``i + q_offset`` (``positions``); ``out_fp32``: out in float32;
    ``drop_q0`` / ``drop_k0``: dropout draws at rows ``drop_q0 + i`` and keys ``drop_k0 + j`` (the
    ``positions``), ``drop_h0`` / ``drop_H``: at head ``b * drop_H + drop_h0 + h`` (a head shard;
    ``drop_H = 0``: H). ``q_pos`` / ``k_pos``: the per-row positions rule (`positions_meta`)."""
    p = plan_for(q, k, v, layout_mask, layout_block, kpm, scale, dropout_p, left, right, tf32, q_offset)
    qpos, kpos, pos_meta = positions_meta(p, q_pos, k_pos, pos_causal)
    out = torch.empty((p.B, p.H, p.Lq, p.Dv), dtype=torch.float32 if out_fp32 else q.dtype, device=q.device)
    lse = torch.empty((p.B, p.H, p.Lq), dtype=torch.float32, device=q.device)
    seed_key = philox_key(seed) if dropout_p > 0 else 0
    kpm_u8 = kpm.view(torch.uint8) if kpm is not None else q
    visits = [None]
    tma = tma_default(q, k, v)

    def launch(cfg):
        if tma and "tma" not in cfg[4:]:
            cfg = tuple(cfg) + ("tma",)
        if "tma" in cfg[4:]:
            kv_tma_check(k, v)
        grid, lists, args, meta = p.fwd_args(cfg, q, k, v, counts)
        cnt = torch.zeros(p.B * p.H, grid[0] // (p.B * p.H), dtype=torch.int32, device=q.device) if counts else None
        fwd_kernel[grid](Q=q, K=k, V=v, O=out, LSE=lse, KPM=kpm_u8, LAY=_or_dummy(p.lay, q),
                         LISTS=_or_dummy(lists, q), COUNTS=_or_dummy(cnt, q), ITEMS=q, QPOS=qpos, KPOS=kpos,
                         seed=seed_key, drop_q0=drop_q0, drop_k0=drop_k0, drop_h0=drop_h0, drop_H=drop_H or p.H,
                         **args, **dict(meta, **pos_meta))
        visits[0] = cnt

    if p.Lq > 0 and p.B * p.H > 0:
        with _on_device(q.device):
            if config is not None:
                launch(config)
            else:                  # "tma" candidates only where TMA applies (`tma_default`)
                _launch_tuned("fwd", p, launch, q.device, usable=lambda c: tma or "tma" not in c[4:])
    return (out, lse, visits[0]) if counts else (out, lse)


def fwd_varlen(q, k, v, segments, seed, scale, dropout_p, left, right, tf32=False, out_fp32=False, config=None):
    """Packed sequences (`effattn.packed`), forward only: out (1, H, Tq, Dv) (float32 with ``out_fp32``)
    and lse (1, H, Tq) fp32 for the segment work list ``segments`` ((q0, q1, k0, k1, offset), longest
    first). One program per (segment, query tile) and head, the tiles of a segment heaviest first; rows
    outside every segment (none: the segments tile Tq) and segments without keys give out = 0, lse =
    -inf. Dropout draws at the packed rows (the segment's first query / key row plus the local ones),
    so a packed call drops the pairs the plain call over the packed tensors would (as the CUDA kernels)."""
    p = plan_for(q, k, v, None, 0, None, scale, dropout_p, left, right, tf32)
    out = torch.zeros((p.B, p.H, p.Lq, p.Dv), dtype=torch.float32 if out_fp32 else q.dtype, device=q.device)
    lse = torch.full((p.B, p.H, p.Lq), float("-inf"), dtype=torch.float32, device=q.device)
    seed_key = philox_key(seed) if dropout_p > 0 else 0

    def launch(cfg):
        grid, lists, args, meta = p.fwd_args(cfg, q, k, v, False)
        items = _work_items(segments, cfg[0], False, p.right >= 0)     # causal: the last tile is heaviest
        if not items:
            return
        table = torch.tensor(items, dtype=torch.int32).to(q.device)
        fwd_kernel[(len(items) * p.B * p.H,)](Q=q, K=k, V=v, O=out, LSE=lse, KPM=q, LAY=q, LISTS=q, COUNTS=q,
                                              ITEMS=table, QPOS=q, KPOS=q, seed=seed_key, drop_q0=0, drop_k0=0,
                                              drop_h0=0, drop_H=p.H,
                                              **dict(args, Lq=len(items) * cfg[0]),
                                              **dict(meta, ORDER=0, VARLEN=True))

    if p.Lq > 0 and p.B * p.H > 0 and segments:
        with _on_device(q.device):
            if config is not None:
                launch(config)
            else:                  # packed calls read K / V without TMA (its descriptors span one sequence)
                _launch_tuned("fwd", p, launch, q.device, usable=lambda c: "tma" not in c[4:],
                              key_extra=("packed",))
    return out, lse


def bwd(dout, dlse, q, k, v, out, lse, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right,
        tf32=False, q_offset=None, out_fp32=False, drop_q0=0, drop_k0=0, drop_h0=0, drop_H=0, config=None,
        counts=False, n_split=None, segments=None, q_pos=None, k_pos=None, pos_causal=False):
    """dq, dk, dv (same shapes and dtypes as q, k, v): the Delta pre-pass, then one launch of
    `bwd_kernel` (dK/dV and dQ programs), then, if the group's query heads were split (GQA with
    few key tiles per SM; ``n_split`` forces a split count, None: `gqa_splits`), the partial dK, dV
    added in a fixed order. With ``counts``, also the int32 (B*Hkv, n_key_tiles) numbers of query
    tiles each key tile visited (all G heads) and the (B*H, n_query_tiles) numbers of key tiles
    each query tile visited. `tf32` must be the forward's (the op's autograd passes it on).
    ``segments``: packed sequences (`fwd_varlen`'s work list): dK/dV programs per (segment, key tile)
    and dQ programs per (segment, query tile); rows of no segment get zero gradients. ``q_pos`` /
    ``k_pos`` / ``pos_causal``: the forward's (`positions_meta`)."""
    p = plan_for(q, k, v, layout_mask, layout_block, kpm, scale, dropout_p, left, right, tf32, q_offset)
    qpos, kpos, pos_meta = positions_meta(p, q_pos, k_pos, pos_causal)
    if q_pos is not None and segments is not None:
        raise ValueError("q_pos / k_pos: positions do not take packed sequences (segments)")
    alloc = torch.empty_like if segments is None else torch.zeros_like
    dq, dk, dv = alloc(q), alloc(k), alloc(v)
    if out_fp32:                                        # an fp32 output's gradient: the kernels' dtype
        dout = dout.to(q.dtype)
    visits = [None, None]
    if p.Lq == 0 or p.Lk == 0 or p.B * p.H == 0:       # no grid of size 0: nothing is launched
        for t in (dq, dk, dv):
            t.zero_()
        return (dq, dk, dv, *visits) if counts else (dq, dk, dv)
    out, lse = out.contiguous(), lse.contiguous()       # the kernels index them as the forward wrote them
    delta = torch.empty((p.B, p.H, p.Lq), dtype=torch.float32, device=q.device)
    seed_key = philox_key(seed) if dropout_p > 0 else 0
    kpm_u8 = kpm.view(torch.uint8) if kpm is not None else q
    lay = _or_dummy(p.lay, q)

    def launch(cfg):
        five = five_product(cfg)
        if five and segments is not None:
            raise ValueError(f"config {cfg}: the five-product backward does not take packed sequences")
        n_kv_tiles = cdiv(p.Lk, cfg[1]) * p.B * p.Hkv
        splits = n_split if n_split is not None else gqa_splits(n_kv_tiles, p.G, sm_count(q.device))
        if splits > 1:
            new = torch.empty if segments is None else torch.zeros
            dk_out = new((splits, *dk.shape), dtype=torch.float32, device=q.device)
            dv_out = new((splits, *dv.shape), dtype=torch.float32, device=q.device)
        else:
            dk_out, dv_out = dk, dv
        grid, n_kv, lists, args, meta = p.bwd_args(cfg, q, k, v, dout, dq, dk_out, dv_out, dlse, counts, splits)
        items = (q, q)
        if segments is not None:
            grid, n_kv, items, args, meta = _varlen_bwd_launch(p, cfg, segments, splits, args, meta, q.device)
        cnt = torch.zeros(grid[0], dtype=torch.int32, device=q.device) if counts else None
        dqp = dq_partials(p.dq_partial_shape(cfg[1]), q.device) if five else None
        if grid[0] > 0:
            bwd_kernel[grid](Q=q, K=k, V=v, DO=dout, LSE=lse, DELTA=delta, DQ=dq, DK=dk_out, DV=dv_out,
                             DQP=_or_dummy(dqp, delta), KPM=kpm_u8,
                             LAY=lay, LISTS1=_or_dummy(lists[0], q), LISTS2=_or_dummy(lists[1], q),
                             COUNTS=_or_dummy(cnt, q), ITEMS1=items[0], ITEMS2=items[1], QPOS=qpos, KPOS=kpos,
                             seed=seed_key, drop_q0=drop_q0, drop_k0=drop_k0, drop_h0=drop_h0, drop_H=drop_H or p.H,
                             **args, **dict(meta, **pos_meta))
        if five:                                       # dQ: each query tile's partials summed in a fixed order
            rgrid, rlists, rargs, rmeta = p.dq_reduce_args(cfg, dq, counts)
            rcnt = torch.zeros(rgrid[0], dtype=torch.int32, device=q.device) if counts else None
            dq_reduce_kernel[rgrid](DQP=dqp, DQ=dq, LISTS=_or_dummy(rlists, q), COUNTS=_or_dummy(rcnt, q), **rargs,
                                    **rmeta)
        if splits > 1:                                 # fixed order: bitwise the same every run
            for part, grad in ((dk_out, dk), (dv_out, dv)):
                acc = part[0]
                for i in range(1, splits):
                    acc = acc + part[i]
                grad.copy_(acc)
        if counts:
            visits[0] = cnt[:n_kv].view(p.B * p.Hkv, splits, -1).sum(1, dtype=torch.int32)
            visits[1] = (rcnt if five else cnt[n_kv:]).view(p.B * p.H, -1)

    with _on_device(q.device):
        grid, args, meta = p.delta_args(dout, dlse)
        delta_kernel[grid](O=out, DO=dout, DLSE=_or_dummy(dlse, lse), DELTA=delta, **args, **meta)
        if config is not None:
            launch(config)
        else:
            _launch_tuned("bwd", p, launch, q.device, usable=lambda c: not five_product(c) or (
                segments is None and five_fits(p.dq_partial_shape(c[1]))), key_extra=("packed",) if segments else ())
    return (dq, dk, dv, *visits) if counts else (dq, dk, dv)


def positions_meta(p: "LaunchPlan", q_pos, k_pos, pos_causal: bool):
    """(QPOS, KPOS, the meta arguments) of the positions rule (`fwd_kernel`'s ``POS``): ``q_pos``
    int32 ``(B*H, Lq)`` and ``k_pos`` int32 ``(B*H, Lk)`` (-1: a key never visible), both or neither;
    key j is hidden from query i where ``k_pos[j] < 0`` or (``pos_causal``) ``k_pos[j] > q_pos[i]``,
    and scores `effattn.lsh.SELF_SCORE` (not scaled, no gradient) where the positions are equal.
    Without positions the meta arguments are empty: the kernels compile as before (``POS`` off).
    With them the scale is not folded into the exponent (the self score is a constant in log2 units)."""
    if q_pos is None and k_pos is None:
        if pos_causal:
            raise ValueError("pos_causal=True needs q_pos and k_pos")
        return None, None, {}
    if q_pos is None or k_pos is None:
        raise ValueError("q_pos and k_pos go together (both int32 tensors, or neither)")
    for name, t, n in (("q_pos", q_pos, p.Lq), ("k_pos", k_pos, p.Lk)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor (B*H, {n}), got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tuple(t.shape) != (p.B * p.H, n):
            raise ValueError(f"{name} must have shape (B*H, {n}) = ({p.B * p.H}, {n}), got {tuple(t.shape)}")
    if p.B * p.H * max(p.Lq, p.Lk) > _I32_MAX:
        raise ValueError("q_pos / k_pos: (B*H) * L must stay below 2^31 elements")
    return q_pos.contiguous(), k_pos.contiguous(), dict(POS=True, POS_CAUSAL=bool(pos_causal), FOLD_SCALE=False)


def dq_partials(shape, device):
    """The five-product backward's fp32 dQ partial buffer (uninitialized: `dq_reduce_kernel` reads
    only the slots the dK/dV programs wrote)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _work_items(segments, block: int, by_key: bool, descending: bool):
    """The (q0, q1, k0, k1, tile) work list of packed `segments` (longest first) in tiles of `block`
    queries (or keys, ``by_key``), each segment's tiles heaviest first."""
    items = []
    for q0, q1, k0, k1, _ in segments:
        n = cdiv((k1 - k0) if by_key else (q1 - q0), block)
        items.extend((q0, q1, k0, k1, t) for t in (range(n - 1, -1, -1) if descending else range(n)))
    return items


def _varlen_bwd_launch(p, cfg, segments, splits, args, meta, device):
    """(grid, n_kv, (ITEMS1, ITEMS2), args, meta) of a packed backward: the key tiles' and the query
    tiles' work lists, the arguments ``Lq`` / ``Lk`` replaced by the lists' lengths in rows (see
    `bwd_kernel`)."""
    m1, n1, m2, n2 = cfg[:4]
    kv = _work_items(segments, n1, True, False)            # causal key tiles: work shrinks with the tile
    qi = _work_items(segments, m2, False, p.right >= 0)    # causal query tiles: work grows with the tile
    tables = tuple(torch.tensor(t or [(0, 0, 0, 0, 0)], dtype=torch.int32).to(device) for t in (kv, qi))
    n_kv = len(kv) * p.B * p.Hkv * splits
    return ((n_kv + len(qi) * p.B * p.H,), n_kv, tables, dict(args, Lq=len(qi) * m2, Lk=len(kv) * n1),
            dict(meta, ORDER1=0, ORDER2=0, VARLEN=True))


# The capability the launchers assume for meta tensors (the GPU suite's precompile planner runs them on
# meta tensors and sets its target here); None: no GPU, no TMA
META_CAPABILITY = None


def kv_tma_applies(k, v, capability) -> bool:
    """Whether the forward can read K and V through TMA: a GPU of compute capability 9.0 or later
    (``capability`` = (major, minor) or None), 16-bit K / V with unit stride along D, 16-byte
    aligned rows and base addresses (`kv_tma_check`'s conditions)."""
    if capability is None or capability[0] < 9 or k.element_size() != 2 or v.element_size() != 2:
        return False
    try:
        _tma_layout_check(k, v)
    except ValueError:
        return False
    return True


def tma_default(q, k, v) -> bool:
    """The forward's default for ``KV_TMA``: on where `kv_tma_applies` (the TMA loads cut the
    registers and instructions per tile on sm_90 with no spill: benchmarks/results/offline-sm90/
    tma_ws_trials.md), unless ``EFFATTN_TRITON_TMA=0``; never in the interpreter (its configs ask for
    it by their "tma" tag)."""
    if _INTERPRET or os.environ.get("EFFATTN_TRITON_TMA", "1") == "0":
        return False
    if q.device.type == "cuda":
        capability = torch.cuda.get_device_capability(q.device)
    else:
        capability = META_CAPABILITY if q.device.type == "meta" else None
    return kv_tma_applies(k, v, capability)


def _tma_layout_check(k, v) -> None:
    for name, t in (("k", k), ("v", v)):
        e = t.element_size()
        if t.stride(3) != 1 or (t.stride(2) * e) % 16 or t.data_ptr() % 16 or t.shape[3] * e < 16:
            raise ValueError(f"KV_TMA: {name} needs unit stride along D and 16-byte aligned rows")


def kv_tma_check(k, v) -> None:
    """Raises ValueError unless K and V can be read through tensor descriptors (the forward's
    ``KV_TMA`` trial): unit stride along D, rows and base addresses 16-byte aligned; and sets
    Triton's allocator for the in-kernel descriptors on a GPU."""
    _tma_layout_check(k, v)
    if not _INTERPRET and k.device.type == "cuda" and not getattr(kv_tma_check, "allocator_set", False):
        import triton
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        kv_tma_check.allocator_set = True


def _or_dummy(t, dummy):
    """A pointer argument the kernel does not read (its feature flag is off)."""
    return t if t is not None else dummy


def _on_device(device):
    """Launch on the tensors' GPU (Triton launches on the current device)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
