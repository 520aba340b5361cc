// Backward kernels of attention with relative keys (effattn.bias.RelativeKeys; attention.h: relk). The
// scores are S_ij = scale (q_i . k_j + u_i . r[h, idx(d)]), d = pos(i) - j, u the term's query (q itself
// when relkq is null). With dT = P (dP - Delta) (FlashAttention-2 Alg. 2; Delta from attn_delta_kernel):
//   dq_i = scale sum_j dT_ij k_j,   du_i = scale sum_j dT_ij r[idx(d_ij)]   (added to dq when u = q),
//   dk_j = scale sum_i dT_ij q_i,   dv_j = sum_i P_ij dO_i,
//   gd[h, d] = scale sum_{b, i} dT[i, pos(i) - d] u_i   (per distance; the binding's caller folds the
//   distances onto the rows of r: the clamped ends take the sums of theirs).
// Three passes, each gradient element written by one block (no atomics: deterministic):
// 1. relk_dq_kernel, one block per (query tile of 64, b, h[, column block]): recomputes S with relk_add
//    (fwd.cuh: the band of r per tile pair, one product per tile, the relative shift in the tile), then
//    dq += dT K and du += G R_band, G = dT written skewed into each warp's band columns (the shift undone).
// 2. relk_dkdv_kernel, one block per (key tile of 64, b, kv head[, column block]): per query tile the
//    term's tile U R_band^T (read skewed, as in the forward) joins S^T = K Q^T; dV += P^T dO, dK += dS^T Q.
// 3. relk_dr_kernel, the distance-band pass, one block per (block of 64 distances, h[, column block]):
//    over the batch and the query tiles in a fixed order, the keys j = pos(i) - d of a query tile and a
//    block of distances form a band of BM + BD - 1 rows; Q K_band^T and dO V_band^T read skewed give S and
//    dP at (i, pos(i) - d), U R_blk^T the term; gd += dT^T U.
// Head-dim buckets 32, 64 and 128 (at 256 the tiles and the band do not fit the shared memory of a block).
#pragma once

#include "attention/bwd.cuh"
#include "attention/fwd.cuh"

namespace effattn {

template <int HD>
struct RelkBwdConfig {
  static constexpr int BM = 64;                         // query rows (dQ and distance passes)
  static constexpr int BN = 64;                         // keys per dQ step, distances per distance block
  static constexpr int WB = 16 + BN;                    // band rows one warp's 16 query rows read
  static constexpr int ACC = HD >= 128 ? 64 : HD;       // gradient columns one block accumulates (blockIdx.z)
  static constexpr int kSplit = HD / ACC;
  static constexpr int BM_KV = HD >= 128 ? 32 : 64;     // query rows per step of the dK/dV loop
  static constexpr int kWarpsKV = BM_KV / 16;           // warps that form the term's tile there
  // dQ: Q, dO, U (BM rows), K, V (BN), the band of r (BM + BN); each warp's fp32 products
  static constexpr int kDqSmem = (3 * BM + 2 * BN + BM + BN) * HD * 2 + 4 * 16 * WB * 4;
  // dK/dV: K, V (BN), Q, dO, U (BM_KV), the band (BM_KV + BN), the term's products, the rows' lse and Delta
  static constexpr int kDkdvSmem = (2 * BN + 3 * BM_KV + BM_KV + BN) * HD * 2 + kWarpsKV * 16 * WB * 4 + 2 * BM_KV * 4;
  // distances: Q, dO, U (BM), the key / value band (BM + BN), r's rows of the block (BN), the products (also dT)
  static constexpr int kDrSmem = (3 * BM + BM + BN + BN) * HD * 2 + 4 * 16 * WB * 4;
  static_assert(BM * BN <= 4 * 16 * WB, "dT of a distance block fits the products' space");
};

// The A operand of reduction step kk from an fp32 matrix in shared memory: element (row, col) of the
// 16 x 16 block at `at(row, 16 kk + col)` (the accumulator layout acc_to_a reads).
template <bool BF16, class At>
EFFATTN_DEVICE void smem_to_a(uint32_t (&a)[4], const At& at, int kk) {
  const int lane = prim::thread_x() & 31, g = lane >> 2, c = 16 * kk + 2 * (lane & 3);
  a[0] = prim::pack2<BF16>(at(g, c), at(g, c + 1));
  a[1] = prim::pack2<BF16>(at(g + 8, c), at(g + 8, c + 1));
  a[2] = prim::pack2<BF16>(at(g, c + 8), at(g, c + 9));
  a[3] = prim::pack2<BF16>(at(g + 8, c + 8), at(g + 8, c + 9));
}

// Rows [r0, r0 + ROWS) of an (L, width) strided matrix into a swizzled tile, rows outside [0, L) zero
// (r0 may be negative: a band of keys). All 128 threads.
template <int HD, int ROWS>
EFFATTN_DEVICE void load_band(uint16_t* tile, const uint16_t* base, int64_t ld, int r0, int L, int width) {
  constexpr int C = HD / 8;
  for (int idx = prim::thread_x(); idx < ROWS * C; idx += 128) {
    const int r = idx / C, c = idx % C, gr = r0 + r;
    const bool ok = gr >= 0 && gr < L && c * 8 < width;
    prim::cp_async_16(tile + Tile<HD>::offset(r, c), ok ? base + int64_t(gr) * ld + c * 8 : base, ok ? 16 : 0);
  }
}

// Whether query i sees key j (window, lengths, key padding; no layouts with relative keys).
EFFATTN_DEVICE bool relk_visible(const AttnParams& p, const uint8_t* kpm, int i, int j) {
  return j >= 0 && visible<false>(p, nullptr, i, j) && !(kpm && kpm[int64_t(j) * p.kpm_l]);
}

// The saved lse (log2 units; +inf for rows past Lq or that saw no key, so that P = 0 there) and Delta of
// this thread's query rows row0 and row0 + 8.
EFFATTN_DEVICE void rows_lse_delta(const AttnParams& p, int b, int h, int row0, float (&lse2)[2], float (&dlt)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    lse2[r] = INFINITY;
    dlt[r] = 0.f;
    if (i < p.Lq) {
      const float l = p.lse[q_row(p, b, h, i)];
      lse2[r] = l == -INFINITY ? INFINITY : l * 1.4426950408889634f;
      dlt[r] = p.delta[q_row(p, b, h, i)];
    }
  }
}

template <int HD, bool BF16>
EFFATTN_KERNEL_1 relk_dq_kernel(const AttnParams params) {
  using Cfg = RelkBwdConfig<HD>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, WB = Cfg::WB, ACC = Cfg::ACC;
  constexpr int NS = BN / 8, NA = ACC / 8;
  EFFATTN_SMEM(smem);
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sdO = sQ + BM * HD;
  uint16_t* sU = sdO + BM * HD;
  uint16_t* sK = sU + BM * HD;
  uint16_t* sV = sK + BN * HD;
  uint16_t* sR = sV + BN * HD;
  float* sPR = reinterpret_cast<float*>(sR + (BM + BN) * HD);

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  GridTile gt = grid_tile((params.Lq + BM - 1) / BM, params.H);
  const AttnParams& p = params;
  const int mt = gt.t, b = gt.b, h = gt.h, hk = h / p.G;
  const int m0 = mt * BM;
  const int c0 = int(prim::block_z()) * ACC;
  const int kd = (p.D + 15) / 16, kdv = (p.Dv + 15) / 16;
  const uint16_t* kb = static_cast<const uint16_t*>(p.k) + b * p.k_b + hk * p.k_h;
  const uint16_t* vb = static_cast<const uint16_t*>(p.v) + b * p.v_b + hk * p.v_h;
  const uint8_t* kpm = p.kpm ? p.kpm + b * p.kpm_b : nullptr;

  load_tile<HD, BM>(sQ, static_cast<const uint16_t*>(p.q) + b * p.q_b + h * p.q_h, p.q_l, m0, p.Lq, p.D);
  load_tile<HD, BM>(sdO, static_cast<const uint16_t*>(p.dout) + b * p.do_b + h * p.do_h, p.do_l, m0, p.Lq, p.Dv);
  if (p.relkq)
    load_tile<HD, BM>(sU, static_cast<const uint16_t*>(p.relkq) + b * p.relkq_b + h * p.relkq_h, p.relkq_l, m0, p.Lq,
                      p.D);
  prim::cp_async_commit();
  const uint16_t* sQt = p.relkq ? sU : sQ;

  const int row0 = m0 + warp * 16 + g;
  float lse2[2], dlt[2];
  rows_lse_delta(p, b, h, row0, lse2, dlt);
  float dq[NA][4], du[NA][4];
#pragma unroll
  for (int j = 0; j < NA; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[j][e] = du[j][e] = 0.f;
  float* w = sPR + warp * 16 * WB;                      // this warp's products, then its skewed dT

  const Schedule sched = key_schedule(p, h, mt, BM, BN);
  for (int it = 0; it < sched.count(); ++it) {
    const int n0 = sched.tile(it) * BN;
    load_tile<HD, BN>(sK, kb, p.k_l, n0, p.Lk, p.D);
    load_tile<HD, BN>(sV, vb, p.v_l, n0, p.Lk, p.Dv);
    prim::cp_async_commit();
    prim::cp_async_wait<0>();
    prim::sync_block();

    float s[NS][4], dp[NS][4];
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
    mma_rows_rows<HD, BN, BF16>(s, sQ, warp * 16, sK, kd);
    mma_rows_rows<HD, BN, BF16>(dp, sdO, warp * 16, sV, kdv);
    relk_add<HD, BM, BN, BF16>(p, h, m0, n0, sR, sQt, sPR, kd, s);   // (its barriers: sK read by every warp)
    const bool masked = sched.masked(it);
    if (masked || kpm) {                                 // keys no row sees: zero K rows for dT K
      zero_unseen<HD, BN>(sK, n0, [&](int j) { return key_seen(p, nullptr, kpm, m0, m0 + BM, j); });
      prim::sync_block();
    }
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int i = row0 + 8 * r, kj = n0 + 8 * j + 2 * t4 + (e & 1);
        const bool ok = (!masked || visible<false>(p, nullptr, i, kj)) && !(kpm && (kj >= p.Lk || kpm[kj * p.kpm_l]));
        const float pr = ok ? prim::exp2(s[j][e] * p.qk_scale - lse2[r]) : 0.f;
        s[j][e] = ok ? pr * (dp[j][e] - dlt[r]) : 0.f;   // dT (an ignored V row's NaN: 0, not 0 * NaN)
      }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {               // dq += dT K over columns [c0, c0 + ACC)
      uint32_t a[4];
      acc_to_a<BF16>(a, s, kk);
      mma_a_rows<HD, NA, BF16>(dq, a, sK, kk, c0 / 8, p.D);
    }
    // G: element (ri, jl) of dT at column ri + BN - 1 - jl of the warp's band (zeros elsewhere)
    prim::sync_block();                                  // every thread has read its block in relk_add
    for (int idx = lane; idx < 16 * WB; idx += 32) w[idx] = 0.f;
    prim::sync_block();
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ri = g + 8 * (e >> 1), jl = 8 * j + 2 * t4 + (e & 1);
        w[ri * WB + ri + BN - 1 - jl] = s[j][e];
      }
    prim::sync_block();
#pragma unroll
    for (int kk = 0; kk < WB / 16; ++kk) {               // du += G R_band (band rows [16 warp, 16 warp + WB))
      uint32_t a[4];
      smem_to_a<BF16>(a, [&](int rr, int cc) { return w[rr * WB + cc]; }, kk);
      if (p.relkq) mma_a_rows<HD, NA, BF16>(du, a, sR + warp * 16 * HD, kk, c0 / 8, p.D);
      else mma_a_rows<HD, NA, BF16>(dq, a, sR + warp * 16 * HD, kk, c0 / 8, p.D);
    }
    prim::sync_block();                                  // every warp is done with sK, sV, sR, its block
  }
  prim::cp_async_wait<0>();

  uint16_t* dqb = static_cast<uint16_t*>(p.dq) + q_row(p, b, h, 0) * p.D;
  uint16_t* dub = p.relkq ? static_cast<uint16_t*>(p.drelkq) + q_row(p, b, h, 0) * p.D : nullptr;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    if (i >= p.Lq) continue;
#pragma unroll
    for (int j = 0; j < NA; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = c0 + 8 * j + 2 * t4 + e;
        if (c >= p.D) continue;
        dqb[int64_t(i) * p.D + c] = prim::from_float<BF16>(dq[j][2 * r + e] * p.scale);
        if (dub) dub[int64_t(i) * p.D + c] = prim::from_float<BF16>(du[j][2 * r + e] * p.scale);
      }
  }
}

template <int HD, bool BF16>
EFFATTN_KERNEL_1 relk_dkdv_kernel(const AttnParams params) {
  using Cfg = RelkBwdConfig<HD>;
  constexpr int BM = Cfg::BM_KV, BN = Cfg::BN, WB = Cfg::WB, ACC = Cfg::ACC;
  constexpr int NS = BM / 8, NA = ACC / 8;
  EFFATTN_SMEM(smem);
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sV = sK + BN * HD;
  uint16_t* sQ = sV + BN * HD;
  uint16_t* sdO = sQ + BM * HD;
  uint16_t* sU = sdO + BM * HD;
  uint16_t* sR = sU + BM * HD;
  float* sPR = reinterpret_cast<float*>(sR + (BM + BN) * HD);
  float* s_lse = sPR + Cfg::kWarpsKV * 16 * WB;
  float* s_delta = s_lse + BM;

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  GridTile gt = grid_tile((params.Lk + BN - 1) / BN, params.H / params.G);
  const AttnParams& p = params;
  const int nt = gt.t, b = gt.b, hk = gt.h;
  const int n0 = nt * BN;
  const int c0 = int(prim::block_z()) * ACC;
  const int kd = (p.D + 15) / 16, kdv = (p.Dv + 15) / 16;
  const uint8_t* kpm = p.kpm ? p.kpm + b * p.kpm_b : nullptr;

  load_tile<HD, BN>(sK, static_cast<const uint16_t*>(p.k) + b * p.k_b + hk * p.k_h, p.k_l, n0, p.Lk, p.D);
  load_tile<HD, BN>(sV, static_cast<const uint16_t*>(p.v) + b * p.v_b + hk * p.v_h, p.v_l, n0, p.Lk, p.Dv);
  prim::cp_async_commit();

  float dk[NA][4], dv[NA][4];
#pragma unroll
  for (int j = 0; j < NA; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
  const int key0 = n0 + warp * 16 + g;                  // this thread's keys: key0, key0 + 8

  for (int h = hk * p.G; h < (hk + 1) * p.G; ++h) {
    const uint16_t* qb = static_cast<const uint16_t*>(p.q) + b * p.q_b + h * p.q_h;
    const uint16_t* dob = static_cast<const uint16_t*>(p.dout) + b * p.do_b + h * p.do_h;
    const uint16_t* ub = p.relkq ? static_cast<const uint16_t*>(p.relkq) + b * p.relkq_b + h * p.relkq_h : nullptr;
    const uint16_t* sQt = ub ? sU : sQ;
    const Schedule sched = query_schedule(p, nullptr, h, nt, BM, BN);
    for (int it = 0; it < sched.count(); ++it) {
      const int m0 = sched.tile(it) * BM;
      load_tile<HD, BM>(sQ, qb, p.q_l, m0, p.Lq, p.D);
      load_tile<HD, BM>(sdO, dob, p.do_l, m0, p.Lq, p.Dv);
      if (ub) load_tile<HD, BM>(sU, ub, p.relkq_l, m0, p.Lq, p.D);
      load_relk_rows<HD, BM + BN>(sR, p, h, m0 + p.off - (n0 + BN - 1));
      prim::cp_async_commit();
      load_row_stats(p, s_lse, s_delta, b, h, m0, BM);
      prim::cp_async_wait<0>();
      prim::sync_block();

      // the term's tile: warp w < kWarpsKV multiplies query rows [16 w, 16 w + 16) with band rows [16 w, 16 w + WB)
      if (warp < Cfg::kWarpsKV) {
        float pr[WB / 8][4];
        warp_band_product<HD, WB, BF16>(pr, sQt, sR, kd);
        store_acc<WB>(sPR + warp * 16 * WB, pr);
      }

      float st[NS][4], dpt[NS][4];
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
      mma_rows_rows<HD, BM, BF16>(st, sK, warp * 16, sQ, kd);
      mma_rows_rows<HD, BM, BF16>(dpt, sV, warp * 16, sdO, kdv);
      prim::sync_block();                                // the term's tile has landed

      const bool masked = sched.masked(it);
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kj = key0 + 8 * (e >> 1), kr = kj - n0;
          const int qr = 8 * j + 2 * t4 + (e & 1);      // query row within the tile
          const int i = m0 + qr;
          const bool ok = (!masked || visible<false>(p, nullptr, i, kj)) &&
                          !(kpm && (kj >= p.Lk || kpm[kj * p.kpm_l]));
          const float term = sPR[(qr >> 4) * 16 * WB + (qr & 15) * WB + (qr & 15) + BN - 1 - kr];
          const float pt = ok ? prim::exp2((st[j][e] + term) * p.qk_scale - s_lse[qr]) : 0.f;
          st[j][e] = pt;
          dpt[j][e] = ok ? pt * (dpt[j][e] - s_delta[qr]) : 0.f;   // dS^T (an ignored V row's NaN: 0)
        }
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {             // dV += P^T dO, dK += dS^T Q over [c0, c0 + ACC)
        uint32_t ap[4], as[4];
        acc_to_a<BF16>(ap, st, kk);
        acc_to_a<BF16>(as, dpt, kk);
        mma_a_rows<HD, NA, BF16>(dv, ap, sdO, kk, c0 / 8, p.Dv);
        mma_a_rows<HD, NA, BF16>(dk, as, sQ, kk, c0 / 8, p.D);
      }
      prim::sync_block();                                // every warp is done with the tiles and stats
    }
  }
  prim::cp_async_wait<0>();                              // K, V when no query tile was visited

  uint16_t* dkb = static_cast<uint16_t*>(p.dk) + k_row(p, b, hk, 0) * p.D;
  uint16_t* dvb = static_cast<uint16_t*>(p.dv) + k_row(p, b, hk, 0) * p.Dv;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int kj = key0 + 8 * r;
    if (kj >= p.Lk) continue;
#pragma unroll
    for (int j = 0; j < NA; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = c0 + 8 * j + 2 * t4 + e;
        if (c < p.D) dkb[int64_t(kj) * p.D + c] = prim::from_float<BF16>(dk[j][2 * r + e] * p.scale);
        if (c < p.Dv) dvb[int64_t(kj) * p.Dv + c] = prim::from_float<BF16>(dv[j][2 * r + e]);
      }
  }
}

template <int HD, bool BF16>
EFFATTN_KERNEL_1 relk_dr_kernel(const AttnParams params) {
  using Cfg = RelkBwdConfig<HD>;
  constexpr int BM = Cfg::BM, BD = Cfg::BN, WB = Cfg::WB, ACC = Cfg::ACC;
  constexpr int NS = BD / 8, NA = ACC / 8;
  EFFATTN_SMEM(smem);
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sdO = sQ + BM * HD;
  uint16_t* sU = sdO + BM * HD;
  uint16_t* sB = sU + BM * HD;                          // the band of keys, then of values
  uint16_t* sRb = sB + (BM + BD) * HD;                  // r's rows of the block's distances
  float* sPR = reinterpret_cast<float*>(sRb + BD * HD); // the warps' products, then dT (BM x BD)

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const AttnParams& p = params;
  const int n_d = p.Lq + p.Lk - 1;                      // distances off - (Lk - 1) .. off + Lq - 1
  GridTile gt = grid_tile((n_d + BD - 1) / BD, p.H);
  const int h = gt.h, hk = h / p.G;
  const int d0 = p.off - (p.Lk - 1) + gt.t * BD;
  const int c0 = int(prim::block_z()) * ACC;
  const int kd = (p.D + 15) / 16, kdv = (p.Dv + 15) / 16;
  float* w = sPR + warp * 16 * WB;

  load_relk_rows<HD, BD>(sRb, p, h, d0);
  prim::cp_async_commit();
  float gd[NA][4];
#pragma unroll
  for (int j = 0; j < NA; ++j) gd[j][0] = gd[j][1] = gd[j][2] = gd[j][3] = 0.f;
  // a block of distances the window hides entirely (-right <= d <= left) has nothing to sum
  const bool hidden = (p.right >= 0 && d0 + BD - 1 < -p.right) || (p.left >= 0 && d0 > p.left);
  const int n_b = hidden ? 0 : p.B;
  for (int b = 0; b < n_b; ++b) {
    const uint16_t* kb = static_cast<const uint16_t*>(p.k) + b * p.k_b + hk * p.k_h;
    const uint16_t* vb = static_cast<const uint16_t*>(p.v) + b * p.v_b + hk * p.v_h;
    const uint8_t* kpm = p.kpm ? p.kpm + b * p.kpm_b : nullptr;
    for (int i0 = 0; i0 < p.Lq; i0 += BM) {
      const int jb0 = i0 + p.off - (d0 + BD - 1);       // key of band row u: jb0 + u, u < BM + BD - 1
      if (jb0 + BM + BD - 2 < 0 || jb0 >= p.Lk) continue;   // (uniform) no key of the band exists
      load_tile<HD, BM>(sQ, static_cast<const uint16_t*>(p.q) + b * p.q_b + h * p.q_h, p.q_l, i0, p.Lq, p.D);
      load_tile<HD, BM>(sdO, static_cast<const uint16_t*>(p.dout) + b * p.do_b + h * p.do_h, p.do_l, i0, p.Lq, p.Dv);
      if (p.relkq)
        load_tile<HD, BM>(sU, static_cast<const uint16_t*>(p.relkq) + b * p.relkq_b + h * p.relkq_h, p.relkq_l, i0,
                          p.Lq, p.D);
      load_band<HD, BM + BD>(sB, kb, p.k_l, jb0, p.Lk, p.D);
      prim::cp_async_commit();
      const uint16_t* sQt = p.relkq ? sU : sQ;
      const int row0 = i0 + warp * 16 + g;
      prim::cp_async_wait<0>();
      prim::sync_block();

      float s[NS][4], dp[NS][4];
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
      mma_rows_rows<HD, BD, BF16>(s, sQt, warp * 16, sRb, kd);   // the term u_i . r[idx(d)]
      {
        float pr[WB / 8][4];
        warp_band_product<HD, WB, BF16>(pr, sQ, sB, kd);
        skew_read<WB, BD - 1, NS>(w, pr, dp);           // q_i . k_{pos(i) - d}
      }
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] += dp[j][e];
      prim::sync_block();                                // every warp is done with the key band and its block
      load_band<HD, BM + BD>(sB, vb, p.v_l, jb0, p.Lk, p.Dv);
      prim::cp_async_commit();
      prim::cp_async_wait<0>();
      prim::sync_block();
      {
        float pr[WB / 8][4];
        warp_band_product<HD, WB, BF16>(pr, sdO, sB, kdv);
        skew_read<WB, BD - 1, NS>(w, pr, dp);           // dO_i . v_{pos(i) - d}
      }
      prim::sync_block();                                // every warp has read its block: dT replaces it
      float lse2[2], dlt[2];
      rows_lse_delta(p, b, h, row0, lse2, dlt);
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1, dl = 8 * j + 2 * t4 + (e & 1);
          const int i = row0 + 8 * r;
          const bool ok = relk_visible(p, kpm, i, i + p.off - (d0 + dl));
          const float pr = ok ? prim::exp2(s[j][e] * p.qk_scale - lse2[r]) : 0.f;
          sPR[(i - i0) * BD + dl] = ok ? pr * (dp[j][e] - dlt[r]) : 0.f;   // dT (NaN of an unseen key: 0)
        }
      prim::sync_block();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {             // gd (warp: distances [16 warp, +16)) += dT^T U
        uint32_t a[4];
        smem_to_a<BF16>(a, [&](int rr, int cc) { return sPR[cc * BD + warp * 16 + rr]; }, kk);
        mma_a_rows<HD, NA, BF16>(gd, a, sQt, kk, c0 / 8, p.D);
      }
      prim::sync_block();                                // every warp is done with the tiles and dT
    }
  }
  prim::cp_async_wait<0>();

  float* gdb = p.drelk_gd + int64_t(h) * n_d * p.D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int dl = warp * 16 + g + 8 * r, di = gt.t * BD + dl;
    if (di >= n_d) continue;
#pragma unroll
    for (int j = 0; j < NA; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = c0 + 8 * j + 2 * t4 + e;
        if (c < p.D) gdb[int64_t(di) * p.D + c] = gd[j][2 * r + e] * p.scale;
      }
  }
}

}  // namespace effattn
