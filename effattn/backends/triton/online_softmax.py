"""Triton helpers shared by the kernels of the ``lsh``, ``paged`` and ``relative`` folders:
FlashAttention-2's online softmax (Dao 2023, Alg. 1) and the key range a window
leaves to a block of query rows."""
import triton
import triton.language as tl


@triton.jit
def key_range(first_pos, last_pos, n_keys, left, right, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr):
    """Keys ``[lo, hi)`` that rows at positions ``first_pos .. last_pos`` may see under the window
    (``lo`` rounded down to a tile); ``hi <= lo`` when none."""
    lo = 0
    hi = n_keys
    if HAS_LEFT:
        lo = tl.maximum(first_pos - left, 0) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(last_pos + right + 1, n_keys)
    return lo, hi


@triton.jit
def online_step(m_i, l_i, s):
    """One tile of scores ``s`` (-inf = invisible): ``(p, alpha, m_new, l_new)`` with ``p = exp(s - m_new)``
    and the factor ``alpha`` that rescales what was accumulated; rows that have seen nothing keep
    ``m = -inf`` and shift by 0 instead (no NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_ref[:, None])
    alpha = tl.exp(m_i - m_ref)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def finish(acc, m_i, l_i):
    """``(out, lse)`` of the accumulated rows: 0 and -inf for a row that saw no key."""
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    return out, lse
