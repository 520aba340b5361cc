"""The autograd formula the backends share: one for the softmax-attention op pairs of every backend
(the torch reference, the CPU blocks path, Triton, CUDA)."""
from __future__ import annotations

from typing import Callable


def attention_autograd(bwd_op, prepare: Callable = lambda grad_out: grad_out, seeded: bool = True,
                       extra_tensors: int = 0):
    """The autograd formula every backend's attention op shares. The forward op's inputs are
    ``(q, k, v, layout_mask, layout_block, key_padding_mask, seed, *scalars)`` and it returns
    ``(out, lse)``; ``bwd_op(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block,
    key_padding_mask, seed, *scalars)`` returns ``(dq, dk, dv)``; an op without dropout has no
    ``seed`` in either (``seeded=False``); ``extra_tensors`` optional tensors follow ``seed`` in both
    (the CUDA ops' ``cu_seqlens`` pair). ``prepare`` adapts grad_out (e.g. makes it contiguous).
    Returns ``(setup_context, backward)`` for ``fwd_op.register_autograd`` (or an
    ``autograd.Function`` that calls the launchers directly)."""
    n_opt = (3 if seeded else 2) + extra_tensors   # the optional tensors after layout_mask: kpm (and seed), extras

    def setup_context(ctx, inputs, output):
        q, k, v, layout_mask, layout_block, *rest = inputs
        ctx.save_for_backward(q, k, v, *output, layout_mask, *rest[:n_opt - 1])
        ctx.static = (layout_block, *rest[n_opt - 1:])     # read at the forward (e.g. TF32), not again

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, layout_mask, *opt = ctx.saved_tensors
        dq, dk, dv = bwd_op(prepare(grad_out), grad_lse, q, k, v, out, lse, layout_mask, ctx.static[0], *opt,
                            *ctx.static[1:])
        return (dq, dk, dv) + (None,) * (len(ctx.static) + n_opt)

    return setup_context, backward
