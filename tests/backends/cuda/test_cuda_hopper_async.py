"""The emulation of Hopper's asynchronous machinery (csrc/emu/async.h, through csrc/common/prims_async.cuh and
csrc/emu/selftest_async.cpp), against the PTX ISA's and the driver's documented behaviour:

- mbarrier: phase parity (try_wait.parity(P) passes once the phase of parity P completed: right after
  init parity 1 passes, parity 0 waits), the pending arrival count reloaded at each phase, the tx-count
  (arrive.expect_tx adds, complete_tx subtracts, the phase completes only when both reach zero, a
  complete_tx ahead of its expect_tx while an arrival is pending is allowed), and the misuses the ISA
  leaves undefined failing with the reason: tx-count underflow, an arrive with none pending, counts out
  of range, an uninitialized or misaligned mbarrier, a phase that never completes, a tx-count left at
  block end (a phase that completed before its last copy landed, bytes announced that never landed);
- bulk tensor copies: every element of a box at every edge of a 2-D / 3-D / 4-D tensor against a model
  written here (out-of-bounds elements zero, including negative coordinates), the 128-byte swizzle
  (16-byte chunk index XOR row index mod 8), the byte count (always the whole box), the destination
  reading NaN bits until the wait, a wrong expect_tx byte count failing both ways;
- the tensor-map rules of cuTensorMapEncodeTiled (alignment, strides, box sizes, rank);
- setmaxnreg: 384 threads start at 168 registers each; the producer's .dec 24 lets the consumers'
  .inc 240 through; counts outside 24..256 or not a multiple of 8, an .inc below the current count, a
  warpgroup disagreeing, and an .inc the pool can never serve fail with the reason;
- named barriers (bar.sync id, count; bar.arrive id, count): the ping-pong of the Hopper forward's consumer
  warpgroups alternates their turns, and a thread counted twice in one phase (a bar.sync of the pair
  removed) or arrivals left at block end (a bar.arrive nobody waits for) fail with the reason.
"""
import itertools
import shutil

import pytest

from tests.conftest import selftest_runner

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.fixture(scope="module")
def selftest():
    return selftest_runner("selftest_async.cpp")


def lines(res):
    assert res.returncode == 0, res.stderr
    return {ln.split()[0]: [int(x) for x in ln.split()[1:]] for ln in res.stdout.splitlines() if ln != "no abort"}


def test_mbarrier_phase_parity(selftest):
    """Two arrivals per phase: [try_wait(0), try_wait(1), token] after init and each arrive."""
    out = lines(selftest("phases"))
    assert out["init"] == [0, 1]
    assert out["arrive1"] == [0, 1, 0]          # one arrival pending: phase 0 runs
    assert out["arrive2"] == [1, 0, 0]          # phase 0 complete, phase 1 (parity 1) runs
    assert out["arrive3"] == [1, 0, 1]
    assert out["arrive4"] == [0, 1, 1]          # phase 1 complete, parity back to 0
    assert out["arrive5"] == [0, 1, 0]


def test_mbarrier_transaction_count(selftest):
    out = lines(selftest("tx"))
    assert out["expect"] == [0, 256] and out["half"] == [0, 128] and out["full"] == [1, 0]
    out = lines(selftest("tx-early"))            # bytes before the expect_tx: allowed while an arrival is pending
    assert out["early"] == [0, -64] and out["expect"] == [1, 0]


MBAR_MISUSE = {
    "bug-tx-underflow": "tx-count underflow: 28 bytes more landed than the phase expects",
    # a tx-count left at block end: the phase completed before its last copy landed (an expect_tx one tile
    # short), or announced bytes never landed
    "bug-tx-past-phase": "at tx-count -64: more bytes landed than its expect_tx announced",
    "bug-tx-never-lands": "at tx-count 64: bytes its expect_tx announced never landed",
    "bug-arrive-none-pending": "mbarrier.arrive with no arrival pending",
    "bug-expect-tx-range": "byte count outside 0..2^20-1",
    "bug-init-count-0": "arrival count outside 1..2^20-1",
    "bug-init-count-2^20": "arrival count outside 1..2^20-1",
    "bug-uninitialized": "mbarrier used before mbarrier.init",
    "bug-misaligned": "mbarrier is not 8-byte aligned",
    "bug-never-completes": "never completes (1 arrivals of 2 pending, tx-count 0)",
}



def swizzled(offset, width):
    """The shared-memory byte offset where box byte `offset` lands (destination 1024-byte aligned): the
    16-byte chunk bits 4.. XORed with the row bits 7.. (3 bits for 128B, 2 for 64B, 1 for 32B)."""
    if width == 0:
        return offset
    bits = {128: 7, 64: 3, 32: 1}[width]
    return offset ^ (((offset >> 7) & bits) << 4)


def expected_box(dims, strides, box, coord, width):
    """The destination's 16-bit elements in address order: element i of the tensor's buffer holds
    i % 65521 + 1; box element e (dimension 0 fastest) lands at swizzled(2 e), zero out of bounds."""
    n = 1
    for b in box:
        n *= b
    out = [None] * n
    for e, idx in enumerate(itertools.product(*[range(b) for b in reversed(box)])):
        idx = idx[::-1]
        x = [c + i for c, i in zip(coord, idx)]
        inside = all(0 <= xi < d for xi, d in zip(x, dims))
        val = (sum(xi * s for xi, s in zip(x, strides)) % 65521 + 1) if inside else 0
        out[swizzled(2 * e, width) // 2] = val
    return out


def tma_args(swz, dims, strides, box, coord):
    return ["tma", swz, len(dims), *dims, *strides[1:], *box, *coord]


# (swizzle, dims, element strides, box, coordinates): corners and edges, negative coordinates, a box
# larger than the tensor, strides with padding, 3-D and 4-D
TMA_CASES = {
    "2d-inside": (0, (40, 30), (1, 48), (16, 8), (8, 4)),
    "2d-top-left-negative": (0, (10, 7), (1, 16), (8, 4), (-3, -2)),
    "2d-bottom-right": (0, (10, 7), (1, 16), (8, 4), (6, 5)),
    "2d-bottom-left": (0, (10, 7), (1, 16), (8, 4), (-5, 5)),
    "2d-top-right": (0, (10, 7), (1, 16), (8, 4), (6, -1)),
    "2d-box-beyond-all": (0, (5, 3), (1, 8), (16, 8), (-4, -2)),
    "2d-fully-outside": (0, (10, 7), (1, 16), (8, 4), (16, 0)),
    "3d-edges": (0, (24, 9, 3), (1, 32, 320), (8, 4, 2), (20, 7, 2)),
    "3d-negative-depth": (0, (24, 9, 3), (1, 24, 216), (8, 4, 2), (0, 0, -1)),
    "4d-kv-tile": (0, (40, 50, 2, 2), (1, 48, 2400, 4800), (8, 16, 1, 1), (32, 40, 1, 1)),
    "2d-swizzle128": (128, (64, 20), (1, 64), (64, 8), (0, 16)),
    "2d-swizzle128-partial": (128, (40, 20), (1, 48), (64, 16), (0, 10)),
    "3d-swizzle128-head-dim-128": (128, (128, 70, 2), (1, 128, 8960), (64, 16, 1), (64, 64, 1)),
    "2d-swizzle64": (64, (32, 12), (1, 40), (32, 8), (-8, 6)),
}


@pytest.mark.parametrize("case", list(TMA_CASES))
def test_bulk_tensor_copy_against_the_model(selftest, case):
    swz, dims, strides, box, coord = TMA_CASES[case]
    res = selftest(*tma_args(swz, dims, strides, box, coord))
    out = lines(res)
    n = 1
    for b in box:
        n *= b
    assert out["expect_tx"] == [2 * n]                 # the whole box's bytes, out-of-bounds ones included
    assert out["poisoned"] == [n]                      # NaN bits until the mbarrier wait
    assert out["box"] == expected_box(dims, strides, box, coord, swz)


def test_the_model_zero_fills_where_the_tensor_ends():
    """The model itself: a box past the right edge is zero exactly there."""
    got = expected_box((10, 7), (1, 16), (8, 1), (6, 0), 0)
    assert got == [7, 8, 9, 10, 0, 0, 0, 0]


TMA_MISUSE = {
    ("bug-tma-expect", -16): "tx-count underflow: 16 bytes more landed",
    ("bug-tma-expect", 16): "never completes (0 arrivals of 1 pending, tx-count 16)",
    ("bug-tma-unwaited", 0): "bulk tensor copies in flight",
    ("bug-tma-misaligned", 0): "shared destination is not 128-byte aligned",
}


@pytest.mark.parametrize("scenario, delta", list(TMA_MISUSE))
def test_bulk_copy_misuse_fails_with_the_reason(selftest, scenario, delta):
    res = selftest(scenario, 0, 2, 10, 7, 16, 8, 4, 0, 0, delta)
    assert res.returncode != 0
    assert TMA_MISUSE[scenario, delta] in res.stderr, res.stderr


MAP_REFUSALS = {
    "map-misaligned-base": "global address is not 16-byte aligned",
    "map-stride": "global stride is not a multiple of 16 bytes",
    "map-box-257": "box dimension outside 1..256",
    "map-inner-bytes": "inner box dimension is not a multiple of 16 bytes",
    "map-swizzle-width": "swizzled box row must be exactly the swizzle width",
    "map-rank-6": "rank outside 1..5",
    "map-dim-0": "dimension outside 1..2^32",
}


@pytest.mark.parametrize("which", list(MAP_REFUSALS))
def test_tensor_map_refusals(selftest, which):
    res = selftest(which)
    assert res.returncode == 0 and MAP_REFUSALS[which] in res.stdout, res.stdout


def test_setmaxnreg_moves_registers_from_producer_to_consumers(selftest):
    out = lines(selftest("regs"))
    assert out["start"] == [168, 168, 168]            # 65536 / 384 rounded down to a multiple of 8
    assert out["end"] == [240, 240, 24]                # 2 x 128 x 240 + 128 x 24 <= 384 x 168


REGS_MISUSE = {
    "bug-regs-pool": "waits in setmaxnreg.inc 240 for registers the CTA's pool never has",
    "bug-regs-multiple": "outside 24..256 or not a multiple of 8",
    "bug-regs-range": "outside 24..256 or not a multiple of 8",
    "bug-regs-range-high": "outside 24..256 or not a multiple of 8",
    "bug-regs-inc-below": "setmaxnreg.inc below the warpgroup's current register count",
    "bug-regs-divergent": "threads of a warpgroup execute different setmaxnreg instructions",
}



@pytest.mark.parametrize("scenario", [*MBAR_MISUSE, *REGS_MISUSE])
def test_mbarrier_and_setmaxnreg_misuse_fails_with_the_reason(selftest, scenario):
    res = selftest(scenario)
    assert res.returncode != 0 and "no abort" not in res.stdout
    assert {**MBAR_MISUSE, **REGS_MISUSE}[scenario] in res.stderr, res.stderr


def test_named_barriers(selftest):
    assert lines(selftest("named"))["passes"] == [1]
    res = selftest("bug-named-count")
    assert res.returncode != 0 and "give different counts" in res.stderr
    res = selftest("bug-named-short")
    assert res.returncode != 0 and "named barrier 2 for 256 threads that never all arrive" in res.stderr


def test_named_barrier_ping_pong_alternates_and_its_misuse_fails(selftest):
    assert lines(selftest("pingpong", "4"))["order"] == [0, 1] * 4
    res = selftest("bug-pingpong-no-sync", "4")
    assert res.returncode != 0 and "a thread arrives twice at one phase of named barrier" in res.stderr, \
        res.stderr
    res = selftest("bug-pingpong-extra-arrive", "4")
    assert res.returncode != 0 and "the block ends with 128 of 256 threads arrived at named barrier 2" in res.stderr, \
        res.stderr
