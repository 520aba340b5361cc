// Hopper (sm_90a) backward: the fused backward of bwd_fused.cuh (five products per (query tile, key tile)
// pair, dQ added in key-tile order under a semaphore per query tile) with its products on warpgroup MMA.
//
// One block = two warpgroups (8 warps, 256 threads) per (key tile of 128, b, kv head); warpgroup w owns
// keys [64 w, 64 w + 64), warp 4 w + i keys [16 (4 w + i), + 16) in the m16n8 fragment layout, so the
// element code (p_and_ds) and the epilogue (store_dkdv) of the mma.sync kernel serve both. The block walks
// the same query steps as bwd_fused.cuh (query_schedule: 64-row tiles from the last down, the group's heads
// inside each), Q, dO, lse and Delta double-buffered (cp.async, step u + 1's copies in flight during step
// u's products). K, V, Q and dO sit in wgmma's 128-byte-swizzled layout (Sw128Tile, fwd_sm90.cuh). Per step:
//   S^T = K Q^T, dP^T = V dO^T      wgmma m64n64k16, both operands in shared memory (per warpgroup:
//                                   64 keys x 64 queries), two groups issued back to back
//   P^T, dS^T                       in registers (p_and_ds); dS also to shared memory, query-major (the
//                                   A operand of dQ), then fence.proxy.async
//   dV += P^T dO, dK += dS^T Q      wgmma m64nHDk16 with A from registers (P^T, dS^T repacked as 16-bit
//                                   A fragments), B = dO, Q read N-major
//   dQ_part = dS K                  wgmma, A = dS and B = K (N-major) in shared memory, after the block
//                                   barrier that makes dS whole and the semaphore turn this block's; head
//                                   dim 128: m64n64k16 per warpgroup on columns [64 w, 64 w + 64); head dim
//                                   64: m64n64k16 per warpgroup on its own 64 keys, the two partials added
//                                   in shared memory (warpgroup 0 + warpgroup 1)
// dQ_part goes to the fp32 dq_accum exactly as in bwd_fused.cuh (the same BM, BN, schedules and
// semaphores: bitwise reproducible), and attn_dq_convert_kernel writes dq. dK / dV retire (wgmma wait)
// before the dQ barrier: the next step's copies overwrite the Q / dO stage they read, after that barrier.
//
// Serves mask kinds kDense, kCausal and kWindow without dropout, key padding, score terms or packed
// sequences, head-dim buckets 64 and 128 (attention_bwd_sm90_serves, bwd.cu); every other call runs the
// mma.sync kernels. Its device code exists only in the sm_90a part of a build (EFFATTN_SM90A).
#pragma once

#include "attention/bwd_launch.cuh"
#include "attention/fwd_sm90.cuh"

namespace effattn {

template <int HD>
struct BwdSm90Config {
  static constexpr int BM = 64;             // query rows per step (as bwd_fused.cuh: its semaphores)
  static constexpr int BN = 128;            // keys per block: 64 per warpgroup (wgmma's m64)
  static constexpr int kThreads = 256;
  static constexpr int kStages = 2;         // buffers of Q, dO, lse, Delta
  static constexpr int kKVBytes = BN * HD * 2, kQBytes = BM * HD * 2, kDSBytes = BM * BN * 2;
  // K, V; Q and dO per stage; dS; lse and Delta per stage; at head dim 64 warpgroup 1's dQ partial (fp32);
  // the slack to align the tiles to 1024 bytes
  static constexpr int kSmemBytes = 2 * kKVBytes + 2 * kStages * kQBytes + kDSBytes + 2 * kStages * BM * 4 +
                                    (HD == 64 ? BM * HD * 4 : 0) + 1024;
};

template <int HD, bool BF16, int KIND>
EFFATTN_KERNEL_WG2 attn_bwd_sm90_kernel(const AttnParams params) {
#if EFFATTN_SM90A
  using Cfg = BwdSm90Config<HD>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, NT = Cfg::kThreads;
  constexpr int NS = BM / 8;                 // 8-wide query subtiles of a warp's S^T
  constexpr int NA = HD / 8;                 // 8-wide column subtiles of dK / dV
  // dQ = dS K: at head dim 128 warpgroup w takes columns [64 w, 64 w + 64) (one K panel) over all 128 keys;
  // at 64 it takes all 64 columns over its own 64 keys, and warpgroup 0 adds warpgroup 1's partial (through
  // shared memory) before the global adds. Either way every wgmma B operand starts on a 64-column panel of
  // K: a 32-column split would start 64 bytes into a swizzled row.
  constexpr bool kSplitKeys = HD == 64;
  constexpr int NDQ = kSplitKeys ? HD : HD / 2;   // the columns of a warpgroup's dQ product
  constexpr int NQ = NDQ / 8;
  using TK = Sw128Tile<HD, BN>;              // K, V: key rows
  using TQ = Sw128Tile<HD, BM>;              // Q, dO: query rows
  using TS = Sw128Tile<BN, BM>;              // dS: query rows, key columns
  EFFATTN_SMEM(smem_raw);
  char* smem = smem_raw + ((1024 - (prim::smem_u32(smem_raw) & 1023)) & 1023);
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sV = sK + BN * HD;
  uint16_t* sQ = sV + BN * HD;               // [stage][BM rows]
  uint16_t* sdO = sQ + Cfg::kStages * BM * HD;
  uint16_t* sdS = sdO + Cfg::kStages * BM * HD;
  float* s_lse = reinterpret_cast<float*>(sdS + BM * BN);
  float* s_delta = s_lse + Cfg::kStages * BM;
  float* s_dq = s_delta + Cfg::kStages * BM;  // head dim 64: warpgroup 1's dQ partial (fragment order)

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int g = lane >> 2, t4 = lane & 3;
  // this warpgroup's 64 keys: 64 rows of 128 bytes into each panel of K and V (a multiple of 1024 bytes)
  const uint32_t aK = prim::smem_u32(sK), aV = prim::smem_u32(sV), aKw = aK + wg * 64 * 128, aVw = aV + wg * 64 * 128;
  const uint32_t aQ = prim::smem_u32(sQ), adO = prim::smem_u32(sdO), adS = prim::smem_u32(sdS);
  const int c0 = kSplitKeys ? 0 : wg * NDQ;  // this warpgroup's columns of dQ: its K panel
  const uint32_t aKc = aK + (c0 / 64) * TK::kPanelBytes;
  const int kk0 = kSplitKeys ? wg * (BN / 32) : 0;   // ... and its 16-key steps of the reduction
  // not packed (the binding refuses cu_seqlens here): the params as they are
  const AttnParams& p = params;
  const GridTile gt = grid_tile((p.Lk + BN - 1) / BN, p.H / p.G);
  const int nt = gt.t, b = gt.b, hk = gt.h;
  const int n0 = nt * BN;
  const int n_mt = (p.Lq + BM - 1) / BM;
  const Sw128Copy<HD, BN, NT> kv_copy;
  const Sw128Copy<HD, BM, NT> q_copy;

  kv_copy.load(sK, static_cast<const uint16_t*>(p.k) + b * p.k_b + hk * p.k_h + p.k0 * p.k_l, p.k_l, n0, p.Lk, p.D);
  kv_copy.load(sV, static_cast<const uint16_t*>(p.v) + b * p.v_b + hk * p.v_h + p.k0 * p.v_l, p.v_l, n0, p.Lk, p.Dv);
  prim::cp_async_commit();

  // the query steps of bwd_fused.cuh: step u is tile t3 - 1 - u / G of head hk G + u % G
  const Schedule sched = query_schedule(p, nullptr, hk * p.G, nt, BM, BN);
  const int count = sched.count(), total = p.G * count, t3 = sched.t0 + count;
  auto issue = [&](int u, int stage) {       // Q, dO (cp.async) and the row statistics of step u
    const int h = hk * p.G + u % p.G, m0 = (t3 - 1 - u / p.G) * BM;
    q_copy.load(sQ + stage * BM * HD, static_cast<const uint16_t*>(p.q) + b * p.q_b + h * p.q_h + p.q0 * p.q_l, p.q_l,
                m0, p.Lq, p.D);
    q_copy.load(sdO + stage * BM * HD, static_cast<const uint16_t*>(p.dout) + b * p.do_b + h * p.do_h + p.q0 * p.do_l,
                p.do_l, m0, p.Lq, p.Dv);
    load_row_stats<NT>(p, s_lse + stage * BM, s_delta + stage * BM, b, h, m0, BM);
  };
  if (total > 0) issue(0, 0);
  prim::cp_async_commit();
  // Keys no query row sees (past the window of every row) may hold anything, NaN included: zero their K
  // rows, so that dQ = dS K adds 0 * 0 for them (as bwd_fused.cuh; rows past Lk land as zeros). The loop's
  // first fence.proxy.async and barrier publish the zeros to wgmma.
  if (KIND != kDense && (p.left >= 0 || p.right >= 0)) {
    prim::cp_async_wait<1>();
    prim::sync_block();
    zero_unseen<HD, BN, TK, NT>(sK, n0, [&](int j) { return key_seen(p, nullptr, nullptr, 0, p.Lq, j); });
  }

  float dk[NA][4], dv[NA][4], st[NS][4], dpt[NS][4], dq[NQ][4];
  zero_acc(dk);
  zero_acc(dv);
  zero_acc(st);
  zero_acc(dpt);
  zero_acc(dq);
  const int key0 = n0 + warp * 16 + g;       // this thread's keys: key0, key0 + 8
  int* held = nullptr;                       // the semaphore whose turn this block holds (uniform)
  int held_turn = 0;

  for (int u = 0; u < total; ++u) {
    const int stage = u & 1;
    const int h = hk * p.G + u % p.G, mt = t3 - 1 - u / p.G, m0 = mt * BM;
    const int bh = b * p.H + h;
    if (u + 1 < total) issue(u + 1, stage ^ 1);   // its buffers were last read before step u - 1's dQ barrier
    prim::cp_async_commit();
    prim::cp_async_wait<1>();                // step u's group (and K, V) landed
    prim::fence_proxy_async();               // ... visible to wgmma's async proxy (and K's zeros)
    prim::sync_block();
    if (held && tid == 0) prim::sem_release(held, held_turn + 1);   // the previous step's dQ adds are fenced
    held = nullptr;
    const uint32_t aQs = aQ + stage * Cfg::kQBytes, adOs = adO + stage * Cfg::kQBytes;
    const float* lse_s = s_lse + stage * BM;
    const float* delta_s = s_delta + stage * BM;

    prim::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      prim::wgmma_ss<BM, BF16, false>(st, TK::desc_k(aKw, kk), TQ::desc_k(aQs, kk), kk > 0);
    prim::wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      prim::wgmma_ss<BM, BF16, false>(dpt, TK::desc_k(aVw, kk), TQ::desc_k(adOs, kk), kk > 0);
    prim::wgmma_commit();
    prim::wgmma_wait<0>();
    keep_all(st);
    keep_all(dpt);

    const bool masked = KIND != kDense && (mt < sched.t1 || mt >= sched.t2);   // outside the full tiles [t1, t2)
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kj = key0 + 8 * (e >> 1);
        const int qr = 8 * j + 2 * t4 + (e & 1);
        const int i = m0 + qr;
        const bool ok = !masked || visible_kind<KIND == kCausal ? kCausal : kWindow>(p, nullptr, i, kj);
        const PdS r = p_and_ds<false>(p, st[j][e], dpt[j][e], 0.f, lse_s[qr], delta_s[qr], 0.f, bh, i, kj, ok);
        st[j][e] = r.pd;
        dpt[j][e] = r.ds;
        const int kr = kj - n0;
        sdS[TS::offset(qr, kr >> 3) + (kr & 7)] = prim::from_float<BF16>(r.ds);
      }
    uint32_t pa[BM / 16][4], dsa[BM / 16][4];     // P^T and dS^T as wgmma A fragments
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      acc_to_a<BF16>(pa[kk], st, kk);
      acc_to_a<BF16>(dsa[kk], dpt, kk);
    }
    prim::fence_proxy_async();               // this thread's dS stores visible to wgmma (after the barrier)
    prim::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) prim::wgmma_rs<HD, BF16, true>(dv, pa[kk], TQ::desc_mn(adOs, kk), true);
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) prim::wgmma_rs<HD, BF16, true>(dk, dsa[kk], TQ::desc_mn(aQs, kk), true);
    prim::wgmma_commit();

    // this key tile's place among the key tiles query tile mt sees: its turn to add into dQ
    int* sem = p.dq_sem + (int64_t(b) * p.H + h) * n_mt + mt;
    const int turn = nt - key_schedule(p, h, mt, BM, BN).t0;
    prim::wgmma_wait<0>();                   // dK, dV retired: this stage's Q and dO are read
    keep_all(dk);
    keep_all(dv);
    keep_all(pa);
    keep_all(dsa);
    if (tid == 0) prim::sem_wait(sem, turn);
    prim::sync_block();                      // dS is whole, the turn is ours

    prim::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < (kSplitKeys ? BN / 32 : BN / 16); ++kk)
      prim::wgmma_ss<NDQ, BF16, true>(dq, TS::desc_k(adS, kk0 + kk), TK::desc_mn(aKc, kk0 + kk), kk > 0);
    prim::wgmma_commit();
    prim::wgmma_wait<0>();
    keep_all(dq);
    if constexpr (kSplitKeys) {              // keys [0, 64) + keys [64, 128), in that order
      float* mine = s_dq + (tid & 127);      // element (j, e) at (4 j + e) * 128: conflict-free
      if (wg == 1)
#pragma unroll
        for (int j = 0; j < NQ; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) mine[(j * 4 + e) * 128] = dq[j][e];
      prim::sync_block();
      if (wg == 1) {                         // warpgroup 0 adds for both
        prim::fence_gpu();
        held = sem;
        held_turn = turn;
        continue;
      }
#pragma unroll
      for (int j = 0; j < NQ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[j][e] += mine[(j * 4 + e) * 128];
    }
    add_dq_fragment<NQ>(p, b, h, m0 + 16 * (warp & 3) + g, c0, t4, dq);
    prim::fence_gpu();                       // the adds are visible before the turn is passed on
    held = sem;
    held_turn = turn;
  }
  prim::cp_async_wait<0>();                  // K, V (and the empty last group)
  if (held) {
    prim::sync_block();
    if (tid == 0) prim::sem_release(held, held_turn + 1);
  }
  store_dkdv<NA, BF16>(p, dk, dv, b, hk, key0, 0);
#endif
}

namespace detail {

// Delta, the Hopper backward kernel (dK, dV, dQ's fp32 accumulator), then dq.
template <int HD, bool BF16, int KIND>
int bwd_sm90_kernel(const AttnParams& p, prim::stream_t stream) {
  using Cfg = BwdSm90Config<HD>;
  int err = delta<BF16>(p, stream);
  if (err) return err;
  if (p.Lk > 0) {
    err = launch(attn_bwd_sm90_kernel<HD, BF16, KIND>, cdiv(p.Lk, Cfg::BN) * unsigned(p.B * (p.H / p.G)), 1,
                 Cfg::kSmemBytes, stream, p, Cfg::kThreads);
    if (err) return err;
  }
  return launch(attn_dq_convert_kernel<BF16>, cdiv(p.dq_numel, 512), 1, 0, stream, p);
}

static_assert(BwdSm90Config<64>::BN == kBwdFusedKeyTile && BwdSm90Config<64>::BM == BwdFusedConfig<64>::BM,
              "the Hopper backward shares the fused kernel's tiles (mask kind, dq semaphores)");

template <int HD, bool BF16>
int bwd_sm90(const AttnParams& p, prim::stream_t stream) {
#if defined(EFFATTN_CUDA_EMU)
  emu_record::last_bwd = 90000 + HD * 10 + BF16;
#endif
  switch (mask_kind(p, kBwdFusedKeyTile)) {
    case kDense: return bwd_sm90_kernel<HD, BF16, kDense>(p, stream);
    case kCausal: return bwd_sm90_kernel<HD, BF16, kCausal>(p, stream);
    case kWindow: return bwd_sm90_kernel<HD, BF16, kWindow>(p, stream);
    default: return -1;
  }
}

}  // namespace detail
}  // namespace effattn
