"""The row ``triton/lsh`` of op ``"lsh_attention"``: the rounds in sorted order (`effattn.lsh.sorted_rounds`,
rounds folded into the head axis) on effattn's general block-sparse attention kernels
(``effattn/backends/triton/attention``) with the layout `effattn.lsh.lsh_layout` (one head, cached per
(length, chunk_len, offsets) so its tile lists are built once) and per-row positions: the kernels'
``POS`` feature hides padding keys and, when causal, keys after the query's original position, and
gives a token against itself the constant `effattn.lsh.SELF_SCORE`, in every visited tile. Forward
and backward (deterministic: the backward kernels write each gradient element once), dropout from
the kernels' Philox stream seeded from torch's default generator; `effattn.lsh.unsorted` puts the
rows back in their original order."""
from __future__ import annotations

import torch

from ....lsh import FN, cached_lsh_layout, sorted_rounds, unsorted
from ....numerics import draw_seed
from ....tiles import visited_tiles
from ..runtime import _INTERPRET, own_kernel_row, triton


def _layout_on(call, device):
    return cached_lsh_layout(call.q.shape[2], call.chunk_len, call.offsets).to(device)


def _kernel_tiles(call):
    """(BLOCK_M, BLOCK_N) of the forward's tiles the description counts: the interpreter's config, or
    the first GPU candidate (the one taken untimed; the autotuner may pick another)."""
    from ..attention import configs
    if _INTERPRET:
        return configs.INTERPRET_CONFIGS["fwd"][:2]
    block = max(16, 1 << (max(call.q.shape[-1], call.v.shape[-1]) - 1).bit_length())
    return configs.candidates("fwd", configs.head_class(block), call.q.element_size())[0][:2]


def describe(call) -> str:
    B, H, L, _ = call.q.shape
    lay = _layout_on(call, "cpu")
    bm, bn = _kernel_tiles(call)
    full, part = visited_tiles(L, L, bm, bn, layout_mask=lay.mask, layout_block=call.chunk_len)
    n = B * H * call.n_hashes
    return (f"triton (the block-sparse attention kernels with positions: rounds in sorted order as "
            f"{n} heads, layout of {lay.num_query_blocks} x {len(call.offsets)} chunk blocks of {call.chunk_len}; "
            f"{full + part} tiles of {bm} x {bn} per head ({full} full, {part} partial), every one masked by "
            f"the gathered positions)")


if triton is not None:
    from ..attention import launch

    class _Rounds(torch.autograd.Function):
        """Sorted rows ``q, k (N, L, D)``, ``v (N, L, Dv)`` -> ``out (N, L, Dv)`` fp32 and ``lse (N, L)``
        of the block-sparse kernels with positions (the N rows as heads of one batch)."""

        @staticmethod
        def forward(ctx, q, k, v, q_pos, k_pos, mask, chunk_len, causal, scale, dropout_p, seed):
            q4, k4, v4 = (x.unsqueeze(0) for x in (q, k, v))
            out, lse = launch.fwd(q4, k4, v4, mask, chunk_len, None, seed, scale, dropout_p, -1, -1,
                                  out_fp32=True, q_pos=q_pos, k_pos=k_pos, pos_causal=causal)
            ctx.save_for_backward(q4, k4, v4, q_pos, k_pos, mask, out, lse)
            ctx.args = (chunk_len, seed, scale, dropout_p, causal)
            return out[0], lse[0]

        @staticmethod
        def backward(ctx, dout, dlse):
            q4, k4, v4, q_pos, k_pos, mask, out, lse = ctx.saved_tensors
            chunk_len, seed, scale, dropout_p, causal = ctx.args
            dout = torch.zeros_like(out) if dout is None else dout.unsqueeze(0)
            dlse = None if dlse is None else dlse.unsqueeze(0)
            dq, dk, dv = launch.bwd(dout, dlse, q4, k4, v4, out, lse, mask, chunk_len, None, seed, scale, dropout_p,
                                    -1, -1, out_fp32=True, q_pos=q_pos, k_pos=k_pos, pos_causal=causal)
            return dq[0], dk[0], dv[0], None, None, None, None, None, None, None, None


def _run(call):
    rows = sorted_rounds(call, call.q.dtype)
    mask = _layout_on(call, call.q.device).mask
    seed = draw_seed() if call.dropout_p > 0 else None
    out_s, lse_s = _Rounds.apply(rows.q, rows.k, rows.v, rows.pos.to(torch.int32).contiguous(),
                                 rows.key_positions().contiguous(), mask, call.chunk_len, call.causal, call.scale,
                                 call.dropout_p, seed)
    return unsorted(out_s, lse_s, call)


PATH = own_kernel_row(FN, "triton/lsh", _run, {"causal", "key_padding_mask", "dropout"}, describe=describe)
