// The host emulation of a CUDA thread block, for compiling effattn's kernels with g++
// (EFFATTN_CUDA_EMU). Only csrc/common/prims.cuh includes this file.
//
// A block's threads run as fibers (ucontext) on one OS thread. A fiber gives up the CPU only at a
// block barrier or inside a warp collective (shuffle, ldmatrix, mma), so every run is deterministic.
// Warp collectives: each lane deposits its operands and waits; the 32nd lane to arrive computes
// every lane's result from the PTX ISA fragment layouts (emu/fragments.h) and all lanes go on.
//
// What makes kernel bugs visible here:
// - shared memory is filled with NaN bit patterns (0xFF bytes) when a block starts;
// - a cp.async destination is NaN-poisoned when the copy is issued and written only at the
//   cp.async.wait_group that retires its group (bytes past src_bytes are zero-filled), so a missing
//   wait or barrier reads NaN;
// - fails (emu::Failure, a std::runtime_error naming the thread, also printed to stderr) on
//   misaligned cp.async/ldmatrix addresses, shared-memory accesses out of the block's buffer, a
//   thread that exits with copies not waited for, lanes of one warp in different collectives,
//   barriers that can never complete, and a launch asking for more shared memory per block than
//   the emulated device's opt-in limit (`smem_limit()`, an H100's by default). A failure inside a
//   thread abandons the block's fibers and is thrown from `launch`, so an op called from Python
//   raises it as a RuntimeError with the reason (a program without a handler still aborts);
// - schedules: `lockstep` runs every thread one step (to its next barrier or collective) per pass;
//   `warp_serial` (the default) runs the lowest-numbered warp until it blocks at a barrier, which
//   exposes a missing __syncthreads that lockstep hides; `warp_serial_reversed` starts from the last warp.
// - ldmatrix bank accounting: per 8-row phase, the number of shared-memory wavefronts (16-byte
//   rows that fall in the same 128-byte bank window at different addresses serialize).
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "fragments.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define EFFATTN_EMU_ASAN 1
#endif

namespace effattn {
namespace emu {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

enum class Schedule : int { lockstep = 0, warp_serial = 1, warp_serial_reversed = 2 };

struct Stats {
  uint64_t blocks = 0, mma = 0, ldmatrix_phases = 0, ldmatrix_wavefronts = 0, max_wavefronts = 0;
};

// Warp-serial by default: a warp that runs ahead to its next barrier overwrites a tile the other warps
// still read when a barrier is missing, which lockstep hides (every barrier of the kernels' tile loops,
// removed one at a time by csrc/emu/mutate.py, is caught under it).
inline Schedule& schedule() {
  static Schedule s = Schedule::warp_serial;
  return s;
}

inline Stats& stats() {
  static Stats s;
  return s;
}

// The opt-in shared memory per block of the emulated device (bytes): a launch asking for more fails,
// as cudaFuncSetAttribute does on a GPU. 227 KB: sm_90 / sm_100; tests lower it to 99 KB (sm_86, sm_89,
// sm_120) to check which kernels a smaller GPU takes.
inline size_t& smem_limit() {
  static size_t s = 232448;
  return s;
}

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(const char* what, int tid, int block);

// async_wait: at an mbarrier phase, a named barrier or a setmaxnreg.inc (emu/async.h); the thread's
// `waiting` says which, for the deadlock report
enum class State { runnable, warp_wait, bar_wait, async_wait, done };

struct Copy {
  char* dst;
  unsigned char data[16];
  int bytes;
};

struct Thread {
  ucontext_t ctx;
  char* stack = nullptr;
  int tid = 0;
  State state = State::runnable;
  std::vector<Copy> open;                      // issued since the last commit
  std::deque<std::vector<Copy>> committed;     // oldest first
  int wgmma_groups = 0;                        // wgmma ops issued and not yet retired (emu/wgmma.h)
  bool wgmma_fenced = false;                   // a wgmma.fence since the last wgmma.wait_group
  const void* wait_obj = nullptr;              // what an async_wait thread waits on (emu/async.h)
  std::string waiting;                         // ... in words
};

// The Hopper asynchronous state of a block (emu/async.h): mbarriers by shared-memory offset, bulk
// tensor copies in flight, named barriers, and the warpgroups' register counts.
struct Mbarrier {
  uint32_t expected = 0;                       // arrivals per phase (mbarrier.init's count)
  int64_t pending = 0;                         // arrivals still missing in the current phase
  int64_t tx = 0;                              // tx-count of the current phase
  int phase = 0;                               // the current phase's parity
  uint64_t completed = 0;                      // phases completed
};

struct BulkCopy {
  uint32_t dst = 0, bar = 0;                   // shared-memory offsets
  std::vector<unsigned char> image;            // the destination bytes as they land (swizzle applied)
  int issuer = 0;
};

struct NamedBarrier {
  int arrived = 0, count = 0;
  std::vector<int> who;                        // the threads counted in the current phase (bar.sync / bar.arrive)
};

struct RegRequest {                            // a warpgroup's setmaxnreg in progress
  int arrived = 0, value = 0, inc = 0;
  bool granted_wait = false;                   // an inc that waits for the pool
};

struct AsyncState {
  std::map<uint32_t, Mbarrier> mbars;
  std::vector<BulkCopy> copies;                // in flight, in issue order
  NamedBarrier named[16];
  std::vector<int> wg_regs;                    // per warpgroup: the per-thread register count
  std::vector<RegRequest> reg_req;
  int64_t reg_pool = 0;                        // the CTA's free registers
};

// Per-lane operands and results of the collective a warp is in.
struct Warp {
  int arrived = 0;
  int op = -1;
  int arg = 0;                                 // a value every lane must agree on (shuffle mask, ...)
  uint32_t in[32][10];
  const char* addr[32];
  uint32_t out[32][4];
};

enum Op : int { op_shfl = 1, op_ldsm = 2, op_ldsm_t = 3, op_mma_bf16 = 4, op_mma_f16 = 5 };

struct Block {
  Dim3 grid, block_dim, block_idx;
  int nthreads = 0;
  int linear_block = 0;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  char* smem = nullptr;
  size_t smem_bytes = 0;
  int bar_arrived = 0;
  // per 16-byte chunk of shared memory: 1 + the thread whose cp.async or st.shared (prim::st_shared) last
  // wrote it, until that thread's fence.proxy.async, else 0 (wgmma reads through the async proxy: emu/wgmma.h)
  std::vector<int> proxy_owner;
  AsyncState async;
  int current = -1;
  bool in_fiber = false;                       // a thread's fiber runs (else the scheduler)
  std::string failure;                         // set by fail() inside a fiber
  ucontext_t sched;
  std::function<void()> body;
#ifdef EFFATTN_EMU_ASAN
  void* fake_stack = nullptr;
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
#endif
};

inline Block*& cur_block() {
  static Block* b = nullptr;
  return b;
}

inline Thread& self() { return cur_block()->threads[cur_block()->current]; }
inline int self_tid() { return cur_block()->current; }

// Reports a kernel (or launch) error. Inside a thread's fiber the exception cannot unwind past the
// fiber's entry: the message is handed to the scheduler, the fiber is abandoned (never resumed) and
// `launch` throws it. Elsewhere it is thrown at once.
[[noreturn]] inline void fail(const char* what, int tid, int block) {
  char msg[512];
  std::snprintf(msg, sizeof msg, "effattn emulator: %s (thread %d of block %d)", what, tid, block);
  std::fprintf(stderr, "%s\n", msg);
  std::fflush(stderr);
  Block* b = cur_block();
  if (b && b->in_fiber) {
    b->failure = msg;
    b->in_fiber = false;
#ifdef EFFATTN_EMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, b->sched_stack_bottom, b->sched_stack_size);
#endif
    setcontext(&b->sched);
  }
  throw Failure(msg);
}

[[noreturn]] inline void fail_here(const char* what) { fail(what, self_tid(), cur_block()->linear_block); }

constexpr size_t kStack = 256 * 1024;

inline void switch_to_scheduler() {
  Block* b = cur_block();
  Thread& t = b->threads[b->current];
#ifdef EFFATTN_EMU_ASAN
  void* fs = nullptr;
  __sanitizer_start_switch_fiber(&fs, b->sched_stack_bottom, b->sched_stack_size);
  swapcontext(&t.ctx, &b->sched);
  __sanitizer_finish_switch_fiber(fs, nullptr, nullptr);
#else
  swapcontext(&t.ctx, &b->sched);
#endif
}

inline void fiber_main() {
#ifdef EFFATTN_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &cur_block()->sched_stack_bottom, &cur_block()->sched_stack_size);
#endif
  cur_block()->body();
  Block* b = cur_block();
  Thread& t = b->threads[b->current];
  if (!t.open.empty() || !t.committed.empty())
    fail_here("thread exits with cp.async copies it never waited for");
  if (t.wgmma_groups) fail_here("thread exits with wgmma operations it never waited for");
  t.state = State::done;
#ifdef EFFATTN_EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, b->sched_stack_bottom, b->sched_stack_size);
#endif
  setcontext(&b->sched);
}

// ---------------------------------------------------------------------------- block barrier

inline void sync_block() {
  Block* b = cur_block();
  Thread& t = self();
  if (++b->bar_arrived == b->nthreads) {
    b->bar_arrived = 0;
    for (auto& o : b->threads)
      if (o.state == State::bar_wait) o.state = State::runnable;
    return;
  }
  t.state = State::bar_wait;
  switch_to_scheduler();
}

// ---------------------------------------------------------------------------- warp collectives

inline int lane_id() { return self_tid() & 31; }
inline Warp& my_warp() { return cur_block()->warps[self_tid() >> 5]; }

// Called after the lane deposited its operands in w.in[lane] / w.addr[lane]. The last lane to
// arrive runs `compute(w)`, which fills w.out for all lanes.
template <class F>
inline void collective(int op, int arg, F&& compute) {
  Warp& w = my_warp();
  if (w.arrived == 0) {
    w.op = op;
    w.arg = arg;
  } else if (w.op != op || w.arg != arg) {
    fail_here("lanes of one warp are in different collectives (divergence or mismatched arguments)");
  }
  if (++w.arrived == 32) {
    compute(w);
    w.arrived = 0;
    int base = self_tid() & ~31;
    for (int l = 0; l < 32; ++l)
      if (cur_block()->threads[base + l].state == State::warp_wait)
        cur_block()->threads[base + l].state = State::runnable;
    return;
  }
  self().state = State::warp_wait;
  switch_to_scheduler();
}

inline uint32_t shfl_xor(uint32_t v, int mask) {
  Warp& w = my_warp();
  int l = lane_id();
  w.in[l][0] = v;
  collective(op_shfl, mask, [mask](Warp& w) {
    for (int i = 0; i < 32; ++i) w.out[i][0] = w.in[i ^ mask][0];
  });
  return w.out[l][0];
}

inline void check_smem(const void* p, size_t bytes, const char* what) {
  Block* b = cur_block();
  const char* c = static_cast<const char*>(p);
  if (c < b->smem || c + bytes > b->smem + b->smem_bytes) fail_here(what);
}

// Counts the wavefronts of one 8-row ldmatrix phase: distinct 16-byte rows that map to the same
// 16-byte bank group (bits 4..6 of the address) are served one after another.
inline void count_banks(const char* const* rows) {
  int worst = 1;
  for (int g = 0; g < 8; ++g) {
    const char* seen[8];
    int n = 0;
    for (int r = 0; r < 8; ++r) {
      uintptr_t a = reinterpret_cast<uintptr_t>(rows[r]);
      if (((a >> 4) & 7) != uintptr_t(g)) continue;
      bool dup = false;
      for (int s = 0; s < n; ++s) dup |= seen[s] == rows[r];
      if (!dup) seen[n++] = rows[r];
    }
    if (n > worst) worst = n;
  }
  Stats& s = stats();
  s.ldmatrix_phases += 1;
  s.ldmatrix_wavefronts += worst;
  if (uint64_t(worst) > s.max_wavefronts) s.max_wavefronts = worst;
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8m..8m+7 give the row addresses of
// matrix m; register m of each lane receives that lane's share of matrix m.
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr, bool trans) {
  Warp& w = my_warp();
  int l = lane_id();
  if (reinterpret_cast<uintptr_t>(row_addr) % 16) fail_here("ldmatrix row address is not 16-byte aligned");
  check_smem(row_addr, 16, "ldmatrix row address outside the block's shared memory");
  w.addr[l] = static_cast<const char*>(row_addr);
  collective(trans ? op_ldsm_t : op_ldsm, 0, [trans](Warp& w) {
    for (int m = 0; m < 4; ++m) count_banks(&w.addr[8 * m]);
    for (int lane = 0; lane < 32; ++lane)
      for (int m = 0; m < 4; ++m) {
        uint16_t h[2];
        for (int e = 0; e < 2; ++e) {
          int row, col;
          ldmatrix_element(lane, e, trans, row, col);
          std::memcpy(&h[e], w.addr[8 * m + row] + 2 * col, 2);
        }
        w.out[lane][m] = uint32_t(h[0]) | (uint32_t(h[1]) << 16);
      }
  });
  for (int m = 0; m < 4; ++m) r[m] = w.out[l][m];
}

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline float f16_to_float(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return float(x);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32: D = A B + C. Products of 16-bit
// floats are exact in fp32; the sum runs in fp32 in k order (the hardware's order and rounding of
// the sum are unspecified; the tests' error rules allow for that).
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4],
                      bool bf16) {
  Warp& w = my_warp();
  int l = lane_id();
  for (int i = 0; i < 4; ++i) w.in[l][i] = a[i];
  for (int i = 0; i < 2; ++i) w.in[l][4 + i] = b[i];
  for (int i = 0; i < 4; ++i) w.in[l][6 + i] = float_to_bits(c[i]);
  collective(bf16 ? op_mma_bf16 : op_mma_f16, 0, [bf16](Warp& w) {
    float A[16][16], B[16][8], C[16][8];
    for (int lane = 0; lane < 32; ++lane) {
      for (int reg = 0; reg < 4; ++reg)
        for (int e = 0; e < 2; ++e) {
          int row, col;
          mma_a_element(lane, reg, e, row, col);
          uint16_t h = uint16_t(w.in[lane][reg] >> (16 * e));
          A[row][col] = bf16 ? bf16_to_float(h) : f16_to_float(h);
        }
      for (int reg = 0; reg < 2; ++reg)
        for (int e = 0; e < 2; ++e) {
          int row, col;
          mma_b_element(lane, reg, e, row, col);
          uint16_t h = uint16_t(w.in[lane][4 + reg] >> (16 * e));
          B[row][col] = bf16 ? bf16_to_float(h) : f16_to_float(h);
        }
      for (int i = 0; i < 4; ++i) {
        int row, col;
        mma_c_element(lane, i, row, col);
        C[row][col] = bits_to_float(w.in[lane][6 + i]);
      }
    }
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        int row, col;
        mma_c_element(lane, i, row, col);
        float acc = C[row][col];
        for (int k = 0; k < 16; ++k) acc = std::fma(A[row][k], B[k][col], acc);
        w.out[lane][i] = float_to_bits(acc);
      }
    stats().mma += 1;
  });
  for (int i = 0; i < 4; ++i) d[i] = bits_to_float(w.out[l][i]);
}

// ---------------------------------------------------------------------------- cp.async

inline void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes) {
  if (reinterpret_cast<uintptr_t>(smem_dst) % 16) fail_here("cp.async shared destination is not 16-byte aligned");
  if (src_bytes > 0 && reinterpret_cast<uintptr_t>(gmem_src) % 16)
    fail_here("cp.async global source is not 16-byte aligned");
  if (src_bytes < 0 || src_bytes > 16) fail_here("cp.async src_bytes outside 0..16");
  check_smem(smem_dst, 16, "cp.async destination outside the block's shared memory");
  Copy c;
  c.dst = static_cast<char*>(smem_dst);
  c.bytes = src_bytes;
  std::memset(c.data, 0, 16);
  if (src_bytes > 0) std::memcpy(c.data, gmem_src, src_bytes);   // the source is read-only here
  std::memset(c.dst, 0xFF, 16);                                   // poisoned until the wait
  self().open.push_back(c);
}

inline void cp_async_commit() {
  Thread& t = self();
  t.committed.push_back(std::move(t.open));
  t.open.clear();
}

inline void cp_async_wait(int n) {
  Thread& t = self();
  while (int(t.committed.size()) > n) {
    for (const Copy& c : t.committed.front()) {
      std::memcpy(c.dst, c.data, 16);
      cur_block()->proxy_owner[(c.dst - cur_block()->smem) / 16] = self_tid() + 1;
    }
    t.committed.pop_front();
  }
}

// ---------------------------------------------------------------------------- st.shared (generic proxy)

// A plain shared-memory store by this thread (prim::st_shared): a generic-proxy write, so the 16-byte
// chunks it touches need this thread's fence.proxy.async before a wgmma reads them (proxy_owner, as
// cp.async's retired copies).
template <class T>
inline void st_shared(T* p, T v) {
  check_smem(p, sizeof(T), "st.shared outside the block's shared memory");
  std::memcpy(p, &v, sizeof(T));
  Block* b = cur_block();
  const size_t off = size_t(reinterpret_cast<char*>(p) - b->smem);
  for (size_t k = off / 16; k <= (off + sizeof(T) - 1) / 16; ++k) b->proxy_owner[k] = self_tid() + 1;
}

// ---------------------------------------------------------------------------- ordered turns in global memory

// A per-tile semaphore that orders the blocks adding into one global accumulator (the fused backward's
// dQ). Blocks run one after another in grid order here, so a block whose turn has not come waits for a
// later block (or for none): on a GPU that block would spin until a later-scheduled block released the
// turn, which can deadlock when the grid does not fit the GPU at once. Both are kernel errors.
inline void sem_wait(const int* sem, int turn) {
  if (*sem != turn) {
    char what[200];
    std::snprintf(what, sizeof what,
                  "waits for turn %d of a semaphore that holds %d: no earlier block releases it (a deadlock on a GPU)",
                  turn, *sem);
    fail_here(what);
  }
}
inline void sem_release(int* sem, int value) { *sem = value; }

// ---------------------------------------------------------------------------- launch

inline Dim3& block_idx_ref() {
  static Dim3 d;
  return d;
}

inline int pick_next(Block& b, int last) {
  int n = b.nthreads;
  if (schedule() == Schedule::lockstep) {
    for (int s = 1; s <= n; ++s) {
      int t = (last + s) % n;
      if (b.threads[t].state == State::runnable) return t;
    }
    return -1;
  }
  int nw = n / 32;
  // warp-serial: stay in the running warp while it has runnable lanes, else the first warp that
  // has one (in order, or in reverse order)
  int cw = last >= 0 ? last / 32 : -1;
  if (cw >= 0)
    for (int s = 1; s <= 32; ++s) {
      int t = cw * 32 + (last % 32 + s) % 32;
      if (b.threads[t].state == State::runnable) return t;
    }
  for (int i = 0; i < nw; ++i) {
    int wi = schedule() == Schedule::warp_serial ? i : nw - 1 - i;
    for (int l = 0; l < 32; ++l)
      if (b.threads[wi * 32 + l].state == State::runnable) return wi * 32 + l;
  }
  return -1;
}

inline Block& block_storage() {
  static Block b;
  return b;
}

inline void run_grid(Block& b, Dim3 grid, int nthreads, size_t smem_bytes);

// Runs every block of the grid, one after another. `kernel` is called once per thread. A failure
// (fail()) frees the block's stacks and shared memory and is thrown from here.
template <class F>
void launch(Dim3 grid, Dim3 block_dim, size_t smem_bytes, F&& kernel) {
  int nthreads = int(block_dim.x * block_dim.y * block_dim.z);
  if (nthreads % 32) fail("block size is not a multiple of 32", 0, 0);
  if (smem_bytes > smem_limit()) {
    char what[160];
    std::snprintf(what, sizeof what, "launch asks for %zu bytes of shared memory per block, the device allows %zu",
                  smem_bytes, smem_limit());
    fail(what, 0, 0);
  }
  Block& b = block_storage();
  b.grid = grid;
  b.block_dim = block_dim;
  b.nthreads = nthreads;
  b.threads.assign(nthreads, Thread());
  b.warps.assign(nthreads / 32, Warp());
  b.smem_bytes = smem_bytes;
  // exactly the requested size, so that AddressSanitizer sees an access past the end
  void* mem = nullptr;
  // 1024-byte aligned, as the shared-memory window: wgmma's swizzle reads address bits 7..9
  if (posix_memalign(&mem, 1024, smem_bytes ? smem_bytes : 1)) fail("out of memory for shared memory", 0, 0);
  b.smem = static_cast<char*>(mem);
  for (auto& t : b.threads) t.stack = static_cast<char*>(std::malloc(kStack));
  b.body = [&kernel] { kernel(); };
  b.failure.clear();
  b.in_fiber = false;
  cur_block() = &b;
  auto release = [&b] {
    for (auto& t : b.threads) std::free(t.stack);
    b.threads.clear();
    std::free(b.smem);
    b.smem = nullptr;
    cur_block() = nullptr;
  };
  try {
    run_grid(b, grid, nthreads, smem_bytes);
  } catch (...) {
    release();
    throw;
  }
  release();
}

// The registers a block of n threads starts with, per thread: what ptxas gives a kernel of
// __launch_bounds__(n, 1) on a 64K-register SM (a multiple of 8, at most 256); setmaxnreg moves them
// between warpgroups through the CTA's pool, which starts empty.
inline int launch_regs(int nthreads) {
  const int r = 65536 / nthreads / 8 * 8;
  return r > 256 ? 256 : r;
}

inline void reset_async(Block& b) {
  b.async = AsyncState();
  b.async.wg_regs.assign((b.nthreads + 127) / 128, launch_regs(b.nthreads));
  b.async.reg_req.assign(b.async.wg_regs.size(), RegRequest());
}

inline void run_grid(Block& b, Dim3 grid, int nthreads, size_t smem_bytes) {
  int linear = 0;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x, ++linear) {
        b.block_idx = {x, y, z};
        b.linear_block = linear;
        b.bar_arrived = 0;
        std::memset(b.smem, 0xFF, smem_bytes);     // NaN in every float format
        b.proxy_owner.assign(smem_bytes / 16 + 1, 0);
        for (auto& w : b.warps) w = Warp();
        reset_async(b);
        for (int i = 0; i < nthreads; ++i) {
          Thread& t = b.threads[i];
          t.tid = i;
          t.state = State::runnable;
          t.open.clear();
          t.committed.clear();
          t.wgmma_groups = 0;
          t.wgmma_fenced = false;
          t.wait_obj = nullptr;
          t.waiting.clear();
          getcontext(&t.ctx);
          t.ctx.uc_stack.ss_sp = t.stack;
          t.ctx.uc_stack.ss_size = kStack;
          t.ctx.uc_link = nullptr;
          makecontext(&t.ctx, fiber_main, 0);
        }
        int last = -1;
        for (;;) {
          int next = pick_next(b, last);
          if (next < 0) {
            for (int i = 0; i < nthreads; ++i)
              if (b.threads[i].state == State::async_wait)
                fail(("deadlock: " + b.threads[i].waiting).c_str(), i, linear);
            for (int i = 0; i < nthreads; ++i)
              if (b.threads[i].state != State::done)
                fail(b.threads[i].state == State::bar_wait
                         ? "deadlock: a thread waits at a barrier that the other threads never reach"
                         : "deadlock: a lane waits in a warp collective that the rest of its warp never reaches",
                     i, linear);
            if (!b.async.copies.empty())
              fail("the block ends with bulk tensor copies in flight (no thread waited on their mbarrier)",
                   b.async.copies.front().issuer, linear);
            // every phase's tx-count is spent when its copies land: a count left over is an expect_tx that
            // announced fewer bytes than landed (the phase completed before its last copy) or more
            for (const auto& kv : b.async.mbars)
              if (kv.second.tx != 0)
                fail(("the block ends with the mbarrier at shared offset " + std::to_string(kv.first) +
                      " at tx-count " + std::to_string(kv.second.tx) +
                      (kv.second.tx < 0 ? ": more bytes landed than its expect_tx announced (a phase completed "
                                          "before its last bulk copy landed)"
                                        : ": bytes its expect_tx announced never landed"))
                         .c_str(),
                     0, linear);
            for (int id = 1; id < 16; ++id)
              if (b.async.named[id].arrived)
                fail(("the block ends with " + std::to_string(b.async.named[id].arrived) + " of " +
                      std::to_string(b.async.named[id].count) + " threads arrived at named barrier " +
                      std::to_string(id) + " (a bar.arrive no bar.sync consumed)")
                         .c_str(),
                     b.async.named[id].who.front(), linear);
            break;
          }
          b.current = next;
          last = next;
          b.in_fiber = true;
#ifdef EFFATTN_EMU_ASAN
          __sanitizer_start_switch_fiber(&b.fake_stack, b.threads[next].stack, kStack);
          swapcontext(&b.sched, &b.threads[next].ctx);
          __sanitizer_finish_switch_fiber(b.fake_stack, nullptr, nullptr);
#else
          swapcontext(&b.sched, &b.threads[next].ctx);
#endif
          b.in_fiber = false;
          if (!b.failure.empty()) throw Failure(b.failure);
        }
        stats().blocks += 1;
      }
}

inline unsigned thread_x() { return unsigned(cur_block()->current); }
inline Dim3 block_index() { return cur_block()->block_idx; }

}  // namespace emu
}  // namespace effattn
