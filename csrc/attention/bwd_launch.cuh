// Launchers of the softmax-attention backward per (head-dim bucket, dtype, mask kind, dropout flag): the Delta
// kernel, the two passes (dK/dV, dQ; TERMS: with bias tensors, terms.cu, kAny with dropout), the fused
// dK/dV/dQ kernel, and `bwd_of_call`, which picks the fused kernel when the call asks for it with dq_accum
// (attention_bwd_fused_serves: buckets 32..128, no layout), else the two passes.
// attention/inst/bwd_<hd>_<dtype>_<kind>_<drop>.cu instantiates `bwd_of_call` (csrc/generate_instances.py),
// bwd.cu dispatches to it.
#pragma once

#include "attention/bwd_fused.cuh"
#include "attention/launch.cuh"
#include "attention/launchers.cuh"

namespace effattn {
namespace detail {

// Delta = rowsum(dO * O) - dlse, the first kernel of every backward.
template <bool BF16>
int delta(const AttnParams& p, prim::stream_t stream) {
  return launch(attn_delta_kernel<BF16>, cdiv(p.Lq, 16) * unsigned(p.B * p.H), 1, 0, stream, p);
}

template <int HD, bool BF16, bool TERMS = false, int KIND = kAny, bool DROP = true>
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
    err = launch(attn_dkdv_kernel<HD, BF16, TERMS, KIND, DROP>, cdiv(p.Lk, Cfg::BN) * unsigned(p.B * (p.H / p.G)),
                 TERMS ? Cfg::kSplitTerms : Cfg::kSplit, TERMS ? Cfg::kDkdvSmemTerms : Cfg::kDkdvSmem, stream, pk);
    if (err) return err;
  }
  if constexpr (TERMS)
    return launch(attn_dq_terms_kernel<HD, BF16>, cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), Cfg::kSplit,
                  Cfg::kDqSmemTerms, stream, p);
  else
    return launch(attn_dq_kernel<HD, BF16, false, KIND, DROP>, cdiv(p.Lq, Cfg::BM) * unsigned(p.B * p.H), Cfg::kSplit, Cfg::kDqSmem,
                  stream, p);
}

// The fused backward (bwd_fused.cuh) after the Delta kernel: dK, dV, dQ's fp32 accumulator, then dq.
template <int HD, bool BF16, int KIND, bool DROP>
int bwd_fused(const AttnParams& p, prim::stream_t stream) {
  using Cfg = BwdFusedConfig<HD>;
  int err = delta<BF16>(p, stream);
  if (err) return err;
  if (p.Lk > 0) {
    err = launch(attn_bwd_fused_kernel<HD, BF16, KIND, DROP>, cdiv(p.Lk, Cfg::BN) * unsigned(p.B * (p.H / p.G)), 1, Cfg::kSmem,
                 stream, p, Cfg::kThreads);
    if (err) return err;
  }
  return launch(attn_dq_convert_kernel<BF16>, cdiv(p.dq_numel, 512), 1, 0, stream, p);
}

// The key tile whose fullness bwd.cu's mask_kind reads (kDense: every tile full): the fused kernel's, and
// the dK/dV pass's, which the dQ pass's key steps divide.
static_assert(BwdFusedConfig<64>::BN == kBwdFusedKeyTile && BwdConfig<64>::BN == kBwdKeyTile &&
              kBwdKeyTile % BwdConfig<256>::BN_DQ == 0 && kBwdKeyTile % BwdConfig<64>::BN_DQ == 0, "bwd.cu's key tiles");

template <int HD, bool BF16, int KIND, bool DROP>
int bwd_of_call(const AttnParams& p, prim::stream_t stream) {
#if defined(EFFATTN_CUDA_EMU)
  emu_record::last_bwd = HD * 1000 + BF16 * 100 + KIND * 10 + DROP;
#endif
  // buckets <= 128: the dense / causal / window units hold the fused kernel only; their calls run the two passes
  // only where the fused kernel does not (EFFATTN_CUDA_FUSED_BWD=0, a device without room for it), and bwd.cu
  // sends those to kAny (a tenth of the backward's nvcc time for code that is rarely taken)
  if constexpr (HD <= 128 && KIND != kLayout && KIND != kAny) {
    return p.dq_accum ? bwd_fused<HD, BF16, KIND, DROP>(p, stream) : -1;
  } else {
    if constexpr (HD <= 128 && KIND == kAny)
      if (p.dq_accum) return bwd_fused<HD, BF16, KIND, DROP>(p, stream);
    return bwd<HD, BF16, false, KIND, DROP>(p, stream);
  }
}

}  // namespace detail
}  // namespace effattn
