// Entry points of the softmax-attention kernels with bias tensors (relative table, adaptive span, dense
// bias; attention.h: has_bias_tensors): the mma.sync forward's kAny instance and the backward's dK/dV
// and dQ kernels compiled with TERMS = true, per dtype and head-dim bucket. A translation unit of its
// own, so that calls without those terms run the kernels of fwd.cu / bwd.cu, compiled without the
// terms' code, and each unit stays within the kernel budget.
// the round keys of the dropout hash computed from the seed here (common.cuh: philox_round_key)
#define EFFATTN_PHILOX_KEYS_FROM_SEED 1
#include "attention/bwd_launch.cuh"

namespace effattn {
namespace {

template <bool BF16>
int dispatch_terms_fwd(const AttnParams& p, prim::stream_t stream) {
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 32: return detail::fwd_terms<32, BF16>(p, stream);
    case 64: return detail::fwd_terms<64, BF16>(p, stream);
    case 128: return detail::fwd_terms<128, BF16>(p, stream);
    case 256: return detail::fwd_terms<256, BF16>(p, stream);
    default: return -1;
  }
}

template <bool BF16>
int dispatch_terms_bwd(const AttnParams& p, prim::stream_t stream) {
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 32: return detail::bwd<32, BF16, true>(p, stream);
    case 64: return detail::bwd<64, BF16, true>(p, stream);
    case 128: return detail::bwd<128, BF16, true>(p, stream);
    case 256: return detail::bwd<256, BF16, true>(p, stream);
    default: return -1;
  }
}

}  // namespace

int attention_fwd_terms(const AttnParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  return bf16 ? dispatch_terms_fwd<true>(p, stream) : dispatch_terms_fwd<false>(p, stream);
}

int attention_bwd_terms(const AttnParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  return bf16 ? dispatch_terms_bwd<true>(p, stream) : dispatch_terms_bwd<false>(p, stream);
}

}  // namespace effattn
