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

// The same kernels over paged keys/values (prepare_paged, attention_args.h).
std::tuple<Tensor, Tensor> attention_decode_paged(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages,
                                                  const Tensor& block_table, const Tensor& seqlens, double scale,
                                                  int64_t left, int64_t right, int64_t splits, int64_t stages) {
  EFFATTN_GUARD(q);
  check_decode(q, v_pages, splits, stages);
  PagedPrepared pp = prepare_paged(q, k_pages, v_pages, block_table, seqlens, scale, left, right);
  effattn::DecodeParams d{};
  d.a = pp.r.p;
  d.kv = pp.kv;
  d.stages = int(stages);
  return launch_decode(q, v_pages.size(3), d, pp.r.bf16, splits);
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
