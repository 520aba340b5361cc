// Entry point of the paged prefill forward (paged_prefill.cuh): dispatch on dtype and head-dim bucket,
// the forward's grid (query tiles of the call's Lq x B x H) and shared memory. Compiled by nvcc, or by a
// host compiler with EFFATTN_CUDA_EMU (the same code).
#include "attention/launch.cuh"
#include "attention/paged_prefill.cuh"

namespace effattn {
namespace {

template <int HD, bool BF16>
int paged_fwd(const PagedParams& p, prim::stream_t stream) {
  using Cfg = FwdConfig<HD>;
  return detail::launch(PagedFwd<HD, BF16>::kernel, detail::cdiv(p.a.Lq, Cfg::BM) * unsigned(p.a.B * p.a.H), 1,
                        Cfg::kSmemBytes, stream, p);
}

template <bool BF16>
int dispatch_paged_fwd(const PagedParams& p, prim::stream_t stream) {
  switch (head_dim_bucket(p.a.D > p.a.Dv ? p.a.D : p.a.Dv)) {
    case 32: return paged_fwd<32, BF16>(p, stream);
    case 64: return paged_fwd<64, BF16>(p, stream);
    case 128: return paged_fwd<128, BF16>(p, stream);
    case 256: return paged_fwd<256, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

int attention_fwd_paged(const PagedParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.a.Lq == 0 || p.a.B * p.a.H == 0) return 0;
  if (!p.kv.block_table || !p.kv.seqlens || p.kv.page_size < 1) return -1;
  return bf16 ? dispatch_paged_fwd<true>(p, stream) : dispatch_paged_fwd<false>(p, stream);
}

}  // namespace effattn
