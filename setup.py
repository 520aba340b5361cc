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


def cuda_build():
    """(ext_modules, cmdclass) for the CUDA extension, or ([], {}) with the reason printed."""
    want = os.environ.get("EFFATTN_BUILD_CUDA", "auto")
    if want == "0":
        return [], {}
    kernels = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    bindings = sorted(glob.glob(os.path.join("csrc", "binding", "*.cpp")))   # the only torch-including sources
    why = None
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
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    nvcc = ["-O3", "--use_fast_math", "-std=c++17", "--expt-relaxed-constexpr"]
    cxx = ["-O3", "-std=c++17"]
    if arch:    # torch's format: "8.0;9.0a" or "8.0 9.0a+PTX"
        sm90a = any(a.startswith("9.0a") for a in arch.replace(";", " ").split())
    else:
        sm90a = nvcc_version(CUDA_HOME) >= (12, 0)
    if not arch:
        nvcc += ["-gencode=arch=compute_80,code=sm_80"]
        nvcc += ["-gencode=arch=compute_90a,code=sm_90a"] if sm90a else []
    if sm90a:    # the Hopper forward (csrc/attention_sm90.cu) has device code: the launcher may run it
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
        "test": ["pytest", "pytest-benchmark", "hypothesis>=6.100", TRITON, "numpy", "matplotlib", "tqdm",
                 "transformers>=4.56",
                 "pillow",   # the LRA Pathfinder loader (benchmarks/lra)
                 # SASS checks of the CUDA kernels (tests/test_cuda_build.py)
                 "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
