"""Launchers of the linear-attention kernels: operand descriptions, tile configs, allocation.

Numerics: dots run in bf16 on tensor cores for bf16 calls; fp16 and fp32 calls run them on fp32
operands (TF32 on the GPU for fp16, whose 10-bit mantissa TF32 keeps, and for fp32 when torch allows
TF32; IEEE fp32 otherwise), because a state summed over many keys can exceed fp16's range. States
are accumulated in fp32; the per-chunk states the output pass reads are stored in bf16 for bf16
calls (the dot rounds them to bf16 anyway) and fp32 otherwise. Final states are fp32. The normalizer
``z`` is fp32 throughout and takes no product: per-chunk row sums of the fp32 (mapped) key tiles
(``chunk_sum_kernel``), added up in the state pass, and fp32 row dots ``a . z`` for the denominators.

Configs: a chunk of ``CHUNK`` timeline positions, feature tiles ``BK`` (the contracted features)
and ``BV`` (the output features). On the GPU the first candidate is the default
(``EFFATTN_TRITON_AUTOTUNE=0``, CUDA-graph capture); otherwise the candidates are timed once per
role (forward state / output pass, dq, dk, ...), feature-dim class and dtype, and kept for the
process. The interpreter uses 32-position chunks and 32-wide tiles, so that small test shapes cross
chunk and tile edges.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ....feature_maps import FMAP_IDENTITY
from ....splits import sm_count
from ..runtime import _INTERPRET, _log, _next_pow2, triton

if triton is not None:
    import triton.language as tl
    from triton.testing import do_bench

    from .kernels import chunk_out_kernel, chunk_state_kernel, chunk_sum_kernel, map_kernel, step_kernel

CHUNK = 32 if _INTERPRET else 64
# (BK, BV, num_warps, num_stages); the first is the untimed default. Checked offline for sm_90 by
# tools/triton/linear_kernel_resources.py (wgmma, no spills in the chunk loop).
# fp32 inputs (4-byte tiles) get a 64-wide output tile: at 128 the output pass spills inside its loop.
# fp16 calls too (their dots take fp32 operands at TF32): at 128 the output pass spilled 9 registers in its
# loop at F = Dv = 128 (offline sm_90, triton 3.9; 0 at 64).
# 3 stages: with 2 the chunk loops waited for all their copies at every chunk (no prefetch; offline
# sm_90, triton 3.9: the state pass 690 instructions and 10 barriers per chunk, waiting; 3 stages 717
# and 10, one chunk's copies in flight)
_STATE16 = [(64, 64, 4, 3), (64, 64, 4, 4), (32, 64, 4, 3), (32, 32, 4, 2), (64, 128, 8, 3)]
CONFIGS = {"state": {torch.bfloat16: _STATE16, torch.float16: _STATE16,
                     torch.float32: [(64, 64, 4, 3), (32, 64, 4, 3), (32, 32, 4, 2)]},
           "out": {torch.bfloat16: [(64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (32, 128, 4, 3)],
                   torch.float16: [(64, 64, 4, 3), (64, 128, 4, 3), (32, 64, 4, 2), (64, 32, 4, 2)],
                   torch.float32: [(64, 64, 4, 3), (32, 64, 4, 2), (64, 32, 4, 2)]}}
INTERPRET_CONFIG = (32, 32, 4, 1)
_TUNED: Dict[tuple, tuple] = {}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Rows:
    """A row operand: ``x (B, H, L, F)`` read at row ``t + shift`` of the timeline, through the
    feature map ``fmap`` (MAPS code; 0: as is), which the passes apply to each tile they load unless
    `mapped` applied it first (`MAP_ONCE`); an output pass's ``grad_x`` takes the map's derivative."""
    x: Tensor
    shift: int = 0
    fmap: int = FMAP_IDENTITY

    @property
    def strides(self):
        return tuple(self.x.stride())

    @property
    def L(self):
        return self.x.shape[2]

    @property
    def F(self):
        return self.x.shape[3]


class Numerics:
    """Dot dtype / precision of a call (see the module docstring)."""

    def __init__(self, dtype: torch.dtype, tf32: bool):
        self.dtype = dtype
        self.dt = tl.bfloat16 if dtype == torch.bfloat16 else tl.float32
        if _INTERPRET:
            self.prec = "ieee"
        elif dtype == torch.float16 or (dtype == torch.float32 and tf32):
            self.prec = "tf32"
        else:
            self.prec = "ieee"
        self.upcast = _INTERPRET and dtype == torch.bfloat16
        self.state_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32

    def flags(self):
        # FP fusion pinned (triton 3.10 turns its default off): the same FMAs on every version
        return dict(DT=self.dt, DOT_PREC=self.prec, INTERP_BF16=self.upcast, enable_fp_fusion=True)


def _fit(cfg, fa: int, fc: int):
    """A config with its feature tiles no larger than the (power-of-2 padded) feature dims."""
    bk, bv, w, s = cfg
    return min(bk, max(16, _next_pow2(fa))), min(bv, max(16, _next_pow2(fc))), w, s


def candidates(kind: str, dtype: torch.dtype):
    """The GPU configs of `kind` ("state" or "out") for inputs of `dtype`, the default first."""
    return CONFIGS[kind][dtype]


def _launch(kind: str, key: tuple, launch, fa: int, fc: int, dtype: torch.dtype) -> None:
    """Runs `launch(cfg)` with this kind's config: the interpreter's, the cached one, the first
    candidate (EFFATTN_TRITON_AUTOTUNE=0 or CUDA-graph capture), or the fastest by do_bench."""
    if _INTERPRET:
        launch(_fit(INTERPRET_CONFIG, fa, fc))
        return
    key = (kind,) + key
    cfg = _TUNED.get(key)
    if cfg is not None:
        launch(cfg)
        return
    cands = [_fit(c, fa, fc) for c in candidates(kind.split(":")[0], dtype)]
    cands = list(dict.fromkeys(cands))
    capturing = torch.cuda.is_current_stream_capturing()
    if capturing or os.environ.get("EFFATTN_TRITON_AUTOTUNE", "1") == "0":
        launch(cands[0])
        if not capturing:
            _TUNED[key] = cands[0]
        return
    timed = []
    for c in cands:
        try:
            timed.append((do_bench(lambda: launch(c), warmup=5, rep=20, return_mode="median"), c))
        except Exception as e:  # noqa: BLE001 - a config that does not fit this GPU is skipped
            _log.info("effattn triton linear: %s config %s skipped: %s", kind, c, str(e)[:200])
    if not timed:
        raise RuntimeError(f"effattn triton linear attention: no {kind} config runs for {key}")
    _TUNED[key] = min(timed, key=lambda tc: tc[0])[1]
    launch(_TUNED[key])


def _n_split(programs: int, n_chunks: int, device) -> int:
    """Sequence splits of a non-causal reduction: enough programs for two waves of the GPU."""
    if _INTERPRET:
        return max(1, min(n_chunks, 3))
    return max(1, min(n_chunks, cdiv(2 * sm_count(device), programs)))


def dv_tile(bv: int, fc: int, rows: int, n_sm: int) -> int:
    """The state pass's output-feature tile for ``rows`` programs per output tile (B * H x Fb tiles):
    ``bv`` halved (down to 16) while the programs are fewer than the ``n_sm`` SMs (0: unknown, as
    is). Each program runs the whole sequence's chunks one after another, so at small B * H only
    more output tiles give more programs (each maps its b tile again where the map runs in the passes)."""
    while bv > 16 and rows * cdiv(fc, bv) < n_sm:
        bv //= 2
    return bv


MAP_ROWS = 32          # rows per program of `map_kernel` (64 x 128 spilled: sm_90 offline, bf16 and fp16)
# Where a feature map runs, per input dtype: once per token (`map_kernel`, the passes read phi(x)) from this
# feature dim on (padded to a power of 2; 0: always, math.inf: never), in the passes on every tile they load
# below it. From the offline model (sm_90, triton 3.9: the forward's instructions per chunk of 64 positions at
# F = Dv = 64, 128, 256: chunk sums, state and output programs plus the map kernel's;
# benchmarks/results/offline-sm90/linear_resources.md, "Where the feature map runs"), which
# tests/backends/triton/test_triton_linear.py checks against this table.
MAP_ONCE = {torch.bfloat16: 128, torch.float16: 128, torch.float32: 128}


def map_once(dtype: torch.dtype, F: int) -> bool:
    """Whether a feature map of inputs of `dtype` with `F` features runs once per token (`MAP_ONCE`)."""
    return _next_pow2(max(F, 1)) >= MAP_ONCE[dtype]


def mapped(*rows: Rows) -> Tuple[Rows, ...]:
    """``rows`` (one or two operands of one call: q and k) with their feature map applied once per token
    where `MAP_ONCE` says so for their dtype and feature dim: ``phi(x)`` contiguous in x's dtype (O(L) memory, as the
    input), read as it is by the passes, both operands in one `map_kernel` launch. bf16 and fp32 calls lose
    nothing (their dots round each mapped tile to that dtype, or read fp32). fp16 calls run their dots at
    TF32, whose 10-bit mantissa is fp16's: a mapped feature below fp16's normal range (2^-14: elu + 1 of
    x < -9.7) keeps an absolute error under 2^-25. Identity-mapped operands, and those of a dtype whose
    map runs in the passes, are returned as they are."""
    todo = [i for i, r in enumerate(rows) if r.fmap != FMAP_IDENTITY and map_once(r.x.dtype, r.F) and r.x.numel()]
    if not todo:
        return rows
    xs = [rows[i].x for i in todo]
    if len({(x.dtype, x.shape[0], x.shape[3]) for x in xs}) != 1 or len({rows[i].fmap for i in todo}) != 1:
        raise ValueError("effattn triton linear: operands mapped in one launch share dtype, batch, features and map")
    ys = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    x2, y2 = (xs[1], ys[1]) if len(xs) == 2 else (xs[0], ys[0])
    B, H, L, F = xs[0].shape
    H2, L2 = (x2.shape[1], x2.shape[2]) if len(xs) == 2 else (0, 0)
    bf = min(128, max(16, _next_pow2(F)))
    map_kernel[(B * (H + H2), cdiv(max(L, L2), MAP_ROWS), cdiv(F, bf))](
        Xp=xs[0], x_strides=tuple(xs[0].stride()), Y=ys[0], H=H, L=L, X2p=x2, x2_strides=tuple(x2.stride()),
        Y2=y2, H2=H2, L2=L2, F=F, BL=MAP_ROWS, BF=bf, MAP=rows[todo[0]].fmap,
        INTERP_BF16=_INTERPRET and xs[0].dtype == torch.bfloat16, num_warps=4, enable_fp_fusion=True)
    out = list(rows)
    for i, y in zip(todo, ys):
        out[i] = Rows(y, rows[i].shift)
    return tuple(out)


SUM_ROWS_F = 128       # `chunk_sum_kernel`'s feature tile (64 rows x 128: one fp32 tile a program, no spill)


def chunk_sums(b: Rows, cx: Optional[Tensor], n_chunks: int) -> Tensor:
    """The normalizer's per-chunk increments ``(B*Hs, n_chunks, Fb)`` fp32: each chunk's rows of ``b`` (its
    feature map applied) weighted by ``cx`` (fp32 ``(B*Hs, L)``; None: ones) and summed (`chunk_sum_kernel`)."""
    B, Hs, L, FB = b.x.shape
    zs = torch.empty(B * Hs, n_chunks, FB, dtype=torch.float32, device=b.x.device)
    bz = 32 if _INTERPRET else min(SUM_ROWS_F, max(16, _next_pow2(FB)))
    if zs.numel():
        chunk_sum_kernel[(B * Hs, n_chunks, cdiv(FB, bz))](
            Bp=b.x, b_strides=b.strides, b_L=L, b_shift=b.shift, b_F=FB, CX=cx if cx is not None else zs, ZS=zs,
            n_chunks=n_chunks, b_H=Hs, CH=CHUNK, BZ=bz, C_X=2 if cx is not None else 1, MAP_B=b.fmap, num_warps=4,
            enable_fp_fusion=True)
    return zs


def state_args(b: Rows, c: Rows, zs: Optional[Tensor], st: Optional[Tensor], stz: Optional[Tensor], fin: Tensor,
               finz: Optional[Tensor], n_chunks: int, chunks_per_block: int) -> dict:
    """The chunk-state kernel's arguments by name (`LinStateParams`' fields, strides as tuples; ``ZS``, the
    per-chunk row sums of `chunk_sums`, where C++ reads ``CX``); an absent tensor is ``fin`` (never read)."""
    return dict(Bp=b.x, b_strides=b.strides, Cp=c.x, c_strides=c.strides, b_L=b.L, b_shift=b.shift, b_F=b.F, c_F=c.F,
                ZS=zs if zs is not None else fin, ST=st if st is not None else fin,
                st_strides=tuple(st.stride()) if st is not None else (0, 0, 0, 0),
                STZ=stz if stz is not None else fin, stz_strides=tuple(stz.stride()[:2]) if stz is not None else (0, 0),
                FIN=fin, FINZ=finz if finz is not None else fin, n_chunks=n_chunks, chunks_per_block=chunks_per_block,
                b_H=b.x.shape[1])


def state_pass(b: Rows, c: Rows, T: int, num: Numerics, *, reverse=False, store=True, cx: Optional[Tensor] = None,
               cx_ones=False, split=False, role="fwd"):
    """The chunk-state pass over ``b``, ``c`` (one head each, ``(B, Hs, L, Fb)`` / ``(B, Hs, L, Fc)``) on a
    timeline of ``T`` positions. Returns per-chunk states ``(B*Hs, NC, Fb, Fc)`` and ``z``
    ``(B*Hs, NC, Fb)`` (with ``store``; ``z`` with ``cx`` (B*Hs, L) fp32 or ``cx_ones``) and the final
    sums ``(B*Hs, Fb, Fc)``, ``(B*Hs, Fb)`` (fp32). ``split`` (non-causal, no ``store``): the chunks are
    split over several programs per head and their partial sums added in a fixed order. ``role``
    names the use, for the tuned-config cache."""
    B, Hs, _, FB = b.x.shape
    FC = c.F
    dev = b.x.device
    nc = cdiv(T, CHUNK)
    cx_mode = 2 if cx is not None else (1 if cx_ones else 0)
    f32 = torch.float32
    st = torch.empty(B * Hs, nc, FB, FC, dtype=num.state_dtype, device=dev) if store else None
    stz = torch.empty(B * Hs, nc, FB, dtype=f32, device=dev) if store and cx_mode else None
    zs = chunk_sums(b, cx, nc) if cx_mode else None
    res = {}

    def launch(cfg):
        bk, bv, warps, stages = cfg
        if not split:                # the chunk loop is sequential: parallel only over heads and tiles
            bv = dv_tile(bv, FC, B * Hs * cdiv(FB, bk), sm_count(dev))
        nv = cdiv(FC, bv)
        programs = B * Hs * cdiv(FB, bk) * nv
        ns = _n_split(programs, nc, dev) if split else 1
        fin = torch.empty(ns, B * Hs, FB, FC, dtype=f32, device=dev)
        finz = torch.empty(ns, B * Hs, FB, dtype=f32, device=dev) if cx_mode else None
        chunk_state_kernel[(B * Hs, cdiv(FB, bk) * nv, ns)](
            **state_args(b, c, zs, st, stz, fin, finz, nc, cdiv(nc, ns)),
            CH=CHUNK, BK=bk, BV=bv, NV=nv, REVERSE=reverse, STORE=store, C_X=cx_mode, MAP_B=b.fmap, MAP_C=c.fmap,
            num_warps=warps, num_stages=stages, **num.flags())
        res["fin"] = fin[0] if ns == 1 else fin.sum(0)        # a fixed order: deterministic
        res["finz"] = None if finz is None else (finz[0] if ns == 1 else finz.sum(0))

    key = (_next_pow2(FB), _next_pow2(FC), num.dtype, num.prec, store, b.fmap)
    _launch("state:" + role, key, launch, FB, FC, num.dtype)
    return st, stz, res["fin"], res["finz"]


def out_args(a: Rows, b: Rows, c: Rows, grad_x: Optional[Rows], out: Tensor, den: Optional[Tensor], Hb: int, ga: int,
             ax: Optional[Tensor], bx: Optional[Tensor], state, state_z, base, base_z, eps: float) -> dict:
    """The output kernel's arguments by name (`LinOutParams`' fields, strides as tuples) for `out_pass`'s
    operands (``state`` ... ``base_z``: (tensor, strides) or None); an absent tensor is ``out`` (never read)."""
    B, Ha, _, FA = a.x.shape
    st, st_strides = state if state is not None else (out, (0, 0, 0, 0))
    stz, stz_strides = state_z if state_z is not None else (out, (0, 0))
    bs, bs_strides = base if base is not None else (out, (0, 0, 0))
    bz, bz_strides = base_z if base_z is not None else (out, (0,))
    gx = grad_x if grad_x is not None else a
    return dict(Ap=a.x, a_strides=a.strides, a_L=a.L, a_shift=a.shift, FA=FA, Ha=Ha, GA=ga,
                Bp=b.x, b_strides=b.strides, Cp=c.x, c_strides=c.strides, b_L=b.L, b_shift=b.shift, FC=out.shape[3],
                Hb=Hb, AX=ax if ax is not None else out, BX=bx if bx is not None else out,
                ST=st, st_strides=tuple(st_strides), STZ=stz, stz_strides=tuple(stz_strides),
                BASE=bs, base_strides=tuple(bs_strides), BASEZ=bz, basez_bh=bz_strides[0],
                gbase=max((B * Ha) // (bs.shape[0] if base is not None else 1), 1),
                GXp=gx.x, gx_strides=gx.strides, OUT=out, o_strides=tuple(out.stride()),
                DEN=den if den is not None else out, eps=eps)


def out_pass(a: Rows, b: Optional[Rows], c: Optional[Rows], T: int, num: Numerics, *, out_dtype, causal=True,
             reverse=False, hb: int = 0, fc: int = 0,
             nb=1, ga=1, ax: Optional[Tensor] = None, ax_ones=False, bx: Optional[Tensor] = None,
             bx_ones=False, state=None, state_z=None, z_mode=0, base=None, base_z=None, grad_x: Optional[Rows] = None,
             with_den=False, normalize=False, eps=0.0, role="fwd") -> Tuple[Tensor, Optional[Tensor]]:
    """The output pass (see kernels.py): ``out (B, Ha, La, Fc)`` in ``out_dtype`` and, with ``with_den``,
    ``den (B*Ha, La)`` fp32. ``state``: per-chunk states ``(B*Hb, NC, FA, Fc)`` as a tensor and its 4
    strides ``(bh, chunk, fa, fc)`` (a transposed read swaps the last two; a chunk stride of 0 gives every
    chunk one state); ``state_z`` likewise with 2 strides. ``base``: ``(B*Hbase, FA, Fc)`` tensor with 3
    strides, ``base_z`` with 1; ``grad_x``: multiply the output by ``phi'(x)`` of these rows."""
    B, Ha, La, FA = a.x.shape
    b = b if b is not None else a                     # not read without the intra-chunk term
    Hb = hb or b.x.shape[1]
    FC = fc or c.F
    c = c if c is not None else a
    dev = a.x.device
    nc = cdiv(T, CHUNK)
    out = torch.empty(B, Ha, La, FC, dtype=out_dtype, device=dev)
    den = torch.empty(B * Ha, La, dtype=torch.float32, device=dev) if with_den else None
    a_x = 2 if ax is not None else (1 if ax_ones else 0)
    b_x = 2 if bx is not None else (1 if bx_ones else 0)
    args = out_args(a, b, c, grad_x, out, den, Hb, ga, ax, bx, state, state_z, base, base_z, eps)

    def launch(cfg):
        bk, bv, warps, stages = cfg
        # heads on the first grid axis (no 65535 limit there): B * H can be large, chunks rarely are
        chunk_out_kernel[(B * Ha, nc, cdiv(FC, bv))](
            **args, CH=CHUNK, BK=bk, BV=bv, NB=nb, CAUSAL=causal, REVERSE=reverse, MAP_A=a.fmap, MAP_B=b.fmap,
            MAP_C=c.fmap,
            MAP_X=grad_x.fmap if grad_x is not None else FMAP_IDENTITY, A_X=a_x, B_X=b_x,
            HAS_STATE=state is not None, STATE_Z=state_z is not None, Z_MODE=z_mode, HAS_BASE=base is not None,
            BASE_Z=base_z is not None, WITH_DEN=with_den, NORMALIZE=normalize,
            num_warps=warps, num_stages=stages, **num.flags())

    if B * Ha * La * FC > 0:
        key = (_next_pow2(FA), _next_pow2(FC), num.dtype, num.prec, causal, nb, a.fmap, b.fmap, c.fmap)
        _launch("out:" + role, key, launch, FA, FC, num.dtype)
    return out, den


def step(q: Tensor, k: Tensor, v: Tensor, S: Tensor, z: Tensor, fmap: int, normalize: bool, eps: float):
    """One decoding step: q ``(B, H, 1, F)``, k ``(B, Hkv, 1, F)``, v ``(B, Hkv, 1, Dv)``, state fp32
    ``S (B, H, F, Dv)``, ``z (B, H, F)`` -> ``out (B, H, 1, Dv)``, new ``S``, ``z``."""
    B, H, _, F = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    S, z = S.contiguous(), z.contiguous()
    q2, k2, v2 = (t.reshape(t.shape[0] * t.shape[1], t.shape[3]).contiguous() for t in (q, k, v))  # one row a head
    S_new, z_new = torch.empty_like(S), torch.empty_like(z)
    out = torch.empty(B, H, 1, Dv, dtype=v.dtype, device=q.device)
    bv = min(128, max(16, _next_pow2(Dv)))
    bf = min(64, max(16, _next_pow2(F)))
    step_kernel[(B * H, cdiv(Dv, bv))](
        Q=q2, K=k2, V=v2, S=S, Z=z, S_OUT=S_new, Z_OUT=z_new, OUT=out, q_bh=q2.stride(0), k_bh=k2.stride(0),
        v_bh=v2.stride(0), o_bh=Dv, H=H, G=H // Hkv, F=F, Dv=Dv, eps=eps, BF=bf, BV=bv, MAP=fmap, NORMALIZE=normalize, INTERP_BF16=_INTERPRET and v.dtype == torch.bfloat16,
        num_warps=4, enable_fp_fusion=True)
    return out, S_new, z_new
