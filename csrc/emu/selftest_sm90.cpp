// Host checks of the wgmma emulation (emu/wgmma.h), run by tests/backends/cuda/test_cuda_wgmma.py (built with
// g++ -DEFFATTN_CUDA_EMU). Usage: selftest_sm90 SCENARIO [ARG]
//
//   maps              prints the wgmma D and register-A fragment maps (emu/fragments.h)
//   desc              reads "DESCRIPTOR TRANS" lines (hex, 0/1) on stdin; prints the decoded fields
//                     and the byte address of every element (mn < 128, k < 16)
//   product VARIANT   one warpgroup computes S = Q K^T (wgmma, both from shared memory) and
//                     O = P V (P from registers, V N-major) at head dim 128 with the forward kernel's
//                     tile layout and descriptors; prints the max errors against double references.
//                     VARIANT: ok | swizzle64 | sbo512 | unswizzled | misaligned (a planted layout
//                     mistake each: the results must be wrong)
//   bug-*             planted misuses: the emulation must abort, or (bug-read-before-wait) read NaN
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/fwd_sm90.cuh"
#include "selftest_util.h"

using namespace effattn;

namespace {

constexpr int HD = 128, BN = 64;
using TQ = Sw128Tile<HD, 64>;

void run_wg(size_t smem, const std::function<void()>& body) {
  emu::launch(emu::Dim3{1, 1, 1}, emu::Dim3{128, 1, 1}, smem, body);
}

int maps() {
  for (int t = 0; t < 128; ++t) {
    for (int i = 0; i < 64; ++i) {   // m64n128: 64 accumulators per thread
      int r, c;
      emu::wgmma_d_element(t, i, r, c);
      std::printf("D %d %d %d %d\n", t, i, r, c);
    }
    selftest::print_pairs("A", t, 4, [&](int reg, int e, int& r, int& c) {
      emu::wgmma_a_element(t, reg, e, r, c);
    });
  }
  return 0;
}

int desc() {
  unsigned long long d;
  int trans;
  while (std::scanf("%llx %d", &d, &trans) == 2) {
    const emu::SmemDesc s = emu::decode_desc(d);
    std::printf("fields %u %u %u %u %d\n", s.start, s.lbo, s.sbo, s.base_offset, s.swizzle);
    for (int mn = 0; mn < 128; ++mn) {
      std::printf("addr");
      for (int k = 0; k < 16; ++k) std::printf(" %u", emu::operand_address(s, trans != 0, mn, k));
      std::printf("\n");
    }
  }
  return 0;
}

// The product check. Tiles: Q (64 x 128), K (64 x 128), V (64 x 128) in Sw128Tile layout at
// `base` (1024-aligned unless misaligned); P (64 x 64) from registers.
int product(const std::string& variant) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  auto rnd = [&](int n) {
    std::vector<uint16_t> x(n);
    for (auto& e : x) e = prim::from_float<true>(nd(rng));
    return x;
  };
  const std::vector<uint16_t> q = rnd(64 * HD), k = rnd(BN * HD), v = rnd(BN * HD), pm = rnd(64 * BN);
  std::vector<float> S(64 * BN), O(64 * HD);
  const int base = variant == "misaligned" ? 128 : 0;
  const bool plain = variant == "unswizzled";
  const int swz = variant == "swizzle64" ? 64 : 128;     // Q and K descriptors only (V stays in bounds)
  const uint32_t sbo = variant == "sbo512" ? 512 : 1024;
  run_wg(3 * 64 * HD * 2 + 1024, [&] {
    EFFATTN_SMEM(smem);
    uint16_t* sQ = reinterpret_cast<uint16_t*>(smem + base);
    uint16_t* sK = sQ + 64 * HD;
    uint16_t* sV = sK + BN * HD;
    const int tid = prim::thread_x();
    for (int i = tid; i < 64 * HD; i += 128) {
      const int r = i / HD, c = i % HD;
      const int off = plain ? r * 64 + (c / 64) * 64 * 64 + c % 64 : TQ::offset(r, c / 8) + c % 8;
      sQ[off] = q[i], sK[off] = k[i], sV[off] = v[i];
    }
    prim::sync_block();
    const uint32_t aQ = prim::smem_u32(sQ), aK = prim::smem_u32(sK), aV = prim::smem_u32(sV);
    auto dk = [&](uint32_t t, int kk) {
      return prim::smem_desc(t + (kk >> 2) * 64 * 128 + (kk & 3) * 32, 16, sbo, swz);
    };
    float s[BN / 8][4] = {}, o[HD / 8][4] = {};
    prim::wgmma_fence();
    for (int kk = 0; kk < HD / 16; ++kk) prim::wgmma_ss<BN, true, false>(s, dk(aQ, kk), dk(aK, kk), kk > 0);
    prim::wgmma_commit();
    prim::wgmma_wait<0>();
    uint32_t pa[BN / 16][4];
    for (int kk = 0; kk < BN / 16; ++kk)
      for (int reg = 0; reg < 4; ++reg) {
        uint32_t w = 0;
        for (int e = 0; e < 2; ++e) {
          int r, c;
          emu::wgmma_a_element(tid, reg, e, r, c);
          w |= uint32_t(pm[r * BN + 16 * kk + c]) << (16 * e);
        }
        pa[kk][reg] = w;
      }
    prim::wgmma_fence();
    for (int kk = 0; kk < BN / 16; ++kk)
      prim::wgmma_rs<HD, true, true>(o, pa[kk], prim::smem_desc(aV + kk * 16 * 128, 64 * 128, sbo, 128), true);
    prim::wgmma_commit();
    prim::wgmma_wait<0>();
    for (int i = 0; i < BN / 2; ++i) {
      int r, c;
      emu::wgmma_d_element(tid, i, r, c);
      S[r * BN + c] = s[i / 4][i % 4];
    }
    for (int i = 0; i < HD / 2; ++i) {
      int r, c;
      emu::wgmma_d_element(tid, i, r, c);
      O[r * HD + c] = o[i / 4][i % 4];
    }
  });
  auto f = [](uint16_t h) { return double(prim::to_float<true>(h)); };
  double es = 0, eo = 0;
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < BN; ++n) {
      double ref = 0;
      for (int d = 0; d < HD; ++d) ref += f(q[m * HD + d]) * f(k[n * HD + d]);
      es = std::max(es, std::abs(ref - S[m * BN + n]));
    }
    for (int d = 0; d < HD; ++d) {
      double ref = 0;
      for (int n = 0; n < BN; ++n) ref += f(pm[m * BN + n]) * f(v[n * HD + d]);
      eo = std::max(eo, std::abs(ref - O[m * HD + d]));
    }
  }
  std::printf("max_error_s %.9g max_error_o %.9g\n", es, eo);
  return 0;
}

// One 64 x 64 x 16 product from a zeroed 16 KB tile pair; `body` plants the mistake around it.
int planted(const std::string& which) {
  alignas(16) static uint16_t src[8] = {};
  int nan = 0;
  run_wg(16384, [&] {
    EFFATTN_SMEM(smem);
    uint16_t* sA = reinterpret_cast<uint16_t*>(smem);
    uint16_t* sB = sA + 64 * 64;
    const int tid = prim::thread_x();
    if (which == "bug-no-proxy-fence" || which == "proxy-fenced") {
      for (int i = tid; i < 2 * 64 * 8; i += 128) prim::cp_async_16(sA + 8 * i, src, 16);
      prim::cp_async_commit();
      prim::cp_async_wait<0>();
      if (which == "proxy-fenced") prim::fence_proxy_async();
    } else if (which == "bug-no-proxy-fence-st" || which == "proxy-fenced-st") {   // plain st.shared writes
      for (int i = tid; i < 2 * 64 * 64; i += 128) prim::st_shared(sA + i, uint16_t(0));
      if (which == "proxy-fenced-st") prim::fence_proxy_async();
    } else {
      for (int i = tid; i < 2 * 64 * 64; i += 128) sA[i] = 0;
    }
    prim::sync_block();
    const uint64_t da = prim::smem_desc(prim::smem_u32(sA), 16, 1024, 128);
    const uint64_t db = prim::smem_desc(prim::smem_u32(sB), 16, 1024, 128);
    float d[8][4] = {};
    uint32_t a[4] = {0, 0, 0, 0};
    if (which != "bug-no-fence") prim::wgmma_fence();
    if (which == "bug-a-registers-modified") {
      prim::wgmma_rs<64, true, false>(d, a, db, false);
      a[0] = 1;
    } else {
      prim::wgmma_ss<64, true, false>(d, which == "bug-divergent-descriptor" && tid == 5 ? db : da, db, false);
    }
    if (which == "bug-overwrite-before-wait") prim::cp_async_16(sB + 8 * tid, src, 16);
    prim::wgmma_commit();
    if (which == "bug-read-before-wait")
      for (auto& row : d)
        for (float x : row) nan += std::isnan(x);
    if (which != "bug-unwaited") prim::wgmma_wait<0>();
    if (which == "bug-overwrite-before-wait") {
      prim::cp_async_commit();
      prim::cp_async_wait<0>();
    }
  });
  if (which == "bug-read-before-wait" || which == "proxy-fenced" || which == "proxy-fenced-st") {
    std::printf("nan_reads %d\n", nan);
    return 0;
  }
  std::printf("no abort\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string what = argv[1];
  if (what == "maps") return maps();
  if (what == "desc") return desc();
  if (what == "product") return product(argc > 2 ? argv[2] : "ok");
  return planted(what);
}
