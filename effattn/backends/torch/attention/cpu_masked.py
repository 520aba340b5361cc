"""The torch backend's path ``torch/cpu-sdpa-mask``: torch's fused flash-attention CPU kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, SDPA's CPU kernel) given the call's visibility
as a materialized additive mask, for the windows, block layouts, key padding and bottom-right causal
calls that ``torch/cpu-flash`` does not take. The kernel reads every (query, key) pair, visible or
not, so it wins only where the blocks path's gathers cost more than the pairs it skips: short
sequences, or a large visible fraction. `ADMIT` is that rule, measured on the CPU (see `_rule`).

What the kernel does not give exactly is fixed around it:

- a row that sees no key: the kernel writes output 0 and log-sum-exp 0; effattn's lse there is
  -inf (the kernel's 0 is what its own backward needs, so the backward maps -inf back to 0);
- keys no query sees (padding, outside every window, in no visible layout block): the forward reads
  K and V as they are and checks its output (one reduction): a NaN / inf there reaches a row only as
  a non-finite output, and then the forward runs again with their K and V rows zeroed (copies), so
  it cannot reach a row as 0 * NaN; a backward reads them as they are when every entry and score is
  finite (`masked_keys_harmless`: three reductions before the kernel; a masked score is then -inf,
  its probability exactly 0, its keys' gradients 0), else the zeroed copies;
- an lse gradient: the kernel's backward has none; the blocks path's backward takes it (and every
  float16 backward: the kernel's is slow there; and huge scores, see `kernel_backward_exact`).

The mask of a rule (window, layout) is built once and cached; key padding is added per call.
"""
from __future__ import annotations

import math
import os
import weakref
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from ...._call import needs_grad
from ....numerics import compute_dtype
from ....visibility import Rule
from ...autograd import direct
from ...base import Capabilities, Path, reads_state, register, switches
from .cpu_blocks import CPU_DTYPES, blocks_backward, cpu_reasons, masked_op_pair
from .cpu_flash import _FLASH_BWD, _FLASH_FN, kernel_backward_exact, unit_stride
from .cpu_flash import FEATURES as _FLASH_FEATURES

FEATURES = frozenset({"window", "layout", "key_padding_mask"}) | _FLASH_FEATURES

# ------------------------------------------------------------------------------ the speed rule
# The masked kernel's time grows with Lq * Lk whatever the mask; the blocks path's with the visible
# pairs, plus a cost per group of query blocks that dominates short calls. Measured with
# `python3 -m benchmarks.cpu_sdpa_mask` (benchmarks/results/cpu/cpu_sdpa_mask.md: machine, load,
# commands, tables), B=1, H=8, one thread, masked / blocks time of the forward (fwd+bwd):
#   float32, D=64:
#     L = 256:  window 64 (visible 0.22) 0.77 (0.56), window 256 (0.50) 0.41 (0.42)
#     L = 512:  window 64 (0.12) 0.82 (1.29), window 256 (0.38) 0.47 (0.66)
#     L = 1024: window 256 (0.22) 1.17 (1.16), fixed layout (0.34) 0.88 (0.77)
#     L = 2048: fixed layout (0.20) 1.84 (1.76), padding 1/4 (0.75) 0.33 (0.36)
#   float64, D=64: L = 1024: window 256 (0.22) 1.47 (1.70), fixed layout (0.34) 1.04 (1.15)
#   float32, D=128:
#     L = 1024: fixed layout (0.34) 1.19 (1.08), window 512 (0.38) 0.57 (0.74)
#     L = 2048: window 512 (0.22) 1.35 (1.57)
#   bfloat16, D=64 (the blocks path computes half types in float32):
#     L = 1024: window 256 (0.22) 0.94 (0.71), fixed layout (0.34) 0.83 (0.60)
#     L = 2048: fixed layout (0.20) 2.01 (1.19)
#   float16, D=64: the kernel's float16 backward is 4-16x slower than the blocks path's whole
#   forward+backward (L = 1024 window 256: 3277 ms against 454), so float16 gradients are computed by
#   the blocks path's backward (`BLOCKS_BACKWARD`); the forward alone:
#     L = 1024: window 256 (0.22) 1.42, fixed layout (0.34) 1.37, causal + padding 1/4 (0.38) 0.67
#     L = 2048: window 256 (0.12) 2.07
# Again on 2026-11-27 from L = 256 to 4096 at 1 and 2 threads (the same file, first section): the rule
# picks the faster row on 48 of 54 calls, the other six are close calls that trade places between
# repeats; the order at 2 threads is that at 1, so the rule does not read the thread count.
# Where a point is close the rule leans to the masked kernel: it is what SDPA runs, so choosing it
# is never slower than SDPA. Up to 1024 x 1024 pairs the blocks path's fixed costs weigh more, so the
# fraction needed there is lower (L = 1024, window 256, 0.22: the masked kernel, as fast as the blocks
# path in float32 and faster in bfloat16; L = 2048, window 512, 0.22: the blocks path, 1.3-1.5x faster).


class Admit(NamedTuple):
    small_pairs: int            # Lq * Lk up to which the masked kernel is faster at any visible fraction
    mid_pairs: int              # Lq * Lk up to which `min_fraction_mid` applies, `min_fraction` above
    min_fraction_mid: dict      # dtype -> the visible fraction from which the masked kernel is faster
    min_fraction: dict
    min_fraction_wide: float    # the same for head dims above 64 (the larger of the two applies)


ADMIT = Admit(small_pairs=256 * 256, mid_pairs=1024 * 1024,
              min_fraction_mid={torch.float32: 0.2, torch.bfloat16: 0.2, torch.float64: 0.3, torch.float16: 0.36},
              min_fraction={torch.float32: 0.3, torch.bfloat16: 0.3, torch.float64: 0.3, torch.float16: 0.36},
              min_fraction_wide=0.36)


def min_fraction(dtype: torch.dtype, head_dim: int, pairs: int) -> float:
    """The visible fraction from which the masked kernel is faster, past ``ADMIT.small_pairs``."""
    f = (ADMIT.min_fraction_mid if pairs <= ADMIT.mid_pairs else ADMIT.min_fraction)[dtype]
    return max(f, ADMIT.min_fraction_wide) if head_dim > 64 else f


# The mask is materialized: its entries (batch entries with key padding, heads with a per-head layout,
# times Lq * Lk) are bounded so that the torch backend's memory stays O(L) in practice: 2**24 entries
# (64 MiB in float32) is 4096 x 4096 for one mask.
MASK_BUDGET = 1 << 24
BLOCKS_BACKWARD = frozenset({torch.float16})   # dtypes whose gradients the blocks path's backward computes


# Set to False to leave every call to the other CPU paths (tests compare the paths).
ENABLED = True

# torch's kernel runs on OpenMP threads, which a forked child cannot use (GNU OpenMP: the child hangs
# in its first parallel region when the parent had started them); the blocks path's slice pool is
# rebuilt in a child. So in a forked child with more than one thread the blocks path takes the call.
_FORKED = [False]


def _after_fork_in_child() -> None:
    if not _FORKED[0]:
        _FORKED[0] = True
        reads_state(lambda: torch.get_num_threads() > 1)      # what `_admits` now reads (dispatch plans key on it)


os.register_at_fork(after_in_child=_after_fork_in_child)

# the switches `_admits` reads (setting one makes dispatch plans afresh)
switches(__name__, "ENABLED", "ADMIT", "MASK_BUDGET", "COMPACT")


def visible_fraction(call) -> float:
    """The call's visible (query, key) pairs over Lq * Lk: the rule's exact count times the share of
    keys that are not padding (a product, exact when no window or layout also cuts)."""
    r = call.rule
    key = ("fraction", r.Lq, r.Lk, r.left, r.right, r.layout_block, call.H)
    cache = _RULE_MASKS if r.layout_mask is None else _LAYOUT_MASKS.setdefault(r.layout_mask, {})
    frac = cache.get(key)
    if frac is None:                      # counted once per rule and kept, as the rule's masks
        frac = cache[key] = r.visible_pairs(call.H) / (call.H * call.Lq * call.Lk)
    kpm = call.key_padding_mask
    if kpm is not None:
        frac *= 1.0 - _padding_share(kpm)
    return frac


def _padding_share(kpm: Tensor) -> float:
    """The share of padding entries in ``kpm`` (counted once per tensor and version, `_last_padding`)."""
    return _last_padding(kpm, "share", lambda: kpm.sum().item() / kpm.numel(), _LAST_SHARE)


def read_keys(call) -> int:
    """The keys the masked kernel reads per query row: Lk, or the most any batch entry keeps when
    its key padding is skipped (`_compacts`)."""
    kpm = call.key_padding_mask
    if kpm is None:
        return call.Lk
    n = _kept_keys(kpm)
    return n if _compacts(call.Lq, call.Lk, n) else call.Lk


def mask_entries(call) -> int:
    """The entries of the call's materialized mask (`_masks`): Lq * the keys read (`read_keys`), per
    batch entry with key padding and per head with a per-head layout; key padding alone is a
    (B, 1, 1, keys) mask (none when skipped: a compacted call reads no padding)."""
    lay = call.layout.mask if call.layout is not None else None
    rows = call.Lq if call.rule.has_window or lay is not None else 1
    return rows * read_keys(call) * (call.B if call.key_padding_mask is not None else 1) * \
        (lay.shape[0] if lay is not None else 1)


def _rule(call) -> List[str]:
    """[] when the masked kernel is measured faster than the blocks path for this call, else why not.
    Its time follows the pairs it reads (Lq * `read_keys`), the blocks path's the visible ones."""
    pairs = call.Lq * read_keys(call)
    entries = mask_entries(call)
    if entries > MASK_BUDGET:
        return [f"the mask would hold {entries} entries > {MASK_BUDGET} (memory)"]
    if pairs <= ADMIT.small_pairs:
        return []
    frac, fmin = _read_fraction(call), min_fraction(call.q.dtype, call.D, pairs)
    if frac < fmin:
        return [f"{_pairs_name(call)} = {pairs} > {ADMIT.small_pairs} with visible fraction {frac:.3f} < {fmin} "
                f"(measured: the blocks path is faster there)"]
    return []


def _pairs_name(call) -> str:
    return "Lq * Lk" if read_keys(call) == call.Lk else "Lq * keys read"


def _read_fraction(call) -> float:
    """The visible share of the pairs the masked kernel reads."""
    return visible_fraction(call) * call.Lk / read_keys(call)


def _admits(call) -> List[str]:
    why = cpu_reasons(call)
    if not why and not ENABLED:
        why.append("turned off (cpu_masked.ENABLED is False)")
    if not why and _FORKED[0] and torch.get_num_threads() > 1:
        why.append("in a forked process with more than one thread (torch's OpenMP kernel can hang there)")
    if not why:
        why.extend(_rule(call))
    return why


def _describe(call) -> str:
    pairs = call.Lq * read_keys(call)
    why = (f"{_pairs_name(call)} = {pairs} <= {ADMIT.small_pairs}" if pairs <= ADMIT.small_pairs else
           f"visible fraction {_read_fraction(call):.3f} >= {min_fraction(call.q.dtype, call.D, pairs)}")
    entries = mask_entries(call)
    size = entries * call.q.element_size()
    n = read_keys(call)
    skipped = (f"key padding skipped: K and V gathered at the {n} of {call.Lk} keys a batch entry keeps at most; "
               if n < call.Lk else "")
    return (f"torch's fused flash-attention CPU kernel, {skipped}mask materialized ({'at most ' * (n < call.Lk)}{entries} entries, "
            f"{size / 2 ** 20:.1f} MiB; at most {MASK_BUDGET}); {why}: measured faster than the blocks path; "
            f"K and V read in place when they and the scores are finite (the forward checks its output, a backward "
            f"min/max of q, k, v), else copied with the keys no query sees zeroed")


# ------------------------------------------------------------------------------------ the masks

class _Mask(NamedTuple):
    add: Optional[Tensor]     # additive mask (1 or B, 1 or H, Lq, Lk) in q's dtype (0 / -inf), or None
    empty: Optional[Tensor]   # bool (1 or B, 1 or H, Lq): rows that see no key, or None when none
    unseen: Optional[Tensor]  # bool (1 or B, 1 or Hkv, Lk, 1): keys no query sees, or None when none
    # key padding skipped (`_compacts`): the keys the kernel reads, int64 (n,) when every batch entry
    # keeps the same ones, else (B, n), each entry's kept keys first in order; the masks above are
    # then over those n slots. None: every key is read
    keys: Optional[Tensor] = None
    fill: Optional[Tensor] = None   # bool (B, 1, n, 1): slots past a batch entry's kept keys (K, V zeroed there)


_RULE_MASKS: dict = {}                          # (Lq, Lk, wl, wr, bs, H, Hkv, dtype) -> _Mask; and fractions
_LAYOUT_MASKS = WeakTensorKeyDictionary()       # layout mask -> {the same key: _Mask}


def _build(vis: Optional[Tensor], H: int, Hkv: int, dtype: torch.dtype) -> _Mask:
    """The kernel's mask and the rows / keys to fix, from the bool mask ``vis`` (True = visible)."""
    if vis is None:
        return _Mask(None, None, None)
    add = torch.zeros(vis.shape, dtype=dtype).masked_fill_(~vis, -math.inf)
    empty = ~vis.any(-1)
    seen = vis.any(-2)                                               # (1 or B, 1 or H, Lk)
    if seen.shape[1] == H and H != Hkv:                              # a per-head layout, GQA
        seen = seen.view(seen.shape[0], Hkv, H // Hkv, -1).any(2)
    return _Mask(add, empty if bool(empty.any()) else None, None if bool(seen.all()) else ~seen[..., None])


def _masks(q, k, layout_mask, layout_block, kpm, wl, wr) -> _Mask:
    """The call's masks: the rule's built once per shape and kept (key padding, per call, added)."""
    Lq, Lk, H, Hkv = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    key = (Lq, Lk, wl, wr, layout_block, H, Hkv, q.dtype)
    if kpm is not None:                  # the last key padding's masks are kept (one call's: memory)
        return _last_padding(kpm, key, lambda: _padded(Rule(Lq, Lk, wl, wr, layout_mask, layout_block), kpm,
                                                       H, Hkv, q.dtype))
    if layout_mask is None:
        return _kept(_RULE_MASKS, key, None, H, Hkv)
    # a layout's: the last layout's first (the weak per-layout dictionary costs Python frames)
    return _last_padding(layout_mask, key, lambda: _kept(_LAYOUT_MASKS.setdefault(layout_mask, {}), key, layout_mask,
                                                         H, Hkv), _LAST_LAYOUT)


def _kept(cache: dict, key, layout_mask: Optional[Tensor], H: int, Hkv: int) -> _Mask:
    """The masks of the rule ``key`` (and ``layout_mask``) from ``cache``, built and kept on a miss."""
    m = cache.get(key)
    if m is None:
        Lq, Lk, wl, wr, bs, _, _, dtype = key
        vis = Rule(Lq, Lk, wl, wr, layout_mask, bs).materialize(device="cpu")
        if len(cache) > 32:
            cache.clear()
        m = cache[key] = _build(vis, H, Hkv, dtype)
    return m


def _padded(rule: Rule, kpm: Tensor, H: int, Hkv: int, dtype: torch.dtype) -> _Mask:
    vis = rule.materialize(device="cpu")
    n = _kept_keys(kpm)
    if not _compacts(rule.Lq, rule.Lk, n):
        keep = ~kpm[:, None, None, :]
        return _build(keep if vis is None else vis & keep, H, Hkv, dtype)
    # the kernel reads each batch entry's kept keys only, n slots (the most any entry keeps)
    B = kpm.shape[0]
    order = torch.sort(kpm.to(torch.uint8), dim=1, stable=True).indices[:, :n]     # kept keys first, in order
    slot = ~kpm.gather(1, order)                                 # (B, n): False past an entry's kept keys
    keys = order[0] if bool((order == order[:1]).all()) else order
    fill = None if bool(slot.all()) else ~slot[:, None, :, None]
    vis_c = slot[:, None, None, :]
    if vis is not None:                                          # the rule at the kept keys' positions
        vis = vis.expand(B, *vis.shape[1:])
        vis_c = vis_c & vis.gather(3, order[:, None, None, :].expand(*vis.shape[:3], n))
    if vis is None and fill is None:                             # nothing masked among the slots
        return _Mask(None, None, None, keys, None)
    m = _build(vis_c, H, Hkv, dtype)
    unseen = m.unseen
    if unseen is not None and fill is not None:                  # the slots past the keys are zeroed: harmless
        unseen = unseen & ~fill
        unseen = unseen if bool(unseen.any()) else None
    return m._replace(unseen=unseen, keys=keys, fill=fill)


def _compacts(Lq: int, Lk: int, n: int) -> bool:
    """Whether a key padding call reads only the n keys its batch entries keep (at most; copies of K
    and V gathered there, their gradients spread back) rather than all Lk under a mask: when the
    pairs it skips, ``(Lk - n) * Lq``, reach ``COMPACT.pairs_per_key`` per key. Measured on the CPU
    (``python3 -m benchmarks.cpu_sdpa_mask --compact``, benchmarks/results/cpu/cpu_sdpa_mask.md): the
    copies and their fixed cost (~40 us) are paid back from about 8-16 skipped pairs per key (B = 1,
    H = 8, D = 64, one thread; skipping 16 of 256 keys with 256 queries: 0.94x the time, 64 of 256:
    0.82x; 64 of 256 with 8 queries: 1.29x; a single query: 1.8-3.3x). Not when no entry keeps a key
    (n = 0: the kernel takes no empty key range; the mask gives those rows 0)."""
    return (Lk - n) * Lq >= COMPACT.pairs_per_key * Lk and 0 < n < Lk


class Compact(NamedTuple):
    pairs_per_key: int          # skipped (query, key) pairs per key of Lk from which padding is skipped


COMPACT = Compact(pairs_per_key=16)


def _kept_keys(kpm: Tensor) -> int:
    """The most keys any batch entry keeps (counted once per tensor and version, `_last_padding`)."""
    return _last_padding(kpm, "kept", lambda: int((~kpm).sum(1).max()) if kpm.shape[0] else 0, _LAST_KEPT)


def _compact(x: Tensor, m: _Mask) -> Tensor:
    """K or V at the slots the kernel reads (`_Mask.keys`), zero past a batch entry's kept keys."""
    if m.keys is None:
        return x
    if m.keys.dim() == 1:
        y = x.index_select(2, m.keys)
    else:
        y = x.gather(2, m.keys[:, None, :, None].expand(x.shape[0], x.shape[1], m.keys.shape[1], x.shape[3]))
    return y if m.fill is None else y.masked_fill(m.fill, 0.0)


def _spread(grad: Tensor, x: Tensor, m: _Mask) -> Tensor:
    """The gradient of `_compact`'s K or V on all of x's keys: 0 at the keys not read (a slot past a
    batch entry's keys has probability 0 everywhere, so its gradient is 0 as well)."""
    if m.keys is None:
        return grad
    out = grad.new_zeros(x.shape)
    if m.keys.dim() == 1:
        return out.index_copy_(2, m.keys, grad)
    return out.scatter_(2, m.keys[:, None, :, None].expand(grad.shape), grad)


# one entry each, (weak reference to the key padding tensor, (key, its version), value): replaced whole,
# so a thread reading it sees one call's entry
_LAST_PADDING: list = [None]
_LAST_SHARE: list = [None]
_LAST_LAYOUT: list = [None]          # (the same for a layout mask without key padding: `_masks`)
_LAST_KEPT: list = [None]


def _last_padding(kpm: Tensor, key, build, slot: list = _LAST_PADDING):
    """``build()``, or what it gave on the last call for the same key padding tensor (unchanged
    since: same version) and the same ``key``; one entry per slot, so the memory kept is one call's."""
    entry, full = slot[0], (key, kpm._version)
    if entry is not None and entry[0]() is kpm and entry[1] == full:
        return entry[2]
    value = build()
    slot[0] = (weakref.ref(kpm), full, value)
    return value


def _seen_only(x: Tensor, unseen: Optional[Tensor]) -> Tensor:
    """K or V with zero rows at the keys no query sees (whatever they held: NaN, inf)."""
    return x if unseen is None else x.masked_fill(unseen, 0.0)


def masked_keys_harmless(q: Tensor, k: Tensor, v: Tensor, scale: float) -> bool:
    """Whether the kernel may read K and V as they are at the keys no query sees: every entry of k and
    v finite and every score ``q . k * scale`` finite, so a masked score is ``finite + (-inf) = -inf``
    and its probability exactly 0 (no ``inf - inf`` or ``0 * inf``). One pass per tensor, in place of
    copying K and V with those rows zeroed (two full copies): the Frobenius norms of q, k and v in one
    op (``_foreach_norm``, accumulated in float32, float64 for float64 inputs), finite only when every
    entry is; by Cauchy-Schwarz every score is at most ``|q|_F |k|_F |scale|``, and so is every partial
    sum of the kernel's dot products. A norm that overflows on finite entries only sends the call to the
    copies. The earlier six reductions (``amax`` and ``amin`` of each) read twice as much, and after a
    kernel of a few milliseconds each dispatched op costs 5-15 us of cold host code: measured right after
    a 5 ms forward+backward (L = 256), 91-98 us for those and a stack, about 60 us for this. Each forward+backward of a key padding call runs this once. False
    sends the call to the copies (`_seen_only`)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # on `.data`: on inputs that require grad each op would record an autograd node saving them
    n = torch._foreach_norm([q.data, k.data, v.data], 2, dtype=None if q.dtype == acc else acc)
    qn, kn, vn = n[0].item(), n[1].item(), n[2].item()
    if not (math.isfinite(qn) and math.isfinite(kn) and math.isfinite(vn)):
        return False
    return qn * kn * abs(scale) < _SCORE_BOUND[acc]


# the largest |q . k * scale| `masked_keys_harmless` admits, per accumulation dtype (a margin of 4 for
# the kernel's rounding)
_SCORE_BOUND = {t: torch.finfo(t).max / 4 for t in (torch.float32, torch.float64)}


# ---------------------------------------------------------------------------------- custom ops

def sdpa_mask_forward(q: Tensor, k: Tensor, v: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                      key_padding_mask: Optional[Tensor], scale: float, window_left: int,
                      window_right: int) -> Tuple[Tensor, Tensor]:
    return _forward(q, k, v, _masks(q, k, layout_mask, layout_block, key_padding_mask, window_left, window_right),
                    scale)


def _forward(q: Tensor, k: Tensor, v: Tensor, m: _Mask, scale: float) -> Tuple[Tensor, Tensor]:
    """`sdpa_mask_forward` given the call's masks."""
    q, k, v = unit_stride(q, _compact(k, m), _compact(v, m))
    out, lse = _FLASH_FN(q, k, v, 0.0, False, attn_mask=m.add, scale=scale)
    if m.unseen is not None and not math.isfinite(float(out.sum())):
        # K and V read as they are: a NaN / inf at a key no query sees (or a score overflowing next to
        # one) reaches a row only as a NaN / inf output, so a finite output is exact (those keys' weights
        # were exactly 0) and one sum of the output checks it (isfinite(out).all() is four passes and
        # cost 5% of the kernel's time at L = 1024; a sum overflowing a finite output only costs the
        # rerun below); else again on zeroed copies, which
        # gives what the call's visible keys give (`masked_keys_harmless` decides before the run where a
        # backward reads the same K and V)
        k, v = _seen_only(k, m.unseen), _seen_only(v, m.unseen)
        out, lse = _FLASH_FN(q, k, v, 0.0, False, attn_mask=m.add, scale=scale)
    if m.empty is not None:                  # the kernel's lse there is 0; effattn's -inf
        lse = lse.masked_fill(m.empty.expand(lse.shape), -math.inf)
    return out, lse.contiguous()


cpu_sdpa_mask_fwd = torch.library.custom_op("effattn::cpu_sdpa_mask_fwd", mutates_args=())(sdpa_mask_forward)


@cpu_sdpa_mask_fwd.register_fake
def _(q, k, v, layout_mask, layout_block, key_padding_mask, scale, window_left, window_right):
    B, H, Lq, _ = q.shape
    return q.new_empty(B, Lq, H, v.shape[-1]).transpose(1, 2), q.new_empty(B, H, Lq, dtype=compute_dtype(q.dtype))


def sdpa_mask_backward(grad_out: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       lse: Tensor, layout_mask: Optional[Tensor], layout_block: int,
                       key_padding_mask: Optional[Tensor], scale: float, window_left: int,
                       window_right: int) -> Tuple[Tensor, Tensor, Tensor]:
    if (grad_lse is not None and bool(grad_lse.any())) or q.dtype in BLOCKS_BACKWARD or \
            not kernel_backward_exact(lse):
        # the kernel's backward has no lse gradient input (is slow in float16, and inexact for huge
        # scores); the blocks path's computes the same gradients from the same out and lse
        return blocks_backward(grad_out, grad_lse, q, k, v, out, lse, layout_mask, layout_block, key_padding_mask,
                               scale, window_left, window_right)
    m = _masks(q, k, layout_mask, layout_block, key_padding_mask, window_left, window_right)
    if m.empty is not None:
        lse = lse.masked_fill(torch.isinf(lse), 0.0)     # the kernel's own lse of rows seeing no key
    grad_out, q, kk, vv, out = unit_stride(grad_out, q, _compact(k, m), _compact(v, m), out)
    if m.unseen is not None and not masked_keys_harmless(q, kk, vv, scale):
        kk, vv = _seen_only(kk, m.unseen), _seen_only(vv, m.unseen)
    # the keys no query sees get gradient 0 either way: their probabilities are exactly 0
    dq, dk, dv = _FLASH_BWD(grad_out, q, kk, vv, out, lse, 0.0, False, attn_mask=m.add, scale=scale)
    return dq, _spread(dk, k, m), _spread(dv, v, m)


cpu_sdpa_mask_bwd = torch.library.custom_op("effattn::cpu_sdpa_mask_bwd", mutates_args=())(sdpa_mask_backward)

_PAIR = masked_op_pair(cpu_sdpa_mask_fwd, cpu_sdpa_mask_bwd, sdpa_mask_forward, sdpa_mask_backward)


def _native_autograd(call):
    """``(out, lse)`` of an eager call that wants gradients of out only, with the kernel under torch's
    own autograd node (SDPA's: C++, its backward `_FLASH_BWD` with the same mask on the same saved
    tensors, so the gradients are bitwise the op pair's), or None where the op pair's backward must
    run (float16, an lse too large for the kernel's backward: `sdpa_mask_backward`). The kernel's lse
    of a row that sees no key stays 0 (what its backward needs; no lse is returned); zeroed copies of
    K and V, where taken, pass autograd's zero gradient to the keys no query sees."""
    a = call.op_args()
    m = _masks(a.q, a.k, a.layout_mask, a.layout_block, a.key_padding_mask, a.window_left, a.window_right)
    return _native(a.q, a.k, a.v, m, a.scale)


def _native(q: Tensor, k: Tensor, v: Tensor, m: _Mask, scale: float) -> Optional[Tuple[Tensor, Tensor]]:
    """`_native_autograd` given the call's masks."""
    q, k, v = unit_stride(q, _compact(k, m), _compact(v, m))      # (autograd spreads their gradients)
    if m.unseen is not None and not masked_keys_harmless(q, k, v, scale):
        k, v = _seen_only(k, m.unseen), _seen_only(v, m.unseen)
    out, lse = _FLASH_FN(q, k, v, 0.0, False, attn_mask=m.add, scale=scale)
    return (out, lse) if kernel_backward_exact(lse) else None


def _run(call):
    if not call.return_lse and call.q.dtype not in BLOCKS_BACKWARD and needs_grad(call.q, call.k, call.v) and \
            direct(call.q, call.k, call.v, call.key_padding_mask, call.layout.mask if call.layout is not None else None):
        got = _native_autograd(call)
        if got is not None:
            return got
    return _PAIR(call)


def _planned(call):
    """The runner of a dispatch plan of `call` (effattn.plans): `_run`'s eager branches on a later
    call's q, k, v (the plan's rule and padding mask: the masks from the same caches); None when the
    call returns the lse (the op pair's autograd)."""
    if call.return_lse:
        return None
    a = call.op_args()
    lm, lb, kpm, wl, wr, scale = a.layout_mask, a.layout_block, a.key_padding_mask, a.window_left, a.window_right, \
        a.scale
    half = call.q.dtype in BLOCKS_BACKWARD

    def runner(q, k, v):
        m = _masks(q, k, lm, lb, kpm, wl, wr)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return None if half else _native(q, k, v, m, scale)     # None: `run` (the op pair's backward)
        return _forward(q, k, v, m, scale)
    return runner


PATH = register(Path(
    backend="torch", op="attention", name="torch/cpu-sdpa-mask", priority=92,
    caps=Capabilities(devices=frozenset({"cpu"}), dtypes=CPU_DTYPES, features=FEATURES),
    run=_run, admits=_admits, describe=_describe, planned=_planned))
