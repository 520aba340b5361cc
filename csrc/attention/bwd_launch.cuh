// Launchers of the softmax-attention backward per (head-dim bucket, dtype): the Delta kernel, the two passes
// (dK/dV, dQ; TERMS: with bias tensors, terms.cu), the fused dK/dV/dQ kernel, and `bwd_of_call`, which
// picks the fused kernel when the call asks for it with dq_accum (attention_bwd_fused_serves: buckets
// 32..128), else the two passes. attention/inst/bwd_<hd>_<dtype>.cu instantiates `bwd_of_call`
// (csrc/generate_instances.py), bwd.cu dispatches to it.
#pragma once

#include "attention/bwd_fused.cuh"
#include "attention/launch.cuh"

namespace effattn {
namespace detail {

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

// The fused backward (bwd_fused.cuh) after the Delta kernel: dK, dV, dQ's fp32 accumulator, then dq.
template <int HD, bool BF16>
int bwd_fused(const AttnParams& p, prim::stream_t stream) {
  using Cfg = BwdFusedConfig<HD>;
  int err = delta<BF16>(p, stream);
  if (err) return err;
  if (p.Lk > 0) {
    err = launch(attn_bwd_fused_kernel<HD, BF16>, cdiv(p.Lk, Cfg::BN) * unsigned(p.B * (p.H / p.G)), 1, Cfg::kSmem,
                 stream, p, Cfg::kThreads);
    if (err) return err;
  }
  return launch(attn_dq_convert_kernel<BF16>, cdiv(p.dq_numel, 512), 1, 0, stream, p);
}

template <int HD, bool BF16>
int bwd_of_call(const AttnParams& p, prim::stream_t stream) {
  if constexpr (HD <= 128)
    if (p.dq_accum) return bwd_fused<HD, BF16>(p, stream);
  return bwd<HD, BF16>(p, stream);
}

}  // namespace detail
}  // namespace effattn
