"""torch.library ops of the CUDA linear attention (kernels in csrc/linear/*.cuh).

Two C++ passes (see csrc/linear/linear.h) do all the work: the chunk-state pass ``state_pass`` and the
output pass ``out_pass``, over row operands ``Rows(x, shift, fmap)`` on a timeline of query
positions. The custom ops here compose them, forward and backward, with this notation (one query
head, ``f = phi(q)``, ``p = phi(k)``, base state ``(S0, z0)``)::

    out_i = f_i (S0 + sum_{j <= i} p_j^T v_j) / den_i,   den_i = f_i . (z0 + sum_{j <= i} p_j) + eps
    g_i = dout_i / den_i,   e_i = -(g_i . out_i)          (g = dout, e = 0 without normalize)
    df_i = sum_{j <= i} (g_i . v_j + e_i) p_j + g_i S0^T + e_i z0
    dp_j = sum_{i >= j} (v_j . g_i + e_i) f_i + v_j dS^T + dz
    dv_j = sum_{i >= j} (p_j . f_i) g_i + p_j dS
    dS0 = sum_i f_i^T g_i,   dz0 = sum_i f_i e_i

Each gradient line is an output pass (forward or reverse in time) over a state pass of permuted
operands; one reverse state pass over (f, g, e) serves dp, dv and dS0. GQA key-side gradients sum
the group's query heads inside the kernel, in a fixed order; non-causal reductions split over the
sequence are added in a fixed order: every result is deterministic (no atomics).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ....feature_maps import FMAP_IDENTITY
from ....splits import sm_count
from ...linear_common import (
    apply_bwd_fake,
    apply_fake,
    apply_state_grads,
    causal_bwd_fake,
    causal_fwd_fake,
    empty_den,
    kv_state_fake,
    state_grads,
    step_fake,
    zero_state_grads,
)
from ...linear_common import opt as _opt
from ...linear_common import out_grads as _out_grads
from .._ext import ops as kernels

CHUNK = 64                                     # timeline positions per chunk (csrc/linear.h: kLinChunk)
FAVOR_CAP = 30.0                               # effattn.feature_maps.FAVOR_MAX_EXPONENT


def parts(dtype: torch.dtype) -> int:
    """bf16 parts per operand in every product (csrc/linear/common.cuh): 1 bf16, 2 fp16, 3 fp32."""
    return {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}[dtype]


@dataclass
class Rows:
    """A row operand ``x (B, H, L, F)`` read at row ``t + shift`` of the timeline through ``fmap``."""
    x: Tensor
    shift: int = 0
    fmap: int = FMAP_IDENTITY


def _split(device: torch.device, blocks: int, n_chunks: int) -> int:
    """Sequence splits of a store-less state pass: enough blocks for two waves of the GPU (three on
    the emulation, so that small tests cross split edges)."""
    if device.type != "cuda":
        return max(1, min(n_chunks, 3))
    return max(1, min(n_chunks, -(-2 * sm_count(device) // max(blocks, 1))))


def state_pass(b: Rows, c: Rows, T: int, np_: int, *, reverse=False, store=True, cx: Optional[Tensor] = None,
               cx_ones=False):
    """Per-chunk states ``(B*H, NC, Fb, Fc)`` / ``z (B*H, NC, Fb)`` (with ``store``) and the final sums
    ``(B*H, Fb, Fc)`` / ``(B*H, Fb)`` (z with ``cx`` (B*H, L) fp32 or ``cx_ones``; else None)."""
    B, H, _, Fb = b.x.shape
    nc = -(-T // CHUNK)
    split = 1 if store else _split(b.x.device, B * H * -(-Fb // 64) * -(-c.x.shape[3] // 64), nc)
    mode = 2 if cx is not None else (1 if cx_ones else 0)
    st, stz, fin, finz = kernels(b.x.device).linear_state(b.x, b.shift, b.fmap, c.x, c.fmap, cx, mode, T, reverse,
                                                          store, split, np_)
    fin = fin[0] if fin.shape[0] == 1 else fin.sum(0)                  # a fixed order: deterministic
    finz = None if mode == 0 else (finz[0] if finz.shape[0] == 1 else finz.sum(0))
    return (st if store else None), (stz if store and mode else None), fin, finz


def _strides(x: Optional[Tensor], transpose=False, per_chunk=True):
    """(tensor, strides) of a state read by the output pass: (bh, chunk, fa, fc) for per-chunk states
    ``(BH, NC, F1, F2)``, or a state every chunk shares ``(BH, F1, F2)`` with chunk stride 0; ``transpose``
    swaps the last two. None stays None."""
    if x is None:
        return None, []
    if not per_chunk:
        x = x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous()
        s = [x.stride(0), 0, x.stride(1), x.stride(2)]
    else:
        s = list(x.stride())
    if transpose:
        s[2], s[3] = s[3], s[2]
    return x, s


def _zstrides(z: Optional[Tensor], per_chunk=True):
    if z is None:
        return None, []
    if per_chunk:
        return z, [z.stride(0), z.stride(1)]
    z = z.reshape(-1, z.shape[-1]).contiguous()
    return z, [z.stride(0), 0]


def _base(x: Optional[Tensor], transpose=False):
    if x is None:
        return None, []
    x = x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous()
    s = [x.stride(0), x.stride(2), x.stride(1)] if transpose else list(x.stride())
    return x, s


def _base_z(z: Optional[Tensor]):
    if z is None:
        return None, 0
    z = z.reshape(-1, z.shape[-1]).contiguous()
    return z, z.stride(0)


def out_pass(a: Rows, b: Optional[Rows], c: Optional[Rows], T: int, np_: int, *, out_dtype, fc: int = 0,
             causal=True, reverse=False, hb: int = 0, nb=1, ga=1, ax=None, ax_ones=False, bx=None, bx_ones=False,
             state=(None, []), state_z=(None, []), z_mode=0, base=(None, []), base_z=(None, 0),
             grad_x: Optional[Rows] = None, with_den=False, normalize=False, eps=0.0):
    """``out (B, Ha, La, FC)`` in ``out_dtype`` and ``den (B*Ha, La)`` fp32 (empty without ``with_den``);
    see csrc/linear/linear.h for the formula."""
    FC = fc or c.x.shape[3]
    Hb = hb or (b.x.shape[1] if b is not None else a.x.shape[1])
    gx = grad_x if grad_x is not None and grad_x.fmap else None
    return kernels(a.x.device).linear_out(
        a.x, a.shift, a.fmap, b.x if causal else None, b.shift if causal else 0, b.fmap if causal else 0,
        c.x if causal else None, c.fmap if causal else 0, FC, Hb, T, causal, reverse, nb, ga,
        ax, 2 if ax is not None else int(ax_ones), bx, 2 if bx is not None else int(bx_ones),
        state[0], state[1], state_z[0], state_z[1], z_mode, base[0], base[1], base_z[0], base_z[1],
        gx.x if gx is not None else None, gx.fmap if gx is not None else 0, out_dtype, with_den, normalize, eps, np_)


# ------------------------------------------------------------------------------------ causal

def causal_fwd(q, k, v, base_s, base_z, shift, fmap, normalize, eps):
    B, H, Lq, F = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    n = parts(v.dtype)
    kr, vr = Rows(k, shift, fmap), Rows(v, shift)
    st, stz, S, z = state_pass(kr, vr, Lq, n, cx_ones=True)
    out, den = out_pass(Rows(q, 0, fmap), kr, vr, Lq, n, out_dtype=v.dtype, ga=H // Hkv, state=_strides(st),
                        state_z=_zstrides(stz) if normalize else (None, []), z_mode=1, base=_base(base_s),
                        base_z=_base_z(base_z) if normalize else (None, 0), with_den=normalize, normalize=normalize,
                        eps=eps)
    return out, empty_den(den, q), S.view(B, Hkv, F, Dv), z.view(B, Hkv, F)


def causal_bwd(dout, dS, dz, q, k, v, out, den, base_s, base_z, shift, fmap, normalize, eps):
    B, H, Lq, F = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    n = parts(v.dtype)
    g, e = _out_grads(dout, out, den, normalize)
    fq, gr = Rows(q, 0, fmap), Rows(g)
    kr, vr = Rows(k, shift, fmap), Rows(v, shift)
    mapped = fmap != FMAP_IDENTITY
    st, stz, _, _ = state_pass(kr, vr, Lq, n, cx_ones=normalize)                       # the forward's states
    dh, dhz, dS0, dz0 = state_pass(fq, gr, Lq, n, reverse=True, cx=e)                  # per query head
    dq, _ = out_pass(gr, vr, kr, Lq, n, out_dtype=q.dtype, ga=G, ax=e, bx_ones=normalize,
                     state=_strides(st, transpose=True), state_z=_zstrides(stz) if normalize else (None, []),
                     z_mode=2, base=_base(base_s, transpose=True),
                     base_z=_base_z(base_z) if normalize else (None, 0), grad_x=fq if mapped else None)
    dk, _ = out_pass(Rows(v, shift), gr, fq, Lq, n, out_dtype=k.dtype, reverse=True, nb=G, ax_ones=True, bx=e,
                     state=_strides(dh, transpose=True), state_z=_zstrides(dhz) if normalize else (None, []),
                     z_mode=2, base=_base(dS, transpose=True), base_z=_base_z(dz), grad_x=kr if mapped else None)
    dv, _ = out_pass(kr, fq, gr, Lq, n, out_dtype=v.dtype, reverse=True, nb=G, state=_strides(dh), base=_base(dS))
    return (dq, dk, dv) + state_grads(dS0, dz0, base_s, base_z, normalize, q)


# ------------------------------------------------------------------------------- non-causal

def kv_state_fwd(k, v, fmap):
    """(S (B, Hkv, F, Dv), z (B, Hkv, F)) fp32 over all keys."""
    B, Hkv, Lk, F = k.shape
    _, _, S, z = state_pass(Rows(k, 0, fmap), Rows(v), Lk, parts(v.dtype), store=False, cx_ones=True)
    return S.view(B, Hkv, F, v.shape[3]), z.view(B, Hkv, F)


def kv_state_bwd(dS, dz, k, v, fmap):
    n = parts(v.dtype)
    Lk, F, Dv = k.shape[2], k.shape[3], v.shape[3]
    kr = Rows(k, 0, fmap)
    dk, _ = out_pass(Rows(v), None, None, Lk, n, out_dtype=k.dtype, causal=False, fc=F, ax_ones=True,
                     state=_strides(dS, transpose=True, per_chunk=False), state_z=_zstrides(dz, per_chunk=False),
                     z_mode=2, grad_x=kr if fmap else None)
    dv, _ = out_pass(kr, None, None, Lk, n, out_dtype=v.dtype, causal=False, fc=Dv,
                     state=_strides(dS, per_chunk=False))
    return dk, dv


def apply_fwd(q, S, z, base_s, base_z, fmap, normalize, eps, out_dtype):
    """out_i = phi(q_i) (S + S0) / (phi(q_i) . (z + z0) + eps); S, z per key head, S0, z0 per query head."""
    H, Lq = q.shape[1], q.shape[2]
    Hkv, Dv = S.shape[1], S.shape[3]
    out, den = out_pass(Rows(q, 0, fmap), None, None, Lq, parts(out_dtype), out_dtype=out_dtype, causal=False,
                        hb=Hkv, fc=Dv, ga=H // Hkv, state=_strides(S, per_chunk=False),
                        state_z=_zstrides(z, per_chunk=False) if normalize else (None, []), z_mode=1,
                        base=_base(base_s), base_z=_base_z(base_z) if normalize else (None, 0), with_den=normalize,
                        normalize=normalize, eps=eps)
    return out, empty_den(den, q)


def apply_bwd(dout, q, S, z, base_s, base_z, out, den, fmap, normalize, eps):
    B, H, Lq, F = q.shape
    Hkv = S.shape[1]
    n = parts(out.dtype)
    g, e = _out_grads(dout, out, den, normalize)
    fq = Rows(q, 0, fmap)
    dq, _ = out_pass(Rows(g), None, None, Lq, n, out_dtype=q.dtype, causal=False, hb=Hkv, fc=F, ga=H // Hkv, ax=e,
                     state=_strides(S, transpose=True, per_chunk=False),
                     state_z=_zstrides(z, per_chunk=False) if normalize else (None, []), z_mode=2,
                     base=_base(base_s, transpose=True), base_z=_base_z(base_z) if normalize else (None, 0),
                     grad_x=fq if fmap else None)
    _, _, dSq, dzq = state_pass(fq, Rows(g), Lq, n, store=False, cx=e)                # (B*H, F, Dv)
    return (dq,) + apply_state_grads(dSq, dzq, S, z, base_s, base_z, normalize, q)


# ------------------------------------------------------------------------------------ ops

@torch.library.custom_op("effattn::cuda_linear_causal_fwd", mutates_args=())
def cuda_linear_causal_fwd(q: Tensor, k: Tensor, v: Tensor, base_s: Optional[Tensor], base_z: Optional[Tensor],
                           shift: int, fmap: int, normalize: bool, eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return causal_fwd(q, k, v, base_s, base_z, shift, fmap, normalize, eps)


@cuda_linear_causal_fwd.register_fake
def _(q, k, v, base_s, base_z, shift, fmap, normalize, eps):
    return causal_fwd_fake(q, k, v, normalize)


@torch.library.custom_op("effattn::cuda_linear_causal_bwd", mutates_args=())
def cuda_linear_causal_bwd(dout: Tensor, dS: Tensor, dz: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                           den: Tensor, base_s: Optional[Tensor], base_z: Optional[Tensor], shift: int, fmap: int,
                           normalize: bool, eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return causal_bwd(dout, dS, dz, q, k, v, out, den, base_s, base_z, shift, fmap, normalize, eps)


@cuda_linear_causal_bwd.register_fake
def _(dout, dS, dz, q, k, v, out, den, base_s, base_z, *args):
    return causal_bwd_fake(q, k, v, base_s, base_z)


def _causal_setup(ctx, inputs, output):
    q, k, v, base_s, base_z, shift, fmap, normalize, eps = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], base_s, base_z)
    ctx.static = (shift, fmap, normalize, eps)


def _causal_backward(ctx, dout, _dden, dS, dz):
    q, k, v, out, den, base_s, base_z = ctx.saved_tensors
    dS, dz = zero_state_grads(k, v, dS, dz)
    dq, dk, dv, dbs, dbz = cuda_linear_causal_bwd(dout, dS, dz, q, k, v, out, den, base_s, base_z, *ctx.static)
    return dq, dk, dv, _opt(dbs), _opt(dbz), None, None, None, None


cuda_linear_causal_fwd.register_autograd(_causal_backward, setup_context=_causal_setup)


@torch.library.custom_op("effattn::cuda_linear_kv_state", mutates_args=())
def cuda_linear_kv_state(k: Tensor, v: Tensor, fmap: int) -> Tuple[Tensor, Tensor]:
    return kv_state_fwd(k, v, fmap)


@cuda_linear_kv_state.register_fake
def _(k, v, fmap):
    return kv_state_fake(k, v)


@torch.library.custom_op("effattn::cuda_linear_kv_state_bwd", mutates_args=())
def cuda_linear_kv_state_bwd(dS: Tensor, dz: Tensor, k: Tensor, v: Tensor, fmap: int) -> Tuple[Tensor, Tensor]:
    return kv_state_bwd(dS, dz, k, v, fmap)


@cuda_linear_kv_state_bwd.register_fake
def _(dS, dz, k, v, fmap):
    return torch.empty_like(k), torch.empty_like(v)


def _kv_setup(ctx, inputs, output):
    k, v, fmap = inputs
    ctx.save_for_backward(k, v)
    ctx.fmap = fmap


def _kv_backward(ctx, dS, dz):
    k, v = ctx.saved_tensors
    dS, dz = zero_state_grads(k, v, dS, dz)
    dk, dv = cuda_linear_kv_state_bwd(dS, dz, k, v, ctx.fmap)
    return dk, dv, None


cuda_linear_kv_state.register_autograd(_kv_backward, setup_context=_kv_setup)


@torch.library.custom_op("effattn::cuda_linear_apply", mutates_args=())
def cuda_linear_apply(q: Tensor, S: Tensor, z: Tensor, base_s: Optional[Tensor], base_z: Optional[Tensor], fmap: int,
                      normalize: bool, eps: float, out_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    return apply_fwd(q, S, z, base_s, base_z, fmap, normalize, eps, out_dtype)


@cuda_linear_apply.register_fake
def _(q, S, z, base_s, base_z, fmap, normalize, eps, out_dtype):
    return apply_fake(q, S, normalize, out_dtype)


@torch.library.custom_op("effattn::cuda_linear_apply_bwd", mutates_args=())
def cuda_linear_apply_bwd(dout: Tensor, q: Tensor, S: Tensor, z: Tensor, base_s: Optional[Tensor],
                          base_z: Optional[Tensor], out: Tensor, den: Tensor, fmap: int, normalize: bool,
                          eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return apply_bwd(dout, q, S, z, base_s, base_z, out, den, fmap, normalize, eps)


@cuda_linear_apply_bwd.register_fake
def _(dout, q, S, z, base_s, base_z, *args):
    return apply_bwd_fake(q, S, z, base_s, base_z)


def _apply_setup(ctx, inputs, output):
    q, S, z, base_s, base_z, fmap, normalize, eps, out_dtype = inputs
    ctx.save_for_backward(q, S, z, base_s, base_z, output[0], output[1])
    ctx.static = (fmap, normalize, eps)


def _apply_backward(ctx, dout, _dden):
    q, S, z, base_s, base_z, out, den = ctx.saved_tensors
    dq, dS, dz, dbs, dbz = cuda_linear_apply_bwd(dout, q, S, z, base_s, base_z, out, den, *ctx.static)
    return dq, dS, dz, _opt(dbs), _opt(dbz), None, None, None, None


cuda_linear_apply.register_autograd(_apply_backward, setup_context=_apply_setup)


@torch.library.custom_op("effattn::cuda_linear_step", mutates_args=())
def cuda_linear_step(q: Tensor, k: Tensor, v: Tensor, S: Tensor, z: Tensor, fmap: int, normalize: bool,
                     eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    """One decoding step (no autograd: used for inputs that need no gradient)."""
    return kernels(q.device).linear_step(q, k, v, S, z, fmap, normalize, eps)


@cuda_linear_step.register_fake
def _(q, k, v, S, z, fmap, normalize, eps):
    return step_fake(q, v, S, z)
