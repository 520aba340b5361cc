// The softmax-attention ops' arguments as an AttnParams (attention_args.h).
#include "binding/attention_args.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace effattn {
namespace binding {

// Whether the kernels can read a 4-D tensor with 16-byte cp.async rows: last dim contiguous and a
// multiple of 8, the other strides multiples of 8 elements, 16-byte aligned base.
bool cp_async_rows(const Tensor& t) {
  bool ok = t.stride(3) == 1 && t.size(3) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < 3 && ok; ++d) ok = t.stride(d) % 8 == 0 || t.size(d) <= 1;
  return ok;
}

Tensor aligned(const Tensor& t) {
  if (cp_async_rows(t)) return t;
  int64_t pad = (8 - t.size(3) % 8) % 8;
  return at::constant_pad_nd(t, {0, pad}).contiguous();
}

// Fills everything but the output / gradient pointers.
Prepared prepare(const Tensor& q0, const Tensor& k0, const Tensor& v0, const optional<Tensor>& kpm,
                 const optional<Tensor>& layout, int64_t layout_block, int64_t lay_check,
                 const optional<Tensor>& lists, int64_t list_wf, const optional<Tensor>& lists_by_key,
                 int64_t listk_wf, const optional<Tensor>& seed, double scale, double dropout_p, int64_t left,
                 int64_t right, const Varlen& varlen) {
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
  if (varlen.q_offset.has_value()) {
    check(!varlen.cu_q.has_value(), "q_offset (positions) cannot be combined with cu_seqlens");
    check(std::abs(*varlen.q_offset) < (int64_t(1) << 30), "q_offset must be in (-2^30, 2^30)");
    p.off = int(*varlen.q_offset);
  }
  // The caller sends the normalized window (effattn/visibility.py: a window wider than the sequences
  // is no window, -1; query i sits at key i + off); the bounds are only checked here (and then fit in
  // int32). Packed, the packed lengths bound every segment's.
  check(left == -1 || (left >= 0 && left < std::max(p.Lq - 1 + p.off, 0)),
        "window_left must be -1 (no window) or in [0, Lq - 1 + off) (off = Lk - Lq, or q_offset): the caller "
        "normalizes a wider window to -1");
  check(right == -1 || (right >= 0 && right < std::max(p.Lk - 1 - p.off, 0)),
        "window_right must be -1 (no window) or in [0, Lk - 1 - off) (off = Lk - Lq, or q_offset): the caller "
        "normalizes a wider window to -1");
  p.rq_h = p.Lq, p.rq_b = int64_t(p.H) * p.Lq;
  p.rk_h = p.Lk, p.rk_b = int64_t(Hkv) * p.Lk;
  if (varlen.cu_q.has_value() || varlen.cu_k.has_value()) {
    check(varlen.cu_q.has_value() && varlen.cu_k.has_value(), "cu_seqlens_q and cu_seqlens_k come together");
    check(!kpm.has_value() && !layout.has_value(), "cu_seqlens cannot be combined with a key padding mask or a layout");
    check(p.B == 1, "with cu_seqlens, q, k, v must be packed as (1, H, T, D)");
    for (const Tensor* cu : {&*varlen.cu_q, &*varlen.cu_k}) {
      check(cu->scalar_type() == at::kInt && cu->dim() == 1 && cu->numel() >= 1,
            "cu_seqlens_q / cu_seqlens_k must be int32 of shape (N + 1,)");
      check(cu->device() == q0.device(), "cu_seqlens_q / cu_seqlens_k must be on q's device");
    }
    check(varlen.cu_q->numel() == varlen.cu_k->numel(), "cu_seqlens_q and cu_seqlens_k must have the same length");
    // (a max_seqlen larger than every segment only adds blocks that exit at once)
    check(varlen.max_q >= 0 && varlen.max_q < (int64_t(1) << 30), "max_seqlen_q must be in [0, 2^30)");
    check(varlen.max_k >= 0 && varlen.max_k < (int64_t(1) << 30), "max_seqlen_k must be in [0, 2^30)");
    r.cu_q = varlen.cu_q->contiguous();
    r.cu_k = varlen.cu_k->contiguous();
    p.cu_q = r.cu_q.data_ptr<int32_t>();
    p.cu_k = r.cu_k.data_ptr<int32_t>();
    p.rq_b = p.rk_b = 0;                         // rows of (1, H, T): segment b's rows are moved by its start
    p.B = int(r.cu_q.numel() - 1);
    p.Lq = int(varlen.max_q);
    p.Lk = int(varlen.max_k);
  }
  p.left = int(left);
  p.right = int(right);
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
    p.list_rows = int(r.lists.size(1));
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
    set_dropout_seed(p, key);
    p.drop_thresh = int(std::min<double>(std::nearbyint(dropout_p * (1 << 24)), (1 << 24) - 1));
    p.inv_keep = float(1.0 / (1.0 - dropout_p));
  }
  if (varlen.q_pos.has_value() || varlen.k_pos.has_value()) {
    check(varlen.q_pos.has_value() && varlen.k_pos.has_value(), "q_pos and k_pos come together");
    check(!varlen.cu_q.has_value(), "q_pos / k_pos (per-row positions) cannot be combined with cu_seqlens");
    const int64_t want[2][3] = {{p.B, p.H, p.Lq}, {p.B, Hkv, p.Lk}};
    const Tensor* pos[2] = {&*varlen.q_pos, &*varlen.k_pos};
    for (int t = 0; t < 2; ++t) {
      const Tensor& x = *pos[t];
      check(x.scalar_type() == at::kInt && x.device() == q0.device(), "q_pos / k_pos must be int32 on q's device");
      check(x.dim() == 3 && x.size(0) == want[t][0] && x.size(1) == want[t][1] && x.size(2) == want[t][2],
            "q_pos must be (B, H, Lq) and k_pos (B, Hkv, Lk)");
    }
    check(std::isfinite(varlen.pos_self), "self_score must be finite");
    check(std::max(p.D, p.Dv) > 32 && std::max(p.D, p.Dv) <= 128,
          "q_pos / k_pos (per-row positions) are served at head dims 33..128 (the backward's registers spill at "
          "the buckets 32 and 256)");
    r.q_pos = varlen.q_pos->contiguous();
    r.k_pos = varlen.k_pos->contiguous();
    p.q_pos = r.q_pos.data_ptr<int32_t>();
    p.k_pos = r.k_pos.data_ptr<int32_t>();
    p.pos_causal = int(varlen.pos_causal);
    p.pos_self = float(varlen.pos_self);
  }
  p.drop_H = p.H;
  if (!varlen.drop_at.empty()) {
    const std::vector<int64_t>& at = varlen.drop_at;
    check(at.size() == 4, "drop_at must be (q_start, k_start, h0, heads)");
    constexpr int64_t kMax = int64_t(1) << 30;
    check(at[0] >= 0 && at[0] < kMax && at[1] >= 0 && at[1] < kMax,
          "drop_at's q_start and k_start must be in [0, 2^30)");
    check(at[2] >= 0 && at[3] >= at[2] + p.H && at[3] < kMax,
          "drop_at's h0 and heads must hold the call's H heads (0 <= h0, h0 + H <= heads < 2^30)");
    p.drop_q0 = int(at[0]), p.drop_k0 = int(at[1]), p.drop_h0 = int(at[2]), p.drop_H = int(at[3]);
  }
  return r;
}

Tensor set_backward_inputs(effattn::AttnParams& p, const Tensor& dout, const optional<Tensor>& dlse, const Tensor& out,
                           const Tensor& lse, const Tensor& delta) {
  Tensor dl;
  if (dlse.has_value()) {
    dl = dlse->to(at::kFloat);
    p.dlse = dl.data_ptr<float>();
    p.dl_b = dl.stride(0), p.dl_h = dl.stride(1), p.dl_l = dl.stride(2);
  }
  p.dout = dout.data_ptr();
  p.do_b = stride_or_0(dout, 0), p.do_h = stride_or_0(dout, 1), p.do_l = dout.stride(2);
  p.o = out.data_ptr();
  p.o_f32 = int(out.scalar_type() == at::kFloat);
  p.o_b = out.stride(0), p.o_h = out.stride(1), p.o_l = out.stride(2);
  p.lse = lse.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.delta_out = delta.data_ptr<float>();
  return dl;
}

}  // namespace binding
}  // namespace effattn
