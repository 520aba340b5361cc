"""What the offline build checks (tests/backends/cuda/test_cuda_build*.py) share: nvcc's flags for
setup.py's default architectures, a per-module cache of compiled translation units, and the readers
of ptxas reports and SASS listings.

The checks are split over three test modules (forward units; backward and bias-term units; decode and
linear units) so that a run on several workers (``pytest -n``, ``--dist loadfile``) compiles them in
parallel; each module compiles only the units its tests read, once.
"""
import glob
import os
import re
import shutil
import subprocess

import pytest

from effattn.backends.cuda import targets
from tests.conftest import CSRC

# setup.py's -gencode flags for its default TORCH_CUDA_ARCH_LIST (targets.gencode), less the PTX-only
# compute_90: a front-end pass more per unit for code no SASS check reads (the cuda_torch_build test of
# test_cuda_package.py checks that PTX in the built extension)
GENCODE = [f for f in targets.gencode(targets.DEFAULT_ARCH_LIST)[0] if "code=sm_" in f]
ARCHS = tuple(f.rsplit("code=", 1)[1] for f in GENCODE)
assert ARCHS == ("sm_80", "sm_90a"), ARCHS
MAX_REGISTERS = 255          # the hardware limit per thread; spills are checked separately
KERNEL_BUDGET = 32           # per .cu and arch; attention/inst/fwd_*.cu: 1 or 2 each (kAny up to bucket
                             # 128: the 128-row and the 64-row instance; kDense / kCausal / kWindow without
                             # dropout at 128: 128 x 32 and 128 x 64), inst/bwd_*.cu: 3 to 5 (Delta,
                             # dK/dV, dQ; the fused backward and its dQ conversion up to bucket 128);
                             # attention/fwd.cu and bwd.cu dispatch to them and hold none; terms.cu: 26
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc")


def kernel_sources():
    """The .cu files setup.py compiles with nvcc: one folder per op under csrc/, and its generated
    instances (inst/)."""
    paths = glob.glob(os.path.join(CSRC, "*", "*.cu")) + glob.glob(os.path.join(CSRC, "*", "inst", "*.cu"))
    return sorted(os.path.relpath(p, CSRC) for p in paths)


def gencode_for(archs):
    """nvcc's -gencode flags for a subset of ARCHS."""
    return [f for f in GENCODE if f.rsplit("code=", 1)[1] in archs]


def compile_unit(src, out_dir, gencode=None):
    """(ptxas report, object path) of csrc/`src` compiled for `gencode` (default: GENCODE)."""
    obj = os.path.join(str(out_dir), os.path.basename(src) + ".o")
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "--threads", "2", "-Xptxas", "-v", "-I", CSRC,
           os.path.join(CSRC, src), "-o", obj, *(GENCODE if gencode is None else gencode)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stdout + res.stderr, obj


class Units:
    """Translation units compiled on first use and kept for the module: ``units[src]`` is
    ``(ptxas report, object path)``; ``archs`` maps a unit to the architectures it is built for
    here when not all of ARCHS."""

    def __init__(self, out_dir, archs=None):
        self.out_dir, self.archs, self.done = out_dir, archs or {}, {}

    def __getitem__(self, src):
        if src not in self.done:
            archs = self.archs.get(src, ARCHS)
            self.done[src] = compile_unit(src, self.out_dir, gencode_for(archs))
        return self.done[src]

    def built_archs(self, src):
        return self.archs.get(src, ARCHS)


def ptxas_entries(report):
    """[(arch, kernel, registers, spill stores, spill loads)] from a -Xptxas -v report."""
    entries = []
    for block in report.split("Compiling entry function ")[1:]:
        name, arch = re.match(r"'([^']+)' for '(sm_\w+)'", block).groups()
        regs = int(re.search(r"Used (\d+) registers", block).group(1))
        st, ld = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block).groups())
        entries.append((arch, name, regs, st, ld))
    return entries


def check_spills_and_budget(units, src):
    """No spills, registers under the cap and a kernel count within the budget, per built arch."""
    report, _ = units[src]
    entries = ptxas_entries(report)
    for arch in units.built_archs(src):
        mine = [e for e in entries if e[0] == arch]
        assert 0 < len(mine) <= KERNEL_BUDGET, (src, arch, len(mine))
    spills = [e for e in entries if e[3] or e[4]]
    assert not spills, spills
    assert max(e[2] for e in entries) <= MAX_REGISTERS


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


def functions(sass, fn):
    """The bodies of the SASS functions whose name contains `fn`."""
    return [b for b in sass.split("Function : ")[1:] if fn in b.split("\n", 1)[0]]


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def tile_loop(body, mma="HGMMA"):
    """The main loop of one SASS function (`functions`): the outermost loop (a backward branch and its
    target) that holds `mma` instructions. A dict: its instructions (static count), block barriers
    (BAR.SYNC), loops nested in it, the `mma`, LDGSTS and WARPGROUP.DEPBAR lines in it; None without one."""
    instrs = [(int(m.group(1), 16), m.group(2)) for m in _INSTR.finditer(body)]
    loops = []
    for addr, text in instrs:
        m = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    hits = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi and mma in t for a, t in instrs)]
    if not hits:
        return None
    lo, hi = max(hits, key=lambda span: span[1] - span[0])
    inside = [t for a, t in instrs if lo <= a <= hi]
    return dict(instrs=len(inside), barriers=sum(bool(re.search(r"\bBAR\.SYNC", t)) for t in inside),
                inner_loops=sum(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops),
                mma=[t.split()[0] if not t.startswith("@") else t.split()[1] for t in inside if mma in t],
                ldgsts=sum("LDGSTS" in t for t in inside),
                wg_waits=[t for t in inside if "WARPGROUP.DEPBAR" in t])
