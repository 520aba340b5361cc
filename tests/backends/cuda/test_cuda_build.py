"""Offline checks of the CUDA kernels' build (no GPU needed, only nvcc):

- every csrc/{attention,linear}/*.cu compiles on its own (no torch) for sm_80 and sm_90a;
- ptxas reports no spills, registers under the cap, and a kernel count within the budget (the
  templates are over head-dim bucket and dtype only; masks are runtime data);
- the SASS uses the tensor-core and async-copy instructions the source asks for (HMMA, LDSM,
  LDGSTS; HGMMA in the Hopper forward's sm_90a code), read with cuobjdump from PyPI's
  nvidia-cuda-cuobjdump wheel (nvcc 13's own toolkit here has none).
"""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from effattn.backends.cuda import resources, targets

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "csrc")
# setup.py's -gencode flags for its default TORCH_CUDA_ARCH_LIST (targets.gencode), less the PTX-only
# compute_90: a front-end pass more per unit for code no SASS check reads (the cuda_torch_build test of
# test_cuda_package.py checks that PTX in the built extension)
GENCODE = [f for f in targets.gencode(targets.DEFAULT_ARCH_LIST)[0] if "code=sm_" in f]
ARCHS = tuple(f.rsplit("code=", 1)[1] for f in GENCODE)
assert ARCHS == ("sm_80", "sm_90a"), ARCHS
MAX_REGISTERS = 255          # the hardware limit per thread; spills are checked separately
KERNEL_BUDGET = 32           # per .cu and arch; attention/fwd.cu: 4 head-dim buckets x 2 dtypes x 3 mask
                             # kinds = 24; attention/bwd.cu: 4 x 2 x 2 kernels + 2 Delta + the fused
                             # backward (3 buckets x 2 dtypes) + 2 dQ conversions = 26
MASK_KINDS = 3               # forward instances per bucket and dtype: kDense, kWindow, kAny (common.cuh)
SOFTMAX = ("attention/fwd.cu", "attention/bwd.cu")   # the forward's and the backward's translation units
# attention/decode.cu: 4 buckets x 2 dtypes split kernels, their single-buffered instances at head dim 256
# (GPUs with 99 KB of shared memory per block) and 2 combine kernels
DECODE_KERNELS = 12
DECODE_REGISTER_CAP = 168    # decode split kernels up to head dim 128: 3 blocks of 128 threads per SM
# attention/fwd_sm90.cu: the Hopper forward, head dims 64 and 128 x 2 dtypes, per arch (outside sm_90a
# empty stubs the launcher never starts); 168 registers at head dim 128 (2026-11-22, nvcc 13.0)
HOPPER_KERNELS = 4 * MASK_KINDS
HOPPER_MAX_REGISTERS = 192
# linear/linear.cu: 2 passes x 3 operand splits (bf16 parts) + step + FAVOR+ x 2 splits
LINEAR_KERNELS = 9
# attention/terms.cu: the instances with bias tensors (TERMS): per bucket and dtype the forward (kAny),
# dK/dV and dQ, plus the 2 Delta kernels
TERMS_KERNELS = 4 * 2 * 3 + 2

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc")


def kernel_sources():
    """The .cu files setup.py compiles with nvcc: one folder per op under csrc/."""
    return sorted(glob.glob(os.path.join(CSRC, "*", "*.cu")))


def find_tool(name):
    """`name` on PATH, or from the nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm wheels."""
    exe = shutil.which(name)
    if exe:
        return exe
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        hits = glob.glob(os.path.join(root, "**", "bin", name), recursive=True)
        if hits:
            return hits[0]
    return None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{source relative to csrc/: (ptxas report, object path)}, each .cu built once for both
    architectures."""
    out = {}
    for src in kernel_sources():
        obj = str(tmp_path_factory.mktemp("nvcc") / (os.path.basename(src) + ".o"))
        cmd = [NVCC, "-c", "-std=c++17", "-O3", "--threads", "2", "-Xptxas", "-v", "-I", CSRC, src, "-o", obj, *GENCODE]
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-4000:]
        out[os.path.relpath(src, CSRC)] = (res.stdout + res.stderr, obj)
    assert out, "no .cu sources in csrc/"
    return out


def ptxas_entries(report):
    """[(arch, kernel, registers, spill stores, spill loads)] from a -Xptxas -v report."""
    entries = []
    for block in report.split("Compiling entry function ")[1:]:
        name, arch = re.match(r"'([^']+)' for '(sm_\w+)'", block).groups()
        regs = int(re.search(r"Used (\d+) registers", block).group(1))
        st, ld = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block).groups())
        entries.append((arch, name, regs, st, ld))
    return entries


def test_no_spills_registers_under_cap_and_kernel_budget(compiled):
    for src, (report, _) in compiled.items():
        entries = ptxas_entries(report)
        for arch in ARCHS:
            mine = [e for e in entries if e[0] == arch]
            assert 0 < len(mine) <= KERNEL_BUDGET, (src, arch, len(mine))
        spills = [e for e in entries if e[3] or e[4]]
        assert not spills, spills
        assert max(e[2] for e in entries) <= MAX_REGISTERS


def test_every_kernel_is_built_for_each_bucket_and_dtype(compiled):
    names = {e[1] for src in SOFTMAX for e in ptxas_entries(compiled[src][0])}
    for kernel in ("attn_fwd_kernel", "attn_dkdv_kernel", "attn_dq_kernel"):
        for hd in (32, 64, 128, 256):
            for bf16 in (0, 1):
                assert any(kernel in n and f"ILi{hd}ELb{bf16}E" in n for n in names), (kernel, hd, bf16)


def sass_of(obj, arch):
    """The SASS listing of an object's `arch` code (cuobjdump -sass)."""
    exe, disasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if exe is None or disasm is None:
        pytest.fail("cuobjdump / nvdisasm not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
                    "(the 'test' extra)")
    env = dict(os.environ, PATH=os.path.dirname(disasm) + os.pathsep + os.environ.get("PATH", ""))
    res = subprocess.run([exe, "-sass", "-arch", arch, obj], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_sass_uses_tensor_cores_ldmatrix_and_async_copies(compiled):
    for arch in ARCHS:
        sass = "".join(sass_of(compiled[src][1], arch) for src in SOFTMAX)
        for fn in ("attn_fwd_kernel", "attn_dkdv_kernel", "attn_dq_kernel"):
            bodies = [b for b in sass.split("Function : ")[1:] if fn in b.split("\n", 1)[0]]
            assert len(bodies) == 8 * (MASK_KINDS if fn == "attn_fwd_kernel" else 1), (arch, fn, len(bodies))
            for body in bodies:
                for op in ("HMMA.16816.F32", "LDSM.16.M88.4", "LDGSTS"):
                    assert op in body, (arch, fn, op)
        assert "LDSM.16.MT88.4" in sass, arch          # the .trans loads of V, dO, Q, K


def test_fused_backward_five_products_and_ordered_dq_adds(compiled):
    """The fused backward (attention/bwd_fused.cuh, in bwd.cu) for buckets 32, 64, 128 and both dtypes, no
    spills (checked above) and at most 255 registers; per step its SASS runs five products of equal size
    (S^T, dP^T: 16 keys x 64 queries over HD, dV, dK: 16 keys x HD over 64 queries, dQ: 16 queries x HD / 2
    over 128 keys; HD / 16 x 8 HMMA each per warp, the step's body fully unrolled), ldmatrix (.trans), async
    copies, the dQ adds (fp32 adds at GPU scope), the semaphore's acquire load and release store, and two
    barriers in the step (four in all: the key padding's, the last release's)."""
    report, obj = compiled["attention/bwd.cu"]
    for arch in ARCHS:
        names = sorted(e[1] for e in ptxas_entries(report) if e[0] == arch and "attn_bwd_fused_kernel" in e[1])
        assert len(names) == 6 and all(f"ILi{hd}ELb{bf}E" in "".join(names) for hd in (32, 64, 128) for bf in (0, 1))
        bodies = {b.split("\n", 1)[0]: b for b in sass_of(obj, arch).split("Function : ")[1:]
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


def test_dense_and_window_forwards_carry_no_dropout_or_layout_code(compiled):
    """One forward instance per mask kind (MaskKind, template argument 0 / 1 / 2): only kAny's
    SASS holds Philox's multipliers (dropout), and kDense's listing is under two thirds of kAny's."""
    objs = [compiled["attention/fwd.cu"][1], compiled["attention/fwd_sm90.cu"][1]]
    for arch in ARCHS:
        for obj in objs:
            if arch == "sm_80" and obj == objs[1]:
                continue                                   # the Hopper kernels are stubs there
            bodies = {b.split("\n", 1)[0]: b for b in sass_of(obj, arch).split("Function : ")[1:]
                      if "attn_fwd" in b[:200]}
            for name, body in bodies.items():
                kind = int(re.search(r"Lb[01]ELi([012])E", name).group(1))
                assert ("0xd2511f53" in body.lower()) == (kind == 2), (arch, name)
                if kind == 0:
                    anyk = bodies[name.replace("ELi0E", "ELi2E")]
                    assert 3 * body.count("\n") < 2 * anyk.count("\n"), (arch, name)


def test_bias_tensor_instances_live_in_their_own_unit(compiled):
    """The kernels with bias tensors (template flag TERMS, the last template argument; the dQ pass's is
    attn_dq_terms_kernel) are compiled in attention/terms.cu only, for every bucket and dtype, with
    tensor-core products; fwd.cu and bwd.cu hold none (a call without those terms runs kernels without
    their code)."""
    report, obj = compiled["attention/terms.cu"]
    for arch in ARCHS:
        names = [e[1] for e in ptxas_entries(report) if e[0] == arch]
        assert len(names) == TERMS_KERNELS, (arch, len(names))
        for hd in (32, 64, 128, 256):
            for bf16 in (0, 1):
                for kernel, tail in (("attn_fwd_kernel", "ELi2ELb1EEEv"), ("attn_dkdv_kernel", "ELb1EEEv"),
                                     ("attn_dq_terms_kernel", "EEEv")):
                    want = f"{kernel}ILi{hd}ELb{bf16}{tail}"
                    assert sum(want in n for n in names) == 1, (arch, want)
        bodies = [b for b in sass_of(obj, arch).split("Function : ")[1:] if "attn_d" in b[:200] or "attn_f" in b[:200]]
        for body in bodies:
            if "attn_delta_kernel" not in body.split("\n", 1)[0]:
                assert "HMMA.16816.F32" in body and "LDSM.16.M88.4" in body, arch
    for src in SOFTMAX:
        for e in ptxas_entries(compiled[src][0]):
            if not any(k in e[1] for k in ("attn_delta_kernel", "attn_bwd_fused_kernel", "attn_dq_convert_kernel")):
                assert "Lb0EEEv" in e[1], e[1]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))



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
    exe, disasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if exe is None or disasm is None:
        pytest.fail("cuobjdump / nvdisasm not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    env = dict(os.environ, PATH=os.path.dirname(disasm) + os.pathsep + os.environ.get("PATH", ""))
    for arch in ARCHS:
        res = subprocess.run([exe, "-sass", "-arch", arch, obj], capture_output=True, text=True, env=env)
        assert res.returncode == 0, res.stderr
        bodies = [b for b in res.stdout.split("Function : ")[1:] if "attn_decode_split_kernel" in b.split("\n", 1)[0]]
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
            bodies = [b for b in sass.split("Function : ")[1:] if fn in b.split("\n", 1)[0]]
            assert len(bodies) == n, (arch, fn, len(bodies))
            for body in bodies:
                for op in ("HMMA.16816.F32.BF16", ldsm):
                    assert op in body, (arch, fn, op)


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
        obj = str(tmp_path / (os.path.basename(src) + ".o"))
        res = subprocess.run([NVCC, "-c", "-std=c++17", "-O3", "--threads", "2", "-Xptxas", "-v", "-I", CSRC, src,
                              "-o", obj, f"-gencode=arch=compute_{arch[3:]},code={arch}"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-4000:]
        report = res.stdout + res.stderr
        entries = ptxas_entries(report)
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
