"""effattn's build.

Pure Python by default: the package runs on the torch reference backend and on Triton. The CUDA
extension (`effattn._C`, sources in csrc/) is built only when the torch found at build time is a
CUDA build and nvcc is present (so install torch first and pass --no-build-isolation), and the
kernel sources exist. Set EFFATTN_BUILD_CUDA=0 to force a pure-Python install, =1 to make a missing
toolchain an error instead of a silent pure-Python install.
"""
import glob
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def nvcc_version(cuda_home):
    """(major, minor) of the nvcc under cuda_home, (0, 0) if it cannot be run."""
    import re
    import subprocess
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True,
                             text=True).stdout
    except OSError:
        return (0, 0)
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def find_toolkit():
    """Sets CUDA_HOME to nvcc's own toolkit where torch's guess (nvcc's grandparent folder) has no CUDA
    headers, as when `nvcc` on PATH is a wrapper script in /usr/local/bin; must run before
    torch.utils.cpp_extension is imported (it reads CUDA_HOME once)."""
    import re
    import shutil
    import subprocess
    nvcc = shutil.which("nvcc")
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or nvcc is None:
        return
    guess = os.path.dirname(os.path.dirname(nvcc))
    if os.path.exists(os.path.join(guess, "include", "cuda_runtime_api.h")):
        return
    try:    # nvcc names its root in a dry run (no compilation)
        out = subprocess.run([nvcc, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    except OSError:
        return
    m = re.search(r"^#\$ TOP=(.+)$", out, re.M)
    if m:
        top = os.path.realpath(m.group(1).strip())
        if os.path.exists(os.path.join(top, "include", "cuda_runtime_api.h")):
            print(f"effattn: CUDA_HOME={top} (nvcc's toolkit; {guess} has no CUDA headers)")
            os.environ["CUDA_HOME"] = top


def load_targets():
    """effattn/backends/cuda/targets.py, loaded by path (effattn itself imports torch)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "effattn_targets", os.path.join(HERE, "effattn", "backends", "cuda", "targets.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cuda_build():
    """(ext_modules, cmdclass) for the CUDA extension, or ([], {}) with the reason printed."""
    want = os.environ.get("EFFATTN_BUILD_CUDA", "auto")
    if want == "0":
        return [], {}
    # one folder per op (csrc/attention, csrc/linear) holds its kernels' .cu files, and its inst/ folder
    # the generated instance units (csrc/generate_instances.py); csrc/binding the torch glue, the only
    # sources that include torch. BuildExtension compiles them with ninja, MAX_JOBS at a time.
    kernels = sorted(glob.glob(os.path.join("csrc", "*", "*.cu")) + glob.glob(os.path.join("csrc", "*", "inst", "*.cu")))
    bindings = sorted(glob.glob(os.path.join("csrc", "binding", "*.cpp")))
    why = None
    find_toolkit()
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        why = "torch is not importable at build time (install torch first, use --no-build-isolation)"
    else:
        if torch.version.cuda is None:
            why = "the installed torch is a CPU build"
        elif CUDA_HOME is None:
            why = "nvcc / CUDA_HOME not found"
        elif not kernels:
            why = "no CUDA kernel sources in csrc/"
    if why:
        if want == "1":
            raise RuntimeError(f"EFFATTN_BUILD_CUDA=1 but the CUDA extension cannot be built: {why}")
        print(f"effattn: building without the CUDA extension: {why}")
        return [], {}
    targets = load_targets()
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not arch:
        arch = targets.DEFAULT_ARCH_LIST if nvcc_version(CUDA_HOME) >= (12, 0) else "8.0"
    # our own -gencode list (torch then adds none): PTX of the highest architecture rides along
    gencode, built = targets.gencode(arch)
    print(f"effattn: building the CUDA extension for {' '.join(built)}")
    # the C++ standard of the host compiler is torch's choice (C++20 from torch 2.14); the .cu files
    # include no torch and keep nvcc's C++17
    nvcc = ["-O3", "--use_fast_math", "-std=c++17", "--expt-relaxed-constexpr", *gencode]
    cxx = ["-O3", f"-DEFFATTN_CUDA_TARGETS={','.join(built)}"]
    if "sm_90a" in built:    # the Hopper forward (csrc/attention/fwd_sm90.cu) has device code
        nvcc.append("-DEFFATTN_SM90A_BUILT")
        cxx.append("-DEFFATTN_SM90A_BUILT")
    else:
        print("effattn: building without the Hopper (sm_90a) forward: needs nvcc >= 12 and 9.0a in "
              "TORCH_CUDA_ARCH_LIST (when set); the mma.sync forward serves Hopper GPUs")
    ext = CUDAExtension("effattn._C", kernels + bindings, include_dirs=[os.path.join(HERE, "csrc")],
                        extra_compile_args={"cxx": cxx, "nvcc": nvcc})
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_build()

# One Triton requirement for every extra. (Triton's CPU interpreter, used only by the tests on a
# machine without a GPU, needs triton >= 3.7 or numpy < 2.4; effattn.explain says so when it applies.)
TRITON = "triton>=3.6"

with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="effattn",
    version="0.1.0",
    description="Fused efficient attention for PyTorch: dense, causal, sliding-window, block-sparse and "
                "linear attention in Triton and CUDA, with drop-in nn.Module layers",
    long_description=long_description,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["effattn", "effattn.*"]),
    python_requires=">=3.9",
    license="MIT",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "triton": [TRITON],
        "bench": ["matplotlib", "tqdm"],
        "hf": ["transformers>=4.56"],
        "test": ["pytest", "pytest-xdist", "pytest-benchmark", "hypothesis>=6.100", TRITON, "numpy", "matplotlib", "tqdm",
                 "transformers>=4.56",
                 "pillow",   # the LRA Pathfinder loader (benchmarks/lra)
                 # SASS checks of the CUDA kernels (tests/backends/cuda/test_cuda_build.py)
                 "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm",
                 "build",   # the source distribution's contents (tests/backends/cuda/test_cuda_package.py)
                 "ruff"],   # the lint CI runs before the tests (pyproject.toml [tool.ruff])
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
