// Host checks of the emulation itself and of the kernels' memory behaviour, run by
// tests/backends/cuda/test_cuda_emulation.py (built with g++ -DEFFATTN_CUDA_EMU, and once more under
// AddressSanitizer and UBSan). Usage: selftest SCENARIO [SCHEDULE]
//
//   maps              prints the fragment maps (tests compare them with the PTX ISA tables)
//   mma-bf16/mma-f16  one warp: A, B through ldmatrix, D = A B by mma; prints the max error
//   bank-plain / bank-swizzled   ldmatrix wavefronts per phase of an unswizzled / swizzled tile
//   attention         the attention kernels on exact-size heap buffers (sanitizers watch them), and
//                     the Hopper forward at head dims 33..64
//   decode            the split-KV decode kernels, the same way
//   bug-*             kernels with one planted mistake: the emulation must fail (abort here) or show NaN
//   caught            the same failures caught as exceptions, then a correct kernel on the same emulator
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/fwd_sm90.cu"   // the Hopper forward (its launcher and kernels)
#include "attention/decode_kernels.cuh"
#include "attention/bwd_launch.cuh"
#include "selftest_util.h"

using namespace effattn;

namespace {

using emu::Dim3;
using selftest::heap;

void run1(int threads, size_t smem, const std::function<void()>& body) {
  emu::launch(Dim3{1, 1, 1}, Dim3{unsigned(threads), 1, 1}, smem, body);
}

uint16_t bf(float x) { return prim::from_float<true>(x); }

int maps() {
  for (int lane = 0; lane < 32; ++lane) {
    selftest::print_pairs("A", lane, 4, [&](int reg, int e, int& r, int& c) {
      emu::mma_a_element(lane, reg, e, r, c);
    });
    selftest::print_pairs("B", lane, 2, [&](int reg, int e, int& r, int& c) {
      emu::mma_b_element(lane, reg, e, r, c);
    });
    for (int i = 0; i < 4; ++i) {
      int r, c;
      emu::mma_c_element(lane, i, r, c);
      std::printf("C %d %d %d %d\n", lane, i, r, c);
    }
    selftest::print_pairs("L", lane, 2, [&](int t, int e, int& r, int& c) {
      emu::ldmatrix_element(lane, e, t, r, c);
    });
  }
  return 0;
}

// D (16 x 16) = A (16 x 16) B (16 x 16) with B given as its transpose Bt[n][k], both row-major
// tiles in shared memory, loaded with ldmatrix as the kernels do, D written by the C map.
template <bool BF16>
int mma_check() {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> a(256), bt(256);
  for (auto& x : a) x = prim::from_float<BF16>(nd(rng));
  for (auto& x : bt) x = prim::from_float<BF16>(nd(rng));
  std::vector<float> d(256, 0.f);
  run1(32, 1024, [&] {
    EFFATTN_SMEM(smem);
    uint16_t* sa = reinterpret_cast<uint16_t*>(smem);
    uint16_t* sb = sa + 256;
    const int lane = prim::thread_x();
    for (int i = lane; i < 256; i += 32) sa[i] = a[i], sb[i] = bt[i];
    prim::sync_block();
    uint32_t fa[4], fb[4];
    prim::ldmatrix_x4(fa, sa + 16 * ((lane & 7) + 8 * ((lane >> 3) & 1)) + 8 * (lane >> 4));
    prim::ldmatrix_x4(fb, sb + 16 * ((lane & 7) + 8 * (lane >> 4)) + 8 * ((lane >> 3) & 1));
    float acc[2][4] = {};
    prim::mma_16816<BF16>(acc[0], fa, fb[0], fb[1]);
    prim::mma_16816<BF16>(acc[1], fa, fb[2], fb[3]);
    for (int n = 0; n < 2; ++n)
      for (int i = 0; i < 4; ++i) {
        int r, c;
        emu::mma_c_element(lane, i, r, c);
        d[r * 16 + 8 * n + c] = acc[n][i];
      }
  });
  double worst = 0;
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      double ref = 0;
      for (int k = 0; k < 16; ++k)
        ref += double(prim::to_float<BF16>(a[m * 16 + k])) * prim::to_float<BF16>(bt[n * 16 + k]);
      worst = std::max(worst, std::abs(ref - d[m * 16 + n]));
    }
  std::printf("max_error %.9g\n", worst);
  return 0;
}

// A 64 x 64 tile read by ldmatrix as the kernels read Q: with the swizzle, or plain row-major.
int bank(bool swizzled) {
  run1(32, 64 * 64 * 2, [&] {
    EFFATTN_SMEM(smem);
    uint16_t* s = reinterpret_cast<uint16_t*>(smem);
    const int lane = prim::thread_x();
    for (int i = lane; i < 64 * 64; i += 32) s[i] = 0;
    prim::sync_block();
    for (int kk = 0; kk < 4; ++kk) {
      const int row = (lane & 7) + 8 * ((lane >> 3) & 1), chunk = 2 * kk + (lane >> 4);
      uint32_t r[4];
      prim::ldmatrix_x4(r, s + (swizzled ? Tile<64>::offset(row, chunk) : row * 64 + chunk * 8));
    }
  });
  const emu::Stats& st = emu::stats();
  std::printf("phases %llu wavefronts %llu max %llu\n", (unsigned long long)st.ldmatrix_phases,
              (unsigned long long)st.ldmatrix_wavefronts, (unsigned long long)st.max_wavefronts);
  return 0;
}

// ---------------------------------------------------------------------------- attention

// Contiguous (B, H, L, D) q, o and (B, Hkv, L, D) k, v of shape `s` (a key padding mask when s.kpm),
// the scale 0.2: what the attention and decode scenarios share.
template <class Shape>
void set_params(AttnParams& p, const Shape& s, uint16_t* q, uint16_t* k, uint16_t* v, uint16_t* o, float* lse,
                uint8_t* kpm) {
  const int Hkv = s.H / s.G;
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse;
  p.q_b = int64_t(s.H) * s.Lq * s.D, p.q_h = int64_t(s.Lq) * s.D, p.q_l = s.D;
  p.k_b = int64_t(Hkv) * s.Lk * s.D, p.k_h = int64_t(s.Lk) * s.D, p.k_l = s.D;
  p.v_b = int64_t(Hkv) * s.Lk * s.Dv, p.v_h = int64_t(s.Lk) * s.Dv, p.v_l = s.Dv;
  p.o_b = int64_t(s.H) * s.Lq * s.Dv, p.o_h = int64_t(s.Lq) * s.Dv, p.o_l = s.Dv;
  if (s.kpm) p.kpm = kpm, p.kpm_b = s.Lk, p.kpm_l = 1;
  p.B = s.B, p.H = s.H, p.G = s.G, p.Lq = s.Lq, p.Lk = s.Lk, p.D = s.D, p.Dv = s.Dv, p.Dv_out = s.Dv;
  p.off = s.Lk - s.Lq, p.left = s.left, p.right = s.right;
  p.scale = 0.2f, p.qk_scale = 0.2f * 1.4426950408889634f;
}

int attention() {
  struct Shape { int B, H, G, Lq, Lk, D, Dv, left, right, kpm, dropout; };
  const Shape shapes[] = {
      {1, 2, 2, 37, 53, 24, 8, -1, 0, 1, 0},
      {2, 2, 1, 70, 45, 64, 64, 10, 3, 0, 1},
      {1, 1, 1, 65, 130, 40, 56, -1, -1, 1, 0},
  };
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (const Shape& s : shapes) {
    const int Hkv = s.H / s.G;
    const size_t nq = size_t(s.B) * s.H * s.Lq * s.D, nk = size_t(s.B) * Hkv * s.Lk * s.D;
    const size_t nv = size_t(s.B) * Hkv * s.Lk * s.Dv, no = size_t(s.B) * s.H * s.Lq * s.Dv;
    const size_t nl = size_t(s.B) * s.H * s.Lq;
    uint16_t *q = heap<uint16_t>(nq), *k = heap<uint16_t>(nk), *v = heap<uint16_t>(nv), *o = heap<uint16_t>(no);
    uint16_t *dout = heap<uint16_t>(no), *dq = heap<uint16_t>(nq), *dk = heap<uint16_t>(nk), *dv = heap<uint16_t>(nv);
    float *lse = heap<float>(nl), *delta = heap<float>(nl);
    uint8_t* kpm = heap<uint8_t>(size_t(s.B) * s.Lk);
    for (auto [x, n] : {std::pair{q, nq}, {k, nk}, {v, nv}})
      for (size_t i = 0; i < n; ++i) x[i] = bf(nd(rng));
    for (size_t i = 0; i < no; ++i) dout[i] = bf(nd(rng));
    for (int i = 0; i < s.B * s.Lk; ++i) kpm[i] = (rng() % 4) == 0;
    AttnParams p{};
    set_params(p, s, q, k, v, o, lse, kpm);
    if (s.dropout) {
      p.dropout = 1, p.drop_thresh = 1 << 22, p.inv_keep = 1.f / 0.75f;
      set_dropout_seed(p, (uint64_t(678) << 32) | 12345u);
    }
    p.dout = dout, p.do_b = p.o_b, p.do_h = p.o_h, p.do_l = p.o_l;
    p.delta = delta, p.delta_out = delta, p.dq = dq, p.dk = dk, p.dv = dv;
    // the instances of these head dims only (each instance adds to the sanitizer build's time)
    const bool small = std::max(s.D, s.Dv) <= 32;
    const int err = small ? detail::fwd<32, true, kAny, true>(p, nullptr) || detail::bwd<32, true>(p, nullptr)
                          : detail::fwd<64, true, kAny, true>(p, nullptr) || detail::bwd<64, true>(p, nullptr);
    if (err) return 2;
    int nan = 0;
    for (size_t i = 0; i < no; ++i) nan += std::isnan(prim::to_float<true>(o[i]));
    for (size_t i = 0; i < nq; ++i) nan += std::isnan(prim::to_float<true>(dq[i]));
    for (size_t i = 0; i < nk; ++i) nan += std::isnan(prim::to_float<true>(dk[i]));
    for (size_t i = 0; i < nv; ++i) nan += std::isnan(prim::to_float<true>(dv[i]));
    std::printf("shape Lq=%d Lk=%d D=%d Dv=%d nan=%d\n", s.Lq, s.Lk, s.D, s.Dv, nan);
    if (!small) {   // the Hopper forwards on the same buffers
      uint16_t* o2 = heap<uint16_t>(no);
      AttnParams p2 = p;
      p2.o = o2;
      // the cp.async kernel (64-key tiles): the same output (fp32 sums in one order)
      setenv("EFFATTN_CUDA_HOPPER_TMA", "0", 1);
      const int rc = attention_fwd_sm90(p2, true, nullptr);
      unsetenv("EFFATTN_CUDA_HOPPER_TMA");
      if (rc) return 2;
      int diff = 0;
      for (size_t i = 0; i < no; ++i) diff += o2[i] != o[i];
      std::printf("sm90 forward: %d elements differ\n", diff);
      // the TMA kernel (128-key tiles: its online softmax folds 128 keys a step, so its fp32 sums differ in the
      // last bits and a bf16 rounding may flip: within 2 units of bf16 at 1 (2^-7), relative above 1)
      for (size_t i = 0; i < no; ++i) o2[i] = 0x7fc0;   // NaN-poisoned
      if (attention_fwd_sm90(p2, true, nullptr)) return 2;
      int off = 0;
      for (size_t i = 0; i < no; ++i) {
        const float a = prim::to_float<true>(o2[i]), b = prim::to_float<true>(o[i]);
        off += !(std::fabs(a - b) <= 0x1p-7f * std::max(1.f, std::fabs(b)));
      }
      std::printf("sm90 tma forward: %d elements off\n", off);
      std::free(o2);
    }
    for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)dout, (void*)dq, (void*)dk, (void*)dv,
                      (void*)lse, (void*)delta, (void*)kpm})
      std::free(ptr);
    if (nan) return 3;
  }
  return 0;
}

// ---------------------------------------------------------------------------- decode

// The split-KV decode kernels (head-dim bucket 32, bf16) on exact-size buffers: packed GQA rows,
// several splits (and more splits than key tiles), the combine kernel's partial buffers.
int decode() {
  struct Shape { int B, H, G, Lq, Lk, D, Dv, left, right, kpm, splits; };
  const Shape shapes[] = {
      {1, 8, 4, 2, 150, 24, 16, -1, 0, 1, 2},
      {2, 2, 1, 5, 70, 32, 32, 20, 3, 0, 1},
      {1, 4, 4, 6, 200, 16, 8, -1, -1, 1, 9},
  };
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (const Shape& s : shapes) {
    const int Hkv = s.H / s.G;
    const size_t nq = size_t(s.B) * s.H * s.Lq * s.D, nk = size_t(s.B) * Hkv * s.Lk * s.D;
    const size_t nv = size_t(s.B) * Hkv * s.Lk * s.Dv, nl = size_t(s.B) * s.H * s.Lq, no = nl * s.Dv;
    uint16_t *q = heap<uint16_t>(nq), *k = heap<uint16_t>(nk), *v = heap<uint16_t>(nv), *o = heap<uint16_t>(no);
    float *lse = heap<float>(nl), *part_o = heap<float>(no * s.splits), *part_lse = heap<float>(nl * s.splits);
    uint8_t* kpm = heap<uint8_t>(size_t(s.B) * s.Lk);
    for (auto [x, n] : {std::pair{q, nq}, {k, nk}, {v, nv}})
      for (size_t i = 0; i < n; ++i) x[i] = bf(nd(rng));
    for (int i = 0; i < s.B * s.Lk; ++i) kpm[i] = (rng() % 4) == 0;
    DecodeParams d{};
    AttnParams& p = d.a;
    set_params(p, s, q, k, v, o, lse, kpm);
    d.splits = s.splits, d.rows = s.G * s.Lq, d.row_tiles = (d.rows + kDecodeRows - 1) / kDecodeRows, d.stages = 2;
    if (s.splits > 1) d.part_o = part_o, d.part_lse = part_lse;
    const unsigned grid = unsigned(s.B * Hkv * d.row_tiles * s.splits);
    if (detail::launch(attn_decode_split_kernel<32, true, 2>, grid, 1, DecodeConfig<32>::kSmemBytes, nullptr, d))
      return 2;
    if (s.splits > 1 && detail::launch(attn_decode_combine_kernel<true>, detail::cdiv(nl, 4), 1, 0, nullptr, d))
      return 2;
    int nan = 0;
    for (size_t i = 0; i < no; ++i) nan += std::isnan(prim::to_float<true>(o[i]));
    for (size_t i = 0; i < nl; ++i) nan += std::isnan(lse[i]);
    std::printf("decode Lq=%d Lk=%d splits=%d nan=%d\n", s.Lq, s.Lk, s.splits, nan);
    for (void* ptr : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)lse, (void*)part_o, (void*)part_lse, (void*)kpm})
      std::free(ptr);
    if (nan) return 3;
  }
  return 0;
}

// ---------------------------------------------------------------------------- planted bugs

// Each warp copies its own 16-byte row into shared memory, then every thread reads the row of
// the next warp. `wait` and `barrier` switch the copy's wait and the barrier between write and
// read on or off. Prints how many values read were NaN.
int copy_then_read(bool wait, bool barrier) {
  std::vector<uint16_t> src(4 * 8);
  for (int i = 0; i < 32; ++i) src[i] = bf(float(i + 1));
  int nan = 0;
  run1(128, 4 * 16, [&] {
    EFFATTN_SMEM(smem);
    uint16_t* s = reinterpret_cast<uint16_t*>(smem);
    const int tid = prim::thread_x(), warp = tid >> 5;
    if ((tid & 31) == 0) prim::cp_async_16(s + 8 * warp, src.data() + 8 * warp, 16);
    prim::cp_async_commit();
    if (wait) prim::cp_async_wait<0>();
    else prim::cp_async_wait<1>();
    if (barrier) prim::sync_block();
    nan += std::isnan(prim::to_float<true>(s[8 * ((warp + 1) % 4) + (tid & 7)]));
    prim::sync_block();
    prim::cp_async_wait<0>();
  });
  std::printf("nan_reads %d\n", nan);
  return 0;
}

int planted(const std::string& which) {
  alignas(16) static uint16_t buf[64];
  if (which == "bug-misaligned-ldmatrix") {
    run1(32, 512, [&] {
      EFFATTN_SMEM(smem);
      uint32_t r[4];
      prim::ldmatrix_x4(r, smem + 16 * (prim::thread_x() & 7) + 8);
    });
  } else if (which == "bug-misaligned-cp-async") {
    run1(32, 512, [&] {
      EFFATTN_SMEM(smem);
      prim::cp_async_16(smem + 16 * prim::thread_x(), buf + 1, 16);
      prim::cp_async_commit();
      prim::cp_async_wait<0>();
    });
  } else if (which == "bug-unwaited-copy") {
    run1(32, 512, [&] {
      EFFATTN_SMEM(smem);
      prim::cp_async_16(smem + 16 * prim::thread_x(), buf, 16);
      prim::cp_async_commit();
    });
  } else if (which == "bug-barrier-skipped") {
    run1(64, 0, [&] {
      if (prim::thread_x() >= 32) prim::sync_block();
    });
  } else if (which == "bug-divergent-shuffle") {
    run1(32, 0, [&] {
      if (prim::thread_x() < 16) prim::shfl_xor(1u, 1);
    });
  } else if (which == "bug-smem-out-of-bounds") {
    run1(32, 256, [&] {
      EFFATTN_SMEM(smem);
      uint32_t r[4];
      prim::ldmatrix_x4(r, smem + 256);
    });
  } else if (which == "bug-wait-count") {
    return copy_then_read(false, true);
  } else if (which == "bug-missing-barrier") {
    return copy_then_read(true, false);
  } else if (which == "correct-copy") {
    return copy_then_read(true, true);
  } else {
    std::fprintf(stderr, "unknown scenario %s\n", which.c_str());
    return 2;
  }
  std::printf("no abort\n");
  return 0;
}

}  // namespace

// Each planted mistake again, caught as the exception an op's caller sees (emu::Failure), then a
// correct kernel on the same emulator: prints one "caught: <message>" line per mistake and "after: ok".
int caught() {
  const char* bugs[] = {"bug-misaligned-ldmatrix", "bug-misaligned-cp-async", "bug-unwaited-copy",
                        "bug-barrier-skipped",     "bug-divergent-shuffle",   "bug-smem-out-of-bounds"};
  for (const char* bug : bugs) {
    try {
      planted(bug);
      std::printf("not caught: %s\n", bug);
    } catch (const emu::Failure& e) {
      std::printf("caught: %s\n", e.what());
    }
  }
  const size_t limit = emu::smem_limit();
  emu::smem_limit() = 1024;
  try {
    run1(32, 1040, [] {});
    std::printf("not caught: smem over the limit\n");
  } catch (const emu::Failure& e) {
    std::printf("caught: %s\n", e.what());
  }
  emu::smem_limit() = limit;
  return copy_then_read(true, true) == 0 ? (std::printf("after: ok\n"), 0) : 1;
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string what = argv[1];
  if (argc > 2) emu::schedule() = emu::Schedule(std::atoi(argv[2]));
  if (what == "maps") return maps();
  if (what == "mma-bf16") return mma_check<true>();
  if (what == "mma-f16") return mma_check<false>();
  if (what == "bank-plain") return bank(false);
  if (what == "bank-swizzled") return bank(true);
  if (what == "attention") return attention();
  if (what == "decode") return decode();
  if (what == "caught") return caught();
  return planted(what);
}
