"""Score terms of a softmax-attention call (``softcap``, ``sinks``, ``bias``): their validation, the
feature names a backend declares for them, and the torch reference that defines their math.

Order of operations (docs/conventions.md, "Scores"), with ``d = pos(i) - j`` and
``pos(i) = i + Lk - Lq``::

    s = scale * q_i . k_j
    s = softcap * tanh(s / softcap)                 softcap
    s = s + sum of the bias terms at (b, h, d)       bias
    s = -inf where (i, j) is not visible            causal, window, layout, padding
    lse = log(sum_j exp(s) + exp(sinks[h]))          sinks (the sink term only with sinks)
    out = sum_j exp(s - lse) v_j

The reference (`ScoreAttention`) walks blocks of query rows over the key range they may see, like
the torch backend's chunked reference, so its memory is O(rows x keys) per block; its backward
recomputes the probabilities from the saved lse and reduces the gradient of the biased scores
``dT = P o (dP - Delta)`` to every term's tensors block by block, in a fixed order (deterministic).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import bias as _bias
from .numerics import tile_keep
from .visibility import Rule, seen_keys

# Elements of one (B, H, rows, keys) score block; a handful of those live at once in the backward.
SCORE_BUDGET = 1 << 22
# Rows per block at most: blocks of a causal or windowed call then compute little beyond the visible
# keys, and each block's temporaries stay small (at L = 1024, H = 8 on one CPU thread, 128-row blocks
# took about half the time of 512-row ones, forward and backward).
ROWS_MAX = 128


@dataclass(frozen=True, eq=False)
class ScoreTerms:
    """The validated score terms of a call: one field of `AttnCall` (``call.score``). Their feature
    names (`features`) are ``base.SCORE_FEATURES``; a backend declares those it serves."""
    softcap: Optional[float]
    sinks: Optional[Tensor]                 # (H,)
    terms: Tuple                            # effattn.bias terms, summed

    def features(self):
        f = {t.feature for t in self.terms}
        if self.softcap is not None:
            f.add("softcap")
        if self.sinks is not None:
            f.add("sinks")
        return f

    def tensors(self) -> Tuple[Tensor, ...]:
        """Every tensor of the terms, sinks first (the inputs whose gradients the backward returns)."""
        ts = (self.sinks,) if self.sinks is not None else ()
        for t in self.terms:
            ts += t.params()
        return ts

    def with_tensors(self, tensors) -> "ScoreTerms":
        """The same terms over other tensors (the ones an autograd function sees), in `tensors()` order."""
        it = iter(tensors)
        sinks = next(it) if self.sinks is not None else None
        terms = tuple(t.with_params(*[next(it) for _ in t.params()]) for t in self.terms)
        return ScoreTerms(self.softcap, sinks, terms)

    def horizon(self, future: bool = False) -> Optional[int]:
        """Keys at a distance >= this are invisible to every head (adaptive span), or None; with
        ``future``, keys at a distance <= minus this (a bidirectional span)."""
        hs = [t.horizon for t in self.terms if isinstance(t, _bias.Span) and (t.bidirectional or not future)]
        return min(hs) if hs else None


def make_score_terms(fn: str, q: Tensor, k: Tensor, softcap=None, sinks=None, bias=None) -> Optional[ScoreTerms]:
    """Validates ``softcap``, ``sinks`` and ``bias`` of a call with q (B, H, Lq, D), k (B, Hkv, Lk, D);
    None when none is given. Errors name the argument."""
    if softcap is None and sinks is None and bias is None:
        return None
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"{fn}: softcap must be a float > 0 or None, got {softcap!r}")
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"{fn}: softcap must be a finite float > 0, got {softcap!r}")
        softcap = float(softcap)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"{fn}: sinks must be a (H,) floating-point tensor, got {type(sinks).__name__}")
        if not sinks.is_floating_point():
            raise TypeError(f"{fn}: sinks must be a floating-point tensor, got {sinks.dtype}")
        if tuple(sinks.shape) != (H,):
            raise ValueError(f"{fn}: sinks must have shape (H,)=({H},), one logit per query head, got "
                             f"{tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"{fn}: sinks is on {sinks.device}, q on {q.device}")
    terms = ()
    if bias is not None:
        items = list(bias) if isinstance(bias, (list, tuple)) else [bias]
        if not items:
            raise ValueError(f"{fn}: bias is an empty list; pass None for no bias")
        for x in items:
            if isinstance(x, torch.Tensor):
                x = _bias.Dense(x)
            elif not isinstance(x, (_bias.ALiBi, _bias.Relative, _bias.Span, _bias.Dense)):
                raise TypeError(f"{fn}: bias must be a tensor, an effattn.bias term (ALiBi, Relative, Span) or a "
                                f"list of them, got {type(x).__name__}")
            x.validate(fn, B, H, Lq, Lk, q.device)
            terms += (x,)
    return ScoreTerms(softcap, sinks, terms)


def several_of_a_kind(score: ScoreTerms, kinds, who: str):
    """Reasons for a backend whose kernels take at most one bias term of each of `kinds`: one per kind
    given more than once (``who``: the kernels, as the reason names them)."""
    why = []
    for kind in kinds:
        n = sum(isinstance(t, kind) for t in score.terms)
        if n > 1:
            why.append(f"{n} bias terms of kind {kind.__name__} ({who} take one of each; sum them first)")
    return why


def dense_values(bias, B: int, H: int, Lq: int, Lk: int, device) -> Tensor:
    """The sum of the bias terms ``bias`` (as `attention` takes them) at every (query, key): float32
    ``(B or 1, H or 1, Lq, Lk)``, ``-inf`` where a span hides a key. For dense paths (O(Lq x Lk))."""
    q = torch.empty(B, H, Lq, 0, device=device)
    score = make_score_terms("attention", q, torch.empty(B, H, Lk, 0, device=device), bias=bias)
    d = torch.arange(Lk - Lq, Lk, device=device)[:, None] - torch.arange(Lk, device=device)[None, :]
    total = torch.zeros((), device=device)
    for term in score.terms:
        total = total + term.values(d, (Lk - Lq, 0, Lq, 0, Lk), torch.float32)
    return total


# ------------------------------------------------------------------------------------ the reference

def _chunk_rows(B: int, H: int, Lq: int, Lk: int) -> int:
    return min(max(16, SCORE_BUDGET // max(1, B * H * max(Lk, 1))), max(Lq, 1), ROWS_MAX)


def span_left(left: int, score: ScoreTerms, future: bool = False) -> int:
    """The call's left window bound tightened to the span's horizon (keys beyond it are invisible to
    every head), so that blocks and tiles beyond it are skipped; with ``future``, the right bound
    (a bidirectional span's horizon on the other side)."""
    hz = score.horizon(future)
    if hz is not None:
        left = hz - 1 if left < 0 else min(left, hz - 1)
    return left


def _rule(Lq, Lk, left, right, layout_mask, layout_block, score: ScoreTerms, q_offset=None) -> Rule:
    return Rule(Lq, Lk, span_left(left, score), span_left(right, score, future=True), layout_mask, layout_block,
                q_offset=q_offset)


def _blocks(q, k, layout_mask, layout_block, kpm, scale, left, right, score: ScoreTerms, segments=None):
    """For each block of query rows with a visible key: (block, distances, tanh of the soft-capped
    scores or None, final scores with the terms and -inf where invisible, grouped queries, keys,
    seen). ``block = (d0, i0, i1, k0, k1)``: rows [i0, i1), keys [k0, k1) of the call's tensors, d0
    the distance of (i0, k0). With a mask, ``seen`` (`seen_keys`) marks the keys some row of the block
    sees; the others' K rows are zeroed before the product (and the callers zero their V rows), so
    that whatever an ignored key holds (NaN, inf in padding) gives 0 * 0 and a finite tanh, never 0 *
    NaN; else None. ``segments``: the call's work list ``(q0, q1, k0, k1, q_offset)`` (packed
    sequences, positions: `effattn.packed`), each segment walked under its own rule with its
    segment-local distances ``d = (i - q0 + q_offset) - (j - k0)``; None: the call, bottom-right.
    Forward and backward walk the same blocks."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = H // Hkv
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    for sq0, sq1, sk0, sk1, off in segments if segments is not None else ((0, Lq, 0, Lk, Lk - Lq),):
        # a layout and a key padding mask come only with one segment over the whole call (effattn.packed)
        rule = _rule(sq1 - sq0, sk1 - sk0, left, right, layout_mask, layout_block, score, q_offset=off)
        rows = _chunk_rows(B, H, sq1 - sq0, sk1 - sk0)
        for r0 in range(0, sq1 - sq0, rows):
            r1 = min(r0 + rows, sq1 - sq0)
            c0, c1 = rule.key_range(r0, r1)
            if c1 <= c0:
                continue
            yield _block(q, k, kpm, scale, score, rule, (r0, r1, c0, c1), (sq0, sk0, off), G, cdt)


def _block(q, k, kpm, scale, score: ScoreTerms, rule: Rule, local, at, G: int, cdt):
    """One block of `_blocks`: rows ``[r0, r1)`` against keys ``[c0, c1)`` of the segment that starts
    at row ``sq0``, key ``sk0`` with offset ``off`` (``local``, ``at``)."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    (r0, r1, c0, c1), (sq0, sk0, off) = local, at
    i0, i1, k0, k1 = r0 + sq0, r1 + sq0, c0 + sk0, c1 + sk0
    qc = q[:, :, i0:i1].to(cdt).reshape(B, Hkv, G * (i1 - i0), D)
    kc = k[:, :, k0:k1].to(cdt)
    mask = rule.materialize((r0, r1), torch.arange(c0, c1, device=q.device), key_padding_mask=kpm)
    seen = None
    if mask is not None:
        seen = seen_keys(mask, Hkv)
        kc = torch.where(seen, kc, 0.0)
    raw = torch.matmul(qc, kc.transpose(-1, -2)).mul_(scale).view(B, H, i1 - i0, k1 - k0)
    block = (r0 + off - c0, i0, i1, k0, k1)
    d = (torch.arange(r0 + off, r1 + off, device=q.device)[:, None]
         - torch.arange(c0, c1, device=q.device)[None, :])
    t = None
    s = raw                                              # a fresh tensor: the terms add in place
    if score.softcap is not None:
        t = torch.tanh(raw / score.softcap)
        s = t * score.softcap
    for term in score.terms:
        s.add_(term.values(d, block, cdt))
    if mask is not None:
        s.masked_fill_(~mask, -math.inf)
    return block, d, t, s, qc, kc, seen


def _values(v: Tensor, k0: int, k1: int, seen: Optional[Tensor], cdt) -> Tensor:
    """The block's values in the compute dtype, zero where no row of the block sees the key."""
    vc = v[:, :, k0:k1].to(cdt)
    return vc if seen is None else torch.where(seen, vc, 0.0)


def _keep(seed: Tensor, p: float, block, B: int, H: int, drop_at, device) -> Tensor:
    """Dropout keep-mask (B, H, rows, keys) of one block (`effattn.numerics.tile_keep`: per pair, not
    per block), so the backward regenerates the forward's; at the rows, keys and heads moved by
    ``drop_at`` (`AttnCall.drop_at`: a context-parallel chunk's positions and head shard; packed
    calls draw at the packed rows, as the plain rows do; None: the call's own)."""
    _, i0, i1, k0, k1 = block
    q0, c0, h0, hg = drop_at if drop_at is not None else (0, 0, 0, H)
    return tile_keep(seed, p, B, H, (i0 + q0, i1 + q0), (k0 + c0, k1 + c0), heads=(h0, hg), device=device)


def _grouped(x: Tensor, Hkv: int) -> Tensor:
    B, H, r, n = x.shape
    return x.reshape(B, Hkv, (H // Hkv) * r, n)


def score_forward(q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right,
                  score: ScoreTerms, segments=None, out_dtype=None, drop_at=None):
    """(out, lse); ``segments``, ``out_dtype`` (an fp32 output), ``drop_at``: `AttnCall`'s fields."""
    B, H, Lq, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, H, Lq, Dv, dtype=out_dtype or q.dtype, device=q.device)
    if score.sinks is not None:          # a row that sees no key: lse = its sink logit
        lse = score.sinks.detach().to(cdt)[None, :, None].expand(B, H, Lq).clone()
        sink = score.sinks.detach().to(cdt)[None, :, None, None]
    else:
        lse = torch.full((B, H, Lq), -math.inf, dtype=cdt, device=q.device)
        sink = None
    for block, _, _, s, _, _, seen in _blocks(q, k, layout_mask, layout_block, kpm, scale, left, right, score,
                                              segments):
        _, i0, i1, k0, k1 = block
        m = s.amax(-1, keepdim=True)
        if sink is not None:
            m = torch.maximum(m, sink)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)           # no finite score: exp(-inf) = 0
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        if sink is not None:
            l = l + torch.exp(sink - m)
        lse[:, :, i0:i1] = (m + torch.log(l)).squeeze(-1)
        p = p / torch.where(l > 0, l, torch.ones_like(l))
        if dropout_p > 0:
            p = p * _keep(seed, dropout_p, block, B, H, drop_at, q.device) / (1.0 - dropout_p)
        o = torch.matmul(_grouped(p, Hkv), _values(v, k0, k1, seen, cdt))
        out[:, :, i0:i1] = o.view(B, H, i1 - i0, Dv).to(out.dtype)
    return out, lse


def backward_setup(grad_out, grad_lse, q, k, v, out, lse):
    """What a chunked backward starts from: (compute dtype, dq zeros in q's dtype, dk / dv zeros in
    the compute dtype, Delta = rowsum(dO * O) - dlse, lse in the compute dtype, lse with -inf rows
    at 0). A gradient into lse enters as dS += dlse * P, i.e. as -dlse in Delta."""
    B, H, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(B, H, Lq, D, dtype=q.dtype, device=q.device)
    dk = torch.zeros(B, Hkv, Lk, D, dtype=cdt, device=q.device)
    dv = torch.zeros(B, Hkv, Lk, Dv, dtype=cdt, device=q.device)
    delta = (grad_out.to(cdt) * out.to(cdt)).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(cdt)
    lse = lse.to(cdt)
    return cdt, dq, dk, dv, delta, lse, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def score_backward(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, kpm, seed, scale,
                   dropout_p, left, right, score: ScoreTerms, segments=None, out_dtype=None, drop_at=None):
    """(dq, dk, dv, *gradients of score.tensors()), the last in float32 (float64 for float64 inputs)
    before the cast to each tensor's dtype; the blocks (segments in their work list's order) add to
    the terms' buffers in a fixed order."""
    B, H, Lq, D = q.shape
    Hkv = k.shape[1]
    cdt, dq, dk, dv, delta, lse, lse_safe = backward_setup(grad_out, grad_lse, q, k, v, out, lse)
    grads = []
    if score.sinks is not None:
        # d lse_i / d sink = exp(sink - lse_i); d L / d lse_i = -Delta_i (via out) + dlse_i
        psink = torch.exp(score.sinks.detach().to(cdt)[None, :, None] - lse)
        grads.append(-(psink * delta).sum((0, 2)))
    bufs = []
    for t in score.terms:
        bufs.append([torch.zeros(p.shape, dtype=cdt, device=q.device) if not isinstance(t, _bias.Dense)
                     else torch.zeros(t._full().shape, dtype=cdt, device=q.device) for p in t.params()])
    for block, d, tanh, s, qc, kc, seen in _blocks(q, k, layout_mask, layout_block, kpm, scale, left, right, score,
                                                   segments):
        _, i0, i1, k0, k1 = block
        p = torch.exp(s - lse_safe[:, :, i0:i1, None])
        do = grad_out[:, :, i0:i1].to(cdt)
        vc = _values(v, k0, k1, seen, cdt)
        dp = torch.matmul(_grouped(do, Hkv), vc.transpose(-1, -2)).view_as(p)
        if dropout_p > 0:
            keep = _keep(seed, dropout_p, block, B, H, drop_at, q.device).to(cdt) / (1.0 - dropout_p)
            pd, dp = p * keep, dp * keep
        else:
            pd = p
        dv[:, :, k0:k1] += torch.matmul(_grouped(pd, Hkv).transpose(-1, -2), _grouped(do, Hkv))
        dT = p * (dp - delta[:, :, i0:i1, None])                 # gradient of the biased scores
        for t, buf in zip(score.terms, bufs):
            for b_, g in zip(buf, t.grads(dT, d, block, cdt)):
                if isinstance(g, tuple):                         # a dense bias: its block of the tensor
                    rows, keys, g = g
                    b_[:, :, rows, keys] += g
                else:
                    b_ += g
        ds = dT if tanh is None else dT * (1 - tanh * tanh)     # d(c tanh(x / c)) / dx = 1 - tanh^2
        dsg = _grouped(ds, Hkv)
        dq[:, :, i0:i1] = (torch.matmul(dsg, kc) * scale).view(B, H, i1 - i0, D).to(q.dtype)
        dk[:, :, k0:k1] += torch.matmul(dsg.transpose(-1, -2), qc) * scale
    for t, buf in zip(score.terms, bufs):
        for p, b_ in zip(t.params(), buf):
            grads.append(b_.reshape(p.shape) if isinstance(t, _bias.Dense) else b_)
    params = score.tensors()
    return (dq, dk.to(k.dtype), dv.to(v.dtype), *[g.to(p.dtype) for g, p in zip(grads, params)])


class ScoreAttention(torch.autograd.Function):
    """A call with score terms as an autograd function: inputs (static, q, k, v, *score.tensors())
    with ``static = (impl, args)``, ``args`` the call's other arguments by name (``layout_mask``,
    ``layout_block``, ``kpm``, ``seed``, ``scale``, ``dropout_p``, ``left``, ``right``, ``score``);
    ``impl.forward(q, k, v, **args)`` gives (out, lse) and ``impl.backward(grad_out, grad_lse, q, k, v,
    out, lse, **args)`` (dq, dk, dv, *the tensors' gradients). Returns (out, lse). The torch
    reference is one impl (`Reference`), the Triton kernels another."""

    @staticmethod
    def forward(ctx, static, q, k, v, *tensors):
        impl, args = static
        args = dict(args, score=args["score"].with_tensors([t.detach() for t in tensors]))
        out, lse = impl.forward(q, k, v, **args)
        ctx.impl, ctx.args = impl, args
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        args = dict(ctx.args, score=ctx.args["score"].with_tensors(tensors))
        gs = ctx.impl.backward(grad_out.contiguous(), grad_lse, q, k, v, out, lse, **args)
        return (None, *gs)


class Reference:
    """The torch reference as an implementation of `ScoreAttention`."""
    forward = staticmethod(score_forward)
    backward = staticmethod(score_backward)


def work_args(call) -> dict:
    """The packed / positioned arguments an implementation of `ScoreAttention` receives beside the
    call's masks: ``segments`` (the work list, `effattn.packed`; None: the whole call, bottom-right),
    ``out_dtype`` (fp32 partial outputs) and ``drop_at`` (`AttnCall.drop_at`; None: the call's own)."""
    at = call.drop_at()
    return dict(segments=None if call.segments is None else tuple(call.segments), out_dtype=call.out_dtype,
                drop_at=None if call.dropout_p == 0 or at == (0, 0, 0, call.H) else at)


def run(call, impl=Reference):
    """(out, lse) of a call with score terms on `impl`; differentiable in q, k, v and every term's
    tensors."""
    lay = call.layout
    args = dict(layout_mask=lay.mask if lay is not None else None, layout_block=lay.block_size if lay is not None else 0,
                kpm=call.key_padding_mask, seed=call.seed, scale=call.scale, dropout_p=call.dropout_p,
                left=call.window_left, right=call.window_right, score=call.score, **work_args(call))
    return ScoreAttention.apply((impl, args), call.q, call.k, call.v, *call.score.tensors())
