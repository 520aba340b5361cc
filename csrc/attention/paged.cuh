// What the paged decode and prefill kernels share (paged.h): a block's view of its sequence and the
// loads of key / value rows from the pools through the block table.
#pragma once

#include "attention/common.cuh"
#include "attention/paged.h"

namespace effattn {

// The params of batch entry b as a block works on them: sequence b's own key count (seqlens[b], read on
// the device) with its queries bottom-right.
EFFATTN_DEVICE AttnParams paged_view(AttnParams p, const PagedKV& kv, int b) {
  p.Lk = kv.seqlens[b];
  p.off = p.Lk - p.Lq;
  return p;
}

// Keys [t0, t0 + ROWS) of sequence b into a swizzled tile (load_rows): key t from slot t % page_size of
// page block_table[b, t / page_size] at base + page * page_stride + slot * ld (base: the pool's first
// element of this KV head); rows >= L and columns >= width zero-filled, the table read for rows < L only.
// All 128 threads.
template <int HD, int ROWS>
EFFATTN_DEVICE void load_paged(uint16_t* tile, const uint16_t* base, const PagedKV& kv, int b, int64_t page_stride,
                               int64_t ld, int t0, int L, int width) {
  const int32_t* bt = kv.block_table + b * kv.bt_b;
  load_rows<HD, ROWS>(tile, base, [&](int t) {
    return base + int64_t(bt[t / kv.page_size]) * page_stride + int64_t(t % kv.page_size) * ld;
  }, t0, L, width);
}

}  // namespace effattn
