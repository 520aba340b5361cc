"""Which GPU code the CUDA extension carries, and which devices that code runs on.

One home for both sides of that question: ``setup.py`` turns ``TORCH_CUDA_ARCH_LIST`` into nvcc's
``-gencode`` flags with :func:`gencode` (and bakes the resulting target list into the extension,
where ``torch.ops.effattn_cuda.built_targets()`` returns it), and the backend's availability check
asks :func:`runs_on` whether a device can run any of those targets. This module imports nothing
but the standard library: setup.py loads it by path, before torch or effattn are importable.

Targets are nvcc's code names:
- ``sm_XY``: SASS, runs on compute capability X.Y' with the same major and Y' >= Y;
- ``sm_XYa``: arch-specific SASS (wgmma on ``sm_90a``), runs on X.Y only;
- ``sm_XYf``: family-specific SASS, runs on the same major with Y' >= Y;
- ``compute_XY``: PTX, compiled by the driver for any device of capability >= X.Y (forward
  compatibility: a GPU newer than every SASS target still runs the kernels);
- ``compute_XYa`` / ``compute_XYf``: PTX of arch- / family-specific code, as their SASS.
"""
from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple

DEFAULT_ARCH_LIST = "8.0;9.0a"   # Ampere's mma.sync kernels (every later GPU) and Hopper's wgmma forward
MIN_CAPABILITY = (8, 0)          # mma.sync m16n8k16 bf16, ldmatrix, cp.async

_ENTRY = re.compile(r"(\d+)\.(\d+)([af]?)(\+PTX)?")
_TARGET = re.compile(r"(sm|compute)_(\d+?)(\d)([af]?)")


def gencode(arch_list: str) -> Tuple[List[str], List[str]]:
    """``TORCH_CUDA_ARCH_LIST`` ("8.0;9.0a", "8.0 9.0a+PTX") -> (nvcc ``-gencode`` flags, targets).

    Each entry gives its SASS (``+PTX`` adds its PTX); PTX of the highest listed architecture,
    without its ``a`` / ``f`` suffix, is always added, so that newer GPUs run the kernels (an
    ``sm_90a``-only build has no code for a Blackwell GPU). Raises ValueError naming the entry
    it cannot read (torch's named architectures such as "Hopper" are not taken: give numbers).
    """
    flags: List[str] = []
    targets: List[str] = []

    def add(arch: str, code: str) -> None:
        flag = f"-gencode=arch=compute_{arch},code={code}"
        if flag not in flags:
            flags.append(flag)
            targets.append(code)

    best = None
    for entry in arch_list.replace(";", " ").split():
        m = _ENTRY.fullmatch(entry)
        if m is None:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST: cannot read {entry!r} (expected entries such as 8.0, 9.0a, "
                             f"8.6+PTX)")
        major, minor, suffix, ptx = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        if (major, minor) < MIN_CAPABILITY:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST: {entry!r} is below compute capability 8.0, which the kernels "
                             f"need (mma.sync bf16, cp.async)")
        arch = f"{major}{minor}{suffix}"
        add(arch, f"sm_{arch}")
        if ptx:
            add(arch, f"compute_{arch}")
        best = max(best or (major, minor), (major, minor))
    if best is None:
        raise ValueError("TORCH_CUDA_ARCH_LIST is empty")
    add(f"{best[0]}{best[1]}", f"compute_{best[0]}{best[1]}")
    return flags, targets


def _parse(target: str) -> Tuple[str, Tuple[int, int], str]:
    m = _TARGET.fullmatch(target)
    if m is None:
        raise ValueError(f"not an nvcc target: {target!r}")
    return m.group(1), (int(m.group(2)), int(m.group(3))), m.group(4)


def target_runs(target: str, capability: Tuple[int, int]) -> bool:
    """Whether code built for `target` runs on a device of compute capability `capability`."""
    kind, cc, suffix = _parse(target)
    if suffix == "a":
        return tuple(capability) == cc
    if kind == "compute" and suffix == "":
        return tuple(capability) >= cc
    return capability[0] == cc[0] and capability[1] >= cc[1]


def runs_on(targets: Sequence[str], capability: Tuple[int, int]) -> Optional[str]:
    """None if a device of `capability` can run the extension built for `targets`, else why not."""
    major, minor = capability
    if (major, minor) < MIN_CAPABILITY:
        return f"needs a GPU of compute capability >= 8.0 (Ampere or newer), got {major}.{minor}"
    if any(target_runs(t, capability) for t in targets):
        return None
    return (f"the extension has no code this GPU (compute capability {major}.{minor}) can run: built for "
            f"{', '.join(targets) or 'nothing'}; rebuild with TORCH_CUDA_ARCH_LIST=\"{major}.{minor}\"")
