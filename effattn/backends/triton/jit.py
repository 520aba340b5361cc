"""Jit helpers shared by the Triton kernels (softmax attention, linear attention).

``INTERP_BF16`` is set under Triton's interpreter with bf16 inputs, where the interpreter's bf16 dot
and fp32 -> bf16 cast differ from the GPU's: `dot` and `cast` then work around them. It is a
constexpr, off (compiled away) on the GPU.
"""
import triton
import triton.language as tl

# Kernel arguments whose values change with the sequence lengths but whose value hints buy nothing.
# Triton specializes an int argument on its value unless told not to (1 becomes a constant, a
# multiple of 16 gets a divisibility hint), so a new length can select another compile although
# the call is of the same kind: the layout's blocks per row (``lay_nkb`` = ceil(Lk / block)), the
# layout lists' strides and widths, the heads per L2 group. Without their hints the sm_90 SASS is
# the same (offline compiles, triton 3.9), so a kernel lists those it takes in
# ``do_not_specialize``. ``Lq``, ``Lk`` and ``off`` (= Lk - Lq) keep theirs: they bound the masks of
# the partial tiles, whose loop is 46 instructions shorter with them (D = 128 causal forward: 519
# against 565), and they select at most two compiles each (a multiple of 16 or not), never one per
# length. ``python -m tools.triton.specializations`` counts the compiles a range of lengths selects.
UNSPECIALIZED_ARGS = ["list_wf", "heads_per_group", "lay_nkb", "list_h", "list_t"]
# the same for the one-launch backward, whose two kinds of programs have their own lists (``listk_*`` by
# key tile, as C++'s lists_by_key; ``list_*`` by query tile) and L2 head groups (``group1``, ``group2``)
UNSPECIALIZED_BWD_ARGS = ["lay_nkb", "group1", "group2", "listk_wf", "list_wf", "listk_h", "listk_t", "list_h",
                          "list_t"]


@triton.jit
def round_tf32(x):
    """fp32 ``x`` rounded to the nearest TF32 value (10 mantissa bits; ties away from zero), still
    fp32. Given fp32 operands at TF32 precision, the tensor cores drop the low 13 mantissa bits: a
    truncation, biased toward zero. cuBLAS rounds to nearest, so a TF32 matmul in torch errs at
    random while Triton's ``tl.dot`` errs one way; in attention the probabilities (all positive)
    then come out about 2^-11 too small on average and the whole output shrinks by that much.
    Rounding first makes the hardware's truncation exact. Inf and NaN pass unchanged."""
    i = x.to(tl.int32, bitcast=True)
    r = (i + 0x1000) & -8192
    return tl.where((i & 0x7F800000) == 0x7F800000, i, r).to(tl.float32, bitcast=True)


@triton.jit
def dot(a, b, DOT_PREC: tl.constexpr, INTERP_BF16: tl.constexpr):
    # INTERP_BF16: Triton's interpreter computes bf16 dots wrongly; fp32 operands are exact there
    if INTERP_BF16:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PREC)
    elif DOT_PREC == "tf32":                 # fp32 operands: round to nearest, not truncate (round_tf32)
        c = tl.dot(round_tf32(a), round_tf32(b), input_precision=DOT_PREC)
    else:
        c = tl.dot(a, b, input_precision=DOT_PREC)
    return c

@triton.jit
def cast(x, dtype, INTERP_BF16: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest even. INTERP_BF16 (bf16 under the interpreter): Triton's
    interpreter truncates fp32 -> bf16 (a biased error, unlike the GPU), so round the fp32 bits
    to the nearest bf16 first; the truncation is then exact."""
    if INTERP_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)

@triton.jit
def i64(x, IDX64: tl.constexpr):
    """`x` as int64 when the kernel was compiled for int64 offsets (see "Index arithmetic")."""
    if IDX64:
        x = x.to(tl.int64)
    return x

@triton.jit
def load_tile(ptrs, rows, n_rows, cols, n_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A 2-D tile, zero outside ``rows < n_rows`` / ``cols < n_cols`` where asked to check."""
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            x = tl.load(ptrs)
    return x
