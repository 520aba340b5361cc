"""The CUDA backend's score terms (csrc/attention/common.cuh: ``score_log2``): softcap, attention sinks
and ALiBi slopes in the forward (mma.sync and Hopper kernels) and the backward, served by the row
``cuda/prefill`` through `effattn.score.ScoreAttention` with the implementation `Kernels`.

- softcap: ``s -> c tanh(s / c)`` after the scale, in the tile; the backward multiplies the gradient
  of the capped scores by ``1 - tanh^2``.
- ALiBi: ``-slope[b, h] * |pos(i) - j|`` added in the tile; several ALiBi terms are one slope (their
  sum). The slopes' gradient ``-sum dT |d|`` is reduced by the dQ kernel: one fp32 partial per
  (b, h, query tile), written by one block, summed here over tiles in a fixed order.
- sinks: one logit per head in each row's normalizer (applied when the row's output is stored); a row
  that sees no key outputs 0 with lse = its sink. Their gradient ``-sum_i exp(sink - lse_i) Delta_i``
  is computed here from lse and Delta = rowsum(dO O) - dlse.

No atomics: results and every gradient are bitwise the same on every run. Relative tables, adaptive
span and dense bias tensors are not in these kernels (the Triton and torch backends serve them;
`explain` names the missing feature)."""
from __future__ import annotations

import torch

from .... import bias as _bias
from ....visibility import clamp_window
from . import hopper
from .cpp import kernels
from .tiling import layout_lists

FEATURES = frozenset({"softcap", "sinks", "bias=alibi"})


def _slopes(score):
    """The ALiBi terms' slopes summed: (H,) or (B, H) fp32, or None."""
    total = None
    for t in score.terms:
        if isinstance(t, _bias.ALiBi):
            s = t.slopes.detach().float()
            if total is None:
                total = s
            else:
                if total.dim() != s.dim():
                    total, s = torch.broadcast_tensors(total, s)
                total = total + s
    return total.contiguous() if total is not None else None


def _args(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, by_key) -> dict:
    """The C++ ops' mask, plan and scalar arguments by their schema's names (csrc/binding/attention.cpp);
    ``by_key``: with the backward's tile lists by key."""
    lists, wf, check = layout_lists(q, k, v, layout_mask, layout_block, left, right, by_key=False)
    window_left, window_right = clamp_window(left, right, q.shape[2], k.shape[2])
    args = dict(key_padding_mask=kpm, layout=layout_mask, layout_block=layout_block, layout_check=check, lists=lists,
                list_wf=wf, seed=seed, scale=scale, dropout_p=dropout_p, window_left=window_left,
                window_right=window_right)
    if by_key:
        args["lists_by_key"], args["listk_wf"], _ = layout_lists(q, k, v, layout_mask, layout_block, left, right,
                                                                by_key=True)
    return args


def forward(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, score):
    kops = kernels(q.device)
    fwd = kops.attention_fwd if hopper.why_not(q, v) else kops.attention_fwd_sm90
    return fwd(q, k, v, **_args(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, False),
               softcap=score.softcap or 0.0, alibi=_slopes(score),
               sinks=None if score.sinks is None else score.sinks.detach().float())


def backward(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, kpm, seed, scale, dropout_p, left,
             right, score):
    """(dq, dk, dv, *gradients of score.tensors())."""
    slopes = _slopes(score)
    # a slope gradient is computed whenever there are slopes (autograd asks for every input's): one
    # multiply-add per visible score in the dQ pass
    alibi_grad = slopes is not None
    sinks = None if score.sinks is None else score.sinks.detach().float()
    dq, dk, dv, part = kernels(q.device).attention_bwd_score(
        grad_out, grad_lse, q, k, v, out, lse,
        **_args(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, True),
        softcap=score.softcap or 0.0, alibi=slopes, sinks=sinks, alibi_grad=alibi_grad)
    grads = []
    if sinks is not None:
        delta = (grad_out.float() * out.float()).sum(-1)
        if grad_lse is not None:
            delta = delta - grad_lse.float()
        grads.append(-(torch.exp(sinks[None, :, None] - lse) * delta).sum((0, 2)))
    if slopes is not None:
        g = -part.sum(2)                                           # (B, H): tiles in a fixed order
        grads += [_bias._reduce_like(g, t.slopes.shape) for t in score.terms]
    params = score.tensors()
    return (dq, dk, dv, *[x.to(p.dtype) for x, p in zip(grads, params)])


def describe(call) -> str:
    return ("score terms (" + ", ".join(sorted(call.score.features())) + ") evaluated in the tile after the scale; "
            + hopper.describe(call))


class Kernels:
    """The CUDA kernels as an implementation of `effattn.score.ScoreAttention`."""
    forward = staticmethod(forward)
    backward = staticmethod(backward)
