"""The Triton attention backend as torch ops: ``effattn::triton_attention_fwd`` / ``_bwd``
(``torch.library`` custom ops, opaque to torch.compile) with fake impls and an autograd formula, and
its registration as backend ``"triton"``.

Eager calls on plain tensors skip the torch.library layer (``autograd.direct``): its Python dispatch
costs about 15 us per forward and 100-150 us per forward+backward of host time (argument re-packing,
``fill_defaults`` reading the schema, alias checks), more than the rest of a call. They run the same
launchers with the same autograd formula (``autograd.eager_op_pair``), so results are bitwise those of
the ops. Tracing
(torch.compile, export), dispatch or function modes (FakeTensor, FlopCounter, ...), functorch
transforms, tensor subclasses and the profiler all take the ops."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .... import score
from ....packed import segment_list
from ... import autograd
from ...autograd import attention_autograd, eager_op_pair, op_arg_names
from ...base import FEATURES, PACKED_FEATURES, SCORE_FEATURES, Capabilities, Path, register
from ..runtime import _available, _tf32_enabled, triton

if triton is not None:
    from . import decode, launch
    from . import score as score_path

if triton is not None:

    def _fwd_launch(q: Tensor, k: Tensor, v: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                    key_padding_mask: Optional[Tensor], seed: Optional[Tensor], scale: float, dropout_p: float,
                    window_left: int, window_right: int, allow_tf32: bool = False, q_offset: Optional[int] = None,
                    out_fp32: bool = False, drop_q0: int = 0, drop_k0: int = 0, drop_h0: int = 0,
                    drop_H: int = 0) -> Tuple[Tensor, Tensor]:
        """The forward op's body, which eager calls run directly (`_eager_call`): the launcher, looked up
        per call (tests replace it with spies)."""
        return launch.fwd(q, k, v, layout_mask, layout_block, key_padding_mask, seed, scale, dropout_p,
                          window_left, window_right, allow_tf32, q_offset, out_fp32, drop_q0, drop_k0, drop_h0, drop_H)

    triton_attention_fwd = torch.library.custom_op("effattn::triton_attention_fwd", mutates_args=())(_fwd_launch)

    @triton_attention_fwd.register_fake
    def _(q, k, v, layout_mask, layout_block, key_padding_mask, seed, scale, dropout_p, window_left,
          window_right, allow_tf32=False, q_offset=None, out_fp32=False, drop_q0=0, drop_k0=0, drop_h0=0, drop_H=0):
        B, H, Lq, _ = q.shape
        return (q.new_empty(B, H, Lq, v.shape[-1], dtype=torch.float32 if out_fp32 else q.dtype),
                q.new_empty(B, H, Lq, dtype=torch.float32))

    def _bwd_launch(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    lse: Tensor, layout_mask: Optional[Tensor], layout_block: int, key_padding_mask: Optional[Tensor],
                    seed: Optional[Tensor], scale: float, dropout_p: float, window_left: int, window_right: int,
                    allow_tf32: bool = False, q_offset: Optional[int] = None, out_fp32: bool = False,
                    drop_q0: int = 0, drop_k0: int = 0, drop_h0: int = 0,
                    drop_H: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
        """The backward op's body, the eager calls' backward."""
        return launch.bwd(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, key_padding_mask, seed,
                          scale, dropout_p, window_left, window_right, allow_tf32, q_offset, out_fp32, drop_q0,
                          drop_k0, drop_h0, drop_H)

    triton_attention_bwd = torch.library.custom_op("effattn::triton_attention_bwd", mutates_args=())(_bwd_launch)

    @triton_attention_bwd.register_fake
    def _(grad_out, grad_lse, q, k, v, *args):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    # the autograd formula on the ops, and eager calls on plain tensors running the launchers with it
    # (allow_tf32 is the forward's setting, kept for the backward: not read again)
    _eager_call = eager_op_pair(triton_attention_fwd, triton_attention_bwd, _fwd_launch, _bwd_launch)
    _FWD_NAMES = op_arg_names(triton_attention_fwd)

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


def _direct(*tensors) -> bool:
    """The eager test every backend's ops share (``autograd.direct``, looked up per call: tests switch it)."""
    return autograd.direct(*tensors)


def _tf32(call) -> bool:
    """The TF32 setting, read here, once per call (the backward reuses it; the interpreter ignores it)."""
    return call.q.dtype == torch.float32 and _tf32_enabled()


if triton is not None:

    class _Varlen(torch.autograd.Function):
        """Packed sequences: `launch.fwd_varlen`, and `launch.bwd` on the same segment work list (with
        dropout, the same seed: the keep-mask is drawn again at the same packed rows)."""

        @staticmethod
        def forward(ctx, q, k, v, segments, seed, scale, dropout_p, left, right, tf32, out_fp32):
            out, lse = launch.fwd_varlen(q, k, v, segments, seed, scale, dropout_p, left, right, tf32, out_fp32)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.static = (segments, seed, scale, dropout_p, left, right, tf32, out_fp32)
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            q, k, v, out, lse = ctx.saved_tensors
            segments, seed, scale, dropout_p, left, right, tf32, out_fp32 = ctx.static
            dq, dk, dv = launch.bwd(grad_out, grad_lse, q, k, v, out, lse, None, 0, None, seed, scale, dropout_p,
                                    left, right, tf32, out_fp32=out_fp32, segments=segments)
            return dq, dk, dv, None, None, None, None, None, None, None, None


if triton is not None:

    # Packed sequences as torch ops (torch.compile, export, dispatch modes): the segment work list is
    # read from cu_seqlens inside the op (opaque to the tracer), so a traced packed call needs no host value.
    @torch.library.custom_op("effattn::triton_attention_varlen_fwd", mutates_args=())
    def triton_attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    seed: Optional[Tensor], scale: float, dropout_p: float, window_left: int,
                                    window_right: int, allow_tf32: bool = False,
                                    out_fp32: bool = False) -> Tuple[Tensor, Tensor]:
        segments = segment_list(cu_seqlens_q.tolist(), cu_seqlens_k.tolist())
        return launch.fwd_varlen(q, k, v, segments, seed, scale, dropout_p, window_left, window_right, allow_tf32,
                                 out_fp32)

    @triton_attention_varlen_fwd.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seed, scale, dropout_p, window_left, window_right, allow_tf32=False,
          out_fp32=False):
        B, H, Lq, _ = q.shape
        return (q.new_empty(B, H, Lq, v.shape[-1], dtype=torch.float32 if out_fp32 else q.dtype),
                q.new_empty(B, H, Lq, dtype=torch.float32))

    @torch.library.custom_op("effattn::triton_attention_varlen_bwd", mutates_args=())
    def triton_attention_varlen_bwd(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                                    out: Tensor, lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    seed: Optional[Tensor], scale: float, dropout_p: float, window_left: int,
                                    window_right: int, allow_tf32: bool = False,
                                    out_fp32: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
        segments = segment_list(cu_seqlens_q.tolist(), cu_seqlens_k.tolist())
        return launch.bwd(grad_out, grad_lse, q, k, v, out, lse, None, 0, None, seed, scale, dropout_p, window_left,
                          window_right, allow_tf32, out_fp32=out_fp32, segments=segments)

    @triton_attention_varlen_bwd.register_fake
    def _(grad_out, grad_lse, q, k, v, *args):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    _varlen_setup, _varlen_backward = attention_autograd(triton_attention_varlen_fwd, triton_attention_varlen_bwd)
    triton_attention_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def _run_prefill(call):
    """(out, lse): out (B, H, Lq, Dv) in the input dtype (float32 with ``out_dtype``), lse (B, H, Lq) fp32."""
    a = call.op_args()
    tf32 = _tf32(call)
    if call.cu_seqlens is not None:             # packed sequences: the (segment, tile) work lists
        if not _direct(a.q, a.k, a.v, *call.cu_seqlens):
            return triton_attention_varlen_fwd(a.q, a.k, a.v, *call.cu_seqlens, a.seed, a.scale, a.dropout_p,
                                               a.window_left, a.window_right, tf32, call.out_dtype is not None)
        static = (call.segments, a.seed, a.scale, a.dropout_p, a.window_left, a.window_right, tf32,
                  call.out_dtype is not None)
        if torch.is_grad_enabled() and (a.q.requires_grad or a.k.requires_grad or a.v.requires_grad):
            return _Varlen.apply(a.q, a.k, a.v, *static)
        return launch.fwd_varlen(a.q, a.k, a.v, *static)
    # the op's arguments by name: positions give the kernels' offset (the rule's); the rows, keys and heads
    # dropout draws at (`AttnCall.drop_at`)
    drop_q0, drop_k0, drop_h0, drop_H = call.drop_at()
    args = dict(a._asdict(), allow_tf32=tf32, q_offset=call.rule.q_offset, out_fp32=call.out_dtype is not None,
                drop_q0=drop_q0, drop_k0=drop_k0, drop_h0=drop_h0, drop_H=drop_H)
    return _eager_call(*(args[n] for n in _FWD_NAMES))


def _run_decode(call):
    """The split-KV decode of a few query rows against a long key range (forward only, no dropout)."""
    a = call.op_args()
    fn = decode.fwd if _direct(a.q, a.k, a.v, a.key_padding_mask, a.layout_mask) else triton_attention_decode
    return fn(a.q, a.k, a.v, a.layout_mask, a.layout_block, a.key_padding_mask, a.scale, a.window_left,
              a.window_right, _tf32(call))


# Devices where the kernels are compiled (the interpreter on CPU computes IEEE fp32 exactly, at its pace).
_COMPILED = frozenset({"cuda"})
# float32 with TF32 disallowed has no sound Triton path on a GPU: IEEE fp32 dots run as FMA loops that
# spill (sm_90, D = 128: 7-9 KB of stack, ~30k spill instructions in the dK/dV loop) and 3xTF32 dots
# spill in the dK/dV loop at every tile tried (docs/design/triton-configs.md). Such calls
# rank after the torch backend (cuBLAS fp32), so "auto" takes it; named, the kernels still serve them
# exactly (IEEE dots), slowly.
IEEE_FP32_RANK = 200
IEEE_FP32_NOTE = ("float32 without TF32 (torch's fp32 matmul precision 'highest'): IEEE fp32 dots, no tensor "
                  "cores and spilling kernels, so ranked after torch; allow TF32 for the fast path")


def _ieee_fp32(call) -> bool:
    """Whether `call` is float32 on a GPU with TF32 disallowed (read at dispatch, as `_run` reads it)."""
    return (call is not None and call.q.dtype == torch.float32 and call.q.device.type in _COMPILED
            and not _tf32_enabled())


def _rank(base_rank: int):
    return lambda call: IEEE_FP32_RANK if _ieee_fp32(call) else base_rank


def _caps(features) -> Capabilities:
    return Capabilities(
        devices=frozenset({"cuda", "cpu"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        max_head_dim=256,
        features=features,
        min_compute_capability=(8, 0))           # mma on bf16 tensor cores: Ampere or newer


_COMMON = dict(backend="triton", op="attention", available=_available,
               notes=lambda call: [IEEE_FP32_NOTE] if _ieee_fp32(call) else [],
               # the interpreter is correct but far slower than the torch paths: CPU only when named
               explicit_only_devices=frozenset({"cpu"}))

def _run_score(call):
    """Softcap, sinks, bias: the score-terms kernels (backends/triton/attention/score.py), through the
    score-terms composition of effattn.score."""
    return score.run(call, score_path.Kernels(_tf32(call)))


def _admits_score(call):
    if call.score is None:
        return ["no score terms (triton/prefill serves the call)"]
    return score_path.reasons(call)


# the plain kernels take no score terms (the triton/score row's kernels do); the split-KV decode leaves
# packed sequences, positions and fp32 outputs to the prefill kernels; the score kernels take positions, fp32
# outputs and packed sequences (the plain packed kernels' (segment, tile) work lists).
# triton/score is registered before triton/prefill (same rank): prefill stays the backend's most general row
DECODE = register(Path(name="triton/decode", priority=_rank(9), run=_run_decode,
                       caps=_caps(FEATURES["attention"] - PACKED_FEATURES - SCORE_FEATURES),
                       admits=lambda call: decode.admits(call), describe=lambda call: decode.describe(call),
                       **_COMMON))
SCORE = register(Path(name="triton/score", priority=_rank(10), run=_run_score,
                      caps=_caps(FEATURES["attention"]), admits=_admits_score,
                      describe=lambda call: score_path.describe(call), **_COMMON))
BACKEND = PREFILL = register(Path(name="triton/prefill", priority=_rank(10), run=_run_prefill,
                                  caps=_caps(FEATURES["attention"] - SCORE_FEATURES), **_COMMON))
