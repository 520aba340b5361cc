"""Offline checks of the CUDA kernels' build (nvcc only), backward units: attention/bwd.cu and the
instances with bias tensors, attention/terms.cu (test_cuda_build.py says what is checked).

attention/terms.cu is built for sm_80 only here: its kernels are the mma.sync instances of the
backward's and the forward's templates (the Hopper forward refuses bias tensors), its sm_90a build is
the same source for another arch and takes this unit's compile from about two to about four minutes
on two cores; EFFATTN_CUDA_ARCH_SWEEP=1 builds it for sm_90a as well.
"""
import os
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
SWEEP_ON = os.environ.get("EFFATTN_CUDA_ARCH_SWEEP") == "1"
TERMS_ARCHS = ARCHS if SWEEP_ON else ("sm_80",)

pytestmark = needs_nvcc


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return Units(tmp_path_factory.mktemp("nvcc"), {"attention/terms.cu": TERMS_ARCHS})


@pytest.mark.parametrize("src", ("attention/bwd.cu", "attention/terms.cu"))
def test_no_spills_registers_under_cap_and_kernel_budget(compiled, src):
    check_spills_and_budget(compiled, src)


def test_every_backward_is_built_for_each_bucket_and_dtype_without_bias_terms(compiled):
    entries = ptxas_entries(compiled["attention/bwd.cu"][0])
    names = {e[1] for e in entries}
    for kernel in ("attn_dkdv_kernel", "attn_dq_kernel"):
        for hd in (32, 64, 128, 256):
            for bf16 in (0, 1):
                assert any(kernel in n and f"ILi{hd}ELb{bf16}E" in n for n in names), (kernel, hd, bf16)
    for e in entries:
        if "attn_delta_kernel" not in e[1]:
            assert "Lb0EEEv" in e[1], e[1]


def test_sass_uses_tensor_cores_ldmatrix_and_async_copies(compiled):
    for arch in ARCHS:
        sass = sass_of(compiled["attention/bwd.cu"][1], arch)
        for fn in ("attn_dkdv_kernel", "attn_dq_kernel"):
            bodies = functions(sass, fn)
            assert len(bodies) == 8, (arch, fn, len(bodies))
            for body in bodies:
                for op in ("HMMA.16816.F32", "LDSM.16.M88.4", "LDGSTS"):
                    assert op in body, (arch, fn, op)
        assert "LDSM.16.MT88.4" in sass, arch          # the .trans loads of dO, Q, K


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
            for kernel, tail in (("attn_fwd_kernel", "ELi2ELb1ELb0EEEv"), ("attn_dkdv_kernel", "ELb1EEEv"),
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
