"""Kernel configs: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, BLOCK_M the query tile and BLOCK_N
the key tile; the backward's (one launch of two kinds of programs) are
``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)``: the dK/dV programs' tiles, then
the dQ programs'; a trailing ``"dq5"`` makes it the five-product backward (`five_product`: no dQ
programs, their two numbers unused).

A few candidates per kernel, head-dim class (the larger of D and Dv, padded to a power of two) and
element size, autotuned once per kind of call on the GPU (`launch`). The first of each list is the
untimed default (``EFFATTN_TRITON_AUTOTUNE=0``, CUDA-graph capture): it must fit sm_80's shared
memory, and on sm_90 use wgmma no narrower than 64 x 32 without spilling in its full-tile loops. Why each list is what it is (the
offline compiles behind it) is in docs/design/triton-configs.md; `python -m
tools.triton.kernel_resources` regenerates the tables (benchmarks/results/offline-sm90/)
and tests/backends/triton/test_triton_attention.py::test_kernels_compile_for_sm90_and_sm80_offline checks the firsts.
"""
from ..runtime import _INTERPRET

# element size (2: fp16/bf16, 4: fp32) -> kernel -> head-dim class -> candidates, best guess first
GPU_CONFIGS = {
    # a trailing "tma": only where the forward reads K / V through TMA (`launch.tma_default`: sm_90+,
    # then every config does); "r<N>": at most N registers per thread (Triton's maxnreg)
    2: {"fwd": {64: [(128, 64, 8, 4), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3),
                     # 128 registers: 2 CTAs per SM (190 without the cap on triton 3.9: 1 CTA); no spill in
                     # the full-tile loop, 18-29 instructions in the partial one (offline sm_90)
                     (128, 64, 8, 4, "r128")],
                # D = 128: the H100 autotuner (triton 3.6, 2026-11-27) picked 64 x 64 on 4 warps for 5 of
                # its 6 kinds of call (dense 4k, causal, window, layout) and 128 x 64 for dense 16k;
                # 128 x 128 (2 stages: no prefetch) never won
                # 128 x 128 on 8 warps with 3 stages fits sm_90 only with TMA (225 KiB, 253 registers, no
                # spill; 27 spill instructions per partial tile without): 0.25 warp instructions per
                # score in its full-tile loop against 0.35 for 64 x 64 (triton 3.9)
                128: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3, "tma")],
                # D = 256: 16-key tiles on 8 warps keep 3 stages without a spill (32-key ones spill)
                256: [(64, 16, 8, 3), (64, 32, 8, 3), (64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2)]},
        # the backward (`bwd_kernel`): (BLOCK_M1, BLOCK_N1) of the dK/dV programs, (BLOCK_M2, BLOCK_N2)
        # of the dQ programs, then the launch's warps and stages
        # "dq5": the five-product backward (`five_product`), last: the offline model
        # (tools/triton/backward_model.py) predicts it slower than the seven-product one on an H100
        # (its fp32 dQ partials: 4 D / BLOCK_N1 bytes per pair written, then read again), so it is
        # there for the GPU autotuner to time, not as a default
        "bwd": {64: [(32, 128, 128, 64, 8, 3), (32, 128, 128, 64, 8, 2), (64, 128, 128, 64, 8, 1),
                     (64, 128, 128, 64, 8, 3), (32, 128, 0, 0, 8, 3, "dq5")],
                # D = 128: 32-row query tiles in the dK/dV programs (S^T, dP^T as 64 x 32 wgmmas; 16 rows
                # gave 64 x 16 ones) and 128 x 64 dQ tiles: the H100 autotuner's pick for every kind of
                # call it timed (MHA); GQA (`GQA_FIRST`) keeps the 16-row tiles first
                128: [(32, 128, 128, 64, 8, 3), (16, 128, 128, 32, 8, 3), (32, 128, 128, 64, 8, 4),
                      (32, 128, 0, 0, 8, 3, "dq5")],
                # D = 256: a 16-row query tile (dK/dV) and 16-key tiles (dQ) make room for 3 stages
                256: [(16, 32, 64, 16, 8, 3), (32, 32, 64, 32, 8, 2), (32, 32, 32, 32, 8, 2),
                      (64, 32, 64, 32, 8, 2)]}},
    # 4-byte (TF32 dots): 16-row query tiles in the dK/dV programs (two fp32 (BLOCK_N1, D)
    # accumulators beside the tiles), 3 stages; at D = 256 no backward on wgmma fits sm_80 without
    # spilling, so its default runs mma.sync (see the README beside the tables)
    4: {"fwd": {64: [(64, 32, 4, 3), (64, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 2)],
                128: [(64, 16, 4, 3), (64, 32, 8, 3), (64, 32, 4, 2), (64, 64, 4, 2)],
                256: [(64, 16, 8, 3), (64, 16, 8, 2), (32, 32, 4, 2), (64, 32, 4, 1)]},
        "bwd": {64: [(16, 128, 64, 32, 8, 3), (16, 64, 64, 64, 4, 3), (64, 64, 64, 64, 4, 2),
                     (64, 128, 128, 64, 8, 2)],
                128: [(16, 32, 64, 16, 8, 3), (16, 32, 64, 16, 4, 3), (32, 64, 64, 32, 4, 2),
                      (32, 128, 128, 32, 8, 2)],
                256: [(16, 16, 32, 16, 8, 3), (16, 32, 32, 16, 8, 3), (16, 32, 32, 32, 4, 1),
                      (32, 32, 32, 32, 4, 2)]}},
}
# One config under the interpreter; tiles differ between passes so that the transposed tile
# plans are exercised with other sizes than the forward's.
INTERPRET_CONFIGS = {"fwd": (32, 32, 4, 1), "bwd": (16, 32, 32, 16, 4, 1)}


def head_class(block_d: int) -> int:
    return 64 if block_d <= 64 else (128 if block_d <= 128 else 256)


# (kernel, head class, element size) -> the first candidate when G = H / Hkv > 1: the query-head
# count is then a runtime value in the backward (MHA's G = 1 is a constant Triton specializes on),
# and the 32-row dK/dV tiles spill more in their loops (offline sm_90, triton 3.6: 17 spill
# instructions per iteration against 0 for 16 rows); the GPU run timed MHA only
GQA_FIRST = {("bwd", 128, 2): (16, 128, 128, 32, 8, 3)}


def candidates(kind: str, head_class: int, element_size: int, gqa: bool = False):
    """The GPU configs tried for `kind` ("fwd", "bwd"), best guess first (``gqa``: for G > 1)."""
    cands = GPU_CONFIGS[4 if element_size >= 4 else 2][kind][head_class]
    first = GQA_FIRST.get((kind, head_class, 2 if element_size < 4 else 4)) if gqa else None
    return cands if first is None else [first] + [c for c in cands if c != first]


# the five-product backward's (`five_product`) dQ partials: at most this many bytes (fp32, one
# (B, H, Lq, D) slot per key tile); calls needing more take the seven-product configs
DQ5_MAX_BYTES = 2 << 30


def five_product(cfg) -> bool:
    """Whether backward config ``cfg`` is the five-product backward (tag ``"dq5"`` after the six
    numbers): the dK/dV programs also write dQ partials, no dQ programs (`bwd_kernel`'s ``FIVE``)."""
    return "dq5" in cfg[6:]


def five_fits(partial_shape) -> bool:
    """Whether a five-product backward's fp32 dQ partial buffer of ``partial_shape`` stays within
    ``DQ5_MAX_BYTES``."""
    n = 4
    for s in partial_shape:
        n *= s
    return n <= DQ5_MAX_BYTES


def delta_block(block_dv: int) -> int:
    """Rows per program of the Delta kernel: a (block, Dv) tile of O and of dO each; launched with
    Triton's default warps (4) and stages (3)."""
    return 32 if _INTERPRET or block_dv > 128 else 64
