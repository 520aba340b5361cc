// The op namespace itself (each op's file adds its schemas as a fragment) and what belongs to one
// build only: the Python module entry point of the real extension, the emulation's controls.
#include "binding/common.h"

#if defined(EFFATTN_CUDA_EMU)
#include "common/prims.cuh"   // the emulation's schedule and counters

namespace {

using namespace effattn::binding;

// Emulation controls for tests: the schedule, and the counters (blocks, mma, ldmatrix phases and
// wavefronts, worst wavefronts of one phase), reset on read.
void emu_set_schedule(int64_t s) { effattn::emu::schedule() = effattn::emu::Schedule(int(s)); }

Tensor emu_stats() {
  effattn::emu::Stats& s = effattn::emu::stats();
  Tensor t = at::tensor({int64_t(s.blocks), int64_t(s.mma), int64_t(s.ldmatrix_phases),
                         int64_t(s.ldmatrix_wavefronts), int64_t(s.max_wavefronts)},
                        at::TensorOptions().dtype(at::kLong));
  s = effattn::emu::Stats();
  return t;
}

}  // namespace

TORCH_LIBRARY(EFFATTN_OPS, m) {
  m.def("emu_set_schedule(int schedule) -> ()", emu_set_schedule);
  m.def("emu_stats() -> Tensor", emu_stats);
}

#else

#include <string>

#if !defined(EFFATTN_CUDA_TARGETS)
#error "EFFATTN_CUDA_TARGETS (the nvcc targets of this build, e.g. sm_80,sm_90a,compute_90) comes from setup.py"
#endif
#define EFFATTN_STRINGIFY(...) #__VA_ARGS__
#define EFFATTN_STRING(...) EFFATTN_STRINGIFY(__VA_ARGS__)

namespace {

// The nvcc targets this build carries ("sm_80,sm_90a,compute_90"): the backend admits a device only
// when one of them runs there (effattn/backends/cuda/targets.py).
std::string built_targets() { return EFFATTN_STRING(EFFATTN_CUDA_TARGETS); }

}  // namespace

TORCH_LIBRARY(EFFATTN_OPS, m) { m.def("built_targets() -> str", built_targets); }

// `import effattn._C` loads this library (which registers the ops of every binding file); Python
// needs the module entry point. The emulated build is loaded as a plain library and needs none.
#include <Python.h>

static PyModuleDef effattn_c_module = {PyModuleDef_HEAD_INIT, "_C",
                                       "effattn's CUDA kernels (ops in torch.ops.effattn_cuda)", -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&effattn_c_module); }

#endif
