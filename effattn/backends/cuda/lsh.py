"""The row ``cuda/lsh`` of op ``"lsh_attention"``: the CUDA C++ block-sparse kernels with per-row positions.

`effattn.lsh.sorted_rounds` gathers each round's rows in sorted order (rounds folded into the batch: the kernels
see ``(N, 1, L, D)``, ``N = B * H * n_hashes``) and normalizes the keys in torch; the kernels run the fixed chunk
layout of `effattn.lsh.lsh_layout` (one head, broadcast) through their layout tile lists, which are cached per
layout (the layout is built once per length, chunk length and neighbours, and kept here); `effattn.lsh.unsorted`
gathers the rounds back. What depends on the data is evaluated in the kernels per element from the gathered
positions (``AttnParams::q_pos`` / ``k_pos``: mask kind kAny's forward, the backward passes): key j is hidden
from query i where it is padding (position -1) or, causal, later than i; a query's own key scores the constant
``SELF_SCORE`` (no gradient to q or k through it). Padding also goes to the kernels as the key padding mask, so
a padded key's values never reach a product (NaN-safe).

Forward: the kAny instance (128-row tiles at head dims up to 64 through the layout's 128-row lists, 64 rows at
128). Backward: the two passes (dK/dV over the layout's
by-key lists, dQ over its lists; no atomics, bitwise repeatable); the fused backward takes neither layouts nor
positions.
fp16 / bf16, head dims 33..128, any ``chunk_len``; dropout is refused (``triton/lsh`` and ``torch/lsh`` serve
it).
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor

from ...lsh import FN, SELF_SCORE, cached_lsh_layout, sorted_rounds, unsorted
from ..base import FEATURES, Capabilities, Path, register
from . import _ext, resources
from .attention.cpp import kernels
from .attention.ops import DEVICES, DTYPES
from .attention.tiling import bucket, layout_lists


def layout_mask(L: int, chunk_len: int, offsets: List[int], device) -> Tensor:
    """The mask of the call's chunk layout on `device`: `effattn.lsh.cached_lsh_layout` (one layout per
    length, chunk_len and offsets, its device copy kept), so the tile lists cached on it are built once."""
    return cached_lsh_layout(L, chunk_len, offsets).to(device).mask


class _PositionsAttention(torch.autograd.Function):
    """``(q, k, v) (N, 1, L, *) -> out (N, 1, L, Dv) fp32, lse (N, 1, L)``: the kernels with positions on the
    layout ``mask`` of block ``block``; differentiable in q, k, v (the lse's gradient included)."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, kpm, mask, block, causal, scale):
        lists, wf, check = layout_lists(q, k, v, mask, block, -1, -1, by_key=False)
        out, lse = kernels(q.device).attention_fwd_pos(q, k, v, kpm, mask, block, check, lists, wf, None, scale, 0.0,
                                                       q_pos, k_pos, causal, SELF_SCORE, out_fp32=True)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos, kpm, mask)
        ctx.args = (block, causal, scale, lists, wf, check)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, q_pos, k_pos, kpm, mask = ctx.saved_tensors
        block, causal, scale, lists, wf, check = ctx.args
        klists, kwf, _ = layout_lists(q, k, v, mask, block, -1, -1, by_key=True)
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = kernels(q.device).attention_bwd_pos(dout, dlse, q, k, v, out, lse, kpm, mask, block, check, lists,
                                                         wf, klists, kwf, None, scale, 0.0, q_pos, k_pos, causal,
                                                         SELF_SCORE)
        return dq, dk, dv, None, None, None, None, None, None, None


def positions_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, mask: Tensor, block: int,
                        causal: bool, scale: float, key_padding_mask=None) -> Tuple[Tensor, Tensor]:
    """Block-sparse attention with per-row positions on the CUDA kernels: ``q, k (N, L, D)``, ``v (N, L, Dv)``
    (fp16 / bf16), ``q_pos``, ``k_pos`` int ``(N, L)`` (a key of position < 0 is never seen; causal: nor one
    after the query; a query's own position scores `SELF_SCORE`), the layout ``mask (1, L / block, L / block)``,
    ``key_padding_mask`` bool ``(N, L)`` or None. Returns ``out (N, L, Dv)`` fp32 and ``lse (N, L)``."""
    N, L = q.shape[:2]
    out, lse = _PositionsAttention.apply(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1),
                                         q_pos.to(torch.int32).reshape(N, 1, L).contiguous(),
                                         k_pos.to(torch.int32).reshape(N, 1, L).contiguous(), key_padding_mask,
                                         mask, block, causal, float(scale))
    return out.squeeze(1), lse.squeeze(1)


def run(call) -> Tuple[Tensor, Tensor]:
    """sorted_rounds -> the kernels -> unsorted: ``out (B, H, R, L, Dv)`` fp32, ``lse (B, H, R, L)``."""
    rows = sorted_rounds(call, call.q.dtype)
    mask = layout_mask(call.q.shape[2], call.chunk_len, call.offsets, call.q.device)
    out_s, lse_s = positions_attention(rows.q, rows.k, rows.v, rows.pos, rows.key_positions(), mask, call.chunk_len,
                                       call.causal, call.scale, rows.pad)
    return unsorted(out_s, lse_s, call)


def _needs_grad(call) -> bool:
    return torch.is_grad_enabled() and (call.q.requires_grad or call.v.requires_grad)


def _admits(call) -> List[str]:
    # per-row positions at head dims 33..128 only: at the buckets 32 and 256 the backward passes' registers
    # spill with the rule compiled in (csrc/attention/bwd.cuh, kPosHeadDim)
    hd = max(call.q.shape[-1], call.v.shape[-1])
    if hd <= 32:
        return [f"head dim {hd}: per-row positions are served at head dims 33..128"]
    # the 64-row forward (a layout) and, when q or v needs a gradient, the two backward passes
    needs = resources.prefill_needs(bucket(call.q.shape[-1], call.v.shape[-1]), False, _needs_grad(call))
    return resources.refusals(needs, resources.device_limits(call.q.device))


def _describe(call) -> str:
    check = "" if call.chunk_len % 64 == 0 else \
        f"; chunk_len={call.chunk_len} is not a multiple of the 64-row tiles: partial tiles read the layout per element"
    return ("CUDA C++ block-sparse kernels on the chunk layout (tile lists cached per layout), rounds gathered in "
            "sorted order by torch; causal, padding and the self score evaluated per element from the gathered "
            "positions; backward: dK/dV and dQ passes (deterministic)" + check)


PATH = register(Path(
    backend="cuda", op=FN, name="cuda/lsh", priority=20,
    caps=Capabilities(devices=DEVICES, dtypes=DTYPES, max_head_dim=128, features=FEATURES[FN] - {"dropout"}),
    run=run, admits=_admits, available=_ext.available, describe=_describe,
    explicit_only_devices=frozenset({"cpu"})))
