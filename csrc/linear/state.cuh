// The chunk-state pass of linear attention (fla's chunk_h): one block of 4 warps per (head, Fb tile
// of 64, Fc tile of 64, split), sequential over chunks of 64 timeline positions. Warp w owns state
// rows [16 w, 16 w + 16) of the tile: S += b^T c per chunk on mma.sync (b^T's fragments through
// ldmatrix.trans of the time-major b tile), the next chunk's loads in flight meanwhile. Before each
// chunk the running state (the sum over the earlier chunks) is stored for the output pass;
// z = sum b_t cx_t is summed in fp32 from the mapped values as they are loaded (16 threads per
// column, combined in a fixed order: deterministic).
#pragma once

#include "linear/common.cuh"

namespace effattn {

template <int NP>
struct LinStateConfig {
  static constexpr int CH = kLinChunk, BF = 64;
  static constexpr int kPart = CH * BF;                       // 16-bit elements per part of a tile
  static constexpr int kSmem = 2 * NP * kPart * 2 + 16 * BF * 4;   // b and c tiles, z partials
};

template <int NP>
EFFATTN_LIN_KERNEL lin_state_kernel(const LinStateParams p) {
  using Cfg = LinStateConfig<NP>;
  constexpr int CH = Cfg::CH, BF = Cfg::BF, PART = Cfg::kPart;
  EFFATTN_SMEM(smem);
  uint16_t* sB = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sC = sB + NP * PART;
  float* zbuf = reinterpret_cast<float*>(sC + NP * PART);

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int bh = int(prim::block_x());
  const int H = p.b.H, bb = bh / H, h = bh % H;
  const int n_fc = (p.c.F + BF - 1) / BF;
  const int fb0 = int(prim::block_y()) / n_fc * BF, fc0 = int(prim::block_y()) % n_fc * BF;
  const int split = int(prim::block_z());
  const int Fb = p.b.F, Fc = p.c.F;
  const int n16 = (imin(Fc - fc0, BF) + 15) / 16;             // 16-wide column blocks that hold data
  const bool rows_here = fb0 + 16 * warp < Fb;                // this warp's state rows exist
  const bool with_z = p.cx_mode != 0 && fc0 == 0;             // one Fc tile writes z
  const float* cx = p.cx ? p.cx + int64_t(bh) * p.b.L : nullptr;

  float acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float z_run = 0.f;                                          // column fb0 + tid (tid < 64)

  // Each thread moves the same 8 columns (chunk tid % 8) of rows tid / 8 + 16 i, i < 4, of both
  // tiles. The next chunk's values are loaded into registers while this chunk's products run.
  constexpr int NL = CH * BF / 8 / 128;
  static_assert(NL * 128 * 8 == CH * BF, "whole 8-column steps per thread");
  const int chunk = tid % (BF / 8);
  float vb[NL][8], vc[NL][8];
  auto fetch = [&](int ch) {
#pragma unroll
    for (int l = 0; l < NL; ++l) {
      const int r = (tid + 128 * l) / (BF / 8);
      lin::load8(vb[l], p.b, bb, h, ch * CH + r + p.b.shift, fb0 + 8 * chunk);
      lin::load8(vc[l], p.c, bb, h, ch * CH + r + p.c.shift, fc0 + 8 * chunk);
    }
  };
  const int first = split * p.chunks_per_block;
  const int last = imin(first + p.chunks_per_block, p.n_chunks);
  if (first < last) fetch(p.reverse ? p.n_chunks - 1 - first : first);
  for (int i = first; i < last; ++i) {
    const int ch = p.reverse ? p.n_chunks - 1 - i : i;
    if (p.store) {                                            // the state chunk ch starts from
      float* st = p.st + (int64_t(bh) * p.n_chunks + ch) * Fb * Fc;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = fb0 + 16 * warp + g + 8 * (e >> 1), c = fc0 + 8 * j + 2 * t4 + (e & 1);
          if (r < Fb && c < Fc) st[int64_t(r) * Fc + c] = acc[j][e];
        }
      if (with_z && tid < BF && fb0 + tid < Fb) p.stz[(int64_t(bh) * p.n_chunks + ch) * Fb + fb0 + tid] = z_run;
    }
    prim::sync_block();                                       // every warp is done with the last tiles
    float z_part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int l = 0; l < NL; ++l) {
      const int r = (tid + 128 * l) / (BF / 8);
      if (with_z) {
        const float w = lin::row_scalar(cx, ch * CH + r + p.b.shift, p.b.L, p.cx_mode);
#pragma unroll
        for (int j = 0; j < 8; ++j) z_part[j] += vb[l][j] * w;
      }
      lin::put8_parts<BF, NP>(sB, PART, r, chunk, vb[l]);
      lin::put8_parts<BF, NP>(sC, PART, r, chunk, vc[l]);
    }
    if (with_z) {
#pragma unroll
      for (int j = 0; j < 8; ++j) zbuf[(tid / 8) * BF + 8 * chunk + j] = z_part[j];
    }
    prim::sync_block();
    if (i + 1 < last) fetch(p.reverse ? p.n_chunks - 2 - i : i + 1);
    if (with_z && tid < BF)                                   // the 16 threads of column tid, in order
      for (int q = 0; q < 16; ++q) z_run += zbuf[q * BF + tid];
    if (rows_here) {
#pragma unroll
      for (int kk = 0; kk < CH / 16; ++kk) {
        uint32_t a[NP][4];
        lin::a_cols<BF, NP>(a, sB, PART, 16 * warp, kk);
        lin::mma_a_tile<BF, NP, 8>(acc, a, sC, PART, kk, n16);
      }
    }
  }

  float* fin = p.fin + (int64_t(split) * p.B * H + bh) * Fb * Fc;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = fb0 + 16 * warp + g + 8 * (e >> 1), c = fc0 + 8 * j + 2 * t4 + (e & 1);
      if (r < Fb && c < Fc) fin[int64_t(r) * Fc + c] = acc[j][e];
    }
  if (with_z && tid < BF && fb0 + tid < Fb) p.finz[(int64_t(split) * p.B * H + bh) * Fb + fb0 + tid] = z_run;
}

}  // namespace effattn
