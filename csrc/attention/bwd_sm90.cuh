// Hopper (sm_90a) backward: the fused backward of bwd_fused.cuh (five products per (query tile, key tile)
// pair, dQ added in key-tile order under a semaphore per query tile: DqTurn) with its products on warpgroup
// MMA, warp-specialized like the TMA forward (fwd_sm90_tma.cuh).
//
// One block = three warpgroups (384 threads) per (key tile of 128, b, kv head). Warpgroup 2 is the producer:
// its register count drops to kProducerRegs (setmaxnreg.dec), the consumers' rises to kConsumerRegs, and its
// first warp loads. Warpgroups 0 and 1 are the consumers: warpgroup w owns keys [64 w, 64 w + 64), warp
// 4 w + i keys [16 (4 w + i), + 16) in the m16n8 fragment layout, so the element code (p_and_ds) and the
// epilogue (store_dkdv) of the mma.sync kernel serve both. The block walks the query steps of bwd_fused.cuh
// (query_schedule: 64-row tiles from the last down, the group's heads inside each).
// Loads: K and V once (kv_full), then per step u Q and dO into stage s = u % kStages of a ring, all with
// TMA (64-column boxes of the forward's 4-D tensor maps, head_rows_map: wgmma's 128-byte swizzle, rows past
// L and columns past D or Dv land as zeros), issued by the producer warp's lane 0. The row statistics (lse
// and Delta, 2 x 64 floats a step) are the producer warp's plain loads (load_row_stats, a row per lane and
// step of 32) into the same stage: lse is stored transformed (log2 units, +inf for rows past Lq or that saw
// no key), which a bulk copy cannot do, and a copy of 512 bytes a step is no bandwidth. full[s] counts 32
// arrivals (lane 0's arrive.expect_tx of Q's and dO's bytes, the other lanes' arrive, each after its
// statistics' stores: the arrive's release orders them) plus the bytes; empty[s] counts the 256 consumer
// threads' arrivals after their dK / dV wgmmas (the last reads of the stage's Q and dO, after the
// statistics' reads) have retired. Use n = u / kStages of a stage: the consumers wait full's parity n % 2,
// the producer empty's (n - 1) % 2 (the first use passes at once).
// Per step, in the consumers (their block barriers are named barrier 1 over 256 threads):
//   S^T = K Q^T, dP^T = V dO^T      wgmma m64n64k16, both operands in shared memory (per warpgroup:
//                                   64 keys x 64 queries), two groups issued back to back
//   P^T, dS^T                       in registers (p_and_ds); dS also to shared memory, query-major (the
//                                   A operand of dQ), then fence.proxy.async
//   dV += P^T dO, dK += dS^T Q      wgmma m64nHDk16 with A from registers (P^T, dS^T repacked as 16-bit
//                                   A fragments), B = dO, Q read N-major; once retired, the stage goes back
//                                   to the producer (empty)
//   dQ_part = dS K                  wgmma, A = dS and B = K (N-major) in shared memory, after the barrier
//                                   that makes dS whole and the semaphore turn this block's; head dim 128:
//                                   m64n64k16 per warpgroup on columns [64 w, 64 w + 64); head dim 64:
//                                   m64n64k16 per warpgroup on its own 64 keys, the two partials added in
//                                   shared memory (warpgroup 0 + warpgroup 1)
// dQ_part goes to the fp32 dq_accum exactly as in bwd_fused.cuh (the same BM, BN, schedules and
// semaphores: bitwise reproducible), and attn_dq_convert_kernel writes dq.
//
// Serves mask kinds kDense, kCausal and kWindow without dropout, key padding, score terms or packed
// sequences, head-dim buckets 64 and 128 (attention_bwd_sm90_serves, bwd.cu); every other call runs the
// mma.sync kernels. Its device code exists only in the sm_90a part of a build (EFFATTN_SM90A).
#pragma once

#include "attention/bwd_launch.cuh"
#include "attention/fwd_sm90.cuh"
#include "attention/fwd_sm90_tma.cuh"

namespace effattn {

template <int HD>
struct BwdSm90Config {
  static constexpr int BM = 64;             // query rows per step (as bwd_fused.cuh: its semaphores)
  static constexpr int BN = 128;            // keys per block: 64 per warpgroup (wgmma's m64)
  static constexpr int kThreads = 384;      // consumers: warpgroups 0, 1; producer: warpgroup 2
  static constexpr int kConsumers = 256;
  static constexpr int kStages = 2;         // the ring of Q, dO, lse, Delta
  // 128 x 40 + 256 x 232 = 64512 <= 65536: the producer's loop (schedules, statistics' addresses) fits in 40
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  static constexpr int kKVBytes = BN * HD * 2, kQBytes = BM * HD * 2, kDSBytes = BM * BN * 2;
  // K, V; Q and dO per stage; dS; lse and Delta per stage; at head dim 64 warpgroup 1's dQ partial (fp32);
  // the slack to align the tiles to 1024 bytes (the 2 kStages + 1 mbarriers in it, as the TMA forward)
  static constexpr int kSmemBytes = 2 * kKVBytes + 2 * kStages * kQBytes + kDSBytes + 2 * kStages * BM * 4 +
                                    (HD == 64 ? BM * HD * 4 : 0) + 1024;
  static_assert((2 * kStages + 1) * 8 <= 64, "the mbarriers fit before the first 1024-byte boundary");
};

// The kernel's one parameter: the call and the tensor maps of Q, K, V and dO (__grid_constant__: TMA reads a
// map through its address).
struct BwdTmaParams {
  prim::TensorMap q, k, v, dout;
  AttnParams p;
};

template <int HD, bool BF16, int KIND>
EFFATTN_KERNEL_WG3 attn_bwd_sm90_kernel(const EFFATTN_GRID_CONSTANT BwdTmaParams tp) {
#if EFFATTN_SM90A
  using Cfg = BwdSm90Config<HD>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, NC = Cfg::kConsumers, S = Cfg::kStages;
  constexpr int NS = BM / 8;                 // 8-wide query subtiles of a warp's S^T
  constexpr int NA = HD / 8;                 // 8-wide column subtiles of dK / dV
  constexpr int NP = HD / kTmaBoxCols;       // 64-column boxes of a tile
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
  const uint32_t raw = prim::smem_u32(smem_raw);
  uint64_t* kv_full = reinterpret_cast<uint64_t*>(smem_raw);
  uint64_t* full = kv_full + 1;              // full[s], empty[s]: the ring's stage s
  uint64_t* empty = full + S;
  char* smem = smem_raw + (((raw + 64 + 1023) & ~1023u) - raw);
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sV = sK + BN * HD;
  uint16_t* sQ = sV + BN * HD;               // [stage][BM rows]
  uint16_t* sdO = sQ + S * BM * HD;
  uint16_t* sdS = sdO + S * BM * HD;
  float* s_lse = reinterpret_cast<float*>(sdS + BM * BN);
  float* s_delta = s_lse + S * BM;
  float* s_dq = s_delta + S * BM;            // head dim 64: warpgroup 1's dQ partial (fragment order)

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  // not packed (the binding refuses cu_seqlens here): the params as they are
  const AttnParams& p = tp.p;
  const GridTile gt = grid_tile((p.Lk + BN - 1) / BN, p.H / p.G);
  const int nt = gt.t, b = gt.b, hk = gt.h;
  const int n0 = nt * BN;
  const int n_mt = (p.Lq + BM - 1) / BM;
  // the query steps of bwd_fused.cuh: step u is tile t3 - 1 - u / G of head hk G + u % G
  const Schedule sched = query_schedule(p, nullptr, hk * p.G, nt, BM, BN);
  const int count = sched.count(), total = p.G * count, t3 = sched.t0 + count;

  if (tid == 0) {
    prim::mbar_init(kv_full, 1);
    for (int s = 0; s < S; ++s) {
      prim::mbar_init(full + s, 32);
      prim::mbar_init(empty + s, NC);
    }
    prim::fence_mbar_init();
  }
  prim::sync_block();

  if (tid >= NC) {                           // the producer warpgroup: its first warp loads
    prim::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (warp != NC / 32) return;
    if (lane == 0) {
      prim::mbar_arrive_expect_tx(kv_full, 2 * Cfg::kKVBytes);
#pragma unroll
      for (int c = 0; c < NP; ++c) {
        prim::tma_load_4d(sK + c * BN * kTmaBoxCols, &tp.k, kv_full, kTmaBoxCols * c, n0, hk, b);
        prim::tma_load_4d(sV + c * BN * kTmaBoxCols, &tp.v, kv_full, kTmaBoxCols * c, n0, hk, b);
      }
    }
    for (int u = 0; u < total; ++u) {
      const int s = u % S, h = hk * p.G + u % p.G, m0 = (t3 - 1 - u / p.G) * BM;
      prim::mbar_wait(empty + s, ((u / S) & 1) ^ 1);   // the stage's previous use has retired
      load_row_stats<32>(p, s_lse + s * BM, s_delta + s * BM, b, h, m0, BM, lane);
      if (lane == 0) {
        prim::mbar_arrive_expect_tx(full + s, 2 * Cfg::kQBytes);
#pragma unroll
        for (int c = 0; c < NP; ++c) {
          prim::tma_load_4d(sQ + s * BM * HD + c * BM * kTmaBoxCols, &tp.q, full + s, kTmaBoxCols * c, m0, h, b);
          prim::tma_load_4d(sdO + s * BM * HD + c * BM * kTmaBoxCols, &tp.dout, full + s, kTmaBoxCols * c, m0, h, b);
        }
      } else {
        prim::mbar_arrive(full + s);
      }
    }
    return;
  }

  // the consumers
  prim::setmaxnreg_inc<Cfg::kConsumerRegs>();
  auto consumers_sync = [] { prim::named_sync(1, NC); };
  const int g = lane >> 2, t4 = lane & 3;
  // this warpgroup's 64 keys: 64 rows of 128 bytes into each panel of K and V (a multiple of 1024 bytes)
  const uint32_t aK = prim::smem_u32(sK), aV = prim::smem_u32(sV), aKw = aK + wg * 64 * 128, aVw = aV + wg * 64 * 128;
  const uint32_t aQ = prim::smem_u32(sQ), adO = prim::smem_u32(sdO), adS = prim::smem_u32(sdS);
  const int c0 = kSplitKeys ? 0 : wg * NDQ;  // this warpgroup's columns of dQ: its K panel
  const uint32_t aKc = aK + (c0 / 64) * TK::kPanelBytes;
  const int kk0 = kSplitKeys ? wg * (BN / 32) : 0;   // ... and its 16-key steps of the reduction
  prim::mbar_wait(kv_full, 0);
  // Keys no query row sees (past the window of every row) may hold anything, NaN included: zero their K
  // rows, so that dQ = dS K adds 0 * 0 for them (as bwd_fused.cuh; rows past Lk land as zeros). Each thread
  // fences its zeros for wgmma's async proxy at once (S^T = K Q^T reads K next; it may see a row old or zeroed,
  // the row's scores are masked by selects either way), and the first step's barrier before dQ publishes them.
  if (KIND != kDense && (p.left >= 0 || p.right >= 0)) {
    zero_unseen<HD, BN, TK, NC>(sK, n0, [&](int j) { return key_seen(p, nullptr, nullptr, 0, p.Lq, j); });
    prim::fence_proxy_async();
  }

  float dk[NA][4], dv[NA][4], st[NS][4], dpt[NS][4], dq[NQ][4];
  zero_acc(dk);
  zero_acc(dv);
  zero_acc(st);
  zero_acc(dpt);
  zero_acc(dq);
  const int key0 = n0 + warp * 16 + g;       // this thread's keys: key0, key0 + 8
  DqTurn dqt;                                // dq_accum's turns

  for (int u = 0; u < total; ++u) {
    const int stage = u % S;
    const int h = hk * p.G + u % p.G, mt = t3 - 1 - u / p.G, m0 = mt * BM;
    const int bh = b * p.H + h;
    prim::mbar_wait(full + stage, (u / S) & 1);   // step u's Q, dO, lse, Delta have landed
    consumers_sync();                        // the previous step's dQ (dS read, adds fenced) done by all
    dqt.pass_on(tid);
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
        prim::st_shared(sdS + TS::offset(qr, kr >> 3) + (kr & 7), prim::from_float<BF16>(r.ds));
      }
    uint32_t pa[BM / 16][4], dsa[BM / 16][4];     // P^T and dS^T as wgmma A fragments
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      acc_to_a<BF16>(pa[kk], st, kk);
      acc_to_a<BF16>(dsa[kk], dpt, kk);
    }
    prim::fence_proxy_async();               // this thread's dS stores visible to wgmma
    prim::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) prim::wgmma_rs<HD, BF16, true>(dv, pa[kk], TQ::desc_mn(adOs, kk), true);
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) prim::wgmma_rs<HD, BF16, true>(dk, dsa[kk], TQ::desc_mn(aQs, kk), true);
    prim::wgmma_commit();

    prim::wgmma_wait<0>();                   // dK, dV retired: this stage's Q, dO (and lse, Delta) are read
    keep_all(dk);
    keep_all(dv);
    keep_all(pa);
    keep_all(dsa);
    prim::mbar_arrive(empty + stage);        // ... the stage goes back to the producer
    dqt.wait(p, b, h, mt, n_mt, nt, BM, BN, tid);
    consumers_sync();                        // dS is whole, the turn is ours

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
      consumers_sync();
      if (wg == 1) {                         // warpgroup 0 adds for both
        dqt.added();
        continue;
      }
#pragma unroll
      for (int j = 0; j < NQ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[j][e] += mine[(j * 4 + e) * 128];
    }
    add_dq_fragment<NQ>(p, b, h, m0 + 16 * (warp & 3) + g, c0, t4, dq);
    dqt.added();
  }
  dqt.finish(tid, consumers_sync);
  store_dkdv<NA, BF16>(p, dk, dv, b, hk, key0, 0);
#endif
}

namespace detail {

// Delta, the Hopper backward kernel (dK, dV, dQ's fp32 accumulator), then dq.
// The tensor maps of the call (the binding's row alignment makes them encode: -3 if one does not).
template <int HD, bool BF16, int KIND>
int bwd_sm90_kernel(const AttnParams& p, prim::stream_t stream) {
  using Cfg = BwdSm90Config<HD>;
  int err = delta<BF16>(p, stream);
  if (err) return err;
  if (p.Lk > 0) {
    BwdTmaParams tp;
    tp.p = p;
    const int hkv = p.H / p.G;
    if (!head_rows_map(tp.q, p.q, p.q_l, p.q_h, p.q_b, p.q0, p.D, p.Lq, p.H, p.B, Cfg::BM) ||
        !head_rows_map(tp.dout, p.dout, p.do_l, p.do_h, p.do_b, p.q0, p.Dv, p.Lq, p.H, p.B, Cfg::BM) ||
        !head_rows_map(tp.k, p.k, p.k_l, p.k_h, p.k_b, p.k0, p.D, p.Lk, hkv, p.B, Cfg::BN) ||
        !head_rows_map(tp.v, p.v, p.v_l, p.v_h, p.v_b, p.k0, p.Dv, p.Lk, hkv, p.B, Cfg::BN))
      return -3;
    err = launch(attn_bwd_sm90_kernel<HD, BF16, KIND>, cdiv(p.Lk, Cfg::BN) * unsigned(p.B * (p.H / p.G)), 1,
                 Cfg::kSmemBytes, stream, tp, Cfg::kThreads);
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
