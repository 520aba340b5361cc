// Entry point of the softmax-attention forward: dispatch on dtype, head-dim bucket, mask kind
// (MaskKind, common.cuh) and dropout to the launchers of launch.cuh. This unit compiles no kernel: it
// sees only their declarations (launchers.cuh); each instance is a translation unit of its own in
// attention/inst/ (written by csrc/generate_instances.py), so nvcc builds them side by side. The
// backward's entry point is bwd.cu. Compiled by nvcc for the GPU, or by a host compiler with
// EFFATTN_CUDA_EMU for the emulation (the same code; common/prims.cuh hides the difference).
#include "attention/fwd.cuh"
#include "attention/launchers.cuh"

namespace effattn {
namespace {

template <int HD, bool BF16, bool DROP>
int fwd_of_kind(int kind, const AttnParams& p, prim::stream_t stream) {
  return with_mask_kind(kind, [&](auto k) { return detail::fwd<HD, BF16, decltype(k)::value, DROP>(p, stream); });
}

// The narrowest instance for the call: its mask kind (for the key tile of the query tile fwd_wide picks),
// and the dropout code only when it drops. Below head dim 256 the dense, causal and window kinds have only
// the 128-row instance (launch.cuh), so a call the device cannot give 128-row tiles runs kAny's 64-row one.
template <int HD, bool BF16>
int fwd_of_call(const AttnParams& p, prim::stream_t stream) {
  const bool wide = fwd_wide<HD>(p, device_smem_optin());
  int kind = mask_kind(p, wide ? FwdConfig<HD, 32>::BN : FwdConfig<HD>::BN);
  if (FwdConfig<HD, 32>::kWide && !wide && kind != kLayout) kind = kAny;
  bool drop = p.dropout != 0;
#if defined(EFFATTN_CUDA_EMU)
  if (emu_record::fwd_general) kind = kAny, drop = true;
#endif
  return drop ? fwd_of_kind<HD, BF16, true>(kind, p, stream) : fwd_of_kind<HD, BF16, false>(kind, p, stream);
}

template <bool BF16>
int dispatch_fwd(const AttnParams& p, prim::stream_t stream) {
  switch (head_dim_bucket(p.D > p.Dv ? p.D : p.Dv)) {
    case 32: return fwd_of_call<32, BF16>(p, stream);
    case 64: return fwd_of_call<64, BF16>(p, stream);
    case 128: return fwd_of_call<128, BF16>(p, stream);
    case 256: return fwd_of_call<256, BF16>(p, stream);
    default: return -1;
  }
}

}  // namespace

int attention_fwd(const AttnParams& p, bool bf16, void* stream_ptr) {
  const auto stream = static_cast<prim::stream_t>(stream_ptr);
  if (p.Lq == 0 || p.B * p.H == 0) return 0;
  if (has_bias_tensors(p)) return attention_fwd_terms(p, bf16, stream_ptr);   // terms.cu
  return bf16 ? dispatch_fwd<true>(p, stream) : dispatch_fwd<false>(p, stream);
}

}  // namespace effattn

#if defined(EFFATTN_CUDA_EMU)
extern "C" int effattn_emu_last_fwd_instance() { return effattn::emu_record::last_fwd; }
extern "C" int effattn_emu_last_fwd_keys() { return effattn::emu_record::last_fwd_keys; }
extern "C" void effattn_emu_set_fwd_general(int on) { effattn::emu_record::fwd_general = on; }
#endif
