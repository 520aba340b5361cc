// Split-KV decode kernels (see decode.h for the work split):
//
// attn_decode_split_kernel: one block of 4 warps per (batch, KV head, row tile, split). The 16
//   packed query rows sit in shared memory once; key tiles of 64 stream through a two-stage
//   cp.async pipeline (tile t+1 in flight while t is computed; one stage at head dim 256 on GPUs
//   whose shared memory per block cannot hold two) and warp w takes keys
//   [16w, 16w + 16) of each: S = Q K_w^T, an online softmax of its own, O_w += P V_w. At the end the
//   four warps' (max, sum, O) are merged through shared memory in a fixed order.
//   Paged keys/values (DecodeParams::kv, paged.h): each block works on its sequence's seqlens[b] keys
//   (decode_view) and loads key t from slot t % page_size of page block_table[b, t / page_size].
// attn_decode_combine_kernel: one warp per output row merges the splits' partial rows with weights
//   2^(lse_s - max), in split order. Both are deterministic (no atomics).
#pragma once

#include "attention/common.cuh"
#include "attention/decode.h"
#include "attention/paged.cuh"

namespace effattn {

template <int HD, int STAGES = 2>
struct DecodeConfig {
  static constexpr int BM = kDecodeRows;
  static constexpr int BN = kDecodeBlockN;
  static constexpr int kStages = STAGES;
  static constexpr int kRedStride = HD + 4;        // fp32 row stride of the warp-merge buffer
  static constexpr int kSmemBytes = decode_smem_bytes(HD, STAGES);
  // the merge reuses the Q and K/V buffers: 4 warps x 16 rows of O, then (max, sum) per warp and row
  static_assert(4 * BM * kRedStride * 4 + 4 * BM * 2 * 4 <= kSmemBytes, "merge buffer");
};

// The query row (or Lq for a padding row of the tile) and the layout of packed row `pr`'s head.
struct PackedRow {
  int i, h;
  const uint8_t* lay;
};

EFFATTN_DEVICE PackedRow packed_row(const DecodeParams& dp, int hk, int pr) {
  const AttnParams& p = dp.a;
  PackedRow r;
  const bool real = pr < dp.rows;
  const int g = real ? pr / p.Lq : 0;
  r.i = real ? pr % p.Lq : p.Lq;                  // visible() sees nothing in row Lq
  r.h = hk * p.G + g;
  r.lay = p.layout ? p.layout + r.h * p.lay_h : nullptr;
  return r;
}

// The params of batch entry b as a block works on them: paged, sequence b's own key count (paged_view);
// otherwise dp.a itself.
EFFATTN_DEVICE AttnParams decode_view(const DecodeParams& dp, int b) {
  AttnParams p = dp.a;
  if (dp.kv.block_table) paged_view(p, dp.kv, b);
  return p;
}

template <int HD, bool BF16, int STAGES>
EFFATTN_KERNEL attn_decode_split_kernel(const DecodeParams dp) {
  using Cfg = DecodeConfig<HD, STAGES>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, ND = HD / 8, C = HD / 8;
  EFFATTN_SMEM(smem);
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sKV = sQ + BM * HD;                   // stage s: K at sKV + 2 s BN HD, V BN HD further

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  // 1-D grid, splits fastest, then row tiles, then (batch, KV head)
  const int split = int(prim::block_x() % unsigned(dp.splits));
  const int rest = int(prim::block_x() / unsigned(dp.splits));
  const int rt = rest % dp.row_tiles, bk = rest / dp.row_tiles;
  const int Hkv = dp.a.H / dp.a.G, b = bk / Hkv, hk = bk % Hkv;
  const int r0 = rt * BM;
  const AttnParams p = decode_view(dp, b);

  // Q: packed row r0 + r is query i of head hk * G + g (rows are not evenly strided: one copy each)
  const uint16_t* qb = static_cast<const uint16_t*>(p.q) + b * p.q_b;
  for (int idx = tid; idx < BM * C; idx += 128) {
    const int r = idx / C, c = idx % C;
    const PackedRow row = packed_row(dp, hk, r0 + r);
    const bool ok = row.i < p.Lq && c * 8 < p.D;
    const uint16_t* src = ok ? qb + row.h * p.q_h + int64_t(row.i) * p.q_l + c * 8 : qb;
    prim::cp_async_16(sQ + Tile<HD>::offset(r, c), src, ok ? 16 : 0);
  }
  const uint16_t* kb = static_cast<const uint16_t*>(p.k) + b * p.k_b + hk * p.k_h;
  const uint16_t* vb = static_cast<const uint16_t*>(p.v) + b * p.v_b + hk * p.v_h;
  const uint8_t* kpm = p.kpm ? p.kpm + b * p.kpm_b : nullptr;
  const int kd = (p.D + 15) / 16;

  // this split's run of the visible key tiles (every Lq <= 16 rows lie in query tile 0 of 16 rows)
  const Schedule sched = key_schedule(p, hk, 0, BM, BN);
  const int per = (sched.count() + dp.splits - 1) / dp.splits;
  const int first = split * per;
  const int n_tiles = imax(imin(first + per, sched.count()) - first, 0);

  const int32_t* bt = dp.kv.block_table ? paged_row(dp.kv, b) : nullptr;   // paged: sequence b's pages
  auto load_kv = [&](int it, int stage) {
    const int n0 = sched.tile(first + it) * BN;
    uint16_t* sK = sKV + stage * 2 * BN * HD;
    if (bt) {                                       // key t: slot t % page_size of page bt[t / page_size]
      load_paged<HD, BN>(sK, kb, bt, dp.kv.page_size, dp.kv.k_page, p.k_l, n0, p.Lk, p.D);
      load_paged<HD, BN>(sK + BN * HD, vb, bt, dp.kv.page_size, dp.kv.v_page, p.v_l, n0, p.Lk, p.Dv);
    } else {
      load_tile<HD, BN>(sK, kb, p.k_l, n0, p.Lk, p.D);
      load_tile<HD, BN>(sK + BN * HD, vb, p.v_l, n0, p.Lk, p.Dv);
    }
  };
  if (n_tiles > 0) load_kv(0, 0);
  prim::cp_async_commit();

  float acc[ND][4];
#pragma unroll
  for (int j = 0; j < ND; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};
  const PackedRow my[2] = {packed_row(dp, hk, r0 + g), packed_row(dp, hk, r0 + g + 8)};

  for (int it = 0; it < n_tiles; ++it) {
    const int stage = STAGES == 2 ? (it & 1) : 0;
    if (STAGES == 2) {
      if (it + 1 < n_tiles) load_kv(it + 1, (it + 1) & 1);   // that stage was released by the last barrier
      prim::cp_async_commit();
      prim::cp_async_wait<1>();                     // tile it has landed (this thread's copies)
    } else {
      prim::cp_async_wait<0>();                     // one stage: tile it was issued after the last barrier
    }
    prim::sync_block();                             // ... and every thread's
    const uint16_t* sK = sKV + stage * 2 * BN * HD;
    const uint16_t* sV = sK + BN * HD;
    if (dp.mask_full || sched.masked(first + it) || kpm) {   // keys no packed row sees: zero values
      zero_unseen<HD, BN>(sKV + stage * 2 * BN * HD + BN * HD, sched.tile(first + it) * BN, [&](int j) {
        for (int h = hk * p.G; h < (hk + 1) * p.G; ++h)
          if (key_seen(p, p.layout ? p.layout + h * p.lay_h : nullptr, kpm, 0, p.Lq, j)) return true;
        return false;
      });
      prim::sync_block();
    }

    // S = Q K^T on this warp's 16 keys (a 16-row shift keeps the tile's swizzle pattern)
    float s[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    mma_rows_rows<HD, 16, BF16>(s, sQ, 0, sK + warp * 16 * HD, kd);

    const int n0 = sched.tile(first + it) * BN + warp * 16;
    const bool masked = dp.mask_full || sched.masked(first + it);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const PackedRow& row = my[e >> 1];
        const int kj = n0 + 8 * j + 2 * t4 + (e & 1);
        float x = s[j][e] * p.qk_scale;            // log2 units
        if (masked && !visible(p, row.lay, row.i, kj)) x = -INFINITY;
        if (kpm && (kj >= p.Lk || kpm[kj * p.kpm_l])) x = -INFINITY;
        s[j][e] = x;
      }
    // online softmax over this warp's keys (FA-2 Alg. 1 lines 8-10), rows g (r = 0) and g + 8
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
      mx = fmaxf(mx, prim::shfl_xor_f(mx, 1));
      mx = fmaxf(mx, prim::shfl_xor_f(mx, 2));
      const float m_new = fmaxf(m_i[r], mx);
      const float m_ref = m_new == -INFINITY ? 0.f : m_new;   // exp2(-inf - 0) = 0, not NaN
      const float alpha = prim::exp2(m_i[r] - m_ref);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = prim::exp2(s[j][2 * r + e] - m_ref);
          sum += pv;
          s[j][2 * r + e] = pv;
        }
      l_i[r] = l_i[r] * alpha + sum;
      m_i[r] = m_new;
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        acc[j][2 * r] *= alpha;
        acc[j][2 * r + 1] *= alpha;
      }
    }
    // O_w += P V_w: keys [16 w, 16 w + 16) of the tile are reduction step w of V
    uint32_t a[4];
    acc_to_a<BF16>(a, s, 0);
    mma_a_rows<HD, ND, BF16>(acc, a, sV, warp, 0, p.Dv);
    prim::sync_block();                             // every warp is done with this stage
    if (STAGES == 1) {
      if (it + 1 < n_tiles) load_kv(it + 1, 0);
      prim::cp_async_commit();
    }
  }
  prim::cp_async_wait<0>();
  prim::sync_block();                               // (no tile: the Q copies are retired before reuse)

  // merge the four warps: m = max_w m_w, l = sum_w l_w 2^(m_w - m), O = sum_w O_w 2^(m_w - m)
  float* red = reinterpret_cast<float*>(smem);     // Q is no longer read
  float* red_m = red + 4 * BM * Cfg::kRedStride;    // [warp][row]
  float* red_l = red_m + 4 * BM;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_i[r];
    l += prim::shfl_xor_f(l, 1);
    l += prim::shfl_xor_f(l, 2);
    if (t4 == 0) {
      red_m[warp * BM + g + 8 * r] = m_i[r];
      red_l[warp * BM + g + 8 * r] = l;
    }
  }
  prim::sync_block();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    float m = red_m[row];
    for (int w = 1; w < 4; ++w) m = fmaxf(m, red_m[w * BM + row]);
    const float f = prim::exp2(m_i[r] - (m == -INFINITY ? 0.f : m));
    float* dst = red + (warp * BM + row) * Cfg::kRedStride;
#pragma unroll
    for (int j = 0; j < ND; ++j) {
      dst[8 * j + 2 * t4] = acc[j][2 * r] * f;
      dst[8 * j + 2 * t4 + 1] = acc[j][2 * r + 1] * f;
    }
  }
  prim::sync_block();

  const int Dv = p.Dv_out;
  for (int idx = tid; idx < BM * Dv; idx += 128) {
    const int row = idx / Dv, c = idx % Dv;
    const PackedRow pr = packed_row(dp, hk, r0 + row);
    if (pr.i >= p.Lq) continue;
    float m = red_m[row];
    for (int w = 1; w < 4; ++w) m = fmaxf(m, red_m[w * BM + row]);
    const float m_ref = m == -INFINITY ? 0.f : m;
    float l = 0.f, o = 0.f;
    for (int w = 0; w < 4; ++w) {
      l += red_l[w * BM + row] * prim::exp2(red_m[w * BM + row] - m_ref);
      o += red[(w * BM + row) * Cfg::kRedStride + c];
    }
    const bool empty = l == 0.f;
    const float out = empty ? 0.f : o / l;
    const int64_t orow = (int64_t(b) * p.H + pr.h) * p.Lq + pr.i;   // (b, h, i) in (B, H, Lq)
    if (dp.part_o) {
      dp.part_o[(orow * dp.splits + split) * Dv + c] = out;
      if (c == 0) dp.part_lse[orow * dp.splits + split] = empty ? -INFINITY : m + log2f(l);
    } else {
      uint16_t* ob = static_cast<uint16_t*>(p.o) + b * p.o_b + pr.h * p.o_h + int64_t(pr.i) * p.o_l;
      ob[c] = prim::from_float<BF16>(out);
      if (c == 0) p.lse[orow] = empty ? -INFINITY : (m + log2f(l)) * 0.6931471805599453f;
    }
  }
}

// Merges the splits of row (b, h, i) = block_x * 4 + warp: out = sum_s 2^(lse_s - M) o_s / L,
// L = sum_s 2^(lse_s - M), lse = (M + log2 L) ln 2; a row no split saw anything of: 0 and -inf.
template <bool BF16>
EFFATTN_KERNEL attn_decode_combine_kernel(const DecodeParams dp) {
  const AttnParams& p = dp.a;
  const int lane = int(prim::thread_x()) & 31;
  const int64_t row = int64_t(prim::block_x()) * 4 + (prim::thread_x() >> 5);
  const int64_t n_rows = int64_t(p.B) * p.H * p.Lq;
  if (row >= n_rows) return;                        // whole warps: no collective is left waiting
  const int S = dp.splits, Dv = p.Dv_out;
  const float* lse = dp.part_lse + row * S;
  const float* po = dp.part_o + row * S * Dv;
  float m = -INFINITY;
  for (int s = lane; s < S; s += 32) m = fmaxf(m, lse[s]);
  for (int k = 16; k >= 1; k >>= 1) m = fmaxf(m, prim::shfl_xor_f(m, k));
  const float m_ref = m == -INFINITY ? 0.f : m;
  float l = 0.f;                                    // every lane sums all splits in order: one value
  for (int s = 0; s < S; ++s) l += prim::exp2(lse[s] - m_ref);
  const bool empty = l == 0.f;
  const int bh = int(row / p.Lq), i = int(row % p.Lq);
  uint16_t* ob = static_cast<uint16_t*>(p.o) + (bh / p.H) * p.o_b + (bh % p.H) * p.o_h + int64_t(i) * p.o_l;
  for (int c = lane; c < Dv; c += 32) {
    float o = 0.f;
    for (int s = 0; s < S; ++s) o += prim::exp2(lse[s] - m_ref) * po[int64_t(s) * Dv + c];
    ob[c] = prim::from_float<BF16>(empty ? 0.f : o / l);
  }
  if (lane == 0) p.lse[row] = empty ? -INFINITY : (m + log2f(l)) * 0.6931471805599453f;
}

}  // namespace effattn
