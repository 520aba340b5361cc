"""Offline checks of the CUDA kernels' build (nvcc only), the decode, paged prefill, linear-attention and
relative-key units: attention/decode.cu, attention/paged_prefill.cu, linear/linear.cu, attention/relkeys.cu
and attention/relkeys_bwd.cu (test_cuda_build.py says what is checked). The relative-key units hold mma.sync instances only and are
built for sm_80 here, for sm_90a as well with EFFATTN_CUDA_ARCH_SWEEP=1 (as attention/terms.cu in
test_cuda_build_bwd.py)."""
import os
import sys

import pytest

from effattn.backends.cuda import resources
from tests.backends.cuda.nvcc_units import (
    ARCHS,
    MAX_REGISTERS,
    Units,
    check_spills_and_budget,
    functions,
    needs_nvcc,
    ptxas_entries,
    sass_of,
)

# attention/decode.cu: 4 buckets x 2 dtypes split kernels, their single-buffered instances at head dim 256
# (GPUs with 99 KB of shared memory per block) and 2 combine kernels
DECODE_KERNELS = 12
DECODE_REGISTER_CAP = 168    # decode split kernels up to head dim 128: 3 blocks of 128 threads per SM
# linear/linear.cu: 2 passes x 3 operand splits (bf16 parts) + step + FAVOR+ x 2 splits
LINEAR_KERNELS = 9
# attention/relkeys.cu: the forward with relative keys (RELK, mask kind kAny) per bucket and dtype
RELK_KERNELS = 4 * 2
# attention/relkeys_bwd.cu: its backward (dQ, dK/dV, distance pass) per bucket up to 128 and dtype, 2 Delta kernels
RELK_BWD_KERNELS = 3 * 3 * 2 + 2
# attention/paged_prefill.cu: the forward with the paged row policy (mask kind kWindow) per bucket and dtype
PAGED_PREFILL_KERNELS = 4 * 2
SWEEP_ON = os.environ.get("EFFATTN_CUDA_ARCH_SWEEP") == "1"
RELK_ARCHS = ARCHS if SWEEP_ON else ("sm_80",)

pytestmark = needs_nvcc


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return Units(tmp_path_factory.mktemp("nvcc"), {"attention/relkeys.cu": RELK_ARCHS, "attention/relkeys_bwd.cu": RELK_ARCHS})


@pytest.mark.parametrize("src", ("attention/decode.cu", "linear/linear.cu", "attention/relkeys.cu",
                                 "attention/relkeys_bwd.cu", "attention/paged_prefill.cu"))
def test_no_spills_registers_under_cap_and_kernel_budget(compiled, src):
    check_spills_and_budget(compiled, src)


def test_decode_kernels_counts_register_caps_and_sass(compiled):
    """csrc/attention/decode.cu: a split kernel per head-dim bucket and dtype and a combine kernel per dtype;
    split kernels up to head dim 128 keep 3 blocks per SM by registers (their shared memory allows
    3 at head dim 128); the split kernels' SASS has tensor-core mma, ldmatrix (.trans for V) and
    async copies."""
    report, obj = compiled["attention/decode.cu"]
    entries = ptxas_entries(report)
    for arch in ARCHS:
        mine = [e for e in entries if e[0] == arch]
        assert len(mine) == DECODE_KERNELS, (arch, len(mine))
        for hd in (32, 64, 128, 256):
            for bf16 in (0, 1):
                hits = [e for e in mine if "attn_decode_split_kernel" in e[1] and f"ILi{hd}ELb{bf16}E" in e[1]]
                assert len(hits) == len(resources.DECODE_STAGES[hd]), (arch, hd, bf16)
                assert all(h[2] <= (DECODE_REGISTER_CAP if hd <= 128 else MAX_REGISTERS) for h in hits), hits
        assert sum("attn_decode_combine_kernel" in e[1] for e in mine) == 2
    for arch in ARCHS:
        bodies = functions(sass_of(obj, arch), "attn_decode_split_kernel")
        assert len(bodies) == 10, (arch, len(bodies))
        for body in bodies:
            for op in ("HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS"):
                assert op in body, (arch, op)


def test_linear_kernels_counts_and_sass(compiled):
    """csrc/linear/linear.cu: the chunk-state and output passes per operand split, the step and the FAVOR+
    kernels; both passes and the FAVOR+ prologue multiply on bf16 tensor cores through ldmatrix
    (.trans for the reduction-major tiles); their loads are plain (the feature map is applied
    between global and shared memory)."""
    report, obj = compiled["linear/linear.cu"]
    entries = ptxas_entries(report)
    for arch in ARCHS:
        mine = [e[1] for e in entries if e[0] == arch]
        assert len(mine) == LINEAR_KERNELS, (arch, len(mine))
        for kernel in ("lin_state_kernel", "lin_out_kernel"):
            for parts in (1, 2, 3):
                assert sum(kernel in n and f"ILi{parts}E" in n for n in mine) == 1, (arch, kernel, parts)
        sass = sass_of(obj, arch)
        for fn, n, ldsm in (("lin_state_kernel", 3, "LDSM.16.MT88.4"), ("lin_out_kernel", 3, "LDSM.16.M88.4"),
                            ("lin_favor_kernel", 2, "LDSM.16.M88.4")):
            bodies = functions(sass, fn)
            assert len(bodies) == n, (arch, fn, len(bodies))
            for body in bodies:
                for op in ("HMMA.16816.F32.BF16", ldsm):
                    assert op in body, (arch, fn, op)


def test_paged_prefill_is_the_forward_with_the_paged_row_policy(compiled):
    """attention/paged_prefill.cu holds attn_fwd_kernel with PagedRows (mask kind kWindow, no TERMS / RELK) for
    every bucket and dtype, and nothing else; their SASS multiplies on tensor cores through ldmatrix (.trans for
    V) and loads rows with async copies (cp.async through the block table)."""
    report, obj = compiled["attention/paged_prefill.cu"]
    entries = ptxas_entries(report)
    for arch in ARCHS:
        names = [e[1] for e in entries if e[0] == arch]
        assert len(names) == PAGED_PREFILL_KERNELS, (arch, len(names))
        for hd in (32, 64, 128, 256):
            for bf16 in (0, 1):
                assert sum(f"attn_fwd_kernelILi{hd}ELb{bf16}ELi1ELb0ELb0E" in n and "PagedRows" in n
                           for n in names) == 1, (arch, hd, bf16, names)
        for body in functions(sass_of(obj, arch), "attn_fwd_kernel"):
            for op in ("HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS"):
                assert op in body, (arch, op)


@pytest.mark.parametrize("arch", RELK_ARCHS)
def test_relative_keys_forward_lives_in_its_own_unit(compiled, arch):
    """The forward with relative keys (template flag RELK, before the row policy) is compiled in
    attention/relkeys.cu for every bucket and dtype (mask kind kAny, no bias tensors), with tensor-core
    products and async copies (test_cuda_build.py checks that fwd.cu holds no RELK instance)."""
    report, obj = compiled["attention/relkeys.cu"]
    names = [e[1] for e in ptxas_entries(report) if e[0] == arch]
    assert len(names) == RELK_KERNELS, (arch, len(names))
    for hd in (32, 64, 128, 256):
        for bf16 in (0, 1):
            assert sum(f"attn_fwd_kernelILi{hd}ELb{bf16}ELi2ELb0ELb1ELb1ELi16ENS_11StridedRowsELi0EEEv" in n for n in names) == 1, (arch, hd, bf16)
    bodies = sass_of(obj, arch).split("Function : ")[1:]
    assert bodies
    for body in bodies:
        assert "HMMA.16816.F32" in body and "LDSM.16.M88.4" in body and "LDGSTS" in body, arch


@pytest.mark.parametrize("arch", RELK_ARCHS)
def test_relative_keys_backward_lives_in_its_own_unit(compiled, arch):
    """The backward with relative keys (relk_dq_kernel, relk_dkdv_kernel, relk_dr_kernel and the Delta kernel
    they share with bwd.cu) is compiled in attention/relkeys_bwd.cu for head-dim buckets 32 to 128 and both
    dtypes, with tensor-core products (ldmatrix, .trans for the reduction-major operands) and async copies."""
    report, obj = compiled["attention/relkeys_bwd.cu"]
    names = [e[1] for e in ptxas_entries(report) if e[0] == arch]
    assert len(names) == RELK_BWD_KERNELS, (arch, len(names))
    for kernel in ("relk_dq_kernel", "relk_dkdv_kernel", "relk_dr_kernel"):
        for hd in (32, 64, 128):
            for bf16 in (0, 1):
                assert sum(f"{kernel}ILi{hd}ELb{bf16}EE" in n for n in names) == 1, (arch, kernel, hd, bf16)
        for body in functions(sass_of(obj, arch), kernel):
            for op in ("HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS"):
                assert op in body, (arch, kernel, op)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
