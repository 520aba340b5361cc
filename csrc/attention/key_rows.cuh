// Where the forward kernel (fwd.cuh) reads its key and value rows: its template argument ROWS, a policy
// that gives the kernel's parameter type, the params a block works on and the loads of a K or V tile.
// StridedRows (here, the default): the strided tensors of AttnParams. PagedRows (paged_prefill.cuh): the
// pages of a pool through a block table (paged.h). Only the loads and the block's key count differ; the
// schedule, masks and softmax are the kernel's own.
#pragma once

#include "attention/common.cuh"

namespace effattn {

struct StridedRows {
  using Params = AttnParams;
  EFFATTN_DEVICE static const AttnParams& attn(const Params& kp) { return kp; }
  // The params of batch entry b (after block_view): unchanged.
  EFFATTN_DEVICE static void view(const Params&, AttnParams&, int) {}
  // Rows [t0, t0 + ROWS) of batch entry b's keys (V: values) at base + t * ld: load_tile through the block's
  // per-thread copy plan `map`.
  template <int HD, int ROWS, bool V>
  EFFATTN_DEVICE static void load(const Params&, int, const TileCopy<HD, ROWS>& map, uint16_t* tile,
                                  const uint16_t* base, int64_t ld, int t0, int L, int width) {
    map.load(tile, base, ld, t0, L, width);
  }
};

}  // namespace effattn
