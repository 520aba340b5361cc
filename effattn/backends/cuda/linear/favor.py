"""FAVOR+ features as a CUDA prologue (csrc/linear/step.cuh, ``lin_favor_kernel``): the forward of
:class:`effattn.FavorFeatures` in one kernel, the backward in torch.

``phi(x)_i = exp(min(u_i, cap)) / sqrt(F)``, ``u_i = w_i . x' - |x'|^2 / 2``, ``x' = sqrt(scale) x``;
with ``t = dphi * phi`` (zero where the cap acts): ``dx' = t W - x' sum_i t_i`` and ``dW = t^T x'``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ....feature_maps import FAVOR_MAX_EXPONENT, FavorFeatures
from .._ext import ops as kernels


@torch.library.custom_op("effattn::cuda_favor_features", mutates_args=())
def cuda_favor_features(x: Tensor, projection: Tensor, scale: float) -> Tensor:
    """``(B, H, L, D)`` -> ``(B, H, L, F)`` fp32 features."""
    return kernels(x.device).linear_favor(x, projection, scale, FAVOR_MAX_EXPONENT)


@cuda_favor_features.register_fake
def _(x, projection, scale):
    return x.new_empty(*x.shape[:3], projection.shape[0], dtype=torch.float32)


def _setup(ctx, inputs, output):
    x, projection, scale = inputs
    ctx.save_for_backward(x, projection, output)
    ctx.scale = scale


def _backward(ctx, dphi):
    x, w, phi = ctx.saved_tensors
    xs = x.float() * math.sqrt(ctx.scale)
    wf = w.float()
    u = xs @ wf.T - 0.5 * (xs * xs).sum(-1, keepdim=True)
    t = torch.where(u <= FAVOR_MAX_EXPONENT, dphi * phi, 0.0)
    dx = (t @ wf - xs * t.sum(-1, keepdim=True)) * math.sqrt(ctx.scale)
    dw = (t.reshape(-1, t.shape[-1]).T @ xs.reshape(-1, xs.shape[-1])).to(w.dtype) if ctx.needs_input_grad[1] else None
    return dx.to(x.dtype), dw, None


cuda_favor_features.register_autograd(_backward, setup_context=_setup)


def favor_features(x: Tensor, phi: FavorFeatures) -> Tensor:
    return cuda_favor_features(x, phi.projection, phi.scale)
