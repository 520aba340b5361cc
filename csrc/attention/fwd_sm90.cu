// Entry point of the Hopper (sm_90a, wgmma) softmax-attention forward: dispatch on dtype and head
// dim (64 and 128 only) to the warp-specialized TMA kernel of fwd_sm90_tma.cuh when the call's tensor maps
// encode (16-byte aligned bases and strides), else (or with EFFATTN_CUDA_HOPPER_TMA=0) to the cp.async
// kernel of fwd_sm90.cuh. Its device code exists only in the
// sm_90a part of a build (EFFATTN_SM90A); setup.py defines EFFATTN_SM90A_BUILT when the build has
// that part, and without it the launcher refuses (the part-1 forward serves instead). Under
// EFFATTN_CUDA_EMU the kernel runs through the emulation.
#include <cstdlib>

#include "attention/fwd_sm90.cuh"
#include "attention/fwd_sm90_tma.cuh"
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

// The call's tensor maps for the TMA kernel: (D, L, heads, batch) of Q, K and V, boxes of 64 columns of a
// query or key tile. False when one does not encode (a base or stride not a multiple of 16 bytes, a
// negative stride, no keys): the cp.async kernel serves such calls.
template <int HD, int BN>
bool tma_maps(const AttnParams& p, FwdTmaParams& tp) {
  using Cfg = FwdTmaConfig<HD, BN>;
  const int hkv = p.H / p.G;
  tp.p = p;
  return head_rows_map(tp.q, p.q, p.q_l, p.q_h, p.q_b, p.q0, p.D, p.Lq, p.H, p.B, Cfg::BM) &&
         head_rows_map(tp.k, p.k, p.k_l, p.k_h, p.k_b, p.k0, p.D, p.Lk, hkv, p.B, Cfg::BN) &&
         head_rows_map(tp.v, p.v, p.v_l, p.v_h, p.v_b, p.k0, p.Dv, p.Lk, hkv, p.B, Cfg::BN);
}

bool tma_turned_off() {
  const char* e = std::getenv("EFFATTN_CUDA_HOPPER_TMA");
  return e && e[0] == '0';
}

// Launches the TMA kernel's instance of coarse mask kind KIND with the tensor maps of its key tile (rc: the
// launch's status); false when the maps do not encode (the cp.async kernel serves).
template <int HD, bool BF16, int KIND>
bool fwd_sm90_tma(const AttnParams& p, prim::stream_t stream, int& rc) {
  using Cfg = FwdTmaConfig<HD>;
  FwdTmaParams tp;
  if (!tma_maps<HD, Cfg::BN>(p, tp)) return false;
  rc = detail::launch(attn_fwd_sm90_tma_kernel<HD, BF16, KIND>, detail::cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H),
                      1, Cfg::kSmemBytes, stream, tp, Cfg::kThreads);
  return true;
}

template <int HD, bool BF16>
int fwd_sm90(const AttnParams& p, prim::stream_t stream) {
  using Cfg = FwdSm90Config<HD>;
  if (!tma_turned_off()) {
    // the kinds at the TMA kernel's 128-key tiles (kDense needs Lk a multiple of 128)
    int rc = 0;
    bool ran;
    switch (coarse_kind(mask_kind(p, kFwdTmaKeyTile), p.dropout != 0)) {
      case kDense: ran = fwd_sm90_tma<HD, BF16, kDense>(p, stream, rc); break;
      case kWindow: ran = fwd_sm90_tma<HD, BF16, kWindow>(p, stream, rc); break;
      default: ran = fwd_sm90_tma<HD, BF16, kAny>(p, stream, rc); break;
    }
    if (ran) return rc;
    // the host built a layout's lists for the TMA kernel's 128-key tiles (hopper.tma_why_not: it serves); the
    // cp.async kernel would read them as 64-key ones: refuse rather than run on the wrong plan
    if (p.lists) return -3;
  }
  const int kind = coarse_kind(mask_kind(p, Cfg::BN), p.dropout != 0);
  return detail::launch_by_kind<Sm90Kernel<HD, BF16>::template Of>(
      kind, detail::cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H),
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
