"""Low-level entries for drivers that split one attention call into parts (context parallelism).

``attention_backward`` is the backward of one (query chunk, key chunk) pair against the **global**
output and log-sum-exp of its query rows: with ``P_ij = exp(s_ij - lse_i)`` and
``Delta_i = rowsum(dout_i * out_i)`` taken from the whole row, the pair's gradients are exact parts of
the whole call's gradients (dq sums over key chunks, dk / dv over query chunks).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._call import _fail, make_attn_call
from .backends.torch.attention.reference import attention_backward as reference_backward


def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                       causal: bool = False, window=None, positions=None, cu_seqlens=None, max_seqlen=None,
                       scale: Optional[float] = None, grad_lse: Optional[Tensor] = None, dropout_p: float = 0.0,
                       seed: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of ``attention(q, k, v, causal=..., window=..., positions=...)`` for
    the query rows' global ``out (B, H, Lq, Dv)`` and ``lse (B, H, Lq)`` and ``dout`` (the gradient of
    the global output). Returned in float32 (float64 for float64 inputs), to be summed over the
    parts before any cast. Computed by the torch backend's chunked reference (deterministic).

    With ``dropout_p > 0``, ``seed`` is the forward's dropout seed: the int64 ``(2,)`` tensor that
    `effattn.numerics.draw_seed` returns under the ``torch.manual_seed`` the forward ran under (a call
    draws it first thing). The pair's keep-mask is then the whole call's at the pair's absolute
    ``positions`` (Philox per (b, h, i, j)), replayed here."""
    if dropout_p and seed is None:
        _fail(ValueError, "attention_backward: dropout_p > 0 needs seed, the forward's dropout seed (int64 (2,), "
                          "effattn.numerics.draw_seed under the forward's torch seed)")
    if seed is not None and (not isinstance(seed, Tensor) or seed.dtype != torch.int64 or tuple(seed.shape) != (2,)):
        _fail(TypeError, f"attention_backward: seed must be an int64 tensor of shape (2,), got {seed!r}")
    call = make_attn_call(q, k, v, causal=causal, window=window, scale=scale, positions=positions,
                          cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, dropout_p=dropout_p,
                          seed=seed.cpu() if seed is not None else None)
    B, H, Lq = call.B, call.H, call.Lq
    for name, t, want in (("dout", dout, (B, H, Lq, call.Dv)), ("out", out, (B, H, Lq, call.Dv)),
                          ("lse", lse, (B, H, Lq)), ("grad_lse", grad_lse, (B, H, Lq))):
        if t is None and name == "grad_lse":
            continue
        if not isinstance(t, Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            _fail(ValueError, f"attention_backward: {name} must have shape {want}, got {got}")
        if t.device != q.device:
            _fail(ValueError, f"attention_backward: {name} is on {t.device}, q on {q.device}")
    return reference_backward(dout, grad_lse, q, k, v, out, lse, None, 0, None, call.seed, call.scale, call.dropout_p,
                              call.window_left, call.window_right, segments=call.segments, keep_fp32=True,
                              drop_at=call.drop_at())
