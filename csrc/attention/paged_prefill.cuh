// The paged prefill forward: fwd.cuh's mma.sync kernel (FA-2 Alg. 1, query tiles of 64 rows, any Lq)
// with PagedRows as its row policy (key_rows.cuh). Each block reads its sequence's key count seqlens[b]
// on the device (paged_view: queries bottom-right against those keys, so causal / window mean what they
// mean in a contiguous call over the sequence's keys) and loads key / value row t from slot
// t % page_size of page block_table[b, t / page_size] with 16-byte cp.async copies, row by row (any page
// size: a key tile may cross pages). Nothing is read back to the host, so a call can be captured in a CUDA
// graph. Rows past the sequence are zero-filled without reading the table.
#pragma once

#include "attention/fwd.cuh"
#include "attention/paged.cuh"

namespace effattn {

struct PagedRows {
  using Params = PagedParams;
  EFFATTN_DEVICE static const AttnParams& attn(const Params& kp) { return kp.a; }
  EFFATTN_DEVICE static void view(const Params& kp, AttnParams& p, int b) { paged_view(p, kp.kv, b); }
  // base: the pool's first element of the block's KV head (fwd_block: k_b = 0, k0 = 0)
  // (the strided policy's copy plan does not apply: a row's address goes through the table)
  template <int HD, int ROWS, bool V>
  EFFATTN_DEVICE static void load(const Params& kp, int b, const TileCopy<HD, ROWS>&, uint16_t* tile,
                                  const uint16_t* base, int64_t ld, int t0, int L, int width) {
    load_paged<HD, ROWS>(tile, base, paged_row(kp.kv, b), kp.kv.page_size, V ? kp.kv.v_page : kp.kv.k_page, ld, t0,
                         L, width);
  }
};

// Mask kind kWindow: every sequence's key count is its own (a ragged last tile), no layout, key padding
// or dropout (forward-only inference).
template <int HD, bool BF16>
struct PagedFwd {
  static constexpr auto kernel = attn_fwd_kernel<HD, BF16, kWindow, false, false, false, 16, PagedRows>;
};

}  // namespace effattn
