// Entry points of the softmax-attention kernels: dispatch on dtype and head-dim bucket to the
// launchers of attn_launch.cuh. Compiled by nvcc for the GPU, or by a host compiler with
// EFFATTN_CUDA_EMU for the emulation (the same code; prims.cuh hides the difference).
#include "attn_launch.cuh"

namespace effattn {
namespace {

using detail::bwd;
using detail::fwd;

template <bool BF16>
int dispatch(const AttnParams& p, prim::stream_t stream, bool backward) {
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 32: return backward ? bwd<32, BF16>(p, stream) : fwd<32, BF16>(p, stream);
    case 64: return backward ? bwd<64, BF16>(p, stream) : fwd<64, BF16>(p, stream);
    case 128: return backward ? bwd<128, BF16>(p, stream) : fwd<128, BF16>(p, stream);
    case 256: return backward ? bwd<256, BF16>(p, stream) : fwd<256, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

int attention_fwd(const AttnParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  return bf16 ? dispatch<true>(p, stream, false) : dispatch<false>(p, stream, false);
}

int attention_bwd(const AttnParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  return bf16 ? dispatch<true>(p, stream, true) : dispatch<false>(p, stream, true);
}

}  // namespace effattn
