// The torch glue of the linear-attention kernels (csrc/linear/): row operands, state buffers, the
// ops' schemas (formulas in effattn/backends/cuda/linear_ops.py).
#include <algorithm>
#include <cmath>

#include "binding/common.h"
#include "linear/linear.h"

namespace {

using namespace effattn::binding;

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(EFFATTN_OPS, m) {
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
}

TORCH_LIBRARY_IMPL(EFFATTN_OPS, EFFATTN_KEY, m) {
  m.impl("linear_state", linear_state);
  m.impl("linear_out", linear_out);
  m.impl("linear_step", linear_step);
  m.impl("linear_favor", linear_favor);
}
