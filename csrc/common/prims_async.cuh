// Hopper (sm_90a) asynchronous primitives on top of prims_sm90.cuh: mbarriers, TMA tensor maps and
// bulk tensor copies, named barriers and warpgroup register reallocation. Inline PTX under nvcc for
// sm_90a (elsewhere empty bodies: the kernels built on them are stubs the launcher never starts); the
// emulation of emu/async.h under EFFATTN_CUDA_EMU, which fails with the reason on what the PTX ISA
// leaves undefined.
//
//   TensorMap                             CUtensorMap (nvcc) / emu::TensorMap: a tiled tensor map
//   make_tensor_map(m, base, elem_bytes, rank, dims, strides, box, swizzle)   host: encodes it
//                                         (cuTensorMapEncodeTiled through the runtime's driver entry
//                                         point; zero fill out of bounds); nullptr or why it cannot
//   mbar_init(bar, count)                 mbarrier.init.shared::cta.b64 (one thread), then
//   fence_mbar_init()                     fence.mbarrier_init.release.cluster (before a block barrier)
//   mbar_arrive(bar)                      mbarrier.arrive.shared::cta.b64
//   mbar_arrive_expect_tx(bar, bytes)     mbarrier.arrive.expect_tx.shared::cta.b64
//   mbar_wait(bar, parity)                mbarrier.try_wait.parity loop: until the phase of that
//                                         parity has completed
//   tma_load_2d/3d/4d(dst, map, bar, c...)  cp.async.bulk.tensor.Nd.shared::cluster.global
//                                         .mbarrier::complete_tx::bytes (coordinates: dimension 0 first)
//   named_sync(id, count)                 bar.sync id, count
//   named_arrive(id, count)               bar.arrive id, count (counted, does not wait)
//   setmaxnreg_inc<N>() / _dec<N>()       setmaxnreg.{inc,dec}.sync.aligned.u32 N (whole warpgroup)
#pragma once

#include "common/prims_sm90.cuh"

#if defined(EFFATTN_CUDA_EMU)
#include "emu/async.h"
#else
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

namespace effattn {
namespace prim {

template <int N>
struct RegCount {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg: a multiple of 8 in 24..256");
  static constexpr int value = N;
};

// Why cuTensorMapEncodeTiled would refuse these arguments (nullptr: it accepts them); `strides`
// holds the rank - 1 byte strides of dimensions 1.. . The emulation also refuses a swizzled map whose
// inner box row is not exactly the swizzle width (the kernels' layout; the hardware accepts narrower).
inline const char* tensor_map_problem(const void* base, int elem_bytes, int rank, const uint64_t* dims,
                                      const uint64_t* strides, const uint32_t* box, int swizzle) {
  if (rank < 1 || rank > 5) return "tensor map: rank outside 1..5";
  if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4 && elem_bytes != 8)
    return "tensor map: element size is not 1, 2, 4 or 8 bytes";
  if (reinterpret_cast<uintptr_t>(base) % 16) return "tensor map: global address is not 16-byte aligned";
  for (int i = 0; i < rank; ++i) {
    if (dims[i] < 1 || dims[i] > (uint64_t(1) << 32)) return "tensor map: a dimension outside 1..2^32";
    if (box[i] < 1 || box[i] > 256) return "tensor map: a box dimension outside 1..256";
  }
  for (int i = 0; i + 1 < rank; ++i)
    if (strides[i] % 16 || strides[i] >= (uint64_t(1) << 40))
      return "tensor map: a global stride is not a multiple of 16 bytes below 2^40";
  const uint64_t inner = uint64_t(box[0]) * elem_bytes;
  if (inner % 16) return "tensor map: the inner box dimension is not a multiple of 16 bytes";
  if (swizzle != 0 && swizzle != 32 && swizzle != 64 && swizzle != 128) return "tensor map: swizzle is not 0/32/64/128";
  if (swizzle && inner != uint64_t(swizzle))
    return "tensor map: a swizzled box row must be exactly the swizzle width (the only layout modeled)";
  return nullptr;
}

#if defined(EFFATTN_CUDA_EMU)
using TensorMap = emu::TensorMap;

inline const char* make_tensor_map(TensorMap& m, const void* base, int elem_bytes, int rank, const uint64_t* dims,
                                   const uint64_t* strides, const uint32_t* box, int swizzle) {
  if (const char* why = tensor_map_problem(base, elem_bytes, rank, dims, strides, box, swizzle)) return why;
  emu::make_tensor_map(m, base, elem_bytes, rank, dims, strides, box, swizzle);
  return nullptr;
}

EFFATTN_DEVICE void mbar_init(uint64_t* bar, unsigned count) { emu::mbar_init(bar, count); }
EFFATTN_DEVICE void fence_mbar_init() {}
EFFATTN_DEVICE void mbar_arrive(uint64_t* bar) { emu::mbar_arrive(bar); }
EFFATTN_DEVICE void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) { emu::mbar_arrive_expect_tx(bar, bytes); }
EFFATTN_DEVICE void mbar_wait(uint64_t* bar, int parity) { emu::mbar_wait(bar, parity); }
EFFATTN_DEVICE void tma_load_2d(void* dst, const TensorMap* map, uint64_t* bar, int c0, int c1) {
  const int c[2] = {c0, c1};
  emu::tma_load(dst, map, bar, c, 2);
}
EFFATTN_DEVICE void tma_load_3d(void* dst, const TensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  const int c[3] = {c0, c1, c2};
  emu::tma_load(dst, map, bar, c, 3);
}
EFFATTN_DEVICE void tma_load_4d(void* dst, const TensorMap* map, uint64_t* bar, int c0, int c1, int c2, int c3) {
  const int c[4] = {c0, c1, c2, c3};
  emu::tma_load(dst, map, bar, c, 4);
}
EFFATTN_DEVICE void named_sync(int id, int count) { emu::named_sync(id, count); }
EFFATTN_DEVICE void named_arrive(int id, int count) { emu::named_arrive(id, count); }
template <int N>
EFFATTN_DEVICE void setmaxnreg_inc() { emu::setmaxnreg(RegCount<N>::value, true); }
template <int N>
EFFATTN_DEVICE void setmaxnreg_dec() { emu::setmaxnreg(RegCount<N>::value, false); }

#else  // nvcc
using TensorMap = CUtensorMap;

// The driver's checks come first in words (the same rules the emulation applies), then the driver.
inline const char* make_tensor_map(TensorMap& m, const void* base, int elem_bytes, int rank, const uint64_t* dims,
                                   const uint64_t* strides, const uint32_t* box, int swizzle) {
  if (const char* why = tensor_map_problem(base, elem_bytes, rank, dims, strides, box, swizzle)) return why;
  if (elem_bytes != 2) return "tensor map: only 16-bit elements are encoded here";
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = nullptr;
  if (!encode) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess || !fn)
      return "tensor map: the driver has no cuTensorMapEncodeTiled";
    encode = reinterpret_cast<Encode>(fn);
  }
  cuuint64_t d[5], s[4];
  cuuint32_t bx[5], es[5];
  for (int i = 0; i < rank; ++i) d[i] = dims[i], bx[i] = box[i], es[i] = 1;
  for (int i = 0; i + 1 < rank; ++i) s[i] = strides[i];
  const CUtensorMapSwizzle sw = swizzle == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                : swizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                : swizzle == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                                : CU_TENSOR_MAP_SWIZZLE_NONE;
  const CUresult r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_UINT16, cuuint32_t(rank), const_cast<void*>(base), d, s, bx, es,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? nullptr : "tensor map: cuTensorMapEncodeTiled refused the arguments";
}

#if EFFATTN_SM90A
EFFATTN_DEVICE void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
EFFATTN_DEVICE void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
EFFATTN_DEVICE void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
EFFATTN_DEVICE void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
EFFATTN_DEVICE void mbar_wait(uint64_t* bar, int parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}
EFFATTN_DEVICE void tma_load_2d(void* dst, const TensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}
EFFATTN_DEVICE void tma_load_3d(void* dst, const TensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::
          "r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
EFFATTN_DEVICE void tma_load_4d(void* dst, const TensorMap* map, uint64_t* bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
EFFATTN_DEVICE void named_sync(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
EFFATTN_DEVICE void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
template <int N>
EFFATTN_DEVICE void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(RegCount<N>::value));
}
template <int N>
EFFATTN_DEVICE void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(RegCount<N>::value));
}
#else   // not sm_90a: never launched
EFFATTN_DEVICE void mbar_init(uint64_t*, unsigned) {}
EFFATTN_DEVICE void fence_mbar_init() {}
EFFATTN_DEVICE void mbar_arrive(uint64_t*) {}
EFFATTN_DEVICE void mbar_arrive_expect_tx(uint64_t*, unsigned) {}
EFFATTN_DEVICE void mbar_wait(uint64_t*, int) {}
EFFATTN_DEVICE void tma_load_2d(void*, const TensorMap*, uint64_t*, int, int) {}
EFFATTN_DEVICE void tma_load_3d(void*, const TensorMap*, uint64_t*, int, int, int) {}
EFFATTN_DEVICE void tma_load_4d(void*, const TensorMap*, uint64_t*, int, int, int, int) {}
EFFATTN_DEVICE void named_sync(int, int) {}
EFFATTN_DEVICE void named_arrive(int, int) {}
template <int N>
EFFATTN_DEVICE void setmaxnreg_inc() {}
template <int N>
EFFATTN_DEVICE void setmaxnreg_dec() {}
#endif
#endif

}  // namespace prim
}  // namespace effattn
