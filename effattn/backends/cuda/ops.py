"""torch.library ops of the CUDA backend.

Two levels:

- the C++ ops of csrc/binding/ (``effattn_cuda::attention_fwd`` / ``_bwd`` on CUDA tensors,
  ``effattn_cuda_emu::...`` on CPU tensors through the emulation): kernels only, the tile plan
  passed in as tensors. Their fake (meta) kernels are registered here.
- ``effattn::cuda_attention_fwd`` / ``_bwd``: what the backend calls. They build the layout's tile
  lists (the Triton backend's plan, cached per layout) and call the C++ op; opaque to
  torch.compile, with fake kernels and the autograd formula.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..base import attention_autograd
from ...tiles import layout_tile_lists  # the shared tile plan (packed full/partial lists)
from . import _ext, hopper

BLOCK_M = 64          # query rows per tile, every pass (csrc/attention/attention.h: kBlockM)
BUCKETS = (32, 64, 128, 256)


def bucket(D: int, Dv: int) -> int:
    """The head-dim bucket the kernels are compiled for: max(D, Dv) rounded up to 8, then to a bucket."""
    d = max(-(-D // 8) * 8, -(-Dv // 8) * 8)
    return next(b for b in BUCKETS if d <= b)


def tiles(D: int, Dv: int, by_key: bool) -> Tuple[int, int]:
    """(query tile, key tile) of the forward and dQ passes, or with `by_key` of the dK/dV pass
    (csrc/attention/attention.h; FwdConfig / BwdConfig)."""
    hd = bucket(D, Dv)
    if by_key:
        return (32 if hd >= 128 else 64), 64
    return BLOCK_M, (32 if hd >= 256 else 64)


def _norm_window(left: int, right: int, Lq: int, Lk: int) -> Tuple[int, int]:
    """A window wider than the sequences is no constraint (the C++ ops take only the normalized
    window: they check it)."""
    return (-1 if left >= max(Lk - 1, 0) else left), (-1 if right >= max(Lq - 1, 0) else right)


def _plan(q, k, v, layout_mask, layout_block, left, right, by_key):
    """(lists, wf, layout_check) for a layout; (None, 0, 0) without one."""
    if layout_mask is None:
        return None, 0, 0
    Lq, Lk = q.shape[2], k.shape[2]
    left, right = _norm_window(left, right, Lq, Lk)
    bm, bn = tiles(q.shape[3], v.shape[3], by_key)
    lists, wf = layout_tile_lists(layout_mask, layout_block, Lq, Lk, bm, bn, left, right, by_key)
    # partial tiles read the layout per element unless every pass's tiles nest in its blocks
    return lists, wf, int(layout_block % BLOCK_M != 0)


def _register_fakes(ns: str) -> None:
    def fwd_fake(q, k, v, key_padding_mask, layout, layout_block, layout_check, lists, list_wf, seed, scale,
                 dropout_p, window_left, window_right):
        B, H, Lq, _ = q.shape
        return q.new_empty(B, H, Lq, v.shape[-1]), q.new_empty(B, H, Lq, dtype=torch.float32)

    torch.library.register_fake(f"{ns}::attention_fwd")(fwd_fake)
    torch.library.register_fake(f"{ns}::attention_fwd_sm90")(fwd_fake)

    @torch.library.register_fake(f"{ns}::attention_bwd")
    def _(grad_out, grad_lse, q, k, v, *args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_FAKES_DONE = set()


def kernels(device: torch.device):
    """The C++ op namespace for `device`, its fake kernels registered once."""
    ns = "effattn_cuda" if device.type == "cuda" else "effattn_cuda_emu"
    if ns not in _FAKES_DONE:
        _register_fakes(ns)
        _FAKES_DONE.add(ns)
    return _ext.ops(device)


@torch.library.custom_op("effattn::cuda_attention_fwd", mutates_args=())
def cuda_attention_fwd(q: Tensor, k: Tensor, v: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                       key_padding_mask: Optional[Tensor], seed: Optional[Tensor], scale: float, dropout_p: float,
                       window_left: int, window_right: int) -> Tuple[Tensor, Tensor]:
    lists, wf, check = _plan(q, k, v, layout_mask, layout_block, window_left, window_right, by_key=False)
    # the Hopper forward reads the same plan (same tiles: 64 query rows, 64 keys at buckets 64 / 128)
    kops = kernels(q.device)
    fwd = kops.attention_fwd if hopper.why_not(q, v) else kops.attention_fwd_sm90
    return fwd(q, k, v, key_padding_mask, layout_mask, layout_block, check, lists, wf, seed, scale, dropout_p,
               *_norm_window(window_left, window_right, q.shape[2], k.shape[2]))


@cuda_attention_fwd.register_fake
def _(q, k, v, layout_mask, layout_block, key_padding_mask, seed, scale, dropout_p, window_left, window_right):
    B, H, Lq, _ = q.shape
    return q.new_empty(B, H, Lq, v.shape[-1]), q.new_empty(B, H, Lq, dtype=torch.float32)


@torch.library.custom_op("effattn::cuda_attention_bwd", mutates_args=())
def cuda_attention_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                       key_padding_mask: Optional[Tensor], seed: Optional[Tensor], scale: float, dropout_p: float,
                       window_left: int, window_right: int) -> Tuple[Tensor, Tensor, Tensor]:
    lists, wf, check = _plan(q, k, v, layout_mask, layout_block, window_left, window_right, by_key=False)
    klists, kwf, _ = _plan(q, k, v, layout_mask, layout_block, window_left, window_right, by_key=True)
    return kernels(q.device).attention_bwd(grad_out, grad_lse, q, k, v, out, lse, key_padding_mask, layout_mask,
                                           layout_block, check, lists, wf, klists, kwf, seed, scale, dropout_p,
                                           *_norm_window(window_left, window_right, q.shape[2], k.shape[2]))


@cuda_attention_bwd.register_fake
def _(grad_out, grad_lse, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_setup_context, _backward = attention_autograd(cuda_attention_bwd)
cuda_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
