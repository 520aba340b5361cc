// The fused backward (FlashAttention-2, Dao 2023, Alg. 2 in one kernel): dK, dV and dQ from five
// matrix products per (query tile, key tile) pair, where the two-pass kernels of bwd.cuh run seven
// (their dQ kernel recomputes S and dP).
//
// One block of 8 warps per (key tile of 128, b, kv head). Warp w owns keys [16w, 16w + 16). The block
// walks the G query heads of the group and, for each, the query tiles of 64 rows that see its keys
// (query_schedule; from the last down, see below), with Q, dO and the rows' lse / Delta double-buffered: the copies of step u + 1 are
// issued (cp.async) before step u's products, so they are in flight while the tensor cores work. Per step:
//   S^T = K Q^T, dP^T = V dO^T            (warp: 16 keys x 64 queries)
//   P^T, dS^T elementwise; dS to shared memory (query-major, bf16 / fp16)
//   dV += P^T dO, dK += dS^T Q            (warp: 16 keys x all columns, in registers for the whole block)
//   dQ_part = dS K                        (warp: 16 queries x half the columns)
// dQ_part is added to an fp32 accumulator (dq_accum, dq's shape) in a fixed order: the key tiles that
// a query tile sees add in key-tile order, kept by one semaphore per (b, h, query tile) (dq_sem): the
// block of key tile n waits until the semaphore holds n's place among them (n - t0 of the query tile's
// key_schedule), adds, fences, and passes the turn on at its next barrier. So every run sums the same
// fp32 values in the same order (bitwise reproducible) without per-key-tile buffers. A block waits only
// for blocks of lower index (same (b, kv head), lower key tile), which the GPU starts first.
// attn_dq_convert_kernel then writes dq = scale * dq_accum in the input dtype.
//
// Serves head-dim buckets 32, 64 and 128 without a block layout, bias tensors or the ALiBi slope
// gradient (attention_bwd_fused_serves); the two-pass kernels serve the rest. KIND (MaskKind, common.cuh:
// kDense, kCausal, kWindow, kAny; kLayout runs the two passes) and DROP compile out what an instance never
// sees (attention/inst/: one per mask kind and dropout flag).
#pragma once

#include "attention/bwd.cuh"

namespace effattn {

template <int HD>
struct BwdFusedConfig {
  static constexpr int BM = 64;              // query rows per step
  static constexpr int BN = 128;             // keys per block
  static constexpr int kThreads = 256;       // 8 warps of 16 keys
  static constexpr int kStages = 2;          // buffers of Q, dO, lse, Delta
  // K, V; Q and dO per stage; the dS tile; lse and Delta per stage
  static constexpr int kSmem = (2 * BN + 2 * kStages * BM) * HD * 2 + BM * BN * 2 + 2 * kStages * BM * 4;
};

// Adds a warp's dQ fragment (rows i0 and i0 + 8 of an m16 tile; NQ groups of 8 columns from c0, a thread's 2
// of each at 2 * t4) to the fp32 dq_accum: the fused backward's and the Hopper backward's dQ turn
template <int NQ>
EFFATTN_DEVICE void add_dq_fragment(const AttnParams& p, int b, int h, int i0, int c0, int t4, const float (&dq)[NQ][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i0 + 8 * r;
    if (i >= p.Lq) continue;
    float* row = p.dq_accum + q_row(p, b, h, i) * p.D;
#pragma unroll
    for (int j = 0; j < NQ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = c0 + 8 * j + 2 * t4 + e;
        if (c < p.D) prim::add_global(row + c, dq[j][2 * r + e]);
      }
  }
}

// The ordered hand-over of dq_accum between key tiles (the fused and the Hopper backward): query tile mt's
// semaphore (dq_sem, per (segment, head, query tile); n_mt tiles a head) counts the turns taken, and key tile
// nt's turn is its place among the key tiles mt sees (nt - t0 of mt's key_schedule). Per step: wait (thread 0
// spins until the turn is this block's; the caller's barrier after it makes it the block's), the adds, added
// (every thread fences its adds and holds the turn), then after the caller's next barrier pass_on (thread 0
// releases turn + 1: every thread's adds are fenced by then). finish passes a turn still held at the end.
struct DqTurn {
  int* sem = nullptr;                        // this step's semaphore and this block's turn on it
  int turn = 0;
  int* held = nullptr;                       // the semaphore whose turn this block holds (uniform)
  int held_turn = 0;
  EFFATTN_DEVICE void wait(const AttnParams& p, int seg, int h, int mt, int n_mt, int nt, int BM, int BN, int tid) {
    sem = p.dq_sem + (int64_t(seg) * p.H + h) * n_mt + mt;
    turn = nt - key_schedule(p, h, mt, BM, BN).t0;
    if (tid == 0) prim::sem_wait(sem, turn);
  }
  EFFATTN_DEVICE void added() {
    prim::fence_gpu();                       // the adds are visible before the turn is passed on
    held = sem;
    held_turn = turn;
  }
  EFFATTN_DEVICE void pass_on(int tid) {
    if (held && tid == 0) prim::sem_release(held, held_turn + 1);
    held = nullptr;
  }
  template <class Barrier>
  EFFATTN_DEVICE void finish(int tid, Barrier barrier) {
    if (held) {
      barrier();
      pass_on(tid);
    }
  }
};

template <int HD, bool BF16, int KIND = kAny, bool DROP = true>
EFFATTN_KERNEL_256 attn_bwd_fused_kernel(const AttnParams params) {
  using Cfg = BwdFusedConfig<HD>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, NT = Cfg::kThreads;
  constexpr int NS = BM / 8;                 // 8-wide query subtiles of a warp's S^T
  constexpr int NA = HD / 8;                 // 8-wide column subtiles of dK / dV
  constexpr int NQ = HD / 16;                // ... of a warp's half of dQ
  using KT = Tile<HD>;
  EFFATTN_SMEM(smem);
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sV = sK + BN * HD;
  uint16_t* sQ = sV + BN * HD;               // [stage][BM rows]
  uint16_t* sdO = sQ + Cfg::kStages * BM * HD;
  uint16_t* sdS = sdO + Cfg::kStages * BM * HD;   // [query row][key], swizzled as a Tile<BN>
  float* s_lse = reinterpret_cast<float*>(sdS + BM * BN);
  float* s_delta = s_lse + Cfg::kStages * BM;

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  GridTile gt = grid_tile((params.Lk + BN - 1) / BN, params.H / params.G);
  const int seg = gt.b;                      // batch entry or segment: the semaphores' index
  const AttnParams p = segment_view(params, gt);
  const int nt = gt.t, b = gt.b, hk = gt.h;
  const int n0 = nt * BN;
  if (n0 >= p.Lk) return;                    // packed: past the segment's keys (uniform)
  const int n_mt = (params.Lq + BM - 1) / BM;
  const int kd = (p.D + 15) / 16, kdv = (p.Dv + 15) / 16;
  const uint8_t* kpm = KIND == kAny && p.kpm ? p.kpm + b * p.kpm_b : nullptr;

  load_tile<HD, BN, KT, NT>(sK, static_cast<const uint16_t*>(p.k) + b * p.k_b + hk * p.k_h + p.k0 * p.k_l, p.k_l, n0,
                            p.Lk, p.D);
  load_tile<HD, BN, KT, NT>(sV, static_cast<const uint16_t*>(p.v) + b * p.v_b + hk * p.v_h + p.k0 * p.v_l, p.v_l, n0,
                            p.Lk, p.Dv);
  prim::cp_async_commit();

  // No layout: every head of the group visits the same query tiles, [t0, t3) (analytic). Step u is tile
  // t3 - 1 - u / G of head hk G + u % G: tiles from the last down, the group's heads inside each, so the
  // block of key tile n - 1 reaches each (tile, head) it shares with this block no later than this block
  // (its last tile is at most this block's; causal: 2 tiles lower) and the dQ turns seldom wait. (Tiles
  // in ascending order, or heads outside, would make the causal block n wait about 2n steps.)
  const Schedule sched = query_schedule(p, nullptr, hk * p.G, nt, BM, BN);
  const int count = sched.count(), total = p.G * count, t3 = sched.t0 + count;
  auto issue = [&](int u, int stage) {       // Q, dO (cp.async) and the row statistics of step u
    const int h = hk * p.G + u % p.G, m0 = (t3 - 1 - u / p.G) * BM;
    load_tile<HD, BM, KT, NT>(sQ + stage * BM * HD,
                              static_cast<const uint16_t*>(p.q) + b * p.q_b + h * p.q_h + p.q0 * p.q_l, p.q_l, m0,
                              p.Lq, p.D);
    load_tile<HD, BM, KT, NT>(sdO + stage * BM * HD,
                              static_cast<const uint16_t*>(p.dout) + b * p.do_b + h * p.do_h + p.q0 * p.do_l, p.do_l,
                              m0, p.Lq, p.Dv);
    load_row_stats<NT>(p, s_lse + stage * BM, s_delta + stage * BM, b, h, m0, BM);
  };
  if (total > 0) issue(0, 0);
  prim::cp_async_commit();
  // Keys no query row sees (padded, past the window of every row) may hold anything, NaN included: zero
  // their K rows, so that dQ = dS K adds 0 * 0 for them, never 0 * NaN (dS is 0 there, a select). Keys that
  // some row sees are finite or poison that row's output anyway. (V needs nothing: its products with a
  // masked key are selected away in p_and_ds; Q / dO rows past Lq land as zeros.) Step 0's copies stay
  // in flight behind K and V's.
  if (KIND != kDense && (kpm || p.left >= 0 || p.right >= 0)) {
    prim::cp_async_wait<1>();
    prim::sync_block();
    zero_unseen<HD, BN, KT, NT>(sK, n0, [&](int j) { return key_seen(p, nullptr, kpm, 0, p.Lq, j); });
  }                                          // the loop's first barrier orders the zeros before the reads

  float dk[NA][4], dv[NA][4];
  zero_acc(dk);
  zero_acc(dv);
  const int key0 = n0 + warp * 16 + g;       // this thread's keys: key0, key0 + 8
  const int r0 = 16 * (warp & 3), c0 = (warp >> 2) * (HD / 2);   // this warp's block of dQ
  DqTurn dqt;                                // dq_accum's turns

  for (int u = 0; u < total; ++u) {
    const int stage = u & 1;
    const int h = hk * p.G + u % p.G, mt = t3 - 1 - u / p.G, m0 = mt * BM;
    const int bh = b * p.H + h;
    if (u + 1 < total) issue(u + 1, stage ^ 1);   // its buffers were last read before step u - 1's dQ barrier
    prim::cp_async_commit();
    prim::cp_async_wait<1>();                // step u's group (and K, V) landed
    prim::sync_block();
    dqt.pass_on(tid);                        // the previous step's dQ adds are done and fenced by every thread
    const uint16_t* q_s = sQ + stage * BM * HD;
    const uint16_t* do_s = sdO + stage * BM * HD;
    const float* lse_s = s_lse + stage * BM;
    const float* delta_s = s_delta + stage * BM;

    // S^T = K Q^T for this warp's 16 keys and the 64 queries, then dP^T = V dO^T a half (32 queries) at
    // a time: each half's P^T (dropout applied) and dS^T go straight into the bf16 / fp16 A operands of
    // dV += P^T dO and dK += dS^T Q, one 16-query step of both products after the other (fewer values live
    // next to the dK / dV accumulators: with the whole dP^T in fp32, or both halves' A operands held for the
    // products after the loop, ptxas spilled at head dim 128)
    float st[NS][4];
    zero_acc(st);
    mma_rows_rows<HD, BM, BF16>(st, sK, warp * 16, q_s, kd);
    const bool masked = KIND != kDense && (mt < sched.t1 || mt >= sched.t2);   // outside the full tiles [t1, t2)
    const float slope = alibi_slope(p, b, h);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float dpt[NS / 2][4];
      zero_acc(dpt);
      mma_rows_rows<HD, BM / 2, BF16>(dpt, sV, warp * 16, do_s + half * (BM / 2) * HD, kdv);
#pragma unroll
      for (int jj = 0; jj < NS / 2; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = half * (NS / 2) + jj;
          const int kj = key0 + 8 * (e >> 1);
          const int qr = 8 * j + 2 * t4 + (e & 1);
          const int i = m0 + qr;
          bool ok = !masked || visible_kind<KIND == kCausal ? kCausal : kWindow>(p, nullptr, i, kj);
          if (kpm && (kj >= p.Lk || kpm[kj * p.kpm_l])) ok = false;
          const PdS r = p_and_ds<DROP>(p, st[j][e], dpt[jj][e], 0.f, lse_s[qr], delta_s[qr], slope, bh, i, kj, ok);
          st[j][e] = r.pd;
          dpt[jj][e] = r.ds;
          const int kr = kj - n0;
          sdS[Tile<BN>::offset(qr, kr >> 3) + (kr & 7)] = prim::from_float<BF16>(r.ds);
        }
#pragma unroll
      for (int k2 = 0; k2 < BM / 32; ++k2) {
        const int kk = half * (BM / 32) + k2;
        uint32_t a[4];
        acc_to_a<BF16>(a, st, kk);
        mma_a_rows<HD, NA, BF16>(dv, a, do_s, kk, 0, p.Dv);
        acc_to_a<BF16>(a, dpt, k2);
        mma_a_rows<HD, NA, BF16>(dk, a, q_s, kk, 0, p.D);
      }
    }

    dqt.wait(p, seg, h, mt, n_mt, nt, BM, BN, tid);
    prim::sync_block();                      // dS is whole, this stage's Q and dO are read, the turn is ours

    float dq[NQ][4];
    zero_acc(dq);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      prim::ldmatrix_x4(a, sdS + Tile<BN>::offset(r0 + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * kk + (lane >> 4)));
      mma_a_rows<HD, NQ, BF16>(dq, a, sK, kk, c0 / 8, p.D);
    }
    add_dq_fragment<NQ>(p, b, h, m0 + r0 + g, c0, t4, dq);
    dqt.added();
  }
  prim::cp_async_wait<0>();                  // K, V (and the empty last group)
  dqt.finish(tid, [] { prim::sync_block(); });

  store_dkdv<NA, BF16>(p, dk, dv, b, hk, key0, 0);
}

// dq = scale * dq_accum in the input dtype, 4 elements per thread.
template <bool BF16>
EFFATTN_KERNEL attn_dq_convert_kernel(const AttnParams p) {
  const int64_t i0 = (int64_t(prim::block_x()) * 128 + prim::thread_x()) * 4;
  uint16_t* dq = static_cast<uint16_t*>(p.dq);
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (i0 + e < p.dq_numel) dq[i0 + e] = prim::from_float<BF16>(p.dq_accum[i0 + e] * p.scale);
}

}  // namespace effattn
