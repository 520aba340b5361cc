"""Offline checks of the CUDA kernels' build (no GPU needed, only nvcc), forward units:

- every csrc/{attention,linear}/*.cu compiles on its own (no torch) for sm_80 and sm_90a (this module:
  the forward's dispatch attention/fwd.cu, a set of its generated instances attention/inst/*.cu, and
  attention/fwd_sm90.cu; test_cuda_build_bwd.py: the backward and the bias-term
  units; test_cuda_build_more.py: decode and linear attention; nvcc_units.py: what they share);
- ptxas reports no spills, registers under the cap, and a kernel count within the budget;
- the SASS uses the tensor-core and async-copy instructions the source asks for (HMMA, LDSM,
  LDGSTS; HGMMA in the Hopper forward's sm_90a code), read with cuobjdump from PyPI's
  nvidia-cuda-cuobjdump wheel (nvcc 13's own toolkit here has none).
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

from effattn.backends.cuda import resources
from tests.backends.cuda.nvcc_units import (
    ARCHS,
    CSRC,
    KERNEL_BUDGET,
    MAX_REGISTERS,
    NVCC,
    Units,
    check_spills_and_budget,
    compile_unit,
    functions,
    kernel_sources,
    needs_nvcc,
    ptxas_entries,
    sass_of,
    tile_loop,
)

MASK_KINDS = 3               # Hopper forward instances per bucket and dtype: kDense, kWindow, kAny (common.cuh)
# the mma.sync forward: one generated unit per (bucket, dtype, mask kind, dropout) (attention/inst/); compiled
# here: every (kind, dropout) at head dim 128 bf16, the biggest (head dim 256, kAny with dropout), the
# smallest (head dim 32 fp16, kDense without) and kLayout's 128-row instance at head dim 64
KIND_NAMES = ("dense", "window", "any", "causal", "layout")        # MaskKind 0..4
INSTANCES = tuple(f"attention/inst/fwd_128_bf16_{k}_{d}.cu" for k in KIND_NAMES for d in ("nodrop", "drop")) + (
    "attention/inst/fwd_256_bf16_any_drop.cu", "attention/inst/fwd_32_fp16_dense_nodrop.cu",
    "attention/inst/fwd_64_bf16_layout_nodrop.cu")


def instance_shapes(hd, kind, drop):
    """The (rows per warp, key tile argument KT) of the kernels a generated forward unit holds (launch.cuh `fwd`),
    sorted: 32 (128-row tiles) up to head dim 128, 16 (64-row tiles) at head dim 256 and as the second instance
    of kAny and kLayout up to head dim 128; at head dim 128 the dense, causal and window units without dropout
    hold 128 x 32 and 128 x 64 (KT 64, launch.cuh kLongKeys), the layout unit without dropout 128 x 64 as its
    128-row one, the layout unit with dropout none."""
    if hd > 128:
        return [(16, 0)]
    if hd == 128 and kind in ("dense", "causal", "window") and drop == "nodrop":
        return [(32, 0), (32, 64)]
    if hd == 128 and kind == "layout":
        return [(16, 0)] if drop == "drop" else [(16, 0), (32, 64)]
    return [(16, 0), (32, 0)] if kind in ("any", "layout") else [(32, 0)]
# attention/fwd_sm90.cu: the Hopper forward, head dims 64 and 128 x 2 dtypes, per arch (outside sm_90a
# empty stubs the launcher never starts); two warpgroups and one block per SM, so up to 255 registers
# (181 at head dim 128 for kDense, 2026-11-27, nvcc 13.0)
HOPPER_KERNELS = 4 * MASK_KINDS
HOPPER_MAX_REGISTERS = 255
FORWARD_UNITS = ("attention/fwd_sm90.cu", *INSTANCES)

pytestmark = needs_nvcc


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return Units(tmp_path_factory.mktemp("nvcc"))


@pytest.mark.parametrize("src", FORWARD_UNITS)
def test_no_spills_registers_under_cap_and_kernel_budget(compiled, src):
    check_spills_and_budget(compiled, src)


def test_forward_dispatch_unit_holds_no_kernel(compiled):
    """attention/fwd.cu only dispatches: it sees the launchers' declarations, so every kernel is
    compiled in its own generated unit."""
    assert ptxas_entries(compiled["attention/fwd.cu"][0]) == []


def instance_keys(name):
    """The key tile template argument (KT) of a mangled attn_fwd_kernel name: 64 for the 128 x 64 tile, 0 for
    the default (FwdConfig)."""
    m = re.search(r"attn_fwd_kernelILi\d+E.*NS_11StridedRowsELi(\d+)E", name)
    return int(m.group(1)) if m else 0


def instance_args(name):
    """(head dim, bf16, mask kind, TERMS, RELK, dropout, rows per warp) of a mangled attn_fwd_kernel name."""
    m = re.search(r"attn_fwd_kernelILi(\d+)ELb([01])ELi(\d)ELb([01])ELb([01])ELb([01])ELi(16|32)E", name)
    return tuple(map(int, m.groups()))


def test_each_instance_unit_builds_its_own_kernel_without_bias_terms(compiled):
    """Each generated unit holds one kernel per arch, the one its file name says (head dim, dtype, mask
    kind, dropout); none carries the bias-tensor code or the relative keys' (template flags TERMS and
    RELK: those instances live in attention/terms.cu and attention/relkeys.cu, so a call without those
    terms runs kernels without their code)."""
    for src in INSTANCES:
        _, hd, dtype, kind, drop = os.path.basename(src)[:-3].split("_")
        entries = ptxas_entries(compiled[src][0])
        shapes = instance_shapes(int(hd), kind, drop)
        assert sorted(e[0] for e in entries) == sorted(ARCHS * len(shapes)), (src, entries)
        for arch in ARCHS:
            got = sorted((instance_args(e[1])[6], instance_keys(e[1])) for e in entries if e[0] == arch)
            assert got == shapes, (src, arch, got)
        for e in entries:
            assert instance_args(e[1])[:6] == (int(hd), int(dtype == "bf16"), KIND_NAMES.index(kind), 0, 0,
                                               int(drop == "drop")), (src, e[1])
            assert "NS_11StridedRowsE" in e[1], e[1]    # strided rows (the paged policy: paged_prefill.cu)


def test_sass_uses_tensor_cores_ldmatrix_and_async_copies(compiled):
    for arch in ARCHS:
        for src in INSTANCES:
            _, hd, _, kind, drop = os.path.basename(src)[:-3].split("_")
            bodies = functions(sass_of(compiled[src][1], arch), "attn_fwd_kernel")
            assert len(bodies) == len(instance_shapes(int(hd), kind, drop)), (arch, src, len(bodies))
            for body in bodies:
                for op in ("HMMA.16816.F32", "LDSM.16.M88.4", "LDGSTS", "LDSM.16.MT88.4"):   # MT88: V's .trans loads
                    assert op in body, (arch, src, op)


def test_hopper_forward_is_wgmma_on_sm90a_only(compiled):
    """The Hopper forward's sm_90a SASS multiplies on HGMMA (64x64 for S, 64xHD for P V) between
    warpgroup arrive / wait, loads with LDGSTS and uses no HMMA; its sm_80 build is empty stubs."""
    report, obj = compiled["attention/fwd_sm90.cu"]
    entries = [e for e in ptxas_entries(report) if "attn_fwd_sm90_kernel" in e[1]]
    for arch in ARCHS:
        assert len([e for e in entries if e[0] == arch]) == HOPPER_KERNELS, arch
    assert max(e[2] for e in entries if e[0] == "sm_90a") <= HOPPER_MAX_REGISTERS, entries
    sass = sass_of(obj, "sm_90a")
    bodies = {b.split("\n", 1)[0]: b for b in sass.split("Function : ")[1:] if "attn_fwd_sm90_kernel" in b[:200]}
    assert len(bodies) == HOPPER_KERNELS
    for name, body in bodies.items():
        hd = 128 if "ILi128E" in name else 64
        bf16 = "Lb1E" in name
        for op in ("HGMMA.64x64x16.F32", f"HGMMA.64x{hd}x16.F32", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR",
                   "LDGSTS", "FENCE.VIEW.ASYNC.S"):
            assert op in body, (name, op)
        assert ("HGMMA.64x64x16.F32.BF16" in body) == bf16, name
        assert "HMMA" not in body.replace("HGMMA", ""), name
    assert "HGMMA" not in sass_of(obj, "sm_80")


def test_hopper_forward_pipeline_in_its_sass(compiled):
    """The Hopper forward's key-tile loop (sm_90a SASS): S(t) and P(t - 1) V(t - 1) issued back to back
    and the warps wait for S only (WARPGROUP.DEPBAR.LE gsb0, 0x1) before the softmax; one block barrier
    per key tile (two on masked tiles: the zeroed V rows, not in kDense); the copies of K(t + 1) and
    V(t) unrolled with addresses computed before the loop (no loop nested in it; K and V: 2 x 64 rows x
    HD / 8 chunks over 256 threads); ptxas does not serialize the wgmma (its C7514 advisory)."""
    report, obj = compiled["attention/fwd_sm90.cu"]
    assert "wgmma.mma_async instructions are serialized" not in report, report[-3000:]
    for name, body in ((b.split("\n", 1)[0], b) for b in functions(sass_of(obj, "sm_90a"), "attn_fwd_sm90_kernel")):
        hd = 128 if "ILi128E" in name else 64
        kind = int(re.search(r"Lb[01]ELi([012])E", name).group(1))
        loop = tile_loop(body)
        assert loop is not None, name
        assert {m.split(".F32")[0] for m in loop["mma"]} == {"HGMMA.64x64x16", f"HGMMA.64x{hd}x16"}, (name, loop)
        assert len(loop["mma"]) == hd // 16 + 64 // 16, (name, loop)
        assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in loop["wg_waits"], (name, loop["wg_waits"])
        assert loop["ldgsts"] == 2 * 64 * (hd // 8) // 256, (name, loop)
        if kind == 0:
            assert loop["barriers"] == 1 and loop["inner_loops"] == 0, (name, loop)
        assert loop["barriers"] <= 2, (name, loop)


def test_mma_sync_forward_two_barriers_per_key_tile(compiled):
    """The mma.sync forward's key-tile loop (SASS, both archs): two block barriers per tile in every
    instance (FA-2's "K ready" and "V ready"; the unseen V rows are zeroed before the second by the
    threads that copied them), and the tile's HMMA: per warp, MB row blocks x (Q K^T + P V) over the
    bucket's 16-wide steps and the key tile. The K and V copies are straight-line (TileCopy, common/tiles.cuh:
    each thread's addresses computed once per block): one LDGSTS per 16-byte copy of the tile's K and V, and
    kDense's loop holds no inner loop (load_tile's copy loops were two, each unrolled 4 times plus the rest)."""
    for arch in ARCHS:
        for body in (b for src in INSTANCES for b in functions(sass_of(compiled[src][1], arch), "attn_fwd_kernel")):
            name = body.split("\n", 1)[0]
            args = instance_args(name)
            hd, wm = args[0], args[6]
            loop = tile_loop(body, mma="HMMA")
            assert loop is not None, name
            assert loop["barriers"] == 2, (arch, name, loop["barriers"])
            bn = instance_keys(name) or resources.fwd_key_tile(hd, 4 * wm)
            assert len(loop["mma"]) == (wm // 16) * 2 * (hd // 16) * (bn // 16) * 2, (arch, name, len(loop["mma"]))
            assert loop["ldgsts"] == 2 * bn * hd // 8 // 128, (arch, name, loop["ldgsts"])
            if args[2] == 0:                               # kDense: no masked tile, no zero_unseen loop
                assert loop["inner_loops"] == 0, (arch, name, loop["inner_loops"])


def test_only_dropout_instances_carry_dropout_code_and_dense_is_short(compiled):
    """One forward instance per mask kind and dropout flag: the mma.sync forward's SASS holds Philox's
    multipliers exactly when its DROP flag is set (the Hopper forward's: kAny only), and the kDense
    listing without dropout is under two thirds of kAny's without dropout (the Hopper forward's: of kAny's)."""
    for arch in ARCHS:
        bodies = {}
        for src in FORWARD_UNITS:
            if arch == "sm_80" and src == "attention/fwd_sm90.cu":
                continue                                   # the Hopper kernels are stubs there
            bodies.update({b.split("\n", 1)[0]: b for b in sass_of(compiled[src][1], arch).split("Function : ")[1:]
                           if "attn_fwd" in b[:200]})
        for name, body in bodies.items():
            philox = "0xd2511f53" in body.lower()
            if "sm90" in name:
                kind = int(re.search(r"Lb[01]ELi([012])E", name).group(1))
                assert philox == (kind == 2), (arch, name)
                if kind == 0:
                    anyk = bodies[name.replace("ELi0E", "ELi2E")]
                    assert 3 * body.count("\n") < 2 * anyk.count("\n"), (arch, name)
                continue
            hd, bf16, kind, _, _, drop, wm = instance_args(name)
            assert philox == bool(drop), (arch, name)
            if kind == 0 and not drop and hd == 128:          # against kAny's instance of the same tile
                anyk = next(b for n, b in bodies.items()
                            if "sm90" not in n and instance_args(n) == (hd, bf16, 2, 0, 0, 0, wm))
                assert 3 * body.count("\n") < 2 * anyk.count("\n"), (arch, name)


def test_header_the_binding_includes_is_host_cpp(tmp_path):
    """setup.py compiles csrc/binding/*.cpp with the host compiler (only .cu files go to nvcc): the
    kernel header it includes must not pull in device code without EFFATTN_CUDA_EMU."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++")
    src = tmp_path / "uses_header.cpp"
    src.write_text('#include "attention/attention.h"\n#include "attention/decode.h"\n'
                   'int main() { effattn::DecodeParams d{}; return effattn::head_dim_bucket(d.a.D + 1); }\n')
    res = subprocess.run([gxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-I", CSRC, str(src)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]


# ------------------------------------------------------------------ more architectures (behind a flag)

# opt-in shared memory per block of the architectures the default build serves through PTX or that a
# TORCH_CUDA_ARCH_LIST may name: Ampere consumer (RTX 30xx, A10), Ada (RTX 40xx, L4, L40), Blackwell
# data center (B200) and consumer (RTX 50xx)
SWEEP = {"sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_100": 227 * 1024, "sm_120": 99 * 1024}
SWEEP_ON = os.environ.get("EFFATTN_CUDA_ARCH_SWEEP") == "1"


def dynamic_smem(kernel):
    """The dynamic shared memory a kernel instance launches with (resources.py), from its mangled
    name; None for kernels outside the capability check (linear attention: a few KB)."""
    m = re.search(r"ILi(\d+)E", kernel)
    hd = int(m.group(1)) if m else 0
    if "attn_decode_split_kernel" in kernel:
        return resources.decode_smem(hd, int(re.search(r"ILi\d+ELb[01]ELi(\d)E", kernel).group(1)))
    wide = re.search(r"attn_fwd_kernelILi\d+E.*ELi32ENS_11StridedRowsELi(\d+)E", kernel)
    if wide:                                               # the 128-row instances (32 rows per warp; key tile)
        return resources.fwd_smem(hd, 128, int(wide.group(1)))
    for name, size in (("attn_fwd_sm90_kernel", resources.hopper_smem), ("attn_fwd_kernel", resources.fwd_smem),
                       ("attn_dkdv_kernel", resources.dkdv_smem), ("attn_dq_kernel", resources.dq_smem)):
        if name in kernel:
            return size(hd)
    return None


@pytest.mark.cuda_arch_sweep
@pytest.mark.skipif(not SWEEP_ON, reason="per-architecture compiles (minutes each): EFFATTN_CUDA_ARCH_SWEEP=1")
@pytest.mark.parametrize("arch", list(SWEEP))
def test_kernels_fit_more_architectures(arch, tmp_path):
    """Every .cu compiled for `arch`: no spills, registers under the cap, and every kernel instance the
    capability check would rank there (decode: the stage count resources.decode_stages picks) fits
    the architecture's shared memory per block with its static shared memory."""
    listed = subprocess.run([NVCC, "--list-gpu-code"], capture_output=True, text=True).stdout.split()
    if arch not in listed:
        pytest.skip(f"this nvcc cannot build {arch}")
    limits = resources.Limits(arch, SWEEP[arch], 65536)
    for src in kernel_sources():
        report, _ = compile_unit(src, tmp_path, [f"-gencode=arch=compute_{arch[3:]},code={arch}"])
        entries = ptxas_entries(report)
        if src == "attention/fwd.cu":                      # the forward's dispatch: its kernels are in inst/
            assert entries == [], entries
            continue
        assert 0 < len(entries) <= KERNEL_BUDGET and {e[0] for e in entries} == {arch}, (src, len(entries))
        assert not [e for e in entries if e[3] or e[4]], (src, arch)
        assert max(e[2] for e in entries) <= MAX_REGISTERS, (src, arch)
        static = {name: int(m.group(1)) if m else 0 for name, m in (
            (re.match(r"'([^']+)'", block).group(1), re.search(r"(\d+) bytes smem", block.split("Compiling", 1)[0]))
            for block in report.split("Compiling entry function ")[1:])}
        for name, st in static.items():
            dyn = dynamic_smem(name)
            if dyn is None:
                continue
            hd = int(re.search(r"ILi(\d+)E", name).group(1))
            if "attn_decode_split_kernel" in name and int(re.search(r"ELb[01]ELi(\d)E", name).group(1)) != \
                    resources.decode_stages(hd, limits)[0]:
                continue                                   # the instance the check does not pick there
            assert st + dyn <= SWEEP[arch], (arch, name, st, dyn)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
