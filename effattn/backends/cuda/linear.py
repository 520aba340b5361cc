"""The CUDA C++ backend for linear attention: the composition of a call and its registration as
backend ``"cuda"`` of ``linear_attention``.

Layers: the kernels (csrc/linear_state.cuh, linear_out.cuh, linear_step.cuh) -> launchers
(csrc/linear.cu) -> the C++ ops (csrc/binding/attention_op.cpp) -> the autograd ops
(``linear_ops.py``) -> here.

A call is composed as follows (``off = Lk - Lq``, bottom-right alignment):

- causal: keys ``[0, off)`` (when ``off > 0``) are seen by every query: their sums are one store-less
  state pass added to ``initial_state`` as the base state; the rest is the chunked form (in-chunk
  masked product + inter-chunk state) with keys at timeline row ``j - min(off, 0)``. Memory: the
  per-chunk states, ``(L / 64) x F x Dv`` fp32 per key head; the backward recomputes them.
- non-causal: one reduction for ``(S, z)`` per key head (split over the sequence when the heads alone
  would not fill the GPU; partial sums added in a fixed order), then one output pass.
- ``Lq = Lk = 1`` without gradients (decoding with ``KVCache``): the step kernel, O(F x Dv) per head.

Feature maps: ``elu`` (elu + 1), ``relu`` and ``identity`` are applied by the kernels on each loaded
element (their derivative in the backward's epilogue). FAVOR+ features are computed by a CUDA
kernel (csrc/linear_step.cuh) as a prologue, with the backward in torch (a rank-one correction of
a matmul with the projection), then fed to the passes like any features; any other callable runs
in torch. The features are then plain fp32 operands (rounded to bf16 for bf16 calls).
"""
from __future__ import annotations

import torch

from ..._call import LINEAR, compute_dtype, linear_features
from ...feature_maps import FavorFeatures
from ..base import FEATURES, Backend, Capabilities, register
from . import _available
from .linear_favor import favor_features
from .linear_ops import (MAPS, cuda_linear_apply, cuda_linear_causal_fwd, cuda_linear_kv_state, cuda_linear_step)


def _expand(x, H):
    """Per-key-head state ``(B, Hkv, ...)`` -> per query head ``(B, H, ...)``."""
    B, Hkv = x.shape[:2]
    return x[:, :, None].expand(B, Hkv, H // Hkv, *x.shape[2:]).reshape(B, H, *x.shape[2:])


def _needs_grad(*ts):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _features(call):
    """(q, k, fmap code): the raw inputs for a fused map, else the features (fp32; bf16 for bf16 calls)."""
    fmap = MAPS.get(call.feature_map_name)
    if fmap is not None:
        return call.q, call.k, fmap
    if isinstance(call.phi, FavorFeatures):
        q, k = favor_features(call.q, call.phi), favor_features(call.k, call.phi)
    else:
        q, k = linear_features(call, compute_dtype(call.q.dtype))
    if call.q.dtype == torch.bfloat16:                  # the kernels round them to bf16 anyway
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    return q, k, 0


def _run(call):
    from .ops import kernels
    kernels(call.q.device)
    q, k, fmap = _features(call)
    v = call.v
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    S0 = z0 = None
    if call.initial_state is not None:
        S0, z0 = (t.to(torch.float32) for t in call.initial_state)
    if Lq == 1 and Lk == 1 and not _needs_grad(q, k, v, S0, z0):
        if S0 is None:
            S0 = q.new_zeros(B, H, q.shape[3], v.shape[3], dtype=torch.float32)
            z0 = q.new_zeros(B, H, q.shape[3], dtype=torch.float32)
        # fp16 calls keep torch-computed features in fp32: the step kernel reads one element type
        out, S, z = cuda_linear_step(q, k, v.to(q.dtype), S0, z0, fmap, call.normalize, call.eps)
        return out.to(call.q.dtype), ((S, z) if call.return_state else None)
    if not call.causal:
        S_c, z_c = cuda_linear_kv_state(k, v, fmap)
        out, _ = cuda_linear_apply(q, S_c, z_c, S0, z0, fmap, call.normalize, call.eps, v.dtype)
        base_s, base_z = S0, z0
    else:
        off = Lk - Lq
        base_s, base_z = S0, z0
        if off > 0:                                    # keys every query sees: a base state
            S_pre, z_pre = cuda_linear_kv_state(k[:, :, :off], v[:, :, :off], fmap)
            if base_s is None:
                base_s, base_z = S_pre, z_pre
            else:
                base_s, base_z = base_s + _expand(S_pre, H), base_z + _expand(z_pre, H)
            k, v = k[:, :, off:], v[:, :, off:]
        out, _, S_c, z_c = cuda_linear_causal_fwd(q, k, v, base_s, base_z, min(off, 0), fmap, call.normalize,
                                                  call.eps)
    if not call.return_state:
        return out.to(call.q.dtype), None
    S, z = _expand(S_c, H), _expand(z_c, H)
    if base_s is not None:
        S, z = S + _expand(base_s, H), z + _expand(base_z, H)
    return out.to(call.q.dtype), (S, z)


def _note(call) -> str:
    name = call.feature_map_name
    if name in MAPS:
        how = f"feature map {name!r} fused into the kernels' loads"
    elif name == "favor":
        how = "FAVOR+ features computed by a CUDA prologue kernel (backward in torch) and fed to the passes"
    else:
        how = ("the callable feature map computed in torch (fp32, autograd) and fed to the kernels; they fuse "
               "only 'elu', 'relu' and 'identity'")
    if call.q.shape[2] == 1 and call.k.shape[2] == 1:
        how += "; one token: the recurrent step kernel when no gradient is needed"
    return how


BACKEND = register(Backend(
    # after Triton for "auto" until the GPU acceptance run has measured these kernels
    name="cuda", op=LINEAR, priority=20,
    caps=Capabilities(devices=frozenset({"cuda", "cpu"}),
                      dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
                      max_head_dim=256, features=FEATURES[LINEAR]),
    run=_run, available=_available, notes=lambda call: [_note(call)],
    # on CPU this is the emulation: a test vehicle, only when named
    explicit_only_devices=frozenset({"cpu"})))
