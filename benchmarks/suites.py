"""Named benchmark suites: fixed shapes, in priority order, each section with a time budget.

``python -m benchmarks.run --suite gpu`` runs the sections below through the ordinary runner
(registry variants x implementations, run.sweep), with effattn's kernel backends and the baselines
in the same run; benchmarks/gpu_extras.py adds what a suite has beyond a sweep (budgets, the
output-difference column, capture / compile checks, decode). The shapes are those of
docs/benchmarks.md:

- ``anchors-d128`` / ``anchors-d64``: bf16, 16k tokens per batch (B = 16384 / L), H*D = 2048 (H = 16
  or 32), L = 4k and 16k, dense and causal, against SDPA flash, SDPA cuDNN and compiled
  flex_attention.
- ``sparse-long``: B=1, H=16, D=128, the causal sliding window (1024 keys to the left) and the
  block-sparse ``fixed`` layout (``sliding_and_summary(L, 128, 4, 16)``) at 16k and 64k, against
  flex_attention with the same mask.
- ``causal-64k``: the dense causal reference at 64k (B=1, H=16, D=128) against SDPA flash / cuDNN;
  its forward+backward rows carry the peak memory that is compared with SDPA flash.
- ``linear``: causal linear attention (identity, elu+1, FAVOR+) at 1k..64k against fla's
  chunk_linear_attn, and causal softmax (SDPA flash) at the same shapes up to 16k.
- ``decode`` (gpu_extras): one query row, H=32, Hkv=8, D=128, Lk=16k, B in {1, 4}, against the
  memory-bound time (K and V bytes over the measured copy bandwidth).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

TOKENS = 16384          # B * L of the anchor shapes
WIDTH = 2048            # H * D of the anchor shapes


@dataclass(frozen=True)
class Section:
    name: str
    variants: Tuple[str, ...]           # registry.VARIANTS names ("decode": gpu_extras' own)
    lengths: Tuple[int, ...]
    head_dim: int
    baselines: Tuple[str, ...]          # registry baseline names
    budget_s: float                     # start no new (variant, L) after this many seconds
    batch: Optional[int] = None         # None: TOKENS // L
    heads: Optional[int] = None         # None: WIDTH // head_dim
    window: int = 1024                  # the window variant's left reach
    dense_max_len: Optional[int] = None  # quadratic variants stop here
    modes: Tuple[str, ...] = ("fwd", "fwdbwd")

    def shape(self, L: int) -> Tuple[int, int]:
        """(B, H) at length L."""
        return (self.batch if self.batch is not None else max(1, TOKENS // L),
                self.heads if self.heads is not None else WIDTH // self.head_dim)


_SOFTMAX_BASELINES = ("sdpa-flash", "sdpa-cudnn", "flex")

SUITES: Dict[str, Tuple[Section, ...]] = {
    "gpu": (
        Section("anchors-d128", ("dense", "causal"), (4096, 16384), 128, _SOFTMAX_BASELINES, budget_s=200),
        Section("sparse-long", ("window", "fixed"), (16384, 65536), 128, ("flex",), budget_s=150, batch=1, heads=16),
        Section("causal-64k", ("causal",), (65536,), 128, ("sdpa-flash", "sdpa-cudnn"), budget_s=60, batch=1,
                heads=16),
        Section("linear", ("linear-identity", "linear-elu", "linear-favor", "causal"), (1024, 4096, 16384, 65536),
                128, ("fla-chunk", "sdpa-flash"), budget_s=90, batch=1, heads=16, dense_max_len=16384),
        Section("decode", ("decode",), (16384,), 128, (), budget_s=20, batch=None, heads=32),
        Section("anchors-d64", ("dense", "causal"), (4096, 16384), 64, _SOFTMAX_BASELINES, budget_s=150),
    ),
}
SUITES["anchors"] = tuple(s for s in SUITES["gpu"] if s.name in ("anchors-d128", "sparse-long", "causal-64k",
                                                                 "anchors-d64"))


def smoke(section: Section) -> Section:
    """The same section at toy sizes for a CPU run (--smoke): L / 64 (at least 128: one layout
    block), B = 1, H = 2, D = 32, window 64."""
    lengths = tuple(dict.fromkeys(max(128, L // 64) for L in section.lengths))
    return Section(section.name, section.variants, lengths, 32,
                   section.baselines, section.budget_s, batch=1, heads=2, window=64,
                   dense_max_len=None if section.dense_max_len is None else max(128, section.dense_max_len // 64),
                   modes=section.modes)
