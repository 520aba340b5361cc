"""Finding the compiled ops of the CUDA backend.

- On CUDA tensors: ``effattn._C``, built by setup.py where torch is a CUDA build and nvcc exists;
  its ops are ``torch.ops.effattn_cuda.*``.
- On CPU tensors, with ``EFFATTN_CUDA_EMU=1``: the same binding compiled by the host compiler with
  the emulation of csrc/emu/ (``torch.ops.effattn_cuda_emu.*``), built on first use and cached under
  ``~/.cache/effattn`` (``EFFATTN_CUDA_EMU_DIR``) keyed on the sources' hash. Two parts: the kernels
  (every csrc/*/*.cu, csrc/*/inst/*.cu and csrc/emu/api.cpp, compiled by g++ into ``libeffattn_emu_kernels.so``, no
  torch: seconds) and the binding (csrc/binding/*.cpp as one unit through
  ``torch.utils.cpp_extension.load``, linked against that library: about 40 s, redone only when the
  binding or a ``.h`` changes), so a kernel edit rebuilds only the first, and of it only the units
  that include the edited file. ``EFFATTN_CSRC`` points both at another copy of csrc/ (the
  mutation script, csrc/emu/mutate.py, runs the tests on mutated copies this way).
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import threading
from typing import Optional

import torch

try:
    import fcntl
except ImportError:      # not POSIX: builds are not shared between processes there
    fcntl = None

from . import targets

_CSRC = os.environ.get("EFFATTN_CSRC") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "csrc")
KERNELS_LIB = "libeffattn_emu_kernels.so"
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


def _digest(files, *extra) -> str:
    """A hash of `files` (their paths relative to csrc/ and contents) and `extra` strings."""
    digest = hashlib.sha1()
    for f in files:
        digest.update(os.path.relpath(f, _CSRC).encode())
        with open(f, "rb") as fh:
            digest.update(fh.read())
    for e in extra:
        digest.update(e.encode())
    return digest.hexdigest()[:16]


def _cache_root() -> str:
    return os.environ.get("EFFATTN_CUDA_EMU_DIR", os.path.join(os.path.expanduser("~"), ".cache", "effattn"))


def _unit_object(cxx, flags, src, folder, name=None, text="") -> tuple:
    """(object path, compile command or None when cached) of one translation unit: the object is
    keyed on the contents of every file the unit includes (``-MM``), so a change to one kernel header
    recompiles only the units that include it. A unit outside csrc/ (`_unity_units`) passes its
    `name` and `text`, which key it instead of its path."""
    res = subprocess.run([cxx, *flags, "-x", "c++", "-MM", src], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"compiling the emulated kernels failed:\n{res.stderr[-4000:]}")
    deps = sorted(os.path.abspath(d) for d in res.stdout.replace("\\\n", " ").split(":", 1)[1].split())
    if name is None:
        name = os.path.relpath(src, _CSRC).replace(os.sep, "_")
    else:
        deps = [d for d in deps if d != os.path.abspath(src)]
    # keyed on the flags with csrc/'s own path left out: a copy of csrc/ (EFFATTN_CSRC, a mutant) reuses
    # every object whose sources it did not change
    key_flags = ["<csrc>" if f == _CSRC else f for f in flags]
    obj = os.path.join(folder, f"{name}-{_digest(deps, cxx, *key_flags, text)}.o")
    if os.path.exists(obj):
        return obj, None
    return obj, [cxx, *flags, "-x", "c++", "-c", src, "-o", f"{obj}.{os.getpid()}.tmp"]


def kernel_units():
    """The kernels' translation units, as setup.py's nvcc build takes them: every csrc/*/*.cu and the
    generated instances of csrc/*/inst/*.cu (csrc/generate_instances.py)."""
    return sorted(glob.glob(os.path.join(_CSRC, "*", "*.cu")) + glob.glob(os.path.join(_CSRC, "*", "inst", "*.cu")))


def build_kernels(extra_cflags=()) -> str:
    """The emulated kernels' library (`kernel_units`, as setup.py's nvcc build takes them, and
    csrc/emu/api.cpp), built with the host compiler and cached on the sources' hash; returns its
    path. Objects are cached per translation unit (`_unit_object`) and compiled side by side, MAX_JOBS
    (default: the CPU count) at a time."""
    cxx = os.environ.get("CXX", "g++")
    flags = ["-std=c++17", "-O2", "-fPIC", "-DEFFATTN_CUDA_EMU", "-I", _CSRC, *extra_cflags]
    root = _cache_root()
    lib = os.path.join(root, f"emu_kernels-{_digest(sources(), cxx, *flags[:4], *extra_cflags)}", KERNELS_LIB)
    if os.path.exists(lib):
        return lib
    with _build_lock(root):
        if not os.path.exists(lib):         # another process built it while this one waited
            _compile_and_link(cxx, flags, extra_cflags, root, lib)
    return lib


@contextlib.contextmanager
def _build_lock(root):
    """One kernel build at a time per cache folder across processes (pytest-xdist's workers start
    their first emulated test together): the one that waits then finds the objects it needs built."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "build.lock"), "a") as f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def _unity_units(units, folder):
    """[(source, name, text)]: the generated instance units (csrc/*/inst/*.cu) grouped per the first three
    parts of their names (``fwd_64_bf16``: that bucket and dtype's mask kinds and dropout flags;
    ``bwd_64_bf16`` alone), each group one unit that includes them, written to `folder`: the host
    compiler parses the kernel headers once per group instead of once per instance (most of a forward
    instance's compile time).
    The includes are relative to csrc/, so a copy of csrc/ (EFFATTN_CSRC) reuses the objects."""
    groups = {}
    for src in units:
        rel = os.path.relpath(src, _CSRC).replace(os.sep, "/")
        head, base = rel.rsplit("/", 1)
        groups.setdefault(f"{head}/{'_'.join(base[:-len('.cu')].split('_')[:3])}", []).append(rel)
    out = []
    os.makedirs(folder, exist_ok=True)
    for key, rels in sorted(groups.items()):
        text = "".join(f'#include "{r}"\n' for r in sorted(rels))
        name = key.replace("/", "_") + "-unity"
        path = os.path.join(folder, f"{name}-{hashlib.sha1(text.encode()).hexdigest()[:12]}.cpp")
        if not os.path.exists(path):
            with open(f"{path}.{os.getpid()}.tmp", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(f"{path}.{os.getpid()}.tmp", path)
        out.append((path, name, text))
    return out


def _compile_and_link(cxx, flags, extra_cflags, root, lib) -> None:
    """Compiles the units whose objects are not cached yet, side by side, and links `lib`."""
    objdir = os.path.join(root, "emu_objects")
    os.makedirs(objdir, exist_ok=True)
    inst = os.sep + "inst" + os.sep
    units = [u for u in kernel_units() if inst not in u] + [os.path.join(_CSRC, "emu", "api.cpp")]
    plan = [_unit_object(cxx, flags, src, objdir) for src in units]
    plan += [_unit_object(cxx, flags, src, objdir, name, text)
             for src, name, text in _unity_units([u for u in kernel_units() if inst in u], os.path.join(root, "emu_unity"))]
    todo = [(obj, cmd) for obj, cmd in plan if cmd]
    jobs = max(1, int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1))
    errors, running = [], []

    def finish(obj, proc):
        err = proc.communicate()[1]
        if proc.returncode:
            errors.append(err)
        else:
            os.replace(f"{obj}.{os.getpid()}.tmp", obj)

    for obj, cmd in todo:                   # MAX_JOBS (default: the CPU count) compilers at a time
        if len(running) >= jobs:
            finish(*running.pop(0))
        running.append((obj, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)))
    for obj, proc in running:
        finish(obj, proc)
    if errors:
        raise RuntimeError("compiling the emulated kernels failed:\n" + "\n".join(errors)[-4000:])
    os.makedirs(os.path.dirname(lib), exist_ok=True)
    tmp = f"{lib}.{os.getpid()}.tmp"
    res = subprocess.run([cxx, "-shared", *(obj for obj, _ in plan), "-o", tmp, f"-Wl,-soname,{KERNELS_LIB}",
                          *extra_cflags], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"linking the emulated kernels failed:\n{res.stderr[-4000:]}")
    os.replace(tmp, lib)


def build_emu(extra_cflags=(), name="effattn_cuda_emu", verbose=False):
    """Builds (cached) and loads the emulated extension: the kernels' library (`build_kernels`),
    loaded first with its symbols global, then csrc/binding/*.cpp compiled with EFFATTN_CUDA_EMU
    against torch. The binding is not linked to the library: its kernel entry points stay undefined
    until it loads and resolve to the library loaded before it, so one binding build serves every
    build of the kernels (its hash leaves them out). The C++ standard of the binding is torch's own
    choice (C++17 up to torch 2.13, C++20 from 2.14); the kernels' library is C++17."""
    from torch.utils import cpp_extension
    lib = build_kernels(extra_cflags)
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    emu_dir = os.path.join(_CSRC, "emu", "")
    binding = [f for f in sources() if f.endswith((".h", ".cpp")) and not f.startswith(emu_dir)]
    binding.append(os.path.join(emu_dir, "api.h"))
    build_dir = os.path.join(_cache_root(), f"{name}-{_digest(binding, name, *extra_cflags)}")
    # compiled from a copy in the build folder: the same sources under another csrc/ (EFFATTN_CSRC)
    # reuse the build (ninja keys its objects on the source paths)
    src = os.path.join(build_dir, "src")
    for f in binding:
        dst = os.path.join(src, os.path.relpath(f, _CSRC))
        if not os.path.exists(dst):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(f, f"{dst}.{os.getpid()}.tmp")
            os.replace(f"{dst}.{os.getpid()}.tmp", dst)
    # one translation unit including every binding file: each of them parses ATen's headers (about 20 s of
    # the compiler's time apiece), once here (setup.py's real build compiles them side by side)
    unity = os.path.join(src, "binding_unity.cpp")
    if not os.path.exists(unity):
        text = "".join(f'#include "binding/{os.path.basename(f)}"\n'
                       for f in sorted(glob.glob(os.path.join(src, "binding", "*.cpp"))))
        with open(f"{unity}.{os.getpid()}.tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(f"{unity}.{os.getpid()}.tmp", unity)
    cpp_extension.load(name=name, sources=[unity],
                       extra_include_paths=[src], build_directory=build_dir, is_python_module=False,
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
