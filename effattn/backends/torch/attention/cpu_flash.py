"""The torch backend's path ``torch/cpu-flash``: torch's fused flash-attention CPU kernel
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) for the dense and causal
calls it computes exactly: it returns the log-sum-exp, reads GQA key/value heads without expanding
them, accumulates half types in float32 and float64 in float64. Its causal mask is aligned
top-left, so it serves causal calls only when ``Lq == Lk``; it has no dropout, no ``Dv != D`` and
no masks (``torch/cpu-blocks`` and ``torch/reference`` serve those).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ...._call import needs_grad
from ....numerics import compute_dtype
from ...autograd import direct, eager_op_pair
from ...base import Capabilities, Path, register
from .cpu_blocks import CPU_DTYPES, blocks_backward, cpu_reasons

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# the same kernels through torch's generated bindings, the way SDPA calls them: the Python op packet
# costs ~15 us more per call (a short call's host time matters, see benchmarks/cpu_vs_sdpa.py)
_FLASH_FN = getattr(torch._C._VariableFunctions, "_scaled_dot_product_flash_attention_for_cpu", _FLASH)

# The flash CPU kernel reads fewer key/value heads than query heads since torch 2.5 (SDPA's
# enable_gqa); only torch 2.13 is tested here, so older versions send GQA to the blocks path.
_FLASH_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
FEATURES = frozenset({"causal", "lq_ne_lk", "return_lse"} | ({"gqa"} if _FLASH_GQA else set()))


def kernel_backward_exact(lse: Tensor) -> bool:
    """Whether the kernel's own backward may take a call with this saved lse. It recomputes the
    scores in another order than its forward, so they round differently: by up to a few ulps of
    |score|, which exp(s - lse) turns into a factor e^(ulps) on P. Past |lse| = 2**-10 / eps of the
    compute dtype (8192 in float32) that factor is no longer ~1 (scores of 1e10 in float32 gave
    P = inf and NaN gradients from finite input); the blocks path's backward, whose P never
    exceeds 1, takes those calls."""
    bound = 2.0 ** -10 / torch.finfo(lse.dtype).eps
    if not lse.numel():
        return True
    lo, hi = lse.aminmax()              # one reduction where every row sees a key (abs + max: two, and a copy)
    if -bound <= lo.tolist() and hi.tolist() <= bound:
        return True
    fin = lse[torch.isfinite(lse)]                               # rows that see no key have lse -inf
    return not fin.numel() or fin.abs().max().item() <= bound


def unit_stride(*ts: Tensor) -> Tuple[Tensor, ...]:
    """The tensors with stride 1 along the head dim: the kernel reads a strided last dim wrongly
    (torch 2.13: a ``[..., ::2]`` view gives errors of order 1)."""
    for t in ts:
        if t.stride(-1) != 1:
            break
    else:
        return ts
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


def flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    out, lse = _FLASH_FN(*unit_stride(q, k, v), 0.0, causal, scale=scale)
    return out, lse.contiguous()       # out as the kernel writes it: (B, Lq, H, D) memory, as SDPA's


cpu_flash_fwd = torch.library.custom_op("effattn::cpu_flash_fwd", mutates_args=())(flash_forward)


@cpu_flash_fwd.register_fake
def _(q, k, v, causal, scale):
    B, H, Lq, _ = q.shape
    return q.new_empty(B, Lq, H, v.shape[-1]).transpose(1, 2), q.new_empty(B, H, Lq, dtype=compute_dtype(q.dtype))


def flash_backward(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                   lse: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    if grad_lse is not None and not bool(grad_lse.any()):
        grad_lse = None                      # autograd materializes an unused lse's gradient as zeros
    if grad_lse is not None or not kernel_backward_exact(lse):
        # the flash backward has no lse gradient input (nor an exact P for huge scores); the blocks
        # path's backward computes the same gradients from the same out and lse (causal: Lq == Lk)
        return blocks_backward(grad_out, grad_lse, q, k, v, out, lse, None, 0, None, scale, -1,
                               0 if causal else -1)
    dq, dk, dv = _FLASH_BWD(*unit_stride(grad_out, q, k, v, out), lse, 0.0, causal, scale=scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


cpu_flash_bwd = torch.library.custom_op("effattn::cpu_flash_bwd", mutates_args=())(flash_backward)


@cpu_flash_bwd.register_fake
def _(grad_out, grad_lse, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_CALL = eager_op_pair(cpu_flash_fwd, cpu_flash_bwd, flash_forward, flash_backward, prepare=lambda g: g.contiguous())


def _admits(call) -> List[str]:
    why = cpu_reasons(call)
    if not why and call.causal and call.Lq != call.Lk:
        why.append("causal with Lq != Lk (its causal mask is top-left, effattn's bottom-right)")
    if not why and call.causal and call.scale <= 0:
        why.append("causal with scale <= 0 (its causal mask then gives NaN)")
    return why


def _copied(call) -> List[str]:
    """The inputs whose last dimension is not contiguous: the flash kernel reads rows as if it were
    (a strided view such as x[..., ::2] gave errors of order 1), so they are copied first."""
    return [n for n, t in (("q", call.q), ("k", call.k), ("v", call.v)) if t.stride(-1) != 1 and t.shape[-1] > 1]


def _run(call):
    q, k, v = call.q, call.k, call.v
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous() for t in (q, k, v))
    elif not call.return_lse and direct(q, k, v):
        if not needs_grad(q, k, v):
            # an eager forward that returns no lse: the kernel alone, as `_CALL`'s forward would run it
            return _FLASH_FN(q, k, v, 0.0, call.causal, scale=call.scale)
        # an eager call wanting gradients of out only: the kernel under torch's own autograd node
        # (the one SDPA records: C++, no Python autograd.Function on either pass), whose backward is
        # `_FLASH_BWD` on the same saved tensors, so the gradients are bitwise `_CALL`'s. Taken only
        # when that backward is exact for this lse (`kernel_backward_exact`, read here in the
        # forward); else the forward runs again through `_CALL`, whose backward then takes the
        # blocks path (|lse| > 2**-10 / eps: scores far outside any trained model's range)
        out, lse = _FLASH_FN(q, k, v, 0.0, call.causal, scale=call.scale)
        if kernel_backward_exact(lse.data):
            return out, lse
    return _CALL(q, k, v, call.causal, call.scale)


def _planned(call):
    """The runner of a dispatch plan of `call` (effattn.plans): `_run`'s eager branches for the
    plan's later calls, on their q, k, v alone (no call built, no frame but its own). None when the
    call returns the lse (`_CALL`'s autograd node)."""
    if call.return_lse:
        return None
    causal, scale = call.causal, call.scale
    bound = 2.0 ** -10 / torch.finfo(compute_dtype(call.q.dtype)).eps      # `kernel_backward_exact`'s

    def runner(q, k, v):
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            return None
        if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            return _FLASH_FN(q, k, v, 0.0, causal, scale=scale)
        out, lse = _FLASH_FN(q, k, v, 0.0, causal, scale=scale)
        lo, hi = lse.data.aminmax()
        if -bound <= lo.item() and hi.item() <= bound:       # else `run` (`kernel_backward_exact` in full)
            return out, lse
        return None
    return runner


def _describe(call) -> str:
    copied = _copied(call)
    return ("torch's fused flash-attention CPU kernel (aten._scaled_dot_product_flash_attention_for_cpu)"
            + (f"; {', '.join(copied)} copied (last dimension not contiguous)" if copied else ""))


PATH = register(Path(
    backend="torch", op="attention", name="torch/cpu-flash", priority=90,
    caps=Capabilities(devices=frozenset({"cpu"}), dtypes=CPU_DTYPES, features=FEATURES),
    run=_run, admits=_admits, describe=_describe, planned=_planned))
