// Pieces shared by the linear-attention kernels: element loads of any operand kind, the fused
// feature maps, the split of fp32 values into bf16 parts, and warp-level products on those parts.
//
// Precision: mma.sync takes 16-bit operands only, while linear attention's states are sums over
// many keys (beyond fp16's range). Every operand is therefore rounded to bf16 (fp32's range) in
// NP parts, x ~ x_0 + x_1 + ... (x_0 = bf16(x), x_1 = bf16(x - x_0), ...), and a product keeps the
// part products of order < NP: a b ~ sum_{i + j < NP} a_i b_j, fp32 accumulation. NP = 1 for bf16
// calls (as the Triton kernels), 2 for fp16 (16 significant bits against fp16's 11), 3 for fp32
// (24 bits).
#pragma once

#include <cstring>

#include "common/tiles.cuh"
#include "linear/linear.h"

// Kernels of 128 threads; minBlocksPerSM = 1 leaves ptxas the whole register file (without it,
// ptxas 13 aims some of them at 32 or 128 registers and spills a few bytes to get there)
#if defined(EFFATTN_CUDA_EMU)
#define EFFATTN_LIN_KERNEL EFFATTN_KERNEL
#else
#define EFFATTN_LIN_KERNEL __global__ void __launch_bounds__(128, 1)
#endif

namespace effattn {
namespace lin {

EFFATTN_DEVICE float load_elem(const void* p, int64_t i, int kind) {
  if (kind == kF32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return kind == kBF16 ? prim::to_float<true>(h) : prim::to_float<false>(h);
}

EFFATTN_DEVICE void store_elem(void* p, int64_t i, int kind, float x) {
  if (kind == kF32) static_cast<float*>(p)[i] = x;
  else static_cast<uint16_t*>(p)[i] = kind == kBF16 ? prim::from_float<true>(x) : prim::from_float<false>(x);
}

// x / y: the fast division under nvcc (IEEE division's slow path is a call that makes ptxas spill
// around it; 2 ulp are far below the bf16 rounding of the operands)
EFFATTN_DEVICE float fdiv(float x, float y) {
#if defined(EFFATTN_CUDA_EMU)
  return x / y;
#else
  return __fdividef(x, y);
#endif
}

EFFATTN_DEVICE float apply_map(float x, int map) {
  if (map == kMapElu) return x > 0.f ? x + 1.f : expf(x);
  if (map == kMapRelu) return x > 0.f ? x : 0.f;
  return x;
}

// d phi / dx of the maps above, as a factor
EFFATTN_DEVICE float map_grad(float x, int map) {
  if (map == kMapElu) return x > 0.f ? 1.f : expf(x);
  if (map == kMapRelu) return x > 0.f ? 1.f : 0.f;
  return 1.f;
}

struct alignas(16) Vec16 {
  uint32_t w[4];
};

// Elements (row, col .. col + 7) of head (b, h) of operand x, mapped; zero outside the tensor. One
// or two 16-byte loads when the columns are contiguous, in bounds and aligned, else one by one.
EFFATTN_DEVICE void load8(float (&v)[8], const LinRows& x, int b, int h, int row, int col) {
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = 0.f;
  if (row < 0 || row >= x.L || col >= x.F) return;
  const int64_t i0 = int64_t(b) * x.sb + int64_t(h) * x.sh + int64_t(row) * x.sl + int64_t(col) * x.sf;
  const int esz = x.kind == kF32 ? 4 : 2;
  const char* p = static_cast<const char*>(x.x) + i0 * esz;
  if (x.sf == 1 && col + 8 <= x.F && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    if (x.kind == kF32) {
#pragma unroll
      for (int hlf = 0; hlf < 2; ++hlf) {
        const Vec16 w = reinterpret_cast<const Vec16*>(p)[hlf];
#pragma unroll
        for (int j = 0; j < 4; ++j) std::memcpy(&v[4 * hlf + j], &w.w[j], 4);
      }
    } else {
      const Vec16 w = *reinterpret_cast<const Vec16*>(p);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint16_t e = uint16_t(w.w[j >> 1] >> (16 * (j & 1)));
        v[j] = x.kind == kBF16 ? prim::to_float<true>(e) : prim::to_float<false>(e);
      }
    }
  } else {
    const int n = x.F - col < 8 ? x.F - col : 8;
    for (int j = 0; j < n; ++j) v[j] = load_elem(x.x, i0 + j * x.sf, x.kind);
    for (int j = 0; j < 8; ++j)
      if (j >= n) v[j] = 0.f;
  }
  const int n = x.F - col < 8 ? x.F - col : 8;
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = j < n ? apply_map(v[j], x.map) : 0.f;
}

// v[j] += x[j * stride] for j < n (fp32): two 16-byte loads when contiguous, complete and aligned.
EFFATTN_DEVICE void add8_f32(float (&v)[8], const float* x, int64_t stride, int n) {
  if (stride == 1 && n == 8 && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
#pragma unroll
    for (int hlf = 0; hlf < 2; ++hlf) {
      const Vec16 w = reinterpret_cast<const Vec16*>(x)[hlf];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float f;
        std::memcpy(&f, &w.w[j], 4);
        v[4 * hlf + j] += f;
      }
    }
  } else {
    for (int j = 0; j < n; ++j) v[j] += x[j * stride];
  }
}

// Stores v as 8 consecutive elements (16-byte chunk `ch` of row r) of a swizzled tile of W
// columns, in NP bf16 parts: one 16-byte store per part.
template <int W, int NP>
EFFATTN_DEVICE void put8_parts(uint16_t* tile, int part_elems, int r, int ch, const float (&v)[8]) {
  float x[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = v[j];
  const int off = Tile<W>::offset(r, ch);
#pragma unroll
  for (int q = 0; q < NP; ++q) {
    Vec16 w;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = prim::from_float<true>(x[2 * i]), hi = prim::from_float<true>(x[2 * i + 1]);
      w.w[i] = uint32_t(lo) | (uint32_t(hi) << 16);
      x[2 * i] -= prim::to_float<true>(lo);
      x[2 * i + 1] -= prim::to_float<true>(hi);
    }
    *reinterpret_cast<Vec16*>(tile + q * part_elems + off) = w;
  }
}

// Loads rows [r0, r0 + ROWS) x columns [c0, c0 + W) of head (b, h) of x (rows offset by x.shift
// already in r0), mapped, into a swizzled tile as NP parts. All 128 threads.
template <int W, int ROWS, int NP>
EFFATTN_DEVICE void load_tile_parts(uint16_t* tile, int part_elems, const LinRows& x, int b, int h, int r0, int c0) {
  constexpr int C = W / 8;
  for (int idx = prim::thread_x(); idx < ROWS * C; idx += 128) {
    const int r = idx / C, ch = idx % C;
    float v[8];
    load8(v, x, b, h, r0 + r, c0 + 8 * ch);
    put8_parts<W, NP>(tile, part_elems, r, ch, v);
  }
}

// A per-row scalar: mode 1 one, 2 loaded from v[r]; zero outside [0, L).
EFFATTN_DEVICE float row_scalar(const float* v, int r, int L, int mode) {
  if (mode == 0 || r < 0 || r >= L) return 0.f;
  return mode == 2 ? v[r] : 1.f;
}

// Stores x into element (r, c) of a swizzled 16-bit tile of W columns, as NP bf16 parts (part p
// at tile + p * part_elems).
template <int W, int NP>
EFFATTN_DEVICE void put_parts(uint16_t* tile, int part_elems, int r, int c, float x) {
  const int off = Tile<W>::offset(r, c >> 3) + (c & 7);
#pragma unroll
  for (int q = 0; q < NP; ++q) {
    const uint16_t h = prim::from_float<true>(x);
    tile[q * part_elems + off] = h;
    x -= prim::to_float<true>(h);
  }
}

// d += a b over the part products of order < NP, smallest first.
template <int NP>
EFFATTN_DEVICE void mma_parts(float (&d)[4], const uint32_t (&a)[NP][4], const uint32_t (&b0)[NP],
                              const uint32_t (&b1)[NP]) {
#pragma unroll
  for (int o = NP - 1; o >= 0; --o)
#pragma unroll
    for (int i = 0; i <= o; ++i) prim::mma_16816<true>(d, a[i], b0[o - i], b1[o - i]);
}

// A operand (16 rows from ra, reduction step kk) from a tile stored row-major over the reduction.
template <int W, int NP>
EFFATTN_DEVICE void a_rows(uint32_t (&a)[NP][4], const uint16_t* t, int part_elems, int ra, int kk) {
  const int lane = prim::thread_x() & 31;
  const int off = Tile<W>::offset(ra + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * kk + (lane >> 4));
#pragma unroll
  for (int q = 0; q < NP; ++q) prim::ldmatrix_x4(a[q], t + q * part_elems + off);
}

// A operand of the transpose: rows [m0, m0 + 16) of the product are columns of the tile, which
// is stored reduction-major (row = reduction index); ldmatrix.trans hands out A's fragments.
template <int W, int NP>
EFFATTN_DEVICE void a_cols(uint32_t (&a)[NP][4], const uint16_t* t, int part_elems, int m0, int kk) {
  const int lane = prim::thread_x() & 31;
  const int off = Tile<W>::offset(16 * kk + (lane & 7) + 8 * (lane >> 4), (m0 >> 3) + ((lane >> 3) & 1));
#pragma unroll
  for (int q = 0; q < NP; ++q) prim::ldmatrix_x4_trans(a[q], t + q * part_elems + off);
}

// acc (16 x 8 NA) += a (16 x 16) B, B = rows [16 kk, 16 kk + 16) of a reduction-major tile, its
// 16-column blocks below n16 only.
template <int W, int NP, int NA>
EFFATTN_DEVICE void mma_a_tile(float (&acc)[NA][4], const uint32_t (&a)[NP][4], const uint16_t* t, int part_elems,
                               int kk, int n16) {
  const int lane = prim::thread_x() & 31;
#pragma unroll
  for (int dd = 0; dd < NA / 2; ++dd) {
    if (dd >= n16) break;
    const int off = Tile<W>::offset(kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * dd + (lane >> 4));
    uint32_t b[4][NP];
#pragma unroll
    for (int q = 0; q < NP; ++q) {
      uint32_t r[4];
      prim::ldmatrix_x4_trans(r, t + q * part_elems + off);
      b[0][q] = r[0], b[1][q] = r[1], b[2][q] = r[2], b[3][q] = r[3];
    }
    mma_parts<NP>(acc[2 * dd], a, b[0], b[1]);
    mma_parts<NP>(acc[2 * dd + 1], a, b[2], b[3]);
  }
}

// s (16 x 8 NS) += a B^T, B = the rows of a tile stored row-major over the reduction, 16-row blocks
// [n_lo, n_hi) only.
template <int W, int NP, int NS>
EFFATTN_DEVICE void mma_a_rows_t(float (&s)[NS][4], const uint32_t (&a)[NP][4], const uint16_t* t, int part_elems,
                                 int kk, int n_lo, int n_hi) {
  const int lane = prim::thread_x() & 31;
#pragma unroll
  for (int nn = 0; nn < NS / 2; ++nn) {
    if (nn < n_lo || nn >= n_hi) continue;
    const int off = Tile<W>::offset(nn * 16 + (lane & 7) + 8 * (lane >> 4), 2 * kk + ((lane >> 3) & 1));
    uint32_t b[4][NP];
#pragma unroll
    for (int q = 0; q < NP; ++q) {
      uint32_t r[4];
      prim::ldmatrix_x4(r, t + q * part_elems + off);
      b[0][q] = r[0], b[1][q] = r[1], b[2][q] = r[2], b[3][q] = r[3];
    }
    mma_parts<NP>(s[2 * nn], a, b[0], b[1]);
    mma_parts<NP>(s[2 * nn + 1], a, b[2], b[3]);
  }
}

// The A operand for reduction step kk from fp32 accumulators x (16 x 8 NS), split into NP parts.
template <int NP, int NS>
EFFATTN_DEVICE void acc_to_a_parts(uint32_t (&a)[NP][4], const float (&x)[NS][4], int kk) {
  float v[8] = {x[2 * kk][0], x[2 * kk][1], x[2 * kk][2], x[2 * kk][3],
                x[2 * kk + 1][0], x[2 * kk + 1][1], x[2 * kk + 1][2], x[2 * kk + 1][3]};
#pragma unroll
  for (int q = 0; q < NP; ++q)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = prim::from_float<true>(v[2 * i]), hi = prim::from_float<true>(v[2 * i + 1]);
      a[q][i] = uint32_t(lo) | (uint32_t(hi) << 16);
      v[2 * i] -= prim::to_float<true>(lo);
      v[2 * i + 1] -= prim::to_float<true>(hi);
    }
}

// Sum over the 4 lanes that share a row of an accumulator fragment.
EFFATTN_DEVICE float row_sum4(float x) {
  x += prim::shfl_xor_f(x, 1);
  x += prim::shfl_xor_f(x, 2);
  return x;
}

}  // namespace lin
}  // namespace effattn
