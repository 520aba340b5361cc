// Hopper (sm_90a) forward: the FA2 forward of fwd.cuh with its two products on warpgroup MMA,
// two consumer warpgroups per block, double-buffered K and V and asynchronous wgmma.
//
// One block = two warpgroups (8 warps, 256 threads) per (query tile of 128 rows, b, h); warpgroup w
// owns rows [64 w, 64 w + 64) (warp 4 w + i: 16 of them, in the m16n8 fragment layout, so the
// mask code, online softmax and epilogue of the mma.sync forward serve both kernels). Key tiles of 64,
// the same tile plan. Per key tile t: S(t) (64 x 64 per warpgroup) = Q K(t)^T by wgmma m64n64k16, both
// operands in shared memory; O (64 x HD) += P(t - 1) V(t - 1) by wgmma m64nHDk16 with P from registers
// and V read N-major, issued right behind S(t) without waiting: the tensor cores run P V of the last tile
// while the warps mask and exponentiate S(t) (the rescale of O waits for that product only).
// Q, K and V sit in shared memory in wgmma's canonical 128-byte-swizzled layout (Sw128Tile), loaded
// with cp.async by all 256 threads (Sw128Copy: per-thread addresses computed once per block), K and V
// in two buffers each: the copies of K(t + 1) and V(t) fly while the products of tile t run. One block
// barrier per key tile (two on a masked tile: the zeroed keys). TMA, mbarriers and a producer warp are
// later steps.
#pragma once

#include "attention/fwd.cuh"
#include "common/prims_async.cuh"   // (named barriers: PingPong)

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

// One thread's share of the cp.async copies of a ROWS x HD tile (Sw128Tile layout) by NT threads: the
// thread copies 16-byte chunk c = tid % (HD / 8) of rows r1 + STEP i (r1 = tid / (HD / 8), STEP =
// NT / (HD / 8), i < ROWS / STEP). STEP is a multiple of 8, so the chunk's swizzled place is the same
// in each of those rows: the addresses are computed once per block, a copy adds constant strides.
template <int HD, int ROWS, int NT>
struct Sw128Copy {
  static constexpr int C = HD / 8, STEP = NT / C, N = ROWS / STEP;
  static_assert(NT % C == 0 && STEP % 8 == 0 && ROWS % STEP == 0, "Sw128Copy: whole 8-row groups per step");
  int soff, r1, col;
  EFFATTN_DEVICE Sw128Copy() {
    const int t = int(prim::thread_x());
    r1 = t / C;
    col = (t % C) * 8;
    soff = Sw128Tile<HD, ROWS>::offset(r1, t % C);
  }
  // Rows [r0, r0 + ROWS) of an (L, width) matrix whose rows lie `ld` elements apart from `base` (width
  // a multiple of 8, rows 16-byte aligned), zero-filled at rows >= L and columns >= width.
  EFFATTN_DEVICE void load(uint16_t* tile, const uint16_t* base, int64_t ld, int r0, int L, int width) const {
    const int left = L - r0 - r1;                       // this thread's rows i with STEP i < left exist
    const bool col_ok = col < width;
    const uint16_t* src = base + int64_t(r0 + r1) * ld + col;
    uint16_t* dst = tile + soff;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const bool ok = col_ok && STEP * i < left;
      prim::cp_async_16(dst + STEP * i * 64, ok ? src + STEP * i * ld : base, ok ? 16 : 0);
    }
  }
};

template <int HD>
struct FwdSm90Config {
  static constexpr int kThreads = 256;     // two warpgroups
  static constexpr int BM = 128;           // 64 query rows per warpgroup (wgmma's m64)
  static constexpr int BN = 64;
  static constexpr int kQBytes = BM * HD * 2, kKVBytes = BN * HD * 2;
  // Q, two K and two V buffers, and the slack to align them to 1024 bytes
  static constexpr int kSmemBytes = kQBytes + 4 * kKVBytes + 1024;
};

template <class A>
EFFATTN_DEVICE void keep_all(A& x) {
  for (auto& row : x)
    for (auto& v : row) prim::keep(v);
}

// The ping-pong of the two consumer warpgroups (FA3's inter-warpgroup overlap; fwd_sm90_tma.cuh): at
// each step a warpgroup issues its wgmmas only in its turn, so the tensor cores run one warpgroup's
// products while the other's softmax runs. Warpgroup w waits at named barrier kFirst + w (bar.sync, 256
// threads: its own 128 and the other's 128 bar.arrive), issues, then arrives at the other's barrier.
// Warpgroup 1 arrives at warpgroup 0's once before the first step (0 goes first) and skips its arrival
// after its last issue, so that every arrival meets a bar.sync (the emulation fails on one left over).
struct PingPong {
  static constexpr int kFirst = 2;                 // barriers 2, 3 (0: __syncthreads, 1: the consumers')
  static constexpr int kThreads = 256;
  int w;
  EFFATTN_DEVICE void start(int n_tiles) const {
    if (w == 1 && n_tiles > 0) prim::named_arrive(kFirst, kThreads);
  }
  EFFATTN_DEVICE void wait_turn() const { prim::named_sync(kFirst + w, kThreads); }
  EFFATTN_DEVICE void pass_turn(bool last) const {
    if (w == 0 || !last) prim::named_arrive(kFirst + (w ^ 1), kThreads);
  }
};

// The consumers' side of both Hopper forwards (this kernel and fwd_sm90_tma.cuh's): two warpgroups
// (threads 0..255) run S(t), P V(t - 1) behind it, the softmax of tile t and the epilogue, over the
// block's key tiles of BN keys, with Q at aQ (this warpgroup's rows) and K, V in two buffers each at aK,
// aV (kvBytes apart). The kernels differ in how the tiles arrive: `begin_step(t)` returns once K(t) and
// V(t) are in and V(t - 1)'s unseen keys are zeroed (t == n_tiles: only the latter), `issue_copies(t)`
// starts the next copies after it, and `release(t)` runs once P V(t - 1) has retired (K(t - 1) and V(t - 1)
// are no longer read). PINGPONG: the warpgroups issue their wgmmas in turns (PingPong); the fp32
// operations and their order are the same either way.
template <int HD, bool BF16, int KIND, int BN, bool PINGPONG, class Begin, class Copies, class Release>
EFFATTN_DEVICE void consume_key_tiles(const AttnParams& p, const FwdBlock& fb, const Schedule& sched, uint32_t aQ,
                                      uint32_t aK, uint32_t aV, Begin&& begin_step, Copies&& issue_copies,
                                      Release&& release) {
  constexpr int BM = FwdSm90Config<HD>::BM, kKVBytes = BN * HD * 2;
  constexpr int NS = BN / 8, ND = HD / 8;
  using TQ = Sw128Tile<HD, BM>;
  using TKV = Sw128Tile<HD, BN>;
  const int n_tiles = sched.count();
  const int warp = prim::thread_x() >> 5, g = (prim::thread_x() & 31) >> 2;
  const uint8_t* kpm = KIND == kAny ? fb.kpm : nullptr;    // (MaskKind: see softmax_scores)

  float acc[ND][4], s[NS][4];
#pragma unroll
  for (int j = 0; j < ND; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
  for (int j = 0; j < NS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  uint32_t pa[BN / 16][4] = {};                         // P(t - 1) as wgmma A fragments
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};
  const int row0 = fb.m0 + warp * 16 + g;               // this thread's rows: row0, row0 + 8
  const float slope = alibi_slope(p, fb.b, fb.h);

  auto issue_s = [&](int it) {                           // S(t) = Q K(t)^T: HD / 16 steps, one group
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      prim::wgmma_ss<BN, BF16, false>(s, TQ::desc_k(aQ, kk), TKV::desc_k(aK + (it & 1) * kKVBytes, kk), kk > 0);
    prim::wgmma_commit();
  };
  auto issue_pv = [&](int it) {                          // O += P(t) V(t): BN / 16 steps, one group
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      prim::wgmma_rs<HD, BF16, true>(acc, pa[kk], TKV::desc_mn(aV + (it & 1) * kKVBytes, kk), true);
    prim::wgmma_commit();
  };
  auto softmax = [&](int it, float (&alpha)[2]) {        // S(t) -> P(t) in s, m_i, l_i, alpha
    const int n0 = sched.tile(it) * BN;
    const bool masked = KIND != kDense && sched.masked(it);   // kDense: every tile is full
    // kDense / kWindow: a softmax without the score terms' code for calls without them; kAny (layouts,
    // padding, dropout) keeps one copy that reads p.score per element (its loop would double)
    if (KIND == kAny || p.score)
      softmax_scores<KIND, false, KIND == kAny ? -1 : 1>(p, fb.lay, kpm, fb.bh, row0, n0, masked, slope, s, m_i, l_i,
                                                         alpha);
    else
      softmax_scores<KIND, false, 0>(p, fb.lay, kpm, fb.bh, row0, n0, masked, slope, s, m_i, l_i, alpha);
  };
  auto to_pa = [&](const float (&alpha)[2]) {            // once P V(t - 1) retired: O rescaled, P(t) packed
    rescale_rows(acc, alpha);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) acc_to_a<BF16>(pa[kk], s, kk);
  };

  const PingPong turns{warp >> 2};
  if (PINGPONG) turns.start(n_tiles);
  if (n_tiles > 0) {
    float alpha[2];
    begin_step(0);
    issue_copies(0);
    if (PINGPONG) turns.wait_turn();
    prim::wgmma_fence();
    issue_s(0);
    if (PINGPONG) turns.pass_turn(false);
    prim::wgmma_wait<0>();
    keep_all(s);
    softmax(0, alpha);
    to_pa(alpha);
    for (int it = 1; it < n_tiles; ++it) {
      begin_step(it);
      issue_copies(it);
      if (PINGPONG) turns.wait_turn();
      prim::wgmma_fence();
      issue_s(it);
      issue_pv(it - 1);
      if (PINGPONG) turns.pass_turn(false);
      prim::wgmma_wait<1>();                             // S(t) has retired; P V(t - 1) may still run
      keep_all(s);
      softmax(it, alpha);
      prim::wgmma_wait<0>();                             // P V(t - 1) has retired: O and P(t - 1) are free
      keep_all(acc);
      keep_all(pa);
      release(it);
      to_pa(alpha);
    }
    begin_step(n_tiles);
    if (PINGPONG) turns.wait_turn();
    prim::wgmma_fence();
    issue_pv(n_tiles - 1);
    if (PINGPONG) turns.pass_turn(true);
    prim::wgmma_wait<0>();
    keep_all(acc);
  }
  store_rows<BF16>(p, fb.b, fb.h, fb.bh, row0, acc, m_i, l_i);
}

template <int HD, bool BF16, int KIND>
EFFATTN_KERNEL_WG2 attn_fwd_sm90_kernel(const AttnParams params) {
#if EFFATTN_SM90A
  using Cfg = FwdSm90Config<HD>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, NT = Cfg::kThreads;
  using TKV = Sw128Tile<HD, BN>;
  EFFATTN_SMEM(smem_raw);
  char* smem = smem_raw + ((1024 - (prim::smem_u32(smem_raw) & 1023)) & 1023);
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sK = sQ + BM * HD;                          // K buffers 0, 1
  uint16_t* sV = sK + 2 * BN * HD;                      // V buffers 0, 1
  const int warp = prim::thread_x() >> 5;
  // this warpgroup's 64 rows of Q: 64 rows of 128 bytes into each panel (a multiple of 1024 bytes)
  const uint32_t aQ = prim::smem_u32(sQ) + (warp >> 2) * 64 * 128;
  const uint32_t aK = prim::smem_u32(sK), aV = prim::smem_u32(sV);

  // not packed (the binding refuses cu_seqlens here): a segment view (`segment_view`, a copy of the
  // params with the segment's bounds) costs registers in every instance; packed calls run on the
  // mma.sync forward
  const GridTile gt = grid_tile((params.Lq + BM - 1) / BM, params.H);
  const AttnParams& p = params;
  const FwdBlock fb = fwd_block(p, gt, BM);
  const uint8_t* kpm = KIND == kAny ? fb.kpm : nullptr;    // (MaskKind: see softmax_scores)
  const Schedule sched = key_schedule(p, fb.h, fb.mt, BM, BN);
  const int n_tiles = sched.count();
  const Sw128Copy<HD, BM, NT> q_copy;
  const Sw128Copy<HD, BN, NT> kv_copy;

  q_copy.load(sQ, fb.qb, p.q_l, fb.m0, p.Lq, p.D);
  if (n_tiles > 0) kv_copy.load(sK, fb.kb, p.k_l, sched.tile(0) * BN, p.Lk, p.D);
  prim::cp_async_commit();

  // Step t (t < n_tiles) runs S(t) and P(t - 1) V(t - 1); step n_tiles only the last P V. At a step's
  // start every copy issued (K(t), V(t - 1)) has landed and, past the barrier, every thread is done
  // with the previous step's reads. The first and the last step are peeled off the loop: ptxas then
  // sees each wgmma wait in straight-line code (with branches around the issues it serialized them).
  auto begin_step = [&](int it) {
    prim::cp_async_wait<0>();
    prim::fence_proxy_async();                           // the copies visible to wgmma's async proxy
    prim::sync_block();                                  // ... and every thread's
    if (it > 0 && (KIND != kDense && sched.masked(it - 1) || kpm)) {   // keys no row sees: zero values
      zero_unseen<HD, BN, TKV, NT>(sV + ((it - 1) & 1) * BN * HD, sched.tile(it - 1) * BN,
                                   [&](int j) { return key_seen(p, fb.lay, kpm, fb.m0, fb.m0 + BM, j); });
      prim::fence_proxy_async();                         // the zeros visible to wgmma's async proxy
      prim::sync_block();
    }
  };
  // K(t + 1) into the buffer S(t - 1) read, V(t) into the one P V(t - 2) read: both retired
  auto issue_copies = [&](int it) {
    if (it + 1 < n_tiles) kv_copy.load(sK + ((it + 1) & 1) * BN * HD, fb.kb, p.k_l, sched.tile(it + 1) * BN, p.Lk, p.D);
    kv_copy.load(sV + (it & 1) * BN * HD, fb.vb, p.v_l, sched.tile(it) * BN, p.Lk, p.Dv);
    prim::cp_async_commit();
  };
  consume_key_tiles<HD, BF16, KIND, BN, false>(p, fb, sched, aQ, aK, aV, begin_step, issue_copies, [](int) {});
  prim::cp_async_wait<0>();                              // (Q's copies when there is no key tile)
#endif
}

}  // namespace effattn
