// Per-instance launchers of the softmax-attention forward kernels (one head-dim bucket, dtype, mask kind
// and dropout flag; the bias-term and relative-key instances): grid, shared memory, launch; and `launch`
// itself, which every op's launchers use. fwd.cu dispatches to the forward's through attention/inst/;
// the backward's are in bwd_launch.cuh (a forward unit does not include the backward's kernels); the
// host self-test instantiates a few directly. Under EFFATTN_CUDA_EMU a "launch" runs the grid through the emulation.
#pragma once

#include "attention/attention.h"
#include "attention/fwd.cuh"
#include "attention/launchers.cuh"

namespace effattn {
namespace detail {

#if defined(EFFATTN_CUDA_EMU)
template <class Kernel, class Params>
int launch(Kernel kernel, unsigned grid, unsigned split, int smem, prim::stream_t, const Params& p,
           unsigned threads = 128) {
  emu::launch(emu::Dim3{grid, 1, split}, emu::Dim3{threads, 1, 1}, size_t(smem), [&] { kernel(p); });
  return 0;
}
#else
template <class Kernel, class Params>
int launch(Kernel kernel, unsigned grid, unsigned split, int smem, prim::stream_t stream, const Params& p,
           unsigned threads = 128) {
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return int(e);
  }
  kernel<<<dim3(grid, 1, split), dim3(threads, 1, 1), smem, stream>>>(p);
  return int(cudaGetLastError());
}
#endif

inline unsigned cdiv(int64_t a, int64_t b) { return unsigned((a + b - 1) / b); }

// A forward kernel instance per MaskKind (common.cuh): `kernel<KIND>` for the kind mask_kind picks.
template <template <int> class Kernel, class Params>
int launch_by_kind(int kind, unsigned grid, int smem, prim::stream_t stream, const Params& p, unsigned threads = 128) {
  switch (kind) {
    case kDense: return launch(Kernel<kDense>::value, grid, 1, smem, stream, p, threads);
    case kWindow: return launch(Kernel<kWindow>::value, grid, 1, smem, stream, p, threads);
    default: return launch(Kernel<kAny>::value, grid, 1, smem, stream, p, threads);
  }
}

// The mma.sync forward (declared in launchers.cuh; attention/inst/ instantiates it per head-dim bucket,
// dtype, mask kind and dropout flag, and fwd.cu picks one per call). Up to head dim 128 the instances take
// 128-row query tiles (32 rows per warp, fwd.cuh) where fwd_wide says so; two 128-row blocks fit every
// sm_80+ SM there, so 64-row tiles are built only for block layouts (kLayout: layouts fwd_wide refuses,
// i.e. lists without the 128-row tiles' rows, or at head dim 128 a device that does not hold two 128 x 64 blocks
// per SM (the 99 KB GPUs) or dropout; and kAny, which also serves a call on a device with less shared memory:
// fwd.cu sends such calls to kAny) and at head dim 256. A layout's 128-row instances read the 128-row tiles'
// lists (fwd_wide_lists: the union of the two 64-row halves' lists; any block size, any window). kLayout's
// 128-row instance at head dim 128 is the 128 x 64 one only (its lists' key tiles).
// The instances with a 128 x 64 tile (head dim 128, no dropout): kDense, kCausal and kWindow besides their
// 128 x 32 one (fwd_long_keys picks per device), and kLayout (its only 128-row one). nvcc 13.0 spilled it in kAny
// without dropout (32 bytes, sm_80), kCausal with dropout (8 bytes) and kLayout with dropout (24 bytes), so those
// and the other dropout instances keep 128 x 32 (FA2 too runs 128 x 32 with dropout there); kLayout with dropout
// at head dim 128 has only its 64-row instance (fwd_wide refuses a layout with dropout there).
template <int HD, int KIND, bool DROP>
inline constexpr bool kLongKeys =
    HD == 128 && !DROP && (KIND == kDense || KIND == kCausal || KIND == kWindow || KIND == kLayout);

template <int HD, bool BF16, int KIND, bool DROP>
int fwd(const AttnParams& p, prim::stream_t stream) {
  constexpr bool kWide = FwdConfig<HD, 32>::kWide && (KIND != kLayout || HD < 128 || !DROP);   // a 128-row instance
  constexpr bool kNarrow = !FwdConfig<HD, 32>::kWide || KIND == kLayout || KIND == kAny;  // a 64-row one
#if defined(EFFATTN_CUDA_EMU)
  emu_record::last_fwd = HD * 1000 + BF16 * 100 + KIND * 10 + DROP;
  emu_record::last_fwd_keys = 0;
#endif
  if constexpr (kWide) {
    // a layout's lists at head dim 128 are for 64-key tiles: kAny's 128 x 32 instance never reads them (the general
    // instance of the emulation's record takes 64 rows then)
    if (!kNarrow || (fwd_wide<HD>(p, device_smem_optin()) && !(HD >= 128 && KIND != kLayout && p.lists))) {
      if constexpr (kLongKeys<HD, KIND, DROP>) {
        if (fwd_long_keys<HD>(device_smem_optin()) && (KIND != kDense || p.Lk % 64 == 0)) {   // kDense: full tiles
#if defined(EFFATTN_CUDA_EMU)
          emu_record::last_fwd_keys = 64;
#endif
          using Cfg = FwdConfig<HD, 32, 64>;
          return launch(attn_fwd_kernel<HD, BF16, KIND, false, false, DROP, 32, StridedRows, 64>,
                        cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), 1, Cfg::kSmemBytes, stream, fwd_wide_lists(p));
        }
      }
      if constexpr (!(KIND == kLayout && HD >= 128)) {   // kLayout: fwd_wide asked for the 128 x 64 tile's room
        using Cfg = FwdConfig<HD, 32>;
        return launch(attn_fwd_kernel<HD, BF16, KIND, false, false, DROP, 32>,
                      cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), 1, Cfg::kSmemBytes, stream, fwd_wide_lists(p));
      }
    }
  }
  if constexpr (kNarrow) {
    using Cfg = FwdConfig<HD>;
    return launch(attn_fwd_kernel<HD, BF16, KIND, false, false, DROP>, cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), 1,
                  Cfg::kSmemBytes, stream, p);
  }
  return -1;   // not reached: kWide holds where kNarrow does not
}

// The forward with bias tensors: one instance (mask kind kAny, TERMS).
template <int HD, bool BF16>
int fwd_terms(const AttnParams& p, prim::stream_t stream) {
  using Cfg = FwdConfig<HD>;
  return launch(attn_fwd_kernel<HD, BF16, kAny, true>, cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), 1, Cfg::kSmemBytes,
                stream, p);
}

// The forward with relative keys: one instance (mask kind kAny, RELK).
template <int HD, bool BF16>
int fwd_relk(const AttnParams& p, prim::stream_t stream) {
  using Cfg = FwdConfig<HD>;
  return launch(attn_fwd_kernel<HD, BF16, kAny, false, true>, cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), 1,
                Cfg::kRelkSmemBytes, stream, p);
}

}  // namespace detail
}  // namespace effattn
