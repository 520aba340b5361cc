// Hopper (sm_90a) forward: the FA2 forward of fwd.cuh with its two products on warpgroup MMA.
//
// One block = one warpgroup (4 warps, 128 threads) per (query tile of 64 rows, b, h), the same grid,
// tile plan (key tiles of 64), mask code, online softmax and epilogue as the mma.sync forward. Per
// key tile: S (64 x 64) = Q K^T by wgmma m64n64k16 with both operands in shared memory; the
// softmax on S's accumulators (warp w holds rows 16w..16w+15 in the m16n8 fragment layout, so
// softmax_step serves both kernels); O (64 x HD) += P V by wgmma m64nHDk16 with P from registers
// and V read N-major. Q, K and V sit in shared memory in wgmma's canonical 128-byte-swizzled
// layout (Sw128Tile), loaded with cp.async, one buffer each, pipelined as the mma.sync forward.
// TMA, mbarriers and producer/consumer warp specialization are later steps.
#pragma once

#include "attention/fwd.cuh"
#include "common/prims_sm90.cuh"

namespace effattn {

// A ROWS x HD tile of 16-bit elements in wgmma's 128B-swizzle canonical layout: 64-column panels
// (128-byte rows) one after another, ROWS x 128 bytes each; in a panel, row r's 16-byte chunk c
// sits at chunk c ^ (r % 8). The tile must start on a 1024-byte boundary of the shared window:
// the hardware applies the swizzle to address bits (chunk bits 4-6 XOR row bits 7-9).
template <int HD, int ROWS>
struct Sw128Tile {
  static_assert(HD % 64 == 0 && ROWS % 8 == 0, "Sw128Tile: 64-column panels of whole 8-row groups");
  static constexpr int kPanelBytes = ROWS * 128;
  EFFATTN_DEVICE static int offset(int row, int chunk) {
    return (chunk >> 3) * (kPanelBytes / 2) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
  }
  // The K-major operand (rows = M or N, the reduction along the columns), reduction step kk (16
  // columns): panel kk / 4, 32 bytes into the 128-byte row per step; 8-row groups 1024 bytes apart
  // (SBO); LBO unused by swizzled K-major layouts (16).
  EFFATTN_DEVICE static uint64_t desc_k(uint32_t tile, int kk) {
    return prim::smem_desc(tile + (kk >> 2) * kPanelBytes + (kk & 3) * 32, 16, 1024, 128);
  }
  // The N-major operand (rows = the reduction, columns = N), reduction step kk (16 rows): 8-row
  // groups 1024 bytes apart (SBO), 64-column panels kPanelBytes apart (LBO).
  EFFATTN_DEVICE static uint64_t desc_mn(uint32_t tile, int kk) {
    return prim::smem_desc(tile + kk * 16 * 128, kPanelBytes, 1024, 128);
  }
};

template <int HD>
struct FwdSm90Config {
  static constexpr int BM = kBlockM;       // 64: one warpgroup's m64 rows
  static constexpr int BN = 64;
  static constexpr int kTileBytes = 64 * HD * 2;
  static constexpr int kSmemBytes = 3 * kTileBytes + 1024;   // Q, K, V + slack to align to 1024
};

template <class A>
EFFATTN_DEVICE void keep_all(A& x) {
  for (auto& row : x)
    for (auto& v : row) prim::keep(v);
}

template <int HD, bool BF16, int KIND>
EFFATTN_KERNEL attn_fwd_sm90_kernel(const AttnParams params) {
#if EFFATTN_SM90A
  using Cfg = FwdSm90Config<HD>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN;
  constexpr int NS = BN / 8, ND = HD / 8;
  using TQ = Sw128Tile<HD, BM>;
  using TKV = Sw128Tile<HD, BN>;
  EFFATTN_SMEM(smem_raw);
  char* smem = smem_raw + ((1024 - (prim::smem_u32(smem_raw) & 1023)) & 1023);
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sK = sQ + BM * HD;
  uint16_t* sV = sK + BN * HD;
  const uint32_t aQ = prim::smem_u32(sQ), aK = prim::smem_u32(sK), aV = prim::smem_u32(sV);

  const int warp = prim::thread_x() >> 5, g = (prim::thread_x() & 31) >> 2;
  // not packed (the binding refuses cu_seqlens here): a segment view (`segment_view`, a copy of the
  // params with the segment's bounds) took the D=128 instances from 168 to 192-203 registers, 3 -> 2
  // blocks per SM; packed calls run on the mma.sync forward
  const GridTile gt = grid_tile((params.Lq + BM - 1) / BM, params.H);
  const AttnParams& p = params;
  const FwdBlock fb = fwd_block(p, gt, BM);
  const uint8_t* kpm = KIND == kAny ? fb.kpm : nullptr;    // (MaskKind: see softmax_step)
  const Schedule sched = key_schedule(p, fb.h, fb.mt, BM, BN);
  const int n_tiles = sched.count();

  load_tile<HD, BM, TQ>(sQ, fb.qb, p.q_l, fb.m0, p.Lq, p.D);
  if (n_tiles > 0) load_tile<HD, BN, TKV>(sK, fb.kb, p.k_l, sched.tile(0) * BN, p.Lk, p.D);
  prim::cp_async_commit();

  float acc[ND][4];
#pragma unroll
  for (int j = 0; j < ND; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};
  const int row0 = fb.m0 + warp * 16 + g;               // this thread's rows: row0, row0 + 8
  const float slope = alibi_slope(p, fb.b, fb.h);

  for (int it = 0; it < n_tiles; ++it) {
    const int n0 = sched.tile(it) * BN;
    const bool masked = KIND != kDense && sched.masked(it);   // kDense: every tile is full
    load_tile<HD, BN, TKV>(sV, fb.vb, p.v_l, n0, p.Lk, p.Dv);
    prim::cp_async_commit();
    prim::cp_async_wait<1>();                            // Q and K(t) have landed (this thread's)
    prim::fence_proxy_async();                           // ... visible to wgmma's async proxy
    prim::sync_block();                                  // ... and every thread's

    // S = Q K^T: HD / 16 reduction steps, one commit group
    float s[NS][4];
#pragma unroll
    for (int j = 0; j < NS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    keep_all(s);
    prim::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      prim::wgmma_ss<BN, BF16, false>(s, TQ::desc_k(aQ, kk), TKV::desc_k(aK, kk), kk > 0);
    prim::wgmma_commit();
    prim::wgmma_wait<0>();
    keep_all(s);
    prim::sync_block();                                  // every thread's wgmma is done reading K(t)
    if (it + 1 < n_tiles) load_tile<HD, BN, TKV>(sK, fb.kb, p.k_l, sched.tile(it + 1) * BN, p.Lk, p.D);
    prim::cp_async_commit();                             // (an empty group on the last tile)

    softmax_step<KIND>(p, fb.lay, kpm, fb.bh, row0, n0, masked, slope, s, acc, m_i, l_i);

    // P as wgmma A fragments (per warp the m16n8k16 A layout), all of them: the registers must
    // stay unchanged until the products retire
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) acc_to_a<BF16>(pa[kk], s, kk);
    prim::cp_async_wait<1>();                            // V(t) has landed; K(t+1) may be in flight
    prim::fence_proxy_async();
    prim::sync_block();
    if (masked || kpm) {                                 // keys no row sees: zero values (NaN-safe)
      zero_unseen<HD, BN, TKV>(sV, n0, [&](int j) { return key_seen(p, fb.lay, kpm, fb.m0, fb.m0 + BM, j); });
      prim::fence_proxy_async();                         // the zeros visible to wgmma's async proxy
      prim::sync_block();
    }
    // O += P V
    keep_all(acc);
    keep_all(pa);
    prim::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) prim::wgmma_rs<HD, BF16, true>(acc, pa[kk], TKV::desc_mn(aV, kk), true);
    prim::wgmma_commit();
    prim::wgmma_wait<0>();
    keep_all(acc);
    keep_all(pa);
    prim::sync_block();                                  // every thread's wgmma is done reading V(t)
  }
  prim::cp_async_wait<0>();

  store_rows<BF16>(p, fb.b, fb.h, fb.bh, row0, acc, m_i, l_i);
#endif
}

}  // namespace effattn
