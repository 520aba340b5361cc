"""What the CUDA kernels ask of a GPU at launch, and whether a device has it.

A kernel launches only if its block fits one SM: its dynamic shared memory within the device's
opt-in shared memory per block, its threads (128; 256 for the Hopper forward) x registers within the registers of an SM. The
capability check of the rows ``cuda/prefill`` and ``cuda/decode`` reads both from
``torch.cuda.get_device_properties`` (``shared_memory_per_block_optin``,
``regs_per_multiprocessor``), so a kernel that cannot launch on a device is never ranked there, and
``effattn.explain`` says why.

The shared-memory sizes are those of csrc/'s tile configurations (FwdConfig, BwdConfig,
FwdSm90Config in csrc/attention/*.cuh, ``decode_smem_bytes`` in csrc/attention/decode.h): the
tests set the emulation's limit (``emu_smem_limit``) one byte under each size here and read the
size the launch asks for from the emulator's refusal, so the two cannot drift apart. Registers are
bounded by ptxas's cap of 255 per thread (the offline build tests check every kernel under it; the
actual counts are lower).

On CPU tensors (the emulation) the device is the emulated one: its opt-in shared memory is the
emulator's limit (an H100's 227 KB unless a test lowers it with `set_emulated_smem`), 64 K registers
per SM.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

THREADS = 128            # the attention kernels' block (csrc/attention/launch.cuh, decode.cu), but the Hopper forward's
MAX_REGISTERS = 255      # per thread: ptxas's cap (tests/backends/cuda/test_cuda_build.py checks each kernel)

KB = 1024


class Arch(NamedTuple):
    """What one SM of a compute capability holds (CUDA C++ Programming Guide, "Technical Specifications per
    Compute Capability"): the occupancy limits the offline table (tools/cuda/kernel_table.py) and the tests'
    architecture sweep read."""
    smem_per_sm: int          # bytes of shared memory per SM (blocks' dynamic + static + 1 KB reserved each)
    smem_per_block: int       # bytes of shared memory per block, opt-in
    threads_per_sm: int
    blocks_per_sm: int
    regs_per_sm: int = 65536  # 32-bit registers per SM (every capability here)


ARCHS = {(8, 0): Arch(164 * KB, 163 * KB, 2048, 32), (8, 6): Arch(100 * KB, 99 * KB, 1536, 16),
         (8, 7): Arch(164 * KB, 163 * KB, 2048, 16), (8, 9): Arch(100 * KB, 99 * KB, 1536, 24),
         (9, 0): Arch(228 * KB, 227 * KB, 2048, 32), (10, 0): Arch(228 * KB, 227 * KB, 2048, 32),
         (10, 3): Arch(228 * KB, 227 * KB, 2048, 32), (12, 0): Arch(128 * KB, 99 * KB, 1536, 32)}
RESERVED_SMEM = 1024      # bytes of shared memory the system takes per resident block (sm_80 and newer)
REG_UNIT = 256            # registers are given to warps in units of 256 (per-thread counts rounded up to 8)

# Opt-in shared memory per block by compute capability, for a torch whose device properties lack
# shared_memory_per_block_optin; other capabilities: 99 KB, the smallest of sm_80 and newer
_OPTIN_BY_CAPABILITY = {cc: a.smem_per_block for cc, a in ARCHS.items()}
_OPTIN_DEFAULT = 99 * KB


def ctas_per_sm(regs: int, smem: int, threads: int, arch: Arch) -> Tuple[int, str]:
    """(blocks of a kernel resident on one SM of `arch`, the limit that decides it: "regs", "smem",
    "threads" or "blocks"); 0 when one block does not launch. `regs` per thread, `smem` the block's dynamic +
    static shared memory in bytes (the 1 KB the system reserves per block is added here)."""
    warps = -(-threads // 32)
    regs_per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    if smem > arch.smem_per_block or regs_per_warp * warps > arch.regs_per_sm or threads > arch.threads_per_sm:
        return 0, ("smem" if smem > arch.smem_per_block else
                   "regs" if regs_per_warp * warps > arch.regs_per_sm else "threads")
    by = {"regs": arch.regs_per_sm // (regs_per_warp * warps),
          "smem": arch.smem_per_sm // (-(-smem // 128) * 128 + RESERVED_SMEM),
          "threads": arch.threads_per_sm // threads, "blocks": arch.blocks_per_sm}
    limit = min(by, key=lambda k: by[k])
    return by[limit], limit


class Limits(NamedTuple):
    """What one block may use on a device."""
    name: str                 # "NVIDIA H100 80GB HBM3 (sm_90)", "the emulated GPU"
    smem_per_block: int       # bytes of shared memory per block, opt-in
    regs_per_sm: int          # 32-bit registers per SM


class Need(NamedTuple):
    """One kernel's launch requirements."""
    kernel: str
    smem: int                 # bytes of dynamic shared memory per block
    threads: int = THREADS
    regs: int = MAX_REGISTERS  # registers per thread at most: ptxas's cap, or the one its __launch_bounds__ sets


# ----------------------------------------------------------------------- the kernels' shared memory

def fwd_key_tile(hd: int, rows: int = 64, limits: Optional["Limits"] = None, long_keys: bool = False) -> int:
    """The mma.sync forward's key tile (FwdConfig::BN): 64 keys, 32 at head dim 256 and at 128 with 128-row
    query tiles, except the 128 x 64 tile there (two softmax steps of 32 keys; csrc/attention/launch.cuh
    `kLongKeys`, fwd.cuh `fwd_long_keys`): a call of the kinds kDense (Lk a multiple of 64), kCausal or kWindow
    without dropout (`long_keys`) on a device whose SM holds two such blocks (`limits`)."""
    if hd >= 256:
        return 32
    if rows == 128 and hd >= 128:
        fits = limits is not None and 2 * (fwd_smem(hd, 128, 64) + 1024) <= limits.smem_per_block + 1024
        return 64 if long_keys and fits else 32
    return 64


def fwd_smem(hd: int, rows: int = 64, keys: int = 0) -> int:
    """The mma.sync forward (FwdConfig): Q (`rows` rows), K and V tiles (`keys`, 0: `fwd_key_tile`'s default)."""
    return (rows + 2 * (keys or fwd_key_tile(hd, rows))) * hd * 2


WIDE_BUCKETS = (32, 64, 128)   # the mma.sync forward's buckets with 128-row tiles (FwdConfig::kWide)


def layout_wide(hd: int, limits: "Limits", key_padding: bool, dropout: bool) -> bool:
    """Whether a block layout's call takes the forward's 128-row tiles (csrc/attention/fwd.cuh `fwd_wide`): its
    tile lists hold the 128-row tiles' rows (the union of their two 64-row halves' lists; any block size, any
    window), and at head dim 128 only kLayout's 128 x 64 instance reads them: no key padding or dropout, on a
    device whose SM holds two such blocks (sm_80, sm_90 / sm_100; not the 99 KB GPUs)."""
    if hd not in WIDE_BUCKETS:
        return False
    return hd < 128 or (not key_padding and not dropout and fwd_key_tile(hd, 128, limits, True) == 64)


def fwd_rows(hd: int, limits: "Limits", layout: bool = False, terms: bool = False) -> int:
    """The query tile of the mma.sync forward on a device (csrc/attention/fwd.cuh `fwd_wide`, which the
    launcher runs with the device's opt-in shared memory): 128 rows (4 warps of 32) where the bucket has
    them, the call has no block layout that keeps 64 rows (`layout`: `layout_wide` refuses it), no bias tensors or
    relative keys (`terms`: those instances keep 16 rows per warp), and two blocks fit an SM (an SM has
    the opt-in shared memory per block + 1 KB; each block its tiles + 1 KB: every sm_80+ GPU, 99 KB and
    up, holds two at each of these buckets); else 64 rows."""
    if hd not in WIDE_BUCKETS or layout or terms:
        return 64
    return 128 if 2 * (fwd_smem(hd, 128) + 1024) <= limits.smem_per_block + 1024 else 64


def relk_smem(hd: int) -> int:
    """The forward with relative keys (FwdConfig::kRelkSmemBytes): the forward's tiles, the band of r
    (64 + BN rows), the term's query tile and each warp's fp32 products with 16 + BN band rows."""
    bn = 32 if hd >= 256 else 64
    return fwd_smem(hd) + (64 + bn + 64) * hd * 2 + 4 * 16 * (16 + bn) * 4


def relk_bwd_smem(hd: int) -> dict:
    """The backward passes with relative keys (RelkBwdConfig, csrc/attention/relkeys_bwd.cuh; head dims up to
    128), by pass: dQ (Q, dO, the term's query, K, V, the band of r, the warps' fp32 products), dK/dV (K, V,
    64 keys; Q, dO, the term's query of 64 rows, 32 at 128; the band; the products; lse and Delta) and the
    distance pass (Q, dO, the term's query, the key / value band, the block's rows of r, the products)."""
    bm_kv = 32 if hd >= 128 else 64
    prods = 4 * 16 * 80 * 4
    return {"dQ": (3 * 64 + 2 * 64 + 128) * hd * 2 + prods,
            "dK/dV": (2 * 64 + 4 * bm_kv + 64) * hd * 2 + (bm_kv // 16) * 16 * 80 * 4 + 2 * bm_kv * 4,
            "distances": (3 * 64 + 128 + 64) * hd * 2 + prods}


def dkdv_smem(hd: int) -> int:
    """The dK/dV pass (BwdConfig::kDkdvSmem): K, V (64 keys), Q, dO (64 rows, 32 from head dim 128),
    and the rows' lse and Delta."""
    bm = 32 if hd >= 128 else 64
    return (2 * 64 + 2 * bm) * hd * 2 + 2 * bm * 4


def dq_smem(hd: int) -> int:
    """The dQ pass (BwdConfig::kDqSmem): Q, dO (64 rows), K, V (64 keys, 32 at head dim 256)."""
    bn = 32 if hd >= 256 else 64
    return (2 * 64 + 2 * bn) * hd * 2


def bwd_fused_smem(hd: int) -> int:
    """The fused backward (BwdFusedConfig::kSmem): K, V (128 keys), Q and dO (two stages of 64 rows), the
    dS tile (64 x 128) and the rows' lse and Delta (two stages)."""
    return (2 * 128 + 2 * 2 * 64) * hd * 2 + 64 * 128 * 2 + 2 * 2 * 64 * 4


FUSED_BWD_THREADS = 256  # the fused backward's block: 8 warps


def fused_bwd_needs(hd: int) -> List["Need"]:
    """The fused backward's launch requirements at head-dim bucket `hd`."""
    return [Need("fused backward", bwd_fused_smem(hd), FUSED_BWD_THREADS)]


HOPPER_THREADS = 256     # the Hopper forward's block: two warpgroups (FwdSm90Config::kThreads)
HOPPER_TMA_THREADS = 384  # the warp-specialized one's: a producer and two consumer warpgroups (FwdTmaConfig)
HOPPER_TMA_REGS = 168     # its __launch_bounds__(384, 1): 65536 / 384 registers, rounded down to 8


def hopper_bwd_smem(hd: int) -> int:
    """The Hopper backward (BwdSm90Config::kSmemBytes): the fused backward's tiles (`bwd_fused_smem`), at head
    dim 64 one warpgroup's fp32 dQ partial (64 x 64), and 1 KB to align them to wgmma's swizzle pattern (its
    mbarriers in it)."""
    return bwd_fused_smem(hd) + (64 * 64 * 4 if hd == 64 else 0) + 1024


def hopper_bwd_needs(hd: int) -> List["Need"]:
    """The Hopper backward's launch requirements (BwdSm90Config: a producer and two consumer warpgroups, 384
    threads bounded at 168 registers each by __launch_bounds__, as the TMA forward)."""
    return [Need("Hopper backward", hopper_bwd_smem(hd), HOPPER_TMA_THREADS, HOPPER_TMA_REGS)]


def hopper_smem(hd: int, key_tile: int = 64) -> int:
    """The Hopper forward (FwdSm90Config, and FwdTmaConfig at `key_tile` keys): Q (128 rows), two K and
    two V buffers (`key_tile` keys each) and 1 KB to align them (the TMA kernel's mbarriers in it)."""
    return (128 + 4 * key_tile) * hd * 2 + 1024


def decode_smem(hd: int, stages: int) -> int:
    """The split-KV decode kernel (decode.h decode_smem_bytes): 16 packed query rows and `stages`
    pairs of K and V tiles of 64 keys."""
    return (16 + stages * 2 * 64) * hd * 2


DECODE_STAGES = {32: (2,), 64: (2,), 128: (2,), 256: (2, 1)}   # instances per bucket, preferred first


# ------------------------------------------------------------------------------------- the device

_LIMITS: Dict[Tuple[str, Optional[int]], Limits] = {}


def set_emulated_smem(nbytes: int) -> int:
    """Sets the emulated device's opt-in shared memory per block (the emulator refuses larger launches,
    the capability check reads it) and returns the previous value."""
    from . import _ext
    before = int(_ext.ops(torch.device("cpu")).emu_smem_limit(nbytes))
    _LIMITS.pop(("cpu", None), None)
    return before


def device_limits(device: torch.device) -> Limits:
    """The launch limits of `device` (read once per device; torch.compile traces the cached value): a
    GPU's properties, or on CPU tensors the emulated device's (`set_emulated_smem`)."""
    key = (device.type, device.index)
    got = _LIMITS.get(key)
    if got is not None:
        return got
    if device.type == "cpu":
        from . import _ext
        got = _LIMITS[key] = Limits("the emulated GPU", int(_ext.ops(device).emu_smem_limit(0)), 65536)
        return got
    props = torch.cuda.get_device_properties(device)
    cc = (props.major, props.minor)
    optin = getattr(props, "shared_memory_per_block_optin", None) or _OPTIN_BY_CAPABILITY.get(cc, _OPTIN_DEFAULT)
    regs = getattr(props, "regs_per_multiprocessor", None) or 65536
    got = _LIMITS[key] = Limits(f"{props.name} (sm_{cc[0]}{cc[1]})", int(optin), int(regs))
    return got


def refusals(needs: Sequence[Need], limits: Limits) -> List[str]:
    """Why each kernel of `needs` cannot launch under `limits` (empty: all can)."""
    why = []
    for n in needs:
        if n.smem > limits.smem_per_block:
            why.append(f"the {n.kernel} kernel needs {n.smem} bytes of shared memory per block, {limits.name} "
                       f"allows {limits.smem_per_block}")
        if n.threads * n.regs > limits.regs_per_sm:
            why.append(f"the {n.kernel} kernel may need {n.threads} x {n.regs} registers per block, "
                       f"{limits.name} has {limits.regs_per_sm} per SM")
    return why


def prefill_needs(hd: int, hopper: bool, backward: bool, fused: bool = False) -> List[Need]:
    """The kernels a prefill call at head-dim bucket `hd` launches (the Hopper or the mma.sync
    forward; with `backward`, the fused backward when `fused`, else the two backward passes)."""
    # the Hopper forwards: the cp.async kernel (64-key tiles) and the TMA kernel (128-key tiles, every mask kind)
    # (384 threads bounded at 168 registers each by __launch_bounds__)
    needs = ([Need("Hopper forward", hopper_smem(hd), HOPPER_THREADS),
              Need("Hopper TMA forward", hopper_smem(hd, 128), HOPPER_TMA_THREADS, HOPPER_TMA_REGS)]
             if hopper else [Need("forward", fwd_smem(hd))])
    if backward and fused:
        needs += fused_bwd_needs(hd)
    elif backward:
        needs += [Need("dK/dV backward", dkdv_smem(hd)), Need("dQ backward", dq_smem(hd))]
    return needs


def decode_stages(hd: int, limits: Limits) -> Tuple[int, List[str]]:
    """(K/V stages of the decode kernel at head-dim bucket `hd` on a device, []) for the deepest
    pipeline that fits, or (0, why not) when none does."""
    why: List[str] = []
    for stages in DECODE_STAGES[hd]:
        why = refusals([Need(f"{stages}-stage decode", decode_smem(hd, stages))], limits)
        if not why:
            return stages, []
    return 0, why
