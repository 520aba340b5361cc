"""Offline checks of the CUDA kernels' build (nvcc only), backward units: the generated units
attention/inst/bwd_<hd>_<dtype>_<kind>_<drop>.cu (attention/bwd.cu dispatches to them and holds no
kernel; here the general kAny-with-dropout unit of each bucket and dtype, and at head dim 128 bf16 the
dense unit without dropout against it) and the instances with bias tensors, attention/terms.cu
(test_cuda_build.py says what is checked).

attention/terms.cu is built for sm_80 only here: its kernels are the mma.sync instances of the
backward's and the forward's templates (the Hopper forward refuses bias tensors), its sm_90a build is
the same source for another arch and takes this unit's compile from about two to about four minutes
on two cores; EFFATTN_CUDA_ARCH_SWEEP=1 builds it for sm_90a as well.
"""
import os
import re
import sys

import pytest

from tests.backends.cuda.nvcc_units import (
    ARCHS,
    Units,
    check_spills_and_budget,
    functions,
    needs_nvcc,
    ptxas_entries,
    sass_of,
)

# attention/terms.cu: the instances with bias tensors (TERMS): per bucket and dtype the forward (kAny),
# dK/dV and dQ, plus the 2 Delta kernels
TERMS_KERNELS = 4 * 2 * 3 + 2
# the backward per (bucket, dtype): Delta, dK/dV, dQ, and at buckets 32..128 the fused kernel and its dQ
# conversion; the general instance (kAny with dropout) of each
BWD_UNITS = tuple(f"attention/inst/bwd_{hd}_{dt}_any_drop.cu" for hd in (32, 64, 128, 256) for dt in ("fp16", "bf16"))
DENSE_UNIT = "attention/inst/bwd_128_bf16_dense_nodrop.cu"
SWEEP_ON = os.environ.get("EFFATTN_CUDA_ARCH_SWEEP") == "1"
TERMS_ARCHS = ARCHS if SWEEP_ON else ("sm_80",)

pytestmark = needs_nvcc


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return Units(tmp_path_factory.mktemp("nvcc"), {"attention/terms.cu": TERMS_ARCHS})


def entries_of(compiled, units=BWD_UNITS):
    return [e for src in units for e in ptxas_entries(compiled[src][0])]


@pytest.mark.parametrize("src", ("attention/terms.cu", *BWD_UNITS, DENSE_UNIT))
def test_no_spills_registers_under_cap_and_kernel_budget(compiled, src):
    check_spills_and_budget(compiled, src)


def test_every_backward_is_built_for_each_bucket_and_dtype_without_bias_terms(compiled):
    """Each generated unit holds its bucket and dtype's Delta, dK/dV and dQ kernels (and the fused
    backward with its dQ conversion up to bucket 128), no other bucket's; bwd.cu holds none."""
    assert ptxas_entries(compiled["attention/bwd.cu"][0]) == []
    for src in BWD_UNITS:
        hd, dt = int(src.split("_")[1]), src.split("_")[2][:4]
        names = {e[1] for e in ptxas_entries(compiled[src][0]) if e[0] == ARCHS[0]}
        tag = f"ILi{hd}ELb{int(dt == 'bf16')}E"
        want = ("attn_dkdv_kernel", "attn_dq_kernel") + (("attn_bwd_fused_kernel",) if hd <= 128 else ())
        assert sorted(n.split("ILi")[0] for n in names if "ILi" in n) == sorted(f"_ZN7effattn{len(k)}{k}" for k in want), (src, names)
        assert all(tag in n for n in names if "ILi" in n), (src, names)
        assert len(names) == len(want) + 1 + (hd <= 128), (src, names)   # + Delta (+ the dQ conversion)
    entries = entries_of(compiled)
    for e in entries:            # TERMS off, kAny (2), dropout on (the Delta and dQ conversion kernels have none)
        if "attn_bwd_fused_kernel" in e[1]:
            assert re.search(r"ILi\d+ELb[01]ELi2ELb1EEEv", e[1]), e[1]
        elif not any(k in e[1] for k in ("attn_delta_kernel", "attn_dq_convert_kernel")):
            assert re.search(r"ILi\d+ELb[01]ELb0ELi2ELb1EEEv", e[1]), e[1]


def test_sass_uses_tensor_cores_ldmatrix_and_async_copies(compiled):
    for arch in ARCHS:
        sass = "".join(sass_of(compiled[src][1], arch) for src in BWD_UNITS)
        for fn in ("attn_dkdv_kernel", "attn_dq_kernel"):
            bodies = functions(sass, fn)
            assert len(bodies) == 8, (arch, fn, len(bodies))
            for body in bodies:
                for op in ("HMMA.16816.F32", "LDSM.16.M88.4", "LDGSTS"):
                    assert op in body, (arch, fn, op)
        assert "LDSM.16.MT88.4" in sass, arch          # the .trans loads of dO, Q, K


def test_fused_backward_five_products_and_ordered_dq_adds(compiled):
    """The fused backward (attention/bwd_fused.cuh, in inst/bwd_*.cu) for buckets 32, 64, 128 and both dtypes, no
    spills (checked above) and at most 255 registers; per step its SASS runs five products of equal size
    (S^T, dP^T: 16 keys x 64 queries over HD, dV, dK: 16 keys x HD over 64 queries, dQ: 16 queries x HD / 2
    over 128 keys; HD / 16 x 8 HMMA each per warp, the step's body fully unrolled), ldmatrix (.trans), async
    copies, the dQ adds (fp32 adds at GPU scope), the semaphore's acquire load and release store, and two
    barriers in the step (four in all: the key padding's, the last release's)."""
    for arch in ARCHS:
        names = sorted(e[1] for e in entries_of(compiled) if e[0] == arch and "attn_bwd_fused_kernel" in e[1])
        assert len(names) == 6 and all(f"ILi{hd}ELb{bf}E" in "".join(names) for hd in (32, 64, 128) for bf in (0, 1))
        bodies = {b.split("\n", 1)[0]: b for src in BWD_UNITS for b in sass_of(compiled[src][1], arch).split("Function : ")[1:]
                  if "attn_bwd_fused_kernel" in b[:200]}
        assert len(bodies) == 6, arch
        for name, body in bodies.items():
            hd = int(re.search(r"ILi(\d+)E", name).group(1))
            assert body.count("HMMA.16816.F32") == 5 * (hd // 16) * 8, (arch, name, body.count("HMMA.16816.F32"))
            for op in ("LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS", "LDG.E.STRONG.GPU", "STG.E.STRONG.GPU"):
                assert op in body, (arch, name, op)
            # the dQ adds: RED on sm_80, ATOMG (result unused) on sm_90a
            assert "RED.E.ADD.F32" in body or "ATOMG.E.ADD.F32" in body, (arch, name)
            assert body.count("BAR.SYNC") == 4, (arch, name, body.count("BAR.SYNC"))


def test_dense_instance_without_dropout_carries_no_mask_or_philox_code(compiled):
    """The dense unit without dropout holds the kDense / no-dropout instance of the fused backward kernel
    only (not the two passes), with at most 80% of the general instance's SASS instructions (measured at
    sm_90a, 2026-11-27: 64%), the same products, and no Philox rounds (each a 32-bit multiply-high,
    IMAD.HI.U32: under 10 left, from index arithmetic, where the general instance has about 300 to 700)."""
    for arch in ARCHS:
        dense, general = (sass_of(compiled[src][1], arch) for src in (DENSE_UNIT, "attention/inst/bwd_128_bf16_any_drop.cu"))
        # its two passes are kAny's (bwd_launch.cuh): the unit has the fused kernel only
        assert not functions(dense, "attn_dkdv_kernel") and not functions(dense, "attn_dq_kernel"), arch
        for fn, tail in (("attn_bwd_fused_kernel", "ELi0ELb0EEEv"),):
            (d,), (g,) = functions(dense, fn), functions(general, fn)
            assert tail in d.split("\n", 1)[0], (arch, fn)
            nd, ng = len(re.findall(r"/\*[0-9a-f]{4,}\*/", d)), len(re.findall(r"/\*[0-9a-f]{4,}\*/", g))
            assert nd < 0.8 * ng, (arch, fn, nd, ng)
            assert d.count("HMMA.16816.F32") == g.count("HMMA.16816.F32"), (arch, fn)
            assert d.count("IMAD.HI.U32") < 10 < 100 < g.count("IMAD.HI.U32"), (arch, fn)


@pytest.mark.parametrize("arch", TERMS_ARCHS)
def test_bias_tensor_instances_live_in_their_own_unit(compiled, arch):
    """The kernels with bias tensors (template flag TERMS, the last template argument; the dQ pass's is
    attn_dq_terms_kernel) are compiled in attention/terms.cu only, for every bucket and dtype, with
    tensor-core products (fwd.cu and bwd.cu hold none: their modules check that)."""
    report, obj = compiled["attention/terms.cu"]
    names = [e[1] for e in ptxas_entries(report) if e[0] == arch]
    assert len(names) == TERMS_KERNELS, (arch, len(names))
    for hd in (32, 64, 128, 256):
        for bf16 in (0, 1):
            for kernel, tail in (("attn_fwd_kernel", "ELi2ELb1ELb0ELb1ELi16ENS_11StridedRowsELi0EEEv"), ("attn_dkdv_kernel", "ELb1ELi2ELb1EEEv"),
                                 ("attn_dq_terms_kernel", "EEEv")):
                want = f"{kernel}ILi{hd}ELb{bf16}{tail}"
                assert sum(want in n for n in names) == 1, (arch, want)
    bodies = [b for b in sass_of(obj, arch).split("Function : ")[1:] if "attn_d" in b[:200] or "attn_f" in b[:200]]
    assert bodies
    for body in bodies:
        if "attn_delta_kernel" not in body.split("\n", 1)[0]:
            assert "HMMA.16816.F32" in body and "LDSM.16.M88.4" in body, arch


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
