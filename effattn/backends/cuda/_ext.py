"""Finding the compiled ops of the CUDA backend.

- On CUDA tensors: ``effattn._C``, built by setup.py where torch is a CUDA build and nvcc exists;
  its ops are ``torch.ops.effattn_cuda.*``.
- On CPU tensors, with ``EFFATTN_CUDA_EMU=1``: the same binding compiled by the host compiler with
  the emulation of csrc/emu/ (``torch.ops.effattn_cuda_emu.*``), built on first use with
  ``torch.utils.cpp_extension.load`` and cached under ``~/.cache/effattn`` (``EFFATTN_CUDA_EMU_DIR``)
  keyed on the sources' hash, so a kernel edit rebuilds it.
"""
from __future__ import annotations

import glob
import hashlib
import os
import shutil
import threading
from typing import Optional

import torch

from . import targets

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                     "csrc")
_lock = threading.Lock()
_emu_error: Optional[str] = None
_emu_ready = False       # set once loaded: the check below is then a flag read (torch.compile traces it)


def emu_requested() -> bool:
    return os.environ.get("EFFATTN_CUDA_EMU") == "1"


def sources():
    """The binding and every header it pulls in (the hash decides whether to rebuild)."""
    files = sorted(glob.glob(os.path.join(_CSRC, "**", "*.*"), recursive=True))
    return [f for f in files if f.endswith((".h", ".cuh", ".cu", ".cpp"))]


def _emu_loaded() -> bool:
    return hasattr(torch.ops, "effattn_cuda_emu") and hasattr(torch.ops.effattn_cuda_emu, "attention_fwd")


def emu_problem() -> Optional[str]:
    """None if the emulated extension is usable (building it on first call), else why not."""
    global _emu_error, _emu_ready
    if not emu_requested():
        return "CPU tensors need EFFATTN_CUDA_EMU=1 (the CUDA kernels' host emulation, for tests)"
    if _emu_ready:
        return None
    if _emu_error is not None:
        return _emu_error
    with _lock:
        if _emu_loaded():
            _emu_ready = True
            return None
        if not os.path.isdir(_CSRC):
            _emu_error = f"the kernel sources ({_CSRC}) are not installed"
        elif shutil.which(os.environ.get("CXX", "g++")) is None:
            _emu_error = "no host C++ compiler (g++) to build the emulated kernels"
        else:
            try:
                build_emu()
                _emu_ready = True
            except Exception as e:  # noqa: BLE001 - reported through explain / the error message
                _emu_error = f"building the emulated CUDA kernels failed: {str(e)[-2000:]}"
    return _emu_error


def build_emu(extra_cflags=(), name="effattn_cuda_emu", verbose=False):
    """Compiles csrc/binding/*.cpp with EFFATTN_CUDA_EMU (each op's binding then compiles its kernels
    into itself) and loads it (cached). The C++ standard is torch's own choice (C++17 up to torch
    2.13, C++20 from 2.14): the kernel sources compile under both."""
    from torch.utils import cpp_extension
    digest = hashlib.sha1()
    for f in sources():
        digest.update(f.encode())
        with open(f, "rb") as fh:
            digest.update(fh.read())
    digest.update(" ".join(extra_cflags).encode())
    root = os.environ.get("EFFATTN_CUDA_EMU_DIR", os.path.join(os.path.expanduser("~"), ".cache", "effattn"))
    build_dir = os.path.join(root, f"{name}-{digest.hexdigest()[:16]}")
    os.makedirs(build_dir, exist_ok=True)
    cpp_extension.load(name=name, sources=sorted(glob.glob(os.path.join(_CSRC, "binding", "*.cpp"))),
                       extra_include_paths=[_CSRC], build_directory=build_dir, is_python_module=False,
                       extra_cflags=["-O2", "-DEFFATTN_CUDA_EMU", *extra_cflags], verbose=verbose)


_cuda_problem = ["unchecked"]


def cuda_problem() -> Optional[str]:
    """None if the real extension (effattn._C) is importable, else why not (checked once)."""
    if _cuda_problem[0] == "unchecked":
        try:
            from effattn import _C  # noqa: F401
            _cuda_problem[0] = None
        except ImportError:
            _cuda_problem[0] = "not available in this installation (CUDA extension not built)"
    return _cuda_problem[0]


def device_problem(device: torch.device) -> Optional[str]:
    """None if effattn._C has code that `device` runs (SASS of its architecture or PTX of an older
    one, see targets.py), else why not."""
    why = cuda_problem()
    if why:
        return why
    return targets.runs_on(built_targets(), torch.cuda.get_device_capability(device))


def built_targets():
    """The nvcc targets effattn._C carries (``["sm_80", "sm_90a", "compute_90"]``)."""
    return torch.ops.effattn_cuda.built_targets().split(",")


def ops(device: torch.device):
    """The op namespace serving tensors on `device`."""
    return torch.ops.effattn_cuda if device.type == "cuda" else torch.ops.effattn_cuda_emu


def available(device: torch.device) -> Optional[str]:
    """None when the backend's kernels run on `device`, else why not (the rows' runtime check)."""
    if device.type == "cpu":
        return emu_problem()
    if device.type == "cuda":
        return device_problem(device)
    return None
