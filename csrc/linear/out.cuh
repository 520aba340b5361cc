// The output pass of linear attention (fla's chunk_o): one block of 4 warps per (a-head, chunk of
// 64 timeline positions, Fc tile of 64); warp w owns rows [16 w, 16 w + 16) of the chunk.
//
// Per b-head j of the a-head's group (GQA gradients sum the group's query heads here, in a fixed
// order) and per 32-wide slice of the contracted features: the a and b tiles (feature map fused in
// the load) and the chunk's state slice (plus the base state, once) go to shared memory as bf16
// parts; s += a b^T (the in-chunk scores; only the 16-key blocks the causal order lets a warp see)
// and acc += a S. The denominator's a . z rides along as a 16-wide tile whose first column is z.
// Then the in-chunk term: s masked, acc += s c with s straight from its accumulators.
// Epilogue: ax_t z terms, normalization, the feature map's derivative, the store.
#pragma once

#include "linear/common.cuh"

namespace effattn {

template <int NP>
struct LinOutConfig {
  static constexpr int CH = kLinChunk, BK = 32, BV = 64, ZW = 16;
  static constexpr int kA = CH * BK, kS = BK * BV, kZ = BK * ZW, kC = CH * BV;   // elements per part
  static_assert(kC == 2 * kA, "the c tile reuses the a and b tiles");
  static constexpr int kSmem = NP * (2 * kA + kS + kZ) * 2;
};

template <int NP>
EFFATTN_LIN_KERNEL lin_out_kernel(const LinOutParams p) {
  using Cfg = LinOutConfig<NP>;
  constexpr int CH = Cfg::CH, BK = Cfg::BK, BV = Cfg::BV, ZW = Cfg::ZW;
  EFFATTN_SMEM(smem);
  uint16_t* sA = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sB = sA + NP * Cfg::kA;
  uint16_t* sS = sB + NP * Cfg::kA;
  uint16_t* sZ = sS + NP * Cfg::kS;
  uint16_t* sC = sA;                                          // after the feature loop

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int bha = int(prim::block_x());
  const int bb = bha / p.Ha, ha = bha % p.Ha;
  const int ch = int(prim::block_y());
  const int fc0 = int(prim::block_z()) * BV;
  const int t0 = ch * CH;
  const int FA = p.FA, FC = p.FC;
  const int n16 = (imin(FC - fc0, BV) + 15) / 16;
  const bool den_mma = p.z_mode == 1 && (p.stz || p.base_z);
  // the 16-key blocks of the chunk a warp's rows see: causal keys s <= t (s >= t reversed)
  const int kb_lo = p.reverse ? warp : 0, kb_hi = p.reverse ? CH / 16 : warp + 1;

  float acc[8][4], accz[2][4], s[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  accz[0][0] = accz[0][1] = accz[0][2] = accz[0][3] = accz[1][0] = accz[1][1] = accz[1][2] = accz[1][3] = 0.f;
  float den_part[2] = {0.f, 0.f};                             // rows g, g + 8 of the warp
  int ra[2];                                                  // this thread's rows of a
  float axv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    ra[r] = t0 + 16 * warp + g + 8 * r + p.a.shift;
    axv[r] = lin::row_scalar(p.ax ? p.ax + int64_t(bha) * p.a.L : nullptr, ra[r], p.a.L, p.a_x);
  }
  const int hbase = bha / p.gbase;

  for (int j = 0; j < p.NB; ++j) {
    const int hb = (ha / p.GA) * p.NB + j, bhb = bb * p.Hb + hb;
    const bool with_base = j == 0 && p.base;
    const bool with_tile = p.st || with_base;
    const float* st = p.st ? p.st + int64_t(bhb) * p.st_bh + int64_t(ch) * p.st_c : nullptr;
    const float* stz = p.stz ? p.stz + int64_t(bhb) * p.stz_bh + int64_t(ch) * p.stz_c : nullptr;
    const float* bs = with_base ? p.base + int64_t(hbase) * p.base_bh : nullptr;
    const float* bz = j == 0 && p.base_z ? p.base_z + int64_t(hbase) * p.basez_bh : nullptr;
    if (p.causal) {
#pragma unroll
      for (int q = 0; q < 8; ++q) s[q][0] = s[q][1] = s[q][2] = s[q][3] = 0.f;
    }
    for (int k0 = 0; k0 < FA; k0 += BK) {
      prim::sync_block();                                     // every warp is done with the last tiles
      lin::load_tile_parts<BK, CH, NP>(sA, Cfg::kA, p.a, bb, ha, t0 + p.a.shift, k0);
      if (p.causal) lin::load_tile_parts<BK, CH, NP>(sB, Cfg::kA, p.b, bb, hb, t0 + p.b.shift, k0);
      if (with_tile) {
        for (int idx = tid; idx < BK * BV / 8; idx += 128) {  // 8 columns a step
          const int r = idx / (BV / 8), chunk = idx % (BV / 8), fa = k0 + r, fc = fc0 + 8 * chunk;
          float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
          if (fa < FA && fc < FC) {
            const int n = imin(8, FC - fc);
            if (st) lin::add8_f32(x, st + int64_t(fa) * p.st_a + int64_t(fc) * p.st_f, p.st_f, n);
            if (bs) lin::add8_f32(x, bs + int64_t(fa) * p.base_a + int64_t(fc) * p.base_f, p.base_f, n);
          }
          lin::put8_parts<BV, NP>(sS, Cfg::kS, r, chunk, x);
        }
        if (den_mma) {
          for (int idx = tid; idx < BK * ZW; idx += 128) {
            const int r = idx / ZW, c = idx % ZW, fa = k0 + r;
            float x = 0.f;
            if (c == 0 && fa < FA) x = (stz ? stz[fa] : 0.f) + (bz ? bz[fa] : 0.f);
            lin::put_parts<ZW, NP>(sZ, Cfg::kZ, r, c, x);
          }
        }
      }
      prim::sync_block();
      const int k16 = (imin(FA - k0, BK) + 15) / 16;
      for (int kk = 0; kk < k16; ++kk) {
        uint32_t a[NP][4];
        lin::a_rows<BK, NP>(a, sA, Cfg::kA, 16 * warp, kk);
        if (p.causal) lin::mma_a_rows_t<BK, NP, 8>(s, a, sB, Cfg::kA, kk, kb_lo, kb_hi);
        if (with_tile) {
          lin::mma_a_tile<BV, NP, 8>(acc, a, sS, Cfg::kS, kk, n16);
          if (den_mma) lin::mma_a_tile<ZW, NP, 2>(accz, a, sZ, Cfg::kZ, kk, 1);
        }
      }
    }
    if (p.z_mode == 2 && (stz || bz)) {                       // acc += ax_t (z_c + base_z)
#pragma unroll
      for (int q = 0; q < 8; ++q)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int fc = fc0 + 8 * q + 2 * t4 + (e & 1);
          if (fc < FC) acc[q][e] += axv[e >> 1] * ((stz ? stz[fc] : 0.f) + (bz ? bz[fc] : 0.f));
        }
    }
    if (p.causal) {
      const float* bx = p.bx ? p.bx + int64_t(bhb) * p.b.L : nullptr;
#pragma unroll
      for (int q = 0; q < 8; ++q)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ti = 16 * warp + g + 8 * (e >> 1), ts = 8 * q + 2 * t4 + (e & 1);
          float x = s[q][e];
          if (p.b_x) x += axv[e >> 1] * lin::row_scalar(bx, t0 + ts + p.b.shift, p.b.L, p.b_x);
          if (p.reverse ? ts < ti : ts > ti) x = 0.f;
          s[q][e] = x;
          den_part[e >> 1] += x;
        }
      prim::sync_block();                                     // every warp is done with the a, b tiles
      lin::load_tile_parts<BV, CH, NP>(sC, Cfg::kC, p.c, bb, hb, t0 + p.c.shift, fc0);
      prim::sync_block();
#pragma unroll
      for (int kk = 0; kk < CH / 16; ++kk) {
        if (kk < kb_lo || kk >= kb_hi) continue;
        uint32_t a[NP][4];
        lin::acc_to_a_parts<NP, 8>(a, s, kk);
        lin::mma_a_tile<BV, NP, 8>(acc, a, sC, Cfg::kC, kk, n16);
      }
    }
  }

  // epilogue: rows ra[0] (elements 0, 1) and ra[1] (elements 2, 3)
  uint8_t* ob = static_cast<uint8_t*>(p.out);
  const int osz = p.out_kind == kF32 ? 4 : 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool ok = ra[r] >= 0 && ra[r] < p.a.L;
    float den = lin::row_sum4((p.with_den ? den_part[r] : 0.f) + (t4 == 0 ? accz[0][2 * r] : 0.f));
    if (p.normalize) den += p.eps;
    if (p.with_den && ok && fc0 == 0 && t4 == 0) p.den[int64_t(bha) * p.a.L + ra[r]] = den;
    if (!ok) continue;
    void* orow = ob + (int64_t(bb) * p.o_b + int64_t(ha) * p.o_h + int64_t(ra[r]) * p.o_l) * osz;
#pragma unroll
    for (int q = 0; q < 8; ++q)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int fc = fc0 + 8 * q + 2 * t4 + e;
        if (fc >= FC) continue;
        float x = acc[q][2 * r + e];
        if (p.normalize) x = den == 0.f ? 0.f : lin::fdiv(x, den);   // a row that sees nothing outputs 0
        if (p.gx.map) {
          const LinRows& gx = p.gx;
          const int64_t i = int64_t(bb) * gx.sb + int64_t(ha) * gx.sh + int64_t(ra[r]) * gx.sl + int64_t(fc) * gx.sf;
          x *= lin::map_grad(lin::load_elem(gx.x, i, gx.kind), gx.map);
        }
        lin::store_elem(orow, fc, p.out_kind, x);
      }
  }
}

}  // namespace effattn
