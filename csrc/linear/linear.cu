// Entry points of the linear-attention kernels: grids, shared memory, dispatch on the number of
// bf16 parts of each operand (1: bf16 calls, 2: fp16, 3: fp32; see common.cuh). Compiled by
// nvcc for the GPU, or by a host compiler with EFFATTN_CUDA_EMU for the emulation.
#include "linear/out.cuh"
#include "linear/state.cuh"
#include "linear/step.cuh"

namespace effattn {
namespace {

#if defined(EFFATTN_CUDA_EMU)
template <class Kernel, class Params>
int lin_launch(Kernel kernel, unsigned gx, unsigned gy, unsigned gz, int smem, prim::stream_t, const Params& p) {
  emu::launch(emu::Dim3{gx, gy, gz}, emu::Dim3{128, 1, 1}, size_t(smem), [&] { kernel(p); });
  return 0;
}
#else
template <class Kernel, class Params>
int lin_launch(Kernel kernel, unsigned gx, unsigned gy, unsigned gz, int smem, prim::stream_t stream,
               const Params& p) {
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return int(e);
  }
  kernel<<<dim3(gx, gy, gz), dim3(128, 1, 1), smem, stream>>>(p);
  return int(cudaGetLastError());
}
#endif

template <int NP>
int state_np(const LinStateParams& p, int n_tiles, int n_split, prim::stream_t s) {
  return lin_launch(lin_state_kernel<NP>, unsigned(p.B * p.b.H), unsigned(n_tiles), unsigned(n_split),
                    LinStateConfig<NP>::kSmem, s, p);
}

template <int NP>
int out_np(const LinOutParams& p, prim::stream_t s) {
  constexpr int BV = LinOutConfig<NP>::BV;
  return lin_launch(lin_out_kernel<NP>, unsigned(p.B * p.Ha), unsigned(p.n_chunks), unsigned((p.FC + BV - 1) / BV),
                    LinOutConfig<NP>::kSmem, s, p);
}

}  // namespace

int linear_state(const LinStateParams& p, int parts, int n_fb_tiles, int n_fc_tiles, int n_split, void* stream) {
  const auto s = static_cast<prim::stream_t>(stream);
  if (p.B * p.b.H == 0 || n_fb_tiles * n_fc_tiles == 0) return 0;
  const int tiles = n_fb_tiles * n_fc_tiles;
  switch (parts) {
    case 1: return state_np<1>(p, tiles, n_split, s);
    case 2: return state_np<2>(p, tiles, n_split, s);
    case 3: return state_np<3>(p, tiles, n_split, s);
    default: return -1;
  }
}

int linear_out(const LinOutParams& p, int parts, void* stream) {
  const auto s = static_cast<prim::stream_t>(stream);
  if (p.B * p.Ha == 0 || p.n_chunks == 0 || p.FC == 0) return 0;
  switch (parts) {
    case 1: return out_np<1>(p, s);
    case 2: return out_np<2>(p, s);
    case 3: return out_np<3>(p, s);
    default: return -1;
  }
}

int linear_step(const LinStepParams& p, void* stream) {
  if (p.B * p.H == 0) return 0;
  const int smem = 2 * p.F * int(sizeof(float));          // phi(q), phi(k)
  return lin_launch(lin_step_kernel, unsigned(p.B * p.H), 1, 1, smem, static_cast<prim::stream_t>(stream), p);
}

int linear_favor(const LinFavorParams& p, void* stream) {
  if (p.B * p.x.H == 0 || p.x.L == 0 || p.F == 0) return 0;
  const auto s = static_cast<prim::stream_t>(stream);
  const unsigned blocks = unsigned(p.B * p.x.H) * unsigned((p.x.L + 63) / 64), f_tiles = unsigned((p.F + 63) / 64);
  // fp32 inputs: 3 parts (24 bits); 16-bit inputs: 2 (fp16 values exactly, the projection to 16 bits)
  if (p.x.kind == kF32) return lin_launch(lin_favor_kernel<3>, blocks, f_tiles, 1, LinFavorConfig<3>::kSmem, s, p);
  return lin_launch(lin_favor_kernel<2>, blocks, f_tiles, 1, LinFavorConfig<2>::kSmem, s, p);
}

}  // namespace effattn
