"""The autograd formula the backends share: one for the softmax-attention op pairs of every backend
(the torch reference, the CPU blocks path, Triton, CUDA)."""
from __future__ import annotations

from typing import Callable, List


def op_arg_names(op) -> List[str]:
    """The parameter names of a ``torch.library.custom_op``, in its schema's order (the order in
    which ``setup_context`` receives its inputs)."""
    return [a.name for a in op._opoverload._schema.arguments]


def _tensor_args(op) -> List[str]:
    return [a.name for a in op._opoverload._schema.arguments if str(a.type) in ("Tensor", "Optional[Tensor]")]


def saved_output(ctx):
    """The forward's ``out`` among what `attention_autograd`'s ``setup_context`` saved."""
    return ctx.saved_tensors[0]


def attention_autograd(fwd_op, bwd_op, prepare: Callable = lambda grad_out: grad_out):
    """The autograd formula every backend's attention op shares, by argument name. ``fwd_op`` (a
    ``torch.library.custom_op``) takes ``q, k, v`` and further arguments and returns ``(out, lse)``;
    ``bwd_op(grad_out, grad_lse, q, k, v, out, lse, **the forward's other arguments)`` (called by
    keyword) returns ``(dq, dk, dv)``. The forward's tensor arguments are saved for the backward, the
    others kept as they were at the forward (e.g. TF32). ``prepare`` adapts grad_out (e.g. makes it
    contiguous). Returns ``(setup_context, backward)`` for ``fwd_op.register_autograd`` (or an
    ``autograd.Function`` that calls the launchers directly)."""
    names = op_arg_names(fwd_op)
    tensors = _tensor_args(fwd_op)                 # q, k, v first, then the optional ones (layout, kpm, seed, ...)
    static = [n for n in names if n not in tensors]
    n_grads = len(names)

    def setup_context(ctx, inputs, output):
        given = dict(zip(names, inputs))
        ctx.save_for_backward(*output, *(given[n] for n in tensors))
        ctx.static = {n: given[n] for n in static}   # read at the forward (e.g. TF32), not again

    def backward(ctx, grad_out, grad_lse):
        out, lse, *saved = ctx.saved_tensors
        dq, dk, dv = bwd_op(prepare(grad_out), grad_lse, out=out, lse=lse, **dict(zip(tensors, saved)), **ctx.static)
        return (dq, dk, dv) + (None,) * (n_grads - 3)

    return setup_context, backward
