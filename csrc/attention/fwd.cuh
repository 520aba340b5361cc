// Forward kernel: FlashAttention-2 (Dao 2023, Alg. 1) on mma.sync m16n8k16, ldmatrix and cp.async.
//
// One block of 4 warps per (query tile of BM = 4 WM rows, b, h), 1-D grid; warp w owns rows [WM w, WM w + WM):
// WM = 32 (two m16 row blocks, 128-row tiles: each K and V fragment read from shared memory feeds two
// products) or WM = 16 (64-row tiles: head dim 256, the bias-tensor and relative-key instances, block
// layouts, devices whose shared memory holds fewer than two 128-row blocks per SM; FwdConfig). Per key
// tile (BN keys): S = Q K^T (Q and K from swizzled shared memory through ldmatrix), the online softmax in
// registers, O += P V (P straight from the S accumulators, V through ldmatrix.trans). cp.async, one
// buffer per operand, two barriers per key tile (FA-2's placement): "K(t) ready" (which also ends every
// warp's P V(t-1), so V(t) is then issued into its buffer and lands while S(t) is computed), and
// "V(t) ready" (which also ends every warp's S(t), so K(t+1) is then issued and lands while the softmax
// and P V(t) run). The 128 x 64 tile (head dim 128, FwdConfig<128, 32, 64>) runs two softmax steps of 32 keys
// per key tile: S of the first half, its softmax, S of the second half, "V ready", P V of the first half, the
// second half's softmax and P V (two barriers per 64 keys, where 128 x 32 tiles take four).
#pragma once

#include <atomic>

#include "attention/common.cuh"
#include "attention/key_rows.cuh"

namespace effattn {

// WM: query rows per warp (16 or 32; `kWide` says whether a head-dim bucket has the 32-row instance: at
// 256, 32 rows' output accumulators alone would take 256 registers per thread). KT: the key tile, 0 for the
// default below; 64 with WM = 32 at head dim 128 is the 128 x 64 tile (fwd_long_keys).
template <int HD, int WM = 16, int KT = 0>
struct FwdConfig {
  static_assert(WM == 16 || WM == 32, "a warp owns one or two m16 row blocks");
  static constexpr bool kWide = HD <= 128;
  static constexpr int MB = WM / 16;             // m16 row blocks per warp
  static constexpr int BM = 4 * WM;              // kBlockM (64) for WM = 16
  // key tiles of 32 at head dim 256, and by default at 128 with 32 rows per warp
  static constexpr int BN = KT ? KT : (HD >= 256 || (WM == 32 && HD >= 128) ? 32 : 64);
  // keys per softmax step: 32 with 32 rows per warp at head dim 128, so that a 64-key tile runs two steps
  // (with the whole tile's S, 64 fp32 for two row blocks next to their O, 128 fp32, ptxas went past 255
  // registers with 20-96 bytes of spills in every mask kind: nvcc 13.0, sm_80 / sm_90a); the tile, else
  static constexpr int KS = WM == 32 && HD >= 128 ? 32 : BN;
  static_assert(BN == KS || (BN == 2 * KS && WM == 32), "one softmax step per key tile, or two of a 128 x 64 tile");
  static constexpr int kSmemBytes = (BM + 2 * BN) * HD * 2;   // Q, K, V tiles
  // RELK: the band of r rows one (query tile, key tile) pair reads (BM + BN - 1 distances, one spare
  // row), the term's query tile, and each warp's fp32 products with its 16 + BN band rows
  static constexpr int kBand = BM + BN;
  static constexpr int kWarpBand = 16 + BN;
  static constexpr int kRelkSmemBytes = kSmemBytes + (kBand + BM) * HD * 2 + 4 * 16 * kWarpBand * 4;
};

// The device's opt-in shared memory per block (under the emulation: the emulated device's limit).
#if defined(EFFATTN_CUDA_EMU)
inline int device_smem_optin() { return int(emu::smem_limit()); }
#else
// Read once per device (every forward call asks, a kAny call twice): cached as bytes + 1, 0 = not read yet.
inline int device_smem_optin() {
  static std::atomic<int> known[64];
  int dev = 0, bytes = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;   // unknown: the 64-row tiles, which fit every sm_80+ GPU
  if (dev >= 0 && dev < 64) {
    const int seen = known[dev].load(std::memory_order_relaxed);
    if (seen) return seen - 1;
  }
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 0;
  if (dev >= 0 && dev < 64) known[dev].store(bytes + 1, std::memory_order_relaxed);
  return bytes;
}
#endif

// Whether a 128-row call (fwd_wide) of an instance that has it runs the 128 x 64 tile (FwdConfig<HD, 32, 64>:
// head dim 128, key tiles of 64 in two softmax steps of 32; mask kinds kDense, kCausal, kWindow without dropout,
// the instances where it has no spills) instead of 128 x 32: two such blocks (64 KB of tiles at head dim 128)
// fit an SM: sm_80 (164 KB per SM) and sm_90 / sm_100 (228 KB), not the 100 KB of sm_86 / sm_89 / sm_120.
// effattn/backends/cuda/resources.py (`fwd_key_tile`) makes the same choice for explain.
template <int HD>
inline bool fwd_long_keys(int smem_optin) {
  return 2 * (FwdConfig<HD, 32, 64>::kSmemBytes + 1024) <= smem_optin + 1024;
}

// Whether a call with a block layout can run 128-row tiles: its tile lists hold the 128-row tiles' rows after the
// 64-row ones (list_rows; effattn/tiles.py `layout_tile_lists`, `wide_m`), which the host builds for every layout
// of the mma.sync forward. A 128-row tile's list is the union of its two 64-row halves' lists: a key tile is full
// for it only where it is full for both halves (every element visible, window and layout blocks), partial where it
// is visible to either. So any block size and any window take 128-row tiles (fwd_wide_lists). (Packed sequences,
// which the API does not combine with a layout, would need lists per segment: 64 rows.)
inline bool fwd_layout_wide(const AttnParams& p) {
  return p.lists && !p.cu_q && p.list_rows == int((p.Lq + 63) / 64 + (p.Lq + 127) / 128);
}

// The parameters of a 128-row call with a layout (fwd_layout_wide): the lists from the 128-row tiles' first row,
// so that tile mt reads row mt, and partial tiles read the layout per element unless the tiles nest in its blocks
// (blocks of a multiple of 128 rows: a 128-row tile lies in one block row; the lists' 64-key tiles nest in them).
// Without lists: p unchanged.
inline AttnParams fwd_wide_lists(const AttnParams& p) {
  AttnParams w = p;
  if (!p.lists) return w;
  w.lists = p.lists + int64_t((p.Lq + 63) / 64) * p.list_t;
  w.lay_check = p.lay_check || p.lay_bs % 128 != 0;
  return w;
}

// Whether a plain forward call (no bias tensors or relative keys) runs the 128-row instance (WM = 32) of
// head-dim bucket HD on a device with `smem_optin` bytes of opt-in shared memory per block: the bucket has
// it (FwdConfig::kWide), a block layout where its lists have the 128-row tiles' rows (fwd_layout_wide), and two
// such blocks fit an SM (each takes its tiles + the 1 KB the driver reserves per block; an SM has smem_optin +
// 1 KB: sm_80 164 KB, sm_90 228 KB, sm_86 / sm_89 / sm_120 100 KB, which hold two at every such bucket: 48 KB at
// head dim 128). A layout at head dim 128 runs the 128 x 64 tile (its lists' key tiles are 64): kLayout's without
// dropout (not kAny's: key padding or positions keep 64 rows, and so does dropout), where two of those fit
// (fwd_long_keys: not on the 99 KB GPUs). effattn/backends/cuda/resources.py (`fwd_rows`) makes the same choice
// for explain.
template <int HD>
inline bool fwd_wide(const AttnParams& p, int smem_optin) {
  using Wide = FwdConfig<HD, 32>;
  if (!Wide::kWide) return false;
  if (p.lists || p.layout || p.lay_check) {
    if (!fwd_layout_wide(p)) return false;
    if (HD >= 128) return !p.kpm && !p.q_pos && !p.dropout && fwd_long_keys<HD>(smem_optin);
  }
  return 2 * (Wide::kSmemBytes + 1024) <= smem_optin + 1024;
}

// RELK: the row of r for distance d (attention.h).
EFFATTN_DEVICE int relk_index(const AttnParams& p, int d) {
  return p.relk_max < 0 ? imin(imax(d, 0), p.relk_n - 1) : imin(imax(d, -p.relk_max), p.relk_max) + p.relk_max;
}

// RELK: the rows of r for distances d0 + t, t < ROWS (clamped to the table). All 128 threads.
template <int HD, int ROWS>
EFFATTN_DEVICE void load_relk_rows(uint16_t* tile, const AttnParams& p, int h, int d0) {
  const uint16_t* rb = static_cast<const uint16_t*>(p.relk) + h * p.relk_h;
  load_rows<HD, ROWS>(tile, rb, [&](int t) { return rb + int64_t(relk_index(p, d0 + t)) * p.relk_l; }, 0, ROWS, p.D);
}

// acc (16 x NB) = A B^T for warp w: A = rows [16 w, 16 w + 16) of tile `sa`, B = rows [16 w, 16 w + NB) of tile
// `sb` (a band: the rows of a 16-row shift keep their swizzle), the first `k16` 16-wide steps.
template <int HD, int NB, bool BF16>
EFFATTN_DEVICE void warp_band_product(float (&acc)[NB / 8][4], const uint16_t* sa, const uint16_t* sb, int k16) {
  const int warp = prim::thread_x() >> 5;
#pragma unroll
  for (int j = 0; j < NB / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  mma_rows_rows<HD, NB, BF16>(acc, sa, warp * 16, sb + warp * 16 * HD, k16);
}

// A warp's 16 x NB fp32 accumulators into its block w of shared memory (row-major, row stride NB).
template <int NB>
EFFATTN_DEVICE void store_acc(float* w, const float (&x)[NB / 8][4]) {
  const int lane = prim::thread_x() & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int j = 0; j < NB / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) w[(g + 8 * (e >> 1)) * NB + 8 * j + 2 * t4 + (e & 1)] = x[j][e];
}

// store_acc, then, after a barrier, element (ri, c) of a 16 x 8 NT tile from column ri + SH - c of the block
// into y (ADD: added to y): the relative shift (SH = the tile's width - 1). All 128 threads (the barrier);
// each warp reads only its own block.
template <int NB, int SH, int NT, bool ADD = false>
EFFATTN_DEVICE void skew_read(float* w, const float (&x)[NB / 8][4], float (&y)[NT][4]) {
  const int lane = prim::thread_x() & 31, g = lane >> 2, t4 = lane & 3;
  store_acc<NB>(w, x);
  prim::sync_block();
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ri = g + 8 * (e >> 1), c = 8 * j + 2 * t4 + (e & 1);
      const float v = w[ri * NB + ri + SH - c];
      y[j][e] = ADD ? y[j][e] + v : v;
    }
}

// RELK: adds query_i . relk[h, idx(pos(i) - j)] to this warp's raw S tile (rows m0 + 16 warp + [0, 16),
// keys n0 + [0, BN)). The pair's distances are d0 + t, t < BM + BN - 1, d0 = pos(m0) - (n0 + BN - 1):
// the band rows relk[h, idx(d0 + t)] are loaded (cp.async, waited at once: every earlier group lands too),
// warp w multiplies its query rows with band rows [16 w, 16 w + 16 + BN) into an fp32 block of its own in
// shared memory, and element (ri, jl) of the tile reads column ri + BN - 1 - jl of it: the relative
// shift, done in the tile. All 128 threads; sR is free again after the caller's next block sync.
template <int HD, int BM, int BN, bool BF16, int NS>
EFFATTN_DEVICE void relk_add(const AttnParams& p, int h, int m0, int n0, uint16_t* sR, const uint16_t* sQt,
                             float* sPR, int kd, float (&s)[NS][4]) {
  constexpr int WB = 16 + BN;
  const int warp = prim::thread_x() >> 5;
  load_relk_rows<HD, BM + BN>(sR, p, h, m0 + p.off - (n0 + BN - 1));
  prim::cp_async_commit();
  prim::cp_async_wait<0>();
  prim::sync_block();
  float pr[WB / 8][4];
  warp_band_product<HD, WB, BF16>(pr, sQt, sR, kd);
  skew_read<WB, BN - 1, NS, true>(sPR + warp * 16 * WB, pr, s);
}

// What a forward block works on: the (b, h) pair, the query tile and the base pointers of its
// operands (packed: its segment's, `segment_view`).
struct FwdBlock {
  int b, h, bh, mt, m0;
  const uint16_t *qb, *kb, *vb;
  const uint8_t *kpm, *lay;
};

EFFATTN_DEVICE FwdBlock fwd_block(const AttnParams& p, const GridTile& gt, int BM) {
  FwdBlock f;
  f.mt = gt.t, f.b = gt.b, f.h = gt.h;
  f.bh = f.b * p.H + f.h;
  const int hk = f.h / p.G;
  f.m0 = f.mt * BM;
  f.qb = static_cast<const uint16_t*>(p.q) + f.b * p.q_b + f.h * p.q_h + p.q0 * p.q_l;
  f.kb = static_cast<const uint16_t*>(p.k) + f.b * p.k_b + hk * p.k_h + p.k0 * p.k_l;
  f.vb = static_cast<const uint16_t*>(p.v) + f.b * p.v_b + hk * p.v_h + p.k0 * p.v_l;
  f.kpm = p.kpm ? p.kpm + f.b * p.kpm_b : nullptr;
  f.lay = p.layout ? p.layout + f.h * p.lay_h : nullptr;
  return f;
}

// Masks one S tile (to log2 units; -inf where a key is not visible) and runs the online softmax
// (Alg. 1 lines 8-10) on this thread's rows row0 (r = 0) and row0 + 8 (r = 1): S becomes P in place
// (dropped entries 0), m_i / l_i are updated and alpha[r] receives the factor by which the row's
// output accumulators must be rescaled (`rescale_rows`; the Hopper forward applies it only once the
// previous tile's P V has retired). S is in the m16n8 accumulator layout (mma.sync, or a warp's 16
// rows of a wgmma accumulator: the same fragment). KIND (MaskKind) compiles out what the kernel
// instance never sees: every mask test for kDense, the layout and key padding for kCausal / kWindow, key
// padding for kLayout (kAny: positions too, on every tile); DROP (default: kAny's) compiles the dropout keep-mask in.
// SCORE: -1 reads p.score per element (score_log2), 0 compiles the score terms out (the caller knows
// p.score is 0), 1 keeps them. TERMS: the bias tensors of `br` join the scores, as the one number `cb`
// (log2 units) where the tile is constant (`cfast`: const_bias), else per element.
template <int KIND, bool TERMS = false, int SCORE = -1, bool DROP = KIND == kAny, int NS>
EFFATTN_DEVICE void softmax_scores(const AttnParams& p, const uint8_t* lay, const uint8_t* kpm, int bh, int row0,
                                   int n0, bool masked, float slope, float (&s)[NS][4], float (&m_i)[2],
                                   float (&l_i)[2], float (&alpha)[2], const BiasRow& br = BiasRow{},
                                   bool cfast = false, float cb = 0.f) {
  const int t4 = prim::thread_x() & 3;
#pragma unroll
  for (int j = 0; j < NS; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = row0 + 8 * (e >> 1), kj = n0 + 8 * j + 2 * t4 + (e & 1);
      float dcap;
      float x = SCORE == 0 ? s[j][e] * p.qk_scale : score_log2(p, s[j][e], slope, i, kj, dcap);   // log2 units
      if (TERMS) x += cfast ? cb : bias_terms(p, br, i, kj) * 1.4426950408889634f;
      if (KIND == kAny && p.q_pos) x = pos_score_log2(p, pos_rule_at(p, q_pos_row(p, bh), k_pos_row(p, bh), i, kj), x);
      if (KIND != kDense && masked && !visible_kind<KIND>(p, lay, i, kj)) x = -INFINITY;
      if (KIND == kAny && kpm && (kj >= p.Lk || kpm[kj * p.kpm_l])) x = -INFINITY;
      s[j][e] = x;
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
    mx = fmaxf(mx, prim::shfl_xor_f(mx, 1));
    mx = fmaxf(mx, prim::shfl_xor_f(mx, 2));
    const float m_new = fmaxf(m_i[r], mx);
    // a row that has seen nothing keeps m = -inf; the shift 0 keeps exp2(-inf - 0) = 0, not NaN
    const float m_ref = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = prim::exp2(m_i[r] - m_ref);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float pv = prim::exp2(s[j][2 * r + e] - m_ref);
        sum += pv;
        // the normalizer sums undropped probabilities; dropout acts on P V only
        if (DROP && p.dropout && !dropout_keep(p, bh, row0 + 8 * r, n0 + 8 * j + 2 * t4 + e)) pv = 0.f;
        s[j][2 * r + e] = pv;
      }
    l_i[r] = l_i[r] * alpha[r] + sum;                  // per-thread partial row sums
    m_i[r] = m_new;
  }
}

// The output accumulators of rows row0 (r = 0) and row0 + 8 (r = 1) times alpha[r].
template <int ND>
EFFATTN_DEVICE void rescale_rows(float (&acc)[ND][4], const float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int j = 0; j < ND; ++j) {
      acc[j][2 * r] *= alpha[r];
      acc[j][2 * r + 1] *= alpha[r];
    }
}

// softmax_scores, then the rescale of acc (the mma.sync forward: its P V of the last tile is done).
template <int KIND, bool TERMS = false, bool DROP = KIND == kAny, int NS, int ND>
EFFATTN_DEVICE void softmax_step(const AttnParams& p, const uint8_t* lay, const uint8_t* kpm, int bh, int row0,
                                 int n0, bool masked, float slope, float (&s)[NS][4], float (&acc)[ND][4], float (&m_i)[2],
                                 float (&l_i)[2], const BiasRow& br = BiasRow{}, bool cfast = false, float cb = 0.f) {
  float alpha[2];
  softmax_scores<KIND, TERMS, -1, DROP>(p, lay, kpm, bh, row0, n0, masked, slope, s, m_i, l_i, alpha, br, cfast, cb);
  rescale_rows(acc, alpha);
}

// Alg. 1 lines 12-13 for this thread's rows row0, row0 + 8: O = O / l, L = m + log(l); a row that
// saw no key: O = 0, L = -inf.
template <bool BF16, int ND>
EFFATTN_DEVICE void store_rows(const AttnParams& p, int b, int h, int bh, int row0, const float (&acc)[ND][4],
                               const float (&m_i)[2], const float (&l_i)[2]) {
  const int t4 = prim::thread_x() & 3;
  const int64_t obase = b * p.o_b + h * p.o_h + p.q0 * p.o_l;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_i[r];
    l += prim::shfl_xor_f(l, 1);
    l += prim::shfl_xor_f(l, 2);
    float m = m_i[r], scale_o = 1.f;
    if (p.sinks) {                                     // the sink's weight joins the normalizer only
      const float sk = p.sinks[h] * 1.4426950408889634f;
      const float m_new = fmaxf(m, sk);
      scale_o = prim::exp2(m - m_new);                 // 0 for a row that saw no key
      l = l * scale_o + prim::exp2(sk - m_new);
      m = m_new;
    }
    const bool empty = l == 0.f;
    const float f = empty ? 0.f : scale_o * (p.dropout ? p.inv_keep : 1.f) / l;
    const int i = row0 + 8 * r;
    if (i < p.Lq) {
#pragma unroll
      for (int j = 0; j < ND; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = 8 * j + 2 * t4 + e;
          if (c >= p.Dv_out) continue;
          const int64_t at = obase + int64_t(i) * p.o_l + c;
          if (p.o_f32) static_cast<float*>(p.o)[at] = acc[j][2 * r + e] * f;
          else static_cast<uint16_t*>(p.o)[at] = prim::from_float<BF16>(acc[j][2 * r + e] * f);
        }
      if (t4 == 0) p.lse[q_row(p, b, h, i)] = empty ? -INFINITY : (m + log2f(l)) * 0.6931471805599453f;
    }
  }
}

// acc[mb] (16 x NB) += A_mb B^T for a warp's MB row blocks: A_mb = rows [ra + 16 mb, ra + 16 mb + 16) of tile
// `sa`, B = rows [0, NB) of tile `sb`, the first `k16` 16-wide steps; each B fragment is read from shared
// memory once for the MB products (each accumulator sums its products in mma_rows_rows' order: MB = 1 is
// that function, and every MB gives the same bits).
template <int HD, int NB, bool BF16, int MB>
EFFATTN_DEVICE void mma_rows_rows_mb(float (&acc)[MB][NB / 8][4], const uint16_t* sa, int ra, const uint16_t* sb,
                                     int k16) {
  const int lane = prim::thread_x() & 31;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    if (kk >= k16) break;
    uint32_t a[MB][4];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
      prim::ldmatrix_x4(a[mb], sa + Tile<HD>::offset(ra + 16 * mb + (lane & 7) + 8 * ((lane >> 3) & 1),
                                                     2 * kk + (lane >> 4)));
#pragma unroll
    for (int nn = 0; nn < NB / 16; ++nn) {
      uint32_t b[4];
      prim::ldmatrix_x4(b, sb + Tile<HD>::offset(nn * 16 + (lane & 7) + 8 * (lane >> 4), 2 * kk + ((lane >> 3) & 1)));
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) {
        prim::mma_16816<BF16>(acc[mb][2 * nn], a[mb], b[0], b[1]);
        prim::mma_16816<BF16>(acc[mb][2 * nn + 1], a[mb], b[2], b[3]);
      }
    }
  }
}

// O += P V for a warp's MB row blocks: acc[mb] (16 x 8 NA) += a[mb] (16 x 16, reduction step kk) B, B = rows
// [16 kk, 16 kk + 16) of tile `sb` (ldmatrix.trans), columns below `width` only; each V fragment read once
// for the MB products (mma_a_rows with c0 = 0 per row block, the same bits).
template <int HD, int NA, bool BF16, int MB>
EFFATTN_DEVICE void mma_a_rows_mb(float (&acc)[MB][NA][4], const uint32_t (&a)[MB][4], const uint16_t* sb, int kk,
                                  int width) {
  const int lane = prim::thread_x() & 31;
#pragma unroll
  for (int dd = 0; dd < NA / 2; ++dd) {
    if (16 * dd >= width) break;
    uint32_t b[4];
    prim::ldmatrix_x4_trans(b, sb + Tile<HD>::offset(kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * dd + (lane >> 4)));
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
      prim::mma_16816<BF16>(acc[mb][2 * dd], a[mb], b[0], b[1]);
      prim::mma_16816<BF16>(acc[mb][2 * dd + 1], a[mb], b[2], b[3]);
    }
  }
}

// TERMS: the instance with bias tensors (relative table, adaptive span, dense bias; KIND = kAny). RELK: the
// instance with relative keys (KIND = kAny; relk_add per tile). DROP: the dropout code (the Philox keep-mask) is
// compiled in (attention/inst/: an instance per mask kind and DROP). WM: query rows per warp (FwdConfig); the
// TERMS and RELK instances keep 16 (their per-warp band products and shared-memory blocks are for 16 rows).
// ROWS: where key / value rows are read (key_rows.cuh: the strided tensors, or pages through a block table).
// KT: the key tile (FwdConfig; 0: the default).
template <int HD, bool BF16, int KIND, bool TERMS = false, bool RELK = false, bool DROP = KIND == kAny, int WM = 16,
          class ROWS = StridedRows, int KT = 0>
EFFATTN_FWD_KERNEL attn_fwd_kernel(const typename ROWS::Params kparams) {
  const AttnParams& params = ROWS::attn(kparams);
  using Cfg = FwdConfig<HD, WM, KT>;
  static_assert(WM == 16 || (Cfg::kWide && !TERMS && !RELK), "32 rows per warp: head dims up to 128, no terms");
  constexpr int BM = Cfg::BM, BN = Cfg::BN, MB = Cfg::MB;
  constexpr int KS = Cfg::KS, NSUB = BN / KS;   // keys per softmax step, steps per key tile
  constexpr int NS = KS / 8;        // 8-wide key subtiles of S
  constexpr int ND = HD / 8;        // 8-wide column subtiles of O
  EFFATTN_SMEM(smem);
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sK = sQ + BM * HD;
  uint16_t* sV = sK + BN * HD;
  [[maybe_unused]] uint16_t* sR = sV + BN * HD;         // RELK: the band of r, the term's query tile,
  [[maybe_unused]] uint16_t* sQr = sR + Cfg::kBand * HD;  //   the warps' products (FwdConfig)
  [[maybe_unused]] float* sPR = reinterpret_cast<float*>(sQr + BM * HD);

  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2;
  GridTile gt = grid_tile((params.Lq + BM - 1) / BM, params.H);
  AttnParams p = block_view<TERMS>(params, gt);
  ROWS::view(kparams, p, gt.b);                         // paged: the sequence's own key count
  if (gt.t * BM >= p.Lq) return;                       // packed: past the segment's queries (uniform)
  const FwdBlock fb = fwd_block(p, gt, BM);
  const int b = fb.b, h = fb.h, bh = fb.bh, mt = fb.mt, m0 = fb.m0;
  const uint16_t *qb = fb.qb, *kb = fb.kb, *vb = fb.vb;
  const uint8_t *kpm = KIND == kAny ? fb.kpm : nullptr, *lay = fb.lay;
  const int kd = (p.D + 15) / 16;                       // 16-wide steps of Q K^T that hold data

  // a layout's lists: the 128-row tiles' where WM = 32 (the launcher passes fwd_wide_lists' view)
  const Schedule sched = key_schedule(p, h, mt, BM, BN);
  const int n_tiles = sched.count();

  load_tile<HD, BM>(sQ, qb, p.q_l, m0, p.Lq, p.D);
  if (RELK && p.relkq)
    load_tile<HD, BM>(sQr, static_cast<const uint16_t*>(p.relkq) + b * p.relkq_b + h * p.relkq_h, p.relkq_l, m0, p.Lq, p.D);
  [[maybe_unused]] const uint16_t* sQt = RELK && p.relkq ? sQr : sQ;   // RELK: the query of the position term
  const TileCopy<HD, BN> kv_map;                         // this thread's K / V copies (computed once)
  if (n_tiles > 0)
    ROWS::template load<HD, BN, false>(kparams, b, kv_map, sK, kb, p.k_l, sched.tile(0) * BN, p.Lk, p.D);
  prim::cp_async_commit();

  float acc[MB][ND][4];
#pragma unroll
  for (int mb = 0; mb < MB; ++mb) zero_acc(acc[mb]);
  float m_i[MB][2], l_i[MB][2];
#pragma unroll
  for (int mb = 0; mb < MB; ++mb) m_i[mb][0] = m_i[mb][1] = -INFINITY, l_i[mb][0] = l_i[mb][1] = 0.f;
  const int row0 = m0 + warp * WM + g;                  // row block mb's rows: row0 + 16 mb, row0 + 16 mb + 8
  const float slope = alibi_slope(p, b, h);
  const BiasRow br = TERMS ? bias_row(p, b, h) : BiasRow{};

  for (int it = 0; it < n_tiles; ++it) {
    const int n0 = sched.tile(it) * BN;
    const bool masked = KIND != kDense && sched.masked(it);   // kDense: every tile is full
    prim::cp_async_wait<0>();                            // Q and K(t): this thread's copies have landed
    prim::sync_block();                                  // K ready: every thread's; every warp is done with V(t-1)
    ROWS::template load<HD, BN, true>(kparams, b, kv_map, sV, vb, p.v_l, n0, p.Lk, p.Dv);   // V(t) lands during S(t)
    prim::cp_async_commit();

    // S = Q K^T for this warp's WM rows and the first KS keys of the tile (all of them, NSUB = 1)
    float s[MB][NS][4];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) zero_acc(s[mb]);
    mma_rows_rows_mb<HD, KS, BF16, MB>(s, sQ, warp * WM, sK, kd);
    if constexpr (RELK) relk_add<HD, BM, BN, BF16>(p, h, m0, n0, sR, sQt, sPR, kd, s[0]);

    float cb = 0.f;                                      // TERMS: a constant tile's bias (log2 units)
    const bool cfast = TERMS && const_bias(p, br, m0, BM, n0, BN, cb);
    // P, packed to 16 bits as soon as a row block's softmax is done (half the registers of fp32 S): its
    // accumulator layout is the A-operand layout of the P V mma
    uint32_t pa[KS / 16][MB][4];
    if constexpr (NSUB == 2) {                           // 128 x 64: the first step's softmax, then S of the second
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) {
        softmax_step<KIND, TERMS, DROP>(p, lay, kpm, bh, row0 + 16 * mb, n0, masked, slope, s[mb], acc[mb], m_i[mb],
                                        l_i[mb], br, cfast, cb);
#pragma unroll
        for (int kk = 0; kk < KS / 16; ++kk) acc_to_a<BF16>(pa[kk][mb], s[mb], kk);
      }
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) zero_acc(s[mb]);
      mma_rows_rows_mb<HD, KS, BF16, MB>(s, sQ, warp * WM, sK + KS * HD, kd);   // rows KS.. keep their swizzle
    }

    prim::cp_async_wait<0>();                            // V(t): this thread's copies have landed
    if (masked || kpm)                                   // keys no row sees: zero values (NaN-safe), each thread
      zero_unseen<HD, BN>(sV, n0, [&](int j) {           //   in the chunks it copied (load_tile's map)
        return key_seen(p, lay, kpm, m0, m0 + BM, j);
      });
    prim::sync_block();                                  // V ready: every thread's; every warp is done with K(t)
    if (it + 1 < n_tiles)
      ROWS::template load<HD, BN, false>(kparams, b, kv_map, sK, kb, p.k_l, sched.tile(it + 1) * BN, p.Lk, p.D);
    prim::cp_async_commit();                             // K(t+1) lands during the softmax and P V(t)

    if constexpr (NSUB == 2) {                           // O += P V of the first step, before the second's rescale
#pragma unroll
      for (int kk = 0; kk < KS / 16; ++kk) mma_a_rows_mb<HD, ND, BF16, MB>(acc, pa[kk], sV, kk, p.Dv);
    }
    constexpr int nl = BN - KS;                          // the last step's first key in the tile
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
      softmax_step<KIND, TERMS, DROP>(p, lay, kpm, bh, row0 + 16 * mb, n0 + nl, masked, slope, s[mb], acc[mb],
                                      m_i[mb], l_i[mb], br, cfast, cb);
#pragma unroll
      for (int kk = 0; kk < KS / 16; ++kk) acc_to_a<BF16>(pa[kk][mb], s[mb], kk);
    }
    // O += P V
#pragma unroll
    for (int kk = 0; kk < KS / 16; ++kk) mma_a_rows_mb<HD, ND, BF16, MB>(acc, pa[kk], sV, nl / 16 + kk, p.Dv);
  }
  prim::cp_async_wait<0>();

#pragma unroll
  for (int mb = 0; mb < MB; ++mb) store_rows<BF16>(p, b, h, bh, row0 + 16 * mb, acc[mb], m_i[mb], l_i[mb]);
}

}  // namespace effattn
