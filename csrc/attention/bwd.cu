// Entry point of the softmax-attention backward (Delta, then the fused dK/dV/dQ kernel when the call asks
// for it with dq_accum, else the dK/dV and dQ passes): dispatch on dtype and head-dim bucket to the
// launchers of bwd_launch.cuh. This unit compiles no kernel: it sees only their declarations
// (launchers.cuh); each (bucket, dtype) is a translation unit of its own in attention/inst/ (written by
// csrc/generate_instances.py), so nvcc builds them side by side. The forward's entry point is fwd.cu.
#include "attention/launchers.cuh"

namespace effattn {
namespace {

template <bool BF16>
int dispatch_bwd(const AttnParams& p, prim::stream_t stream) {
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 32: return detail::bwd_of_call<32, BF16>(p, stream);
    case 64: return detail::bwd_of_call<64, BF16>(p, stream);
    case 128: return detail::bwd_of_call<128, BF16>(p, stream);
    case 256: return detail::bwd_of_call<256, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

bool attention_bwd_fused_serves(const AttnParams& p) {
  return !has_bias_tensors(p) && !p.layout && !p.lists && !p.lists_by_key && !p.dalibi && !p.q_pos &&
         head_dim_bucket(p.D > p.Dv ? p.D : p.Dv) <= 128 && head_dim_bucket(p.D > p.Dv ? p.D : p.Dv) > 0;
}

int attention_bwd(const AttnParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  if (has_bias_tensors(p)) return attention_bwd_terms(p, bf16, stream_ptr);   // terms.cu
  return bf16 ? dispatch_bwd<true>(p, stream) : dispatch_bwd<false>(p, stream);
}

}  // namespace effattn
