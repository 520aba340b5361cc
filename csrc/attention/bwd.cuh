// Backward kernels: FlashAttention-2 (Dao 2023, Alg. 2) split in passes so that every gradient
// element is written by exactly one block (no atomics: deterministic).
//
// 1. attn_delta_kernel: Delta_i = rowsum(dO_i * O_i) - dlse_i (Alg. 2 line 4; a gradient into lse
//    enters dS as dlse * P, i.e. as -dlse in Delta).
// 2. attn_dkdv_kernel: one block per (key tile of 64, b, kv head[, column half]); warp w owns keys
//    [16w, 16w + 16). Loops over the G query heads of the group and their visible query tiles (of
//    64 rows, 32 from head dim 128 on, which keeps S^T and dP^T within the register budget):
//    S^T = K Q^T, P^T = exp(S^T - L), dP^T = V dO^T, dV += P^T dO, dK += dS^T Q (lines 11-16, with
//    keys as rows).
// 3. attn_dq_kernel: one block per (query tile of 64, b, h[, column half]), visiting the key tiles
//    of the forward's schedule: dQ += dS K.
// Head dim 256: a block accumulates half the columns of dK/dV (dQ), blockIdx.z picks the half, so
// the accumulators fit in registers; S and dP are computed by both halves.
#pragma once

#include "attention/common.cuh"

namespace effattn {

template <int HD>
struct BwdConfig {
  static constexpr int BM = 64;                         // query rows per tile (dQ)
  static constexpr int BM_KV = HD >= 128 ? 32 : 64;     // query rows per step of the dK/dV loop
  static constexpr int BN = 64;                         // keys per dK/dV block
  static constexpr int BN_DQ = HD >= 256 ? 32 : 64;     // keys per dQ step
  static constexpr int ACC = HD >= 256 ? HD / 2 : HD;   // gradient columns one block accumulates
  static constexpr int kSplit = HD / ACC;
  static constexpr int kDkdvSmem = (2 * BN + 2 * BM_KV) * HD * 2 + 2 * BM_KV * 4;
  // the TERMS instance's dK/dV pass adds the tile's bias terms (fp32, query rows of BN + 4: no bank
  // conflicts when a warp reads its S^T fragment)
  static constexpr int kBiasStride = BN + 4;
  static constexpr int kDkdvSmemTerms = kDkdvSmem + BM_KV * kBiasStride * 4;
  // ... and accumulates at most 64 columns of dK / dV per block from head dim 128 on (blockIdx.z picks
  // them; S^T and dP^T are computed by each): with 128 the bias terms took sm_80 past 255 registers
  static constexpr int ACC_TERMS = HD >= 128 ? 64 : ACC;
  static constexpr int kSplitTerms = HD / ACC_TERMS;
  static constexpr int kDqSmem = (2 * BM + 2 * BN_DQ) * HD * 2;
  // the TERMS instance's dQ pass adds a tile of dT (fp32) and its diagonal sums (the table gradient)
  static constexpr int kDqSmemTerms = kDqSmem + BM * BN_DQ * 4 + 128 * 4;
};

// Delta, one warp per row. Grid: ceil(Lq / 16) * B * H blocks of 4 warps, 4 rows per warp.
template <bool BF16>
EFFATTN_KERNEL attn_delta_kernel(const AttnParams params) {
  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  GridTile gt = grid_tile((params.Lq + 15) / 16, params.H);
  const AttnParams p = segment_view(params, gt);
  const int rt = gt.t, b = gt.b, h = gt.h;
  const int64_t obase = b * p.o_b + h * p.o_h + p.q0 * p.o_l;
  const uint16_t* dout = static_cast<const uint16_t*>(p.dout) + b * p.do_b + h * p.do_h + p.q0 * p.do_l;
  for (int r = 0; r < 4; ++r) {
    const int i = rt * 16 + warp * 4 + r;
    if (i >= p.Lq) break;                                // warp-uniform
    float acc = 0.f;
    for (int c = lane; c < p.Dv_out; c += 32) {
      const int64_t at = obase + int64_t(i) * p.o_l + c;
      const float o = p.o_f32 ? static_cast<const float*>(p.o)[at] : prim::to_float<BF16>(static_cast<const uint16_t*>(p.o)[at]);
      acc += o * prim::to_float<BF16>(dout[int64_t(i) * p.do_l + c]);
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) acc += prim::shfl_xor_f(acc, m);
    if (lane == 0) {
      if (p.dlse) acc -= p.dlse[b * p.dl_b + h * p.dl_h + int64_t(p.q0 + i) * p.dl_l];
      p.delta_out[q_row(p, b, h, i)] = acc;
    }
  }
}

// The saved lse of query rows [m0, m0 + rows) in log2 units, +inf for rows past Lq or that saw no
// key (so that P = exp2(S - lse) = 0 there), and their Delta, into shared memory. NT threads (t: the
// caller's index among them, its thread index by default).
template <int NT = 128>
EFFATTN_DEVICE void load_row_stats(const AttnParams& p, float* s_lse, float* s_delta, int b, int h, int m0, int rows,
                                   int t = prim::thread_x()) {
  for (int r = t; r < rows; r += NT) {
    const int i = m0 + r;
    float l = INFINITY, d = 0.f;
    if (i < p.Lq) {
      l = p.lse[q_row(p, b, h, i)];
      l = l == -INFINITY ? INFINITY : l * 1.4426950408889634f;
      d = p.delta[q_row(p, b, h, i)];
    }
    s_lse[r] = l;
    s_delta[r] = d;
  }
}

// The relative table's gradient from one (BM x BN) tile of dT (sT, row-major; d00: the distance of its
// (0, 0)): sums along the tile's BM + BN - 1 diagonals (one thread each, rows in order) into sD, then
// one thread per table entry adds the sums of the diagonals that clamp to it, in order, to `part`
// (this block's own slots of the partial sums: no other block writes them). All 128 threads; sT
// written before the call's first barrier.
template <int BM, int BN>
EFFATTN_DEVICE void rel_tile_grad(const AttnParams& p, const float* sT, float* sD, float* part, int d00) {
  static_assert(BM + BN - 1 <= 128, "one thread per diagonal");
  constexpr int ND = BM + BN - 1;
  const int t = prim::thread_x();
  prim::sync_block();                                  // every thread's dT has landed
  if (t < ND) {
    const int dd = t - (BN - 1);                       // row - column along diagonal t
    float acc = 0.f;
    for (int r = imax(dd, 0); r < imin(BM, BN + dd); ++r) acc += sT[r * BN + r - dd];
    sD[t] = acc;
  }
  prim::sync_block();
  if (t < ND) {
    const int e = rel_index(p, d00 + t - (BN - 1));
    if (t == 0 || rel_index(p, d00 + t - BN) != e) {   // the first diagonal of entry e
      float sum = 0.f;
      for (int u = t; u < ND && rel_index(p, d00 + u - (BN - 1)) == e; ++u) sum += sD[u];
      if (prim::block_z() == 0) part[e] += sum;
    }
  }
}

// S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys (rows [16 warp, 16 warp + 16) of sK, sV) and
// the BM query rows of sQ, sdO (the dK/dV pass's and the fused backward's first two products).
template <int HD, int BM, bool BF16>
EFFATTN_DEVICE void st_dpt(float (&st)[BM / 8][4], float (&dpt)[BM / 8][4], const uint16_t* sK, const uint16_t* sV,
                           const uint16_t* sQ, const uint16_t* sdO, int warp, int kd, int kdv) {
  zero_acc(st);
  zero_acc(dpt);
  mma_rows_rows<HD, BM, BF16>(st, sK, warp * 16, sQ, kd);
  mma_rows_rows<HD, BM, BF16>(dpt, sV, warp * 16, sdO, kdv);
}

// dV += P^T dO and dK += dS^T Q over columns [c0, c0 + 8 NA) (`pt`: P^T with dropout applied, `dst`: dS^T).
template <int HD, int BM, int NA, bool BF16>
EFFATTN_DEVICE void dv_dk_update(float (&dv)[NA][4], float (&dk)[NA][4], const float (&pt)[BM / 8][4],
                                 const float (&dst)[BM / 8][4], const uint16_t* sQ, const uint16_t* sdO, int c0,
                                 const AttnParams& p) {
#pragma unroll
  for (int kk = 0; kk < BM / 16; ++kk) {
    uint32_t ap[4], as[4];
    acc_to_a<BF16>(ap, pt, kk);
    acc_to_a<BF16>(as, dst, kk);
    mma_a_rows<HD, NA, BF16>(dv, ap, sdO, kk, c0 / 8, p.Dv);
    mma_a_rows<HD, NA, BF16>(dk, as, sQ, kk, c0 / 8, p.D);
  }
}

// The head-dim buckets whose two backward passes take per-row positions (AttnParams::q_pos): 64 and 128. At
// 32 (dK/dV, sm_90a) and 256 (dQ, sm_80) the rule's registers spill under the passes' register caps, so the
// binding refuses positions there (attention_args.cpp) and those instances compile the rule out.
template <int HD>
inline constexpr bool kPosHeadDim = HD == 64 || HD == 128;

// P^T with dropout applied (for dV) and dS^T = dT^T * dcap (for dK) of one score: `x` the raw product
// q_i . k_j, `dp` its dO_i . v_j, `bias` the bias tensors' terms (log2 units), `lse` (log2 units) and
// `delta` of row i; `ok`: key j visible to row i (an ignored V row's NaN gives 0, not 0 * NaN); `rule`: the
// positions' (pos_rule_at: hidden, or the query's own key, whose constant score gives dS = 0). DROP: the
// dropout code compiled in (an instance without it serves only calls without dropout).
struct PdS {
  float pd, ds;
};

template <bool DROP = true>
EFFATTN_DEVICE PdS p_and_ds(const AttnParams& p, float x, float dp, float bias, float lse, float delta, float slope,
                            int bh, int i, int kj, bool ok, int rule = kPosScore) {
  float dcap = 1.f;
  const float s = pos_score_log2(p, rule, score_log2(p, x, slope, i, kj, dcap) + bias);
  ok = ok && rule != kPosHidden;
  const float pt = ok ? prim::exp2(s - lse) : 0.f;
  float pd = pt;
  if (DROP && p.dropout) {
    const bool keep = dropout_keep(p, bh, i, kj);
    pd = keep ? pt * p.inv_keep : 0.f;
    dp = keep ? dp * p.inv_keep : 0.f;
  }
  return {pd, ok && rule != kPosSelf ? pt * (dp - delta) * dcap : 0.f};
}

// Stores this thread's rows of dK (times the scale) and dV: keys key0 and key0 + 8, columns c0 + the
// accumulators' (the dK/dV pass's fragment layout: warp rows are keys).
template <int NA, bool BF16>
EFFATTN_DEVICE void store_dkdv(const AttnParams& p, const float (&dk)[NA][4], const float (&dv)[NA][4], int b, int hk,
                               int key0, int c0) {
  const int t4 = prim::thread_x() & 3;
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

// TERMS: the instances with bias tensors (see attn_fwd_kernel); the dK/dV pass only adds them to the
// scores it recomputes, and visits each query head's span window. The terms of a (query tile, key
// tile) pair are evaluated once into shared memory (s_bias, log2 units), by all threads before the
// products, so that the element loop, where S^T, dP^T, dK and dV are all live, only reads them (computed
// there, they took the head-dim 128 and 256 instances past 255 registers, with spills, on sm_80).
// KIND (MaskKind, common.cuh) and DROP compile out what the instance never sees, as the forward's
// (attention/inst/: an instance per mask kind and dropout flag; TERMS: kAny with dropout).
template <int HD, bool BF16, bool TERMS = false, int KIND = kAny, bool DROP = true>
EFFATTN_KERNEL attn_dkdv_kernel(const AttnParams params) {
  using Cfg = BwdConfig<HD>;
  constexpr int BM = Cfg::BM_KV, BN = Cfg::BN, ACC = TERMS ? Cfg::ACC_TERMS : Cfg::ACC;
  constexpr int NS = BM / 8;         // 8-wide query subtiles of S^T
  constexpr int NA = ACC / 8;        // 8-wide column subtiles of dK / dV
  EFFATTN_SMEM(smem);
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sV = sK + BN * HD;
  uint16_t* sQ = sV + BN * HD;
  uint16_t* sdO = sQ + BM * HD;
  float* s_lse = reinterpret_cast<float*>(sdO + BM * HD);
  float* s_delta = s_lse + BM;
  float* s_bias = s_delta + BM;                         // TERMS: [query row][key] of this pair of tiles

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  GridTile gt = grid_tile((params.Lk + BN - 1) / BN, params.H / params.G);
  const AttnParams p = segment_view(params, gt);
  const int nt = gt.t, b = gt.b, hk = gt.h;
  const int n0 = nt * BN;
  if (n0 >= p.Lk) return;                               // packed: past the segment's keys (uniform)
  const int c0 = int(prim::block_z()) * ACC;            // first gradient column of this block
  const int kd = (p.D + 15) / 16, kdv = (p.Dv + 15) / 16;
  const uint8_t* kpm = KIND == kAny && p.kpm ? p.kpm + b * p.kpm_b : nullptr;

  load_tile<HD, BN>(sK, static_cast<const uint16_t*>(p.k) + b * p.k_b + hk * p.k_h + p.k0 * p.k_l, p.k_l, n0, p.Lk,
                    p.D);
  load_tile<HD, BN>(sV, static_cast<const uint16_t*>(p.v) + b * p.v_b + hk * p.v_h + p.k0 * p.v_l, p.v_l, n0, p.Lk,
                    p.Dv);
  prim::cp_async_commit();

  float dk[NA][4], dv[NA][4];
  zero_acc(dk);
  zero_acc(dv);
  const int key0 = n0 + warp * 16 + g;                  // this thread's keys: key0, key0 + 8

  for (int h = hk * p.G; h < (hk + 1) * p.G; ++h) {
    const int bh = b * p.H + h;
    AttnParams span_p = p;                              // TERMS: head h's window with its span
    if (TERMS) tighten_to_span(span_p, h);
    const AttnParams& pw = TERMS ? span_p : p;
    const BiasRow br = TERMS ? bias_row(p, b, h) : BiasRow{};
    const uint16_t* qb = static_cast<const uint16_t*>(p.q) + b * p.q_b + h * p.q_h + p.q0 * p.q_l;
    const uint16_t* dob = static_cast<const uint16_t*>(p.dout) + b * p.do_b + h * p.do_h + p.q0 * p.do_l;
    const uint8_t* lay = (KIND == kAny || KIND == kLayout) && p.layout ? p.layout + h * p.lay_h : nullptr;
    const float slope = alibi_slope(p, b, h);
    const int32_t *qpos = q_pos_row(p, bh), *kpos = k_pos_row(p, bh);
    const Schedule sched = query_schedule(pw, p.lists, h, nt, BM, BN);
    for (int it = 0; it < sched.count(); ++it) {
      const int m0 = sched.tile(it) * BM;
      load_tile<HD, BM>(sQ, qb, p.q_l, m0, p.Lq, p.D);
      load_tile<HD, BM>(sdO, dob, p.do_l, m0, p.Lq, p.Dv);
      prim::cp_async_commit();
      load_row_stats(p, s_lse, s_delta, b, h, m0, BM);
      float cb = 0.f;                                   // a constant tile's bias: no s_bias fill
      const bool cfast = TERMS && const_bias(p, br, m0, BM, n0, BN, cb);
      if (TERMS && !cfast) {
        for (int idx = tid; idx < BM * BN; idx += 128) {
          const int qr = idx / BN, c = idx % BN;
          s_bias[qr * Cfg::kBiasStride + c] = bias_terms(p, br, m0 + qr, n0 + c) * 1.4426950408889634f;
        }
      }
      prim::cp_async_wait<0>();
      prim::sync_block();

      float st[NS][4], dpt[NS][4];
      st_dpt<HD, BM, BF16>(st, dpt, sK, sV, sQ, sdO, warp, kd, kdv);

      // P^T, dS^T; st becomes P^T with dropout applied (for dV), dpt becomes dS^T (for dK)
      const bool masked = KIND != kDense && sched.masked(it);   // kDense: every tile is full
#pragma unroll
      for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kj = key0 + 8 * (e >> 1);
          const int qr = 8 * j + 2 * t4 + (e & 1);      // query row within the tile
          const int i = m0 + qr;
          bool ok = !masked || visible_kind<KIND>(pw, lay, i, kj);
          if (kpm && (kj >= p.Lk || kpm[kj * p.kpm_l])) ok = false;
          const float bias = TERMS ? (cfast ? cb : s_bias[qr * Cfg::kBiasStride + kj - n0]) : 0.f;
          const PdS r = p_and_ds<DROP>(p, st[j][e], dpt[j][e], bias, s_lse[qr], s_delta[qr], slope, bh, i, kj, ok,
                                       KIND == kAny && kPosHeadDim<HD> ? pos_rule_at(p, qpos, kpos, i, kj) : kPosScore);
          st[j][e] = r.pd;
          dpt[j][e] = r.ds;
        }

      dv_dk_update<HD, BM, NA, BF16>(dv, dk, st, dpt, sQ, sdO, c0, p);   // over this block's columns
      prim::sync_block();                                // every warp is done with sQ, sdO, stats
    }
  }
  prim::cp_async_wait<0>();                              // K, V when no query tile was visited
  store_dkdv<NA, BF16>(p, dk, dv, b, hk, key0, c0);
}

// The bias tensors' gradients from one (BM x BN) tile of dT in shared memory (sT; the tile's first row
// m0, key n0): the dense bias's gradient, dT itself, written row by row (coalesced; block z 0 only);
// returns this thread's sum of dT / ratio on the span's ramp (its elements in order). All threads,
// after a barrier that follows every thread's writes of sT.
template <int BM, int BN>
EFFATTN_DEVICE float tile_bias_grads(const AttnParams& p, float z, const float* sT, int bh, int m0, int n0) {
  float dz = 0.f;
  for (int idx = prim::thread_x(); idx < BM * BN; idx += 128) {
    const int i = m0 + idx / BN, kj = n0 + idx % BN;
    const float dt = sT[idx];
    if (p.dbias && i < p.Lq && kj < p.Lk && prim::block_z() == 0) p.dbias[(int64_t(bh) * p.Lq + i) * p.Lk + kj] = dt;
    if (p.span_z) {                                    // on the ramp: d(log ratio) / dz = 1 / (ramp ratio)
      const float ratio = span_ratio(p, z, i + p.off - kj);
      if (ratio > 0.f && ratio <= 1.f) dz += dt / ratio;
    }
  }
  return dz;
}

// TERMS: with bias tensors; besides dQ, the block writes its partial sums of the table's and the
// span's gradients (drel, dspan) and its rows of dT (dbias), each slot written by this block only:
// dT goes to shared memory in the element loop, the gradients are taken from there after the tile's
// dQ product (fewer registers live than in the loop). KIND, DROP: as attn_dkdv_kernel's.
template <int HD, bool BF16, bool TERMS, int KIND = kAny, bool DROP = true>
EFFATTN_DEVICE void dq_pass(const AttnParams& params) {
  using Cfg = BwdConfig<HD>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN_DQ, ACC = Cfg::ACC;
  constexpr int NS = BN / 8;
  constexpr int NA = ACC / 8;
  EFFATTN_SMEM(smem);
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sdO = sQ + BM * HD;
  uint16_t* sK = sdO + BM * HD;
  uint16_t* sV = sK + BN * HD;
  float* sT = reinterpret_cast<float*>(sV + BN * HD);  // TERMS: a tile of dT and its diagonal sums
  float* sD = sT + BM * BN;

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int n_mt = (params.Lq + BM - 1) / BM;          // query tiles per (b, h): the dalibi partials' stride
  GridTile gt = grid_tile(n_mt, params.H);
  const AttnParams p = block_view<TERMS>(params, gt);
  const int mt = gt.t, b = gt.b, h = gt.h, hk = h / p.G, bh = b * p.H + h;
  const int m0 = mt * BM;
  if (m0 >= p.Lq) return;                               // packed: past the segment's queries (uniform)
  const int c0 = int(prim::block_z()) * ACC;
  const int kd = (p.D + 15) / 16, kdv = (p.Dv + 15) / 16;
  const uint16_t* kb = static_cast<const uint16_t*>(p.k) + b * p.k_b + hk * p.k_h + p.k0 * p.k_l;
  const uint16_t* vb = static_cast<const uint16_t*>(p.v) + b * p.v_b + hk * p.v_h + p.k0 * p.v_l;
  const uint8_t* kpm = KIND == kAny && p.kpm ? p.kpm + b * p.kpm_b : nullptr;
  const uint8_t* lay = (KIND == kAny || KIND == kLayout) && p.layout ? p.layout + h * p.lay_h : nullptr;

  load_tile<HD, BM>(sQ, static_cast<const uint16_t*>(p.q) + b * p.q_b + h * p.q_h + p.q0 * p.q_l, p.q_l, m0, p.Lq,
                    p.D);
  load_tile<HD, BM>(sdO, static_cast<const uint16_t*>(p.dout) + b * p.do_b + h * p.do_h + p.q0 * p.do_l, p.do_l, m0,
                    p.Lq, p.Dv);
  prim::cp_async_commit();

  const int row0 = m0 + warp * 16 + g;
  float lse2[2], dlt[2];
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
  float dq[NA][4];
#pragma unroll
  for (int j = 0; j < NA; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;
  const float slope = alibi_slope(p, b, h);
  float dslope = 0.f;                                   // this thread's sum of dT * |d| (ALiBi's gradient)
  float dz = 0.f;                                       // TERMS: its sum of dT / ratio on the span's ramp
  const BiasRow br = TERMS ? bias_row(p, b, h) : BiasRow{};

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

    const bool masked = KIND != kDense && sched.masked(it);
    float cb = 0.f;                                      // TERMS: a constant tile's bias (log2 units); its dT
    const bool cfast = TERMS && const_bias(p, br, m0, BM, n0, BN, cb);   // gives a span no gradient
    const bool tgrad = TERMS && (p.drel || p.dbias || (p.dspan && !cfast));
    if (masked || kpm) {                                 // keys no row sees: zero K rows for dS K
      prim::sync_block();                                // every warp is done reading sK for S
      zero_unseen<HD, BN>(sK, n0, [&](int j) { return key_seen(p, lay, kpm, m0, m0 + BM, j); });
      prim::sync_block();
    }
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const int i = row0 + 8 * r, kj = n0 + 8 * j + 2 * t4 + (e & 1);
        // positions (LSH) run only the general instance (mask_kind), at head dims 33..128 (kPosHeadDim)
        const int rule = KIND == kAny && kPosHeadDim<HD> ? pos_rule_at(p, q_pos_row(p, bh), k_pos_row(p, bh), i, kj)
                                                         : kPosScore;
        bool ok = (!masked || visible_kind<KIND>(p, lay, i, kj)) && rule != kPosHidden;
        if (kpm && (kj >= p.Lk || kpm[kj * p.kpm_l])) ok = false;
        float dcap = 1.f;
        float x = score_log2(p, s[j][e], slope, i, kj, dcap);
        if (TERMS) x += cfast ? cb : bias_terms(p, br, i, kj) * 1.4426950408889634f;
        x = pos_score_log2(p, rule, x);
        const float pr = ok ? prim::exp2(x - lse2[r]) : 0.f;
        float d = dp[j][e];
        if (DROP && p.dropout) d = dropout_keep(p, bh, i, kj) ? d * p.inv_keep : 0.f;
        const float dt = ok ? pr * (d - dlt[r]) : 0.f;   // dT (an ignored V row's NaN: 0, not 0 * NaN)
        if (p.dalibi) {
          const int dd = i + p.off - kj;
          dslope += dt * float(dd < 0 ? -dd : dd);
        }
        if (tgrad) sT[(i - m0) * BN + kj - n0] = dt;
        s[j][e] = rule == kPosSelf ? 0.f : dt * dcap;    // dS (a constant self score: none)
      }

    // dQ += dS K over columns [c0, c0 + ACC)
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      acc_to_a<BF16>(a, s, kk);
      mma_a_rows<HD, NA, BF16>(dq, a, sK, kk, c0 / 8, p.D);
    }
    if (tgrad) {
      prim::sync_block();                                // every thread's dT has landed
      if (!cfast) dz += tile_bias_grads<BM, BN>(p, br.z, sT, bh, m0, n0);   // (a constant tile: no span gradient)
      if (p.drel) rel_tile_grad<BM, BN>(p, sT, sD, p.drel + (int64_t(bh) * n_mt + mt) * p.rel_w, m0 + p.off - n0);
    }
    prim::sync_block();                                  // every warp is done with sK, sV
  }
  prim::cp_async_wait<0>();

  // this block's sums of dT * |d| and (TERMS) of the span's terms, in a fixed order (block_sum's
  // first barrier: every thread's copies landed, tiles read)
  float* red = reinterpret_cast<float*>(smem);
  if (p.dalibi) {
    const float sum = block_sum(dslope, red);
    if (tid == 0 && prim::block_z() == 0) p.dalibi[int64_t(bh) * n_mt + mt] = sum;
  }
  if (TERMS && p.dspan) {
    const float sum = block_sum(dz, red + 4);
    if (tid == 0 && prim::block_z() == 0) p.dspan[int64_t(bh) * n_mt + mt] = sum;
  }

  uint16_t* dqb = static_cast<uint16_t*>(p.dq) + q_row(p, b, h, 0) * p.D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    if (i >= p.Lq) continue;
#pragma unroll
    for (int j = 0; j < NA; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = c0 + 8 * j + 2 * t4 + e;
        if (c < p.D) dqb[int64_t(i) * p.D + c] = prim::from_float<BF16>(dq[j][2 * r + e] * p.scale);
      }
  }
}

template <int HD, bool BF16, bool TERMS = false, int KIND = kAny, bool DROP = true>
EFFATTN_KERNEL attn_dq_kernel(const AttnParams params) {
  dq_pass<HD, BF16, TERMS, KIND, DROP>(params);
}

// The dQ pass with bias tensors: its own kernel, for one launch bound: with `EFFATTN_KERNEL`'s (128)
// alone ptxas capped the head-dim 256 instance at 168 registers and spilled 32 bytes on sm_80.
template <int HD, bool BF16>
EFFATTN_KERNEL_1 attn_dq_terms_kernel(const AttnParams params) {
  dq_pass<HD, BF16, true>(params);
}

}  // namespace effattn
