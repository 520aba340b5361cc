"""torch.library ops of the CUDA backend.

Two levels:

- the C++ ops of csrc/binding/ (``effattn_cuda::attention_fwd`` / ``_bwd`` on CUDA tensors,
  ``effattn_cuda_emu::...`` on CPU tensors through the emulation): kernels only, the tile plan
  passed in as tensors; `cpp.kernels` gives their namespace, with their fake (meta) kernels.
- ``effattn::cuda_attention_fwd`` / ``_bwd``: what the backend calls. They build the layout's tile
  lists (the Triton backend's plan, cached per layout) and call the C++ op; opaque to
  torch.compile, with fake kernels and the autograd formula.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .... import score as _score
from ...._call import needs_grad
from ....visibility import clamp_window
from ...autograd import attention_autograd
from ...base import PACKED_FEATURES, Capabilities, Path, register
from .. import _ext, resources
from . import backward as bwd_path
from . import hopper
from . import score as score_path
from .cpp import kernels
from .tiling import bucket, layout_lists


# Packed sequences (cu_seqlens_q / _k, int32 (N + 1,) on q's device, with max_seqlen_q / _k: the longest
# segments, which size the grids; the kernels read the segments' bounds on the device), positions
# (q_offset: query i at key i + q_offset), fp32 outputs (out_fp32) and where dropout draws (drop_at: (q_start,
# k_start, h0, heads), `AttnCall.drop_at`; None: (0, 0, 0, H)) are the ops' last arguments.
@torch.library.custom_op("effattn::cuda_attention_fwd", mutates_args=())
def cuda_attention_fwd(q: Tensor, k: Tensor, v: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                       key_padding_mask: Optional[Tensor], seed: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                       cu_seqlens_k: Optional[Tensor], scale: float, dropout_p: float, window_left: int,
                       window_right: int, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                       q_offset: Optional[int] = None, out_fp32: bool = False,
                       drop_at: Optional[List[int]] = None) -> Tuple[Tensor, Tensor]:
    sm90 = hopper.why_not(q, v, packed=cu_seqlens_q is not None) is None
    # the Hopper forward reads the plan of its own tiles (128 query rows; 128 keys in the TMA kernel, else 64)
    lists, wf, check = layout_lists(q, k, v, layout_mask, layout_block, window_left, window_right, by_key=False,
                                    hopper=sm90, tma=sm90 and hopper.tma_why_not(q, k, v) is None)
    kops = kernels(q.device)
    fwd = kops.attention_fwd_sm90 if sm90 else kops.attention_fwd
    return fwd(q, k, v, key_padding_mask, layout_mask, layout_block, check, lists, wf, seed, scale, dropout_p,
               *clamp_window(window_left, window_right, q.shape[2], k.shape[2], q_offset), cu_seqlens_q=cu_seqlens_q,
               cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, q_offset=q_offset,
               out_fp32=out_fp32, drop_at=drop_at)


@cuda_attention_fwd.register_fake
def _(q, k, v, layout_mask, layout_block, key_padding_mask, seed, cu_seqlens_q, cu_seqlens_k, scale, dropout_p,
      window_left, window_right, max_seqlen_q=0, max_seqlen_k=0, q_offset=None, out_fp32=False, drop_at=None):
    B, H, Lq, _ = q.shape
    return (q.new_empty(B, H, Lq, v.shape[-1], dtype=torch.float32 if out_fp32 else q.dtype),
            q.new_empty(B, H, Lq, dtype=torch.float32))


@torch.library.custom_op("effattn::cuda_attention_bwd", mutates_args=())
def cuda_attention_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                       key_padding_mask: Optional[Tensor], seed: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                       cu_seqlens_k: Optional[Tensor], scale: float, dropout_p: float, window_left: int,
                       window_right: int, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                       q_offset: Optional[int] = None, out_fp32: bool = False,
                       drop_at: Optional[List[int]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The backward of `cuda_attention_fwd` (``out_fp32`` is read from ``out``'s dtype)."""
    lists, wf, check = layout_lists(q, k, v, layout_mask, layout_block, window_left, window_right, by_key=False)
    klists, kwf, _ = layout_lists(q, k, v, layout_mask, layout_block, window_left, window_right, by_key=True)
    fused = bwd_path.why_not(q, v, layout_mask is not None) is None
    sm90 = fused and bwd_path.hopper_why_not(q, v, key_padding_mask is not None, dropout_p,
                                             cu_seqlens_q is not None) is None
    return kernels(q.device).attention_bwd(grad_out, grad_lse, q, k, v, out, lse, key_padding_mask, layout_mask,
                                           layout_block, check, lists, wf, klists, kwf, seed, scale, dropout_p,
                                           *clamp_window(window_left, window_right, q.shape[2], k.shape[2],
                                                         q_offset), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, q_offset, drop_at, fused, sm90)


@cuda_attention_bwd.register_fake
def _(grad_out, grad_lse, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_setup_context, _backward = attention_autograd(cuda_attention_fwd, cuda_attention_bwd)
cuda_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------ the row cuda/prefill

DEVICES = frozenset({"cuda", "cpu"})
DTYPES = frozenset({torch.float16, torch.bfloat16})
FEATURES = frozenset({"causal", "window", "layout", "key_padding_mask", "dropout", "gqa", "lq_ne_lk", "dv_ne_d",
                      "return_lse"}) | score_path.FEATURES | PACKED_FEATURES


def notes(call) -> List[str]:
    """What this backend does besides launching the kernels for a call: copies that align inputs."""
    out = []
    for name, t in (("q", call.q), ("k", call.k), ("v", call.v)):
        if t.numel() and (t.stride(-1) != 1 or t.shape[-1] % 8 or any(s % 8 for s in t.stride()[:3])):
            out.append(f"{name} is copied into zero-padded 16-byte rows (head dim {t.shape[-1]}, strides "
                       f"{tuple(t.stride())})")
    return out


def packed_args(call) -> dict:
    """The packed-sequence / positions / fp32-output arguments of `cuda_attention_fwd` for a call."""
    extra = dict(cu_seqlens_q=None, cu_seqlens_k=None)
    if call.cu_seqlens is not None:
        extra.update(cu_seqlens_q=call.cu_seqlens[0], cu_seqlens_k=call.cu_seqlens[1],
                     max_seqlen_q=call.max_seqlen[0], max_seqlen_k=call.max_seqlen[1])
    if call.positions is not None:
        extra["q_offset"] = call.rule.q_offset
    if call.out_dtype is not None:
        extra["out_fp32"] = True
    if call.dropout_p > 0 and call.drop_at() != (0, 0, 0, call.H):
        extra["drop_at"] = list(call.drop_at())
    return extra


def _run(call):
    kernels(call.q.device)
    if call.score is not None:                     # softcap / sinks / ALiBi: the score-terms composition
        return _score.run(call, score_path.Kernels)
    return cuda_attention_fwd(**call.op_args()._asdict(), **packed_args(call))


def _admits(call) -> List[str]:
    if call.score is not None and score_path.reasons(call):
        return score_path.reasons(call)
    return launch_refusals(call)


def launch_refusals(call) -> List[str]:
    """Why a kernel this call launches (the forward the call gets; the backward passes when inputs
    need gradients) cannot launch on its device (shared memory per block, registers: resources.py)."""
    hopper_fwd = hopper.why_not(call.q, call.v, packed=call.cu_seqlens is not None) is None
    fused = _fused_why_not(call) is None
    needs = resources.prefill_needs(bucket(call.q.shape[-1], call.v.shape[-1]), hopper_fwd,
                                    needs_grad(call.q, call.k, call.v), fused)
    return resources.refusals(needs, resources.device_limits(call.q.device))


def _fused_why_not(call):
    """Why the fused backward does not serve `call` (None: it does)."""
    score = call.score
    return bwd_path.why_not(call.q, call.v, call.layout is not None,
                            score is not None and score_path._slopes(score) is not None,
                            score is not None and score_path.has_bias_tensors(score))


def _describe(call) -> str:
    fwd = score_path.describe(call) if call.score is not None else hopper.describe(call)
    hopper_why = bwd_path.hopper_why_not(call.q, call.v, call.key_padding_mask is not None, call.dropout_p,
                                         call.cu_seqlens is not None, call.score is not None)
    return fwd + "; " + bwd_path.describe(_fused_why_not(call), hopper_why)


# after Triton for "auto" until the GPU acceptance run has measured these kernels
PATH = register(Path(
    backend="cuda", op="attention", name="cuda/prefill", priority=20,
    caps=Capabilities(devices=DEVICES, dtypes=DTYPES, max_head_dim=256, features=FEATURES),
    run=_run, admits=_admits, available=_ext.available, notes=notes, describe=_describe,
    # on CPU this is the emulation: a test vehicle, only when named
    explicit_only_devices=frozenset({"cpu"})))
