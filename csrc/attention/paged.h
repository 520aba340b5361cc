// Paged keys/values (vLLM's layout, effattn/paged.py): the fields the paged decode and prefill kernels
// share, the prefill's parameter block and its entry point. No torch here; the binding fills them.
//
// K / V live in pools (num_pages, page_size, Hkv, D / Dv). The kernels take AttnParams::k / v as the
// pools' first element with k_h / v_h the head strides, k_l / v_l the slot strides and k_b = v_b = 0.
// Sequence b's logical key t is slot t % page_size of page block_table[b * bt_b + t / page_size]; it
// holds seqlens[b] keys, read on the device, so each block works on Lk = seqlens[b] with its queries
// bottom-right (off = seqlens[b] - Lq; `paged_view`). AttnParams::Lk as given is the table's capacity
// (max_pages * page_size), which bounds every sequence's. Rows past a sequence are zero-filled without
// reading the table, so entries past it are never read.
#pragma once

#include <cstdint>

#include "attention/attention.h"

namespace effattn {

struct PagedKV {
  const int32_t* block_table;    // (B, max_pages) int32; null: the keys are contiguous (not paged)
  const int32_t* seqlens;        // (B,) int32
  int64_t bt_b, k_page, v_page;  // the table's row stride; the pools' page strides
  int page_size;
};

// The paged prefill forward (paged_prefill.cu): the mma.sync forward of fwd.cuh (mask kind kWindow, any
// Lq) reading its key / value rows through the block table (PagedRows in paged_prefill.cuh).
struct PagedParams {
  AttnParams a;                  // q, the pools (above), o, lse, sizes, window, scale
  PagedKV kv;
};

// Return 0, or a CUDA error code (-1: no kernel for these head dims).
int attention_fwd_paged(const PagedParams& p, bool bf16, void* stream);

}  // namespace effattn
