// Hopper (sm_90a) forward, warp-specialized: a producer warpgroup loads Q, K and V with TMA into a
// two-stage ring guarded by mbarriers, two consumer warpgroups compute with asynchronous wgmma.
//
// One block = three warpgroups (384 threads) per (query tile of 128 rows, b, h). Warpgroups 0 and 1
// are the consumers of fwd_sm90.cuh's kernel (its consume_key_tiles: rows [64 w, 64 w + 64), the same
// products, online softmax, masks and epilogue, S(t) issued with P V(t - 1) behind it), here in
// ping-pong turns (PingPong: one warpgroup's wgmmas run while the other's softmax does) on key tiles of
// 128 (kFwdTmaKeyTile, every instance); warpgroup 2 is the producer: its register count drops
// to 24 (setmaxnreg.dec) and the consumers' rises to 240 (setmaxnreg.inc), and one of its threads
// issues every copy. Q, K and V arrive as 64-column boxes of 4-D tensor maps
// (D, L, heads, batch) in the 128-byte swizzle wgmma reads (Sw128Tile): rows past L and columns past
// D land as zeros (the hardware's out-of-bounds fill), so no copy is predicated.
// The ring: stage s = t % 2 holds K(t) and V(t). full[s] (1 arrival + the stage's bytes) completes when
// the producer's arrive.expect_tx and both tiles' bytes are in; empty[s] (256 arrivals) when every
// consumer thread's P V(t) has retired (after that, S(t) retired too). The producer waits for empty
// of a stage's previous use before refilling it; the consumers wait for full. Phase parities: use u
// of a stage is tile 2 u + s; consumers wait full's parity u % 2, the producer empty's (u - 1) % 2 (the
// first use passes at once: the phase "before" init counts as complete).
// Keys no row of the block sees are zeroed in V by the consumers (generic stores: a fence.proxy.async,
// then the consumers' named barrier 1), as in fwd_sm90.cuh.
#pragma once

#include "attention/fwd_sm90.cuh"
#include "common/prims_async.cuh"

#if defined(EFFATTN_CUDA_EMU)
#define EFFATTN_KERNEL_WG3 inline void
#define EFFATTN_GRID_CONSTANT
#else
#define EFFATTN_KERNEL_WG3 __global__ void __launch_bounds__(384, 1)
#define EFFATTN_GRID_CONSTANT __grid_constant__
#endif

namespace effattn {

// The kernel's one parameter: the call and its three tensor maps (a __grid_constant__ parameter: TMA
// reads a map through its address).
struct FwdTmaParams {
  prim::TensorMap q, k, v;
  AttnParams p;
};

// The TMA kernel's key tile, every instance (kDense, kWindow, kAny): 128 keys, 128 x 128 tiles. kAny (key
// padding, positions, dropout, layouts) too: its layout lists are built on the host for 128-key tiles
// (effattn/backends/cuda/attention/tiling.py HOPPER_TMA_TILES; a tile over two 64-key layout blocks is full
// only if both are, and partial tiles read the layout per element, lay_check), and its dropout keep-mask is
// drawn per (row, key) as in every kernel. Offline sm_90a (nvcc 13.0): the kAny instance's consumers use up
// to R218 of the 240 registers setmaxnreg gives them at D128, no spills (benchmarks/results/offline-sm90).
constexpr int kFwdTmaKeyTile = 128;

// the box of one TMA copy: 64 columns (128 bytes, the swizzle width) of a tile's rows of one head
constexpr int kTmaBoxCols = 64;

template <int HD, int BN_ = kFwdTmaKeyTile>
struct FwdTmaConfig {
  static constexpr int kThreads = 384;           // consumers: warpgroups 0, 1; producer: warpgroup 2
  static constexpr int kConsumers = 256;
  static constexpr int BM = 128, BN = BN_, kStages = 2;
  // FA3's split: 128 x 24 + 256 x 240 = 64512 <= 384 x 168 + the 1024 the launch leaves over (65536)
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kQBytes = BM * HD * 2, kKVBytes = BN * HD * 2;
  // 5 mbarriers in the first 64 bytes, then (from the next 1024-byte boundary) Q and the stages' K, V;
  // at BN 64 the bytes of fwd_sm90.cuh's kernel (its 1024 bytes of alignment slack hold the barriers).
  // HD 128, BN 128: 32 KB of Q + 2 x (32 + 32) KB of K, V + 1 KB = 161 KB of sm_90's 227 KB opt-in
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKVBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "FwdTmaConfig: past sm_90's 227 KB of opt-in shared memory");
  static constexpr int kBoxCols = kTmaBoxCols;
};

// Host: the tensor map of a 16-bit (batch, heads, L, width) tensor (element strides l, h, b; its rows from
// row0) for the Hopper TMA kernels (this forward, bwd_sm90.cuh's backward): dimensions (width, L, heads,
// batch), boxes of 64 columns x `rows` rows of one head in wgmma's 128-byte swizzle (Sw128Tile); rows past L
// and columns past width land as zeros. False when it does not encode (a base or stride not a multiple of
// 16 bytes, a negative stride, L < 1).
inline bool head_rows_map(prim::TensorMap& m, const void* base, int64_t l, int64_t h, int64_t b, int64_t row0,
                          int width, int L, int heads, int batch, int rows) {
  const uint64_t dims[4] = {uint64_t(width), uint64_t(L), uint64_t(heads), uint64_t(batch)};
  const uint64_t strides[3] = {uint64_t(l) * 2, uint64_t(h) * 2, uint64_t(b) * 2};
  const uint32_t box[4] = {uint32_t(kTmaBoxCols), uint32_t(rows), 1, 1};
  if (l < 0 || h < 0 || b < 0 || L < 1) return false;
  return !prim::make_tensor_map(m, static_cast<const uint16_t*>(base) + row0 * l, 2, 4, dims, strides, box, 128);
}

template <int HD, bool BF16, int KIND>
EFFATTN_KERNEL_WG3 attn_fwd_sm90_tma_kernel(const EFFATTN_GRID_CONSTANT FwdTmaParams tp) {
#if EFFATTN_SM90A
  using Cfg = FwdTmaConfig<HD>;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, NC = Cfg::kConsumers;
  constexpr int NP = HD / Cfg::kBoxCols;
  using TKV = Sw128Tile<HD, BN>;
  EFFATTN_SMEM(smem_raw);
  const uint32_t raw = prim::smem_u32(smem_raw);
  uint64_t* q_full = reinterpret_cast<uint64_t*>(smem_raw);
  uint64_t* full = q_full + 1;                          // full[0], full[1]
  uint64_t* empty = q_full + 3;                         // empty[0], empty[1]
  char* smem = smem_raw + (((raw + 64 + 1023) & ~1023u) - raw);
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sK = sQ + BM * HD;                          // stage s: sK + s BN HD, sV + s BN HD
  uint16_t* sV = sK + 2 * BN * HD;
  const int tid = int(prim::thread_x());

  const AttnParams& p = tp.p;
  const GridTile gt = grid_tile((p.Lq + BM - 1) / BM, p.H);
  const FwdBlock fb = fwd_block(p, gt, BM);
  const Schedule sched = key_schedule(p, fb.h, fb.mt, BM, BN);
  const int n_tiles = sched.count();

  if (tid == 0) {
    prim::mbar_init(q_full, 1);
    for (int s = 0; s < 2; ++s) {
      prim::mbar_init(full + s, 1);
      prim::mbar_init(empty + s, NC);
    }
    prim::fence_mbar_init();
  }
  prim::sync_block();

  if (tid >= NC) {                                      // the producer warpgroup
    prim::setmaxnreg_dec<Cfg::kProducerRegs>();
    if (tid != NC) return;
    const int hk = fb.h / p.G;
    prim::mbar_arrive_expect_tx(q_full, Cfg::kQBytes);
#pragma unroll
    for (int c = 0; c < NP; ++c) prim::tma_load_4d(sQ + c * BM * 64, &tp.q, q_full, 64 * c, fb.m0, fb.h, fb.b);
    for (int it = 0; it < n_tiles; ++it) {
      const int s = it & 1;
      prim::mbar_wait(empty + s, ((it >> 1) & 1) ^ 1);   // the stage's previous use has retired
      prim::mbar_arrive_expect_tx(full + s, 2 * Cfg::kKVBytes);
      const int n0 = sched.tile(it) * BN;
#pragma unroll
      for (int c = 0; c < NP; ++c) {
        prim::tma_load_4d(sK + s * BN * HD + c * BN * 64, &tp.k, full + s, 64 * c, n0, hk, fb.b);
        prim::tma_load_4d(sV + s * BN * HD + c * BN * 64, &tp.v, full + s, 64 * c, n0, hk, fb.b);
      }
    }
    return;
  }

  // the consumers
  prim::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const uint32_t aQ = prim::smem_u32(sQ) + ((tid >> 5) >> 2) * 64 * 128;   // this warpgroup's 64 rows of Q
  const uint8_t* kpm = KIND == kAny ? fb.kpm : nullptr;    // (MaskKind: see softmax_scores)
  prim::mbar_wait(q_full, 0);
  // Step t (t < n_tiles): K(t), V(t) have landed; V(t - 1)'s keys no row sees are zeroed.
  auto begin_step = [&](int it) {
    if (it < n_tiles) prim::mbar_wait(full + (it & 1), (it >> 1) & 1);
    if (it > 0 && (KIND != kDense && sched.masked(it - 1) || kpm)) {   // keys no row sees: zero values
      zero_unseen<HD, BN, TKV, NC>(sV + ((it - 1) & 1) * BN * HD, sched.tile(it - 1) * BN,
                                   [&](int j) { return key_seen(p, fb.lay, kpm, fb.m0, fb.m0 + BM, j); });
      prim::fence_proxy_async();                         // the zeros visible to wgmma's async proxy
      prim::named_sync(1, NC);                           // ... and every consumer's
    }
  };
  // P V(t - 1) has retired (S(t - 1) before it): the stage of tile t - 1 goes back to the producer
  auto release = [&](int it) { prim::mbar_arrive(empty + ((it - 1) & 1)); };
  consume_key_tiles<HD, BF16, KIND, BN, true>(p, fb, sched, aQ, prim::smem_u32(sK), prim::smem_u32(sV), begin_step,
                                              [](int) {}, release);
#endif
}

}  // namespace effattn
