// Two small kernels of linear attention that need no tensor cores:
//
// - the one-token recurrent step (decoding with KVCache): S' = S + phi(k)^T v, z' = z + phi(k),
//   out = phi(q) S' / (phi(q) . z' + eps); one block per query head, O(F x Dv), fp32;
// - FAVOR+ features (the prologue of a FAVOR+ call): phi(x)_i = exp(min(w_i . x' - |x'|^2 / 2, cap))
//   / sqrt(F), x' = sqrt(scale) x; the projection on tensor cores.
#pragma once

#include "linear/common.cuh"

namespace effattn {

EFFATTN_LIN_KERNEL lin_step_kernel(const LinStepParams p) {
  EFFATTN_SMEM(smem);
  float* fq = reinterpret_cast<float*>(smem);                 // phi(q), phi(k): F each
  float* fk = fq + p.F;
  const int tid = prim::thread_x();
  const int bh = int(prim::block_x());
  const int b = bh / p.H, h = bh % p.H, hk = h / p.G;
  const int64_t qo = int64_t(b) * p.q_b + int64_t(h) * p.q_h;
  const int64_t ko = int64_t(b) * p.k_b + int64_t(hk) * p.k_h;
  const int64_t vo = int64_t(b) * p.v_b + int64_t(hk) * p.v_h;
  for (int f = tid; f < p.F; f += 128) {
    fq[f] = lin::apply_map(lin::load_elem(p.q, qo + f * p.q_f, p.kind), p.map);
    fk[f] = lin::apply_map(lin::load_elem(p.k, ko + f * p.k_f, p.kind), p.map);
    p.z_out[int64_t(bh) * p.F + f] = p.z[int64_t(bh) * p.F + f] + fk[f];
  }
  prim::sync_block();
  // every thread forms the denominator itself (F terms, the same order in each: no reduction)
  const float* z = p.z + int64_t(bh) * p.F;
  float den = 0.f;
  for (int f = 0; f < p.F; ++f) den += fq[f] * (z[f] + fk[f]);
  if (p.normalize) den += p.eps;
  const float* S = p.S + int64_t(bh) * p.F * p.Dv;
  float* So = p.S_out + int64_t(bh) * p.F * p.Dv;
  for (int d = tid; d < p.Dv; d += 128) {
    const float vd = lin::load_elem(p.v, vo + d * p.v_f, p.kind);
    float num = 0.f;
    for (int f = 0; f < p.F; ++f) {
      const float s = S[int64_t(f) * p.Dv + d] + fk[f] * vd;
      So[int64_t(f) * p.Dv + d] = s;
      num += fq[f] * s;
    }
    if (p.normalize) num = den == 0.f ? 0.f : lin::fdiv(num, den);
    lin::store_elem(p.out, int64_t(bh) * p.Dv + d, p.kind, num);
  }
}

// FAVOR+ features on tensor cores: one block per (head, 64 rows, 64 features); warp w owns rows
// [16 w, 16 w + 16). u = w_i . x over 32-wide slices of D (x and the projection as NP bf16 parts:
// an error in u is a relative error of phi, so even 16-bit inputs take 2 parts), then
// phi = exp(min(sqrt(scale) u - |x'|^2 / 2, cap)) / sqrt(F) with |x'|^2 summed in fp32.
template <int NP>
struct LinFavorConfig {
  static constexpr int BM = 64, BF = 64, BK = 32;
  static constexpr int kPart = BM * BK;
  static constexpr int kSmem = 2 * NP * kPart * 2;
};

template <int NP>
EFFATTN_LIN_KERNEL lin_favor_kernel(const LinFavorParams p) {
  using Cfg = LinFavorConfig<NP>;
  constexpr int BM = Cfg::BM, BF = Cfg::BF, BK = Cfg::BK, PART = Cfg::kPart;
  EFFATTN_SMEM(smem);
  uint16_t* sX = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sW = sX + NP * PART;
  const int tid = prim::thread_x(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  LinRows x = p.x;
  x.map = kMapNone;
  const int D = x.F, n_rt = (x.L + BM - 1) / BM;
  const int bh = int(prim::block_x()) / n_rt, r0 = int(prim::block_x()) % n_rt * BM;
  const int f0 = int(prim::block_y()) * BF;
  const int b = bh / x.H, h = bh % x.H;
  LinRows w;                                                  // the projection as a (1, 1, F, D) operand
  w.x = p.w, w.sl = D, w.sf = 1, w.L = p.F, w.F = D, w.kind = kF32;

  float s[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  for (int k0 = 0; k0 < D; k0 += BK) {
    prim::sync_block();
    lin::load_tile_parts<BK, BM, NP>(sX, PART, x, b, h, r0, k0);
    lin::load_tile_parts<BK, BF, NP>(sW, PART, w, 0, 0, f0, k0);
    prim::sync_block();
    const int k16 = (imin(D - k0, BK) + 15) / 16;
    for (int kk = 0; kk < k16; ++kk) {
      uint32_t a[NP][4];
      lin::a_rows<BK, NP>(a, sX, PART, 16 * warp, kk);
      lin::mma_a_rows_t<BK, NP, 8>(s, a, sW, PART, kk, 0, BF / 16);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + 16 * warp + g + 8 * r;
    const bool ok = row < x.L;                                // every lane reaches the shuffles
    const int64_t xo = int64_t(b) * x.sb + int64_t(h) * x.sh + int64_t(ok ? row : 0) * x.sl;
    float sq = 0.f;
    for (int d = t4; ok && d < D; d += 4) {
      const float xd = lin::load_elem(x.x, xo + d * x.sf, x.kind) * p.sqrt_scale;
      sq += xd * xd;
    }
    sq += prim::shfl_xor_f(sq, 1);                            // the row's 4 lanes, in a fixed order
    sq += prim::shfl_xor_f(sq, 2);
    if (!ok) continue;
    float* out = p.out + (int64_t(bh) * x.L + row) * p.F;
#pragma unroll
    for (int q = 0; q < 8; ++q)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int f = f0 + 8 * q + 2 * t4 + e;
        const float u = p.sqrt_scale * s[q][2 * r + e] - 0.5f * sq;
        if (f < p.F) out[f] = expf(u < p.cap ? u : p.cap) * p.norm;
      }
  }
}

}  // namespace effattn
