// The torch glue of the split-KV decode kernels (csrc/attention/decode.cu): the same argument
// preparation as the softmax-attention ops (attention_args.h), the split buffers, the ops' schemas
// (contiguous and paged keys/values).
#include "attention/decode.h"
#include "binding/attention_args.h"

#include <algorithm>

namespace {

using namespace effattn::binding;

// Allocates the output, lse and split buffers of a prepared decode call (d: its params but those),
// then launches it.
std::tuple<Tensor, Tensor> launch_decode(const Tensor& q, int64_t dv, effattn::DecodeParams d, bool bf16,
                                         int64_t splits) {
  Tensor out = at::empty({q.size(0), q.size(1), q.size(2), dv}, q.options());
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  poison(out);
  poison(lse);
  d.a.o = out.data_ptr();
  d.a.o_b = out.stride(0), d.a.o_h = out.stride(1), d.a.o_l = out.stride(2);
  d.a.lse = lse.data_ptr<float>();
  d.splits = int(splits);
  d.rows = d.a.G * d.a.Lq;
  d.row_tiles = (d.rows + effattn::kDecodeRows - 1) / effattn::kDecodeRows;
  Tensor part_o, part_lse;
  if (splits > 1) {
    part_o = at::empty({q.size(0) * q.size(1) * q.size(2), splits, dv}, q.options().dtype(at::kFloat));
    part_lse = at::empty({q.size(0) * q.size(1) * q.size(2), splits}, q.options().dtype(at::kFloat));
    poison(part_o);
    poison(part_lse);
    d.part_o = part_o.data_ptr<float>();
    d.part_lse = part_lse.data_ptr<float>();
  }
  run_checked(effattn::attention_decode(d, bf16, EFFATTN_STREAM), "decode");
  return {out, lse};
}

void check_decode(const Tensor& q, const Tensor& v, int64_t splits, int64_t stages) {
  check(q.dim() == 4 && q.size(2) <= effattn::kDecodeMaxQueries, "decode takes at most 16 query rows");
  check(splits >= 1, "decode needs at least one split");
  check(stages == 2 || (stages == 1 && std::max(q.size(3), v.size(v.dim() - 1)) > 128),
        "decode stages must be 2, or 1 at head dims over 128 (single-buffered K/V where shared memory is short)");
}

// Split-KV decode (Lq <= 16, forward only): `lists` are the tile lists of query tile 0 (16 rows)
// against key tiles of kDecodeBlockN, per KV head; layout_check 2 masks their full tiles too (lists
// of a per-head layout OR-ed over each GQA group).
std::tuple<Tensor, Tensor> attention_decode(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const optional<Tensor>& kpm, const optional<Tensor>& layout,
                                            int64_t layout_block, int64_t layout_check, const optional<Tensor>& lists,
                                            int64_t list_wf, double scale, int64_t left, int64_t right,
                                            int64_t splits, int64_t stages) {
  EFFATTN_GUARD(q);
  check_decode(q, v, splits, stages);
  Prepared r = prepare(q, k, v, kpm, layout, layout_block, layout.has_value() ? 1 : 0, lists, list_wf,
                       c10::nullopt, 0, c10::nullopt, scale, 0.0, left, right);
  effattn::DecodeParams d{};
  d.a = r.p;
  d.mask_full = layout_check == 2;
  d.stages = int(stages);
  return launch_decode(q, v.size(3), d, r.bf16, splits);
}

// The same kernels over paged keys/values (effattn/paged.py's layout): pools k_pages (num_pages, page_size,
// Hkv, D), v_pages (..., Dv), read in place (never copied); block_table int32 (B, max_pages), seqlens int32
// (B,): sequence b holds keys 0 .. seqlens[b] - 1 with its queries bottom-right. The values are trusted
// (the Python caller checks that the used entries lie in the pool and seqlens in [0, capacity]). The
// window (normalized: -1 = unbounded) may be wider than a sequence.
std::tuple<Tensor, Tensor> attention_decode_paged(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages,
                                                  const Tensor& block_table, const Tensor& seqlens, double scale,
                                                  int64_t left, int64_t right, int64_t splits, int64_t stages) {
  EFFATTN_GUARD(q);
  check_decode(q, v_pages, splits, stages);
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
  Prepared r = prepare(q, page0(k_pages), page0(v_pages), c10::nullopt, c10::nullopt, 0, 0, c10::nullopt, 0,
                       c10::nullopt, 0, c10::nullopt, scale, 0.0, -1, -1);
  const Tensor table = block_table.contiguous(), lens = seqlens.contiguous();
  effattn::DecodeParams d{};
  d.a = r.p;
  d.a.Lk = int(capacity);
  d.a.off = d.a.Lk - d.a.Lq;
  d.a.left = int(left);
  d.a.right = int(right);
  d.stages = int(stages);
  d.block_table = table.data_ptr<int32_t>();
  d.seqlens = lens.data_ptr<int32_t>();
  d.bt_b = table.size(1);
  d.k_page = k_pages.stride(0);
  d.v_page = v_pages.stride(0);
  d.page_size = int(k_pages.size(1));
  return launch_decode(q, v_pages.size(3), d, r.bf16, splits);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(EFFATTN_OPS, m) {
  m.def("attention_decode(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? layout, "
        "int layout_block, int layout_check, Tensor? lists, int list_wf, float scale, int window_left, "
        "int window_right, int splits, int stages=2) -> (Tensor, Tensor)");
  m.def("attention_decode_paged(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor seqlens, "
        "float scale, int window_left, int window_right, int splits, int stages=2) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(EFFATTN_OPS, EFFATTN_KEY, m) {
  m.impl("attention_decode", attention_decode);
  m.impl("attention_decode_paged", attention_decode_paged);
}
