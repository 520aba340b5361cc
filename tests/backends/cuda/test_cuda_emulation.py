"""The host emulation of the CUDA primitives (csrc/emu/), through its self-test program
(csrc/emu/selftest.cpp, built with g++ here):

- the fragment maps equal the PTX ISA's tables for mma.m16n8k16 (16-bit inputs) and ldmatrix,
  written out below from the ISA's text and, independently, from CuTe's MMA_Traits layouts;
- mma through ldmatrix computes A B; the XOR swizzle takes ldmatrix to one wavefront per phase;
- planted mistakes abort (misaligned addresses, copies never waited for, deadlocked barriers,
  divergent collectives, shared memory out of bounds) or read NaN (a wrong wait count, a missing
  barrier) under every schedule;
- the attention kernels (and the Hopper forward) run clean under AddressSanitizer and UBSan on
  exact-size buffers.
"""
import ctypes
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import CSRC, fragment_maps, run_sanitized, selftest_runner

SCHEDULES = {"lockstep": 0, "warp-serial": 1, "warp-serial-reversed": 2}

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.fixture(scope="module")
def selftest():
    return selftest_runner("selftest.cpp")


# ------------------------------------------------------------------------- the ISA's fragment tables

def isa_tables():
    """{(kind, lane, ...): (row, col)} from the PTX ISA, "Matrix Fragments for mma.m16n8k16 with
    floating point type" (elements a0..a7, b0..b3, c0..c3 of a thread) and "ldmatrix"."""
    t = {}
    for lane in range(32):
        group, tig = lane // 4, lane % 4
        for i in range(8):             # a_i: register i // 2, half i % 2
            row = group if (i < 2 or 4 <= i < 6) else group + 8
            col = tig * 2 + (i & 1) + (8 if i >= 4 else 0)
            t[("A", lane, i // 2, i % 2)] = (row, col)
        for i in range(4):             # b_i: row = k, col = n
            row = tig * 2 + (i & 1) + (8 if i >= 2 else 0)
            t[("B", lane, i // 2, i % 2)] = (row, group)
        for i in range(4):
            t[("C", lane, i)] = (group if i < 2 else group + 8, tig * 2 + (i & 1))
        for e in range(2):             # ldmatrix: a thread holds 2 consecutive elements of a row
            t[("L", lane, 0, e)] = (group, 2 * tig + e)
            t[("L", lane, 1, e)] = (2 * tig + e, group)      # .trans: of a column
    return t


def cute_tables():
    """The same maps from CuTe's SM80_16x8x16_F32BF16BF16F32_TN traits: (thread, value) layouts into
    column-major (M, K), (N, K) and (M, N) tiles, thread = t0 + 4 t1, value = v0 + 2 v1 (+ 4 v2)."""
    t = {}
    for lane in range(32):
        t0, t1 = lane % 4, lane // 4
        for v in range(8):             # ALayout ((4, 8), (2, 2, 2)) : ((32, 1), (16, 8, 128)), M = 16
            v0, v1, v2 = v % 2, (v // 2) % 2, v // 4
            idx = 32 * t0 + t1 + 16 * v0 + 8 * v1 + 128 * v2
            t[("A", lane, v // 2, v % 2)] = (idx % 16, idx // 16)
        for v in range(4):             # BLayout ((4, 8), (2, 2)) : ((16, 1), (8, 64)), N = 8
            v0, v1 = v % 2, v // 2
            idx = 16 * t0 + t1 + 8 * v0 + 64 * v1
            t[("B", lane, v // 2, v % 2)] = (idx // 8, idx % 8)
        for v in range(4):             # CLayout ((4, 8), (2, 2)) : ((32, 1), (16, 8)), M = 16
            v0, v1 = v % 2, v // 2
            idx = 32 * t0 + t1 + 16 * v0 + 8 * v1
            t[("C", lane, v)] = (idx % 16, idx // 16)
    return t


def test_fragment_maps_match_the_ptx_isa_and_cute(selftest):
    res = selftest("maps")
    assert res.returncode == 0, res.stderr
    got = fragment_maps(res.stdout)
    isa = isa_tables()
    assert set(got) == set(isa)
    assert {k: v for k, v in got.items() if isa[k] != v} == {}
    cute = cute_tables()
    assert {k: v for k, v in cute.items() if got[k] != v} == {}
    # every element of each operand is held by exactly one (lane, register, half)
    for kind, n in (("A", 256), ("B", 128), ("C", 128)):
        assert len({v for k, v in got.items() if k[0] == kind}) == n


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_mma_through_ldmatrix_is_a_matmul(selftest, dtype):
    res = selftest(f"mma-{dtype}")
    assert res.returncode == 0, res.stderr
    err = float(res.stdout.split()[1])
    assert err < 1e-5, err          # exact products, an fp32 sum of 16 terms of size ~1


def test_swizzle_takes_ldmatrix_to_one_wavefront_per_phase(selftest):
    plain = selftest("bank-plain").stdout.split()
    swz = selftest("bank-swizzled").stdout.split()
    assert plain[5] == "8", plain    # rows 128 bytes apart all hit one bank group
    assert swz[5] == "1" and swz[1] == swz[3], swz


PLANTED = {
    "bug-misaligned-ldmatrix": "ldmatrix row address is not 16-byte aligned",
    "bug-misaligned-cp-async": "cp.async global source is not 16-byte aligned",
    "bug-unwaited-copy": "thread exits with cp.async copies it never waited for",
    "bug-barrier-skipped": "deadlock: a thread waits at a barrier",
    "bug-divergent-shuffle": "deadlock: a lane waits in a warp collective",
    "bug-smem-out-of-bounds": "outside the block's shared memory",
}


@pytest.mark.parametrize("scenario", list(PLANTED))
def test_planted_mistakes_abort_with_a_message(selftest, scenario):
    res = selftest(scenario)
    assert res.returncode != 0 and "no abort" not in res.stdout
    assert PLANTED[scenario] in res.stderr, res.stderr


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_copies_land_only_at_their_wait_and_barrier(selftest, schedule):
    """Reading another warp's cp.async destination with a wait count one too high, or without the
    barrier after the wait, reads the NaN poison; the correct sequence reads none."""
    nan = {}
    for scenario in ("bug-wait-count", "bug-missing-barrier", "correct-copy"):
        res = selftest(scenario, SCHEDULES[schedule])
        assert res.returncode == 0, res.stderr
        nan[scenario] = int(res.stdout.split()[1])
    assert nan["bug-wait-count"] > 0 and nan["bug-missing-barrier"] > 0 and nan["correct-copy"] == 0, nan


@pytest.mark.parametrize("schedule", ["lockstep", "warp-serial"])
def test_attention_kernels_under_address_and_ub_sanitizers(schedule):
    """Forward and backward (padding mask, window, dropout, GQA, Lq != Lk, head dims 8..64) on
    heap buffers of exactly the tensors' size: any read or write past them is reported."""
    out = run_sanitized("selftest.cpp", "attention", SCHEDULES[schedule])
    assert out.count("nan=0") == 3, out
    assert out.count("sm90 forward: 0 elements differ") == 2, out         # the cp.async kernel: bitwise
    assert out.count("sm90 tma forward: 0 elements off") == 2, out        # the TMA kernel: a few bf16 units


def test_decode_kernels_under_address_and_ub_sanitizers():
    """The split-KV decode and combine kernels (packed GQA rows, one split, several, more splits
    than key tiles, two row tiles) on heap buffers of exactly the tensors' size."""
    out = run_sanitized("selftest.cpp", "decode", SCHEDULES["warp-serial"])
    assert out.count("nan=0") == 3, out


@pytest.mark.parametrize("schedule", ["lockstep", "warp-serial"])
def test_failures_are_exceptions_with_their_reason(selftest, schedule):
    """Each planted mistake (and a launch over the shared-memory limit) raises emu::Failure from the
    launch, with the message that names the thread; the emulator then runs a correct kernel. Through
    torch the same exception is a RuntimeError of the op (a test failure naming the reason, not a
    killed test process: tests/backends/cuda/test_cuda_resources.py)."""
    res = selftest("caught", SCHEDULES[schedule])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "after: ok" in lines and not any(line.startswith("not caught") for line in lines), lines
    got = [line for line in lines if line.startswith("caught: effattn emulator: ")]
    for scenario, message in PLANTED.items():
        assert any(message in line for line in got), (scenario, got)
    assert any("launch asks for 1040 bytes of shared memory per block, the device allows 1024" in line
               for line in got), got


def test_failures_leave_no_leak_or_stale_state_under_sanitizers():
    """The abandoned fibers of a failed block are released (AddressSanitizer's leak check passes)."""
    out = run_sanitized("selftest.cpp", "caught", SCHEDULES["warp-serial"])
    assert out.count("caught: ") == len(PLANTED) + 1 and "after: ok" in out, out


def test_concurrent_kernel_builds_compile_each_unit_once(tmp_path):
    """Two processes (pytest-xdist's workers) asking for the same emulated kernels at once: one builds,
    the other waits on the cache folder's lock and loads the result (no unit compiled twice). A
    csrc/ of two one-line units and three generated ones (inst/: the first two of one head dim and
    dtype, compiled as one unit that includes both), through a compiler wrapper that logs its compiles."""
    for rel, text in (("op/a.cu", "int a() { return 1; }\n"), ("emu/api.cpp", "int api() { return 2; }\n"),
                      ("op/inst/k_1_a_x.cu", 'extern "C" int k1x() { return 3; }\n'),
                      ("op/inst/k_1_a_y.cu", 'extern "C" int k1y() { return 4; }\n'),
                      ("op/inst/k_2_a_x.cu", 'extern "C" int k2x() { return 5; }\n')):
        (tmp_path / "csrc" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "csrc" / rel).write_text(text)
    log, cxx = tmp_path / "compiles.log", tmp_path / "cxx.sh"
    cxx.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo "$*" >> {log}; sleep 3;; esac\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    env = dict(os.environ, EFFATTN_CSRC=str(tmp_path / "csrc"), EFFATTN_CUDA_EMU_DIR=str(tmp_path / "cache"),
               CXX=str(cxx), PYTHONPATH=os.path.dirname(CSRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "from effattn.backends.cuda import _ext; print(_ext.build_kernels())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    libs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and libs[0] == libs[1] and os.path.exists(libs[0]), libs
    assert len(log.read_text().splitlines()) == 4, log.read_text()
    lib = ctypes.CDLL(libs[0])
    assert (lib.k1x(), lib.k1y(), lib.k2x()) == (3, 4, 5)
