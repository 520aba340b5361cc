"""Reversible residual layers (RevNet, Gomez et al. 2017; Reformer): `ReversibleSequence`.

Each block is a pair ``(f, g)`` acting on two streams::

    y1 = x1 + f(x2)          x2 = y2 - g(y1)
    y2 = x2 + g(y1)          x1 = y1 - f(x2)        (the inverse, run in the backward)

The forward runs without autograd and keeps only the last block's outputs; the backward walks the
blocks in reverse, rebuilds each block's inputs from its outputs and re-runs ``f`` and ``g`` under
autograd one block at a time. Activation memory therefore does not grow with depth.

Exact recomputation: ``f`` and ``g`` are re-run with the random state they saw in the forward (torch's
CPU generator and, for CUDA inputs, the device's), so dropout (and any hashing drawn from the default
generator) replays exactly. A module may also record what must not be recomputed from the rebuilt
inputs, which equal the originals only up to rounding: a submodule with a ``reversible_record``
attribute (a list or None) appends tensors to it during the forward, and finds them again in
``reversible_replay`` (a list it pops from the front) during the recomputation.
`effattn.nn.LSHSelfAttention` records its hash buckets this way, since an argmax of rebuilt inputs
could flip. Recorded tensors are the only per-block state kept (small integer tensors for LSH).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn


class _RandomState:
    """torch's CPU generator state, and the CUDA device's when the inputs are on one."""

    def __init__(self, device: torch.device):
        self.device = device if device.type == "cuda" else None
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if self.device is not None else None

    @contextmanager
    def replay(self):
        devices = [self.device] if self.device is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.device is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def _recorders(module: nn.Module) -> List[nn.Module]:
    return [m for m in module.modules() if hasattr(m, "reversible_record")]


@contextmanager
def _recording(module: nn.Module, log: list):
    """Lets the recorders under ``module`` append to fresh lists; ``log`` receives one list per recorder."""
    recs = _recorders(module)
    for m in recs:
        m.reversible_record = []
    try:
        yield
    finally:
        for m in recs:
            log.append(m.reversible_record)
            m.reversible_record = None


@contextmanager
def _replaying(module: nn.Module, log: list):
    recs = _recorders(module)
    for m, saved in zip(recs, log):
        m.reversible_replay = list(saved)
    try:
        yield
    finally:
        for m in recs:
            m.reversible_replay = None


class _Step:
    """What the backward needs of one call of f or g: the random state and the recorded tensors
    (stored as indices into the Function's saved tensors, so they are saved like any other)."""

    def __init__(self, state: _RandomState):
        self.state = state
        self.log: list = []


def _flatten_logs(steps: List[_Step]) -> Tuple[List[Tensor], list]:
    flat, shapes = [], []
    for st in steps:
        shape = []
        for rec in st.log:
            shape.append(len(rec))
            flat.extend(rec)
        shapes.append(shape)
    return flat, shapes


def _unflatten_logs(steps: List[_Step], flat: Sequence[Tensor], shapes: list) -> None:
    it = iter(flat)
    for st, shape in zip(steps, shapes):
        st.log = [[next(it) for _ in range(n)] for n in shape]


def _run(module: nn.Module, x: Tensor, kwargs: dict, step: _Step, replay: bool) -> Tensor:
    if replay:
        with step.state.replay(), _replaying(module, step.log):
            return module(x, **kwargs)
    with _recording(module, step.log):
        return module(x, **kwargs)


class _ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1, x2, seq, f_kwargs, g_kwargs, *params):
        steps = []
        with torch.no_grad():
            for f, g in zip(seq.f_blocks, seq.g_blocks):
                sf = _Step(_RandomState(x1.device))
                y1 = x1 + _run(f, x2, f_kwargs, sf, replay=False)
                sg = _Step(_RandomState(x1.device))
                y2 = x2 + _run(g, y1, g_kwargs, sg, replay=False)
                steps += [sf, sg]
                x1, x2 = y1, y2
        flat, shapes = _flatten_logs(steps)
        ctx.seq, ctx.f_kwargs, ctx.g_kwargs = seq, f_kwargs, g_kwargs
        ctx.steps, ctx.shapes, ctx.n_params = steps, shapes, len(params)
        for st in steps:
            st.log = None                     # the tensors live in saved_tensors from here on
        ctx.save_for_backward(x1, x2, *flat)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2, *flat = ctx.saved_tensors
        _unflatten_logs(ctx.steps, flat, ctx.shapes)
        seq = ctx.seq
        params = list(seq.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        grads: List[Optional[Tensor]] = [None] * len(params)
        dy1 = torch.zeros_like(y1) if dy1 is None else dy1
        dy2 = torch.zeros_like(y2) if dy2 is None else dy2

        def backprop(module, x, kwargs, step, dout):
            """Re-runs module on x under autograd; returns (its output, the gradient into x) and adds its
            parameters' gradients."""
            mine = [p for p in module.parameters() if p.requires_grad]
            with torch.enable_grad():
                x = x.detach().requires_grad_(True)
                out = _run(module, x, kwargs, step, replay=True)
                got = torch.autograd.grad(out, [x] + mine, dout, allow_unused=True)
            for p, gp in zip(mine, got[1:]):
                if gp is not None:
                    i = index[id(p)]
                    grads[i] = gp if grads[i] is None else grads[i] + gp
            dx = got[0] if got[0] is not None else torch.zeros_like(x)
            return out.detach(), dx

        blocks = list(zip(seq.f_blocks, seq.g_blocks))
        for b in reversed(range(len(blocks))):
            f, g = blocks[b]
            sf, sg = ctx.steps[2 * b], ctx.steps[2 * b + 1]
            gy, d = backprop(g, y1, ctx.g_kwargs, sg, dy2)       # y2 = x2 + g(y1)
            dy1 = dy1 + d
            x2 = y2 - gy
            fx, d = backprop(f, x2, ctx.f_kwargs, sf, dy1)       # y1 = x1 + f(x2)
            dy2 = dy2 + d
            y1, y2 = y1 - fx, x2
        ctx.steps = None
        return (dy1, dy2, None, None, None, *grads)


class ReversibleSequence(nn.Module):
    r"""A stack of reversible blocks ``[(f, g), ...]``: ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``.

    Args:
        blocks: a sequence of ``(f, g)`` pairs of modules mapping a tensor to one of the same shape.

    ``forward(x1, x2=None, f_kwargs=None, g_kwargs=None) -> (y1, y2)``: ``x2`` defaults to ``x1``
    (Reformer duplicates its input); ``f_kwargs`` / ``g_kwargs`` are passed to every ``f`` / ``g``
    (e.g. ``key_padding_mask`` for attention). When autograd is on and something requires grad,
    activations are not stored: the backward rebuilds them block by block (memory flat in depth) with
    the forward's random state, and its gradients equal those of the same blocks run as an ordinary
    residual stack, to rounding. Without autograd it is the plain loop.

    Examples::

        >>> blocks = [(effattn.nn.LSHSelfAttention(64, 4, chunk_len=32), nn.Sequential(
        ...            nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))) for _ in range(6)]
        >>> rev = effattn.nn.ReversibleSequence(blocks)
        >>> y1, y2 = rev(x)                  # x (N, L, 64)
        >>> y = (y1 + y2) / 2
    """

    def __init__(self, blocks: Sequence[Tuple[nn.Module, nn.Module]]):
        super().__init__()
        blocks = list(blocks)
        for i, blk in enumerate(blocks):
            if not (isinstance(blk, (tuple, list)) and len(blk) == 2 and all(isinstance(m, nn.Module) for m in blk)):
                raise TypeError(f"ReversibleSequence: blocks[{i}] must be a pair (f, g) of nn.Modules, got "
                                f"{type(blk).__name__}")
        if not blocks:
            raise ValueError("ReversibleSequence: blocks must hold at least one (f, g) pair")
        self.f_blocks = nn.ModuleList([f for f, _ in blocks])
        self.g_blocks = nn.ModuleList([g for _, g in blocks])

    def __len__(self) -> int:
        return len(self.f_blocks)

    def forward(self, x1: Tensor, x2: Optional[Tensor] = None, f_kwargs: Optional[dict] = None,
                g_kwargs: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
        x2 = x1 if x2 is None else x2
        if x1.shape != x2.shape:
            raise ValueError(f"ReversibleSequence: x1 and x2 must have one shape, got {tuple(x1.shape)} and "
                             f"{tuple(x2.shape)}")
        f_kwargs, g_kwargs = dict(f_kwargs or {}), dict(g_kwargs or {})
        params = list(self.parameters())
        if torch.is_grad_enabled() and (x1.requires_grad or x2.requires_grad or any(p.requires_grad for p in params)):
            return _ReversibleFunction.apply(x1, x2, self, f_kwargs, g_kwargs, *params)
        for f, g in zip(self.f_blocks, self.g_blocks):
            x1 = x1 + f(x2, **f_kwargs)
            x2 = x2 + g(x1, **g_kwargs)
        return x1, x2
