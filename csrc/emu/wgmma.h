// The host emulation of Hopper's warpgroup MMA (wgmma.mma_async m64nNk16, 16-bit inputs, fp32
// accumulators) and its shared-memory matrix descriptors. Only csrc/common/prims.cuh includes this file.
//
// Descriptors are decoded by the PTX ISA's rules ("Matrix Descriptor Format", "Shared Memory Matrix
// Layout"): bits 0-13 start address >> 4, 16-29 leading-dimension byte offset (LBO) >> 4, 32-45
// stride-dimension byte offset (SBO) >> 4, 49-51 base offset, 62-63 swizzle mode (0 none, 1 128B,
// 2 64B, 3 32B). An operand is read the way the tensor core addresses it: a row-and-column offset
// from the start address, then the swizzle applied to the resulting shared-memory address (its
// 16-byte-chunk bits 4.. XORed with the row bits 7..), so a tile stored at a misaligned base or
// with another swizzle reads the wrong elements here as on the GPU.
//
// wgmma is asynchronous, and the emulation makes that visible:
// - the 128 threads of a warpgroup meet in mma_async (a warpgroup collective); the last to arrive
//   computes D = A B (+ C) for all, from the operands as they are at issue;
// - each thread's accumulator registers read NaN from issue until the wgmma.wait_group that
//   retires the op; a later op on the same accumulators chains on the pending value, as the
//   hardware's in-order accumulation does;
// - at retirement the shared memory and A registers the op read must be unchanged (else abort:
//   they were overwritten while the tensor core could still read them);
// - aborts on mma_async without a wgmma.fence since the thread's last wait (the registers were
//   touched in between: the kernels always do), on threads of a warpgroup passing different
//   descriptors or shapes, on operands outside shared memory, on a non-zero base offset (not
//   modeled: tiles start on the swizzle pattern's boundary), and on an operand chunk written by
//   cp.async whose writer has not yet executed fence.proxy.async (wgmma reads through the async
//   proxy).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace effattn {
namespace emu {

// The fields of a 64-bit shared-memory matrix descriptor, in bytes.
struct SmemDesc {
  uint32_t start, lbo, sbo, base_offset;
  int swizzle;      // the swizzle width in bytes: 0 (none), 32, 64 or 128
};

inline SmemDesc decode_desc(uint64_t d) {
  SmemDesc s;
  s.start = uint32_t(d & 0x3FFF) << 4;
  s.lbo = uint32_t((d >> 16) & 0x3FFF) << 4;
  s.sbo = uint32_t((d >> 32) & 0x3FFF) << 4;
  s.base_offset = uint32_t((d >> 49) & 0x7);
  static const int widths[4] = {0, 128, 64, 32};
  s.swizzle = widths[(d >> 62) & 0x3];
  return s;
}

// The swizzle as the hardware applies it to a shared-memory address: the 16-byte chunk index
// (bits 4..) XORed with the row index within the pattern (bits 7..), as many bits as the width has
// chunks: 3 for 128B, 2 for 64B, 1 for 32B.
inline uint32_t swizzle_address(uint32_t addr, int width) {
  if (width == 0) return addr;
  const uint32_t bits = width == 128 ? 7u : width == 64 ? 3u : 1u;
  return addr ^ (((addr >> 7) & bits) << 4);
}

// The shared-memory byte address of element (mn, k) of an operand (mn: the row of A or the column
// of B; k: the reduction index), 16-bit elements. K-major (trans = 0): rows of the operand are
// contiguous along k; MN-major (trans = 1): contiguous along mn.
//   K-major, no swizzle: 8 x 16-byte core matrices; rows 16 bytes apart, the next 8 rows at SBO,
//     the next 8 k at LBO.
//   K-major, swizzle W: rows W bytes apart (one swizzle row each), the next 8 rows at SBO; the
//     16 k of one instruction lie within the row (LBO unused).
//   MN-major, no swizzle: 8 mn contiguous, the next 8 mn at SBO; k rows 16 bytes apart, the next
//     8 k at LBO.
//   MN-major, swizzle W: W / 2 mn contiguous, the next W / 2 at LBO; k rows W bytes apart, the
//     next 8 k at SBO.
inline uint32_t operand_address(const SmemDesc& d, bool mn_major, int mn, int k) {
  uint32_t a;
  if (!mn_major) {
    if (d.swizzle == 0) a = d.start + (mn % 8) * 16 + (mn / 8) * d.sbo + (k / 8) * d.lbo + (k % 8) * 2;
    else a = d.start + (mn % 8) * d.swizzle + (mn / 8) * d.sbo + k * 2;
  } else {
    if (d.swizzle == 0) a = d.start + (mn % 8) * 2 + (mn / 8) * d.sbo + (k % 8) * 16 + (k / 8) * d.lbo;
    else {
      const int per_row = d.swizzle / 2;
      a = d.start + (mn % per_row) * 2 + (mn / per_row) * d.lbo + (k % 8) * d.swizzle + (k / 8) * d.sbo;
    }
  }
  return swizzle_address(a, d.swizzle);
}

// One issued op as one thread sees it: where its accumulators go and their values at completion.
struct WgSnapshot {
  std::vector<uint32_t> addr;        // shared-memory bytes the op read (2 per element), and their values
  std::vector<uint16_t> val;
  std::vector<const uint32_t*> a_regs;   // per thread: its A registers (register-A form), and their values
  std::vector<uint32_t> a_val;
};

struct WgPending {
  float* d;
  std::vector<float> value;
  std::shared_ptr<WgSnapshot> snap;
};

struct WgThreadState {
  std::vector<WgPending> open;                   // issued since the last commit
  std::vector<std::vector<WgPending>> groups;    // committed, oldest first
};

struct WgCall {
  int arrived = 0;
  int n = 0, acc = 0, flags = 0;     // flags: bf16 | trans_b << 1 | register_a << 2
  uint64_t da = 0, db = 0;
  uint32_t a[128][4];
  const uint32_t* aptr[128];
  float* d[128];
};

inline std::vector<WgThreadState>& wg_threads() {
  static std::vector<WgThreadState> t;
  return t;
}

inline std::vector<WgCall>& wg_calls() {
  static std::vector<WgCall> c;
  return c;
}

inline uint64_t& wgmma_count() {
  static uint64_t n = 0;
  return n;
}

inline uint32_t smem_offset(const void* p) {
  return uint32_t(static_cast<const char*>(p) - cur_block()->smem);
}

inline void wgmma_fence() { self().wgmma_fenced = true; }

// The newest pending result of this thread for accumulators `d` (a chained op reads it as C).
inline const WgPending* newest_pending(int tid, const float* d) {
  WgThreadState& t = wg_threads()[tid];
  for (auto it = t.open.rbegin(); it != t.open.rend(); ++it)
    if (it->d == d) return &*it;
  for (auto g = t.groups.rbegin(); g != t.groups.rend(); ++g)
    for (auto it = g->rbegin(); it != g->rend(); ++it)
      if (it->d == d) return &*it;
  return nullptr;
}

// Reads element (mn, k) of a shared-memory operand, recording it in the snapshot.
inline float read_operand(const SmemDesc& d, bool mn_major, int mn, int k, bool bf16, WgSnapshot& snap) {
  Block* b = cur_block();
  const uint32_t addr = operand_address(d, mn_major, mn, k);
  if (addr + 2 > b->smem_bytes) fail_here("wgmma operand outside the block's shared memory");
  if (b->proxy_owner[addr / 16])
    fail_here("wgmma reads shared memory written through the generic proxy (cp.async or st.shared) "
              "before its writer's fence.proxy.async");
  uint16_t h;
  std::memcpy(&h, b->smem + addr, 2);
  snap.addr.push_back(addr);
  snap.val.push_back(h);
  return bf16 ? bf16_to_float(h) : f16_to_float(h);
}

// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}: d (N / 2 registers per thread) = A B + d
// (or A B when `acc` is 0). A from shared memory (descriptor `da`, K-major) or from registers
// `a`; B from shared memory (descriptor `db`, K-major or, with `trans_b`, N-major).
inline void wgmma(float* d, int n, uint64_t da, const uint32_t* a, uint64_t db, bool acc, bool bf16, bool trans_b) {
  Block* b = cur_block();
  Thread& me = self();
  const int tid = self_tid(), wg = tid / 128, r = tid % 128;
  if (b->nthreads % 128) fail_here("wgmma needs whole warpgroups (a block of a multiple of 128 threads)");
  if (!me.wgmma_fenced) fail_here("wgmma.mma_async without a wgmma.fence since the thread's last wgmma.wait_group");
  if (wg_threads().size() < size_t(b->nthreads)) wg_threads().resize(b->nthreads);
  if (wg_calls().size() < size_t(b->nthreads / 128)) wg_calls().resize(b->nthreads / 128);
  WgCall& c = wg_calls()[wg];
  const int flags = int(bf16) | int(trans_b) << 1 | int(a != nullptr) << 2;
  if (c.arrived == 0) {
    c.n = n, c.acc = acc, c.flags = flags, c.da = da, c.db = db;
  } else if (c.n != n || c.acc != int(acc) || c.flags != flags || c.db != db || (!a && c.da != da)) {
    fail_here("threads of a warpgroup issue wgmma with different shapes, types, flags or descriptors");
  }
  if (a)
    for (int i = 0; i < 4; ++i) c.a[r][i] = a[i];
  c.aptr[r] = a;
  c.d[r] = d;
  me.wgmma_groups += 1;
  if (++c.arrived < 128) {
    me.state = State::warp_wait;
    switch_to_scheduler();
    return;
  }
  // the last thread to arrive computes the op for the whole warpgroup
  c.arrived = 0;
  auto snap = std::make_shared<WgSnapshot>();
  const SmemDesc sa = decode_desc(c.da), sb = decode_desc(c.db);
  if ((!a && sa.base_offset) || sb.base_offset)
    fail_here("wgmma descriptor with a non-zero base offset (not modeled: start tiles on the pattern boundary)");
  // a K-major swizzled operand's 16 k (32 bytes) must lie within one swizzle row
  if (!a && sa.swizzle && sa.start % sa.swizzle + 32 > uint32_t(sa.swizzle))
    fail_here("wgmma A operand: the 16 k of the instruction cross a swizzle row");
  if (!trans_b && sb.swizzle && sb.start % sb.swizzle + 32 > uint32_t(sb.swizzle))
    fail_here("wgmma B operand: the 16 k of the instruction cross a swizzle row");
  std::vector<float> A(64 * 16), B(16 * n);
  if (a) {
    snap->a_val.assign(128 * 4, 0);
    for (int t = 0; t < 128; ++t) {
      snap->a_regs.push_back(c.aptr[t]);
      for (int i = 0; i < 4; ++i) snap->a_val[t * 4 + i] = c.a[t][i];
      for (int reg = 0; reg < 4; ++reg)
        for (int e = 0; e < 2; ++e) {
          int row, col;
          wgmma_a_element(t, reg, e, row, col);
          const uint16_t h = uint16_t(c.a[t][reg] >> (16 * e));
          A[row * 16 + col] = bf16 ? bf16_to_float(h) : f16_to_float(h);
        }
    }
  } else {
    for (int m = 0; m < 64; ++m)
      for (int k = 0; k < 16; ++k) A[m * 16 + k] = read_operand(sa, false, m, k, bf16, *snap);
  }
  for (int k = 0; k < 16; ++k)
    for (int j = 0; j < n; ++j) B[k * n + j] = read_operand(sb, trans_b, j, k, bf16, *snap);
  const int base = wg * 128;
  for (int t = 0; t < 128; ++t) {
    WgPending p;
    p.d = c.d[t];
    p.snap = snap;
    const WgPending* prev = newest_pending(base + t, c.d[t]);
    for (int i = 0; i < n / 2; ++i) {
      int row, col;
      wgmma_d_element(t, i, row, col);
      float s = !acc ? 0.f : prev ? prev->value[i] : c.d[t][i];
      for (int k = 0; k < 16; ++k) s = std::fma(A[row * 16 + k], B[k * n + col], s);
      p.value.push_back(s);
    }
    for (int i = 0; i < n / 2; ++i) c.d[t][i] = std::numeric_limits<float>::quiet_NaN();   // until retired
    wg_threads()[base + t].open.push_back(std::move(p));
  }
  wgmma_count() += 1;
  for (int t = 0; t < 128; ++t)
    if (b->threads[base + t].state == State::warp_wait) b->threads[base + t].state = State::runnable;
}

inline void wgmma_commit() {
  WgThreadState& t = wg_threads()[self_tid()];
  t.groups.push_back(std::move(t.open));
  t.open.clear();
}

// Retires this thread's oldest groups until at most `n` remain pending: checks that what they read
// is unchanged, then writes their results to the accumulator registers.
inline void wgmma_wait(int n) {
  if (wg_threads().size() <= size_t(self_tid())) wg_threads().resize(cur_block()->nthreads);
  WgThreadState& t = wg_threads()[self_tid()];
  Block* b = cur_block();
  const int r = self_tid() % 128;
  while (int(t.groups.size()) > n) {
    for (WgPending& p : t.groups.front()) {
      const WgSnapshot& s = *p.snap;
      for (size_t i = 0; i < s.addr.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, b->smem + s.addr[i], 2);
        if (h != s.val[i]) fail_here("shared memory read by an in-flight wgmma was overwritten before its wait_group");
      }
      if (!s.a_regs.empty())
        for (int i = 0; i < 4; ++i)
          if (s.a_regs[r][i] != s.a_val[r * 4 + i])
            fail_here("A registers of an in-flight wgmma were modified before its wait_group");
      std::memcpy(p.d, p.value.data(), p.value.size() * sizeof(float));
      self().wgmma_groups -= 1;
    }
    t.groups.erase(t.groups.begin());
  }
  self().wgmma_fenced = false;
}

// fence.proxy.async.shared::cta: this thread's earlier generic-proxy writes (here: its retired
// cp.async copies and its prim::st_shared stores) become visible to the async proxy.
inline void fence_proxy_async() {
  const int me = self_tid() + 1;
  for (int& o : cur_block()->proxy_owner)
    if (o == me) o = 0;
}

}  // namespace emu
}  // namespace effattn
