// The torch glue of the softmax-attention kernels (csrc/attention/: forward, Hopper forward,
// backward): argument preparation (attention_args.h), allocation, the ops' schemas. See common.h
// for the two builds.
#include "binding/attention_args.h"

#include <cmath>
#include <vector>

namespace {

using namespace effattn::binding;

using FwdLauncher = int (*)(const effattn::AttnParams&, bool, void*);

// The score terms the kernels take (effattn.score): softcap (0: none), ALiBi slopes ((H,) or (B, H)),
// sinks ((H,)); the fp32 contiguous copies they read are kept in `keep`.
void set_score(effattn::AttnParams& p, std::vector<Tensor>& keep, double softcap, const optional<Tensor>& alibi,
               const optional<Tensor>& sinks) {
  check(softcap >= 0 && std::isfinite(softcap), "softcap must be a finite float > 0 (0: none)");
  p.softcap = float(softcap);
  p.inv_softcap = softcap > 0 ? float(1.0 / softcap) : 0.f;
  if (alibi.has_value()) {
    const Tensor a = alibi->to(at::kFloat).contiguous();
    check((a.dim() == 1 && a.size(0) == p.H) || (a.dim() == 2 && a.size(0) == p.B && a.size(1) == p.H),
          "alibi slopes must be (H,) or (B, H)");
    keep.push_back(a);
    p.alibi = a.data_ptr<float>();
    p.alibi_b = a.dim() == 2 ? p.H : 0;
  }
  if (sinks.has_value()) {
    const Tensor sk = sinks->to(at::kFloat).contiguous();
    check(sk.dim() == 1 && sk.size(0) == p.H, "sinks must be (H,)");
    keep.push_back(sk);
    p.sinks = sk.data_ptr<float>();
  }
  p.score = softcap > 0 || alibi.has_value() || sinks.has_value();
}

// The bias tensors of a call (the TERMS kernel instances): a relative table (H, >= width) with its
// max_distance and direction, adaptive span z (H,) with its ramp, a dense bias (4-D, each dimension
// the call's or 1: broadcast with stride 0). fp32 copies in `keep`.
struct BiasTensors {
  optional<Tensor> rel;
  int64_t rel_max = 0;
  bool rel_bidir = true;
  optional<Tensor> span_z;
  double span_ramp = 1.0;
  optional<Tensor> bias;
};

void set_bias_tensors(effattn::AttnParams& p, std::vector<Tensor>& keep, const BiasTensors& bt, int64_t Lq,
                      int64_t Lk) {
  if (bt.rel.has_value()) {
    check(bt.rel_max >= 0 && bt.rel_max < (int64_t(1) << 29), "rel_max must be in [0, 2^29)");
    const int64_t w = bt.rel_bidir ? 2 * bt.rel_max + 1 : bt.rel_max + 1;
    check(bt.rel->dim() == 2 && bt.rel->size(0) == p.H && bt.rel->size(1) >= w,
          "rel (the relative table) must be (H, 2 * rel_max + 1) (bidirectional) or (H, rel_max + 1)");
    const Tensor t = bt.rel->narrow(1, 0, w).to(at::kFloat).contiguous();
    keep.push_back(t);
    p.rel = t.data_ptr<float>();
    p.rel_w = int(w), p.rel_max = int(bt.rel_max), p.rel_bidir = int(bt.rel_bidir);
  }
  if (bt.span_z.has_value()) {
    check(std::isfinite(bt.span_ramp) && bt.span_ramp > 0, "span_ramp must be a finite float > 0");
    const Tensor z = bt.span_z->to(at::kFloat).contiguous();
    check(z.dim() == 1 && z.size(0) == p.H, "span_z must be (H,)");
    keep.push_back(z);
    p.span_z = z.data_ptr<float>();
    p.span_ramp = float(bt.span_ramp);
  }
  if (bt.bias.has_value()) {
    const Tensor& b0 = *bt.bias;
    const int64_t full[4] = {p.B, p.H, Lq, Lk};
    bool ok = b0.dim() == 4;
    for (int d = 0; d < 4 && ok; ++d) ok = b0.size(d) == full[d] || b0.size(d) == 1;
    check(ok, "bias (dense) must be 4-D, each dimension (B, H, Lq, Lk) or 1");
    const Tensor b = b0.to(at::kFloat);
    keep.push_back(b);
    p.bias = b.data_ptr<float>();
    p.bias_b = stride_or_0(b, 0), p.bias_h = stride_or_0(b, 1), p.bias_q = stride_or_0(b, 2);
    p.bias_k = stride_or_0(b, 3);
  }
  if (effattn::has_bias_tensors(p)) p.score = 1;
}

BiasTensors bias_tensors_of(const optional<Tensor>& rel, int64_t rel_max, bool rel_bidir, const optional<Tensor>& span_z,
                            double span_ramp, const optional<Tensor>& bias) {
  BiasTensors bt;
  bt.rel = rel, bt.rel_max = rel_max, bt.rel_bidir = rel_bidir, bt.span_z = span_z, bt.span_ramp = span_ramp;
  bt.bias = bias;
  return bt;
}

// The packed-sequence / positions arguments of the ops' schemas, as a Varlen.
Varlen varlen_of(const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, int64_t max_q, int64_t max_k,
                 optional<int64_t> q_offset, at::OptionalIntArrayRef drop_at) {
  Varlen vl;
  vl.cu_q = cu_q, vl.cu_k = cu_k, vl.max_q = max_q, vl.max_k = max_k, vl.q_offset = q_offset;
  if (drop_at.has_value()) vl.drop_at = drop_at->vec();
  return vl;
}

std::tuple<Tensor, Tensor> forward(FwdLauncher launch, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const optional<Tensor>& kpm, const optional<Tensor>& layout, int64_t layout_block,
                                   int64_t lay_check, const optional<Tensor>& lists, int64_t list_wf,
                                   const optional<Tensor>& seed, double scale, double dropout_p, int64_t left,
                                   int64_t right, double softcap, const optional<Tensor>& alibi,
                                   const optional<Tensor>& sinks, const Varlen& vl, bool out_fp32,
                                   const BiasTensors& bt) {
  EFFATTN_GUARD(q);
  Prepared r = prepare(q, k, v, kpm, layout, layout_block, lay_check, lists, list_wf, c10::nullopt, 0, seed, scale,
                       dropout_p, left, right, vl);
  std::vector<Tensor> keep;
  set_score(r.p, keep, softcap, alibi, sinks);
  set_bias_tensors(r.p, keep, bt, q.size(2), k.size(2));
  check(!effattn::has_bias_tensors(r.p) || !r.p.cu_q,
        "the bias tensors (rel, span_z, bias) cannot be combined with packed sequences (cu_seqlens)");
  Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)},
                         out_fp32 ? q.options().dtype(at::kFloat) : q.options());
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  poison(out);
  poison(lse);
  effattn::AttnParams& p = r.p;
  p.o = out.data_ptr();
  p.o_f32 = int(out_fp32);
  p.o_b = out.stride(0), p.o_h = out.stride(1), p.o_l = out.stride(2);
  p.lse = lse.data_ptr<float>();
  run_checked(launch(p, r.bf16, EFFATTN_STREAM), "forward");
  return {out, lse};
}

std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const optional<Tensor>& kpm, const optional<Tensor>& layout,
                                         int64_t layout_block, int64_t lay_check, const optional<Tensor>& lists,
                                         int64_t list_wf, const optional<Tensor>& seed, double scale,
                                         double dropout_p, int64_t left, int64_t right, double softcap,
                                         const optional<Tensor>& alibi, const optional<Tensor>& sinks,
                                         const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, int64_t max_q,
                                         int64_t max_k, optional<int64_t> q_offset, bool out_fp32,
                                         const optional<Tensor>& rel, int64_t rel_max, bool rel_bidir,
                                         const optional<Tensor>& span_z, double span_ramp,
                                         const optional<Tensor>& bias, at::OptionalIntArrayRef drop_at) {
  return forward(effattn::attention_fwd, q, k, v, kpm, layout, layout_block, lay_check, lists, list_wf, seed, scale,
                 dropout_p, left, right, softcap, alibi, sinks, varlen_of(cu_q, cu_k, max_q, max_k, q_offset, drop_at),
                 out_fp32, bias_tensors_of(rel, rel_max, rel_bidir, span_z, span_ramp, bias));
}

// The Hopper (sm_90a, wgmma) forward: same arguments and results; head-dim buckets 64 and 128 only.
std::tuple<Tensor, Tensor> attention_fwd_sm90(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const optional<Tensor>& kpm, const optional<Tensor>& layout,
                                              int64_t layout_block, int64_t lay_check, const optional<Tensor>& lists,
                                              int64_t list_wf, const optional<Tensor>& seed, double scale,
                                              double dropout_p, int64_t left, int64_t right, double softcap,
                                              const optional<Tensor>& alibi, const optional<Tensor>& sinks,
                                              const optional<Tensor>& cu_q, const optional<Tensor>& cu_k,
                                              int64_t max_q, int64_t max_k, optional<int64_t> q_offset,
                                              bool out_fp32, const optional<Tensor>& rel, int64_t rel_max,
                                              bool rel_bidir, const optional<Tensor>& span_z, double span_ramp,
                                              const optional<Tensor>& bias, at::OptionalIntArrayRef drop_at) {
  const int hd = effattn::head_dim_bucket(int(std::max((q.size(3) + 7) / 8 * 8, (v.size(3) + 7) / 8 * 8)));
  check(hd == 64 || hd == 128, "the Hopper forward serves head dims 33..128 (buckets 64 and 128)");
  check(effattn::attention_fwd_sm90_built(), "this build has no sm_90a kernels (the Hopper forward)");
  check(!cu_q.has_value() && !cu_k.has_value(),
        "the Hopper forward does not serve packed sequences (cu_seqlens_q / cu_seqlens_k): attention_fwd does");
  check(!rel.has_value() && !span_z.has_value() && !bias.has_value(),
        "the Hopper forward does not serve relative tables, adaptive span or dense bias tensors (rel, span_z, bias): "
        "attention_fwd does");
  return forward(effattn::attention_fwd_sm90, q, k, v, kpm, layout, layout_block, lay_check, lists, list_wf, seed,
                 scale, dropout_p, left, right, softcap, alibi, sinks,
                 varlen_of(cu_q, cu_k, max_q, max_k, q_offset, drop_at), out_fp32, BiasTensors{});
}

bool has_sm90a() { return effattn::attention_fwd_sm90_built(); }

// The score terms' gradients besides dq, dk, dv: with `alibi_grad`, (B, H, query tiles) fp32 partial
// sums of dT * |d| (the caller sums them over tiles and negates: ALiBi's slope gradient); with a
// relative table, (B, H, query tiles, width) partial sums of dT per entry; with a span, (B, H, query
// tiles) partial sums of dT / ratio on the ramp (the caller divides by the ramp); with `bias_grad`,
// dT (B, H, Lq, Lk) fp32 (the caller sums the broadcast dimensions). Empty when not asked for.
struct TermGrads {
  Tensor dalibi, drel, dspan, dbias;
};

// The backward with score terms and packed sequences. The ops below are its two entries: attention_bwd
// (packed, no score terms) and attention_bwd_score (score terms, no packed sequences). `fused`: the fused
// five-product kernel (csrc/attention/bwd_fused.cuh; the backend decides from the device's shared memory,
// effattn/backends/cuda/resources.py) with its zeroed dQ accumulator and semaphores, else the two passes;
// `hopper` (with `fused`): the Hopper backward (csrc/attention/bwd_sm90.cuh) on the same accumulator.
std::tuple<Tensor, Tensor, Tensor, TermGrads> backward(
    const Tensor& dout0, const optional<Tensor>& dlse, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out0, const Tensor& lse0, const optional<Tensor>& kpm, const optional<Tensor>& layout,
    int64_t layout_block, int64_t lay_check, const optional<Tensor>& lists, int64_t list_wf,
    const optional<Tensor>& lists_by_key, int64_t listk_wf, const optional<Tensor>& seed, double scale,
    double dropout_p, int64_t left, int64_t right, double softcap, const optional<Tensor>& alibi,
    const optional<Tensor>& sinks, bool alibi_grad, const Varlen& vl, const BiasTensors& bt, bool bias_grad,
    bool fused, bool hopper = false) {
  EFFATTN_GUARD(q);
  Prepared r = prepare(q, k, v, kpm, layout, layout_block, lay_check, lists, list_wf, lists_by_key, listk_wf, seed,
                       scale, dropout_p, left, right, vl);
  effattn::AttnParams& p = r.p;
  std::vector<Tensor> keep;
  set_score(p, keep, softcap, alibi, sinks);
  set_bias_tensors(p, keep, bt, q.size(2), k.size(2));
  check(!alibi_grad || alibi.has_value(), "alibi_grad needs alibi slopes");
  check(!bias_grad || bt.bias.has_value(), "bias_grad needs a dense bias");
  const int64_t n_mt = (p.Lq + effattn::kBlockM - 1) / effattn::kBlockM;
  const auto f32 = q.options().dtype(at::kFloat);
  TermGrads tg;
  tg.dalibi = at::zeros({alibi_grad ? p.B : 0, p.H, n_mt}, f32);
  // the blocks add to (drel) or write (dspan, dbias) only the slots of the tiles they visit
  tg.drel = at::zeros({p.rel ? p.B : 0, p.H, n_mt, p.rel ? p.rel_w : 0}, f32);
  tg.dspan = at::zeros({p.span_z ? p.B : 0, p.H, n_mt}, f32);
  tg.dbias = at::zeros({bias_grad ? p.B : 0, p.H, bias_grad ? p.Lq : 0, bias_grad ? p.Lk : 0}, f32);
  check(out0.scalar_type() == q.scalar_type() || out0.scalar_type() == at::kFloat,
        "out must have q's dtype or float32 (an fp32 forward output)");
  Tensor dout = aligned(dout0.to(q.scalar_type()));
  Tensor out = out0.contiguous();
  Tensor lse = lse0.contiguous();
  // shapes of the tensors (packed: p.B and p.Lq / p.Lk are the segments and the longest ones)
  const int64_t B = q.size(0), Lq = q.size(2), Lk = k.size(2);
  Tensor dq = at::empty({B, p.H, Lq, p.D}, q.options());
  Tensor dk = at::empty({B, p.H / p.G, Lk, p.D}, q.options());
  Tensor dv = at::empty({B, p.H / p.G, Lk, p.Dv}, q.options());
  Tensor delta = at::empty({B, p.H, Lq}, q.options().dtype(at::kFloat));
  if (p.Lq == 0 || p.B * p.H == 0) {
    dq.zero_(), dk.zero_(), dv.zero_();
  } else {
    poison(dq), poison(dk), poison(dv), poison(delta);
    const Tensor dl = set_backward_inputs(p, dout, dlse, out, lse, delta);
    p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
    if (alibi_grad) {
      poison(tg.dalibi);
      p.dalibi = tg.dalibi.data_ptr<float>();
    }
    if (p.rel) p.drel = tg.drel.data_ptr<float>();
    if (p.span_z) p.dspan = tg.dspan.data_ptr<float>();
    if (bias_grad) p.dbias = tg.dbias.data_ptr<float>();
    Tensor dq_accum, dq_sem;                            // the fused backward's dQ accumulator and turns
    if (fused) {
      check(effattn::attention_bwd_fused_serves(p),
            "fused: the fused backward serves head dims up to 128 without a block layout, bias tensors, "
            "alibi_grad or positions (q_pos / k_pos)");
      dq_accum = at::zeros({B, p.H, Lq, p.D}, f32);
      dq_sem = at::zeros({p.B, p.H, n_mt}, q.options().dtype(at::kInt));
      p.dq_accum = dq_accum.data_ptr<float>();
      p.dq_sem = dq_sem.data_ptr<int>();
      p.dq_numel = dq.numel();
    }
    if (hopper) {
      check(fused && effattn::attention_bwd_sm90_serves(p),
            "hopper: the Hopper backward serves head dims 33..128 (buckets 64, 128), dense, causal or window "
            "masks without key padding, dropout or packed sequences, with fused=True");
      check(effattn::attention_fwd_sm90_built(), "hopper: this build has no sm_90a kernels (the Hopper backward)");
    }
    run_checked(hopper ? effattn::attention_bwd_sm90(p, r.bf16, EFFATTN_STREAM)
                       : effattn::attention_bwd(p, r.bf16, EFFATTN_STREAM), "backward");
  }
  auto crop = [](const Tensor& g, int64_t d) { return g.size(3) == d ? g : g.narrow(3, 0, d).contiguous(); };
  return {crop(dq, q.size(3)), crop(dk, k.size(3)), crop(dv, v.size(3)), tg};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> attention_bwd_score(
    const Tensor& dout, const optional<Tensor>& dlse, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& lse, const optional<Tensor>& kpm, const optional<Tensor>& layout,
    int64_t layout_block, int64_t lay_check, const optional<Tensor>& lists, int64_t list_wf,
    const optional<Tensor>& lists_by_key, int64_t listk_wf, const optional<Tensor>& seed, double scale,
    double dropout_p, int64_t left, int64_t right, double softcap, const optional<Tensor>& alibi,
    const optional<Tensor>& sinks, bool alibi_grad, const optional<Tensor>& rel, int64_t rel_max, bool rel_bidir,
    const optional<Tensor>& span_z, double span_ramp, const optional<Tensor>& bias, bool bias_grad,
    optional<int64_t> q_offset, at::OptionalIntArrayRef drop_at, bool fused) {
  auto g = backward(dout, dlse, q, k, v, out, lse, kpm, layout, layout_block, lay_check, lists, list_wf, lists_by_key,
                    listk_wf, seed, scale, dropout_p, left, right, softcap, alibi, sinks, alibi_grad,
                    varlen_of(c10::nullopt, c10::nullopt, 0, 0, q_offset, drop_at),
                    bias_tensors_of(rel, rel_max, rel_bidir, span_z, span_ramp, bias), bias_grad, fused);
  const TermGrads& tg = std::get<3>(g);
  return {std::get<0>(g), std::get<1>(g), std::get<2>(g), tg.dalibi, tg.drel, tg.dspan, tg.dbias};
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd(
    const Tensor& dout, const optional<Tensor>& dlse, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& lse, const optional<Tensor>& kpm, const optional<Tensor>& layout,
    int64_t layout_block, int64_t lay_check, const optional<Tensor>& lists, int64_t list_wf,
    const optional<Tensor>& lists_by_key, int64_t listk_wf, const optional<Tensor>& seed, double scale,
    double dropout_p, int64_t left, int64_t right, const optional<Tensor>& cu_q, const optional<Tensor>& cu_k,
    int64_t max_q, int64_t max_k, optional<int64_t> q_offset, at::OptionalIntArrayRef drop_at, bool fused,
    bool hopper) {
  auto g = backward(dout, dlse, q, k, v, out, lse, kpm, layout, layout_block, lay_check, lists, list_wf, lists_by_key,
                    listk_wf, seed, scale, dropout_p, left, right, 0.0, c10::nullopt, c10::nullopt, false,
                    varlen_of(cu_q, cu_k, max_q, max_k, q_offset, drop_at), BiasTensors{}, false, fused, hopper);
  return {std::get<0>(g), std::get<1>(g), std::get<2>(g)};
}

// Per-row positions (effattn.lsh_attention's sorted rounds; AttnParams::q_pos): attention_fwd / attention_bwd with
// q_pos int32 (B, H, Lq), k_pos int32 (B, Hkv, Lk), pos_causal and self_score, no window, score terms or packing.
Varlen positions_of(const Tensor& q_pos, const Tensor& k_pos, bool pos_causal, double self_score) {
  Varlen vl;
  vl.q_pos = q_pos, vl.k_pos = k_pos, vl.pos_causal = pos_causal, vl.pos_self = self_score;
  return vl;
}

std::tuple<Tensor, Tensor> attention_fwd_pos(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const optional<Tensor>& kpm, const optional<Tensor>& layout,
                                             int64_t layout_block, int64_t lay_check, const optional<Tensor>& lists,
                                             int64_t list_wf, const optional<Tensor>& seed, double scale,
                                             double dropout_p, const Tensor& q_pos, const Tensor& k_pos,
                                             bool pos_causal, double self_score, bool out_fp32) {
  return forward(effattn::attention_fwd, q, k, v, kpm, layout, layout_block, lay_check, lists, list_wf, seed, scale,
                 dropout_p, -1, -1, 0.0, c10::nullopt, c10::nullopt, positions_of(q_pos, k_pos, pos_causal, self_score),
                 out_fp32, BiasTensors{});
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd_pos(
    const Tensor& dout, const optional<Tensor>& dlse, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out, const Tensor& lse, const optional<Tensor>& kpm, const optional<Tensor>& layout,
    int64_t layout_block, int64_t lay_check, const optional<Tensor>& lists, int64_t list_wf,
    const optional<Tensor>& lists_by_key, int64_t listk_wf, const optional<Tensor>& seed, double scale,
    double dropout_p, const Tensor& q_pos, const Tensor& k_pos, bool pos_causal, double self_score, bool fused) {
  auto g = backward(dout, dlse, q, k, v, out, lse, kpm, layout, layout_block, lay_check, lists, list_wf, lists_by_key,
                    listk_wf, seed, scale, dropout_p, -1, -1, 0.0, c10::nullopt, c10::nullopt, false,
                    positions_of(q_pos, k_pos, pos_causal, self_score), BiasTensors{}, false, fused);
  return {std::get<0>(g), std::get<1>(g), std::get<2>(g)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(EFFATTN_OPS, m) {
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? layout, int layout_block, "
        "int layout_check, Tensor? lists, int list_wf, Tensor? seed, float scale, float dropout_p, int window_left, "
        "int window_right, float softcap=0., Tensor? alibi=None, Tensor? sinks=None, Tensor? cu_seqlens_q=None, "
        "Tensor? cu_seqlens_k=None, int max_seqlen_q=0, int max_seqlen_k=0, int? q_offset=None, bool out_fp32=False, "
        "Tensor? rel=None, int rel_max=0, bool rel_bidir=True, Tensor? span_z=None, float span_ramp=1., "
        "Tensor? bias=None, int[]? drop_at=None) -> (Tensor, Tensor)");
  m.def("attention_bwd(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? key_padding_mask, Tensor? layout, int layout_block, int layout_check, Tensor? lists, int list_wf, "
        "Tensor? lists_by_key, int listk_wf, Tensor? seed, float scale, float dropout_p, int window_left, "
        "int window_right, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int max_seqlen_q=0, "
        "int max_seqlen_k=0, int? q_offset=None, int[]? drop_at=None, bool fused=False, bool hopper=False) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("attention_bwd_score(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, Tensor? key_padding_mask, Tensor? layout, int layout_block, int layout_check, Tensor? lists, "
        "int list_wf, Tensor? lists_by_key, int listk_wf, Tensor? seed, float scale, float dropout_p, "
        "int window_left, int window_right, float softcap, Tensor? alibi, Tensor? sinks, bool alibi_grad, "
        "Tensor? rel=None, int rel_max=0, bool rel_bidir=True, Tensor? span_z=None, float span_ramp=1., "
        "Tensor? bias=None, bool bias_grad=False, int? q_offset=None, int[]? drop_at=None, bool fused=False) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("attention_fwd_sm90(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? layout, "
        "int layout_block, int layout_check, Tensor? lists, int list_wf, Tensor? seed, float scale, float dropout_p, "
        "int window_left, int window_right, float softcap=0., Tensor? alibi=None, Tensor? sinks=None, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int max_seqlen_q=0, int max_seqlen_k=0, "
        "int? q_offset=None, bool out_fp32=False, Tensor? rel=None, int rel_max=0, bool rel_bidir=True, "
        "Tensor? span_z=None, float span_ramp=1., Tensor? bias=None, int[]? drop_at=None) -> (Tensor, Tensor)");
  m.def("attention_fwd_pos(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? layout, int layout_block, "
        "int layout_check, Tensor? lists, int list_wf, Tensor? seed, float scale, float dropout_p, Tensor q_pos, "
        "Tensor k_pos, bool pos_causal, float self_score, bool out_fp32=False) -> (Tensor, Tensor)");
  m.def("attention_bwd_pos(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? key_padding_mask, Tensor? layout, int layout_block, int layout_check, Tensor? lists, int list_wf, "
        "Tensor? lists_by_key, int listk_wf, Tensor? seed, float scale, float dropout_p, Tensor q_pos, Tensor k_pos, "
        "bool pos_causal, float self_score, bool fused=False) -> (Tensor, Tensor, Tensor)");
  m.def("has_sm90a() -> bool", has_sm90a);
}

TORCH_LIBRARY_IMPL(EFFATTN_OPS, EFFATTN_KEY, m) {
  m.impl("attention_fwd", attention_fwd);
  m.impl("attention_bwd", attention_bwd);
  m.impl("attention_bwd_score", attention_bwd_score);
  m.impl("attention_fwd_sm90", attention_fwd_sm90);
  m.impl("attention_fwd_pos", attention_fwd_pos);
  m.impl("attention_bwd_pos", attention_bwd_pos);
}
