"""The autograd formula the backends share: one for the softmax-attention op pairs of every backend
(the torch reference, the CPU blocks path, Triton, CUDA)."""
from __future__ import annotations

from typing import Callable, List

import torch
from torch import Tensor

from .._call import needs_grad


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


_PLAIN = (Tensor, torch.nn.Parameter)


def direct(*tensors) -> bool:
    """Whether a call may skip the torch.library layer: eager (not traced by torch.compile, export
    or torch.jit.trace), no torch function or dispatch mode, no functorch transform, no profiler,
    and every tensor a plain one (None allowed). Anything else sees the ops."""
    for t in tensors:                   # a loop, not all(generator): this runs on every eager call
        if t is not None and type(t) not in _PLAIN:
            return False
    return (not torch.compiler.is_compiling() and not torch._C._get_tracing_state()
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._is_torch_function_mode_enabled() and torch._C._functorch.peek_interpreter_stack() is None
            and not torch._C._autograd._profiler_enabled())


def eager_op_pair(fwd_op, bwd_op, fwd_fn: Callable, bwd_fn: Callable,
                  prepare: Callable = lambda grad_out: grad_out) -> Callable:
    """Registers `attention_autograd` on the op pair (``fwd_op``, ``bwd_op``, custom ops whose bodies
    are ``fwd_fn`` and ``bwd_fn``) and returns ``call(*fwd_op's arguments) -> (out, lse)``.

    Eager calls on plain tensors (`direct`) run the bodies themselves with the same formula, so
    results are bitwise those of the ops: torch.library's Python dispatch costs tens of us per
    forward and 100-150 us per forward+backward, a tenth of a short CPU call. A gradient of only one
    output is not filled with zeros for the other (``grad_lse`` None); a double backward goes
    through the ops. Everything else (tracing, modes, subclasses, the profiler) calls ``fwd_op``."""
    setup_context, op_backward = attention_autograd(fwd_op, bwd_op, prepare)
    fwd_op.register_autograd(op_backward, setup_context=setup_context)
    fn_backward = attention_autograd(fwd_op, bwd_fn, prepare)[1]
    tensors = set(_tensor_args(fwd_op))
    at = [i for i, n in enumerate(op_arg_names(fwd_op)) if n in tensors]

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = fwd_fn(*inputs)
            ctx.set_materialize_grads(False)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            if grad_out is None:
                grad_out = torch.zeros_like(saved_output(ctx))
            if torch.is_grad_enabled():                 # create_graph: the op says it has no derivative
                return op_backward(ctx, grad_out, grad_lse)
            return fn_backward(ctx, grad_out, grad_lse)

    def call(*args):
        ts = [args[i] for i in at]       # the tensor arguments, read once (torch.compile traces this too)
        if not direct(*ts):
            return fwd_op(*args)
        if needs_grad(*ts):
            return Eager.apply(*args)
        return fwd_fn(*args)
    return call
