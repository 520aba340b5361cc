// Entry point of the forward with relative keys (effattn.bias.RelativeKeys, attention.h: relk): the
// mma.sync forward's kAny instance compiled with RELK = true (relk_add in attention/fwd.cuh: the band of r
// a tile pair reads, one product per tile, the relative shift done in the tile), per dtype and head-dim
// bucket. Forward only: the backward of the term is not written yet (the Python row says so).
#include "attention/launch.cuh"

namespace effattn {
namespace {

template <bool BF16>
int dispatch_relk(const AttnParams& p, prim::stream_t stream) {
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 32: return detail::fwd_relk<32, BF16>(p, stream);
    case 64: return detail::fwd_relk<64, BF16>(p, stream);
    case 128: return detail::fwd_relk<128, BF16>(p, stream);
    case 256: return detail::fwd_relk<256, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

int attention_fwd_relk(const AttnParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  if (!p.relk || p.relk_n < 1 || has_bias_tensors(p) || p.score || p.cu_q || p.dropout) return -1;
  return bf16 ? dispatch_relk<true>(p, stream) : dispatch_relk<false>(p, stream);
}

}  // namespace effattn
