// The host emulation of Hopper's asynchronous machinery: mbarriers, TMA tensor maps with their bulk
// tensor copies, named barriers and warpgroup register reallocation (setmaxnreg). Only
// csrc/common/prims_async.cuh includes this file. The rules are the PTX ISA's ("mbarrier",
// "cp.async.bulk.tensor", "Tensor Map", "setmaxnreg", "bar.sync") and the driver's for
// cuTensorMapEncodeTiled; where the ISA leaves a use undefined, the emulation fails with the reason.
//
// mbarrier (a 64-bit object in shared memory; here its state lives beside the block, keyed by offset):
// - init(count): count in 1 .. 2^20 - 1; phase parity 0, pending arrivals = count, tx-count 0;
// - arrive: pending - 1 (an arrive when none is pending fails: the ISA leaves it undefined);
//   expect_tx(n): tx-count + n (n in 0 .. 2^20 - 1); arrive.expect_tx: expect_tx, then arrive;
//   complete_tx(n) (a bulk copy landing n bytes): tx-count - n. tx-count stays in
//   -(2^20 - 1) .. 2^20 - 1, and may go below zero only while arrivals are pending (a copy landing
//   before its expect_tx); below zero with no arrival pending is an underflow: more bytes landed than
//   the phase expects, the hardware would complete the phase before the copy's last byte;
// - the phase completes when pending arrivals and tx-count are both zero: its parity flips and the
//   pending count is reloaded with the init count;
// - try_wait.parity(P) is true when the phase of parity P has completed, i.e. the current phase's
//   parity is not P (so right after init, waiting on parity 1 passes and on parity 0 blocks).
// Bulk tensor copies: the destination is poisoned (0xFF: NaN) when issued; the bytes land, with the
// mbarrier's complete_tx, when a thread tests that mbarrier's phase (a consumer's wait), so a read
// before the wait reads NaN, a wrong expect_tx fails (at once, or as a tx-count left at block end: emu.h's
// run_grid), and a copy nobody waits for fails at block end.
// Out-of-bounds box elements (any coordinate < 0 or >= its dimension) land as zeros, as with
// CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE; the byte count is always the whole box's. The swizzle is
// applied to the shared-memory address bits as wgmma reads them (emu/wgmma.h); bulk copies write
// through the async proxy, so wgmma reads them without a fence.proxy.async.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

namespace effattn {
namespace emu {

constexpr int64_t kTxLimit = (int64_t(1) << 20) - 1;

// A tiled tensor map (CUtensorMap's content as cuTensorMapEncodeTiled builds it): rank 1..5,
// dimension 0 the contiguous one.
struct TensorMap {
  const char* base = nullptr;
  int rank = 0, elem_bytes = 0, swizzle = 0;     // swizzle: 0, 32, 64 or 128 bytes
  uint64_t dims[5] = {}, strides[5] = {};        // strides in bytes; strides[0] = elem_bytes
  uint32_t box[5] = {};
};

// Fills `m` (the arguments checked by prim::tensor_map_problem, common/prims_async.cuh).
inline void make_tensor_map(TensorMap& m, const void* base, int elem_bytes, int rank, const uint64_t* dims,
                            const uint64_t* strides, const uint32_t* box, int swizzle) {
  m = TensorMap();
  m.base = static_cast<const char*>(base);
  m.rank = rank, m.elem_bytes = elem_bytes, m.swizzle = swizzle;
  for (int i = 0; i < rank; ++i) {
    m.dims[i] = dims[i];
    m.box[i] = box[i];
    m.strides[i] = i == 0 ? uint64_t(elem_bytes) : strides[i - 1];
  }
}

inline uint32_t swizzle_address(uint32_t addr, int width);   // emu/wgmma.h

// ---------------------------------------------------------------------------- mbarrier

inline AsyncState& async_state() { return cur_block()->async; }

inline uint32_t mbar_offset(const void* bar) {
  Block* b = cur_block();
  const char* c = static_cast<const char*>(bar);
  if (c < b->smem || c + 8 > b->smem + b->smem_bytes) fail_here("mbarrier outside the block's shared memory");
  if ((c - b->smem) % 8) fail_here("mbarrier is not 8-byte aligned");
  return uint32_t(c - b->smem);
}

inline Mbarrier& mbar_at(const void* bar) {
  auto it = async_state().mbars.find(mbar_offset(bar));
  if (it == async_state().mbars.end()) fail_here("mbarrier used before mbarrier.init");
  return it->second;
}

inline void wake(const void* obj) {
  for (auto& t : cur_block()->threads)
    if (t.state == State::async_wait && t.wait_obj == obj) t.state = State::runnable;
}

inline void mbar_init(void* bar, int64_t count) {
  const uint32_t off = mbar_offset(bar);
  if (count < 1 || count > kTxLimit) fail_here("mbarrier.init: arrival count outside 1..2^20-1");
  for (const BulkCopy& c : async_state().copies)
    if (c.bar == off) fail_here("mbarrier.init on an mbarrier with bulk copies in flight");
  Mbarrier m;
  m.expected = uint32_t(count);
  m.pending = count;
  async_state().mbars[off] = m;
  std::memset(bar, 0, 8);
}

inline void mbar_try_complete(void* bar, Mbarrier& m) {
  if (m.pending == 0 && m.tx == 0) {
    m.phase ^= 1;
    m.completed += 1;
    m.pending = m.expected;
    wake(bar);
  }
}

inline void mbar_check_tx(const Mbarrier& m) {
  if (m.tx > kTxLimit || m.tx < -kTxLimit) fail_here("mbarrier tx-count outside -(2^20-1)..2^20-1");
  if (m.tx < 0 && m.pending == 0) {
    char what[200];
    std::snprintf(what, sizeof what,
                  "mbarrier tx-count underflow: %lld bytes more landed than the phase expects with no arrival "
                  "pending (the phase would complete before the copy landed)",
                  (long long)-m.tx);
    fail_here(what);
  }
}

inline void mbar_expect_tx(void* bar, int64_t bytes) {
  Mbarrier& m = mbar_at(bar);
  if (bytes < 0 || bytes > kTxLimit) fail_here("mbarrier.expect_tx: byte count outside 0..2^20-1");
  m.tx += bytes;
  mbar_check_tx(m);
  wake(bar);
}

// mbarrier.arrive: returns the parity of the phase it arrived on (the state token's content)
inline int mbar_arrive(void* bar) {
  Mbarrier& m = mbar_at(bar);
  if (m.pending == 0) fail_here("mbarrier.arrive with no arrival pending in the phase (undefined in the ISA)");
  const int phase = m.phase;
  m.pending -= 1;
  mbar_check_tx(m);
  mbar_try_complete(bar, m);
  wake(bar);
  return phase;
}

inline int mbar_arrive_expect_tx(void* bar, int64_t bytes) {
  mbar_expect_tx(bar, bytes);
  return mbar_arrive(bar);
}

// The complete-tx of `bytes` on the mbarrier at shared offset `off` (a bulk copy landing).
inline void mbar_complete_tx(uint32_t off, int64_t bytes) {
  char* bar = cur_block()->smem + off;
  Mbarrier& m = mbar_at(bar);
  m.tx -= bytes;
  mbar_check_tx(m);
  mbar_try_complete(bar, m);
}

// Lands every bulk copy in flight on the mbarrier at `off`, in issue order.
inline void land_copies(uint32_t off) {
  auto& copies = async_state().copies;
  for (size_t i = 0; i < copies.size();) {
    if (copies[i].bar != off) {
      ++i;
      continue;
    }
    BulkCopy c = std::move(copies[i]);
    copies.erase(copies.begin() + i);
    std::memcpy(cur_block()->smem + c.dst, c.image.data(), c.image.size());
    mbar_complete_tx(off, int64_t(c.image.size()));
  }
}

// mbarrier.try_wait.parity: lands the copies on the mbarrier, then tests the phase of parity `parity`.
inline bool mbar_try_wait(void* bar, int parity) {
  const uint32_t off = mbar_offset(bar);
  mbar_at(bar);
  land_copies(off);
  return mbar_at(bar).phase != (parity & 1);
}

// The wait loop of a kernel: blocks the thread until the phase of parity `parity` has completed.
inline void mbar_wait(void* bar, int parity) {
  while (!mbar_try_wait(bar, parity)) {
    const Mbarrier& m = mbar_at(bar);
    char what[240];
    std::snprintf(what, sizeof what,
                  "a thread waits on the mbarrier at shared offset %u for its phase of parity %d, which never "
                  "completes (%lld arrivals of %u pending, tx-count %lld)",
                  mbar_offset(bar), parity & 1, (long long)m.pending, m.expected, (long long)m.tx);
    Thread& t = self();
    t.waiting = what;
    t.wait_obj = bar;
    t.state = State::async_wait;
    switch_to_scheduler();
  }
}

// ---------------------------------------------------------------------------- bulk tensor copies

// cp.async.bulk.tensor.<rank>d.shared::cluster.global.mbarrier::complete_tx::bytes: the box of `map` at
// coordinates `coord` (rank of them, signed) into shared memory at `dst`, completing on `bar`.
inline void tma_load(void* dst, const TensorMap* map, void* bar, const int* coord, int ncoord) {
  Block* b = cur_block();
  const uint32_t boff = mbar_offset(bar);
  mbar_at(bar);
  if (!map || map->rank == 0) fail_here("bulk tensor copy with a tensor map that was never encoded");
  if (ncoord != map->rank) fail_here("bulk tensor copy: the coordinate count differs from the tensor map's rank");
  const char* d = static_cast<const char*>(dst);
  if ((d - b->smem) % 128) fail_here("bulk tensor copy: shared destination is not 128-byte aligned");
  uint64_t n = map->elem_bytes;
  for (int i = 0; i < map->rank; ++i) n *= map->box[i];
  check_smem(dst, n, "bulk tensor copy: the box lands outside the block's shared memory");
  const uint32_t doff = uint32_t(d - b->smem);
  for (const auto& kv : async_state().mbars)
    if (kv.first + 8 > doff && kv.first < doff + n) fail_here("bulk tensor copy: the box lands on an mbarrier");
  BulkCopy c;
  c.dst = doff, c.bar = boff, c.issuer = self_tid();
  c.image.assign(n, 0);
  // element e of the box (dimension 0 fastest) at box-relative byte e * elem_bytes, swizzled by address
  int idx[5] = {0, 0, 0, 0, 0};
  for (uint64_t e = 0; e < n / map->elem_bytes; ++e) {
    bool inside = true;
    uint64_t src = 0;
    for (int i = 0; i < map->rank; ++i) {
      const int64_t x = int64_t(coord[i]) + idx[i];
      if (x < 0 || uint64_t(x) >= map->dims[i]) inside = false;
      else src += uint64_t(x) * map->strides[i];
    }
    const uint32_t at = swizzle_address(doff + uint32_t(e * map->elem_bytes), map->swizzle) - doff;
    if (inside) std::memcpy(&c.image[at], map->base + src, map->elem_bytes);
    for (int i = 0; i < map->rank && ++idx[i] == int(map->box[i]); ++i) idx[i] = 0;
  }
  std::memset(b->smem + doff, 0xFF, n);        // poisoned until it lands
  for (uint64_t k = doff / 16; k < (doff + n + 15) / 16; ++k) b->proxy_owner[k] = 0;   // async-proxy writes
  async_state().copies.push_back(std::move(c));
  wake(bar);
}

// ---------------------------------------------------------------------------- named barriers

// bar.sync id, count / bar.arrive id, count: `count` threads (a multiple of 32) meet at barrier `id`
// (1..15; 0 is __syncthreads); every thread counted in one phase gives the same count. bar.sync waits
// for the phase to complete, bar.arrive only adds its thread (a producer's signal to the threads that
// sync). A thread counted twice in one phase fails: the hardware counts arrivals per warp, so the phase
// would complete on a warp's second arrival without the threads it is meant to order (a bar.sync that
// pairs with an arrive removed). Arrivals left at block end fail in run_grid (emu.h).
inline NamedBarrier& named_arrival(int id, int count, const char* op) {
  if (id < 1 || id > 15) fail_here((std::string(op) + ": named barrier id outside 1..15").c_str());
  if (count <= 0 || count % 32 || count > cur_block()->nthreads)
    fail_here((std::string(op) + ": thread count is not a positive multiple of 32 within the block").c_str());
  NamedBarrier& nb = async_state().named[id];
  if (nb.arrived == 0) nb.count = count;
  else if (nb.count != count) fail_here((std::string(op) + ": threads of one named barrier give different counts").c_str());
  for (int t : nb.who)
    if (t == self_tid()) {
      char what[200];
      std::snprintf(what, sizeof what,
                    "%s: a thread arrives twice at one phase of named barrier %d (%d of %d threads in: a matching "
                    "bar.sync or bar.arrive of other threads is missing)",
                    op, id, nb.arrived, count);
      fail_here(what);
    }
  nb.who.push_back(self_tid());
  return nb;
}

inline bool named_complete(NamedBarrier& nb) {
  if (++nb.arrived < nb.count) return false;
  nb.arrived = 0;
  nb.who.clear();
  wake(&nb);
  return true;
}

inline void named_sync(int id, int count) {
  NamedBarrier& nb = named_arrival(id, count, "bar.sync");
  if (named_complete(nb)) return;
  char what[120];
  std::snprintf(what, sizeof what, "a thread waits at named barrier %d for %d threads that never all arrive", id, count);
  Thread& t = self();
  t.waiting = what;
  t.wait_obj = &nb;
  t.state = State::async_wait;
  switch_to_scheduler();
}

inline void named_arrive(int id, int count) { named_complete(named_arrival(id, count, "bar.arrive")); }

// ---------------------------------------------------------------------------- setmaxnreg

inline void grant_registers() {
  AsyncState& a = async_state();
  for (size_t w = 0; w < a.reg_req.size(); ++w) {
    RegRequest& r = a.reg_req[w];
    if (!r.granted_wait) continue;
    const int64_t need = int64_t(r.value - a.wg_regs[w]) * 128;
    if (need > a.reg_pool) continue;
    a.reg_pool -= need;
    a.wg_regs[w] = r.value;
    r = RegRequest();
    wake(&r);
  }
}

// setmaxnreg.{inc,dec}.sync.aligned.u32 value: every thread of the warpgroup executes the same one;
// value a multiple of 8 in 24..256, not below the current count for .inc nor above it for .dec.
// .dec returns registers to the CTA's pool at once; .inc blocks until the pool has them.
inline void setmaxnreg(int value, bool inc) {
  Block* b = cur_block();
  if (b->nthreads % 128) fail_here("setmaxnreg needs whole warpgroups (a block of a multiple of 128 threads)");
  if (value < 24 || value > 256 || value % 8) fail_here("setmaxnreg: register count outside 24..256 or not a multiple of 8");
  AsyncState& a = async_state();
  const int w = self_tid() / 128;
  RegRequest& r = a.reg_req[w];
  if (r.arrived == 0) {
    if (inc && value < a.wg_regs[w]) fail_here("setmaxnreg.inc below the warpgroup's current register count");
    if (!inc && value > a.wg_regs[w]) fail_here("setmaxnreg.dec above the warpgroup's current register count");
    r.value = value, r.inc = inc;
  } else if (r.value != value || r.inc != int(inc)) {
    fail_here("threads of a warpgroup execute different setmaxnreg instructions");
  }
  if (++r.arrived == 128) {
    if (!inc) {
      a.reg_pool += int64_t(a.wg_regs[w] - value) * 128;
      a.wg_regs[w] = value;
      r = RegRequest();
      wake(&r);
      grant_registers();
      return;
    }
    r.granted_wait = true;
    grant_registers();
    if (!a.reg_req[w].granted_wait) return;   // granted at once
  }
  char what[200];
  std::snprintf(what, sizeof what,
                "warpgroup %d waits in setmaxnreg.%s %d for registers the CTA's pool never has (pool %lld, "
                "current %d per thread)",
                w, inc ? "inc" : "dec", value, (long long)a.reg_pool, a.wg_regs[w]);
  Thread& t = self();
  t.waiting = what;
  t.wait_obj = &r;
  t.state = State::async_wait;
  switch_to_scheduler();
}

inline int warpgroup_regs(int warpgroup) { return async_state().wg_regs[warpgroup]; }

}  // namespace emu
}  // namespace effattn
