// The torch glue of the forward with relative keys (csrc/attention/relkeys.cu): q, k, v as the
// softmax-attention ops take them (attention_args.h), the relative keys r (H, n_dist, D) and the term's
// query; the op's schema. Forward only.
#include "binding/attention_args.h"

namespace {

using namespace effattn::binding;

// out (B, H, Lq, Dv) and lse (B, H, Lq) fp32 of softmax(scale (q k^T + query . r[h, idx(d)])) v with the
// window and key padding of a call; max_distance -1: r holds past distances 0 .. n_dist - 1 (idx clamps
// to them), else n_dist = 2 max_distance + 1. query: None for q itself.
std::tuple<Tensor, Tensor> attention_fwd_relk(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const optional<Tensor>& kpm, double scale, int64_t left, int64_t right,
                                              const Tensor& r, const optional<Tensor>& query, int64_t max_distance) {
  EFFATTN_GUARD(q);
  Prepared pr = prepare(q, k, v, kpm, c10::nullopt, 0, 0, c10::nullopt, 0, c10::nullopt, 0, c10::nullopt, scale, 0.0,
                        left, right);
  effattn::AttnParams& p = pr.p;
  check(r.dim() == 3 && r.size(0) == q.size(1) && r.size(2) == q.size(3) && r.size(1) >= 1,
        "r (relative keys) must be (H, n_dist >= 1, D)");
  check(r.scalar_type() == q.scalar_type() && r.device() == q.device(), "r must share q's dtype and device");
  check(max_distance == -1 || (max_distance >= 0 && r.size(1) == 2 * max_distance + 1),
        "max_distance must be -1 (past distances) or M with r holding 2 M + 1 distances");
  check(r.size(1) < (int64_t(1) << 30), "r holds too many distances");
  const Tensor rk = aligned(r.unsqueeze(0));            // (1, H, n_dist, D) in 16-byte rows
  p.relk = rk.data_ptr();
  p.relk_h = rk.stride(1), p.relk_l = rk.stride(2);
  p.relk_n = int(r.size(1));
  p.relk_max = int(max_distance);
  Tensor rq;
  if (query.has_value()) {
    check(query->sizes() == q.sizes() && query->scalar_type() == q.scalar_type() && query->device() == q.device(),
          "query must be shaped like q, with q's dtype and device");
    rq = aligned(*query);
    check(rq.size(3) == pr.q.size(3), "query's padded head dim must match q's");
    p.relkq = rq.data_ptr();
    p.relkq_b = stride_or_0(rq, 0), p.relkq_h = stride_or_0(rq, 1), p.relkq_l = rq.stride(2);
  }
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(EFFATTN_OPS, m) {
  m.def("attention_fwd_relk(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, float scale, int window_left, "
        "int window_right, Tensor r, Tensor? query, int max_distance) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(EFFATTN_OPS, EFFATTN_KEY, m) {
  m.impl("attention_fwd_relk", attention_fwd_relk);
}
