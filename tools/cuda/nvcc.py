"""nvcc's view of the CUDA backend's translation units, without a GPU: the flags setup.py compiles them with,
compiling one unit, and the readers of what comes out (ptxas reports, cuobjdump's resource usage and ELF
attributes, SASS listings and their tile loops).

One copy for both users: tools/cuda/kernel_table.py (the offline table) and the offline build checks
(tests/backends/cuda/nvcc_units.py re-exports these). Standard library and effattn.backends.cuda.targets only.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Tuple

from effattn.backends.cuda import targets

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")

# setup.py's -gencode flags for its default TORCH_CUDA_ARCH_LIST (targets.gencode), less the PTX-only
# compute_90: a front-end pass more per unit for code no SASS reader looks at (the cuda_torch_build test of
# test_cuda_package.py checks that PTX in the built extension)
GENCODE = [f for f in targets.gencode(targets.DEFAULT_ARCH_LIST)[0] if "code=sm_" in f]
ARCHS = tuple(f.rsplit("code=", 1)[1] for f in GENCODE)
NVCC = shutil.which("nvcc")


def gencode_for(archs) -> List[str]:
    """nvcc's -gencode flags for a subset of ARCHS."""
    return [f for f in GENCODE if f.rsplit("code=", 1)[1] in archs]


def compile_unit(src: str, out_dir: str, gencode: Optional[List[str]] = None, threads: int = 2) -> Tuple[str, str]:
    """(ptxas report, object path) of csrc/`src` compiled for `gencode` (default: GENCODE); raises
    RuntimeError with nvcc's messages when it fails."""
    if NVCC is None:
        raise RuntimeError("nvcc not found on PATH")
    obj = os.path.join(str(out_dir), os.path.basename(src) + ".o")
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "--threads", str(threads), "-Xptxas", "-v", "-I", CSRC,
           os.path.join(CSRC, src), "-o", obj, *(GENCODE if gencode is None else gencode)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed on {src}:\n{res.stderr[-4000:]}")
    return res.stdout + res.stderr, obj


def nvcc_version() -> str:
    """nvcc's release line ("release 13.0, V13.0.88"), or "" without nvcc."""
    if NVCC is None:
        return ""
    out = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release [^\n]*", out)
    return m.group(0) if m else out.strip().splitlines()[-1]


def ptxas_entries(report: str) -> List[Tuple[str, str, int, int, int]]:
    """[(arch, kernel, registers, spill stores, spill loads)] from a -Xptxas -v report."""
    entries = []
    for block in report.split("Compiling entry function ")[1:]:
        name, arch = re.match(r"'([^']+)' for '(sm_\w+)'", block).groups()
        regs = int(re.search(r"Used (\d+) registers", block).group(1))
        st, ld = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block).groups())
        entries.append((arch, name, regs, st, ld))
    return entries


def find_tool(name: str) -> Optional[str]:
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


MISSING_TOOLS = ("cuobjdump / nvdisasm not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm "
                 "(the 'test' extra)")


def cuobjdump(obj: str, *args: str) -> str:
    """cuobjdump's output for an object (with nvdisasm on its PATH); FileNotFoundError without the tools."""
    exe, disasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if exe is None or disasm is None:
        raise FileNotFoundError(MISSING_TOOLS)
    env = dict(os.environ, PATH=os.path.dirname(disasm) + os.pathsep + os.environ.get("PATH", ""))
    res = subprocess.run([exe, *args, obj], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(res.stderr)
    return res.stdout


def sass_of(obj: str, arch: str) -> str:
    """The SASS listing of an object's `arch` code (cuobjdump -sass)."""
    return cuobjdump(obj, "-sass", "-arch", arch)


def resource_usage(obj: str) -> Dict[Tuple[str, str], Dict[str, int]]:
    """{(arch, kernel): {"REG", "STACK", "SHARED", "LOCAL", ...}} from cuobjdump -res-usage: SHARED is the
    kernel's static shared memory (bytes)."""
    out, arch = {}, None
    text = cuobjdump(obj, "-res-usage")
    for line in text.splitlines():
        m = re.match(r"arch = (sm_\w+)", line.strip())
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        if line.strip().startswith("REG:"):
            out[(arch, name)] = {k: int(v) for k, v in re.findall(r"([A-Z_\[\]0-9]+):(\d+)", line)}
    return out


def max_threads(obj: str, arch: str) -> Dict[str, int]:
    """{kernel: threads per block} from the ELF's EIATTR_MAX_THREADS (the kernels' __launch_bounds__)."""
    text = cuobjdump(obj, "-elf", "-arch", arch)
    out = {}
    for section in re.split(r"\n(?=\.nv\.info\.)", text):
        m = re.match(r"\.nv\.info\.(\S+)", section)
        if not m:
            continue
        t = re.search(r"EIATTR_MAX_THREADS\s+Format:\s+\S+\s+Value:\s+(0x[0-9a-f]+) (0x[0-9a-f]+) (0x[0-9a-f]+)",
                      section)
        if t:
            x, y, z = (int(v, 16) for v in t.groups())
            out[m.group(1)] = x * y * z
    return out


def functions(sass: str, fn: str) -> List[str]:
    """The bodies of the SASS functions whose name contains `fn`."""
    return [b for b in sass.split("Function : ")[1:] if fn in b.split("\n", 1)[0]]


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def loops_of(body: str):
    """(instructions [(address, text)], loops [(target, branch address)]) of one SASS function: a loop is a
    backward branch (BRA to a lower address) and its target."""
    instrs = [(int(m.group(1), 16), m.group(2)) for m in _INSTR.finditer(body)]
    loops = []
    for addr, text in instrs:
        m = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    return instrs, loops


def _op(text: str) -> str:
    """The opcode of a SASS instruction's text, without its predicate."""
    parts = text.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def shortest_trip(instrs, lo: int, hi: int, mma: str) -> Tuple[int, int]:
    """(instructions, `mma` instructions) of one trip of the loop from its head `lo` to its backward branch at
    `hi`: among the paths through the loop body (a predicated branch may go either way, an unpredicated one is
    taken; nested loops run once: their backward branches are not followed) those with the most `mma`
    instructions, the one with the fewest instructions. A full tile's trip without the mask and edge code its
    branches skip: what one trip issues at the least, where the loop's static count is the most."""
    at = {a: i for i, (a, _) in enumerate(instrs)}
    start, goal = at[lo], at[hi]
    best = {start: (int(mma in instrs[start][1]), -1)}
    for i in range(start, goal):
        if i not in best:
            continue
        addr, text = instrs[i]
        m = re.search(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        predicated = text.startswith("@") and not text.startswith("@PT")
        succ = []
        if m and addr < int(m.group(1), 16) <= hi:
            succ.append(at[int(m.group(1), 16)])
        if not ((m or _op(text) in ("EXIT", "RET", "BRX", "JMX")) and not predicated):
            succ.append(i + 1)
        for j in succ:
            got = (best[i][0] + (mma in instrs[j][1]), best[i][1] - 1)
            if j not in best or got > best[j]:
                best[j] = got
    if goal not in best:
        return 0, 0
    return -best[goal][1], best[goal][0]


def tile_loop(body: str, mma: str = "HGMMA"):
    """The main loop of one SASS function (`functions`): the outermost loop (a backward branch and its
    target) that holds `mma` instructions and that a trip runs through (`shortest_trip`). A dict: its instructions (static count), block barriers
    (BAR.SYNC), loops nested in it, the `mma`, LDGSTS and WARPGROUP.DEPBAR lines in it, and its shortest trip
    (`shortest_trip`: instructions, `mma` on it); None without one."""
    instrs, loops = loops_of(body)
    hits = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi and mma in t for a, t in instrs)]
    if not hits:
        return None
    # the widest such loop that a trip runs through (a path from its head to its backward branch): a backward
    # branch behind the kernel's last EXIT spans code no trip runs (the warp-specialized Hopper forward's)
    hits.sort(key=lambda span: span[0] - span[1])
    trips = {}
    for lo, hi in hits:
        trips[(lo, hi)] = shortest_trip(instrs, lo, hi, mma)
        if trips[(lo, hi)][0]:
            break
    else:
        lo, hi = hits[0]
    inside = [t for a, t in instrs if lo <= a <= hi]
    trip, trip_mma = trips[(lo, hi)]
    return dict(trip=trip, trip_mma=trip_mma, instrs=len(inside), barriers=sum(bool(re.search(r"\bBAR\.SYNC", t)) for t in inside),
                inner_loops=sum(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops),
                mma=[t.split()[0] if not t.startswith("@") else t.split()[1] for t in inside if mma in t],
                ldgsts=sum("LDGSTS" in t for t in inside),
                wg_waits=[t for t in inside if "WARPGROUP.DEPBAR" in t])
