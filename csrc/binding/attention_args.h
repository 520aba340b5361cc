// The arguments of the softmax-attention ops (forward, backward, decode) as an AttnParams: checks,
// aligned copies where cp.async cannot read a tensor, the mask and dropout fields.
#pragma once

#include "attention/attention.h"
#include "attention/paged.h"
#include "binding/common.h"

#include <vector>

namespace effattn {
namespace binding {

// Packed sequences and positions: cu_seqlens_q / _k (int32 (N + 1,), on q's device; q, k, v packed as
// (1, H, T, D)) with the longest segments (max_seqlen: the grid; never read back from the device),
// and the offset of a positioned call (query i at key i + q_offset; none: bottom-right). drop_at: where dropout
// draws, (q_start, k_start, h0, heads): query i at row q_start + i, key j at k_start + j, head h of batch entry b
// at b * heads + h0 + h (a context-parallel chunk / head shard); empty: (0, 0, 0, H). Per-row positions (LSH
// attention's sorted rounds, AttnParams::q_pos): q_pos int32 (B, H, Lq), k_pos int32 (B, Hkv, Lk) (-1: a padding
// key), with pos_causal and the constant score pos_self of a query's own key; none: no positions.
struct Varlen {
  optional<Tensor> cu_q, cu_k;
  int64_t max_q = 0, max_k = 0;
  optional<int64_t> q_offset;
  std::vector<int64_t> drop_at;
  optional<Tensor> q_pos, k_pos;
  bool pos_causal = false;
  double pos_self = 0.0;
};

// The tensors a call's AttnParams point into (kept alive for the call) and the params themselves.
struct Prepared {
  Tensor q, k, v, kpm, layout, lists, lists_by_key, cu_q, cu_k, q_pos, k_pos;
  effattn::AttnParams p{};
  bool bf16 = false;
};

// Whether the kernels can read a 4-D tensor with 16-byte cp.async rows in place.
bool cp_async_rows(const Tensor& t);

// A tensor the kernels can read with 16-byte cp.async rows: t itself, or a zero-padded contiguous copy
// (explain() names it).
Tensor aligned(const Tensor& t);

// Fills everything but the output / gradient pointers.
Prepared prepare(const Tensor& q0, const Tensor& k0, const Tensor& v0, const optional<Tensor>& kpm,
                 const optional<Tensor>& layout, int64_t layout_block, int64_t lay_check,
                 const optional<Tensor>& lists, int64_t list_wf, const optional<Tensor>& lists_by_key,
                 int64_t listk_wf, const optional<Tensor>& seed, double scale, double dropout_p, int64_t left,
                 int64_t right, const Varlen& varlen = Varlen{});

// Points p at a backward's inputs: dO (`aligned`), the forward's out (q's dtype or fp32) and lse, the Delta
// buffer (written by the Delta kernel, read by the passes) and the lse's gradient, if any, as fp32: the
// returned tensor (keep it alive for the launch; undefined without one).
Tensor set_backward_inputs(effattn::AttnParams& p, const Tensor& dout, const optional<Tensor>& dlse, const Tensor& out,
                           const Tensor& lse, const Tensor& delta);

// A paged call's arguments (paged.h; binding/paged.cpp): the pools k_pages (num_pages, page_size, Hkv, D),
// v_pages (..., Dv), read in place, never copied (refused unless cp.async reads their rows); block_table int32
// (B, max_pages), seqlens int32 (B,), on q's device. `p.Lk` is the table's capacity; the window (normalized,
// -1 = unbounded) may be wider than a sequence. The table's and seqlens' values are trusted: the Python
// caller checks that the used entries lie in the pool and seqlens in [0, capacity] (effattn/paged.py).
struct PagedPrepared {
  Prepared r;
  Tensor table, lens;
  effattn::PagedKV kv{};
};

PagedPrepared prepare_paged(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& block_table,
                            const Tensor& seqlens, double scale, int64_t left, int64_t right);

}  // namespace binding
}  // namespace effattn
