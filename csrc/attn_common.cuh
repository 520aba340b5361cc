// Pieces shared by the forward and backward kernels: swizzled shared-memory tiles and their
// cp.async loads, the tile schedule (analytic causal/window runs or the packed layout lists), the
// elementwise visibility of a partial tile, and the dropout keep-mask (Philox, as Triton's).
#pragma once

#include "attention.h"
#include "prims.cuh"

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

// Loads rows [r0, r0 + ROWS) of a (L, width) matrix (row stride `ld` elements, width a multiple
// of 8) into a swizzled tile (layout `Lay`: offset(row, 16-byte chunk)), zero-filling rows >= L and
// columns >= width. All 128 threads.
template <int HD, int ROWS, class Lay = Tile<HD>>
EFFATTN_DEVICE void load_tile(uint16_t* tile, const uint16_t* base, int64_t ld, int r0, int L, int width) {
  constexpr int C = HD / 8;
  for (int idx = prim::thread_x(); idx < ROWS * C; idx += 128) {
    int r = idx / C, c = idx % C;
    int gr = r0 + r;
    bool ok = gr < L && c * 8 < width;
    const uint16_t* src = ok ? base + int64_t(gr) * ld + c * 8 : base;
    prim::cp_async_16(tile + Lay::offset(r, c), src, ok ? 16 : 0);
  }
}

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

// The key tiles a query tile visits (forward and dQ) or the query tiles a key tile visits (dK/dV):
// `n_full` unmasked tiles then `n_part` masked ones. Without a layout they are analytic: full
// [t1, t2), partial [t0, t1) and [t2, t3); with one, read from the packed lists.
struct Schedule {
  const int32_t* row;
  int n_full, n_part, wf, t0, t1, t2;
  EFFATTN_DEVICE int count() const { return n_full + n_part; }
  EFFATTN_DEVICE bool masked(int it) const { return it >= n_full; }
  EFFATTN_DEVICE int tile(int it) const {
    if (row) return it < n_full ? row[2 + it] : row[2 + wf + it - n_full];
    if (it < n_full) return t1 + it;
    int j = it - n_full;
    return j < t1 - t0 ? t0 + j : t2 + j - (t1 - t0);
  }
};

// Key tiles of query rows [m0, m0 + BM) (port of the Triton backend's `_key_tile_range`).
EFFATTN_DEVICE Schedule key_schedule(const AttnParams& p, int h, int mt, int BM, int BN) {
  Schedule s{};
  if (p.lists) {
    s.row = p.lists + h * p.list_h + mt * p.list_t;
    s.n_full = s.row[0];
    s.n_part = s.row[1];
    s.wf = p.list_wf;
    return s;
  }
  int m0 = mt * BM;
  int r1 = imin(m0 + BM, p.Lq) - 1;
  int lo = 0, hi = p.Lk, flo = 0, fhi = p.Lk;
  if (p.left >= 0) {
    lo = imax(m0 + p.off - p.left, 0);
    flo = imax(r1 + p.off - p.left, 0);
  }
  if (p.right >= 0) {
    hi = imax(imin(r1 + p.off + p.right + 1, p.Lk), 0);
    fhi = imax(imin(m0 + p.off + p.right + 1, p.Lk), 0);
  }
  int t0 = imin(lo, p.Lk) / BN;
  int t3 = hi > lo ? (hi + BN - 1) / BN : t0;
  int t1 = imin(imax((imin(flo, p.Lk) + BN - 1) / BN, t0), t3);
  int t2 = imin(imax(fhi / BN, t1), t3);
  s.t0 = t0, s.t1 = t1, s.t2 = t2;
  s.n_full = t2 - t1;
  s.n_part = (t1 - t0) + (t3 - t2);
  return s;
}

// Query tiles that see keys [n0, n0 + BN) (port of `_query_tile_range`); `lists` are the by-key ones.
EFFATTN_DEVICE Schedule query_schedule(const AttnParams& p, const int32_t* lists, int h, int nt, int BM, int BN) {
  Schedule s{};
  if (lists) {
    s.row = lists + h * p.list_h + nt * p.list_t;
    s.n_full = s.row[0];
    s.n_part = s.row[1];
    s.wf = p.list_wf;
    return s;
  }
  int n0 = nt * BN;
  int n1 = imin(n0 + BN, p.Lk) - 1;
  int lo = 0, hi = p.Lq, flo = 0, fhi = p.Lq;
  if (p.right >= 0) {
    lo = imax(n0 - p.off - p.right, 0);
    flo = imax(n1 - p.off - p.right, 0);
  }
  if (p.left >= 0) {
    hi = imax(imin(n1 - p.off + p.left + 1, p.Lq), 0);
    fhi = imax(imin(n0 - p.off + p.left + 1, p.Lq), 0);
  }
  if (n0 + BN > p.Lk) fhi = 0;
  int t0 = imin(lo, p.Lq) / BM;
  int t3 = hi > lo ? (hi + BM - 1) / BM : t0;
  int t1 = imin(imax((imin(flo, p.Lq) + BM - 1) / BM, t0), t3);
  int t2 = fhi == p.Lq ? (fhi + BM - 1) / BM : fhi / BM;
  t2 = imin(imax(t2, t1), t3);
  s.t0 = t0, s.t1 = t1, s.t2 = t2;
  s.n_full = t2 - t1;
  s.n_part = (t1 - t0) + (t3 - t2);
  return s;
}

// Elementwise visibility inside a partial tile (window, lengths, layout when tiles straddle its
// blocks). Key padding is applied separately, on every tile.
EFFATTN_DEVICE bool visible(const AttnParams& p, const uint8_t* lay, int i, int j) {
  if (i >= p.Lq || j >= p.Lk) return false;
  int pos = i + p.off;
  if (p.left >= 0 && j < pos - p.left) return false;
  if (p.right >= 0 && j > pos + p.right) return false;
  if (p.lay_check && !lay[int64_t(i / p.lay_bs) * p.lay_nkb + j / p.lay_bs]) return false;
  return true;
}

// Whether some query row in [i0, i1) sees key j: lengths, window, key padding (`kpm`: this batch
// entry's flags, or null) and a layout checked per layout block of those rows (exact).
EFFATTN_DEVICE bool key_seen(const AttnParams& p, const uint8_t* lay, const uint8_t* kpm, int i0, int i1, int j) {
  if (j >= p.Lk || (kpm && kpm[int64_t(j) * p.kpm_l])) return false;
  int lo = i0, hi = imin(i1, p.Lq) - 1;               // rows whose window holds j: pos - left <= j <= pos + right
  if (p.right >= 0) lo = imax(lo, j - p.off - p.right);
  if (p.left >= 0) hi = imin(hi, j - p.off + p.left);
  if (lo > hi) return false;
  if (!p.lay_check) return true;
  for (int qb = lo / p.lay_bs; qb <= hi / p.lay_bs; ++qb)
    if (lay[int64_t(qb) * p.lay_nkb + j / p.lay_bs]) return true;
  return false;
}

// Zeroes the rows (keys n0 + r) of a landed swizzled K or V tile for which `seen(key)` is false, so
// that whatever an ignored key holds (NaN, inf in padding) gives 0 * 0 in a product, never 0 * NaN.
// Masked tiles only; all 128 threads, between two block syncs.
template <int HD, int ROWS, class Lay = Tile<HD>, class Seen>
EFFATTN_DEVICE void zero_unseen(uint16_t* tile, int n0, const Seen& seen) {
  constexpr int C = HD / 8;
  for (int idx = prim::thread_x(); idx < ROWS * C; idx += 128) {
    const int r = idx / C, c = idx % C;
    if (seen(n0 + r)) continue;
    uint16_t* dst = tile + Lay::offset(r, c);
#pragma unroll
    for (int e = 0; e < 8; ++e) dst[e] = 0;
  }
}

// Triton's tl.philox(seed, c0, c1, c2, c3) with 10 rounds, first output word.
EFFATTN_DEVICE uint32_t philox_first(uint32_t k0, uint32_t k1, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    uint32_t a0 = c0, a2 = c2;
    c0 = prim::umulhi(0xCD9E8D57u, a2) ^ c1 ^ k0;
    c2 = prim::umulhi(0xD2511F53u, a0) ^ c3 ^ k1;
    c1 = 0xCD9E8D57u * a2;
    c3 = 0xD2511F53u * a0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

EFFATTN_DEVICE bool dropout_keep(const AttnParams& p, int bh, int i, int j) {
  return int(philox_first(p.seed_lo, p.seed_hi, uint32_t(i), uint32_t(j), uint32_t(bh), 0u) >> 8) >= p.drop_thresh;
}

}  // namespace effattn
