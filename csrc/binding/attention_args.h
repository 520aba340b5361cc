// The arguments of the softmax-attention ops (forward, backward, decode) as an AttnParams: checks,
// aligned copies where cp.async cannot read a tensor, the mask and dropout fields.
#pragma once

#include "attention/attention.h"
#include "binding/common.h"

namespace effattn {
namespace binding {

// The tensors a call's AttnParams point into (kept alive for the call) and the params themselves.
struct Prepared {
  Tensor q, k, v, kpm, layout, lists, lists_by_key;
  effattn::AttnParams p{};
  bool bf16 = false;
};

// A tensor the kernels can read with 16-byte cp.async rows (or a zero-padded copy).
Tensor aligned(const Tensor& t);

// Fills everything but the output / gradient pointers.
Prepared prepare(const Tensor& q0, const Tensor& k0, const Tensor& v0, const optional<Tensor>& kpm,
                 const optional<Tensor>& layout, int64_t layout_block, int64_t lay_check,
                 const optional<Tensor>& lists, int64_t list_wf, const optional<Tensor>& lists_by_key,
                 int64_t listk_wf, const optional<Tensor>& seed, double scale, double dropout_p, int64_t left,
                 int64_t right);

}  // namespace binding
}  // namespace effattn
