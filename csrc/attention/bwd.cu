// Entry points of the softmax-attention backward (Delta, then the fused dK/dV/dQ kernel when the call asks
// for it with dq_accum, else the dK/dV and dQ passes; attention_bwd_sm90: the Hopper one of bwd_sm90.cuh): dispatch on dtype, head-dim bucket, mask kind
// (MaskKind, common.cuh) and dropout to the launchers of bwd_launch.cuh. This unit compiles no kernel: it
// sees only their declarations (launchers.cuh); each instance is a translation unit of its own in
// attention/inst/ (written by csrc/generate_instances.py), so nvcc builds them side by side. The forward's
// entry point is fwd.cu.
#include "attention/common.cuh"
#include "attention/launchers.cuh"

namespace effattn {
namespace {

template <int HD, bool BF16, bool DROP>
int bwd_of_kind(int kind, const AttnParams& p, prim::stream_t stream) {
  return with_mask_kind(kind, [&](auto k) { return detail::bwd_of_call<HD, BF16, decltype(k)::value, DROP>(p, stream); });
}

// The narrowest instance for the call: its mask kind for the key tile of the kernel that runs (the fused
// one's when the call asks for it), and the dropout code only when it drops.
template <int HD, bool BF16>
int bwd_of_bucket(const AttnParams& p, prim::stream_t stream) {
  int kind = mask_kind(p, HD <= 128 && p.dq_accum ? detail::kBwdFusedKeyTile : detail::kBwdKeyTile);
  bool drop = p.dropout != 0;
  if (HD <= 128 && !p.dq_accum && kind != kLayout) kind = kAny;   // those units' two passes (bwd_launch.cuh)
#if defined(EFFATTN_CUDA_EMU)
  if (emu_record::bwd_general) kind = kAny, drop = true;
#endif
  return drop ? bwd_of_kind<HD, BF16, true>(kind, p, stream) : bwd_of_kind<HD, BF16, false>(kind, p, stream);
}

template <bool BF16>
int dispatch_bwd(const AttnParams& p, prim::stream_t stream) {
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 32: return bwd_of_bucket<32, BF16>(p, stream);
    case 64: return bwd_of_bucket<64, BF16>(p, stream);
    case 128: return bwd_of_bucket<128, BF16>(p, stream);
    case 256: return bwd_of_bucket<256, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

bool attention_bwd_fused_serves(const AttnParams& p) {
  return !has_bias_tensors(p) && !p.layout && !p.lists && !p.lists_by_key && !p.dalibi && !p.q_pos &&
         head_dim_bucket(p.D > p.Dv ? p.D : p.Dv) <= 128 && head_dim_bucket(p.D > p.Dv ? p.D : p.Dv) > 0;
}

bool attention_bwd_sm90_serves(const AttnParams& p) {
  const int hd = head_dim_bucket(p.D > p.Dv ? p.D : p.Dv);
  const int kind = mask_kind(p, detail::kBwdFusedKeyTile);
  return attention_bwd_fused_serves(p) && (hd == 64 || hd == 128) && !p.dropout && !p.score && !p.cu_q &&
         (kind == kDense || kind == kCausal || kind == kWindow);
}

int attention_bwd_sm90(const AttnParams& p, bool bf16, void* stream_ptr) {
  if (!attention_fwd_sm90_built()) return -2;
  if (!p.dq_accum || !attention_bwd_sm90_serves(p)) return -1;
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  const int hd = head_dim_bucket(p.D > p.Dv ? p.D : p.Dv);
  if (hd == 64) return bf16 ? detail::bwd_sm90<64, true>(p, stream) : detail::bwd_sm90<64, false>(p, stream);
  return bf16 ? detail::bwd_sm90<128, true>(p, stream) : detail::bwd_sm90<128, false>(p, stream);
}

int attention_bwd(const AttnParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  if (has_bias_tensors(p)) return attention_bwd_terms(p, bf16, stream_ptr);   // terms.cu
  return bf16 ? dispatch_bwd<true>(p, stream) : dispatch_bwd<false>(p, stream);
}

}  // namespace effattn

#if defined(EFFATTN_CUDA_EMU)
extern "C" int effattn_emu_last_bwd_instance() { return effattn::emu_record::last_bwd; }
extern "C" void effattn_emu_set_bwd_general(int on) { effattn::emu_record::bwd_general = on; }
#endif
