// The op namespace itself (each op's file adds its schemas as a fragment) and what belongs to one
// build only: the Python module entry point of the real extension, the emulation's controls.
#include "binding/common.h"

#include <vector>

#if defined(EFFATTN_CUDA_EMU)
#include "emu/api.h"   // the emulation's controls, in the emulated kernels' library

namespace {

using namespace effattn::binding;

// Emulation controls for tests: the schedule, the counters (blocks, mma, ldmatrix phases and
// wavefronts, worst wavefronts of one phase), reset on read, and the emulated device's opt-in shared
// memory per block.
void emu_set_schedule(int64_t s) {
  check(s >= 0 && s <= 2, "schedule must be 0 (lockstep), 1 (warp-serial) or 2 (warp-serial reversed)");
  effattn::emu_api::set_schedule(int(s));
}

Tensor emu_stats() {
  int64_t s[5];
  effattn::emu_api::read_stats(s);
  return at::tensor(std::vector<int64_t>(s, s + 5), at::TensorOptions().dtype(at::kLong));
}

// Sets the limit (bytes > 0) and returns the one in force before; 0 only reads it.
int64_t emu_smem_limit(int64_t bytes) {
  check(bytes >= 0, "the shared-memory limit must be >= 0 bytes (0: read it)");
  const int64_t before = effattn::emu_api::smem_limit();
  if (bytes > 0) effattn::emu_api::set_smem_limit(bytes);
  return before;
}

}  // namespace

TORCH_LIBRARY(EFFATTN_OPS, m) {
  m.def("emu_set_schedule(int schedule) -> ()", emu_set_schedule);
  m.def("emu_stats() -> Tensor", emu_stats);
  m.def("emu_smem_limit(int bytes) -> int", emu_smem_limit);
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
