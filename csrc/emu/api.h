// The emulation's controls, as the emulated binding (csrc/binding/module.cpp) calls them. Torch-free
// declarations: the kernels and the emulation live in a library of their own
// (effattn/backends/cuda/_ext.py builds every csrc/*/*.cu with the host compiler, plus api.cpp), so
// that a kernel edit rebuilds only that library, not the torch binding.
#pragma once

#include <cstdint>

namespace effattn {
namespace emu_api {

// 0 lockstep, 1 warp-serial, 2 warp-serial from the last warp (emu.h)
void set_schedule(int schedule);
// blocks, mma, ldmatrix phases, ldmatrix wavefronts, worst wavefronts of one phase; reset on read
void read_stats(int64_t (&out)[5]);
// the emulated device's opt-in shared memory per block, in bytes (a launch asking for more fails)
void set_smem_limit(int64_t bytes);
int64_t smem_limit();

}  // namespace emu_api
}  // namespace effattn
