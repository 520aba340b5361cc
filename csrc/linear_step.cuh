// Two small kernels of linear attention that need no tensor cores:
//
// - the one-token recurrent step (decoding with KVCache): S' = S + phi(k)^T v, z' = z + phi(k),
//   out = phi(q) S' / (phi(q) . z' + eps); one block per query head, O(F x Dv), fp32;
// - FAVOR+ features (the prologue of a FAVOR+ call): phi(x)_i = exp(min(w_i . x' - |x'|^2 / 2, cap))
//   / sqrt(F), x' = sqrt(scale) x; one block per 64 rows of x, each thread a few features of a row.
#pragma once

#include "linear_common.cuh"

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

constexpr int kFavorRows = 64;

EFFATTN_LIN_KERNEL lin_favor_kernel(const LinFavorParams p) {
  const int tid = prim::thread_x();
  const LinRows& x = p.x;
  const int n_rt = (x.L + kFavorRows - 1) / kFavorRows;
  const int bh = int(prim::block_x()) / n_rt, r0 = int(prim::block_x()) % n_rt * kFavorRows;
  const int b = bh / x.H, h = bh % x.H;
  // thread tid: row r0 + tid % 64, features tid / 64, tid / 64 + 2, ...
  const int r = r0 + tid % kFavorRows;
  if (r >= x.L) return;
  const int64_t xo = int64_t(b) * x.sb + int64_t(h) * x.sh + int64_t(r) * x.sl;
  float sq = 0.f;
  for (int d = 0; d < x.F; ++d) {
    const float xd = lin::load_elem(x.x, xo + d * x.sf, x.kind) * p.sqrt_scale;
    sq += xd * xd;
  }
  float* out = p.out + (int64_t(bh) * x.L + r) * p.F;
  for (int i = tid / kFavorRows; i < p.F; i += 128 / kFavorRows) {
    float u = 0.f;
    for (int d = 0; d < x.F; ++d)
      u += p.w[int64_t(i) * x.F + d] * (lin::load_elem(x.x, xo + d * x.sf, x.kind) * p.sqrt_scale);
    u -= 0.5f * sq;
    out[i] = expf(u < p.cap ? u : p.cap) * p.norm;
  }
}

}  // namespace effattn
