// Entry point of the softmax-attention forward: dispatch on dtype and head-dim bucket to the
// launchers of launch.cuh (the backward's is bwd.cu: two translation units, so that
// nvcc builds them in parallel and each in about half the time). Compiled by nvcc for the GPU, or by
// a host compiler with EFFATTN_CUDA_EMU for the emulation (the same code; common/prims.cuh hides the
// difference).
#include "attention/launch.cuh"

namespace effattn {
namespace {

template <bool BF16>
int dispatch_fwd(const AttnParams& p, prim::stream_t stream) {
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 32: return detail::fwd<32, BF16>(p, stream);
    case 64: return detail::fwd<64, BF16>(p, stream);
    case 128: return detail::fwd<128, BF16>(p, stream);
    case 256: return detail::fwd<256, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

int attention_fwd(const AttnParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  if (has_bias_tensors(p)) return attention_fwd_terms(p, bf16, stream_ptr);   // terms.cu
  return bf16 ? dispatch_fwd<true>(p, stream) : dispatch_fwd<false>(p, stream);
}

}  // namespace effattn
