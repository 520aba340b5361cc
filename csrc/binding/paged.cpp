// The torch glue of the paged kernels' shared arguments (prepare_paged, attention_args.h) and of the paged
// prefill forward (csrc/attention/paged_prefill.cu). The paged decode op is in decode.cpp.
#include "attention/paged.h"
#include "binding/attention_args.h"

namespace effattn {
namespace binding {

PagedPrepared prepare_paged(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_table,
                            const Tensor& seqlens, double scale, int64_t left, int64_t right) {
  check(q.dim() == 4, "q must be 4-D (B, H, Lq, D)");
  check(k_pages.dim() == 4 && v_pages.dim() == 4 && k_pages.size(0) >= 1 &&
            k_pages.sizes().slice(0, 3) == v_pages.sizes().slice(0, 3),
        "k_pages, v_pages must be 4-D (num_pages >= 1, page_size, Hkv, D / Dv) of the same pages");
  check(cp_async_rows(k_pages) && cp_async_rows(v_pages),
        "k_pages and v_pages are read in place: their last dim must be contiguous, a multiple of 8, the other "
        "strides multiples of 8 elements and the base 16-byte aligned");
  check(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.size(0) == q.size(0),
        "block_table must be int32 (B, max_pages)");
  check(seqlens.scalar_type() == at::kInt && seqlens.dim() == 1 && seqlens.size(0) == q.size(0),
        "seqlens must be int32 (B,)");
  check(block_table.device() == q.device() && seqlens.device() == q.device() && k_pages.device() == q.device() &&
            v_pages.device() == q.device(),
        "k_pages, v_pages, block_table and seqlens must be on q's device");
  const int64_t capacity = block_table.size(1) * k_pages.size(1);
  check(capacity < (int64_t(1) << 30), "max_pages * page_size must be below 2^30");
  check(left >= -1 && left < (int64_t(1) << 30) && right >= -1 && right < (int64_t(1) << 30),
        "window_left / window_right must be -1 (no bound) or in [0, 2^30)");
  // page 0 as a (B, Hkv, page_size, D) view (batch stride 0): prepare() takes the dtypes, head and slot
  // strides from it; the window goes in after its checks, which assume one key length for every row
  auto page0 = [&](const Tensor& pool) { return pool.select(0, 0).transpose(0, 1).unsqueeze(0).expand({q.size(0), -1, -1, -1}); };
  PagedPrepared pp;
  pp.r = prepare(q, page0(k_pages), page0(v_pages), c10::nullopt, c10::nullopt, 0, 0, c10::nullopt, 0, c10::nullopt,
                 0, c10::nullopt, scale, 0.0, -1, -1);
  effattn::AttnParams& p = pp.r.p;
  p.Lk = int(capacity);
  p.off = p.Lk - p.Lq;
  p.left = int(left);
  p.right = int(right);
  pp.table = block_table.contiguous();
  pp.lens = seqlens.contiguous();
  pp.kv.block_table = pp.table.data_ptr<int32_t>();
  pp.kv.seqlens = pp.lens.data_ptr<int32_t>();
  pp.kv.bt_b = pp.table.size(1);
  pp.kv.k_page = k_pages.stride(0);
  pp.kv.v_page = v_pages.stride(0);
  pp.kv.page_size = int(k_pages.size(1));
  return pp;
}

}  // namespace binding
}  // namespace effattn

namespace {

using namespace effattn::binding;

// The paged prefill forward (any Lq; forward only): out (B, H, Lq, Dv) in q's dtype and lse (B, H, Lq) fp32,
// query i of sequence b at key seqlens[b] - Lq + i. A sequence without keys (or a row that sees none) gives 0
// and lse -inf.
std::tuple<Tensor, Tensor> attention_prefill_paged(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages,
                                                   const Tensor& block_table, const Tensor& seqlens, double scale,
                                                   int64_t left, int64_t right) {
  EFFATTN_GUARD(q);
  PagedPrepared pp = prepare_paged(q, k_pages, v_pages, block_table, seqlens, scale, left, right);
  Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v_pages.size(3)}, q.options());
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  poison(out);
  poison(lse);
  effattn::PagedParams pf{};
  pf.a = pp.r.p;
  pf.kv = pp.kv;
  pf.a.o = out.data_ptr();
  pf.a.o_b = out.stride(0), pf.a.o_h = out.stride(1), pf.a.o_l = out.stride(2);
  pf.a.lse = lse.data_ptr<float>();
  run_checked(effattn::attention_fwd_paged(pf, pp.r.bf16, EFFATTN_STREAM), "paged prefill");
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(EFFATTN_OPS, m) {
  m.def("attention_prefill_paged(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor seqlens, "
        "float scale, int window_left, int window_right) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(EFFATTN_OPS, EFFATTN_KEY, m) {
  m.impl("attention_prefill_paged", attention_prefill_paged);
}
