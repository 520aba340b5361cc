// Host check of the linear-attention kernels' memory behaviour, run by tests/backends/cuda/test_cuda_linear.py
// under AddressSanitizer and UBSan (g++ -DEFFATTN_CUDA_EMU): the operand permutations of a causal
// GQA forward and backward (state pass with stored chunk states, output pass with base state,
// denominator and normalization; a reverse state pass with loaded row weights; a reverse output
// pass summing two query heads, transposed state reads, the feature-map derivative), a split
// store-less reduction, the step and FAVOR+ kernels, all on heap buffers of exactly the tensors'
// size, bf16 (1 part) and fp32 (3 parts) inputs. Prints "nan=N" per configuration.
// Usage: linear_selftest [SCHEDULE]
#include <cstdio>
#include <cstdlib>
#include <random>

#include "linear/linear.cu"
#include "selftest_util.h"

using namespace effattn;

namespace {

std::mt19937 rng(5);

using selftest::heap;

// A contiguous (B, H, L, F) operand of element kind `kind`, random values.
struct Buf {
  void* p;
  size_t n;
  int kind;
  Buf(size_t n_, int kind_) : n(n_), kind(kind_) {
    p = kind == kF32 ? static_cast<void*>(heap<float>(n)) : static_cast<void*>(heap<uint16_t>(n));
    std::normal_distribution<float> nd;
    for (size_t i = 0; i < n; ++i) lin::store_elem(p, int64_t(i), kind, nd(rng));
  }
  ~Buf() { std::free(p); }
  int nan() const {
    int c = 0;
    for (size_t i = 0; i < n; ++i) c += std::isnan(lin::load_elem(p, int64_t(i), kind));
    return c;
  }
};

LinRows rows(const Buf& b, int B, int H, int L, int F, int shift, int map) {
  LinRows r;
  r.x = b.p, r.sb = int64_t(H) * L * F, r.sh = int64_t(L) * F, r.sl = F, r.sf = 1;
  r.H = H, r.L = L, r.F = F, r.shift = shift, r.map = map, r.kind = b.kind;
  (void)B;
  return r;
}

int run(int parts, int B, int H, int G, int Lq, int Lk, int F, int Dv) {
  const int kind = parts == 1 ? kBF16 : (parts == 2 ? kF16 : kF32);
  const int Hkv = H / G, shift = Lk < Lq ? Lk - Lq : 0, nc = (Lq + kLinChunk - 1) / kLinChunk;
  Buf q(size_t(B) * H * Lq * F, kind), k(size_t(B) * Hkv * Lk * F, kind), v(size_t(B) * Hkv * Lk * Dv, kind);
  Buf g(size_t(B) * H * Lq * Dv, kF32), base(size_t(B) * H * F * Dv, kF32), base_z(size_t(B) * H * F, kF32);
  Buf e(size_t(B) * H * Lq, kF32);
  Buf out(size_t(B) * H * Lq * Dv, kind), den(size_t(B) * H * Lq, kF32), dk(size_t(B) * Hkv * Lk * F, kind);
  Buf st(size_t(B) * Hkv * nc * F * Dv, kF32), stz(size_t(B) * Hkv * nc * F, kF32);
  Buf fin(size_t(B) * Hkv * F * Dv, kF32), finz(size_t(B) * Hkv * F, kF32);
  Buf dh(size_t(B) * H * nc * F * Dv, kF32), dhz(size_t(B) * H * nc * F, kF32);
  Buf dfin(size_t(B) * H * F * Dv, kF32), dfinz(size_t(B) * H * F, kF32);
  const int n_split = 2;
  Buf sfin(size_t(n_split) * B * Hkv * F * Dv, kF32), sfinz(size_t(n_split) * B * Hkv * F, kF32);
  int err = 0;

  LinStateParams sp;                                  // forward states of (phi(k), v)
  sp.b = rows(k, B, Hkv, Lk, F, shift, kMapElu), sp.c = rows(v, B, Hkv, Lk, Dv, shift, 0);
  sp.cx_mode = 1, sp.B = B, sp.n_chunks = nc, sp.chunks_per_block = nc, sp.store = 1;
  sp.st = static_cast<float*>(st.p), sp.stz = static_cast<float*>(stz.p);
  sp.fin = static_cast<float*>(fin.p), sp.finz = static_cast<float*>(finz.p);
  err |= linear_state(sp, parts, (F + 63) / 64, (Dv + 63) / 64, 1, nullptr);

  LinOutParams op;                                    // the forward output pass
  op.a = rows(q, B, H, Lq, F, 0, kMapElu), op.b = sp.b, op.c = sp.c;
  op.B = B, op.Ha = H, op.Hb = Hkv, op.GA = G, op.NB = 1, op.n_chunks = nc, op.FA = F, op.FC = Dv, op.causal = 1;
  op.st = sp.st, op.st_bh = int64_t(nc) * F * Dv, op.st_c = int64_t(F) * Dv, op.st_a = Dv, op.st_f = 1;
  op.stz = sp.stz, op.stz_bh = int64_t(nc) * F, op.stz_c = F, op.z_mode = 1;
  op.base = static_cast<float*>(base.p), op.base_bh = int64_t(F) * Dv, op.base_a = Dv, op.base_f = 1;
  op.base_z = static_cast<float*>(base_z.p), op.basez_bh = F, op.gbase = 1;
  op.out = out.p, op.o_b = int64_t(H) * Lq * Dv, op.o_h = int64_t(Lq) * Dv, op.o_l = Dv, op.out_kind = kind;
  op.den = static_cast<float*>(den.p), op.with_den = 1, op.normalize = 1, op.eps = 1e-6f;
  err |= linear_out(op, parts, nullptr);

  LinStateParams rp;                                  // reverse states of (phi(q), g) weighted by e
  rp.b = rows(q, B, H, Lq, F, 0, kMapElu), rp.c = rows(g, B, H, Lq, Dv, 0, 0);
  rp.cx = static_cast<float*>(e.p), rp.cx_mode = 2, rp.B = B, rp.n_chunks = nc, rp.chunks_per_block = nc;
  rp.reverse = 1, rp.store = 1, rp.st = static_cast<float*>(dh.p), rp.stz = static_cast<float*>(dhz.p);
  rp.fin = static_cast<float*>(dfin.p), rp.finz = static_cast<float*>(dfinz.p);
  err |= linear_state(rp, parts, (F + 63) / 64, (Dv + 63) / 64, 1, nullptr);

  LinOutParams kp;                                    // dk: reverse, the group's query heads summed
  kp.a = rows(v, B, Hkv, Lk, Dv, shift, 0), kp.b = rows(g, B, H, Lq, Dv, 0, 0), kp.c = rp.b;
  kp.gx = sp.b;
  kp.B = B, kp.Ha = Hkv, kp.Hb = H, kp.GA = 1, kp.NB = G, kp.n_chunks = nc, kp.FA = Dv, kp.FC = F;
  kp.causal = 1, kp.reverse = 1, kp.a_x = 1, kp.bx = rp.cx, kp.b_x = 2;
  kp.st = rp.st, kp.st_bh = int64_t(nc) * F * Dv, kp.st_c = int64_t(F) * Dv, kp.st_a = 1, kp.st_f = Dv;
  kp.stz = rp.stz, kp.stz_bh = int64_t(nc) * F, kp.stz_c = F, kp.z_mode = 2;
  kp.base = rp.fin, kp.base_bh = int64_t(F) * Dv * G, kp.base_a = 1, kp.base_f = Dv, kp.gbase = 1;
  kp.base_z = rp.finz, kp.basez_bh = int64_t(F) * G;
  kp.out = dk.p, kp.o_b = int64_t(Hkv) * Lk * F, kp.o_h = int64_t(Lk) * F, kp.o_l = F, kp.out_kind = kind;
  err |= linear_out(kp, parts, nullptr);

  LinStateParams np;                                  // a split store-less reduction over all keys
  np.b = rows(k, B, Hkv, Lk, F, 0, kMapRelu), np.c = rows(v, B, Hkv, Lk, Dv, 0, 0);
  np.cx_mode = 1, np.B = B, np.n_chunks = (Lk + kLinChunk - 1) / kLinChunk;
  np.chunks_per_block = (np.n_chunks + n_split - 1) / n_split;
  np.fin = static_cast<float*>(sfin.p), np.finz = static_cast<float*>(sfinz.p);
  err |= linear_state(np, parts, (F + 63) / 64, (Dv + 63) / 64, n_split, nullptr);

  Buf sout(size_t(B) * H * Dv, kind), S1(size_t(B) * H * F * Dv, kF32), z1(size_t(B) * H * F, kF32);
  LinStepParams tp{};                                 // one decoding step from the base state
  tp.q = q.p, tp.k = k.p, tp.v = v.p;
  tp.q_b = int64_t(H) * Lq * F, tp.q_h = int64_t(Lq) * F, tp.q_f = 1;
  tp.k_b = int64_t(Hkv) * Lk * F, tp.k_h = int64_t(Lk) * F, tp.k_f = 1;
  tp.v_b = int64_t(Hkv) * Lk * Dv, tp.v_h = int64_t(Lk) * Dv, tp.v_f = 1;
  tp.S = op.base, tp.z = op.base_z, tp.S_out = static_cast<float*>(S1.p), tp.z_out = static_cast<float*>(z1.p);
  tp.out = sout.p, tp.B = B, tp.H = H, tp.G = G, tp.F = F, tp.Dv = Dv, tp.map = kMapElu, tp.kind = kind;
  tp.normalize = 1, tp.eps = 1e-6f;
  err |= linear_step(tp, nullptr);

  const int Fp = 20;                                  // FAVOR+ features of q
  Buf w(size_t(Fp) * F, kF32), phi(size_t(B) * H * Lq * Fp, kF32);
  LinFavorParams fp;
  fp.x = rows(q, B, H, Lq, F, 0, 0), fp.B = B, fp.w = static_cast<float*>(w.p), fp.F = Fp;
  fp.sqrt_scale = 0.3f, fp.norm = 1.f / std::sqrt(float(Fp)), fp.out = static_cast<float*>(phi.p);
  err |= linear_favor(fp, nullptr);

  if (err) return 2;
  const int nan = out.nan() + den.nan() + st.nan() + stz.nan() + fin.nan() + dh.nan() + dfin.nan() + dk.nan() +
                  sfin.nan() + sfinz.nan() + sout.nan() + S1.nan() + z1.nan() + phi.nan();
  std::printf("parts=%d Lq=%d Lk=%d F=%d Dv=%d nan=%d\n", parts, Lq, Lk, F, Dv, nan);
  return nan ? 3 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) emu::schedule() = emu::Schedule(std::atoi(argv[1]));
  int r = run(1, 1, 4, 2, 70, 70, 72, 24);
  r = r ? r : run(3, 1, 4, 2, 40, 30, 8, 72);
  r = r ? r : run(2, 2, 2, 1, 3, 9, 16, 8);
  return r;
}
