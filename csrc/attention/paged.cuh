// What the paged decode and prefill kernels share (paged.h): a block's view of its sequence and the
// loads of key / value rows from the pools through the block table.
#pragma once

#include "attention/common.cuh"
#include "attention/paged.h"

namespace effattn {

// Batch entry b's params as a block works on them: sequence b's own key count (seqlens[b], read on the
// device) with its queries bottom-right. In place (two fields: a copy of the whole block cost the decode
// kernel registers, and a spill at head dim 64 on sm_80).
EFFATTN_DEVICE void paged_view(AttnParams& p, const PagedKV& kv, int b) {
  p.Lk = kv.seqlens[b];
  p.off = p.Lk - p.Lq;
}

// The block-table row of sequence b.
EFFATTN_DEVICE const int32_t* paged_row(const PagedKV& kv, int b) { return kv.block_table + b * kv.bt_b; }

// Keys [t0, t0 + ROWS) of a sequence into a swizzled tile (load_rows): key t from slot t % page_size of page
// bt[t / page_size] (bt: the sequence's table row, paged_row) at base + page * page_stride + slot * ld (base:
// the pool's first element of this KV head); rows >= L and columns >= width zero-filled, the table read for
// rows < L only. All 128 threads.
template <int HD, int ROWS>
EFFATTN_DEVICE void load_paged(uint16_t* tile, const uint16_t* base, const int32_t* bt, int page_size,
                               int64_t page_stride, int64_t ld, int t0, int L, int width) {
  load_rows<HD, ROWS>(tile, base, [&](int t) {
    return base + int64_t(bt[t / page_size]) * page_stride + int64_t(t % page_size) * ld;
  }, t0, L, width);
}

}  // namespace effattn
