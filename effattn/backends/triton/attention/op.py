"""The Triton attention backend as torch ops: ``effattn::triton_attention_fwd`` / ``_bwd``
(``torch.library`` custom ops, opaque to torch.compile) with fake impls and an autograd formula, and
its registration as backend ``"triton"``."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ...base import FEATURES, Backend, Capabilities, register
from ..runtime import _available, _tf32_enabled, triton

if triton is not None:
    from . import decode, launch

if triton is not None:

    @torch.library.custom_op("effattn::triton_attention_fwd", mutates_args=())
    def triton_attention_fwd(q: Tensor, k: Tensor, v: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                             key_padding_mask: Optional[Tensor], seed: Optional[Tensor], scale: float,
                             dropout_p: float, window_left: int, window_right: int,
                             allow_tf32: bool = False) -> Tuple[Tensor, Tensor]:
        return launch.fwd(q, k, v, layout_mask, layout_block, key_padding_mask, seed, scale, dropout_p,
                          window_left, window_right, allow_tf32)

    @triton_attention_fwd.register_fake
    def _(q, k, v, layout_mask, layout_block, key_padding_mask, seed, scale, dropout_p, window_left,
          window_right, allow_tf32=False):
        B, H, Lq, _ = q.shape
        return q.new_empty(B, H, Lq, v.shape[-1]), q.new_empty(B, H, Lq, dtype=torch.float32)

    @torch.library.custom_op("effattn::triton_attention_bwd", mutates_args=())
    def triton_attention_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                             out: Tensor, lse: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                             key_padding_mask: Optional[Tensor], seed: Optional[Tensor], scale: float,
                             dropout_p: float, window_left: int, window_right: int,
                             allow_tf32: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
        return launch.bwd(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, key_padding_mask, seed,
                    scale, dropout_p, window_left, window_right, allow_tf32)

    @triton_attention_bwd.register_fake
    def _(grad_out, grad_lse, q, k, v, *args):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def _setup_context(ctx, inputs, output):
        q, k, v, layout_mask, layout_block, kpm, seed, scale, dropout_p, left, right, tf32 = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, layout_mask, kpm, seed)
        ctx.static = (layout_block, scale, dropout_p, left, right, tf32)   # tf32: the forward's, not re-read

    def _backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, layout_mask, kpm, seed = ctx.saved_tensors
        layout_block, scale, dropout_p, left, right, tf32 = ctx.static
        dq, dk, dv = triton_attention_bwd(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, kpm,
                                          seed, scale, dropout_p, left, right, tf32)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None

    triton_attention_fwd.register_autograd(_backward, setup_context=_setup_context)

    @torch.library.custom_op("effattn::triton_attention_decode", mutates_args=())
    def triton_attention_decode(q: Tensor, k: Tensor, v: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                                key_padding_mask: Optional[Tensor], scale: float, window_left: int,
                                window_right: int, allow_tf32: bool = False) -> Tuple[Tensor, Tensor]:
        """The split-KV decode (`decode`): forward only, no dropout; `_run` routes calls here."""
        return decode.fwd(q, k, v, layout_mask, layout_block, key_padding_mask, scale, window_left, window_right,
                          allow_tf32)

    @triton_attention_decode.register_fake
    def _(q, k, v, *args):
        B, H, Lq, _ = q.shape
        return q.new_empty(B, H, Lq, v.shape[-1]), q.new_empty(B, H, Lq, dtype=torch.float32)


def _run(call):
    """(out, lse): out (B, H, Lq, Dv) in the input dtype, lse (B, H, Lq) fp32. The TF32 setting is
    read here, once per call; the backward reuses it."""
    lay = call.layout
    tf32 = call.q.dtype == torch.float32 and _tf32_enabled()      # ignored by the interpreter
    if decode.decode_reason(call) is None:      # a few query rows against a long key range
        return triton_attention_decode(call.q, call.k, call.v, lay.mask if lay is not None else None,
                                       lay.block_size if lay is not None else 0, call.key_padding_mask,
                                       call.scale, call.window_left, call.window_right, tf32)
    return triton_attention_fwd(call.q, call.k, call.v, lay.mask if lay is not None else None,
                                lay.block_size if lay is not None else 0, call.key_padding_mask, call.seed,
                                call.scale, call.dropout_p, call.window_left, call.window_right, tf32)


BACKEND = register(Backend(
    name="triton", op="attention", priority=10,
    caps=Capabilities(
        devices=frozenset({"cuda", "cpu"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        max_head_dim=256,
        features=FEATURES["attention"],
        min_compute_capability=(8, 0)),           # mma on bf16 tensor cores: Ampere or newer
    run=_run, available=_available,
    describe=lambda call: decode.describe(call) if triton is not None else None,
    # the interpreter is correct but far slower than the torch reference: CPU only when named
    explicit_only_devices=frozenset({"cpu"})))
