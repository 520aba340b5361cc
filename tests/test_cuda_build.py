"""Offline checks of the CUDA kernels' build (no GPU needed, only nvcc):

- every csrc/*.cu compiles on its own (no torch) for sm_80 and sm_90a;
- ptxas reports no spills, registers under the cap, and a kernel count within the budget (the
  templates are over head-dim bucket and dtype only; masks are runtime data);
- the SASS uses the tensor-core and async-copy instructions the source asks for (HMMA, LDSM,
  LDGSTS), read with cuobjdump from PyPI's nvidia-cuda-cuobjdump wheel (nvcc 13's own toolkit
  here has none).
"""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
ARCHS = ("sm_80", "sm_90a")
MAX_REGISTERS = 255          # the hardware limit per thread; spills are checked separately
# per arch, all sources: attention 4 head-dim buckets x 2 dtypes x 3 kernels + 2 Delta kernels = 26;
# linear attention (linear.cu) 2 passes x 3 operand splits + step + FAVOR+ x 2 splits = 9
KERNEL_BUDGET = 40

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc")


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
    """{source: (ptxas report, object path)}, each .cu built once for both architectures."""
    out = {}
    for src in sorted(glob.glob(os.path.join(CSRC, "*.cu"))):
        obj = str(tmp_path_factory.mktemp("nvcc") / (os.path.basename(src) + ".o"))
        cmd = [NVCC, "-c", "-std=c++17", "-O3", "--threads", "2", "-Xptxas", "-v", "-I", CSRC, src, "-o", obj]
        for arch in ARCHS:
            cmd.append(f"-gencode=arch=compute_{arch[3:]},code={arch}")
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-4000:]
        out[os.path.basename(src)] = (res.stdout + res.stderr, obj)
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
    total = {arch: 0 for arch in ARCHS}
    for src, (report, _) in compiled.items():
        entries = ptxas_entries(report)
        for arch in ARCHS:
            mine = [e for e in entries if e[0] == arch]
            assert mine, (src, arch)
            total[arch] += len(mine)
        spills = [e for e in entries if e[3] or e[4]]
        assert not spills, spills
        assert max(e[2] for e in entries) <= MAX_REGISTERS
    assert max(total.values()) <= KERNEL_BUDGET, total


def test_every_kernel_is_built_for_each_bucket_and_dtype(compiled):
    names = {e[1] for e in ptxas_entries(compiled["attention.cu"][0])}
    for kernel in ("attn_fwd_kernel", "attn_dkdv_kernel", "attn_dq_kernel"):
        for hd in (32, 64, 128, 256):
            for bf16 in (0, 1):
                assert any(kernel in n and f"ILi{hd}ELb{bf16}E" in n for n in names), (kernel, hd, bf16)


def test_every_linear_kernel_is_built_for_each_operand_split(compiled):
    names = {e[1] for e in ptxas_entries(compiled["linear.cu"][0])}
    for kernel in ("lin_state_kernel", "lin_out_kernel"):
        for parts in (1, 2, 3):
            assert any(kernel in n and f"ILi{parts}E" in n for n in names), (kernel, parts)
    assert any("lin_step_kernel" in n for n in names) and any("lin_favor_kernel" in n for n in names)


def sass_of(compiled, src, arch):
    exe, disasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if exe is None or disasm is None:
        pytest.fail("cuobjdump / nvdisasm not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
                    "(the 'test' extra)")
    env = dict(os.environ, PATH=os.path.dirname(disasm) + os.pathsep + os.environ.get("PATH", ""))
    res = subprocess.run([exe, "-sass", "-arch", arch, compiled[src][1]], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_linear_passes_use_bf16_tensor_cores_and_ldmatrix(compiled):
    """Both passes and the FAVOR+ prologue multiply on bf16 tensor cores through ldmatrix (.trans for
    the reduction-major tiles); their loads are plain (the feature map is applied between global and
    shared memory)."""
    for arch in ARCHS:
        sass = sass_of(compiled, "linear.cu", arch)
        for fn, n in (("lin_state_kernel", 3), ("lin_out_kernel", 3), ("lin_favor_kernel", 2)):
            bodies = [b for b in sass.split("Function : ")[1:] if fn in b.split("\n", 1)[0]]
            assert len(bodies) == n, (arch, fn, len(bodies))
            for body in bodies:
                for op in ("HMMA.16816.F32.BF16", "LDSM.16.MT88.4" if fn == "lin_state_kernel" else "LDSM.16.M88.4"):
                    assert op in body, (arch, fn, op)
        out = [b for b in sass.split("Function : ")[1:] if "lin_out_kernel" in b.split("\n", 1)[0]]
        assert all("LDSM.16.M88.4" in b for b in out), arch


def test_sass_uses_tensor_cores_ldmatrix_and_async_copies(compiled):
    exe, disasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if exe is None or disasm is None:
        pytest.fail("cuobjdump / nvdisasm not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
                    "(the 'test' extra)")
    env = dict(os.environ, PATH=os.path.dirname(disasm) + os.pathsep + os.environ.get("PATH", ""))
    _, obj = compiled["attention.cu"]
    for arch in ARCHS:
        res = subprocess.run([exe, "-sass", "-arch", arch, obj], capture_output=True, text=True, env=env)
        assert res.returncode == 0, res.stderr
        sass = res.stdout
        for fn in ("attn_fwd_kernel", "attn_dkdv_kernel", "attn_dq_kernel"):
            bodies = [b for b in sass.split("Function : ")[1:] if fn in b.split("\n", 1)[0]]
            assert len(bodies) == 8, (arch, fn, len(bodies))
            for body in bodies:
                for op in ("HMMA.16816.F32", "LDSM.16.M88.4", "LDGSTS"):
                    assert op in body, (arch, fn, op)
        assert "LDSM.16.MT88.4" in sass, arch          # the .trans loads of V, dO, Q, K


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))



def test_header_the_binding_includes_is_host_cpp(tmp_path):
    """setup.py compiles csrc/binding/*.cpp with the host compiler (only .cu files go to nvcc): the
    kernel header it includes must not pull in device code without EFFATTN_CUDA_EMU."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++")
    src = tmp_path / "uses_header.cpp"
    src.write_text('#include "attention.h"\nint main() { effattn::AttnParams p{}; '
                   'return effattn::head_dim_bucket(p.D + 1); }\n')
    res = subprocess.run([gxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-I", CSRC, str(src)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
