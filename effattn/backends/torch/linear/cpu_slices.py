"""The torch backend's path ``torch/linear-cpu-slices``: the reference's math (reference.py), run on
independent slices of the call (key/value heads, or batch entries) in parallel, one intra-op thread
per slice (see threads.py for why many-op code needs this to scale with threads).

The backward recomputes each slice's forward with autograd on and differentiates it in the same
worker, so the backward is as parallel as the forward (at the price of one extra forward, about a
third of the backward's work). Feature maps whose gradient could reach parameters (a user's
callable; FAVOR+ features with a projection that requires grad) stay on the reference, where
autograd sees the whole computation, as does tracing by torch.compile.
"""
from __future__ import annotations

from typing import List

import torch

from ...._call import LINEAR
from ....numerics import compute_dtype
from ...base import FEATURES, Capabilities, Path, register
from .. import threads
from .reference import DTYPES, linear_attention_reference


def _admits(call) -> List[str]:
    """Why the slice-parallel path leaves a call it declares to serve to the reference."""
    if call.feature_map_name == "favor" and any(t.requires_grad for t in getattr(call.phi, "parameters", lambda: [])()):
        return ["the FAVOR+ projection requires grad: autograd must see the whole computation"]
    if torch.compiler.is_compiling():
        return ["traced by torch.compile"]
    if min(call.q.shape) == 0 or min(call.k.shape) == 0:
        return ["an empty shape"]
    if min(torch.get_num_threads(), max(call.k.shape[0], call.k.shape[1])) <= 1:
        # nothing to run in parallel, and the reference's backward needs no recomputed forward
        return ["one thread, or one key/value head and batch entry: nothing to split"]
    return []


def _slice_math(call, q, k, v, S0, z0):
    """out, S, z of one slice, through the reference's math."""
    dt = compute_dtype(call.q.dtype)
    fq, fk = call.phi(q.to(dt)), call.phi(k.to(dt))
    init = None if S0 is None else (S0, z0)
    return linear_attention_reference(fq.to(dt), fk.to(dt), v.to(dt), causal=call.causal,
                                      normalize=call.normalize, eps=call.eps, initial_state=init)


def _parts(by_heads, a, b, G, q, k, v, S0, z0):
    def cut(t, per_q):
        if t is None:
            return None
        if not by_heads:
            return t[a:b]
        m = G if per_q else 1
        return t[:, a * m:b * m]
    return cut(q, True), cut(k, False), cut(v, False), cut(S0, True), cut(z0, True)


class _SliceParallel(torch.autograd.Function):
    """``math(call, q, k, v, S0, z0) -> (out, S or None, z or None)`` on each slice in parallel."""
    @staticmethod
    def forward(ctx, call, math, q, k, v, S0, z0):
        B, Hkv = k.shape[0], k.shape[1]
        G = q.shape[1] // Hkv
        by_heads = Hkv >= B
        slices = threads.ranges(Hkv if by_heads else B, torch.get_num_threads())
        res = threads.run_slices(lambda a, b: math(call, *_parts(by_heads, a, b, G, q, k, v, S0, z0)), slices)
        dim = 1 if by_heads else 0
        out, S, z = (None if res[0][i] is None else torch.cat([r[i] for r in res], dim) for i in range(3))
        ctx.call, ctx.math, ctx.by_heads, ctx.slices, ctx.G = call, math, by_heads, slices, G
        ctx.save_for_backward(q, k, v, S0, z0)
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), S, z

    @staticmethod
    def backward(ctx, g_out, g_S, g_z):
        q, k, v, S0, z0 = ctx.saved_tensors
        call, by_heads, G = ctx.call, ctx.by_heads, ctx.G
        want = [t is not None and t.requires_grad for t in (q, k, v, S0, z0)]

        def one(a, b):
            leaves = [None if t is None else t.detach().requires_grad_(w)
                      for t, w in zip(_parts(by_heads, a, b, G, q, k, v, S0, z0), want)]
            outs = ctx.math(call, *leaves)
            grads_in = _parts(by_heads, a, b, G, g_out, None, None, g_S, g_z)
            pairs = [(o, g) for o, g in zip(outs, (grads_in[0], grads_in[3], grads_in[4])) if g is not None]
            inputs = [t for t, w in zip(leaves, want) if w]
            if not pairs or not inputs:
                return [None] * 5
            got = iter(torch.autograd.grad([o for o, _ in pairs], inputs, [g.to(o.dtype) for o, g in pairs],
                                           allow_unused=True))
            return [next(got) if w else None for w in want]

        res = threads.run_slices(one, ctx.slices, grad=True)
        dim = 1 if by_heads else 0
        grads = []
        for i, t in enumerate((q, k, v, S0, z0)):
            if not want[i]:
                grads.append(None)
                continue
            gs = [r[i] if r[i] is not None else torch.zeros_like(p) for r, p in
                  zip(res, [_parts(by_heads, a, b, G, q, k, v, S0, z0)[i] for a, b in ctx.slices])]
            grads.append(torch.cat(gs, dim).to(t.dtype))
        return (None, None, *grads)


def run_slices(call, math=_slice_math):
    """``(out, S, z)`` of a call, ``math`` (`_SliceParallel`'s) run on its slices in parallel."""
    S0, z0 = call.initial_state if call.initial_state is not None else (None, None)
    return _SliceParallel.apply(call, math, call.q, call.k, call.v, S0, z0)


def run(call):
    """(out, (S, z) or None) of a LinearCall this path admits."""
    out, S, z = run_slices(call)
    return out, ((S, z) if call.return_state else None)


# a callable feature map may hold parameters, so autograd must see the whole computation: the
# reference serves it (the declaration leaves feature_map=callable out)
PATH = register(Path(
    backend="torch", op=LINEAR, name="torch/linear-cpu-slices", priority=95,
    caps=Capabilities(devices=frozenset({"cpu"}), dtypes=DTYPES, features=FEATURES[LINEAR] - {"feature_map=callable"}),
    run=run, admits=_admits,
    describe=lambda call: "the reference's chunked math, key/value heads (or batch entries) in parallel on all threads"))
