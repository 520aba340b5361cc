// Declarations of the forward launchers that attention/inst/ instantiates, one translation unit per
// (head-dim bucket, dtype, mask kind, dropout) (csrc/generate_instances.py writes them): fwd.cu
// includes only these declarations, so it compiles no kernel, and the build compiles the instances
// side by side. The definition is in launch.cuh.
#pragma once

#include "attention/attention.h"
#include "common/prims.cuh"

namespace effattn {
namespace detail {

// The mma.sync forward of one head-dim bucket, dtype, MaskKind (common.cuh) and dropout flag.
template <int HD, bool BF16, int KIND, bool DROP>
int fwd(const AttnParams& p, prim::stream_t stream);

}  // namespace detail
}  // namespace effattn

#if defined(EFFATTN_CUDA_EMU)
namespace effattn {
namespace emu_record {
// The emulation's record of the forward instance that ran last (HD * 1000 + BF16 * 100 + KIND * 10 +
// DROP), and its switch that makes fwd.cu run the general instance (kAny with dropout) for every call
// (the specialized instances must give its bits). The tests read and set them through fwd.cu's
// extern "C" accessors (ctypes on the kernels' library).
inline int last_fwd = -1;
inline int fwd_general = 0;
}  // namespace emu_record
}  // namespace effattn
#endif
