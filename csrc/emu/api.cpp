// The emulation's controls (api.h), compiled into the emulated kernels' library.
#include "emu/api.h"

#include "common/prims.cuh"

namespace effattn {
namespace emu_api {

void set_schedule(int schedule) { emu::schedule() = emu::Schedule(schedule); }

void read_stats(int64_t (&out)[5]) {
  emu::Stats& s = emu::stats();
  out[0] = int64_t(s.blocks);
  out[1] = int64_t(s.mma);
  out[2] = int64_t(s.ldmatrix_phases);
  out[3] = int64_t(s.ldmatrix_wavefronts);
  out[4] = int64_t(s.max_wavefronts);
  s = emu::Stats();
}

void set_smem_limit(int64_t bytes) { emu::smem_limit() = size_t(bytes); }

int64_t smem_limit() { return int64_t(emu::smem_limit()); }

}  // namespace emu_api
}  // namespace effattn
