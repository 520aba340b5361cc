// Pieces shared by the softmax-attention kernels (forward, backward, decode): the tile schedule
// (analytic causal/window runs or the packed layout lists), the elementwise visibility of a
// partial tile, and the dropout keep-mask (Philox, as Triton's). Tiles and warp products are in
// common/tiles.cuh.
#pragma once

#include <type_traits>

#include "attention/attention.h"
#include "common/tiles.cuh"

namespace effattn {

// The (b, h, tile) of a block of a 1-D grid with `n_t` tiles per (b, h), tiles fastest (a grid's
// y size is limited to 65535, B * H is not); `heads`: H, or Hkv for the dK/dV pass.
struct GridTile {
  int b, h, t;
};

EFFATTN_DEVICE GridTile grid_tile(int n_t, int heads) {
  const int t = int(prim::block_x() % unsigned(n_t));
  const int bh = int(prim::block_x() / unsigned(n_t));
  return {bh / heads, bh % heads, t};
}

// The params of batch entry gt.b as a block works on them. Packed sequences (p.cu_q): segment gt.b as a
// plain call of one sequence (its lengths and bottom-right offset; q0 / k0: its first rows, which every
// row index adds) on batch entry 0 of the packed tensors, so gt.b becomes 0. Otherwise p itself. Only
// scalars change: the pointers stay kernel parameters (no registers held for them through the loops).
EFFATTN_DEVICE AttnParams segment_view(const AttnParams& p0, GridTile& gt) {
  AttnParams p = p0;
  if (!p0.cu_q) return p;
  p.q0 = p0.cu_q[gt.b], p.k0 = p0.cu_k[gt.b];
  p.Lq = p0.cu_q[gt.b + 1] - p.q0;
  p.Lk = p0.cu_k[gt.b + 1] - p.k0;
  p.off = p.Lk - p.Lq;
  gt.b = 0;
  return p;
}

// Row (b, h, i) of the fp32 row statistics (lse, Delta) and of dq; row (b, hk, j) of dk and dv.
EFFATTN_DEVICE int64_t q_row(const AttnParams& p, int b, int h, int i) { return b * p.rq_b + h * p.rq_h + p.q0 + i; }
EFFATTN_DEVICE int64_t k_row(const AttnParams& p, int b, int hk, int j) { return b * p.rk_b + hk * p.rk_h + p.k0 + j; }

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
// blocks; LAYOUT = false: a kernel instance that never sees a layout). Key padding is applied
// separately, on every tile.
template <bool LAYOUT = true>
EFFATTN_DEVICE bool visible(const AttnParams& p, const uint8_t* lay, int i, int j) {
  if (i >= p.Lq || j >= p.Lk) return false;
  int pos = i + p.off;
  if (p.left >= 0 && j < pos - p.left) return false;
  if (p.right >= 0 && j > pos + p.right) return false;
  if (LAYOUT && p.lay_check && !lay[int64_t(i / p.lay_bs) * p.lay_nkb + j / p.lay_bs]) return false;
  return true;
}

// What one forward kernel instance handles (the launcher picks the narrowest kind for a call; dropout
// is a template flag of its own, DROP, orthogonal to the kind):
// kDense: no window, layout or key padding, and Lk a multiple of the key tile, so that every key tile
// is full and the tile loop carries no mask or padding code; kCausal: window (-1, 0) without a layout
// or key padding (the diagonal's test `j <= i + off` with constant bounds; ragged lengths and packed
// sequences too); kWindow: any other sliding window and ragged lengths (the analytic schedule's partial
// tiles, checked elementwise without a layout; packed sequences: each segment's own Lk); kLayout: block
// layouts (the packed tile lists, their partial tiles checked per layout block) without key padding;
// kAny (padding): key padding or positions (AttnParams::q_pos) with anything else. The values 0..2 are those the Hopper forward is
// instantiated for (`coarse_kind`).
enum MaskKind : int { kDense = 0, kWindow = 1, kAny = 2, kCausal = 3, kLayout = 4 };

inline int mask_kind(const AttnParams& p, int block_n) {
  if (p.kpm || p.q_pos) return kAny;
  if (p.lists || p.layout || p.lay_check) return kLayout;
  if (p.left < 0 && p.right == 0) return kCausal;
  if (p.left >= 0 || p.right >= 0 || p.Lk % block_n != 0 || p.cu_q) return kWindow;
  return kDense;
}

// Returns launch(std::integral_constant<int, KIND>{}) for the MaskKind `kind` (kAny for any other value):
// fwd.cu's and bwd.cu's dispatch to their instances of each kind.
template <class Launch>
inline int with_mask_kind(int kind, const Launch& launch) {
  switch (kind) {
    case kDense: return launch(std::integral_constant<int, kDense>{});
    case kCausal: return launch(std::integral_constant<int, kCausal>{});
    case kWindow: return launch(std::integral_constant<int, kWindow>{});
    case kLayout: return launch(std::integral_constant<int, kLayout>{});
    default: return launch(std::integral_constant<int, kAny>{});
  }
}

// The kinds of an instance family built for kDense, kWindow and kAny only (the Hopper forward): causal
// runs the window instance, layouts the kAny one, and so does every call with dropout.
inline int coarse_kind(int kind, bool dropout) {
  if (dropout || kind == kLayout) return kAny;
  return kind == kCausal ? kWindow : kind;
}

// Positions (AttnParams::q_pos): the rule of query position qp and key position kp: kPosHidden (padding, or causal
// and later), kPosSelf (the query's own position: the constant score pos_self, no gradient to q or k) or kPosScore.
enum PosRule : int { kPosHidden = 0, kPosScore = 1, kPosSelf = 2 };

EFFATTN_DEVICE int pos_rule(const AttnParams& p, int qp, int kp) {
  if (kp < 0 || (p.pos_causal && kp > qp)) return kPosHidden;
  return kp == qp ? kPosSelf : kPosScore;
}

// The rule of query i and key j of a (b, h) from its rows of the positions (`qpos`, `kpos`: the (b, h) and (b, hk)
// bases; null without positions: kPosScore); rows past Lq or keys past Lk are hidden.
EFFATTN_DEVICE int pos_rule_at(const AttnParams& p, const int32_t* qpos, const int32_t* kpos, int i, int j) {
  if (!qpos) return kPosScore;
  if (i >= p.Lq || j >= p.Lk) return kPosHidden;
  return pos_rule(p, qpos[i], kpos[j]);
}

// A score x (log2 units) under rule r: -inf where hidden, pos_self (in log2 units) for the query's own key.
EFFATTN_DEVICE float pos_score_log2(const AttnParams& p, int r, float x) {
  return r == kPosHidden ? -INFINITY : r == kPosSelf ? p.pos_self * 1.4426950408889634f : x;
}

// The bases of (b, h)'s query positions and (b, h / G)'s key positions (null, null without positions).
EFFATTN_DEVICE const int32_t* q_pos_row(const AttnParams& p, int bh) {
  return p.q_pos ? p.q_pos + int64_t(bh) * p.Lq : nullptr;
}
EFFATTN_DEVICE const int32_t* k_pos_row(const AttnParams& p, int bh) {
  return p.k_pos ? p.k_pos + int64_t(bh / p.G) * p.Lk : nullptr;
}

// `visible` for a partial tile of a forward instance of mask kind KIND (kDense never asks).
template <int KIND>
EFFATTN_DEVICE bool visible_kind(const AttnParams& p, const uint8_t* lay, int i, int j) {
  if (KIND == kCausal) return i < p.Lq && j < p.Lk && j <= i + p.off;
  return visible<KIND == kAny || KIND == kLayout>(p, lay, i, j);
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
// Masked tiles only; all NT threads of the block. A thread zeroes exactly the chunks load_rows / load_tile
// (same ROWS, Lay, NT) gave it, so it may run right after that thread's own wait, before the barrier that
// publishes the tile (the forward), or between two block syncs.
template <int HD, int ROWS, class Lay = Tile<HD>, int NT = 128, class Seen>
EFFATTN_DEVICE void zero_unseen(uint16_t* tile, int n0, const Seen& seen) {
  constexpr int C = HD / 8;
  for (int idx = prim::thread_x(); idx < ROWS * C; idx += NT) {
    const int r = idx / C, c = idx % C;
    if (seen(n0 + r)) continue;
    uint16_t* dst = tile + Lay::offset(r, c);
#pragma unroll
    for (int e = 0; e < 8; ++e) prim::st_shared(dst + e, uint16_t(0));   // (wgmma reads them after a fence)
  }
}

// Score terms (AttnParams::score): the slope of ALiBi for (b, h), 0 without it.
EFFATTN_DEVICE float alibi_slope(const AttnParams& p, int b, int h) {
  return p.alibi ? p.alibi[int64_t(b) * p.alibi_b + h] : 0.f;
}

// The score of query i and key j in log2 units from the raw product x = q_i . k_j: scale, then the
// soft-cap and ALiBi when the call has score terms. `dcap` receives d(capped) / d(scaled), 1 - tanh^2
// (1 without a cap): the backward's dS is the gradient of the biased scores dT times it.
EFFATTN_DEVICE float score_log2(const AttnParams& p, float x, float slope, int i, int j, float& dcap) {
  dcap = 1.f;
  if (!p.score) return x * p.qk_scale;
  float s = x * p.scale;
  if (p.softcap > 0.f) {
    const float t = tanhf(s * p.inv_softcap);
    s = p.softcap * t;
    dcap = 1.f - t * t;
  }
  const int d = i + p.off - j;
  s -= slope * float(d < 0 ? -d : d);
  return s * 1.4426950408889634f;
}

// Bias tensors (relative table, adaptive span, dense bias): only the kernel instances compiled with
// TERMS = true evaluate them (has_bias_tensors). What one (b, h) reads of them:
struct BiasRow {
  const float* rel;              // the head's table row (null: no table)
  float z;                       // the head's span z (with span_z)
  const float* dense;            // the (b, h) base of the dense bias (null: none)
};

EFFATTN_DEVICE BiasRow bias_row(const AttnParams& p, int b, int h) {
  BiasRow r;
  r.rel = p.rel ? p.rel + int64_t(h) * p.rel_w : nullptr;
  r.z = p.span_z ? p.span_z[h] : 0.f;
  r.dense = p.bias ? p.bias + b * p.bias_b + h * p.bias_h : nullptr;
  return r;
}

// The relative table's entry for distance d: clamp(d, -M, M) + M (bidirectional) or clamp(d, 0, M).
EFFATTN_DEVICE int rel_index(const AttnParams& p, int d) {
  return p.rel_bidir ? imin(imax(d, -p.rel_max), p.rel_max) + p.rel_max : imin(imax(d, 0), p.rel_max);
}

// The adaptive span's (ramp + z - d) / ramp: the key is visible iff > 0, on the ramp iff in (0, 1].
EFFATTN_DEVICE float span_ratio(const AttnParams& p, float z, int d) {
  return (p.span_ramp + z - float(d)) / p.span_ramp;
}

// The bias tensors' sum at query i, key j in natural units; -inf beyond the span. The dense bias is
// read only inside [0, Lq) x [0, Lk) (a full tile's rows may run past Lq).
EFFATTN_DEVICE float bias_terms(const AttnParams& p, const BiasRow& br, int i, int j) {
  const int d = i + p.off - j;
  float t = 0.f;
  if (br.rel) t += br.rel[rel_index(p, d)];
  if (p.span_z) {
    const float r = span_ratio(p, br.z, d);
    t += r > 0.f ? logf(fminf(r, 1.f)) : -INFINITY;
  }
  if (br.dense && i < p.Lq && j < p.Lk) t += br.dense[int64_t(i) * p.bias_q + int64_t(j) * p.bias_k];
  return t;
}

// Whether the bias tensors' sum is one number on rows [i0, i0 + rows) x keys [j0, j0 + cols) of a tile
// (a constant tile: no dense bias; a relative table's distances all clamp to one entry, i.e. beyond its
// clip; the span's farthest distance still on its flat part, ratio > 1), and then that number in log2
// units in `c`: bias_terms at the tile's first element times log2(e), the bits every element's
// bias_terms(...) * log2(e) has there (the same entry, logf(1) for the span). The index and the ratio
// are monotone in d, so the tile's corner distances decide. The kernels add `c` as one scalar on such
// tiles instead of evaluating the terms per element.
EFFATTN_DEVICE bool const_bias(const AttnParams& p, const BiasRow& br, int i0, int rows, int j0, int cols, float& c) {
  if (br.dense) return false;
  const int d_lo = i0 + p.off - (j0 + cols - 1), d_hi = i0 + rows - 1 + p.off - j0;
  if (br.rel && rel_index(p, d_lo) != rel_index(p, d_hi)) return false;
  if (p.span_z && !(span_ratio(p, br.z, d_hi) > 1.f)) return false;
  c = bias_terms(p, br, i0, j0) * 1.4426950408889634f;
  return true;
}

// Head h's window with its span: keys at d > z[h] + ramp are invisible, so the left bound becomes
// floor(z[h] + ramp) and the schedules skip the key (query) tiles beyond it (per-head tile skipping).
EFFATTN_DEVICE void tighten_to_span(AttnParams& p, int h) {
  if (!p.span_z) return;
  const float hz = p.span_z[h] + p.span_ramp;
  if (!(hz < 1073741824.f)) return;                    // beyond any sequence: no bound
  const int l = int(hz);
  p.left = p.left < 0 ? l : imin(p.left, l);
}

// The params a block of a TERMS instance works on (segment_view, then head gt.h's span window);
// without TERMS, segment_view's.
template <bool TERMS>
EFFATTN_DEVICE AttnParams block_view(const AttnParams& p0, GridTile& gt) {
  AttnParams p = segment_view(p0, gt);
  if (TERMS) tighten_to_span(p, gt.h);
  return p;
}

// The sum of v over the block's 128 threads in a fixed order (lanes by a butterfly, then warps 0..3
// through red[0..3] in shared memory); every thread gets it. All threads, between block syncs.
EFFATTN_DEVICE float block_sum(float v, float* red) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += prim::shfl_xor_f(v, m);
  prim::sync_block();
  if ((prim::thread_x() & 31) == 0) red[prim::thread_x() >> 5] = v;
  prim::sync_block();
  return ((red[0] + red[1]) + red[2]) + red[3];
}

// Internal linkage: the key source below differs between units (EFFATTN_PHILOX_KEYS_FROM_SEED), so each
// unit keeps its own copy of these functions (the host emulation links the units into one library).
namespace {

// Philox's round key i (round i / 2, word i % 2) of the call's seed: by default a kernel parameter
// (AttnParams::drop_key, constant space: computed in the kernel, ptxas held all 20 in registers through the
// fused backward's loop, which spilled); a unit that defines EFFATTN_PHILOX_KEYS_FROM_SEED computes them from the
// seed (terms.cu: its dQ kernel at head dim 128 spilled on sm_80 with the parameter reads). Equal values either way.
EFFATTN_DEVICE uint32_t philox_round_key(const AttnParams& p, int i) {
#ifdef EFFATTN_PHILOX_KEYS_FROM_SEED
  return (i & 1) ? p.seed_hi + uint32_t(i >> 1) * 0xBB67AE85u : p.seed_lo + uint32_t(i >> 1) * 0x9E3779B9u;
#else
  return p.drop_key[i];
#endif
}

// Triton's tl.philox(seed, c0, c1, c2, c3) with 10 rounds, first output word, for the call's seed.
EFFATTN_DEVICE uint32_t philox_first(const AttnParams& p, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    uint32_t a0 = c0, a2 = c2;
    c0 = prim::umulhi(0xCD9E8D57u, a2) ^ c1 ^ philox_round_key(p, 2 * r);
    c2 = prim::umulhi(0xD2511F53u, a0) ^ c3 ^ philox_round_key(p, 2 * r + 1);
    c1 = 0xCD9E8D57u * a2;
    c3 = 0xD2511F53u * a0;
  }
  return c0;
}

// Packed sequences draw at the packed rows (q0 + i, k0 + j) of head h (their one batch entry: bh = h). A chunk
// with positions draws at its absolute rows and keys (drop_q0 / drop_k0 added), a head shard at the global head
// b * drop_H + drop_h0 + h (bh = b * H + h; drop_H = 0 reads as H; the division is loop-invariant in every caller).
EFFATTN_DEVICE bool dropout_keep(const AttnParams& p, int bh, int i, int j) {
  const int head = p.drop_H ? bh + (bh / p.H) * (p.drop_H - p.H) + p.drop_h0 : bh;
  return int(philox_first(p, uint32_t(p.drop_q0 + p.q0 + i), uint32_t(p.drop_k0 + p.k0 + j),
                          uint32_t(head), 0u) >> 8) >= p.drop_thresh;
}

}  // namespace

}  // namespace effattn
