// The torch glue of attention with relative keys (csrc/attention/relkeys.cu, relkeys_bwd.cu): q, k, v as
// the softmax-attention ops take them (attention_args.h), the relative keys r (H, n_dist, D) and the term's
// query; the ops' schemas.
#include "binding/attention_args.h"

namespace {

using namespace effattn::binding;

// The tensors of the term that the params point into (kept alive for the call).
struct RelkTensors {
  Tensor r, query;
};

// The params of a call (q, k, v, key padding, scale, window as attention_args.h takes them) with r (H, n_dist,
// D) and the term's query (None: q itself) in `t`; max_distance -1: r holds past distances 0 .. n_dist - 1
// (idx clamps to them), else n_dist = 2 max_distance + 1.
Prepared prepare_relk(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& kpm, double scale,
                      int64_t left, int64_t right, const Tensor& r, const optional<Tensor>& query, int64_t max_distance,
                      RelkTensors& t) {
  Prepared pr = prepare(q, k, v, kpm, c10::nullopt, 0, 0, c10::nullopt, 0, c10::nullopt, 0, c10::nullopt, scale, 0.0,
                        left, right);
  effattn::AttnParams& p = pr.p;
  check(r.dim() == 3 && r.size(0) == q.size(1) && r.size(2) == q.size(3) && r.size(1) >= 1,
        "r (relative keys) must be (H, n_dist >= 1, D)");
  check(r.scalar_type() == q.scalar_type() && r.device() == q.device(), "r must share q's dtype and device");
  check(max_distance == -1 || (max_distance >= 0 && r.size(1) == 2 * max_distance + 1),
        "max_distance must be -1 (past distances) or M with r holding 2 M + 1 distances");
  check(r.size(1) < (int64_t(1) << 30), "r holds too many distances");
  t.r = aligned(r.unsqueeze(0));                        // (1, H, n_dist, D) in 16-byte rows
  p.relk = t.r.data_ptr();
  p.relk_h = t.r.stride(1), p.relk_l = t.r.stride(2);
  p.relk_n = int(r.size(1));
  p.relk_max = int(max_distance);
  if (query.has_value()) {
    check(query->sizes() == q.sizes() && query->scalar_type() == q.scalar_type() && query->device() == q.device(),
          "query must be shaped like q, with q's dtype and device");
    t.query = aligned(*query);
    check(t.query.size(3) == pr.q.size(3), "query's padded head dim must match q's");
    p.relkq = t.query.data_ptr();
    p.relkq_b = stride_or_0(t.query, 0), p.relkq_h = stride_or_0(t.query, 1), p.relkq_l = t.query.stride(2);
  }
  return pr;
}

// out (B, H, Lq, Dv) and lse (B, H, Lq) fp32 of softmax(scale (q k^T + query . r[h, idx(d)])) v with the
// window and key padding of a call.
std::tuple<Tensor, Tensor> attention_fwd_relk(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const optional<Tensor>& kpm, double scale, int64_t left, int64_t right,
                                              const Tensor& r, const optional<Tensor>& query, int64_t max_distance) {
  EFFATTN_GUARD(q);
  RelkTensors keep;
  Prepared pr = prepare_relk(q, k, v, kpm, scale, left, right, r, query, max_distance, keep);
  effattn::AttnParams& p = pr.p;
  Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  poison(out);
  poison(lse);
  p.o = out.data_ptr();
  p.o_b = out.stride(0), p.o_h = out.stride(1), p.o_l = out.stride(2);
  p.lse = lse.data_ptr<float>();
  run_checked(effattn::attention_fwd_relk(p, pr.bf16, EFFATTN_STREAM), "relative-keys forward");
  return {out, lse};
}

// (dq, dk, dv, dquery, gd) of attention_fwd_relk: dquery (B, H, Lq, D) when query is given (else empty; its
// gradient is in dq), gd (H, Lq + Lk - 1, D) fp32 the per-distance sums for distances 1 - Lq .. Lk - 1 (the
// caller folds them onto the rows of r).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> attention_bwd_relk(
    const Tensor& dout0, const optional<Tensor>& dlse, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out0, const Tensor& lse0, const optional<Tensor>& kpm, double scale, int64_t left, int64_t right,
    const Tensor& r, const optional<Tensor>& query, int64_t max_distance) {
  EFFATTN_GUARD(q);
  RelkTensors keep;
  Prepared pr = prepare_relk(q, k, v, kpm, scale, left, right, r, query, max_distance, keep);
  effattn::AttnParams& p = pr.p;
  check(out0.scalar_type() == q.scalar_type(), "out must have q's dtype");
  Tensor dout = aligned(dout0.to(q.scalar_type()));
  Tensor out = out0.contiguous();
  Tensor lse = lse0.contiguous();
  const int64_t B = q.size(0), Lq = q.size(2), Lk = k.size(2);
  Tensor dq = at::empty({B, p.H, Lq, p.D}, q.options());
  Tensor dquery = at::empty({query.has_value() ? B : 0, p.H, Lq, p.D}, q.options());
  Tensor dk = at::empty({B, p.H / p.G, Lk, p.D}, q.options());
  Tensor dv = at::empty({B, p.H / p.G, Lk, p.Dv}, q.options());
  Tensor gd = at::empty({p.H, Lq + Lk - 1, p.D}, q.options().dtype(at::kFloat));
  Tensor delta = at::empty({B, p.H, Lq}, q.options().dtype(at::kFloat));
  if (Lq == 0 || B * p.H == 0) {
    dq.zero_(), dquery.zero_(), dk.zero_(), dv.zero_(), gd.zero_();
  } else {
    poison(dq), poison(dquery), poison(dk), poison(dv), poison(gd), poison(delta);
    const Tensor dl = set_backward_inputs(p, dout, dlse, out, lse, delta);
    p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
    p.drelkq = query.has_value() ? dquery.data_ptr() : nullptr;
    p.drelk_gd = gd.data_ptr<float>();
    run_checked(effattn::attention_bwd_relk(p, pr.bf16, EFFATTN_STREAM), "relative-keys backward");
  }
  auto crop = [](const Tensor& g, int64_t d) { return g.size(-1) == d ? g : g.narrow(-1, 0, d).contiguous(); };
  return {crop(dq, q.size(3)), crop(dk, k.size(3)), crop(dv, v.size(3)), crop(dquery, q.size(3)), crop(gd, q.size(3))};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(EFFATTN_OPS, m) {
  m.def("attention_fwd_relk(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, float scale, int window_left, "
        "int window_right, Tensor r, Tensor? query, int max_distance) -> (Tensor, Tensor)");
  m.def("attention_bwd_relk(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? key_padding_mask, float scale, int window_left, int window_right, Tensor r, Tensor? query, "
        "int max_distance) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(EFFATTN_OPS, EFFATTN_KEY, m) {
  m.impl("attention_fwd_relk", attention_fwd_relk);
  m.impl("attention_bwd_relk", attention_bwd_relk);
}
