"""The CUDA backend's score terms (csrc/attention/common.cuh: ``score_log2``, ``bias_terms``): softcap,
attention sinks, ALiBi slopes, a relative table, adaptive span and a dense bias tensor in the forward
and the backward, served by the row ``cuda/prefill`` through `effattn.score.ScoreAttention` with the
implementation `Kernels`.

- softcap: ``s -> c tanh(s / c)`` after the scale, in the tile; the backward multiplies the gradient
  of the capped scores by ``1 - tanh^2``.
- ALiBi: ``-slope[b, h] * |pos(i) - j|`` added in the tile; several ALiBi terms are one slope (their
  sum). The slopes' gradient ``-sum dT |d|`` is reduced by the dQ kernel: one fp32 partial per
  (b, h, query tile), written by one block, summed here over tiles in a fixed order.
- sinks: one logit per head in each row's normalizer (applied when the row's output is stored); a row
  that sees no key outputs 0 with lse = its sink. Their gradient ``-sum_i exp(sink - lse_i) Delta_i``
  is computed here from lse and Delta = rowsum(dO O) - dlse.
- relative table, adaptive span, dense bias (the "bias tensors"): evaluated by kernel instances
  compiled with them (csrc/attention/terms.cu; calls without them run kernels without their code).
  The table's gradient: each dQ block sums each tile's dT along its diagonals and adds the sums of
  the diagonals that clamp to an entry to its own (b, h, query tile) slot of that entry; the span's:
  one partial of ``dT / ratio`` on the ramp per (b, h, query tile), divided by the ramp here; the
  dense bias's: dT itself, written by the dQ block that owns the rows (zero where no tile is
  visited), summed here over the broadcast dimensions. Adaptive span skips, per head, the key tiles
  beyond ``z[h] + ramp`` (the kernels tighten the window's left bound to it), and every head the
  tiles beyond the call's horizon (``max_span + ramp``, folded into the window here).
  The Hopper forward takes none of the bias tensors: such calls run on the mma.sync forward
  (`hopper.why_not` says so in `explain`).

No atomics: results and every gradient are bitwise the same on every run. One term of each bias
kind per call (several ALiBi terms are summed); `reasons` names what is not served."""
from __future__ import annotations

from typing import List

import torch

from .... import bias as _bias
from ....score import several_of_a_kind, span_left
from ....visibility import clamp_window
from . import backward as bwd_path
from . import hopper
from .cpp import kernels
from .tiling import layout_lists

FEATURES = frozenset({"softcap", "sinks", "bias=alibi", "bias=relative", "bias=span", "bias=dense"})
_ONE_EACH = (_bias.Relative, _bias.Span, _bias.Dense)


def reasons(call) -> List[str]:
    """Why the CUDA score-terms kernels cannot serve `call` (beyond the declared features)."""
    if call.score is None:
        return []
    why = several_of_a_kind(call.score, _ONE_EACH, "the CUDA kernels")
    if call.cu_seqlens is not None:
        why.append("score terms with packed sequences (cu_seqlens): the CUDA kernels' parameter-gradient partials "
                   "are per (batch, head, query tile), not per segment (torch/score and triton/score serve the call)")
    if any(isinstance(t, _bias.Span) and t.bidirectional for t in call.score.terms):
        why.append("a bidirectional adaptive span (the CUDA kernels bound the span on the past side only; "
                   "the Triton and torch backends serve it)")
    return why


def has_bias_tensors(score) -> bool:
    """Whether the terms include a relative table, a span or a dense bias (the Hopper forward takes none)."""
    return any(isinstance(t, _ONE_EACH) for t in score.terms)


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


def _term(score, kind):
    return next((t for t in score.terms if isinstance(t, kind)), None)


def _tensor_args(score) -> dict:
    """The bias tensors' keyword arguments of the C++ ops (rel, rel_max, rel_bidir, span_z, span_ramp,
    bias), detached."""
    args = {}
    rel, span, dense = (_term(score, k) for k in _ONE_EACH)
    if rel is not None:
        args.update(rel=rel.table.detach(), rel_max=rel.max_distance, rel_bidir=rel.bidirectional)
    if span is not None:
        args.update(span_z=span.z.detach(), span_ramp=float(span.ramp))
    if dense is not None:
        args.update(bias=dense._full().detach())
    return args


def _args(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, by_key, score,
          segments=None, drop_at=None, sm90=False) -> dict:
    """The C++ ops' mask, plan and scalar arguments by their schema's names (csrc/binding/attention.cpp);
    ``by_key``: with the backward's tile lists by key. ``segments``: None or the one segment of a call
    with positions / an fp32 output (its offset: ``q_offset``; `reasons` refuses packed sequences);
    ``drop_at``: where dropout draws (`AttnCall.drop_at`); ``sm90``: the forward's plan for the Hopper kernel's
    tiles."""
    left = span_left(left, score)                 # keys beyond every head's span: tiles skipped
    lists, wf, check = layout_lists(q, k, v, layout_mask, layout_block, left, right, by_key=False, hopper=sm90,
                                    tma=sm90 and hopper.tma_why_not(q, k, v) is None)
    q_offset = None if segments is None else segments[0][4]
    window_left, window_right = clamp_window(left, right, q.shape[2], k.shape[2], q_offset)
    args = dict(key_padding_mask=kpm, layout=layout_mask, layout_block=layout_block, layout_check=check, lists=lists,
                list_wf=wf, seed=seed, scale=scale, dropout_p=dropout_p, window_left=window_left,
                window_right=window_right, q_offset=q_offset, drop_at=None if drop_at is None else list(drop_at))
    if by_key:
        args["lists_by_key"], args["listk_wf"], _ = layout_lists(q, k, v, layout_mask, layout_block, left, right,
                                                                by_key=True)
    return args


def forward(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, score, segments=None,
            out_dtype=None, drop_at=None):
    kops = kernels(q.device)
    sm90 = hopper.why_not(q, v, terms=has_bias_tensors(score)) is None
    fwd = kops.attention_fwd_sm90 if sm90 else kops.attention_fwd
    return fwd(q, k, v, **_args(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, False,
                                score, segments, drop_at, sm90),
               out_fp32=out_dtype is not None, softcap=score.softcap or 0.0, alibi=_slopes(score),
               sinks=None if score.sinks is None else score.sinks.detach().float(), **_tensor_args(score))


def backward(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, kpm, seed, scale, dropout_p, left,
             right, score, segments=None, out_dtype=None, drop_at=None):
    """(dq, dk, dv, *gradients of score.tensors()); None for a dense bias that does not require grad."""
    slopes = _slopes(score)
    # a slope gradient is computed whenever there are slopes (autograd asks for every input's): one
    # multiply-add per visible score in the dQ pass
    alibi_grad = slopes is not None
    dense = _term(score, _bias.Dense)
    bias_grad = dense is not None and dense.tensor.requires_grad       # dT is (B, H, Lq, Lk): only if wanted
    sinks = None if score.sinks is None else score.sinks.detach().float()
    fused = bwd_path.why_not(q, v, layout_mask is not None, alibi_grad, has_bias_tensors(score)) is None
    dq, dk, dv, part, drel, dspan, dbias = kernels(q.device).attention_bwd_score(
        grad_out, grad_lse, q, k, v, out, lse,
        **_args(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, True, score, segments,
                drop_at),
        softcap=score.softcap or 0.0, alibi=slopes, sinks=sinks, alibi_grad=alibi_grad, **_tensor_args(score),
        bias_grad=bias_grad, fused=fused)
    grads = []
    if sinks is not None:
        delta = (grad_out.float() * out.float()).sum(-1)
        if grad_lse is not None:
            delta = delta - grad_lse.float()
        grads.append(-(torch.exp(sinks[None, :, None] - lse) * delta).sum((0, 2)))
    for t in score.terms:                                          # the partials: tiles, then batch, in order
        if isinstance(t, _bias.ALiBi):
            grads.append(_bias._reduce_like(-part.sum(2), t.slopes.shape))
        elif isinstance(t, _bias.Relative):
            g = drel.sum(2).sum(0)                                 # (H, width)
            if t.table.shape[1] > t.width:
                g = torch.nn.functional.pad(g, (0, t.table.shape[1] - t.width))
            grads.append(g)
        elif isinstance(t, _bias.Span):
            grads.append(dspan.sum(2).sum(0) / t.ramp)
        elif bias_grad:
            full = t._full()
            dims = tuple(a for a in range(4) if full.shape[a] == 1 and dbias.shape[a] != 1)
            grads.append((dbias.sum(dims, keepdim=True) if dims else dbias).reshape(t.tensor.shape))
        else:
            grads.append(None)
    params = score.tensors()
    return (dq, dk, dv, *[None if x is None else x.to(p.dtype) for x, p in zip(grads, params)])


def describe(call) -> str:
    what = "score terms (" + ", ".join(sorted(call.score.features())) + ") evaluated in the tile after the scale"
    if has_bias_tensors(call.score):
        what += " (the kernel instances with bias tensors)"
    return what + "; " + hopper.describe(call, terms=has_bias_tensors(call.score))


class Kernels:
    """The CUDA kernels as an implementation of `effattn.score.ScoreAttention`."""
    forward = staticmethod(forward)
    backward = staticmethod(backward)
