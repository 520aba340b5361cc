// Declarations of the launchers that attention/inst/ instantiates, one translation unit per forward
// and per backward (head-dim bucket, dtype, mask kind, dropout) instance
// (csrc/generate_instances.py writes them): fwd.cu and bwd.cu include only these declarations, so they
// compile no kernel, and the build compiles the instances side by side. The definitions are in
// launch.cuh (forward) and bwd_launch.cuh (backward).
#pragma once

#include "attention/attention.h"
#include "common/prims.cuh"

namespace effattn {
namespace detail {

// The mma.sync forward of one head-dim bucket, dtype, MaskKind (common.cuh) and dropout flag (launch.cuh).
template <int HD, bool BF16, int KIND, bool DROP>
int fwd(const AttnParams& p, prim::stream_t stream);

// The backward of one head-dim bucket, dtype, MaskKind and dropout flag: fused or two passes, as the call
// asks (bwd_launch.cuh).
template <int HD, bool BF16, int KIND, bool DROP>
int bwd_of_call(const AttnParams& p, prim::stream_t stream);

// The Hopper (sm_90a, wgmma) backward of one head-dim bucket (64, 128) and dtype, for calls of mask kind
// kDense, kCausal or kWindow without dropout (bwd_sm90.cuh; attention/inst/bwd_sm90_<hd>_<dtype>.cu).
template <int HD, bool BF16>
int bwd_sm90(const AttnParams& p, prim::stream_t stream);

// The key tiles of the backward's kernels (bwd_launch.cuh checks them): the fused kernel's and the dK/dV
// pass's; a call is kDense for the kernel that runs when Lk is a multiple of its tile (bwd.cu).
constexpr int kBwdFusedKeyTile = 128, kBwdKeyTile = 64;

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
inline int last_fwd_keys = 0;   // 64: it ran the 128 x 64 tile (fwd_long_keys), else 0
inline int fwd_general = 0;
// ... and the same for the backward (last_bwd; bwd_general: bwd.cu runs kAny with dropout for every call)
inline int last_bwd = -1;
inline int bwd_general = 0;
}  // namespace emu_record
}  // namespace effattn
#endif
