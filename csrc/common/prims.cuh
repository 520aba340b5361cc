// Every hardware operation effattn's CUDA kernels use, in one place: inline PTX under nvcc (sm_80
// and newer), and an exact emulation under a host compiler when EFFATTN_CUDA_EMU is defined (see
// emu/emu.h). Kernels include this header and nothing else that is CUDA-specific, so the same
// kernel source runs on a GPU and, for tests, on a CPU.
//
//   thread_x / block_x,y,z   threadIdx.x, blockIdx
//   sync_block               __syncthreads (bar.sync 0)
//   shfl_xor                 shfl.sync.bfly over the full warp
//   ldmatrix_x4[_trans]      ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16
//   mma_16816<BF16>          mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.f32, D += A B
//   cp_async_16              cp.async.cg.shared.global, 16 bytes, zero-fill past src_bytes
//   cp_async_commit / _wait  cp.async.commit_group / cp.async.wait_group N
//   st_shared(p, v)          a plain store to shared memory (*p = v) that a wgmma may later read: the
//                            emulation records the writer for the proxy rule (fence.proxy.async, prims_sm90.cuh)
//   exp2                     ex2.approx.ftz.f32
//   pack2 / to_float / from_float   fp32 <-> bf16 / fp16, round to nearest even
//   sem_wait / sem_release   ld.acquire.gpu spin until a global int holds a turn / st.release.gpu of the next
//   add_global / fence_gpu   red.global.add.f32 (one adder at a time: ordered by the semaphore) / membar.gl
// Hopper-only operations (wgmma, its shared-memory descriptors, fence.proxy.async) are in
// prims_sm90.cuh, on top of this header.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(EFFATTN_CUDA_EMU)
#include <cstring>

#include "emu/emu.h"
#define EFFATTN_DEVICE inline
#define EFFATTN_KERNEL inline void
#define EFFATTN_FWD_KERNEL inline void
#define EFFATTN_KERNEL_1 inline void
#define EFFATTN_KERNEL_256 inline void
#define EFFATTN_SMEM(name) char* name = ::effattn::emu::cur_block()->smem
#else
#define EFFATTN_DEVICE __device__ __forceinline__
#define EFFATTN_KERNEL __global__ void __launch_bounds__(128)
// the mma.sync forward: at least 2 blocks per SM, the rest of the register file ptxas's (with 128
// alone it capped every instance at 168 registers and spilled where the score terms join a mask kind)
#define EFFATTN_FWD_KERNEL __global__ void __launch_bounds__(128, 2)
// at least 1 block per SM: the whole register file ptxas's (kernels that need more than 168)
#define EFFATTN_KERNEL_1 __global__ void __launch_bounds__(128, 1)
// blocks of 8 warps (the fused backward), one per SM at least: the whole register file ptxas's
#define EFFATTN_KERNEL_256 __global__ void __launch_bounds__(256, 1)
#define EFFATTN_SMEM(name) extern __shared__ __align__(128) char name[]
#endif

namespace effattn {
namespace prim {

#if defined(EFFATTN_CUDA_EMU)
using stream_t = void*;

EFFATTN_DEVICE unsigned thread_x() { return emu::thread_x(); }
EFFATTN_DEVICE unsigned block_x() { return emu::block_index().x; }
EFFATTN_DEVICE unsigned block_y() { return emu::block_index().y; }
EFFATTN_DEVICE unsigned block_z() { return emu::block_index().z; }
EFFATTN_DEVICE void sync_block() { emu::sync_block(); }
EFFATTN_DEVICE uint32_t shfl_xor(uint32_t v, int mask) { return emu::shfl_xor(v, mask); }
EFFATTN_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) { emu::ldmatrix_x4(r, row, false); }
EFFATTN_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) { emu::ldmatrix_x4(r, row, true); }
template <bool BF16>
EFFATTN_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t b[2] = {b0, b1};
  const float c[4] = {d[0], d[1], d[2], d[3]};
  emu::mma_16816(d, a, b, c, BF16);
}
EFFATTN_DEVICE void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  emu::cp_async_16(smem, gmem, src_bytes);
}
EFFATTN_DEVICE void cp_async_commit() { emu::cp_async_commit(); }
template <class T>
EFFATTN_DEVICE void st_shared(T* p, T v) { emu::st_shared(p, v); }
template <int N>
EFFATTN_DEVICE void cp_async_wait() { emu::cp_async_wait(N); }
EFFATTN_DEVICE float exp2(float x) { return std::exp2(x); }
EFFATTN_DEVICE uint32_t umulhi(uint32_t a, uint32_t b) { return uint32_t((uint64_t(a) * b) >> 32); }
EFFATTN_DEVICE void sem_wait(const int* sem, int turn) { emu::sem_wait(sem, turn); }
EFFATTN_DEVICE void sem_release(int* sem, int value) { emu::sem_release(sem, value); }
EFFATTN_DEVICE void add_global(float* dst, float v) { *dst += v; }
EFFATTN_DEVICE void fence_gpu() {}

template <bool BF16>
EFFATTN_DEVICE uint16_t from_float(float f) {
  if (BF16) {
    uint32_t u = emu::float_to_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);   // quiet NaN
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  _Float16 h = static_cast<_Float16>(f);   // IEEE round to nearest even
  uint16_t r;
  std::memcpy(&r, &h, 2);
  return r;
}
template <bool BF16>
EFFATTN_DEVICE float to_float(uint16_t h) { return BF16 ? emu::bf16_to_float(h) : emu::f16_to_float(h); }

#else  // nvcc
using stream_t = cudaStream_t;

EFFATTN_DEVICE unsigned thread_x() { return threadIdx.x; }
EFFATTN_DEVICE unsigned block_x() { return blockIdx.x; }
EFFATTN_DEVICE unsigned block_y() { return blockIdx.y; }
EFFATTN_DEVICE unsigned block_z() { return blockIdx.z; }
EFFATTN_DEVICE void sync_block() { __syncthreads(); }
EFFATTN_DEVICE uint32_t shfl_xor(uint32_t v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
EFFATTN_DEVICE uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
EFFATTN_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row)));
}
EFFATTN_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row)));
}
template <bool BF16>
EFFATTN_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
EFFATTN_DEVICE void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
EFFATTN_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <class T>
EFFATTN_DEVICE void st_shared(T* p, T v) { *p = v; }
template <int N>
EFFATTN_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
EFFATTN_DEVICE float exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
EFFATTN_DEVICE uint32_t umulhi(uint32_t a, uint32_t b) { return __umulhi(a, b); }
EFFATTN_DEVICE void sem_wait(const int* sem, int turn) {
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(sem) : "memory");
  } while (v != turn);
}
EFFATTN_DEVICE void sem_release(int* sem, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(sem), "r"(value) : "memory");
}
EFFATTN_DEVICE void add_global(float* dst, float v) { atomicAdd(dst, v); }
EFFATTN_DEVICE void fence_gpu() { __threadfence(); }

template <bool BF16>
EFFATTN_DEVICE uint16_t from_float(float f) {
  uint16_t h;
  if constexpr (BF16) asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
  else asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
  return h;
}
template <bool BF16>
EFFATTN_DEVICE float to_float(uint16_t h) {
  float f;
  if constexpr (BF16) f = __uint_as_float(uint32_t(h) << 16);
  else asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
}
#endif

// Shared by both builds.
EFFATTN_DEVICE float shfl_xor_f(float v, int mask) {
#if defined(EFFATTN_CUDA_EMU)
  return emu::bits_to_float(shfl_xor(emu::float_to_bits(v), mask));
#else
  return __uint_as_float(shfl_xor(__float_as_uint(v), mask));
#endif
}

// Two floats as one register of 16-bit values (lo in the low half), as mma operands want them.
template <bool BF16>
EFFATTN_DEVICE uint32_t pack2(float lo, float hi) {
  return uint32_t(from_float<BF16>(lo)) | (uint32_t(from_float<BF16>(hi)) << 16);
}

}  // namespace prim
}  // namespace effattn
