// The plain parameter block of effattn's CUDA softmax-attention kernels, and their launchers.
// No torch here: pointers, int64 element strides, sizes. The binding (csrc/binding/) fills it.
//
// Visibility (the same rule as every effattn backend): query i sits at pos(i) = i + off,
// off = Lk - Lq (bottom-right), and sees key j iff
//   pos(i) - left <= j <= pos(i) + right   (left / right = -1: unbounded; causal is right = 0)
// and the layout block (i / lay_bs, j / lay_bs) is on and key j is not padded. `off` is set by the
// binding: Lk - Lq, or the call's positions (q_start - k_start).
//
// Packed sequences (cu_q non-null): the batch index b is the segment. Segment b is queries
// [cu_q[b], cu_q[b + 1]) of the packed (1, H, Tq) tensors against keys [cu_k[b], cu_k[b + 1]),
// aligned bottom-right inside it; B is the number of segments and Lq / Lk the longest segments
// (max_seqlen: they size the grid). Every block reads its segment's bounds from device memory
// (segment_view in common.cuh), so nothing is read back to the host.
#pragma once

#include <cstdint>

namespace effattn {

struct AttnParams {
  // inputs, element type bf16 or fp16 (raw 16-bit); the last dimension is contiguous, rows start
  // 16-byte aligned, D and Dv are multiples of 8 (the binding pads a copy where they are not)
  const void* q;                 // (B, H, Lq, D)
  const void* k;                 // (B, Hkv, Lk, D)
  const void* v;                 // (B, Hkv, Lk, Dv)
  int64_t q_b, q_h, q_l, k_b, k_h, k_l, v_b, v_h, v_l;
  void* o;                       // (B, H, Lq, Dv_out): forward output
  int64_t o_b, o_h, o_l;
  float* lse;                    // (B, H, Lq) fp32, natural log; -inf for a row that sees nothing
  int o_f32;                     // o is fp32 (float*): partial outputs for a later merge; the Delta kernel reads it so
  // rows of the fp32 row statistics (lse, Delta) and of dq: (b, h, i) is row b * rq_b + h * rq_h + i; of dk, dv:
  // (b, hk, j) is row b * rk_b + hk * rk_h + j (contiguous (B, H, L) tensors, or the packed (1, H, T) ones)
  int64_t rq_b, rq_h, rk_b, rk_h;
  // packed sequences (null: none; see above)
  const int32_t* cu_q;           // (B + 1,) int32: the segments' first query rows
  const int32_t* cu_k;           // (B + 1,) int32: their first key rows
  // mask data (null = absent)
  const uint8_t* kpm;            // (B, Lk), nonzero = padded (ignored)
  int64_t kpm_b, kpm_l;
  const uint8_t* layout;         // (Hl, ceil(Lq/bs), ceil(Lk/bs)) uint8 contiguous
  int64_t lay_h;                 // 0 when the layout is shared by all heads
  int lay_nkb, lay_bs;
  int lay_check;                 // partial tiles read the layout per element (tiles straddle blocks)
  const int32_t* lists;          // packed tile lists [n_full, n_partial, full..., partial...] per row
  int64_t list_h, list_t;
  int list_wf;
  // rows of `lists`: the forward's 64-row tiles' lists, then, where the host built them (rows = ceil(Lq / 64) +
  // ceil(Lq / 128)), the 128-row tiles' (the mma.sync forward's wide instances: fwd.cuh fwd_wide_lists)
  int list_rows;
  const int32_t* lists_by_key;   // the transposed lists (query tiles per key tile) for the dK/dV pass
  int64_t listk_h, listk_t;
  int listk_wf;
  // sizes
  int B, H, G, Lq, Lk, D, Dv, Dv_out;   // G = H / Hkv (grouped-query attention)
  int off, left, right;
  float scale, qk_scale;         // qk_scale = scale * log2(e)
  // packed: the first query and key rows of the segment a block works on (segment_view; 0 otherwise)
  int q0, k0;
  // dropout: keep (i, j) iff (Philox(seed; drop_q0 + q0 + i, drop_k0 + k0 + j, b * drop_H + drop_h0 + h, 0)[0] >> 8)
  // >= drop_thresh (packed: the packed rows of head h). drop_q0 / drop_k0: the absolute positions of a chunk's
  // first query and key (a context-parallel call's positions); drop_h0 / drop_H: the first head of a head shard
  // and the global head count (0 reads as H); 0, 0, 0, H for a plain call. So a chunk draws what the whole call draws.
  int dropout;
  int drop_q0, drop_k0, drop_h0, drop_H;
  uint32_t seed_lo, seed_hi;
  // Philox's round keys, drop_key[2r] = seed_lo + r * 0x9E3779B9 and drop_key[2r + 1] = seed_hi + r * 0xBB67AE85
  // for rounds r = 0..9 (set_dropout_seed): the rounds read them as kernel parameters from constant space (when
  // computed in the kernel, ptxas held all 20 in registers through the loops: the fused backward spilled)
  uint32_t drop_key[20];
  int drop_thresh;
  float inv_keep;                // 1 / (1 - p)
  // backward
  const void* dout;              // (B, H, Lq, Dv), same layout rules as q
  int64_t do_b, do_h, do_l;
  const float* delta;            // (B, H, Lq) fp32: rowsum(dO * O) - dlse
  const float* dlse;             // (B, H, Lq) fp32 or null
  int64_t dl_b, dl_h, dl_l;
  void* dq;                      // (B, H, Lq, D), contiguous
  void* dk;                      // (B, Hkv, Lk, D), contiguous
  void* dv;                      // (B, Hkv, Lk, Dv), contiguous
  float* delta_out;              // written by the Delta kernel
  // the fused backward (bwd_fused.cuh) when non-null, else the two-pass one: dQ accumulated in fp32 (dq's
  // shape and rows, zeroed) by the key blocks in key-tile order, each query tile's turns kept by a semaphore
  // (int32 (B, H, ceil(Lq / 64)), zeroed; packed: B segments, Lq the longest); dq_numel: dq's elements
  float* dq_accum;
  int* dq_sem;
  int64_t dq_numel;
  // score terms (effattn.score; order: scale, soft-cap, ALiBi, mask, sinks in the normalizer).
  // `score` = 0: none of them, the scores are scale * q.k (the plain kernels' arithmetic).
  int score;
  float softcap, inv_softcap;    // softcap > 0: s -> softcap * tanh(s / softcap); 0: no cap
  const float* alibi;            // ALiBi slopes fp32, slope of (b, h) at alibi[b * alibi_b + h]: adds
  int64_t alibi_b;               //   -slope * |pos(i) - j|; null: none
  const float* sinks;            // (H,) fp32 sink logits (natural units) in each row's normalizer; null: none
  float* dalibi;                 // backward: (B * H, n_query_tiles) fp32 partial sums of dT * |d| (null: not wanted)
  // bias tensors: served by the kernel instances compiled with TERMS = true only (attention_fwd /
  // attention_bwd route a call that has one of them there; has_bias_tensors). d = pos(i) - j.
  const float* rel;              // relative table (H, rel_w) fp32 contiguous: adds rel[h, idx(d)], idx(d) =
  int rel_w, rel_max, rel_bidir; //   clamp(d, -M, M) + M (bidirectional) or clamp(d, 0, M); M = rel_max; null: none
  const float* span_z;           // adaptive span z (H,) fp32: adds log clamp((ramp + z[h] - d) / ramp, 0, 1), keys
  float span_ramp;               //   with d >= z[h] + ramp invisible (and their tiles skipped per head); null: none
  const float* bias;             // dense bias fp32 at (b, h, i, j): bias[b * bias_b + h * bias_h + i * bias_q + j *
  int64_t bias_b, bias_h, bias_q, bias_k;   // bias_k] (stride 0 along a broadcast dimension); null: none
  float* drel;                   // backward: (B * H, n_query_tiles, rel_w) fp32 partial sums of dT per table entry
  float* dspan;                  // backward: (B * H, n_query_tiles) fp32 partial sums of dT / ratio on the ramp
  float* dbias;                  // backward: (B, H, Lq, Lk) fp32 contiguous, dT (zero where no tile was visited)
  // relative keys (effattn.bias.RelativeKeys; the forward instances compiled with RELK only): adds
  // query_i . relk[h, idx(d)] to the raw score q_i . k_j (before the scale), d = pos(i) - j, idx(d) =
  // clamp(d, 0, relk_n - 1) (relk_max < 0: past distances only) or clamp(d, -M, M) + M (M = relk_max)
  const void* relk;              // (H, relk_n, D) 16-bit, cp.async-readable rows; null: none
  int64_t relk_h, relk_l;
  int relk_n, relk_max;
  const void* relkq;             // the term's query (B, H, Lq, D), rows as q's; null: q itself
  int64_t relkq_b, relkq_h, relkq_l;
  // relative keys, backward (relkeys_bwd.cu): the term query's gradient (B, H, Lq, D) contiguous, rows as dq's
  // (written when relkq is set), and the per-distance sums gd (H, Lq + Lk - 1, D) fp32 for distances off - (Lk - 1) ..
  void* drelkq;
  float* drelk_gd;
  // positions (effattn.lsh_attention's sorted rounds; the forward instances of mask kind kAny and every backward, a
  // runtime branch on q_pos): query i of (b, h) is at q_pos[(b H + h) Lq + i], key j of (b, hk) at k_pos[(b Hkv + hk)
  // Lk + j] (int32 contiguous; null: none). Key j is hidden from query i where k_pos[j] < 0 (padding) or, with
  // pos_causal, k_pos[j] > q_pos[i]; where k_pos[j] == q_pos[i] the score is pos_self (natural units, not scaled; a
  // constant: no gradient flows to q or k through it). Checked per element on every tile (full ones too).
  const int32_t* q_pos;
  const int32_t* k_pos;
  int pos_causal;
  float pos_self;
};

// Sets the dropout seed (one 64-bit Philox key) and its round keys.
inline void set_dropout_seed(AttnParams& p, uint64_t key) {
  p.seed_lo = uint32_t(key & 0xffffffffu);
  p.seed_hi = uint32_t(key >> 32);
  for (int r = 0; r < 10; ++r) {
    p.drop_key[2 * r] = p.seed_lo + uint32_t(r) * 0x9E3779B9u;
    p.drop_key[2 * r + 1] = p.seed_hi + uint32_t(r) * 0xBB67AE85u;
  }
}

// Whether a call has a relative table, an adaptive span or a dense bias (the TERMS instances).
inline bool has_bias_tensors(const AttnParams& p) { return p.rel || p.span_z || p.bias; }

// Head-dim buckets: the kernels are compiled for max(D, Dv) rounded up to one of these.
constexpr int kHeadDimBuckets[] = {32, 64, 128, 256};

inline int head_dim_bucket(int d) {
  for (int b : kHeadDimBuckets)
    if (d <= b) return b;
  return -1;
}

// Launchers (fwd.cu: forward, bwd.cu: backward). `bf16`: the element type (else fp16); `stream`: a cudaStream_t (null
// under the emulation). Return 0, or a CUDA error code (-1: no kernel for these head dims).
int attention_fwd(const AttnParams& p, bool bf16, void* stream);
int attention_bwd(const AttnParams& p, bool bf16, void* stream);
// Whether the fused backward serves a call (its buckets, no layout, no ALiBi gradient, no bias tensors, no
// positions: its head-dim-128 instance spilled with the positions' test in its element loop on sm_80): the
// backend decides from resources.py (shared memory of the device) and asks for it with dq_accum; the binding
// refuses a request this says no to.
bool attention_bwd_fused_serves(const AttnParams& p);
// The instances with bias tensors (terms.cu: the mma.sync forward of mask kind kAny and the backward,
// compiled with TERMS = true); attention_fwd / attention_bwd call them when has_bias_tensors(p).
int attention_fwd_terms(const AttnParams& p, bool bf16, void* stream);
int attention_bwd_terms(const AttnParams& p, bool bf16, void* stream);
// The forward with relative keys (relkeys.cu: the mma.sync forward of mask kind kAny compiled with
// RELK = true; p.relk set, no other score term or bias tensor).
int attention_fwd_relk(const AttnParams& p, bool bf16, void* stream);
// Its backward (relkeys_bwd.cu: Delta, dQ with the term query's gradient, dK/dV, the distance-band pass
// for r; head-dim buckets 32 to 128). p.drelkq, p.drelk_gd and the backward fields set.
int attention_bwd_relk(const AttnParams& p, bool bf16, void* stream);
// The Hopper forward (fwd_sm90.cu: wgmma, head-dim buckets 64 and 128; -2 when this build has
// no sm_90a code). Only for devices of compute capability 9.0.
int attention_fwd_sm90(const AttnParams& p, bool bf16, void* stream);
bool attention_fwd_sm90_built();
// The Hopper backward (bwd.cu -> bwd_sm90.cuh: wgmma, head-dim buckets 64 and 128, mask kinds dense / causal /
// window, no dropout, key padding, score terms or packed sequences; needs dq_accum and dq_sem as the fused
// backward; -2 when this build has no sm_90a code, -1 for a call it does not serve). Only for devices of
// compute capability 9.0; the backend decides (effattn/backends/cuda/attention/backward.py).
int attention_bwd_sm90(const AttnParams& p, bool bf16, void* stream);
bool attention_bwd_sm90_serves(const AttnParams& p);

// Tile sizes (the host's tile plan uses the same): forward and dQ: query tiles of 64 rows, key
// tiles of 64 (32 for head dim 256); dK/dV: key tiles of 64, query tiles of 64 (32 from head dim
// 128 on).
constexpr int kBlockM = 64;

}  // namespace effattn
