// The torch glue of the CUDA softmax-attention kernels: argument preparation, allocation and the
// TORCH_LIBRARY registration. The only file of csrc/ that includes torch.
//
// Two builds of this one file:
// - the real extension (setup.py, a CUDA torch and nvcc): ops `effattn_cuda::*` on CUDA tensors;
// - with EFFATTN_CUDA_EMU (a host compiler against any torch, built on first use by
//   effattn/backends/cuda/): ops `effattn_cuda_emu::*` on CPU tensors, running the same kernel
//   source through the emulation of csrc/emu/, compiled into this translation unit.
// The Python side (effattn/backends/cuda/) adds the fake (meta) kernels and the autograd formula.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "attention.h"
#include "decode.h"
#include "linear.h"

#if defined(EFFATTN_CUDA_EMU)
#include "attention.cu"
#include "attention_bwd.cu"
#include "attention_sm90.cu"
#include "decode.cu"
#include "linear.cu"
#define EFFATTN_OPS effattn_cuda_emu
#define EFFATTN_KEY CPU
#else
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#define EFFATTN_OPS effattn_cuda
#define EFFATTN_KEY CUDA
#endif

namespace {

using at::Tensor;
using c10::optional;

// A tensor the kernels can read with 16-byte cp.async rows: last dim contiguous and a multiple of
// 8, row/head/batch strides multiples of 8 elements, 16-byte aligned base. Otherwise a zero-padded
// contiguous copy (explain() names it).
Tensor aligned(const Tensor& t) {
  bool ok = t.stride(3) == 1 && t.size(3) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < 3 && ok; ++d) ok = t.stride(d) % 8 == 0 || t.size(d) <= 1;
  if (ok) return t;
  int64_t pad = (8 - t.size(3) % 8) % 8;
  return at::constant_pad_nd(t, {0, pad}).contiguous();
}

int64_t stride_or_0(const Tensor& t, int d) { return t.size(d) > 1 ? t.stride(d) : 0; }

void check(bool ok, const char* what) { TORCH_CHECK(ok, "effattn cuda backend: ", what); }

struct Prepared {
  Tensor q, k, v, kpm, layout, lists, lists_by_key;
  effattn::AttnParams p{};
  bool bf16 = false;
};

// Fills everything but the output / gradient pointers.
Prepared prepare(const Tensor& q0, const Tensor& k0, const Tensor& v0, const optional<Tensor>& kpm,
                 const optional<Tensor>& layout, int64_t layout_block, int64_t lay_check,
                 const optional<Tensor>& lists, int64_t list_wf, const optional<Tensor>& lists_by_key,
                 int64_t listk_wf, const optional<Tensor>& seed, double scale, double dropout_p, int64_t left,
                 int64_t right) {
  check(q0.dim() == 4 && k0.dim() == 4 && v0.dim() == 4, "q, k, v must be 4-D (B, H, L, D)");
  check(q0.scalar_type() == k0.scalar_type() && q0.scalar_type() == v0.scalar_type(), "q, k, v must share a dtype");
  check(q0.scalar_type() == at::kBFloat16 || q0.scalar_type() == at::kHalf, "dtype must be bfloat16 or float16");
  Prepared r;
  r.bf16 = q0.scalar_type() == at::kBFloat16;
  r.q = aligned(q0);
  r.k = aligned(k0);
  r.v = aligned(v0);
  effattn::AttnParams& p = r.p;
  p.B = int(q0.size(0));
  p.H = int(q0.size(1));
  const int Hkv = int(k0.size(1));
  check(Hkv > 0 && p.H % Hkv == 0, "H must be a multiple of Hkv");
  p.G = p.H / Hkv;
  p.Lq = int(q0.size(2));
  p.Lk = int(k0.size(2));
  p.D = int(r.q.size(3));
  p.Dv = int(r.v.size(3));
  p.Dv_out = int(v0.size(3));
  check(effattn::head_dim_bucket(std::max(p.D, p.Dv)) > 0, "head dims must be at most 256");
  p.q = r.q.data_ptr();
  p.k = r.k.data_ptr();
  p.v = r.v.data_ptr();
  p.q_b = stride_or_0(r.q, 0), p.q_h = stride_or_0(r.q, 1), p.q_l = r.q.stride(2);
  p.k_b = stride_or_0(r.k, 0), p.k_h = stride_or_0(r.k, 1), p.k_l = r.k.stride(2);
  p.v_b = stride_or_0(r.v, 0), p.v_h = stride_or_0(r.v, 1), p.v_l = r.v.stride(2);
  p.off = p.Lk - p.Lq;
  // a window wider than the sequences is no constraint (and -1 keeps the bound arithmetic in int32)
  p.left = left >= std::max(p.Lk - 1, 0) ? -1 : int(left);
  p.right = right >= std::max(p.Lq - 1, 0) ? -1 : int(right);
  p.scale = float(scale);
  p.qk_scale = float(scale * 1.4426950408889634);
  if (kpm.has_value()) {
    check(kpm->scalar_type() == at::kBool && kpm->dim() == 2, "key_padding_mask must be bool (B, Lk)");
    r.kpm = kpm->view(at::kByte);
    p.kpm = r.kpm.data_ptr<uint8_t>();
    p.kpm_b = r.kpm.stride(0);
    p.kpm_l = r.kpm.stride(1);
  }
  if (layout.has_value()) {
    r.layout = layout->to(at::kByte).contiguous();
    p.layout = r.layout.data_ptr<uint8_t>();
    p.lay_h = r.layout.size(0) > 1 ? r.layout.stride(0) : 0;
    p.lay_nkb = int(r.layout.size(2));
    p.lay_bs = int(layout_block);
    p.lay_check = int(lay_check);
    check(lists.has_value(), "a layout needs its tile lists");
  }
  if (lists.has_value()) {
    r.lists = lists->contiguous();
    p.lists = r.lists.data_ptr<int32_t>();
    p.list_h = r.lists.size(0) > 1 ? r.lists.stride(0) : 0;
    p.list_t = r.lists.stride(1);
    p.list_wf = int(list_wf);
  }
  if (lists_by_key.has_value()) {
    r.lists_by_key = lists_by_key->contiguous();
    p.lists_by_key = r.lists_by_key.data_ptr<int32_t>();
    p.listk_h = r.lists_by_key.size(0) > 1 ? r.lists_by_key.stride(0) : 0;
    p.listk_t = r.lists_by_key.stride(1);
    p.listk_wf = int(listk_wf);
  }
  if (dropout_p > 0) {
    check(seed.has_value() && seed->numel() == 2, "dropout needs a seed tensor of 2 int64");
    Tensor s = seed->to(at::kCPU).to(at::kLong);
    const uint64_t s0 = uint64_t(s[0].item<int64_t>()), s1 = uint64_t(s[1].item<int64_t>());
    // one 64-bit Philox key, the same as the Triton backend's for the same seed tensor
    const uint64_t key = ((s0 << 31) ^ s1) | (uint64_t(1) << 62);
    p.dropout = 1;
    p.seed_lo = uint32_t(key & 0xffffffffu);
    p.seed_hi = uint32_t(key >> 32);
    p.drop_thresh = int(std::min<double>(std::nearbyint(dropout_p * (1 << 24)), (1 << 24) - 1));
    p.inv_keep = float(1.0 / (1.0 - dropout_p));
  }
  return r;
}

void run_checked(int err, const char* what) {
  TORCH_CHECK(err == 0, "effattn cuda backend: ", what, " launch failed (error ", err, ")");
}

#if defined(EFFATTN_CUDA_EMU)
using Guard = int;
#define EFFATTN_GUARD(t) Guard guard_ = 0; (void)guard_
#define EFFATTN_STREAM nullptr
// unwritten outputs must show up as NaN, as with the test suite's poisoned torch.empty
void poison(Tensor& t) { t.fill_(std::numeric_limits<double>::quiet_NaN()); }
#else
#define EFFATTN_GUARD(t) c10::cuda::CUDAGuard guard_(t.device())
#define EFFATTN_STREAM at::cuda::getCurrentCUDAStream().stream()
void poison(Tensor&) {}
#endif

using FwdLauncher = int (*)(const effattn::AttnParams&, bool, void*);

std::tuple<Tensor, Tensor> forward(FwdLauncher launch, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const optional<Tensor>& kpm, const optional<Tensor>& layout, int64_t layout_block,
                                   int64_t lay_check, const optional<Tensor>& lists, int64_t list_wf,
                                   const optional<Tensor>& seed, double scale, double dropout_p, int64_t left,
                                   int64_t right) {
  EFFATTN_GUARD(q);
  Prepared r = prepare(q, k, v, kpm, layout, layout_block, lay_check, lists, list_wf, c10::nullopt, 0, seed, scale,
                       dropout_p, left, right);
  Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  poison(out);
  poison(lse);
  effattn::AttnParams& p = r.p;
  p.o = out.data_ptr();
  p.o_b = out.stride(0), p.o_h = out.stride(1), p.o_l = out.stride(2);
  p.lse = lse.data_ptr<float>();
  run_checked(launch(p, r.bf16, EFFATTN_STREAM), "forward");
  return {out, lse};
}

std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const optional<Tensor>& kpm, const optional<Tensor>& layout,
                                         int64_t layout_block, int64_t lay_check, const optional<Tensor>& lists,
                                         int64_t list_wf, const optional<Tensor>& seed, double scale,
                                         double dropout_p, int64_t left, int64_t right) {
  return forward(effattn::attention_fwd, q, k, v, kpm, layout, layout_block, lay_check, lists, list_wf, seed, scale,
                 dropout_p, left, right);
}

// The Hopper (sm_90a, wgmma) forward: same arguments and results; head-dim buckets 64 and 128 only.
std::tuple<Tensor, Tensor> attention_fwd_sm90(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const optional<Tensor>& kpm, const optional<Tensor>& layout,
                                              int64_t layout_block, int64_t lay_check, const optional<Tensor>& lists,
                                              int64_t list_wf, const optional<Tensor>& seed, double scale,
                                              double dropout_p, int64_t left, int64_t right) {
  const int hd = effattn::head_dim_bucket(int(std::max((q.size(3) + 7) / 8 * 8, (v.size(3) + 7) / 8 * 8)));
  check(hd == 64 || hd == 128, "the Hopper forward serves head dims 33..128 (buckets 64 and 128)");
  check(effattn::attention_fwd_sm90_built(), "this build has no sm_90a kernels (the Hopper forward)");
  return forward(effattn::attention_fwd_sm90, q, k, v, kpm, layout, layout_block, lay_check, lists, list_wf, seed,
                 scale, dropout_p, left, right);
}

bool has_sm90a() { return effattn::attention_fwd_sm90_built(); }

std::tuple<Tensor, Tensor, Tensor> attention_bwd(
    const Tensor& dout0, const optional<Tensor>& dlse, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& out0, const Tensor& lse0, const optional<Tensor>& kpm, const optional<Tensor>& layout,
    int64_t layout_block, int64_t lay_check, const optional<Tensor>& lists, int64_t list_wf,
    const optional<Tensor>& lists_by_key, int64_t listk_wf, const optional<Tensor>& seed, double scale,
    double dropout_p, int64_t left, int64_t right) {
  EFFATTN_GUARD(q);
  Prepared r = prepare(q, k, v, kpm, layout, layout_block, lay_check, lists, list_wf, lists_by_key, listk_wf, seed,
                       scale, dropout_p, left, right);
  effattn::AttnParams& p = r.p;
  Tensor dout = aligned(dout0.to(q.scalar_type()));
  Tensor out = out0.contiguous();
  Tensor lse = lse0.contiguous();
  Tensor dq = at::empty({p.B, p.H, p.Lq, p.D}, q.options());
  Tensor dk = at::empty({p.B, p.H / p.G, p.Lk, p.D}, q.options());
  Tensor dv = at::empty({p.B, p.H / p.G, p.Lk, p.Dv}, q.options());
  Tensor delta = at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat));
  if (p.Lq == 0 || p.B * p.H == 0) {
    dq.zero_(), dk.zero_(), dv.zero_();
  } else {
    poison(dq), poison(dk), poison(dv), poison(delta);
    Tensor dl;
    if (dlse.has_value()) {
      dl = dlse->to(at::kFloat);
      p.dlse = dl.data_ptr<float>();
      p.dl_b = dl.stride(0), p.dl_h = dl.stride(1), p.dl_l = dl.stride(2);
    }
    p.dout = dout.data_ptr();
    p.do_b = stride_or_0(dout, 0), p.do_h = stride_or_0(dout, 1), p.do_l = dout.stride(2);
    p.o = out.data_ptr();
    p.o_b = out.stride(0), p.o_h = out.stride(1), p.o_l = out.stride(2);
    p.lse = lse.data_ptr<float>();
    p.delta = delta.data_ptr<float>();
    p.delta_out = delta.data_ptr<float>();
    p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
    run_checked(effattn::attention_bwd(p, r.bf16, EFFATTN_STREAM), "backward");
  }
  auto crop = [](const Tensor& g, int64_t d) { return g.size(3) == d ? g : g.narrow(3, 0, d).contiguous(); };
  return {crop(dq, q.size(3)), crop(dk, k.size(3)), crop(dv, v.size(3))};
}

// Split-KV decode (Lq <= 16, forward only): `lists` are the tile lists of query tile 0 (16 rows)
// against key tiles of kDecodeBlockN, per KV head; layout_check 2 masks their full tiles too (lists
// of a per-head layout OR-ed over each GQA group).
std::tuple<Tensor, Tensor> attention_decode(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const optional<Tensor>& kpm, const optional<Tensor>& layout,
                                            int64_t layout_block, int64_t layout_check, const optional<Tensor>& lists,
                                            int64_t list_wf, double scale, int64_t left, int64_t right,
                                            int64_t splits) {
  EFFATTN_GUARD(q);
  check(q.dim() == 4 && q.size(2) <= effattn::kDecodeMaxQueries, "decode takes at most 16 query rows");
  check(splits >= 1, "decode needs at least one split");
  Prepared r = prepare(q, k, v, kpm, layout, layout_block, layout.has_value() ? 1 : 0, lists, list_wf,
                       c10::nullopt, 0, c10::nullopt, scale, 0.0, left, right);
  Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  poison(out);
  poison(lse);
  effattn::DecodeParams d{};
  d.a = r.p;
  d.a.o = out.data_ptr();
  d.a.o_b = out.stride(0), d.a.o_h = out.stride(1), d.a.o_l = out.stride(2);
  d.a.lse = lse.data_ptr<float>();
  d.splits = int(splits);
  d.rows = d.a.G * d.a.Lq;
  d.row_tiles = (d.rows + effattn::kDecodeRows - 1) / effattn::kDecodeRows;
  d.mask_full = layout_check == 2;
  Tensor part_o, part_lse;
  if (splits > 1) {
    part_o = at::empty({q.size(0) * q.size(1) * q.size(2), splits, v.size(3)}, q.options().dtype(at::kFloat));
    part_lse = at::empty({q.size(0) * q.size(1) * q.size(2), splits}, q.options().dtype(at::kFloat));
    poison(part_o);
    poison(part_lse);
    d.part_o = part_o.data_ptr<float>();
    d.part_lse = part_lse.data_ptr<float>();
  }
  run_checked(effattn::attention_decode(d, r.bf16, EFFATTN_STREAM), "decode");
  return {out, lse};
}

// ------------------------------------------------------------------ linear attention (csrc/linear.h)

int lin_kind(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return effattn::kBF16;
    case at::kHalf: return effattn::kF16;
    case at::kFloat: return effattn::kF32;
    default: TORCH_CHECK(false, "effattn cuda linear attention: dtype must be bfloat16, float16 or float32");
  }
  return -1;
}

effattn::LinRows lin_rows(const Tensor& t, int64_t shift, int64_t map) {
  check(t.dim() == 4, "linear attention operands must be 4-D (B, H, L, F)");
  effattn::LinRows r;
  r.x = t.data_ptr();
  r.sb = t.stride(0), r.sh = t.stride(1), r.sl = t.stride(2), r.sf = t.stride(3);
  r.H = int(t.size(1)), r.L = int(t.size(2)), r.F = int(t.size(3));
  r.shift = int(shift), r.map = int(map), r.kind = lin_kind(t);
  return r;
}

const float* f32_or_null(const optional<Tensor>& t) {
  if (!t.has_value()) return nullptr;
  check(t->scalar_type() == at::kFloat, "linear attention states and row weights must be float32");
  return t->data_ptr<float>();
}

int64_t cdiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::tuple<Tensor, Tensor, Tensor, Tensor> linear_state(const Tensor& b, int64_t b_shift, int64_t b_map,
                                                        const Tensor& c, int64_t c_map, const optional<Tensor>& cx,
                                                        int64_t cx_mode, int64_t T, bool reverse, bool store,
                                                        int64_t n_split, int64_t parts) {
  EFFATTN_GUARD(b);
  effattn::LinStateParams p;
  p.b = lin_rows(b, b_shift, b_map);
  p.c = lin_rows(c, b_shift, c_map);
  check(b.size(0) == c.size(0) && b.size(1) == c.size(1), "state pass operands must share (B, H)");
  const int64_t B = b.size(0), H = b.size(1), Fb = b.size(3), Fc = c.size(3), BH = B * H;
  p.B = int(B);
  p.n_chunks = int(cdiv64(T, effattn::kLinChunk));
  n_split = std::max<int64_t>(1, std::min<int64_t>(n_split, std::max(p.n_chunks, 1)));
  p.chunks_per_block = int(cdiv64(p.n_chunks, n_split));
  p.reverse = reverse, p.store = store, p.cx_mode = int(cx_mode);
  Tensor cxc;
  if (cx_mode == 2) {
    check(cx.has_value(), "cx_mode 2 needs cx");
    cxc = cx->contiguous();
    p.cx = f32_or_null(cxc);
  }
  auto f32 = b.options().dtype(at::kFloat);
  Tensor st = store ? at::empty({BH, p.n_chunks, Fb, Fc}, f32) : at::empty({0}, f32);
  Tensor stz = store && cx_mode ? at::empty({BH, p.n_chunks, Fb}, f32) : at::empty({0}, f32);
  Tensor fin = at::empty({n_split, BH, Fb, Fc}, f32);
  Tensor finz = cx_mode ? at::empty({n_split, BH, Fb}, f32) : at::empty({0}, f32);
  for (Tensor* t : {&st, &stz, &fin, &finz}) poison(*t);
  p.st = store ? st.data_ptr<float>() : nullptr;
  p.stz = store && cx_mode ? stz.data_ptr<float>() : nullptr;
  p.fin = fin.data_ptr<float>();
  p.finz = cx_mode ? finz.data_ptr<float>() : nullptr;
  if (p.n_chunks == 0) {
    fin.zero_(), finz.zero_();
    return {st, stz, fin, finz};
  }
  run_checked(effattn::linear_state(p, int(parts), int(cdiv64(Fb, 64)), int(cdiv64(Fc, 64)), int(n_split),
                                    EFFATTN_STREAM), "linear state pass");
  return {st, stz, fin, finz};
}

std::tuple<Tensor, Tensor> linear_out(
    const Tensor& a, int64_t a_shift, int64_t a_map, const optional<Tensor>& b, int64_t b_shift, int64_t b_map,
    const optional<Tensor>& c, int64_t c_map, int64_t fc, int64_t hb, int64_t T, bool causal, bool reverse,
    int64_t nb, int64_t ga, const optional<Tensor>& ax, int64_t a_x, const optional<Tensor>& bx, int64_t b_x,
    const optional<Tensor>& st, at::IntArrayRef st_strides, const optional<Tensor>& stz,
    at::IntArrayRef stz_strides, int64_t z_mode, const optional<Tensor>& base, at::IntArrayRef base_strides,
    const optional<Tensor>& base_z, int64_t basez_stride, const optional<Tensor>& gx, int64_t gx_map,
    at::ScalarType out_dtype, bool with_den, bool normalize, double eps, int64_t parts) {
  EFFATTN_GUARD(a);
  effattn::LinOutParams p;
  p.a = lin_rows(a, a_shift, a_map);
  if (causal) {
    check(b.has_value() && c.has_value(), "a causal output pass needs b and c");
    p.b = lin_rows(*b, b_shift, b_map);
    p.c = lin_rows(*c, b_shift, c_map);
  }
  if (gx.has_value()) p.gx = lin_rows(*gx, a_shift, gx_map);
  const int64_t B = a.size(0), Ha = a.size(1), La = a.size(2);
  p.B = int(B), p.Ha = int(Ha), p.Hb = int(hb), p.GA = int(ga), p.NB = int(nb);
  p.n_chunks = int(cdiv64(T, effattn::kLinChunk));
  p.FA = int(a.size(3)), p.FC = int(fc);
  p.causal = causal, p.reverse = reverse;
  p.ax = f32_or_null(ax), p.a_x = int(a_x);
  p.bx = f32_or_null(bx), p.b_x = int(b_x);
  p.st = f32_or_null(st);
  if (p.st) check(st_strides.size() == 4, "st_strides: 4 strides"),
      p.st_bh = st_strides[0], p.st_c = st_strides[1], p.st_a = st_strides[2], p.st_f = st_strides[3];
  p.stz = f32_or_null(stz);
  if (p.stz) check(stz_strides.size() == 2, "stz_strides: 2 strides"), p.stz_bh = stz_strides[0], p.stz_c = stz_strides[1];
  p.z_mode = int(z_mode);
  p.base = f32_or_null(base);
  if (p.base) {
    check(base_strides.size() == 3, "base_strides: 3 strides");
    p.base_bh = base_strides[0], p.base_a = base_strides[1], p.base_f = base_strides[2];
    p.gbase = int(std::max<int64_t>(1, B * Ha / base->size(0)));
  }
  p.base_z = f32_or_null(base_z);
  p.basez_bh = basez_stride;
  if (p.base_z && !p.base) p.gbase = int(std::max<int64_t>(1, B * Ha / base_z->size(0)));
  Tensor out = at::empty({B, Ha, La, fc}, a.options().dtype(out_dtype));
  Tensor den = at::empty({with_den ? B * Ha : 0, with_den ? La : 0}, a.options().dtype(at::kFloat));
  poison(out), poison(den);
  p.out = out.data_ptr(), p.out_kind = lin_kind(out);
  p.o_b = out.stride(0), p.o_h = out.stride(1), p.o_l = out.stride(2);
  p.den = with_den ? den.data_ptr<float>() : nullptr;
  p.with_den = with_den, p.normalize = normalize, p.eps = float(eps);
  run_checked(effattn::linear_out(p, int(parts), EFFATTN_STREAM), "linear output pass");
  return {out, den};
}

std::tuple<Tensor, Tensor, Tensor> linear_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& S0,
                                               const Tensor& z0, int64_t map, bool normalize, double eps) {
  EFFATTN_GUARD(q);
  check(q.dim() == 4 && q.size(2) == 1 && k.size(2) == 1 && v.size(2) == 1, "a step takes one token");
  check(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v must share a dtype");
  Tensor S = S0.to(at::kFloat).contiguous(), z = z0.to(at::kFloat).contiguous();
  effattn::LinStepParams p{};
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr();
  p.q_b = q.stride(0), p.q_h = q.stride(1), p.q_f = q.stride(3);
  p.k_b = k.stride(0), p.k_h = k.stride(1), p.k_f = k.stride(3);
  p.v_b = v.stride(0), p.v_h = v.stride(1), p.v_f = v.stride(3);
  p.B = int(q.size(0)), p.H = int(q.size(1)), p.G = int(q.size(1) / k.size(1));
  p.F = int(q.size(3)), p.Dv = int(v.size(3));
  check(S.numel() == int64_t(p.B) * p.H * p.F * p.Dv && z.numel() == int64_t(p.B) * p.H * p.F,
        "the state must be (B, H, F, Dv), (B, H, F)");
  Tensor S_out = at::empty_like(S), z_out = at::empty_like(z);
  Tensor out = at::empty({q.size(0), q.size(1), 1, v.size(3)}, v.options());
  poison(S_out), poison(z_out), poison(out);
  p.S = S.data_ptr<float>(), p.z = z.data_ptr<float>();
  p.S_out = S_out.data_ptr<float>(), p.z_out = z_out.data_ptr<float>();
  p.out = out.data_ptr(), p.kind = lin_kind(q), p.map = int(map), p.normalize = normalize, p.eps = float(eps);
  run_checked(effattn::linear_step(p, EFFATTN_STREAM), "linear step");
  return {out, S_out, z_out};
}

Tensor linear_favor(const Tensor& x, const Tensor& w0, double scale, double cap) {
  EFFATTN_GUARD(x);
  Tensor w = w0.to(at::kFloat).contiguous();
  check(w.dim() == 2 && w.size(1) == x.size(3), "the projection must be (F, D)");
  effattn::LinFavorParams p;
  p.x = lin_rows(x, 0, 0);
  p.B = int(x.size(0)), p.w = w.data_ptr<float>(), p.F = int(w.size(0));
  p.sqrt_scale = float(std::sqrt(scale)), p.cap = float(cap), p.norm = float(1.0 / std::sqrt(double(p.F)));
  Tensor out = at::empty({x.size(0), x.size(1), x.size(2), w.size(0)}, x.options().dtype(at::kFloat));
  poison(out);
  p.out = out.data_ptr<float>();
  run_checked(effattn::linear_favor(p, EFFATTN_STREAM), "FAVOR+ features");
  return out;
}

#if defined(EFFATTN_CUDA_EMU)
// Emulation controls for tests: the schedule, and the counters (blocks, mma, ldmatrix phases and
// wavefronts, worst wavefronts of one phase), reset on read.
void emu_set_schedule(int64_t s) { effattn::emu::schedule() = effattn::emu::Schedule(int(s)); }

Tensor emu_stats() {
  effattn::emu::Stats& s = effattn::emu::stats();
  Tensor t = at::tensor({int64_t(s.blocks), int64_t(s.mma), int64_t(s.ldmatrix_phases),
                         int64_t(s.ldmatrix_wavefronts), int64_t(s.max_wavefronts)},
                        at::TensorOptions().dtype(at::kLong));
  s = effattn::emu::Stats();
  return t;
}
#endif

}  // namespace

#define EFFATTN_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define EFFATTN_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

EFFATTN_LIBRARY(EFFATTN_OPS, m) {
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? layout, int layout_block, "
        "int layout_check, Tensor? lists, int list_wf, Tensor? seed, float scale, float dropout_p, int window_left, "
        "int window_right) -> (Tensor, Tensor)");
  m.def("attention_bwd(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? key_padding_mask, Tensor? layout, int layout_block, int layout_check, Tensor? lists, int list_wf, "
        "Tensor? lists_by_key, int listk_wf, Tensor? seed, float scale, float dropout_p, int window_left, "
        "int window_right) -> (Tensor, Tensor, Tensor)");
  m.def("attention_fwd_sm90(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? layout, "
        "int layout_block, int layout_check, Tensor? lists, int list_wf, Tensor? seed, float scale, float dropout_p, "
        "int window_left, int window_right) -> (Tensor, Tensor)");
  m.def("has_sm90a() -> bool", has_sm90a);
  m.def("attention_decode(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? layout, "
        "int layout_block, int layout_check, Tensor? lists, int list_wf, float scale, int window_left, "
        "int window_right, int splits) -> (Tensor, Tensor)");
  m.def("linear_state(Tensor b, int b_shift, int b_map, Tensor c, int c_map, Tensor? cx, int cx_mode, int T, "
        "bool reverse, bool store, int n_split, int parts) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("linear_out(Tensor a, int a_shift, int a_map, Tensor? b, int b_shift, int b_map, Tensor? c, int c_map, "
        "int fc, int hb, int T, bool causal, bool reverse, int nb, int ga, Tensor? ax, int a_x, Tensor? bx, int b_x, "
        "Tensor? st, int[] st_strides, Tensor? stz, int[] stz_strides, int z_mode, Tensor? base, int[] base_strides, "
        "Tensor? base_z, int basez_stride, Tensor? gx, int gx_map, ScalarType out_dtype, bool with_den, "
        "bool normalize, float eps, int parts) -> (Tensor, Tensor)");
  m.def("linear_step(Tensor q, Tensor k, Tensor v, Tensor S, Tensor z, int map, bool normalize, float eps) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("linear_favor(Tensor x, Tensor projection, float scale, float cap) -> Tensor");
#if defined(EFFATTN_CUDA_EMU)
  m.def("emu_set_schedule(int schedule) -> ()", emu_set_schedule);
  m.def("emu_stats() -> Tensor", emu_stats);
#endif
}

EFFATTN_LIBRARY_IMPL(EFFATTN_OPS, EFFATTN_KEY, m) {
  m.impl("attention_fwd", attention_fwd);
  m.impl("attention_bwd", attention_bwd);
  m.impl("attention_fwd_sm90", attention_fwd_sm90);
  m.impl("attention_decode", attention_decode);
  m.impl("linear_state", linear_state);
  m.impl("linear_out", linear_out);
  m.impl("linear_step", linear_step);
  m.impl("linear_favor", linear_favor);
}

#if !defined(EFFATTN_CUDA_EMU)
// `import effattn._C` loads this library (which registers the ops above); Python needs the module
// entry point. The emulated build is loaded as a plain library and needs none.
#include <Python.h>

static PyModuleDef effattn_c_module = {PyModuleDef_HEAD_INIT, "_C",
                                       "effattn's CUDA kernels (ops in torch.ops.effattn_cuda)", -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&effattn_c_module); }
#endif
