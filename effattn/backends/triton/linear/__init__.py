"""The Triton backend for linear attention: chunked causal and non-causal kernels, forward and
backward, with the named feature maps fused and a one-token decoding step.

Layers: ``kernels.py`` (two jit kernels, the chunk-state pass and the output pass, plus the step
kernel), ``launch.py`` (operands, configs, allocation), ``ops.py`` (``torch.library`` ops, fake impls,
the backward as five launches of the same two kernels), and here the composition of a call and its
registration as backend ``"triton"``.

A call is composed as follows (``off = Lk - Lq``, bottom-right alignment):

- causal: keys ``[0, off)`` (when ``off > 0``) are seen by every query: their sums are one
  non-causal reduction added to ``initial_state`` as the base state; the rest is the chunked form
  (intra-chunk masked product + inter-chunk state) with keys shifted by ``min(off, 0)`` on the
  query timeline. Memory: the per-chunk states, ``(L / 64) x F x Dv`` per key head (as fla's
  ``chunk_h``), never an ``(L, F, Dv)`` tensor; the backward recomputes them.
- non-causal: one reduction for ``(S, z)`` per key head, split over the sequence when the heads
  alone would not fill the GPU (partial sums added in a fixed order), then one output pass.
- ``Lq = Lk = 1`` without gradients (decoding with ``KVCache``): the step kernel, O(F x Dv) per head,
  its own row ``triton/linear-step`` (the chunked passes are the row ``triton/linear``).

Feature maps: ``elu`` (elu + 1), ``relu`` and ``identity`` are applied inside the kernels on each
loaded tile (and their derivative in the backward's epilogue). FAVOR+ and any other callable are
applied in torch (fp32, through autograd, so a trainable projection gets its gradient) and the
kernels take the features: FAVOR+ is a (D x F) matmul plus exp per row, which cuBLAS already does at
full speed; fusing it into the passes would redo it in every pass that reads the features (the
forward reads phi(k) twice, the backward phi(q) and phi(k) three times each). ``explain`` says so.
Whether fusing would pay is for the GPU to say: the share of a ``linear-favor256`` benchmark call
spent in the torch feature map (time ``FavorFeatures(q)`` and ``(k)`` beside the call) is the most
a fused projection could save.
"""
from __future__ import annotations

import torch

from ...._call import LINEAR, linear_features
from ....feature_maps import FMAP_IDENTITY, KERNEL_MAPS
from ....numerics import compute_dtype
from ...base import FEATURES, Capabilities, Path, register
from ...linear_common import LinearKernels, run, run_step, step_reasons
from ..runtime import _available, _tf32_enabled, triton
from .launch import map_once

if triton is not None:
    from .ops import triton_linear_apply, triton_linear_causal_fwd, triton_linear_kv_state, triton_linear_step


def _features(call):
    """(q, k, fmap code): the raw inputs for a fused map, else the features computed in torch."""
    q, k = call.q, call.k
    fmap = KERNEL_MAPS.get(call.feature_map_name)
    if fmap is None:                                   # FAVOR+ / a callable: features in torch
        q, k = linear_features(call, compute_dtype(call.q.dtype))
        if call.q.dtype == torch.bfloat16:             # the kernels round them to bf16 anyway; fp16 keeps
            q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)  # fp32 (features can exceed its range)
        fmap = FMAP_IDENTITY                           # the features as they are
    return q, k, fmap


def _ops() -> LinearKernels:
    # the ops are looked up per call (tests replace them with spies)
    return LinearKernels(triton_linear_kv_state, triton_linear_apply, triton_linear_causal_fwd, triton_linear_step)


def _run(call):
    tf32 = call.q.dtype == torch.float32 and _tf32_enabled()
    return run(call, *_features(call), _ops(), tf32)


def _run_step(call):
    return run_step(call, *_features(call), _ops())


def _note(call) -> str:
    name = call.feature_map_name
    if name == "identity":
        return "feature map 'identity' fused into the kernels"
    if name in ("elu", "relu"):
        if map_once(call.q.dtype, call.q.shape[-1]):
            return (f"feature map {name!r} fused into the kernels: a map kernel applies it once per token (q and "
                    "k in one launch), the passes read the mapped features")
        return (f"feature map {name!r} fused into the kernels: applied in the passes to each tile they load "
                f"(fewer instructions than a map kernel for {str(call.q.dtype)[6:]} at {call.q.shape[-1]} "
                "features, offline sm_90 model)")
    what = "FAVOR+ features" if name == "favor" else "the callable feature map"
    return (f"{what} computed in torch (fp32, autograd) and fed to the kernels; the kernels fuse only "
            "'elu', 'relu' and 'identity'")


_COMMON = dict(backend="triton", op=LINEAR,
               caps=Capabilities(devices=frozenset({"cuda", "cpu"}),
                                 dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
                                 max_head_dim=256, features=FEATURES[LINEAR], min_compute_capability=(8, 0)),
               available=_available, notes=lambda call: [_note(call)], explicit_only_devices=frozenset({"cpu"}))

STEP = register(Path(name="triton/linear-step", priority=9, run=_run_step, admits=step_reasons, **_COMMON))
BACKEND = register(Path(name="triton/linear", priority=10, run=_run, **_COMMON))
