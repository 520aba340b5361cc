// Host checks of the Hopper asynchronous emulation (emu/async.h through common/prims_async.cuh), run by
// tests/backends/cuda/test_cuda_hopper_async.py (built with g++ -DEFFATTN_CUDA_EMU).
// Usage: selftest_async SCENARIO [ARGS]
//
//   phases          an mbarrier of 2 arrivals: "STEP try_wait(0) try_wait(1) token" after init and
//                   after each arrive
//   tx              arrive.expect_tx(256) on an mbarrier of 1 arrival, then 128 + 128 bytes landing
//   tx-early        64 bytes landing before arrive.expect_tx(64) (tx-count below zero while an arrival
//                   is pending: allowed)
//   tma SWZ RANK dims.. strides.. box.. coords..   one bulk tensor copy of a 16-bit tensor whose element
//                   at buffer position i holds i % 65521 + 1 (strides in elements, dimensions 1..):
//                   prints the tx-count the box expects, how many destination elements read NaN bits
//                   before the wait, and the destination's elements in address order after it
//   map-*           a tensor map the driver refuses: prints why
//   regs            384 threads: the consumers' setmaxnreg.inc 240 waits for the producer's .dec 24
//   named           256 of 384 threads meet at named barrier 1, twice
//   pingpong N      two warpgroups take N turns each in alternation (bar.sync on their own barrier 2 + w,
//                   then bar.arrive on the other's, 256 threads): prints the warpgroup of each turn in order
//   bug-*           planted misuses: the emulation must fail with the reason
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/prims_async.cuh"

using namespace effattn;

namespace {

void run(int threads, size_t smem, const std::function<void()>& body) {
  emu::launch(emu::Dim3{1, 1, 1}, emu::Dim3{unsigned(threads), 1, 1}, smem, body);
}

int phases() {
  run(32, 1024, [] {
    EFFATTN_SMEM(smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    if (prim::thread_x() == 0) {
      prim::mbar_init(bar, 2);
      std::printf("init %d %d\n", emu::mbar_try_wait(bar, 0), emu::mbar_try_wait(bar, 1));
      for (int i = 1; i <= 5; ++i) {
        const int token = emu::mbar_arrive(bar);
        std::printf("arrive%d %d %d %d\n", i, emu::mbar_try_wait(bar, 0), emu::mbar_try_wait(bar, 1), token);
      }
      emu::mbar_arrive(bar);                      // phase 2 (parity 0) completes: a wait on parity 0 passes
      prim::mbar_wait(bar, 0);
    }
  });
  return 0;
}

int tx(const std::string& what) {
  run(32, 1024, [&] {
    EFFATTN_SMEM(smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    if (prim::thread_x() != 0) return;
    const uint32_t off = 0;
    prim::mbar_init(bar, 1);
    if (what == "tx") {
      prim::mbar_arrive_expect_tx(bar, 256);
      std::printf("expect %d %lld\n", emu::mbar_try_wait(bar, 0), (long long)emu::mbar_at(bar).tx);
      emu::mbar_complete_tx(off, 128);
      std::printf("half %d %lld\n", emu::mbar_try_wait(bar, 0), (long long)emu::mbar_at(bar).tx);
      emu::mbar_complete_tx(off, 128);
      std::printf("full %d %lld\n", emu::mbar_try_wait(bar, 0), (long long)emu::mbar_at(bar).tx);
    } else if (what == "tx-early") {
      emu::mbar_complete_tx(off, 64);
      std::printf("early %d %lld\n", emu::mbar_try_wait(bar, 0), (long long)emu::mbar_at(bar).tx);
      prim::mbar_arrive_expect_tx(bar, 64);
      std::printf("expect %d %lld\n", emu::mbar_try_wait(bar, 0), (long long)emu::mbar_at(bar).tx);
    } else if (what == "bug-tx-underflow") {
      prim::mbar_arrive_expect_tx(bar, 100);
      emu::mbar_complete_tx(off, 128);
    } else if (what == "bug-tx-past-phase") {         // the phase completes on the first 64 bytes of 128
      prim::mbar_arrive_expect_tx(bar, 64);
      emu::mbar_complete_tx(off, 64);
      emu::mbar_complete_tx(off, 64);
    } else if (what == "bug-tx-never-lands") {         // announced, nothing lands, nobody waits
      emu::mbar_expect_tx(bar, 64);
    } else if (what == "bug-arrive-none-pending") {
      prim::mbar_arrive_expect_tx(bar, 64);
      prim::mbar_arrive(bar);
    } else if (what == "bug-expect-tx-range") {
      prim::mbar_arrive_expect_tx(bar, 1u << 20);
    } else if (what == "bug-init-count-0") {
      prim::mbar_init(bar + 1, 0);
    } else if (what == "bug-init-count-2^20") {
      prim::mbar_init(bar + 1, 1u << 20);
    } else if (what == "bug-uninitialized") {
      prim::mbar_wait(bar + 1, 0);
    } else if (what == "bug-misaligned") {
      prim::mbar_init(reinterpret_cast<uint64_t*>(smem + 12), 1);
    }
  });
  std::printf("no abort\n");
  return 0;
}

// A phase that never completes: one arrival of two, waited for by a warp.
int never_completes() {
  run(64, 1024, [] {
    EFFATTN_SMEM(smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    if (prim::thread_x() == 0) prim::mbar_init(bar, 2);
    prim::sync_block();
    if (prim::thread_x() == 32) prim::mbar_arrive(bar);
    if (prim::thread_x() < 32) prim::mbar_wait(bar, 0);
  });
  std::printf("no abort\n");
  return 0;
}

uint16_t value_at(uint64_t pos) { return uint16_t(pos % 65521 + 1); }

// Usage: tma SWZ RANK d0..d(R-1) s1..s(R-1) b0..b(R-1) c0..c(R-1) [EXPECT_DELTA [WAIT]]: EXPECT_DELTA is
// added to the expect_tx byte count (a planted mistake), WAIT 0 leaves the copy unwaited.
int tma(int argc, char** argv, const char* bug) {
  int a = 2;
  const int swz = std::atoi(argv[a++]), rank = std::atoi(argv[a++]);
  uint64_t dims[5], strides[4];
  uint32_t box[5];
  int coord[5];
  for (int i = 0; i < rank; ++i) dims[i] = std::strtoull(argv[a++], nullptr, 10);
  uint64_t stride_el[5] = {1};
  for (int i = 1; i < rank; ++i) stride_el[i] = std::strtoull(argv[a++], nullptr, 10);
  for (int i = 0; i < rank; ++i) box[i] = uint32_t(std::atoi(argv[a++]));
  for (int i = 0; i < rank; ++i) coord[i] = std::atoi(argv[a++]);
  const int delta = a < argc ? std::atoi(argv[a++]) : 0;
  uint64_t total = 1;
  for (int i = 0; i < rank; ++i) total += (dims[i] - 1) * stride_el[i];
  for (int i = 1; i < rank; ++i) strides[i - 1] = stride_el[i] * 2;
  std::vector<uint16_t> g(total + 8);
  uint16_t* base = g.data();
  while (reinterpret_cast<uintptr_t>(base) % 16) ++base;
  for (uint64_t i = 0; i < total; ++i) base[i] = value_at(i);
  prim::TensorMap map;
  if (const char* why = prim::make_tensor_map(map, base, 2, rank, dims, strides, box, swz)) {
    std::printf("refused %s\n", why);
    return 0;
  }
  uint64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= box[i];
  const std::string planted = bug ? bug : "";
  std::vector<uint16_t> out(n);
  int poisoned = 0;
  long long expected_tx = 0;
  run(128, 2048 + n * 2, [&] {
    EFFATTN_SMEM(smem);
    uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
    uint16_t* dst = reinterpret_cast<uint16_t*>(smem + (planted == "bug-tma-misaligned" ? 1088 : 1024));
    if (prim::thread_x() == 0) {
      prim::mbar_init(bar, 1);
      prim::fence_mbar_init();
    }
    prim::sync_block();
    if (prim::thread_x() == 0) {
      prim::mbar_arrive_expect_tx(bar, unsigned(int64_t(n * 2) + delta));
      expected_tx = emu::mbar_at(bar).tx;
      if (rank == 2) prim::tma_load_2d(dst, &map, bar, coord[0], coord[1]);
      else if (rank == 3) prim::tma_load_3d(dst, &map, bar, coord[0], coord[1], coord[2]);
      else prim::tma_load_4d(dst, &map, bar, coord[0], coord[1], coord[2], coord[3]);
      for (uint64_t i = 0; i < n; ++i) poisoned += dst[i] == 0xFFFF;
    }
    if (planted == "bug-tma-unwaited") return;
    prim::mbar_wait(bar, 0);
    if (prim::thread_x() == 0)
      for (uint64_t i = 0; i < n; ++i) out[i] = dst[i];
  });
  std::printf("expect_tx %lld\npoisoned %d\nbox", expected_tx, poisoned);
  for (uint16_t v : out) std::printf(" %u", unsigned(v));
  std::printf("\n");
  return 0;
}

int map_refusal(const std::string& which) {
  alignas(16) static uint16_t buf[4096];
  uint64_t dims[3] = {64, 32, 2}, strides[2] = {128, 128 * 32};
  uint32_t box[3] = {64, 8, 1};
  const void* base = buf;
  int rank = 3, swz = 128;
  if (which == "map-misaligned-base") base = buf + 1;
  if (which == "map-stride") strides[0] = 120;
  if (which == "map-box-257") box[1] = 257;
  if (which == "map-inner-bytes") box[0] = 12, swz = 0;
  if (which == "map-swizzle-width") box[0] = 32;
  if (which == "map-rank-6") rank = 6;
  if (which == "map-dim-0") dims[1] = 0;
  prim::TensorMap map;
  const char* why = prim::make_tensor_map(map, base, 2, rank, dims, strides, box, swz);
  std::printf("refused %s\n", why ? why : "(accepted)");
  return 0;
}

int regs(const std::string& what) {
  run(384, 1024, [&] {
    const int wg = prim::thread_x() / 128;
    if (prim::thread_x() == 0) std::printf("start %d %d %d\n", emu::warpgroup_regs(0), emu::warpgroup_regs(1), emu::warpgroup_regs(2));
    if (what == "regs") {
      // the consumers run first (warp-serial) and wait in .inc until the producer's .dec fills the pool
      if (wg < 2) prim::setmaxnreg_inc<240>();
      else prim::setmaxnreg_dec<24>();
    } else if (what == "bug-regs-pool") {
      if (wg < 2) prim::setmaxnreg_inc<240>();
    } else if (what == "bug-regs-multiple") {
      if (wg == 2) emu::setmaxnreg(36, false);
    } else if (what == "bug-regs-range") {
      if (wg == 2) emu::setmaxnreg(16, false);
    } else if (what == "bug-regs-range-high") {
      if (wg == 0) emu::setmaxnreg(264, true);
    } else if (what == "bug-regs-inc-below") {
      if (wg == 0) prim::setmaxnreg_inc<160>();
    } else if (what == "bug-regs-divergent") {
      if (wg == 2) emu::setmaxnreg(prim::thread_x() < 320 ? 24 : 32, false);
    }
    prim::sync_block();
    if (prim::thread_x() == 0) std::printf("end %d %d %d\n", emu::warpgroup_regs(0), emu::warpgroup_regs(1), emu::warpgroup_regs(2));
  });
  std::printf("no abort\n");
  return 0;
}

int named(const std::string& what) {
  int passes = 0;
  run(384, 1024, [&] {
    if (prim::thread_x() >= 256) return;
    const int count = what == "bug-named-count" && prim::thread_x() == 40 ? 128 : 256;
    prim::named_sync(1, count);
    prim::named_sync(1, count);
    if (what == "bug-named-short" && prim::thread_x() < 128) prim::named_sync(2, 256);
    passes += prim::thread_x() == 0;
  });
  std::printf("passes %d\n", passes);
  return 0;
}

// The turns of the Hopper forward's PingPong (attention/fwd_sm90.cuh): warpgroup 1 arrives at barrier 2 first;
// each turn waits at the warpgroup's own barrier and ends with an arrival at the other's (warpgroup 1 none
// after its last). bug-pingpong-no-sync: warpgroup 0 skips its waits; bug-pingpong-extra-arrive: warpgroup 1
// arrives after its last turn too.
int pingpong(const std::string& what, int turns) {
  std::vector<int> order;
  run(256, 1024, [&] {
    const int w = prim::thread_x() / 128;
    if (w == 1) prim::named_arrive(2, 256);
    for (int i = 0; i < turns; ++i) {
      if (!(what == "bug-pingpong-no-sync" && w == 0)) prim::named_sync(2 + w, 256);
      if (prim::thread_x() % 128 == 0) order.push_back(w);
      if (w == 0 || i + 1 < turns || what == "bug-pingpong-extra-arrive") prim::named_arrive(2 + (w ^ 1), 256);
    }
  });
  std::printf("order");
  for (int w : order) std::printf(" %d", w);
  std::printf("\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  const std::string what = argv[1];
  if (what == "phases") return phases();
  if (what == "bug-never-completes") return never_completes();
  if (what == "tma") return tma(argc, argv, nullptr);
  if (what.rfind("bug-tma", 0) == 0) return tma(argc, argv, argv[1]);
  if (what.rfind("map-", 0) == 0) return map_refusal(what);
  if (what == "regs" || what.rfind("bug-regs", 0) == 0) return regs(what);
  if (what == "named" || what.rfind("bug-named", 0) == 0) return named(what);
  if (what == "pingpong" || what.rfind("bug-pingpong", 0) == 0) return pingpong(what, argc > 2 ? std::atoi(argv[2]) : 3);
  return tx(what);
}
