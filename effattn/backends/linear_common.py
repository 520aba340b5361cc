"""What the Triton and CUDA linear-attention backends share: the composition of a call around their
kernels (``run``) and the torch-side pieces of their autograd ops (``g``/``e`` from ``dout``, GQA group
sums, the state gradients, the fake results, the empty marker of an absent optional result).

Each backend gives its kernels as a ``LinearKernels``; the arithmetic around them is here once, so
both backends give the same composition (and the same rounding) for the same call.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional

import torch
from torch import Tensor

from .._call import needs_grad

EMPTY = (0,)            # the shape that marks an absent optional result of a custom op


def expand(x: Tensor, H: int) -> Tensor:
    """Per-key-head state ``(B, Hkv, ...)`` -> per query head ``(B, H, ...)``."""
    B, Hkv = x.shape[:2]
    return x[:, :, None].expand(B, Hkv, H // Hkv, *x.shape[2:]).reshape(B, H, *x.shape[2:])


class LinearKernels(NamedTuple):
    """A backend's linear-attention ops (all states fp32; ``S (B, Hkv, F, Dv)``, ``z (B, Hkv, F)``).

    ``kv_state(k, v, fmap, *extra) -> (S, z)``: sums over all keys.
    ``apply(q, S, z, S0, z0, fmap, normalize, eps, out_dtype, *extra) -> (out, den)``.
    ``causal_fwd(q, k, v, S0, z0, shift, fmap, normalize, eps, *extra) -> (out, den, S, z)``.
    ``step(q, k, v, S0, z0, fmap, normalize, eps) -> (out, S, z)``: one token, no autograd.
    ``extra`` are the backend's own trailing arguments (``run``'s)."""
    kv_state: Callable
    apply: Callable
    causal_fwd: Callable
    step: Callable


def step_reasons(call) -> List[str]:
    """Why the one-token step kernel (rows ``triton/linear-step``, ``cuda/linear-step``: O(F x Dv) per
    head, no autograd) does not take a call: empty when it does (``Lq = Lk = 1``, no gradient wanted)."""
    if call.q.shape[2] != 1 or call.k.shape[2] != 1:
        return [f"not one token (Lq={call.q.shape[2]}, Lk={call.k.shape[2]})"]
    state = call.initial_state or ()
    if needs_grad(call.q, call.k, call.v, *state):
        return ["gradients needed: inputs require grad (the step kernel has no backward)"]
    if not torch.is_grad_enabled():
        return []
    if call.feature_map_name == "callable":
        return ["a callable feature map may hold parameters that want gradients (no_grad decoding takes the step)"]
    if any(t.requires_grad for t in getattr(call.phi, "parameters", lambda: [])()):
        return ["gradients needed: the FAVOR+ projection requires grad"]
    return []


def run_step(call, q: Tensor, k: Tensor, fmap: int, ops: LinearKernels):
    """``(out, (S, z) or None)`` of a one-token call through the step kernel (features ``q``, ``k``
    as in `run`)."""
    v = call.v
    B, H = q.shape[:2]
    if call.initial_state is not None:
        S0, z0 = (t.to(torch.float32) for t in call.initial_state)
    else:
        S0 = q.new_zeros(B, H, q.shape[3], v.shape[3], dtype=torch.float32)
        z0 = q.new_zeros(B, H, q.shape[3], dtype=torch.float32)
    out, S, z = ops.step(q, k, v, S0, z0, fmap, call.normalize, call.eps)
    return out.to(call.q.dtype), ((S, z) if call.return_state else None)


def run(call, q: Tensor, k: Tensor, fmap: int, ops: LinearKernels, *extra):
    """``(out, (S, z) or None)`` of a ``LinearCall`` with features ``q``, ``k`` (the raw inputs for a
    fused ``fmap``). Composition (``off = Lk - Lq``, bottom-right alignment): causal keys ``[0, off)``
    are seen by every query, so their sums join ``initial_state`` as the base state and the chunked
    pass runs the rest shifted by ``min(off, 0)``; non-causal is one reduction and one output pass."""
    v = call.v
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    S0 = z0 = None
    if call.initial_state is not None:
        S0, z0 = (t.to(torch.float32) for t in call.initial_state)
    if not call.causal:
        S_c, z_c = ops.kv_state(k, v, fmap, *extra)
        out, _ = ops.apply(q, S_c, z_c, S0, z0, fmap, call.normalize, call.eps, v.dtype, *extra)
        base_s, base_z = S0, z0
    else:
        off = Lk - Lq
        base_s, base_z = S0, z0
        if off > 0:                                    # keys every query sees: a base state
            S_pre, z_pre = ops.kv_state(k[:, :, :off], v[:, :, :off], fmap, *extra)
            if base_s is None:
                base_s, base_z = S_pre, z_pre
            else:
                base_s, base_z = base_s + expand(S_pre, H), base_z + expand(z_pre, H)
            k, v = k[:, :, off:], v[:, :, off:]
        out, _, S_c, z_c = ops.causal_fwd(q, k, v, base_s, base_z, min(off, 0), fmap, call.normalize, call.eps,
                                          *extra)
    if not call.return_state:
        return out.to(call.q.dtype), None
    S, z = expand(S_c, H), expand(z_c, H)
    if base_s is not None:
        S, z = S + expand(base_s, H), z + expand(base_z, H)
    return out.to(call.q.dtype), (S, z)


# ------------------------------------------------------------------------ autograd pieces

def out_grads(dout: Tensor, out: Tensor, den: Tensor, normalize: bool):
    """``g = dout / den`` ``(B, H, L, Dv)`` and ``e = -(g . out)`` ``(B*H, L)`` fp32 (``g = dout`` and ``e``
    None without normalize). bf16 calls round g to bf16 in every product that reads it: it is stored
    so (half the traffic); else fp32."""
    if not normalize:
        return dout, None
    d = den.view(out.shape[:3])[..., None]
    g = torch.where(d == 0, 0.0, dout.float() / torch.where(d == 0, 1.0, d))
    e = -(g * out.float()).sum(-1).reshape(-1, out.shape[2]).contiguous()
    return (g.to(torch.bfloat16) if dout.dtype == torch.bfloat16 else g), e


def group_sum(x: Tensor, B: int, Hs: int) -> Tensor:
    """Per-query-head sums ``(B*H, ...)`` -> per ``Hs`` heads ``(B, Hs, ...)`` (each group summed in order)."""
    if x.shape[0] == B * Hs:
        return x.view(B, Hs, *x.shape[1:])
    return x.reshape(B, Hs, -1, *x.shape[1:]).sum(2)


def state_grads(dS: Tensor, dz: Optional[Tensor], S: Optional[Tensor], z: Optional[Tensor], normalize: bool,
                q: Tensor):
    """The gradients of a state ``S (B, Hs, F, Dv)``, ``z (B, Hs, F)`` from per-query-head sums ``dS
    (B*H, F, Dv)``, ``dz (B*H, F)`` (None without normalize: z then gets zeros); the empty marker for an
    absent S or z."""
    B = q.shape[0]
    gs = group_sum(dS, B, S.shape[1]) if S is not None else q.new_empty(EMPTY)
    gz = q.new_empty(EMPTY)
    if z is not None:
        gz = group_sum(dz, B, z.shape[1]) if normalize else torch.zeros_like(z)
    return gs, gz


def apply_state_grads(dS: Tensor, dz: Optional[Tensor], S: Tensor, z: Tensor, base_s: Optional[Tensor],
                      base_z: Optional[Tensor], normalize: bool, q: Tensor):
    """The gradients of the non-causal output pass's two states, ``(S, z)`` (the keys' sums) and the
    base ``(base_s, base_z)``: both enter every query's sums, so both get the same per-query-head
    sums. A custom op may not return two views of one tensor (when ``S`` has H heads its group sum is a
    view of ``dS``), so the base's gradients are copies when they would alias the first pair's."""
    gs, gz = state_grads(dS, dz, S, z, normalize, q)
    bs, bz = state_grads(dS, dz, base_s, base_z, normalize, q)
    bs = bs.clone() if bs.numel() and bs.data_ptr() == gs.data_ptr() else bs
    bz = bz.clone() if bz.numel() and gz.numel() and bz.data_ptr() == gz.data_ptr() else bz
    return gs, gz, bs, bz


def empty_den(den: Optional[Tensor], q: Tensor) -> Tensor:
    """``den`` or, when there is none (no normalize), the empty marker."""
    return den if den is not None and den.numel() else q.new_empty(EMPTY, dtype=torch.float32)


def opt(x: Tensor) -> Optional[Tensor]:
    """The empty marker -> None (the gradient of an absent optional input)."""
    return None if x.numel() == 0 and x.shape == EMPTY else x


def like_or_empty(x: Optional[Tensor], q: Tensor) -> Tensor:
    return torch.empty_like(x) if x is not None else q.new_empty(EMPTY)


def zero_state_grads(k: Tensor, v: Tensor, dS: Optional[Tensor], dz: Optional[Tensor]):
    """Zeros for final-state gradients autograd left undefined (the state was not used)."""
    B, Hkv, _, F = k.shape
    dS = dS if dS is not None else k.new_zeros(B, Hkv, F, v.shape[3], dtype=torch.float32)
    dz = dz if dz is not None else k.new_zeros(B, Hkv, F, dtype=torch.float32)
    return dS, dz


# ------------------------------------------------------------------------ fake results

def causal_fwd_fake(q, k, v, normalize):
    B, H, Lq, F = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    den = q.new_empty((B * H, Lq) if normalize else EMPTY, dtype=torch.float32)
    return (q.new_empty(B, H, Lq, Dv, dtype=v.dtype), den, q.new_empty(B, Hkv, F, Dv, dtype=torch.float32),
            q.new_empty(B, Hkv, F, dtype=torch.float32))


def causal_bwd_fake(q, k, v, base_s, base_z):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), like_or_empty(base_s, q),
            like_or_empty(base_z, q))


def kv_state_fake(k, v):
    B, Hkv, _, F = k.shape
    return k.new_empty(B, Hkv, F, v.shape[3], dtype=torch.float32), k.new_empty(B, Hkv, F, dtype=torch.float32)


def apply_fake(q, S, normalize, out_dtype):
    B, H, Lq, _ = q.shape
    den = q.new_empty((B * H, Lq) if normalize else EMPTY, dtype=torch.float32)
    return q.new_empty(B, H, Lq, S.shape[3], dtype=out_dtype), den


def apply_bwd_fake(q, S, z, base_s, base_z):
    return (torch.empty_like(q), torch.empty_like(S), torch.empty_like(z), like_or_empty(base_s, q),
            like_or_empty(base_z, q))


def step_fake(q, v, S, z):
    return q.new_empty(q.shape[0], q.shape[1], 1, v.shape[3], dtype=v.dtype), torch.empty_like(S), torch.empty_like(z)
