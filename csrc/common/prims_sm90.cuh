// Hopper (sm_90a) primitives on top of common/prims.cuh: warpgroup MMA (wgmma) with shared-memory matrix
// descriptors, and the proxy fence its shared-memory operands need. Inline PTX under nvcc when
// compiling for sm_90a (elsewhere the bodies are empty and EFFATTN_SM90A is 0: kernels built on
// these compile to stubs that the launcher never starts); the exact emulation of emu/wgmma.h
// under EFFATTN_CUDA_EMU.
//
//   smem_u32(p)                          the shared-memory address of p (what descriptors hold)
//   smem_desc(addr, lbo, sbo, swizzle)   a wgmma matrix descriptor (bytes; swizzle 0/32/64/128)
//   wgmma_fence / _commit / _wait<N>     wgmma.fence / commit_group / wait_group N
//   wgmma_ss<N, BF16, TRANS_B>(d, da, db, acc)   wgmma.mma_async m64nNk16 f32 += A B, A and B in
//                                        shared memory (A K-major; B K-major, or N-major with TRANS_B)
//   wgmma_rs<N, BF16, TRANS_B>(d, a, db, acc)    the same with A (64 x 16) from registers
//   keep(x)                              tells the compiler x is read and written here (keeps wgmma
//                                        operand registers live and in place until the wait)
//   fence_proxy_async                    fence.proxy.async.shared::cta (cp.async writes -> wgmma reads)
// d: the m64nN accumulator fragment as [N / 8][4] floats per thread (emu/fragments.h).
#pragma once

#include "common/prims.cuh"

// A kernel of two warpgroups (256 threads), one block per SM: the whole register file is ptxas's
#if defined(EFFATTN_CUDA_EMU)
#define EFFATTN_KERNEL_WG2 inline void
#else
#define EFFATTN_KERNEL_WG2 __global__ void __launch_bounds__(256, 1)
#endif

#if defined(EFFATTN_CUDA_EMU)
#include "emu/wgmma.h"
#define EFFATTN_SM90A 1
#elif defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define EFFATTN_SM90A 1
#else
#define EFFATTN_SM90A 0
#endif

namespace effattn {
namespace prim {

// The 64-bit descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading- and
// stride-dimension byte offsets, each >> 4 in 14 bits; base offset 0; swizzle mode in bits 62-63.
EFFATTN_DEVICE uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo, int swizzle) {
  const uint64_t mode = swizzle == 128 ? 1 : swizzle == 64 ? 2 : swizzle == 32 ? 3 : 0;
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t((lbo & 0x3FFFF) >> 4) << 16 |
         uint64_t((sbo & 0x3FFFF) >> 4) << 32 | mode << 62;
}

#if defined(EFFATTN_CUDA_EMU)
EFFATTN_DEVICE uint32_t smem_u32(const void* p) { return emu::smem_offset(p); }
EFFATTN_DEVICE void wgmma_fence() { emu::wgmma_fence(); }
EFFATTN_DEVICE void wgmma_commit() { emu::wgmma_commit(); }
template <int N>
EFFATTN_DEVICE void wgmma_wait() { emu::wgmma_wait(N); }
EFFATTN_DEVICE void fence_proxy_async() { emu::fence_proxy_async(); }
template <int N, bool BF16, bool TRANS_B>
EFFATTN_DEVICE void wgmma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db, bool acc) {
  emu::wgmma(&d[0][0], N, da, nullptr, db, acc, BF16, TRANS_B);
}
template <int N, bool BF16, bool TRANS_B>
EFFATTN_DEVICE void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db, bool acc) {
  emu::wgmma(&d[0][0], N, 0, a, db, acc, BF16, TRANS_B);
}
template <class T>
EFFATTN_DEVICE void keep(T&) {}

#else  // nvcc
EFFATTN_DEVICE uint32_t smem_u32(const void* p) { return smem_addr(p); }

// Operand lists of the wgmma asm: the accumulators %0..%(N/2 - 1), then the descriptors (or the
// four A registers and B's descriptor), scale-d (a predicate set from `acc`) and B's transpose flag.
#define EFFATTN_ACC4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define EFFATTN_ACC32                                                                               \
  EFFATTN_ACC4(0), EFFATTN_ACC4(1), EFFATTN_ACC4(2), EFFATTN_ACC4(3), EFFATTN_ACC4(4),              \
      EFFATTN_ACC4(5), EFFATTN_ACC4(6), EFFATTN_ACC4(7)
#define EFFATTN_ACC64                                                                               \
  EFFATTN_ACC32, EFFATTN_ACC4(8), EFFATTN_ACC4(9), EFFATTN_ACC4(10), EFFATTN_ACC4(11),              \
      EFFATTN_ACC4(12), EFFATTN_ACC4(13), EFFATTN_ACC4(14), EFFATTN_ACC4(15)
#define EFFATTN_REGS32                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define EFFATTN_REGS64                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                         \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define EFFATTN_WGMMA_SS64(TY)                                                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                         \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY " " EFFATTN_REGS32                  \
               ", %32, %33, p, 1, 1, 0, %35;\n}\n"                                                  \
               : EFFATTN_ACC32                                                                      \
               : "l"(da), "l"(db), "r"(int(acc)), "n"(int(TRANS_B)))
#define EFFATTN_WGMMA_RS64(TY)                                                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                             \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY " " EFFATTN_REGS32                      \
               ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                        \
               : EFFATTN_ACC32                                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(int(acc)), "n"(int(TRANS_B)))
#define EFFATTN_WGMMA_SS128(TY)                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                         \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY " " EFFATTN_REGS64                 \
               ", %64, %65, p, 1, 1, 0, %67;\n}\n"                                                  \
               : EFFATTN_ACC64                                                                      \
               : "l"(da), "l"(db), "r"(int(acc)), "n"(int(TRANS_B)))
#define EFFATTN_WGMMA_RS128(TY)                                                                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                             \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY " " EFFATTN_REGS64                     \
               ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                        \
               : EFFATTN_ACC64                                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(int(acc)), "n"(int(TRANS_B)))

#if EFFATTN_SM90A
EFFATTN_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
EFFATTN_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
EFFATTN_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
EFFATTN_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
template <int N, bool BF16, bool TRANS_B>
EFFATTN_DEVICE void wgmma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db, bool acc) {
  static_assert(N == 64 || N == 128, "wgmma_ss: N is 64 or 128");
  if constexpr (N == 64) {
    if constexpr (BF16) EFFATTN_WGMMA_SS64("bf16.bf16");
    else EFFATTN_WGMMA_SS64("f16.f16");
  } else {
    if constexpr (BF16) EFFATTN_WGMMA_SS128("bf16.bf16");
    else EFFATTN_WGMMA_SS128("f16.f16");
  }
}
template <int N, bool BF16, bool TRANS_B>
EFFATTN_DEVICE void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db, bool acc) {
  static_assert(N == 64 || N == 128, "wgmma_rs: N is 64 or 128");
  if constexpr (N == 64) {
    if constexpr (BF16) EFFATTN_WGMMA_RS64("bf16.bf16");
    else EFFATTN_WGMMA_RS64("f16.f16");
  } else {
    if constexpr (BF16) EFFATTN_WGMMA_RS128("bf16.bf16");
    else EFFATTN_WGMMA_RS128("f16.f16");
  }
}
#else   // not sm_90a: never launched (the launcher checks), bodies compiled out
EFFATTN_DEVICE void wgmma_fence() {}
EFFATTN_DEVICE void wgmma_commit() {}
template <int N>
EFFATTN_DEVICE void wgmma_wait() {}
EFFATTN_DEVICE void fence_proxy_async() {}
template <int N, bool BF16, bool TRANS_B>
EFFATTN_DEVICE void wgmma_ss(float (&)[N / 8][4], uint64_t, uint64_t, bool) {}
template <int N, bool BF16, bool TRANS_B>
EFFATTN_DEVICE void wgmma_rs(float (&)[N / 8][4], const uint32_t (&)[4], uint64_t, bool) {}
#endif
EFFATTN_DEVICE void keep(float& x) { asm volatile("" : "+f"(x)::"memory"); }
EFFATTN_DEVICE void keep(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }
#endif

}  // namespace prim
}  // namespace effattn
