// What the kernels of every op share on top of common/prims.cuh: swizzled shared-memory tiles and
// their cp.async loads, warp-level m16n8k16 products over such tiles, small integer helpers.
#pragma once

#include <cstdint>

#include "common/prims.cuh"

namespace effattn {

// A tile of `ROWS` rows of `HD` 16-bit elements in shared memory. Row r's 16-byte chunk c sits at
// chunk c ^ swz(r): the 8 rows an ldmatrix phase reads then fall in 8 different bank groups
// (without it, rows 128 bytes apart share one and the phase takes 8 wavefronts).
template <int HD>
struct Tile {
  static constexpr int kChunks = HD / 8;
  // rows per 128 bytes share a bank window; XOR with the row's 128-byte line index
  static constexpr int kRowsPerLine = kChunks >= 8 ? 1 : 8 / kChunks;
  static constexpr int kXorMask = kChunks >= 8 ? 7 : kChunks - 1;
  EFFATTN_DEVICE static int offset(int row, int chunk) {
    return row * HD + ((chunk ^ ((row / kRowsPerLine) & kXorMask)) << 3);
  }
};

// Loads rows [r0, r0 + ROWS) of an (L, width) matrix whose row gr starts at `row(gr)` (width a
// multiple of 8, rows 16-byte aligned) into a swizzled tile (layout `Lay`: offset(row, 16-byte chunk)),
// zero-filling rows >= L and columns >= width; `row` is called for rows < L only. All 128 threads.
template <int HD, int ROWS, class Lay = Tile<HD>, class RowPtr>
EFFATTN_DEVICE void load_rows(uint16_t* tile, const uint16_t* any, const RowPtr& row, int r0, int L, int width) {
  constexpr int C = HD / 8;
  for (int idx = prim::thread_x(); idx < ROWS * C; idx += 128) {
    int r = idx / C, c = idx % C;
    int gr = r0 + r;
    bool ok = gr < L && c * 8 < width;
    const uint16_t* src = ok ? row(gr) + c * 8 : any;
    prim::cp_async_16(tile + Lay::offset(r, c), src, ok ? 16 : 0);
  }
}

// load_rows of a strided matrix (row gr at base + gr * ld), written out: as a call of load_rows with a
// lambda, nvcc 13.0 spilled 8 bytes in attn_dq_terms_kernel at head dim 128 on sm_80. All NT threads of
// the block.
template <int HD, int ROWS, class Lay = Tile<HD>, int NT = 128>
EFFATTN_DEVICE void load_tile(uint16_t* tile, const uint16_t* base, int64_t ld, int r0, int L, int width) {
  constexpr int C = HD / 8;
  for (int idx = prim::thread_x(); idx < ROWS * C; idx += NT) {
    int r = idx / C, c = idx % C;
    int gr = r0 + r;
    bool ok = gr < L && c * 8 < width;
    const uint16_t* src = ok ? base + int64_t(gr) * ld + c * 8 : base;
    prim::cp_async_16(tile + Lay::offset(r, c), src, ok ? 16 : 0);
  }
}

// load_tile's copies with each thread's part computed once per block: a block that loads many ROWS-row tiles
// (the forward's K and V per key tile) keeps its thread's first row, column and shared-memory offsets, and a
// tile's load is then one address and one row limit per tile, and per copy a 64-bit add, a compare and the
// cp.async (load_tile recomputes row, column, swizzle and the 64-bit address for every 16-byte copy). The
// same thread-to-chunk map as load_tile (chunk idx = tid + NT k: row idx / C, column chunk idx % C), so
// zero_unseen still walks it. Tile<HD> layout.
template <int HD, int ROWS, int NT = 128>
struct TileCopy {
  static constexpr int C = HD / 8;               // 16-byte chunks per row
  static constexpr int RS = NT / C;              // rows between a thread's copies
  static constexpr int N = ROWS * C / NT;        // copies per thread and tile
  static_assert(NT % C == 0 && (ROWS * C) % NT == 0, "every thread copies the same column of N rows");
  // the swizzle of rows RS apart repeats after kPeriod copies (one at every bucket but 256, whose 4-row steps
  // flip chunk bit 2 every other copy)
  static constexpr int kLine = (Tile<HD>::kXorMask + 1) * Tile<HD>::kRowsPerLine;   // rows per swizzle cycle
  static constexpr int kPeriod = RS % kLine == 0 ? 1 : (kLine % RS == 0 ? kLine / RS : 0);
  static_assert(kPeriod >= 1 && kPeriod <= 2, "the swizzle of a thread's rows cycles in one or two copies");
  int row, col;                                  // the thread's first row in a tile, its first column
  int dst[kPeriod];                              // shared-memory offsets of copies k (< kPeriod) less RS k rows

  EFFATTN_DEVICE TileCopy() {
    const int t = prim::thread_x();
    row = t / C;
    col = (t % C) * 8;
#pragma unroll
    for (int k = 0; k < kPeriod; ++k) dst[k] = Tile<HD>::offset(row + k * RS, t % C) - k * RS * HD;
  }

  // load_tile(tile, base, ld, r0, L, width): rows >= L and columns >= width zero-filled (a copy of 0 source
  // bytes, which reads nothing: its address, the row's own, is never dereferenced). All NT threads.
  EFFATTN_DEVICE void load(uint16_t* tile, const uint16_t* base, int64_t ld, int r0, int L, int width) const {
    const int lim = col < width ? L - r0 - row : 0;   // copy k holds data iff RS k < lim
    const uint16_t* src = base + int64_t(r0 + row) * ld + col;
    const int64_t step = int64_t(RS) * ld;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const bool ok = k * RS < lim;
      prim::cp_async_16(tile + dst[k % kPeriod] + k * RS * HD, src + k * step, ok ? 16 : 0);
    }
  }
};

// Warp-level products on m16n8k16 tensor cores. Fragment order follows the PTX ISA: an x4
// ldmatrix of a 16 x 16 A block gives a0..a3 (rows 0-7 / 8-15 x columns 0-7 / 8-15); the A
// operand of a product whose left side comes from accumulators reuses their layout (P in P V).

// acc (16 x NB) += A B^T: A = rows [ra, ra + 16) of tile `sa`, B = rows [0, NB) of tile `sb`, both
// row-major over the reduction; only the first `k16` 16-wide steps (the rest is zero padding).
template <int HD, int NB, bool BF16>
EFFATTN_DEVICE void mma_rows_rows(float (&acc)[NB / 8][4], const uint16_t* sa, int ra, const uint16_t* sb, int k16) {
  const int lane = prim::thread_x() & 31;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    if (kk >= k16) break;
    uint32_t a[4];
    prim::ldmatrix_x4(a, sa + Tile<HD>::offset(ra + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * kk + (lane >> 4)));
#pragma unroll
    for (int nn = 0; nn < NB / 16; ++nn) {
      uint32_t b[4];
      prim::ldmatrix_x4(b, sb + Tile<HD>::offset(nn * 16 + (lane & 7) + 8 * (lane >> 4), 2 * kk + ((lane >> 3) & 1)));
      prim::mma_16816<BF16>(acc[2 * nn], a, b[0], b[1]);
      prim::mma_16816<BF16>(acc[2 * nn + 1], a, b[2], b[3]);
    }
  }
}

// Zeroes fragment accumulators.
template <int N>
EFFATTN_DEVICE void zero_acc(float (&x)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) x[j][0] = x[j][1] = x[j][2] = x[j][3] = 0.f;
}

// The A operand for reduction step kk from fp32 accumulators x (16 x K, K = 8 * subtiles).
template <bool BF16, int NS>
EFFATTN_DEVICE void acc_to_a(uint32_t (&a)[4], const float (&x)[NS][4], int kk) {
  a[0] = prim::pack2<BF16>(x[2 * kk][0], x[2 * kk][1]);
  a[1] = prim::pack2<BF16>(x[2 * kk][2], x[2 * kk][3]);
  a[2] = prim::pack2<BF16>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
  a[3] = prim::pack2<BF16>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
}

// acc (16 x 8 NA) += a (16 x 16, reduction step kk) B, B = rows [16 kk, 16 kk + 16) of tile `sb`
// at columns [8 c0, 8 c0 + 8 NA) (ldmatrix.trans: B is stored reduction-major); only columns below
// `width` (zero padding beyond).
template <int HD, int NA, bool BF16>
EFFATTN_DEVICE void mma_a_rows(float (&acc)[NA][4], const uint32_t (&a)[4], const uint16_t* sb, int kk, int c0,
                               int width) {
  const int lane = prim::thread_x() & 31;
#pragma unroll
  for (int dd = 0; dd < NA / 2; ++dd) {
    if (8 * c0 + 16 * dd >= width) break;
    uint32_t b[4];
    const int row = kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1);
    prim::ldmatrix_x4_trans(b, sb + Tile<HD>::offset(row, c0 + 2 * dd + (lane >> 4)));
    prim::mma_16816<BF16>(acc[2 * dd], a, b[0], b[1]);
    prim::mma_16816<BF16>(acc[2 * dd + 1], a, b[2], b[3]);
  }
}

EFFATTN_DEVICE int imin(int a, int b) { return a < b ? a : b; }
EFFATTN_DEVICE int imax(int a, int b) { return a > b ? a : b; }

}  // namespace effattn
