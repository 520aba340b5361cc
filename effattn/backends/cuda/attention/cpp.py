"""The C++ attention ops of csrc/binding/ (``effattn_cuda::attention_fwd`` / ``_bwd`` /
``_bwd_score`` / ``_fwd_sm90`` on CUDA tensors, ``effattn_cuda_emu::...`` on CPU tensors through the
emulation) with their fake (meta) kernels, registered on first use. `ops` (the torch ops and the
row ``cuda/prefill``) and `score` (the score terms) both call them through `kernels`."""
from __future__ import annotations

import torch

from .. import _ext
from .tiling import BLOCK_M


def _register_fakes(ns: str) -> None:
    def fwd_fake(q, k, v, key_padding_mask, layout, layout_block, layout_check, lists, list_wf, seed, scale,
                 dropout_p, window_left, window_right, softcap=0.0, alibi=None, sinks=None, cu_seqlens_q=None,
                 cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, q_offset=None, out_fp32=False, rel=None,
                 rel_max=0, rel_bidir=True, span_z=None, span_ramp=1.0, bias=None, drop_at=None):
        B, H, Lq, _ = q.shape
        return (q.new_empty(B, H, Lq, v.shape[-1], dtype=torch.float32 if out_fp32 else q.dtype),
                q.new_empty(B, H, Lq, dtype=torch.float32))

    torch.library.register_fake(f"{ns}::attention_fwd")(fwd_fake)
    torch.library.register_fake(f"{ns}::attention_fwd_sm90")(fwd_fake)

    @torch.library.register_fake(f"{ns}::attention_bwd")
    def _(grad_out, grad_lse, q, k, v, *args):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    @torch.library.register_fake(f"{ns}::attention_bwd_score")
    def _(grad_out, grad_lse, q, k, v, out, lse, key_padding_mask, layout, layout_block, layout_check, lists, list_wf,
          lists_by_key, listk_wf, seed, scale, dropout_p, window_left, window_right, softcap, alibi, sinks, alibi_grad,
          rel=None, rel_max=0, rel_bidir=True, span_z=None, span_ramp=1.0, bias=None, bias_grad=False, q_offset=None,
          drop_at=None, fused=False):
        B, H, Lq = q.shape[:3]
        Lk, n_mt, f32 = k.shape[2], -(-Lq // BLOCK_M), torch.float32
        width = (2 * rel_max + 1 if rel_bidir else rel_max + 1) if rel is not None else 0
        return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
                q.new_empty(B if alibi_grad else 0, H, n_mt, dtype=f32),
                q.new_empty(B if rel is not None else 0, H, n_mt, width, dtype=f32),
                q.new_empty(B if span_z is not None else 0, H, n_mt, dtype=f32),
                q.new_empty(B if bias_grad else 0, H, Lq if bias_grad else 0, Lk if bias_grad else 0, dtype=f32))


_FAKES_DONE = set()


def kernels(device: torch.device):
    """The C++ op namespace for `device`, its fake kernels registered once."""
    ns = "effattn_cuda" if device.type == "cuda" else "effattn_cuda_emu"
    if ns not in _FAKES_DONE:
        _register_fakes(ns)
        _FAKES_DONE.add(ns)
    return _ext.ops(device)
