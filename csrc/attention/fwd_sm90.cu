// Entry point of the Hopper (sm_90a, wgmma) softmax-attention forward: dispatch on dtype and head
// dim (64 and 128 only) to the kernel of fwd_sm90.cuh. Its device code exists only in the
// sm_90a part of a build (EFFATTN_SM90A); setup.py defines EFFATTN_SM90A_BUILT when the build has
// that part, and without it the launcher refuses (the part-1 forward serves instead). Under
// EFFATTN_CUDA_EMU the kernel runs through the emulation.
#include "attention/fwd_sm90.cuh"
#include "attention/launch.cuh"

namespace effattn {
namespace {

template <int HD, bool BF16>
struct Sm90Kernel {
  template <int KIND>
  struct Of {
    static constexpr auto value = attn_fwd_sm90_kernel<HD, BF16, KIND>;
  };
};

template <int HD, bool BF16>
int fwd_sm90(const AttnParams& p, prim::stream_t stream) {
  using Cfg = FwdSm90Config<HD>;
  return detail::launch_by_kind<Sm90Kernel<HD, BF16>::template Of>(
      coarse_kind(mask_kind(p, Cfg::BN), p.dropout != 0), detail::cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H),
      Cfg::kSmemBytes, stream, p, Cfg::kThreads);
}

template <bool BF16>
int dispatch_sm90(const AttnParams& p, prim::stream_t stream) {
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 64: return fwd_sm90<64, BF16>(p, stream);
    case 128: return fwd_sm90<128, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

bool attention_fwd_sm90_built() {
#if defined(EFFATTN_CUDA_EMU) || defined(EFFATTN_SM90A_BUILT)
  return true;
#else
  return false;
#endif
}

int attention_fwd_sm90(const AttnParams& p, bool bf16, void* stream_ptr) {
  if (!attention_fwd_sm90_built()) return -2;
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  return bf16 ? dispatch_sm90<true>(p, stream) : dispatch_sm90<false>(p, stream);
}

}  // namespace effattn
