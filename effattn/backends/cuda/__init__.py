"""The CUDA C++ backend for softmax attention (kernels in csrc/, FlashAttention-2 class on
mma.sync / ldmatrix / cp.async, sm_80 and newer), forward and backward, every mask kind.

On a GPU of compute capability 9.0 the forward at head dims 33..128 runs the Hopper kernel
(csrc/attention/fwd_sm90.cuh, wgmma) when the extension has sm_90a code (``hopper.py`` decides; explain
says which forward runs).

Layers: the kernels (csrc/attention/fwd.cuh, fwd_sm90.cuh, bwd.cuh) -> launchers
(csrc/attention/fwd.cu, bwd.cu, fwd_sm90.cu) -> the C++ ops (csrc/binding/attention.cpp) -> the
autograd ops (``ops.py``) -> this registration.

CUDA tensors use ``effattn._C`` (built by setup.py). CPU tensors are served only with
``EFFATTN_CUDA_EMU=1``, and only when the backend is named (``backend="cuda"``): the same kernel
source runs through a host emulation of the GPU primitives, built on first use with the host
compiler. That is a test vehicle (thousands of emulated warp mma per second), not a CPU backend.

Linear attention's registration (its own kernels, csrc/linear/) lives in ``linear.py``.

Inputs whose last dimension is not contiguous, whose head dims are not multiples of 8, or whose
rows are not 16-byte aligned are copied (zero-padded) once per call: the kernels load 16-byte rows
with cp.async.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..base import Backend, Capabilities, register
from . import _ext, decode, hopper


def _available(device: torch.device) -> Optional[str]:
    if device.type == "cpu":
        return _ext.emu_problem()
    if device.type == "cuda":
        return _ext.device_problem(device)
    return None


def notes(call) -> List[str]:
    """What this backend does besides launching the kernels for a call: copies that align inputs."""
    out = []
    for name, t in (("q", call.q), ("k", call.k), ("v", call.v)):
        if t.numel() and (t.stride(-1) != 1 or t.shape[-1] % 8 or any(s % 8 for s in t.stride()[:3])):
            out.append(f"{name} is copied into zero-padded 16-byte rows (head dim {t.shape[-1]}, strides "
                       f"{tuple(t.stride())})")
    return out


def _run(call):
    from .ops import cuda_attention_fwd, kernels
    if decode.why_not(call) is None:
        return decode.run(call)
    kernels(call.q.device)
    lay = call.layout
    return cuda_attention_fwd(call.q, call.k, call.v, lay.mask if lay is not None else None,
                              lay.block_size if lay is not None else 0, call.key_padding_mask, call.seed,
                              call.scale, call.dropout_p, call.window_left, call.window_right)


def _describe(call) -> str:
    """The path for a call (a line in explain): the split-KV decode, or the prefill kernels (and which
    forward: Hopper wgmma or mma.sync) with why the decode does not apply."""
    if decode.why_not(call) is None:
        return decode.describe(call)
    return f"{decode.describe(call)}; {hopper.describe(call)}"


def _rank(call) -> int:
    """After Triton for "auto" until the GPU acceptance run has measured these kernels, except for
    decode-shaped calls (a few query rows, no gradient) against a long cache: the split-KV kernels."""
    return 5 if decode.ranks_ahead(call) else 20


BACKEND = register(Backend(
    name="cuda", op="attention", priority=_rank,
    caps=Capabilities(
        devices=frozenset({"cuda", "cpu"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=256,
        features=frozenset({"causal", "window", "layout", "key_padding_mask", "dropout", "gqa", "lq_ne_lk",
                            "dv_ne_d", "return_lse"})),
    run=_run, available=_available, notes=notes, describe=_describe,
    # on CPU this is the emulation: a test vehicle, only when named
    explicit_only_devices=frozenset({"cpu"})))

from . import linear  # noqa: E402,F401  (registers linear_attention's "cuda" backend)
