"""The Triton backend for softmax attention: fused FlashAttention-2 kernels (Dao 2023), forward and
backward, with tile skipping for causal / window / block-sparse calls.

Modules, kernel to op (each reads only the ones above it):

- ``schedule``: in-kernel tile schedule and elementwise visibility (jit helpers);
- ``forward``: ``fwd_kernel`` (FA-2 Alg. 1); ``backward``: ``delta_kernel`` (Alg. 2 line 4) and
  ``bwd_kernel`` (the rest of Alg. 2 in one launch of two kinds of programs, dK/dV per key tile
  and dQ per query tile, so that no program accumulates into memory another one writes:
  deterministic);
- ``configs``: the candidate tile configs; ``launch``: ``LaunchPlan``, the launchers ``fwd`` / ``bwd``
  and autotuning;
- ``decode``: the split-KV decode for a few query rows against a long key range (``decode_kernel``,
  ``combine_kernel``, its launcher and when it is taken, ``decode_reason``);
- ``op``: the ``torch.library`` ops ``effattn::triton_attention_fwd`` / ``_bwd`` with fake impls and
  autograd, ``effattn::triton_attention_decode`` (forward only), and the registration as backend
  ``"triton"``, whose ``_run`` sends calls of ``Lq <= 16`` queries against ``>= 1024`` visible keys
  that need no gradient and no dropout to the decode (``effattn.explain`` says which path and why).

Which tiles a program visits ("skip, don't mask") is the tile plan of `effattn.tiles`: full tiles
(no elementwise mask), then partial ones (``PARTIAL``). Without a layout the kernels compute the
runs from the window bounds; with a `BlockLayout` they read the plan's packed lists, cached per
layout on the device. Kernel tiles need not match the layout block: a partial tile that straddles
layout blocks reads the layout block of each element (``LAYOUT_MASK``). Work scales with the
number of visible tiles.

Numerics
--------
Scores and softmax statistics are fp32 (with a positive scale the row max is taken on the raw
scores and the scale folded into the exponent: one FMA per score, ``FOLD_SCALE``; FP fusion is
pinned on for every launch); products run on tensor cores in the input dtype. float32
inputs use TF32 dots (10-bit mantissa) when torch's cuBLAS setting allows TF32
(``torch.backends.cuda.matmul.fp32_precision == "tf32"``, or the legacy ``allow_tf32``), like
torch's own fp32 matmuls, and IEEE fp32 dots otherwise. The setting is read once per call, at the
forward, and the backward of that call uses the same. IEEE fp32 dots have no tensor-core path and
spill on the GPU, so such calls rank after the torch backend (``op.IEEE_FP32_RANK``: "auto" takes
torch, explain notes why); named, the backend still serves them. Dropout draws a Philox number
per (b, h, i, j) from the call's seed, so backward regenerates exactly the forward's mask, whatever
the tile sizes. No kernel uses atomics: every gradient element is written by one program.

Configs and reproducibility
---------------------------
Tile sizes are autotuned on the GPU: the first call of each kind (head dim, dtype, mask mode,
length bucket) times a handful of configs with ``triton.testing.do_bench`` (which synchronizes and
briefly allocates a 256 MB L2-flush buffer) and keeps the fastest for the process. Gradients are
bitwise reproducible for a fixed config. ``EFFATTN_TRITON_AUTOTUNE=0`` skips the timing and pins the
first config that fits, which makes results reproducible across processes too. Warm up outside
CUDA-graph capture (``torch.compile(mode="reduce-overhead")`` does so in its warm-up runs); a call
that meets an untuned kind while a stream is capturing takes the first config that fits, untimed,
and does not cache it.

Syncs and per-call work
-----------------------
No call waits for the GPU except: autotuning (first call per kind), and building a layout's tile
lists (first call per layout, lengths, tiles and window: ``torch.unique`` and two ``.max()`` read
sizes back, so that first call cannot happen during CUDA-graph capture); the lists are cached on
the device, keyed weakly on the layout's mask. The dropout seed is a CPU tensor (no sync).
Everything else per call is host-side Python and the launches (one for the forward, two for the
backward: the Delta pre-pass and `bwd_kernel`, with a GQA split two small additions of the partial
dK, dV after them; two for a split-KV decode, which has one config and is never autotuned, so its
first call may be made while a CUDA graph is captured once the kernels are compiled).
The launch metadata (sizes, flags, every scalar kernel argument) is built once per kind of call
(shapes, strides, dtype, layout, flags) and cached (`launch.plan_for`), so a repeated call costs a
dictionary lookup; eager calls on plain tensors call the launchers without the torch.library layer
(`op._direct`), and dispatch asks only the backend it picks. About 25-35 us of CPU per forward and
120-200 us per forward+backward at L=1024 without Triton's own launch path
(``python -m tools.triton.host_overhead``; benchmarks/results/cpu/host_overhead.md).

Scheduling
----------
Programs of causal and windowed calls run heaviest first (`schedule.slice_tile`): the query
tiles that see the most keys (the dK/dV programs: the key tiles seen by the most queries) start
first, across groups of (batch, head) slices whose K and V fit in L2 together, so the last wave is
short. In the backward's one launch the dK/dV programs, each a loop over the query heads of a kv
head, come before the dQ programs. When they are fewer than the GPU's SMs (GQA with small
B * Hkv), each key tile's query heads are split over several programs (`launch.gqa_splits`) that
write fp32 partial dK, dV, added in a fixed order after the launch (deterministic).

Index arithmetic
----------------
Per-(batch, head) bases and per-tile row offsets are int64. Offsets inside a tile (row x stride +
column x stride) are int32 unless some tensor's span over its (length, head-dim) axes reaches 2**31
elements (e.g. a ``(L, B, H, D)`` tensor viewed as ``(B, H, L, D)`` with L*B*H*D > 2**31), in which
case the kernels are compiled with int64 offsets throughout (``IDX64``).
"""
from ..runtime import triton
from .op import BACKEND  # noqa: F401  (registers the backend)

if triton is not None:
    from . import configs, decode, launch, op  # noqa: F401
    from .backward import bwd_kernel, delta_kernel  # noqa: F401
    from .forward import fwd_kernel  # noqa: F401
    from .launch import LaunchPlan, bwd, fwd  # noqa: F401
    from .op import triton_attention_bwd, triton_attention_decode, triton_attention_fwd  # noqa: F401
