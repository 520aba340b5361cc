"""torch.library ops of the Triton linear attention, their fake impls and autograd formulas.

Notation (one query head; ``f = phi(q)``, ``p = phi(k)``; the base state ``(S0, z0)``)::

    num_i = f_i (S0 + sum_{j <= i} p_j^T v_j)      den_i = f_i . (z0 + sum_{j <= i} p_j) + eps
    out_i = num_i / den_i   (num_i without normalize)

Backward, with ``g_i = dout_i / den_i`` and ``e_i = -(g_i . out_i)`` (``g = dout``, ``e = 0`` without
normalize), and ``(dS, dz)`` the gradient of the final state:

    df_i = sum_{j <= i} (g_i . v_j + e_i) p_j + g_i S0^T + e_i z0
    dp_j = sum_{i >= j} (v_j . g_i + e_i) f_i + v_j dS^T + dz
    dv_j = sum_{i >= j} (p_j . f_i) g_i + p_j dS
    dS0 = sum_i f_i^T g_i,  dz0 = sum_i f_i e_i

Each line is the forward's shape again (a chunk-state pass and an output pass), forward or reverse in
time, with the operands permuted: one reverse state pass over (f, g, e) serves dp, dv and dS0. For
GQA the key-side passes sum the group's query heads in a fixed order (no atomics: deterministic).
Feature maps run where `launch.MAP_ONCE` puts them for the dtype: once per token and call (`mapped`: the
forward maps q and k in one launch, the backward once more; the features are not kept: memory as the
inputs') or in the passes; the chain rule reads the raw rows.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ....feature_maps import FMAP_IDENTITY
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
from .launch import Numerics, Rows, mapped, out_pass, state_pass, step


def _t(x: Tensor):
    """(state as a contiguous (B*H, F, Dv), strides with a chunk stride of 0, last two swapped): the
    transposed read of a state that every chunk shares. States are small: copying one (incoming
    gradients can be expanded views) costs nothing next to a pass over the sequence."""
    x = x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous()
    return x, (x.stride(0), 0, x.stride(2), x.stride(1))


def _n(x: Tensor):
    x = x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous()
    return x, (x.stride(0), 0, x.stride(1), x.stride(2))


def _base(x: Optional[Tensor], transpose=False):
    if x is None:
        return None
    x, s = _t(x) if transpose else _n(x)
    return x, (s[0], s[2], s[3])


def _vec(x: Optional[Tensor], per_chunk=False):
    if x is None:
        return None
    x = x.reshape(-1, x.shape[-1]).contiguous()         # the kernels read it with unit stride
    return (x, (x.stride(0), 0)) if per_chunk else (x, (x.stride(0),))


# ------------------------------------------------------------------------------------ causal

def causal_fwd(q, k, v, base_s, base_z, shift, fmap, normalize, eps, tf32):
    num = Numerics(v.dtype, tf32)
    B, H, Lq, F = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    fq, kb = mapped(Rows(q, 0, fmap), Rows(k, shift, fmap))
    vb = Rows(v, shift)
    st, stz, S, z = state_pass(kb, vb, Lq, num, cx_ones=True)
    out, den = out_pass(fq, kb, vb, Lq, num, out_dtype=v.dtype, ga=H // Hkv,
                        state=(st, st.stride()), state_z=(stz, stz.stride()[:2]) if normalize else None,
                        z_mode=1, base=_base(base_s), base_z=_vec(base_z) if normalize else None,
                        with_den=normalize, normalize=normalize, eps=eps)
    return out, empty_den(den, q), S.view(B, Hkv, F, Dv), z.view(B, Hkv, F)


def causal_bwd(dout, dS, dz, q, k, v, out, den, base_s, base_z, shift, fmap, normalize, eps, tf32):
    num = Numerics(v.dtype, tf32)
    B, H, Lq, F = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    g, e = _out_grads(dout, out, den, normalize)
    gb, vb = Rows(g), Rows(v, shift)
    xq, xk = Rows(q, 0, fmap), Rows(k, shift, fmap)          # raw rows: the map's derivative
    fq, kb = mapped(xq, xk)
    chain = fmap != FMAP_IDENTITY
    st, stz, _, _ = state_pass(kb, vb, Lq, num, cx_ones=normalize)               # the forward's states
    dh, dhz, dS0, dz0 = state_pass(fq, gb, Lq, num, reverse=True, cx=e, role="dh")   # per query head
    dq, _ = out_pass(gb, vb, kb, Lq, num, out_dtype=q.dtype, ga=G, ax=e, bx_ones=normalize,
                     state=(st, st.stride()[:2] + (st.stride(3), st.stride(2))),
                     state_z=(stz, stz.stride()[:2]) if normalize else None, z_mode=2,
                     base=_base(base_s, transpose=True), base_z=_vec(base_z) if normalize else None,
                     grad_x=xq if chain else None, role="dq")
    dk, _ = out_pass(Rows(v, shift), gb, fq, Lq, num, out_dtype=k.dtype, reverse=True, nb=G, ax_ones=True, bx=e,
                     state=(dh, dh.stride()[:2] + (dh.stride(3), dh.stride(2))),
                     state_z=(dhz, dhz.stride()[:2]) if normalize else None, z_mode=2,
                     base=_base(dS, transpose=True), base_z=_vec(dz), grad_x=xk if chain else None, role="dk")
    dv, _ = out_pass(kb, fq, gb, Lq, num, out_dtype=v.dtype, reverse=True, nb=G, state=(dh, dh.stride()),
                     base=_base(dS), role="dv")
    return (dq, dk, dv) + state_grads(dS0, dz0, base_s, base_z, normalize, q)


# ------------------------------------------------------------------------------- non-causal

def kv_state_fwd(k, v, fmap, tf32):
    """(S (B, Hkv, F, Dv), z (B, Hkv, F)) fp32: one reduction over the keys, split over the sequence."""
    num = Numerics(v.dtype, tf32)
    B, Hkv, Lk, F = k.shape
    _, _, S, z = state_pass(*mapped(Rows(k, 0, fmap)), Rows(v), Lk, num, store=False, cx_ones=True, split=True)
    return S.view(B, Hkv, F, v.shape[-1]), z.view(B, Hkv, F)


def kv_state_bwd(dS, dz, k, v, fmap, tf32):
    num = Numerics(v.dtype, tf32)
    Lk, F, Dv = k.shape[2], k.shape[3], v.shape[3]
    xk = Rows(k, 0, fmap)
    dk, _ = out_pass(Rows(v), None, None, Lk, num, out_dtype=k.dtype, causal=False, fc=F, ax_ones=True,
                     state=_t(dS), state_z=_vec(dz, per_chunk=True), z_mode=2,
                     grad_x=xk if fmap != FMAP_IDENTITY else None, role="dk")
    dv, _ = out_pass(*mapped(xk), None, None, Lk, num, out_dtype=v.dtype, causal=False, fc=Dv, state=_n(dS), role="dv")
    return dk, dv


def apply_fwd(q, S, z, base_s, base_z, fmap, normalize, eps, out_dtype, tf32):
    """out_i = phi(q_i) (S + S0) / (phi(q_i) . (z + z0) + eps); S, z per key head, S0, z0 per query head."""
    num = Numerics(out_dtype, tf32)
    B, H, Lq, F = q.shape
    Hkv, Dv = S.shape[1], S.shape[-1]
    out, den = out_pass(*mapped(Rows(q, 0, fmap)), None, None, Lq, num, out_dtype=out_dtype, causal=False, hb=Hkv,
                        fc=Dv, ga=H // Hkv, state=_n(S), state_z=_vec(z, per_chunk=True) if normalize else None,
                        z_mode=1, base=_base(base_s), base_z=_vec(base_z) if normalize else None,
                        with_den=normalize, normalize=normalize, eps=eps)
    return out, empty_den(den, q)


def apply_bwd(dout, q, S, z, base_s, base_z, out, den, fmap, normalize, eps, tf32):
    num = Numerics(out.dtype, tf32)
    B, H, Lq, F = q.shape
    Hkv = S.shape[1]
    g, e = _out_grads(dout, out, den, normalize)
    xq = Rows(q, 0, fmap)
    dq, _ = out_pass(Rows(g), None, None, Lq, num, out_dtype=q.dtype, causal=False, hb=Hkv, fc=F, ga=H // Hkv,
                     ax=e, state=_t(S), state_z=_vec(z, per_chunk=True) if normalize else None, z_mode=2,
                     base=_base(base_s, transpose=True), base_z=_vec(base_z) if normalize else None,
                     grad_x=xq if fmap != FMAP_IDENTITY else None, role="dq")
    _, _, dSq, dzq = state_pass(*mapped(xq), Rows(g), Lq, num, store=False, cx=e, split=True, role="dS")   # (B*H, F, Dv)
    return (dq,) + apply_state_grads(dSq, dzq, S, z, base_s, base_z, normalize, q)


# ------------------------------------------------------------------------------------ ops

@torch.library.custom_op("effattn::triton_linear_causal_fwd", mutates_args=())
def triton_linear_causal_fwd(q: Tensor, k: Tensor, v: Tensor, base_s: Optional[Tensor], base_z: Optional[Tensor],
                             shift: int, fmap: int, normalize: bool, eps: float,
                             tf32: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return causal_fwd(q, k, v, base_s, base_z, shift, fmap, normalize, eps, tf32)


@triton_linear_causal_fwd.register_fake
def _(q, k, v, base_s, base_z, shift, fmap, normalize, eps, tf32):
    return causal_fwd_fake(q, k, v, normalize)


@torch.library.custom_op("effattn::triton_linear_causal_bwd", mutates_args=())
def triton_linear_causal_bwd(dout: Tensor, dS: Optional[Tensor], dz: Optional[Tensor], q: Tensor, k: Tensor,
                             v: Tensor, out: Tensor, den: Tensor, base_s: Optional[Tensor],
                             base_z: Optional[Tensor], shift: int, fmap: int, normalize: bool, eps: float,
                             tf32: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return causal_bwd(dout, dS, dz, q, k, v, out, den, base_s, base_z, shift, fmap, normalize, eps, tf32)


@triton_linear_causal_bwd.register_fake
def _(dout, dS, dz, q, k, v, out, den, base_s, base_z, *args):
    return causal_bwd_fake(q, k, v, base_s, base_z)


def _causal_setup(ctx, inputs, output):
    q, k, v, base_s, base_z, shift, fmap, normalize, eps, tf32 = inputs
    out, den, _, _ = output
    ctx.save_for_backward(q, k, v, out, den, base_s, base_z)
    ctx.static = (shift, fmap, normalize, eps, tf32)


def _causal_backward(ctx, dout, _dden, dS, dz):
    q, k, v, out, den, base_s, base_z = ctx.saved_tensors
    dq, dk, dv, dbs, dbz = triton_linear_causal_bwd(dout, dS, dz, q, k, v, out, den, base_s, base_z, *ctx.static)
    return dq, dk, dv, _opt(dbs), _opt(dbz), None, None, None, None, None


triton_linear_causal_fwd.register_autograd(_causal_backward, setup_context=_causal_setup)


@torch.library.custom_op("effattn::triton_linear_kv_state", mutates_args=())
def triton_linear_kv_state(k: Tensor, v: Tensor, fmap: int, tf32: bool) -> Tuple[Tensor, Tensor]:
    return kv_state_fwd(k, v, fmap, tf32)


@triton_linear_kv_state.register_fake
def _(k, v, fmap, tf32):
    return kv_state_fake(k, v)


@torch.library.custom_op("effattn::triton_linear_kv_state_bwd", mutates_args=())
def triton_linear_kv_state_bwd(dS: Tensor, dz: Tensor, k: Tensor, v: Tensor, fmap: int,
                               tf32: bool) -> Tuple[Tensor, Tensor]:
    return kv_state_bwd(dS, dz, k, v, fmap, tf32)


@triton_linear_kv_state_bwd.register_fake
def _(dS, dz, k, v, fmap, tf32):
    return torch.empty_like(k), torch.empty_like(v)


def _kv_setup(ctx, inputs, output):
    k, v, fmap, tf32 = inputs
    ctx.save_for_backward(k, v)
    ctx.static = (fmap, tf32)


def _kv_backward(ctx, dS, dz):
    k, v = ctx.saved_tensors
    dS, dz = zero_state_grads(k, v, dS, dz)
    dk, dv = triton_linear_kv_state_bwd(dS, dz, k, v, *ctx.static)
    return dk, dv, None, None


triton_linear_kv_state.register_autograd(_kv_backward, setup_context=_kv_setup)


@torch.library.custom_op("effattn::triton_linear_apply", mutates_args=())
def triton_linear_apply(q: Tensor, S: Tensor, z: Tensor, base_s: Optional[Tensor], base_z: Optional[Tensor],
                        fmap: int, normalize: bool, eps: float, out_dtype: torch.dtype,
                        tf32: bool) -> Tuple[Tensor, Tensor]:
    return apply_fwd(q, S, z, base_s, base_z, fmap, normalize, eps, out_dtype, tf32)


@triton_linear_apply.register_fake
def _(q, S, z, base_s, base_z, fmap, normalize, eps, out_dtype, tf32):
    return apply_fake(q, S, normalize, out_dtype)


@torch.library.custom_op("effattn::triton_linear_apply_bwd", mutates_args=())
def triton_linear_apply_bwd(dout: Tensor, q: Tensor, S: Tensor, z: Tensor, base_s: Optional[Tensor],
                            base_z: Optional[Tensor], out: Tensor, den: Tensor, fmap: int, normalize: bool,
                            eps: float, tf32: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return apply_bwd(dout, q, S, z, base_s, base_z, out, den, fmap, normalize, eps, tf32)


@triton_linear_apply_bwd.register_fake
def _(dout, q, S, z, base_s, base_z, *args):
    return apply_bwd_fake(q, S, z, base_s, base_z)


def _apply_setup(ctx, inputs, output):
    q, S, z, base_s, base_z, fmap, normalize, eps, out_dtype, tf32 = inputs
    out, den = output
    ctx.save_for_backward(q, S, z, base_s, base_z, out, den)
    ctx.static = (fmap, normalize, eps, tf32)


def _apply_backward(ctx, dout, _dden):
    q, S, z, base_s, base_z, out, den = ctx.saved_tensors
    dq, dS, dz, dbs, dbz = triton_linear_apply_bwd(dout, q, S, z, base_s, base_z, out, den, *ctx.static)
    return dq, dS, dz, _opt(dbs), _opt(dbz), None, None, None, None, None


triton_linear_apply.register_autograd(_apply_backward, setup_context=_apply_setup)


@torch.library.custom_op("effattn::triton_linear_step", mutates_args=())
def triton_linear_step(q: Tensor, k: Tensor, v: Tensor, S: Tensor, z: Tensor, fmap: int, normalize: bool,
                       eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    """One decoding step (no autograd: used under no_grad / for inputs without gradients)."""
    return step(q, k, v, S, z, fmap, normalize, eps)


@triton_linear_step.register_fake
def _(q, k, v, S, z, fmap, normalize, eps):
    return step_fake(q, v, S, z)
