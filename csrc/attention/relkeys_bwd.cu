// Entry point of the backward of attention with relative keys (attention/relkeys_bwd.cuh): Delta
// (attn_delta_kernel), the dQ pass with the term query's gradient, the dK/dV pass and the distance-band
// pass for r, per dtype and head-dim bucket 32, 64, 128. A unit of its own, built beside relkeys.cu.
#include "attention/launch.cuh"
#include "attention/relkeys_bwd.cuh"

namespace effattn {
namespace {

template <int HD, bool BF16>
int bwd_relk(const AttnParams& p, prim::stream_t stream) {
  using Cfg = RelkBwdConfig<HD>;
  using detail::cdiv;
  using detail::launch;
  int err = launch(attn_delta_kernel<BF16>, cdiv(p.Lq, 16) * unsigned(p.B * p.H), 1, 0, stream, p);
  if (!err)
    err = launch(relk_dq_kernel<HD, BF16>, cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), Cfg::kSplit, Cfg::kDqSmem,
                 stream, p);
  if (!err && p.Lk > 0)
    err = launch(relk_dkdv_kernel<HD, BF16>, cdiv(p.Lk, Cfg::BN) * unsigned(p.B * (p.H / p.G)), Cfg::kSplit,
                 Cfg::kDkdvSmem, stream, p);
  if (!err)
    err = launch(relk_dr_kernel<HD, BF16>, cdiv(p.Lq + p.Lk - 1, Cfg::BN) * unsigned(p.H), Cfg::kSplit, Cfg::kDrSmem,
                 stream, p);
  return err;
}

template <bool BF16>
int dispatch_bwd_relk(const AttnParams& p, prim::stream_t stream) {
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 32: return bwd_relk<32, BF16>(p, stream);
    case 64: return bwd_relk<64, BF16>(p, stream);
    case 128: return bwd_relk<128, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

int attention_bwd_relk(const AttnParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (!p.relk || p.relk_n < 1 || has_bias_tensors(p) || p.score || p.cu_q || p.dropout || p.lists) return -1;
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  return bf16 ? dispatch_bwd_relk<true>(p, stream) : dispatch_bwd_relk<false>(p, stream);
}

}  // namespace effattn
