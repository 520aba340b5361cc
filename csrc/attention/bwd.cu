// Entry point of the softmax-attention backward (Delta, then the fused dK/dV/dQ kernel when the call asks
// for it with dq_accum, else the dK/dV and dQ passes): dispatch on dtype and head-dim bucket to the
// launchers of launch.cuh; the forward's is fwd.cu.
#include "attention/bwd_fused.cuh"
#include "attention/launch.cuh"

namespace effattn {
namespace {

// The fused backward (bwd_fused.cuh) after the Delta kernel: dK, dV, dQ's fp32 accumulator, then dq.
template <int HD, bool BF16>
int bwd_fused(const AttnParams& p, prim::stream_t stream) {
  using Cfg = BwdFusedConfig<HD>;
  int err = detail::delta<BF16>(p, stream);
  if (err) return err;
  if (p.Lk > 0) {
    err = detail::launch(attn_bwd_fused_kernel<HD, BF16>, detail::cdiv(p.Lk, Cfg::BN) * unsigned(p.B * (p.H / p.G)),
                         1, Cfg::kSmem, stream, p, Cfg::kThreads);
    if (err) return err;
  }
  return detail::launch(attn_dq_convert_kernel<BF16>, detail::cdiv(p.dq_numel, 512), 1, 0, stream, p);
}

template <bool BF16>
int dispatch_bwd(const AttnParams& p, prim::stream_t stream) {
  const bool fused = p.dq_accum != nullptr;          // attention_bwd_fused_serves(p): buckets 32..128
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 32: return fused ? bwd_fused<32, BF16>(p, stream) : detail::bwd<32, BF16>(p, stream);
    case 64: return fused ? bwd_fused<64, BF16>(p, stream) : detail::bwd<64, BF16>(p, stream);
    case 128: return fused ? bwd_fused<128, BF16>(p, stream) : detail::bwd<128, BF16>(p, stream);
    case 256: return detail::bwd<256, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

bool attention_bwd_fused_serves(const AttnParams& p) {
  return !has_bias_tensors(p) && !p.layout && !p.lists && !p.lists_by_key && !p.dalibi &&
         head_dim_bucket(p.D > p.Dv ? p.D : p.Dv) <= 128 && head_dim_bucket(p.D > p.Dv ? p.D : p.Dv) > 0;
}

int attention_bwd(const AttnParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  if (has_bias_tensors(p)) return attention_bwd_terms(p, bf16, stream_ptr);   // terms.cu
  return bf16 ? dispatch_bwd<true>(p, stream) : dispatch_bwd<false>(p, stream);
}

}  // namespace effattn
