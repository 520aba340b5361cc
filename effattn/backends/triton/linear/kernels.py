"""The Triton kernels of linear attention (math only; launchers in ``launch.py``).

Everything is written in terms of three row operands ``a``, ``b``, ``c`` on a common timeline
``t`` (query positions): operand row ``r = t + shift`` (keys of a causal call with ``Lk < Lq`` sit at
``shift = Lk - Lq < 0``; rows outside ``[0, L)`` are zero). Two kernels compute

- ``chunk_state_kernel`` (the chunk-state pass, fla's ``chunk_h``): for every chunk ``c`` of ``CH``
  timeline positions, the state ``S_c = sum_{t before chunk c} b_t^T c_t`` (``(Fb, Fc)``) and
  ``z_c = sum b_t * cx_t`` (``(Fb,)``: the prefix sum of ``chunk_sum_kernel``'s per-chunk row sums),
  "before" meaning earlier chunks, or later ones when ``REVERSE``; and the total over all chunks (the
  final state). Sequential over chunks, parallel
  over heads and (Fb, Fc) tiles. Without ``STORE`` it only sums, over a range of chunks per program
  (the non-causal reduction, split over the sequence).
- ``chunk_out_kernel`` (the output pass, fla's ``chunk_o``): for each chunk and a tile of ``Fc``,
  ``out_t = sum_{s in chunk, s <= t} (a_t . b_s + ax_t bx_s) c_s + a_t S_c + ax_t zc_c`` (``s >= t``
  when ``REVERSE``; no intra-chunk term without ``CAUSAL``), plus a fixed ``base`` state, an optional
  denominator ``den_t = sum_s a_t . b_s + a_t . z_c`` (the row sums of the masked scores the numerator
  multiplies, plus fp32 row dots in a loop after the products) and the feature-map derivative of the output.

The forward is (state pass on (phi(k), v); output pass), the backward four more launches of the same
two kernels with the operands swapped (see ``ops.py``). Feature maps (``MAP``: the codes of
`effattn.feature_maps.KERNEL_MAPS`, identity / elu + 1 / relu) are placed per dtype (``launch.MAP_ONCE``,
from the offline model of tools/triton/linear_kernel_resources.py): once per token, in ``map_kernel`` (one
launch for q and k), which writes ``phi(x)`` in the input's dtype for the passes to read as they are; or in
the passes, on each tile right after its load, in fp32 (each operand's ``MAP_A`` / ``MAP_B`` / ``MAP_C``;
identity for a pre-mapped or unmapped operand). The output pass also reads the raw rows of ``MAP_X`` (the
map's derivative in the backward), the step kernel maps its one row itself.
The normalizer takes no matrix product: ``z``'s per-chunk row sums are reduced in `chunk_sum_kernel` (a tile
that feeds no dot) and the denominator's state terms from a second, unpipelined load of the a tiles. No
pipelined shared-memory tile that a dot reads is also reduced: Triton 3.6's pipeliner (3 stages, sm_90)
read such a tile's buffer twice, in two layouts, and the reduction came out wrong on an H200 (FAVOR+
features, a bf16 tile with no map applied: the normalizer ``z`` and the output off by up to 0.09);
``tools.triton.linear_kernel_resources.shared_tile_reductions`` finds the pattern and a test holds it at 0.
Before, both were products on the tensor cores against a 16-column ``(hi, lo)`` split of the fp32 vector
(a 64 x 16 wgmma in each loop).

Arguments mirror the CUDA kernels' parameter blocks (`LinStateParams`, `LinOutParams`, `LinStepParams` in
csrc/linear/linear.h) under their names, a nested row operand ``a`` / ``b`` / ``c`` / ``gx`` (C++ `LinRows`)
flattened with its name in front: its pointer ``Ap`` / ``Bp`` / ``Cp`` / ``GXp`` (C++ ``a.x``, ...), its
strides as one tuple ``a_strides`` = (a_sb, a_sh, a_sl, a_sf), ``a_L``, ``a_shift``, ``b_F``, ``b_H``; the
other fields as they are (``FA``, ``FC``, ``Ha``, ``Hb``, ``GA``, ``n_chunks``, ``chunks_per_block``, ``st_bh``,
``st_c``, ``st_a``, ``st_f`` (as ``st_strides``), ``stz_strides`` = (stz_bh, stz_c), ``base_strides`` = (base_bh,
base_a, base_f), ``basez_bh``, ``gbase``, ``o_strides`` = (o_b, o_h, o_l, o_f), ``eps``; pointers upper case:
``CX`` (`chunk_sum_kernel`'s; the state kernel reads its sums ``ZS`` instead), ``ST``, ``STZ``, ``FIN``, ``FINZ``, ``AX``, ``BX``, ``BASE``, ``BASEZ``, ``OUT``, ``DEN``; the step's
``S``, ``Z``, ``S_OUT``, ``Z_OUT``). C++ int flags that select code here are constexprs (``REVERSE``,
``STORE``, ``CAUSAL``, ``C_X`` = cx_mode, ``A_X``, ``B_X``, ``Z_MODE``, ``MAP_A``, ``MAP_B``, ``MAP_C``,
``MAP_X`` = each operand's ``map``, ...).
No C++ field: the state pass's Fb stride ``st_b`` (C++ stores the states contiguous), the last-dim
strides ``o_f``, and the step's per-head row strides ``q_bh``, ``k_bh``, ``v_bh``, ``o_bh``. One helper per
kernel in ``launch.py`` builds them by name (`state_args`, `out_args`, `step`); every launch passes
them by keyword.
"""
import triton
import triton.language as tl

from ....feature_maps import FMAP_ELU, FMAP_IDENTITY, FMAP_RELU
from ..jit import cast, dot

IDENTITY: tl.constexpr = tl.constexpr(FMAP_IDENTITY)   # feature-map codes (effattn.feature_maps.KERNEL_MAPS)
ELU: tl.constexpr = tl.constexpr(FMAP_ELU)
RELU: tl.constexpr = tl.constexpr(FMAP_RELU)


@triton.jit
def _rows(base, r, L, s_l, cols, ncols, s_f, MAP: tl.constexpr):
    """fp32 tile of rows ``r`` x columns ``cols``, the feature map applied; zero outside the tensor
    (after the map: elu + 1 of a padded zero is 1). The map is written out here rather than called:
    each nested jit call costs about a millisecond under Triton's interpreter."""
    ok = ((r >= 0) & (r < L))[:, None] & (cols < ncols)[None, :]
    x = tl.load(base + r.to(tl.int64)[:, None] * s_l + cols[None, :] * s_f, mask=ok, other=0.0).to(tl.float32)
    if MAP == ELU:
        x = tl.where(ok, tl.where(x > 0, x + 1.0, tl.exp(x)), 0.0)
    elif MAP == RELU:
        x = tl.maximum(x, 0.0)
    return x


@triton.jit
def _mm(a, b, DT: tl.constexpr, DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``a @ b`` of fp32 tiles on operands rounded to the dot dtype ``DT`` (fp32 accumulation)."""
    if INTERP_BF16:
        c = dot(cast(a, DT, INTERP_BF16), cast(b, DT, INTERP_BF16), DOT_PREC, INTERP_BF16)
    else:
        c = dot(a.to(DT), b.to(DT), DOT_PREC, INTERP_BF16)    # fp32 at TF32: rounded to nearest first
    return c


@triton.jit
def _row_scalars(base, r, L, MODE: tl.constexpr):
    """Per-row scalars of a ``(L,)`` row: MODE 1 ones, 2 loaded; zero outside ``[0, L)``."""
    ok = (r >= 0) & (r < L)
    if MODE == 2:
        x = tl.load(base + r, mask=ok, other=0.0).to(tl.float32)
    else:
        x = tl.where(ok, 1.0, 0.0)
    return x


@triton.jit
def map_kernel(Xp, x_strides, Y, H, L, X2p, x2_strides, Y2, H2, L2, F, BL: tl.constexpr, BF: tl.constexpr,
               MAP: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``Y = phi(X)`` and ``Y2 = phi(X2)`` in one launch (the forward's q and k): one head x ``BL`` rows of
    one of them per program. X ``(B, H, L, F)`` with strides ``x_strides`` = (x_sb, x_sh, x_sl, x_sf), Y
    contiguous ``(B, H, L, F)`` in its dtype (the input's: rounded to nearest, as the passes' dots round
    it); X2 ``(B, H2, L2, F)`` likewise (``H2 = 0``: X alone). The map in fp32 as `_rows` applies it; grid
    (B * (H + H2), cdiv(max(L, L2), BL), cdiv(F, BF)): programs ``B * H`` on are X2's; one tile a
    program, no loop."""
    pid_bh, pid_l, pid_f = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n1 = (tl.num_programs(0) // (H + H2)) * H          # X's programs (B * H)
    second = pid_bh >= n1
    bh = tl.where(second, pid_bh - n1, pid_bh)
    nh = tl.where(second, H2, H)
    rows = tl.where(second, L2, L)
    x_sb, x_sh, x_sl, x_sf = x_strides
    x2_sb, x2_sh, x2_sl, x2_sf = x2_strides
    b, h = bh // nh, bh % nh
    r = pid_l * BL + tl.arange(0, BL)
    cols = pid_f * BF + tl.arange(0, BF)
    x_base = tl.where(second, X2p + b.to(tl.int64) * x2_sb + h.to(tl.int64) * x2_sh,
                      Xp + b.to(tl.int64) * x_sb + h.to(tl.int64) * x_sh)
    x = _rows(x_base, r, rows, tl.where(second, x2_sl, x_sl), cols, F, tl.where(second, x2_sf, x_sf), MAP)
    y_base = tl.where(second, Y2, Y) + bh.to(tl.int64) * rows * F
    tl.store(y_base + r.to(tl.int64)[:, None] * F + cols[None, :], cast(x, Y.dtype.element_ty, INTERP_BF16),
             mask=(r < rows)[:, None] & (cols < F)[None, :])


@triton.jit
def chunk_sum_kernel(Bp, b_strides, b_L, b_shift, b_F, CX, ZS, n_chunks, b_H,
                     CH: tl.constexpr, BZ: tl.constexpr, C_X: tl.constexpr, MAP_B: tl.constexpr):
    """The normalizer's per-chunk increments: ``ZS[bh, c, f] = sum_{t in chunk c} cx_t phi(b)_{t + shift, f}``
    (fp32 ``(B * H, n_chunks, Fb)``; ``cx`` ones with C_X 1, loaded with 2), which `chunk_state_kernel` adds
    up in its chunk order into ``z``. A column reduction of one fp32 tile per program (grid (B * H, n_chunks,
    cdiv(Fb, BZ))): no loop, no dot, the chunks in parallel; ``z`` takes no product in the state loop."""
    b_sb, b_sh, b_sl, b_sf = b_strides
    pid_bh, c, pid_f = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = pid_bh // b_H, pid_bh % b_H
    fb = pid_f * BZ + tl.arange(0, BZ)
    r = c * CH + tl.arange(0, CH) + b_shift
    bt = _rows(Bp + b.to(tl.int64) * b_sb + h.to(tl.int64) * b_sh, r, b_L, b_sl, fb, b_F, b_sf, MAP_B)
    if C_X == 2:
        bt = bt * _row_scalars(CX + pid_bh.to(tl.int64) * b_L, r, b_L, C_X)[:, None]
    zs = ZS + (pid_bh.to(tl.int64) * n_chunks + c) * b_F
    tl.store(zs + fb, tl.sum(bt, 0), mask=fb < b_F)       # (rows outside [0, L) are zero: `_rows`)


@triton.jit
def chunk_state_kernel(
        Bp, b_strides, Cp, c_strides, b_L, b_shift, b_F, c_F, ZS,
        ST, st_strides, STZ, stz_strides, FIN, FINZ, n_chunks, chunks_per_block, b_H,
        CH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, REVERSE: tl.constexpr,
        STORE: tl.constexpr, C_X: tl.constexpr, MAP_B: tl.constexpr, MAP_C: tl.constexpr,
        DT: tl.constexpr, DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr):
    """The chunk-state pass (see the module docstring) of one b/c head x one (Fb, Fc) tile x one range of
    ``chunks_per_block`` chunks (all of them with ``STORE``)."""
    b_sb, b_sh, b_sl, b_sf = b_strides
    c_sb, c_sh, c_sl, c_sf = c_strides
    st_bh, st_c, st_b, st_f = st_strides
    stz_bh, stz_c = stz_strides
    pid_bh, pid_kv, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = pid_bh // b_H, pid_bh % b_H
    fb = (pid_kv // NV) * BK + tl.arange(0, BK)
    fc = (pid_kv % NV) * BV + tl.arange(0, BV)
    b_base = Bp + b.to(tl.int64) * b_sb + h.to(tl.int64) * b_sh
    c_base = Cp + b.to(tl.int64) * c_sb + h.to(tl.int64) * c_sh
    zs_base = ZS + pid_bh.to(tl.int64) * n_chunks * b_F
    z_ok = (fb < b_F) & ((fb * 0 + pid_kv % NV) == 0)   # one program per Fb tile sums and writes z
    state = tl.zeros((BK, BV), dtype=tl.float32)
    z = tl.zeros((BK,), dtype=tl.float32)
    first = pid_s * chunks_per_block
    last = tl.minimum(first + chunks_per_block, n_chunks)
    for i in range(first, last):
        c = (n_chunks - 1 - i) if REVERSE else i
        if STORE:                                     # the state every row of chunk c starts from
            st = ST + pid_bh.to(tl.int64) * st_bh + c.to(tl.int64) * st_c
            tl.store(st + fb[:, None] * st_b + fc[None, :] * st_f, state.to(ST.dtype.element_ty),
                     mask=(fb < b_F)[:, None] & (fc < c_F)[None, :])
            if C_X != 0:
                stz = STZ + pid_bh.to(tl.int64) * stz_bh + c.to(tl.int64) * stz_c
                tl.store(stz + fb, z, mask=z_ok)
        r = c * CH + tl.arange(0, CH) + b_shift
        bt = _rows(b_base, r, b_L, b_sl, fb, b_F, b_sf, MAP_B)            # (CH, BK)
        ct = _rows(c_base, r, b_L, c_sl, fc, c_F, c_sf, MAP_C)            # (CH, BV)
        state += _mm(tl.trans(bt), ct, DT, DOT_PREC, INTERP_BF16)
        if C_X != 0:                                  # chunk c's row sums (chunk_sum_kernel): a vector, no tile
            z += tl.load(zs_base + c.to(tl.int64) * b_F + fb, mask=z_ok, other=0.0)
    fin = FIN + (pid_s * tl.num_programs(0) + pid_bh).to(tl.int64) * b_F * c_F
    tl.store(fin + fb[:, None] * c_F + fc[None, :], state, mask=(fb < b_F)[:, None] & (fc < c_F)[None, :])
    if C_X != 0:
        finz = FINZ + (pid_s * tl.num_programs(0) + pid_bh).to(tl.int64) * b_F
        tl.store(finz + fb, z, mask=z_ok)


@triton.jit
def chunk_out_kernel(
        Ap, a_strides, a_L, a_shift, FA, Ha, GA,
        Bp, b_strides, Cp, c_strides, b_L, b_shift, FC, Hb,
        AX, BX, ST, st_strides, STZ, stz_strides,
        BASE, base_strides, BASEZ, basez_bh, gbase,
        GXp, gx_strides, OUT, o_strides, DEN, eps,
        CH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NB: tl.constexpr, CAUSAL: tl.constexpr,
        REVERSE: tl.constexpr, MAP_A: tl.constexpr, MAP_B: tl.constexpr, MAP_C: tl.constexpr,
        MAP_X: tl.constexpr, A_X: tl.constexpr, B_X: tl.constexpr, HAS_STATE: tl.constexpr,
        STATE_Z: tl.constexpr, Z_MODE: tl.constexpr, HAS_BASE: tl.constexpr, BASE_Z: tl.constexpr,
        WITH_DEN: tl.constexpr, NORMALIZE: tl.constexpr, DT: tl.constexpr, DOT_PREC: tl.constexpr,
        INTERP_BF16: tl.constexpr):
    """One chunk x one Fc tile of one a-head. b/c heads: ``(ha // GA) * NB + j`` for ``j < NB`` (their
    contributions summed: GQA's query heads into a key head's gradient); the state is the b/c head's.
    Z_MODE 1: ``z`` runs over Fb and makes the denominator; 2: over Fc, weighted by ``ax``."""
    a_sb, a_sh, a_sl, a_sf = a_strides
    b_sb, b_sh, b_sl, b_sf = b_strides
    c_sb, c_sh, c_sl, c_sf = c_strides
    st_bh, st_c, st_a, st_f = st_strides
    stz_bh, stz_c = stz_strides
    base_bh, base_a, base_f = base_strides
    gx_sb, gx_sh, gx_sl, gx_sf = gx_strides
    o_b, o_h, o_l, o_f = o_strides
    pid_bh, pid_c, pid_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, ha = pid_bh // Ha, pid_bh % Ha
    t = pid_c * CH + tl.arange(0, CH)
    ra = t + a_shift
    fc = pid_v * BV + tl.arange(0, BV)
    a_base = Ap + b.to(tl.int64) * a_sb + ha.to(tl.int64) * a_sh
    acc = tl.zeros((CH, BV), dtype=tl.float32)
    den = tl.zeros((CH,), dtype=tl.float32)
    if A_X != 0:
        ax = _row_scalars(AX + pid_bh.to(tl.int64) * a_L, ra, a_L, A_X)
    if CAUSAL:
        rb = t + b_shift
        if REVERSE:
            keep = t[None, :] >= t[:, None]
        else:
            keep = t[None, :] <= t[:, None]
    for j in range(NB):
        hb = (ha // GA) * NB + j
        bh_b = b * Hb + hb
        b_base = Bp + b.to(tl.int64) * b_sb + hb.to(tl.int64) * b_sh
        st = ST + bh_b.to(tl.int64) * st_bh + pid_c.to(tl.int64) * st_c
        stz = STZ + bh_b.to(tl.int64) * stz_bh + pid_c.to(tl.int64) * stz_c          # Z_MODE 2's z (Fc)
        if CAUSAL:
            s = tl.zeros((CH, CH), dtype=tl.float32)
        for k0 in range(0, FA, BK):
            fa = k0 + tl.arange(0, BK)
            at = _rows(a_base, ra, a_L, a_sl, fa, FA, a_sf, MAP_A)
            if CAUSAL:
                bt = _rows(b_base, rb, b_L, b_sl, fa, FA, b_sf, MAP_B)
                s += _mm(at, tl.trans(bt), DT, DOT_PREC, INTERP_BF16)
            if HAS_STATE:
                h = tl.load(st + fa[:, None] * st_a + fc[None, :] * st_f,
                            mask=(fa < FA)[:, None] & (fc < FC)[None, :], other=0.0)
                acc += _mm(at, h.to(tl.float32), DT, DOT_PREC, INTERP_BF16)
                if STATE_Z and Z_MODE == 1 and MAP_A != IDENTITY:   # a mapped tile: registers, a row dot here
                    den += tl.sum(at * tl.load(stz + fa, mask=fa < FA, other=0.0)[None, :], 1)
        if HAS_STATE and STATE_Z:
            if Z_MODE == 2:
                acc += ax[:, None] * tl.load(stz + fc, mask=fc < FC, other=0.0)[None, :]
        if CAUSAL:
            if B_X != 0:
                bx = _row_scalars(BX + bh_b.to(tl.int64) * b_L, rb, b_L, B_X)
                s += ax[:, None] * bx[None, :]
            s = tl.where(keep, s, 0.0)
            c_base = Cp + b.to(tl.int64) * c_sb + hb.to(tl.int64) * c_sh
            ct = _rows(c_base, rb, b_L, c_sl, fc, FC, c_sf, MAP_C)
            acc += _mm(s, ct, DT, DOT_PREC, INTERP_BF16)
            if WITH_DEN:
                den += tl.sum(s, 1)
    if HAS_BASE:                                      # a fixed state of the a-head's group (fp32)
        hbase = pid_bh // gbase
        bs = BASE + hbase.to(tl.int64) * base_bh
        for k0 in range(0, FA, BK):
            fa = k0 + tl.arange(0, BK)
            at = _rows(a_base, ra, a_L, a_sl, fa, FA, a_sf, MAP_A)
            h = tl.load(bs + fa[:, None] * base_a + fc[None, :] * base_f,
                        mask=(fa < FA)[:, None] & (fc < FC)[None, :], other=0.0)
            acc += _mm(at, h, DT, DOT_PREC, INTERP_BF16)
            if BASE_Z and Z_MODE == 1 and MAP_A != IDENTITY:
                den += tl.sum(at * tl.load(BASEZ + hbase.to(tl.int64) * basez_bh + fa, mask=fa < FA, other=0.0)[None, :],
                              1)
        if BASE_Z:
            if Z_MODE == 2:
                zc = tl.load(BASEZ + hbase.to(tl.int64) * basez_bh + fc, mask=fc < FC, other=0.0)
                acc += ax[:, None] * zc[None, :]
    if Z_MODE == 1 and MAP_A == IDENTITY and ((HAS_STATE and STATE_Z) or (HAS_BASE and BASE_Z)):
        # a tile fed to the dots as loaded (no map between): the denominator's state terms a_t . (z_c + z_base) as
        # fp32 row dots in a loop of their own, after the products, on a second plain (unpipelined:
        # num_stages=1) load of the a tiles, so no pipelined shared-memory tile that a dot reads is also reduced
        # (`tools.triton.linear_kernel_resources.shared_tile_reductions`). A mapped tile is in registers: its
        # row dots run in the product loops above
        dz = tl.zeros((CH, BK), dtype=tl.float32)     # the row dots' partial sums, reduced once after the loop
        for kz in tl.range(0, FA, BK, num_stages=1):
            fa = kz + tl.arange(0, BK)
            zf = tl.zeros((BK,), dtype=tl.float32)
            if HAS_STATE and STATE_Z:
                for jz in tl.static_range(NB):            # names of their own: no loop-carried values
                    bhz = b * Hb + (ha // GA) * NB + jz
                    zf += tl.load(STZ + bhz.to(tl.int64) * stz_bh + pid_c.to(tl.int64) * stz_c + fa, mask=fa < FA,
                                  other=0.0)
            if HAS_BASE and BASE_Z:
                zf += tl.load(BASEZ + (pid_bh // gbase).to(tl.int64) * basez_bh + fa, mask=fa < FA, other=0.0)
            a2 = _rows(a_base, ra, a_L, a_sl, fa, FA, a_sf, MAP_A)
            dz += a2 * zf[None, :]
        den += tl.sum(dz, 1)
    ok_a = (ra >= 0) & (ra < a_L)
    if NORMALIZE:
        den = den + eps
        acc = acc / tl.where(den == 0.0, 1.0, den)[:, None]
        acc = tl.where((den == 0.0)[:, None], 0.0, acc)      # a query that sees nothing outputs 0
    if WITH_DEN:
        tl.store(DEN + pid_bh.to(tl.int64) * a_L + ra, den, mask=ok_a & ((ra * 0 + pid_v) == 0))
    ok = ok_a[:, None] & (fc < FC)[None, :]
    if MAP_X != IDENTITY:                             # the chain rule through the feature map
        x_base = GXp + b.to(tl.int64) * gx_sb + ha.to(tl.int64) * gx_sh
        x = tl.load(x_base + ra.to(tl.int64)[:, None] * gx_sl + fc[None, :] * gx_sf, mask=ok, other=0.0)
        x = x.to(tl.float32)
        if MAP_X == ELU:
            acc = acc * tl.where(x > 0, 1.0, tl.exp(x))
        else:
            acc = acc * tl.where(x > 0, 1.0, 0.0)
    o_base = OUT + b.to(tl.int64) * o_b + ha.to(tl.int64) * o_h
    tl.store(o_base + ra.to(tl.int64)[:, None] * o_l + fc[None, :] * o_f,
             cast(acc, OUT.dtype.element_ty, INTERP_BF16), mask=ok)


@triton.jit
def step_kernel(Q, K, V, S, Z, S_OUT, Z_OUT, OUT, q_bh, k_bh, v_bh, o_bh, H, G, F, Dv, eps,
                BF: tl.constexpr, BV: tl.constexpr, MAP: tl.constexpr, NORMALIZE: tl.constexpr,
                INTERP_BF16: tl.constexpr):
    """One decoding step of one query head: ``S += phi(k)^T v``, ``z += phi(k)``,
    ``out = phi(q) S / (phi(q) . z + eps)``; OUT(F x Dv). States fp32 ``(B*H, F, Dv)``, ``(B*H, F)``;
    q/k/v one row each (``(B*H or B*Hkv, D)`` with row strides)."""
    pid, pid_v = tl.program_id(0), tl.program_id(1)
    hk = (pid // H) * (H // G) + (pid % H) // G
    fv = pid_v * BV + tl.arange(0, BV)
    vv = tl.load(V + hk.to(tl.int64) * v_bh + fv, mask=fv < Dv, other=0.0).to(tl.float32)
    num = tl.zeros((BV,), dtype=tl.float32)
    den = tl.zeros((1,), dtype=tl.float32)
    s_base = pid.to(tl.int64) * F * Dv
    zero = tl.zeros((1,), dtype=tl.int32)
    for f0 in range(0, F, BF):
        ff = f0 + tl.arange(0, BF)
        fm = ff < F
        fq = _rows(Q + pid.to(tl.int64) * q_bh, zero, 1, 0, ff, F, 1, MAP)          # (1, BF)
        fk = _rows(K + hk.to(tl.int64) * k_bh, zero, 1, 0, ff, F, 1, MAP)
        m2 = fm[:, None] & (fv < Dv)[None, :]
        s = tl.load(S + s_base + ff[:, None] * Dv + fv[None, :], mask=m2, other=0.0) + tl.trans(fk) * vv[None, :]
        tl.store(S_OUT + s_base + ff[:, None] * Dv + fv[None, :], s, mask=m2)
        num += tl.sum(tl.trans(fq) * s, 0)
        z = tl.load(Z + pid.to(tl.int64) * F + ff[None, :], mask=fm[None, :], other=0.0) + fk      # (1, BF)
        tl.store(Z_OUT + pid.to(tl.int64) * F + ff[None, :], z, mask=fm[None, :] & ((ff[None, :] * 0 + pid_v) == 0))
        den += tl.sum(fq * z, 1)
    if NORMALIZE:
        d = den + eps
        num = tl.where(d == 0.0, 0.0, num / tl.where(d == 0.0, 1.0, d))
    tl.store(OUT + pid.to(tl.int64) * o_bh + fv, cast(num, OUT.dtype.element_ty, INTERP_BF16), mask=fv < Dv)
