"""The CUDA C++ backend for linear attention: the composition of a call and its registration as
backend ``"cuda"`` of ``linear_attention``.

Layers: the kernels (csrc/linear_state.cuh, linear_out.cuh, linear_step.cuh) -> launchers
(csrc/linear.cu) -> the C++ ops (csrc/binding/) -> the autograd ops (``ops.py``; FAVOR+ features in
``favor.py``) -> here, the rows ``cuda/linear-step`` (one token) and ``cuda/linear``.

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
kernel (csrc/linear/step.cuh) as a prologue, with the backward in torch (a rank-one correction of
a matmul with the projection), then fed to the passes like any features; any other callable runs
in torch. The features are then plain fp32 operands (rounded to bf16 for bf16 calls).
"""
from __future__ import annotations

import torch

from ...._call import LINEAR, linear_features
from ....feature_maps import FMAP_IDENTITY, KERNEL_MAPS, FavorFeatures
from ....numerics import compute_dtype
from ...base import FEATURES, Capabilities, Path, register
from ...linear_common import LinearKernels, run, run_step, step_reasons
from .. import _ext
from .favor import favor_features
from .ops import cuda_linear_apply, cuda_linear_causal_fwd, cuda_linear_kv_state, cuda_linear_step


def _features(call):
    """(q, k, fmap code): the raw inputs for a fused map, else the features (fp32; bf16 for bf16 calls)."""
    fmap = KERNEL_MAPS.get(call.feature_map_name)
    if fmap is not None:
        return call.q, call.k, fmap
    if isinstance(call.phi, FavorFeatures):
        q, k = favor_features(call.q, call.phi), favor_features(call.k, call.phi)
    else:
        q, k = linear_features(call, compute_dtype(call.q.dtype))
    if call.q.dtype == torch.bfloat16:                  # the kernels round them to bf16 anyway
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    return q, k, FMAP_IDENTITY                          # the features as they are


def _step(q, k, v, S0, z0, fmap, normalize, eps):
    # fp16 calls keep torch-computed features in fp32: the step kernel reads one element type
    return cuda_linear_step(q, k, v.to(q.dtype), S0, z0, fmap, normalize, eps)


def _ops() -> LinearKernels:
    # the ops are looked up per call (tests may replace them with spies)
    return LinearKernels(cuda_linear_kv_state, cuda_linear_apply, cuda_linear_causal_fwd, _step)


def _run(call):
    _ext.ops(call.q.device)
    return run(call, *_features(call), _ops())


def _run_step(call):
    _ext.ops(call.q.device)
    return run_step(call, *_features(call), _ops())


def _note(call) -> str:
    name = call.feature_map_name
    if name in KERNEL_MAPS:
        how = f"feature map {name!r} fused into the kernels' loads"
    elif name == "favor":
        how = "FAVOR+ features computed by a CUDA prologue kernel (backward in torch) and fed to the passes"
    else:
        how = ("the callable feature map computed in torch (fp32, autograd) and fed to the kernels; they fuse "
               "only 'elu', 'relu' and 'identity'")
    return how


_COMMON = dict(backend="cuda", op=LINEAR,
               caps=Capabilities(devices=frozenset({"cuda", "cpu"}),
                                 dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
                                 max_head_dim=256, features=FEATURES[LINEAR]),
               available=_ext.available, notes=lambda call: [_note(call)],
               # on CPU this is the emulation: a test vehicle, only when named
               explicit_only_devices=frozenset({"cpu"}))

# after Triton for "auto" until the GPU acceptance run has measured these kernels
STEP = register(Path(name="cuda/linear-step", priority=19, run=_run_step, admits=step_reasons, **_COMMON))
BACKEND = register(Path(name="cuda/linear", priority=20, run=_run, **_COMMON))
