// Parameter blocks of effattn's CUDA linear-attention kernels (Katharopoulos et al. 2020), and their
// launchers. No torch here: pointers, int64 element strides, sizes. The binding fills them.
//
// Everything is phrased, as in the Triton backend, with row operands on a timeline t of query
// positions: an operand's row r = t + shift (rows outside [0, L) read as zero). Two kernels:
//
// - the chunk-state pass (state.cuh): for each chunk of kChunk timeline positions, the state
//   S_c = sum_{t in earlier chunks} b_t^T c_t (Fb x Fc) and z_c = sum b_t cx_t (Fb), "earlier" meaning
//   later with `reverse`; and the total (the final state). Without `store` only the total, over a
//   range of chunks per block (a reduction split over the sequence);
// - the output pass (out.cuh): for each chunk and a tile of Fc columns,
//   out_t = sum_{s in chunk, s <= t} (a_t . b_s + ax_t bx_s) c_s + a_t (S_c + base) + ax_t (zc_c + base_z)
//   (s >= t with `reverse`; no in-chunk term without `causal`), an optional denominator
//   den_t = a_t . (z_c + base_z) + sum_{s} a_t . b_s, normalization, and the feature map's derivative.
//
// The forward is (state pass on (phi(k), v); output pass), the backward more launches of the same
// two kernels with the operands permuted (effattn/backends/cuda/linear_ops.py). Two small kernels
// (step.cuh) are the one-token recurrent step and the FAVOR+ feature prologue.
#pragma once

#include <cstdint>

namespace effattn {

constexpr int kLinChunk = 64;       // timeline positions per chunk (4 warps x 16 rows)

// Element kinds of the row operands and outputs.
enum LinKind : int { kBF16 = 0, kF16 = 1, kF32 = 2 };
// Feature maps applied on load: 0 none, 1 elu + 1, 2 relu.
enum LinMap : int { kMapNone = 0, kMapElu = 1, kMapRelu = 2 };

// A row operand x (B, H, L, F), any strides; head h of batch b at x + b * sb + h * sh.
struct LinRows {
  const void* x = nullptr;
  int64_t sb = 0, sh = 0, sl = 0, sf = 0;
  int H = 1, L = 0, F = 0, shift = 0, map = 0, kind = 0;
};

struct LinStateParams {
  LinRows b, c;
  const float* cx = nullptr;      // (B*H, Lb) fp32 row weights of z; cx_mode 1: ones, 0: no z
  int cx_mode = 0;
  int B = 0, n_chunks = 0, chunks_per_block = 0, reverse = 0, store = 0;
  float* st = nullptr;            // (B*H, n_chunks, Fb, Fc) fp32, with `store`
  float* stz = nullptr;           // (B*H, n_chunks, Fb) fp32, with `store` and cx_mode
  float* fin = nullptr;           // (n_split, B*H, Fb, Fc) fp32: the sums of each split
  float* finz = nullptr;          // (n_split, B*H, Fb) fp32, with cx_mode
};

struct LinOutParams {
  LinRows a, b, c, gx;            // gx: rows whose feature-map derivative multiplies the output
  int B = 0, Ha = 0, Hb = 0, GA = 1, NB = 1, n_chunks = 0, FA = 0, FC = 0;
  int causal = 0, reverse = 0;
  const float* ax = nullptr;      // (B*Ha, La) fp32; a_x 1: ones on valid rows, 0: none
  const float* bx = nullptr;      // (B*Hb, Lb) fp32; b_x likewise
  int a_x = 0, b_x = 0;
  const float* st = nullptr;      // per-chunk states of the b heads, strides (bh, chunk, fa, fc)
  int64_t st_bh = 0, st_c = 0, st_a = 0, st_f = 0;
  const float* stz = nullptr;     // per-chunk z, strides (bh, chunk), unit over features
  int64_t stz_bh = 0, stz_c = 0;
  int z_mode = 0;                 // 1: z runs over FA and makes the denominator; 2: over FC, times ax
  const float* base = nullptr;    // a fixed state per group of `gbase` a-heads, strides (bh, fa, fc)
  int64_t base_bh = 0, base_a = 0, base_f = 0;
  const float* base_z = nullptr;  // its z, stride (bh), unit over features
  int64_t basez_bh = 0;
  int gbase = 1;
  void* out = nullptr;            // (B, Ha, La, FC), kind out_kind
  int64_t o_b = 0, o_h = 0, o_l = 0;
  int out_kind = 0;
  float* den = nullptr;           // (B*Ha, La) fp32, with with_den
  int with_den = 0, normalize = 0;
  float eps = 0.f;
};

struct LinStepParams {
  const void* q;                  // one row per head: element (b, h, f) at q + b * q_b + h * q_h + f * q_f
  const void* k;
  const void* v;
  int64_t q_b, q_h, q_f, k_b, k_h, k_f, v_b, v_h, v_f;
  const float* S;                 // (B*H, F, Dv) fp32 contiguous
  const float* z;                 // (B*H, F)
  float* S_out;
  float* z_out;
  void* out;                      // (B*H, Dv) contiguous, kind `kind`
  int B, H, G, F, Dv, map, kind, normalize;
  float eps;
};

// FAVOR+ features (Choromanski et al. 2021): phi(x)_i = exp(min(w_i . x' - |x'|^2 / 2, cap)) / sqrt(F),
// x' = sqrt(scale) x, for rows x of (B, H, L, D) -> (B, H, L, F) fp32 contiguous.
struct LinFavorParams {
  LinRows x;                      // map ignored
  int B = 0;
  const float* w = nullptr;       // (F, D) fp32 contiguous projection
  int F = 0;
  float sqrt_scale = 1.f, cap = 30.f, norm = 1.f;   // norm = F ** -0.5
  float* out = nullptr;
};

// Launchers (linear.cu). `parts`: each product runs on operands split into this many bf16 parts
// (1 for bf16 calls, 2 for fp16, 3 for fp32: ~8, 16, 24 significant bits, fp32's range; tensor
// cores only take 16-bit inputs). `n_split`: blocks per head of a store-less state pass.
// Return 0 or a CUDA error code (-1: unsupported `parts`).
int linear_state(const LinStateParams& p, int parts, int n_fb_tiles, int n_fc_tiles, int n_split, void* stream);
int linear_out(const LinOutParams& p, int parts, void* stream);
int linear_step(const LinStepParams& p, void* stream);
int linear_favor(const LinFavorParams& p, void* stream);

}  // namespace effattn
