"""What the offline build checks (tests/backends/cuda/test_cuda_build*.py) share: a per-module cache of
compiled translation units and the checks on them; nvcc's flags and the readers of ptxas reports and SASS
listings live in tools/cuda/nvcc.py (the offline table's tool reads them too) and are re-exported here.

The checks are split over three test modules (forward units; backward and bias-term units; decode and
linear units) so that a run on several workers (``pytest -n``, ``--dist loadfile``) compiles them in
parallel; each module compiles only the units its tests read, once.
"""
import glob
import os

import pytest

from tests.conftest import CSRC
from tools.cuda import nvcc as _nvcc
from tools.cuda.nvcc import (
    ARCHS,
    GENCODE,
    NVCC,
    compile_unit,
    find_tool,
    functions,
    gencode_for,
    ptxas_entries,
    tile_loop,
)

# re-exported for the build checks
__all__ = ["ARCHS", "GENCODE", "NVCC", "compile_unit", "find_tool", "functions", "gencode_for", "ptxas_entries",
           "tile_loop", "needs_nvcc", "MAX_REGISTERS", "KERNEL_BUDGET", "kernel_sources", "Units",
           "check_spills_and_budget", "sass_of"]

assert ARCHS == ("sm_80", "sm_90a"), ARCHS
MAX_REGISTERS = 255          # the hardware limit per thread; spills are checked separately
KERNEL_BUDGET = 32           # per .cu and arch; attention/inst/fwd_*.cu: 1 or 2 each (kAny up to bucket
                             # 128: the 128-row and the 64-row instance; kDense / kCausal / kWindow without
                             # dropout at 128: 128 x 32 and 128 x 64), inst/bwd_*.cu: 3 to 5 (Delta,
                             # dK/dV, dQ; the fused backward and its dQ conversion up to bucket 128);
                             # attention/fwd.cu and bwd.cu dispatch to them and hold none; terms.cu: 26
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc")


def kernel_sources():
    """The .cu files setup.py compiles with nvcc: one folder per op under csrc/, and its generated
    instances (inst/)."""
    paths = glob.glob(os.path.join(CSRC, "*", "*.cu")) + glob.glob(os.path.join(CSRC, "*", "inst", "*.cu"))
    return sorted(os.path.relpath(p, CSRC) for p in paths)


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


def sass_of(obj, arch):
    """The SASS listing of an object's `arch` code (cuobjdump -sass); fails the test without the tools."""
    try:
        return _nvcc.sass_of(obj, arch)
    except FileNotFoundError as e:
        pytest.fail(str(e))
