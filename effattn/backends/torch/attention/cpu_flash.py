"""The torch backend's path ``torch/cpu-flash``: torch's fused flash-attention CPU kernel
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) for the dense and causal
calls it computes exactly: it returns the log-sum-exp, reads GQA key/value heads without expanding
them, accumulates half types in float32 and float64 in float64. Its causal mask is aligned
top-left, so it serves causal calls only when ``Lq == Lk``; it has no dropout, no ``Dv != D`` and
no masks (``torch/cpu-sdpa-mask``, ``torch/cpu-blocks`` and ``torch/reference`` serve those), but takes
a block layout that cuts no pair of the call (`layout_cuts_nothing`). Float32 causal calls of
moderate length run in query blocks (`SPLIT`): the kernel reads the pairs above the diagonal there.
"""
from __future__ import annotations

import math
import weakref
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ...._call import needs_grad
from ....numerics import compute_dtype
from ...autograd import direct, eager_op_pair
from ...base import Capabilities, Path, register, switches
from .cpu_blocks import CPU_DTYPES, blocks_backward, cpu_reasons

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# the same kernels through torch's generated bindings, the way SDPA calls them: the Python op packet
# costs ~15 us more per call (a short call's host time matters, see benchmarks/cpu_vs_sdpa.py)
_FLASH_FN = getattr(torch._C._VariableFunctions, "_scaled_dot_product_flash_attention_for_cpu", _FLASH)

# The flash CPU kernel reads fewer key/value heads than query heads since torch 2.5 (SDPA's
# enable_gqa); only torch 2.13 is tested here, so older versions send GQA to the blocks path.
_FLASH_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
FEATURES = frozenset({"causal", "lq_ne_lk", "return_lse", "layout"} | ({"gqa"} if _FLASH_GQA else set()))
# ("layout": a block layout that cuts no pair the call's causal mask keeps, `layout_cuts_nothing`)

_NO_CUT = weakref.WeakKeyDictionary()     # BlockLayout -> {(Lq, Lk, causal): whether it cuts no pair}


def layout_cuts_nothing(call) -> bool:
    """Whether the call's block layout keeps every (query block, key block) tile holding a pair its
    causal mask (or, without one, every pair) keeps: then the layout changes nothing, and the call is
    the plain causal (dense) one, as the fixed layout at L <= 4 x 128 is (kept per layout: a
    layout is immutable)."""
    lay = call.layout
    key = (call.Lq, call.Lk, call.causal)
    seen = _NO_CUT.setdefault(lay, {})
    got = seen.get(key)
    if got is None:
        bs = lay.block_size
        nq, nk = -(-call.Lq // bs), -(-call.Lk // bs)
        m = lay.mask[:, :nq, :nk]
        if call.causal:                   # (Lq == Lk here) query block i holds pairs with key blocks 0..i
            need = torch.ones(nq, nk, dtype=torch.bool).tril()
            got = bool(m[:, need].all())
        else:
            got = bool(m.all())
        seen[key] = got
    return got


def exact_bound(lse_dtype: torch.dtype) -> float:
    """The largest |lse| the kernel's backward takes exactly (`kernel_backward_exact`)."""
    return 2.0 ** -10 / torch.finfo(lse_dtype).eps


def kernel_backward_exact(lse: Tensor) -> bool:
    """Whether the kernel's own backward may take a call with this saved lse. It recomputes the
    scores in another order than its forward, so they round differently: by up to a few ulps of
    |score|, which exp(s - lse) turns into a factor e^(ulps) on P. Past |lse| = 2**-10 / eps of the
    compute dtype (8192 in float32) that factor is no longer ~1 (scores of 1e10 in float32 gave
    P = inf and NaN gradients from finite input); the blocks path's backward, whose P never
    exceeds 1, takes those calls."""
    bound = exact_bound(lse.dtype)
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


# ------------------------------------------------------------------ causal calls in query blocks
# Below L = 768 torch's kernel reads every (query, key) pair of a causal call, those above the
# diagonal too (a causal call costs what a dense one does there; from L = 768 its larger query
# blocks skip part of them). Cut into `SPLIT.pieces` query blocks, block i against the keys up to its
# end (block 0 causal, the others with their diagonal masked), the pairs read fall to (p + 1) / (2p)
# of L^2. Measured with ``python3 -m benchmarks.cpu_sdpa_mask --causal-blocks``
# (benchmarks/results/cpu/cpu_sdpa_mask.md; float32, B = 1, H = 8, D = 64), 4 blocks against one call,
# forward / forward+backward:
#   1 thread:  L = 128 0.76 / 0.78, 256 0.72 / 0.73, 512 0.70 / 0.68, 768 0.89 / 0.83, 1024 0.92 / 0.85,
#              1280 1.02 / 0.99, 2048 1.12 / 1.04
#   2 threads: L = 128 0.86 / 0.89, 256 0.82 / 0.82, 512 0.76 / 0.72, 768 0.92 / 0.87, 1024 0.95 / 0.97,
#              1280 1.04 / 1.00, 2048 1.13 / 1.10
# (2 blocks: 0.79-0.95 up to L = 640, 1.06-1.15 from 768). Up to L = 768: at 1024 the gain was small
# and did not hold at 2 threads in the side-by-side run with SDPA (1.09x forward). Float32 only (the
# rule's measurements); the op pair's backward sums the blocks' dK, dV in a fixed order (last block
# first): reproducible.


class Split(NamedTuple):
    min_len: int                # causal calls with Lq == Lk from this length
    max_len: int                # up to this one
    pieces: int                 # query blocks
    dtypes: frozenset


SPLIT = Split(min_len=128, max_len=768, pieces=4, dtypes=frozenset({torch.float32}))
_SPLIT_MASKS: dict = {}         # (L, pieces, dtype) -> the blocks (`_blocks`)


def _blocks(q: Tensor, k: Tensor, causal: bool) -> Optional[tuple]:
    """The query blocks of a causal call `SPLIT` cuts: ``((i0, i1, mask or None), ...)``, block i
    queries i0..i1-1 against keys 0..i1-1 (mask: additive, its diagonal block's upper part -inf;
    None: the kernel's own causal mask, the first block); None when the call is not cut."""
    L = q.shape[2]
    if not causal or not SPLIT.min_len <= L <= SPLIT.max_len or q.dtype not in SPLIT.dtypes or k.shape[2] != L:
        return None
    key = (L, SPLIT.pieces, q.dtype)
    got = _SPLIT_MASKS.get(key)
    if got is None:
        cuts = sorted({round(i * L / SPLIT.pieces) for i in range(SPLIT.pieces + 1)})   # (no empty block)
        got = tuple((i0, i1, None if i0 == 0 else torch.zeros(i1 - i0, i1, dtype=q.dtype).masked_fill_(
                    torch.arange(i1)[None, :] > torch.arange(i0, i1)[:, None], -math.inf))
                    for i0, i1 in zip(cuts, cuts[1:]))
        if len(_SPLIT_MASKS) > 16:
            _SPLIT_MASKS.clear()
        _SPLIT_MASKS[key] = got
    return got


def flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    q, k, v = unit_stride(q, k, v)
    blocks = _blocks(q, k, causal)
    if blocks is None:
        out, lse = _FLASH_FN(q, k, v, 0.0, causal, scale=scale)
        return out, lse.contiguous()       # out as the kernel writes it: (B, Lq, H, D) memory, as SDPA's
    outs, lses = [], []
    for i0, i1, mask in blocks:
        o, l = _FLASH_FN(q[:, :, i0:i1], k[:, :, :i1], v[:, :, :i1], 0.0, mask is None, attn_mask=mask, scale=scale)
        outs.append(o.transpose(1, 2))     # (B, rows, H, D) memory, as the kernel writes it
        lses.append(l)
    return torch.cat(outs, 1).transpose(1, 2), torch.cat(lses, 2)


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
    grad_out, q, k, v, out = unit_stride(grad_out, q, k, v, out)
    blocks = _blocks(q, k, causal)
    if blocks is None:
        dq, dk, dv = _FLASH_BWD(grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
        return dq.contiguous(), dk.contiguous(), dv.contiguous()
    dqs, dk, dv = [], None, None
    for i0, i1, mask in reversed(blocks):          # the last block reads every key: its dK, dV start the sums
        r = slice(i0, i1)
        dq_i, dk_i, dv_i = _FLASH_BWD(grad_out[:, :, r], q[:, :, r], k[:, :, :i1], v[:, :, :i1], out[:, :, r],
                                      lse[:, :, r].contiguous(), 0.0, mask is None, attn_mask=mask, scale=scale)
        dqs.append(dq_i)
        if dk is None:
            dk, dv = dk_i.contiguous(), dv_i.contiguous()
        else:
            dk[:, :, :i1] += dk_i
            dv[:, :, :i1] += dv_i
    return torch.cat(dqs[::-1], 2), dk, dv


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
    if not why and call.layout is not None and not layout_cuts_nothing(call):
        why.append("a layout that cuts pairs (the kernel has no block mask)")
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
        if _blocks(q, k, call.causal) is not None:       # cut in query blocks: the op pair's bodies
            return flash_forward(q, k, v, True, call.scale) if not needs_grad(q, k, v) else \
                _CALL(q, k, v, True, call.scale)
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
        if kernel_backward_exact(lse):           # (the kernel's lse needs no gradient: no autograd record)
            return out, lse
    return _CALL(q, k, v, call.causal, call.scale)


def _planned(call):
    """The runner of a dispatch plan of `call` (effattn.plans): `_run`'s eager branches for the
    plan's later calls, on their q, k, v alone (no call built, no frame but its own). None when the
    call returns the lse (`_CALL`'s autograd node)."""
    if call.return_lse:
        return None
    causal, scale = call.causal, call.scale
    bound = exact_bound(compute_dtype(call.q.dtype))

    if _blocks(call.q, call.k, causal) is not None:      # the plan's shapes are cut in query blocks
        def blocks_runner(q, k, v):
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                return _CALL(q, k, v, True, scale)
            return flash_forward(q, k, v, True, scale)
        return blocks_runner

    def runner(q, k, v):
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            return None
        if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            return _FLASH_FN(q, k, v, 0.0, causal, scale=scale)
        out, lse = _FLASH_FN(q, k, v, 0.0, causal, scale=scale)
        lo, hi = lse.aminmax()
        if -bound <= lo.item() and hi.item() <= bound:       # else `run` (`kernel_backward_exact` in full)
            return out, lse
        return None
    return runner


def _describe(call) -> str:
    copied = _copied(call)
    blocks = _blocks(call.q, call.k, call.causal)
    return ("torch's fused flash-attention CPU kernel (aten._scaled_dot_product_flash_attention_for_cpu)"
            + ("; the layout cuts no pair of this call: run without it" if call.layout is not None else "")
            + (f"; causal in {len(blocks)} query blocks, each against the keys up to its end (measured faster "
               f"than one causal call from L = {SPLIT.min_len} to {SPLIT.max_len})" if blocks else "")
            + (f"; {', '.join(copied)} copied (last dimension not contiguous)" if copied else ""))


switches(__name__, "SPLIT")              # (the cut decides which ops a call runs: dispatch plans key on it)

PATH = register(Path(
    backend="torch", op="attention", name="torch/cpu-flash", priority=90,
    caps=Capabilities(devices=frozenset({"cpu"}), dtypes=CPU_DTYPES, features=FEATURES),
    run=_run, admits=_admits, describe=_describe, planned=_planned))
