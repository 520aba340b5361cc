// Per-instance launchers of the softmax-attention kernels (one head-dim bucket and dtype): grid,
// shared memory, launch. fwd.cu / bwd.cu dispatch to them; the host self-test
// instantiates a few directly. Under EFFATTN_CUDA_EMU a "launch" runs the grid through the emulation.
#pragma once

#include "attention/attention.h"
#include "attention/bwd.cuh"
#include "attention/fwd.cuh"

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

template <int HD, bool BF16, int WM = 16>
struct FwdKernel {
  template <int KIND>
  struct Of {
    static constexpr auto value = attn_fwd_kernel<HD, BF16, KIND, false, false, WM>;
  };
};

// 128-row query tiles (32 rows per warp) where fwd_wide says so, else 64-row ones (fwd.cuh). Up to head dim
// 128 two 128-row blocks fit every sm_80+ SM, so only a block layout takes 64 rows there on a GPU: kAny is
// the only 64-row instance built for those buckets.
template <int HD, bool BF16>
int fwd(const AttnParams& p, prim::stream_t stream) {
  if constexpr (FwdConfig<HD, 32>::kWide) {
    using Cfg = FwdConfig<HD, 32>;
    if (fwd_wide<HD>(p, device_smem_optin()))
      return launch_by_kind<FwdKernel<HD, BF16, 32>::template Of>(
          mask_kind(p, Cfg::BN), cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), Cfg::kSmemBytes, stream, p);
  }
  using Cfg = FwdConfig<HD>;
  if constexpr (FwdConfig<HD, 32>::kWide)
    return launch(attn_fwd_kernel<HD, BF16, kAny>, cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), 1, Cfg::kSmemBytes,
                  stream, p);
  else
    return launch_by_kind<FwdKernel<HD, BF16>::template Of>(mask_kind(p, Cfg::BN),
                                                           cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), Cfg::kSmemBytes,
                                                           stream, p);
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

// Delta = rowsum(dO * O) - dlse, the first kernel of every backward.
template <bool BF16>
int delta(const AttnParams& p, prim::stream_t stream) {
  return launch(attn_delta_kernel<BF16>, cdiv(p.Lq, 16) * unsigned(p.B * p.H), 1, 0, stream, p);
}

template <int HD, bool BF16, bool TERMS = false>
int bwd(const AttnParams& p, prim::stream_t stream) {
  using Cfg = BwdConfig<HD>;
  int err = delta<BF16>(p, stream);
  if (err) return err;
  AttnParams pk = p;                                    // the dK/dV pass reads the by-key lists
  pk.lists = p.lists_by_key;
  pk.list_h = p.listk_h;
  pk.list_t = p.listk_t;
  pk.list_wf = p.listk_wf;
  if (p.Lk > 0) {
    err = launch(attn_dkdv_kernel<HD, BF16, TERMS>, cdiv(p.Lk, Cfg::BN) * unsigned(p.B * (p.H / p.G)),
                 TERMS ? Cfg::kSplitTerms : Cfg::kSplit, TERMS ? Cfg::kDkdvSmemTerms : Cfg::kDkdvSmem, stream, pk);
    if (err) return err;
  }
  if constexpr (TERMS)
    return launch(attn_dq_terms_kernel<HD, BF16>, cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), Cfg::kSplit,
                  Cfg::kDqSmemTerms, stream, p);
  else
    return launch(attn_dq_kernel<HD, BF16>, cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), Cfg::kSplit, Cfg::kDqSmem,
                  stream, p);
}

}  // namespace detail
}  // namespace effattn
