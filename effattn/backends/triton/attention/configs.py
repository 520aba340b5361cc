"""Kernel configs: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, BLOCK_M the query tile and BLOCK_N
the key tile; the backward's (one launch of two kinds of programs) are
``(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)``: the dK/dV programs' tiles, then
the dQ programs'.

A few candidates per kernel, head-dim class (the larger of D and Dv, padded to a power of two) and
element size, autotuned once per kind of call on the GPU (`launch`). The first of each list is the
untimed default (``EFFATTN_TRITON_AUTOTUNE=0``, CUDA-graph capture): it must fit sm_80's shared
memory, and on sm_90 use wgmma without spilling in its tile loops. Why each list is what it is (the
offline compiles behind it) is in docs/design/triton-configs.md; `python -m
tools.triton.kernel_resources` regenerates the tables (benchmarks/results/offline-sm90/)
and tests/backends/triton/test_triton_attention.py::test_kernels_compile_for_sm90_and_sm80_offline checks the firsts.
"""
from ..runtime import _INTERPRET

# element size (2: fp16/bf16, 4: fp32) -> kernel -> head-dim class -> candidates, best guess first
GPU_CONFIGS = {
    2: {"fwd": {64: [(128, 64, 8, 4), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
                128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
                # D = 256: 16-key tiles on 8 warps keep 3 stages without a spill (32-key ones spill)
                256: [(64, 16, 8, 3), (64, 32, 8, 3), (64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2)]},
        # the backward (`bwd_kernel`): (BLOCK_M1, BLOCK_N1) of the dK/dV programs, (BLOCK_M2, BLOCK_N2)
        # of the dQ programs, then the launch's warps and stages
        "bwd": {64: [(32, 128, 128, 64, 8, 3), (32, 128, 128, 64, 8, 2), (64, 128, 128, 64, 8, 1),
                     (64, 128, 128, 64, 8, 3)],
                128: [(16, 128, 128, 32, 8, 3), (32, 128, 128, 32, 8, 2), (32, 128, 128, 32, 8, 1),
                      (16, 128, 128, 32, 8, 2), (32, 128, 128, 64, 8, 3)],
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


def candidates(kind: str, head_class: int, element_size: int):
    """The GPU configs tried for `kind` ("fwd", "bwd"), best guess first."""
    return GPU_CONFIGS[4 if element_size >= 4 else 2][kind][head_class]


def delta_block(block_dv: int) -> int:
    """Rows per program of the Delta kernel: a (block, Dv) tile of O and of dO each; launched with
    Triton's default warps (4) and stages (3)."""
    return 32 if _INTERPRET or block_dv > 128 else 64
