// Entry point of the split-KV decode kernels (decode_kernels.cuh): dispatch on dtype and head-dim
// bucket, the split kernel's grid, then the combine kernel when the key range was split. Compiled
// by nvcc, or by a host compiler with EFFATTN_CUDA_EMU (the binding includes it).
#include "attention/launch.cuh"
#include "attention/decode_kernels.cuh"

namespace effattn {
namespace {

template <int HD, bool BF16>
int decode_launch(const DecodeParams& p, prim::stream_t stream) {
  const unsigned grid = unsigned(p.a.B) * unsigned(p.a.H / p.a.G) * unsigned(p.row_tiles) * unsigned(p.splits);
  int err;
  if constexpr (HD == 256) {   // single-buffered K/V only where two stages may not fit (decode.h)
    err = p.stages == 1 ? detail::launch(attn_decode_split_kernel<HD, BF16, 1>, grid, 1, DecodeConfig<HD, 1>::kSmemBytes,
                                         stream, p)
                        : detail::launch(attn_decode_split_kernel<HD, BF16, 2>, grid, 1, DecodeConfig<HD, 2>::kSmemBytes,
                                         stream, p);
  } else {
    if (p.stages != 2) return -1;
    err = detail::launch(attn_decode_split_kernel<HD, BF16, 2>, grid, 1, DecodeConfig<HD, 2>::kSmemBytes, stream, p);
  }
  if (err || p.splits == 1) return err;
  const unsigned rows = unsigned(p.a.B) * unsigned(p.a.H) * unsigned(p.a.Lq);
  return detail::launch(attn_decode_combine_kernel<BF16>, detail::cdiv(rows, 4), 1, 0, stream, p);
}

template <bool BF16>
int decode_dispatch(const DecodeParams& p, prim::stream_t stream) {
  switch (head_dim_bucket(p.a.D > p.a.Dv ? p.a.D : p.a.Dv)) {
    case 32: return decode_launch<32, BF16>(p, stream);
    case 64: return decode_launch<64, BF16>(p, stream);
    case 128: return decode_launch<128, BF16>(p, stream);
    case 256: return decode_launch<256, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

int attention_decode(const DecodeParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.a.Lq == 0 || p.a.B * p.a.H == 0) return 0;
  if (p.a.Lq > kDecodeMaxQueries || p.splits < 1 || (p.splits > 1 && !(p.part_o && p.part_lse))) return -1;
  if (p.stages != 1 && p.stages != 2) return -1;
  return bf16 ? decode_dispatch<true>(p, stream) : decode_dispatch<false>(p, stream);
}

}  // namespace effattn
