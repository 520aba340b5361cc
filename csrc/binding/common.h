// What every op's torch glue shares: the op namespace and dispatch key of this build, the device
// guard and stream, argument checks, and the NaN poisoning of outputs under the emulation.
//
// The binding (csrc/binding/*.cpp) is the only part of csrc/ that includes torch. Two builds of it:
// - the real extension (setup.py, a CUDA torch and nvcc): ops `effattn_cuda::*` on CUDA tensors;
//   only c10/cuda's stream and guard headers (no ATen/cuda/CUDAContext.h, which needs the cuBLAS,
//   cuSPARSE and cuSOLVER headers that a minimal CUDA toolkit lacks);
// - with EFFATTN_CUDA_EMU (a host compiler against any torch, built on first use by
//   effattn/backends/cuda/_ext.py): ops `effattn_cuda_emu::*` on CPU tensors; the kernels (the .cu
//   files of csrc/attention/, csrc/linear/, run through the emulation of csrc/emu/) are a library of
//   their own, loaded before the binding, which calls them as the real build calls nvcc's objects.
// The Python side (effattn/backends/cuda/) adds the fake (meta) kernels and the autograd formulas.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#if defined(EFFATTN_CUDA_EMU)
#define EFFATTN_OPS effattn_cuda_emu
#define EFFATTN_KEY CPU
#else
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define EFFATTN_OPS effattn_cuda
#define EFFATTN_KEY CUDA
#endif

namespace effattn {
namespace binding {

using at::Tensor;
using c10::optional;

inline void check(bool ok, const char* what) { TORCH_CHECK(ok, "effattn cuda backend: ", what); }

inline void run_checked(int err, const char* what) {
  TORCH_CHECK(err == 0, "effattn cuda backend: ", what, " launch failed (error ", err, ")");
}

// The stride of dimension d, 0 where the dimension has one element (its stride is then arbitrary).
inline int64_t stride_or_0(const Tensor& t, int d) { return t.size(d) > 1 ? t.stride(d) : 0; }

#if defined(EFFATTN_CUDA_EMU)
// unwritten outputs must show up as NaN, as with the test suite's poisoned torch.empty
inline void poison(Tensor& t) { t.fill_(std::numeric_limits<double>::quiet_NaN()); }
#else
inline void poison(Tensor&) {}
#endif

}  // namespace binding
}  // namespace effattn

// The device of tensor t made current for the op's scope, and the stream its kernels go to.
#if defined(EFFATTN_CUDA_EMU)
#define EFFATTN_GUARD(t) (void)(t)
#define EFFATTN_STREAM nullptr
#else
#define EFFATTN_GUARD(t) c10::cuda::CUDAGuard guard_(t.device())
#define EFFATTN_STREAM c10::cuda::getCurrentCUDAStream().stream()
#endif
