// Launchers of the softmax-attention kernels: pick the head-dim bucket and dtype instance, size
// the grid and shared memory, launch. Compiled by nvcc for the GPU, or by a host compiler with
// EFFATTN_CUDA_EMU for the emulation (the same code; prims.cuh hides the difference).
#include "attention.h"
#include "attn_bwd.cuh"
#include "attn_fwd.cuh"

namespace effattn {
namespace {

#if defined(EFFATTN_CUDA_EMU)
template <class Kernel>
int launch(Kernel kernel, unsigned grid, unsigned split, int smem, prim::stream_t, const AttnParams& p) {
  emu::launch(emu::Dim3{grid, 1, split}, emu::Dim3{128, 1, 1}, size_t(smem), [&] { kernel(p); });
  return 0;
}
#else
template <class Kernel>
int launch(Kernel kernel, unsigned grid, unsigned split, int smem, prim::stream_t stream, const AttnParams& p) {
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return int(e);
  }
  kernel<<<dim3(grid, 1, split), dim3(128, 1, 1), smem, stream>>>(p);
  return int(cudaGetLastError());
}
#endif

unsigned cdiv(int64_t a, int64_t b) { return unsigned((a + b - 1) / b); }

template <int HD, bool BF16>
int fwd(const AttnParams& p, prim::stream_t stream) {
  using Cfg = FwdConfig<HD>;
  return launch(attn_fwd_kernel<HD, BF16>, cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), 1, Cfg::kSmemBytes, stream, p);
}

template <int HD, bool BF16>
int bwd(const AttnParams& p, prim::stream_t stream) {
  using Cfg = BwdConfig<HD>;
  int err = launch(attn_delta_kernel<BF16>, cdiv(p.Lq, 16) * unsigned(p.B * p.H), 1, 0, stream, p);
  if (err) return err;
  AttnParams pk = p;                                    // the dK/dV pass reads the by-key lists
  pk.lists = p.lists_by_key;
  pk.list_h = p.listk_h;
  pk.list_t = p.listk_t;
  pk.list_wf = p.listk_wf;
  if (p.Lk > 0) {
    err = launch(attn_dkdv_kernel<HD, BF16>, cdiv(p.Lk, Cfg::BN) * unsigned(p.B * (p.H / p.G)), Cfg::kSplit,
                 Cfg::kDkdvSmem, stream, pk);
    if (err) return err;
  }
  return launch(attn_dq_kernel<HD, BF16>, cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), Cfg::kSplit, Cfg::kDqSmem,
                stream, p);
}

template <bool BF16>
int dispatch(const AttnParams& p, prim::stream_t stream, bool backward) {
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 32: return backward ? bwd<32, BF16>(p, stream) : fwd<32, BF16>(p, stream);
    case 64: return backward ? bwd<64, BF16>(p, stream) : fwd<64, BF16>(p, stream);
    case 128: return backward ? bwd<128, BF16>(p, stream) : fwd<128, BF16>(p, stream);
    case 256: return backward ? bwd<256, BF16>(p, stream) : fwd<256, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

int attention_fwd(const AttnParams& p, bool bf16, prim::stream_t stream) {
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  return bf16 ? dispatch<true>(p, stream, false) : dispatch<false>(p, stream, false);
}

int attention_bwd(const AttnParams& p, bool bf16, prim::stream_t stream) {
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  return bf16 ? dispatch<true>(p, stream, true) : dispatch<false>(p, stream, true);
}

}  // namespace effattn
