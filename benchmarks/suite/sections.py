"""Named benchmark suites: fixed shapes, in priority order, each section with a time budget.

``python -m benchmarks.suite`` runs the sections below through the sweep's runner (registry
variants x implementations, benchmarks.run.sweep), with effattn's kernel backends and the baselines
in the same run; runner.py adds what a suite has beyond a sweep (budgets, the output-difference
column), extra_sections.py the sections that are not a sweep (GQA, decode, host overhead, capture /
compile checks). The shapes are those of docs/benchmarks.md:

- ``anchors-d128`` / ``anchors-d64``: bf16, 16k tokens per batch (B = 16384 / L), H*D = 2048 (H = 16
  or 32), L = 4k and 16k, dense and causal, against SDPA flash, SDPA cuDNN and compiled
  flex_attention.
- ``hopper``: the anchors' dense and causal calls at 16k, D=128, with the CUDA backend as it ships
  (on an H100 / H200: the TMA forward and the TMA backward) against ``effattn-cuda-earlier``, the same
  backend with ``EFFATTN_CUDA_HOPPER_TMA=0`` and ``EFFATTN_CUDA_HOPPER_BWD=0`` (the cp.async wgmma
  forward and the fused mma.sync backward), in one run.
- ``sparse-long``: B=1, H=16, D=128, the causal sliding window (1024 keys to the left) and the
  block-sparse ``fixed`` layout (``sliding_and_summary(L, 128, 4, 16)``) at 16k and 64k, against
  flex_attention with the same mask.
- ``causal-64k``: the dense causal reference at 64k (B=1, H=16, D=128) against SDPA flash / cuDNN;
  its forward+backward rows carry the peak memory that is compared with SDPA flash.
- ``linear``: causal linear attention (identity, elu+1, FAVOR+) at 1k..64k against fla's
  chunk_linear_attn, and causal softmax (SDPA flash) at the same shapes up to 16k.
- ``gqa`` (extra_sections.py): grouped-query attention, H=32 query heads on Hkv=8 KV heads, D=128, causal,
  L = 4k and 16k (B = 16384 / L), against SDPA flash and cuDNN with ``enable_gqa``.
- ``decode`` (extra_sections.py): one query row, H=32, Hkv=8, D=128, Lk=16k, B in {1, 4}, against the
  memory-bound time (K and V bytes over the measured copy bandwidth).
- ``paged`` (extra_sections.py): the decode shape over a paged KV cache (pages of 16 shuffled over the
  pool), B in {1, 4}: the Triton paged kernel (in place, split-KV), the contiguous decode of each backend
  on the same keys, and a torch gather of the pages + SDPA; the memory-bound time beside them.
- ``packed`` (extra_sections.py): packed sequences against padding, causal, D=128, H=16, 8 documents of
  random lengths up to L=4096 (about 50% padding): one packed row with ``cu_seqlens`` / ``max_seqlen``
  against the padded batch with a key padding mask, per effattn backend, forward and forward+backward.
- ``host`` (extra_sections.py): host overhead, the wall time per call of a tiny call issued back to back
  (the GPU waits for the host), next to SDPA's.
- ``score``: score terms (softcap 30, ALiBi with the paper's slopes, one sink logit per head, T5's
  relative table, adaptive span with ramp 32 and spans drawn per head against every head at the
  largest span, Transformer-XL's relative keys over 1024 past distances), causal, D=128, L = 4k and 16k, against compiled flex_attention with the same
  ``score_mod`` (sinks: Flex's lse rescales its output; span: Flex also gets each head's span as a
  per-head block mask); the last section, with a small budget. Their kernels (Triton's score
  kernels) are compiled by their first call, not by ``precompile``.

Around them (runner.py): ``precompile`` (every Triton kernel variant the suite launches, compiled
first in a process pool: kernels.py), ``explore`` (autotuning of each kind of call with every
candidate's timing saved) and, after the sections, ``recheck`` (the tuned configs against the
float64 oracle): explore.py; and ``checks`` (CUDA graphs, torch.compile): extra_sections.py.

`plan` lists what a suite will run, with its visible pairs, FLOPs and a rough time estimate, from
shapes alone (``--dry-run``); benchmarks/tests/test_suite.py checks its counts against the oracle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import registry, run
from ..registry import Case
from . import explore, kernels
from .kernels import Call

EST_TFLOPS = 300.0                                  # rough throughput for the time estimate
# first call per (impl, section, variant, mode): autotune (effattn: kernels precompiled) / compile
EST_FIRST_CALL_S = {"effattn": 3.0, "flex": 25.0}
EST_EXPLORE_S = 4.0       # autotuning one kind of call, kernels precompiled (a few ms per candidate)
EST_RECHECK_S = 3.0       # one re-check: the call and two chunked oracles at <= 8k tokens
TOKENS = 16384          # B * L of the anchor shapes
WIDTH = 2048            # H * D of the anchor shapes


@dataclass(frozen=True)
class Section:
    name: str
    variants: Tuple[str, ...]           # registry.VARIANTS names ("decode", "paged", "host": extra_sections')
    lengths: Tuple[int, ...]
    head_dim: int
    baselines: Tuple[str, ...]          # registry baseline names
    budget_s: float                     # start no new (variant, L) after this many seconds
    batch: Optional[int] = None         # None: TOKENS // L
    heads: Optional[int] = None         # None: WIDTH // head_dim
    window: int = 1024                  # the window variant's left reach
    dense_max_len: Optional[int] = None  # quadratic variants stop here
    modes: Tuple[str, ...] = ("fwd", "fwdbwd")
    kv_heads: Optional[int] = None      # GQA: K/V heads (None: as many as the query heads)

    def shape(self, L: int) -> Tuple[int, int]:
        """(B, H) at length L."""
        return (self.batch if self.batch is not None else max(1, TOKENS // L),
                self.heads if self.heads is not None else WIDTH // self.head_dim)


PAGE_SIZE = 16                                    # the paged section's page size (vLLM's default)


def paged_impls(backends) -> List[str]:
    """The paged section's implementations: the in-place paged kernel (Triton), the contiguous decode of
    each backend on the same keys, and the gather + SDPA baseline."""
    return (["effattn-paged-triton"] if "triton" in backends else []) + \
        [f"effattn-contiguous-{b}" for b in backends] + ["gather+sdpa"]


_SOFTMAX_BASELINES = ("sdpa-flash", "sdpa-cudnn", "flex")

SUITES: Dict[str, Tuple[Section, ...]] = {
    "gpu": (
        Section("anchors-d128", ("dense", "causal"), (4096, 16384), 128, _SOFTMAX_BASELINES, budget_s=200),
        Section("sparse-long", ("window", "fixed"), (16384, 65536), 128, ("flex",), budget_s=150, batch=1, heads=16),
        Section("causal-64k", ("causal",), (65536,), 128, ("sdpa-flash", "sdpa-cudnn"), budget_s=60, batch=1,
                heads=16),
        Section("linear", ("linear-identity", "linear-elu", "linear-favor256", "causal"),
                (1024, 4096, 16384, 65536), 128, ("fla-chunk", "sdpa-flash"), budget_s=90, batch=1, heads=16,
                dense_max_len=16384),
        Section("gqa", ("causal",), (4096, 16384), 128, ("sdpa-flash", "sdpa-cudnn"), budget_s=40, heads=32,
                kv_heads=8),
        Section("decode", ("decode",), (16384,), 128, (), budget_s=20, batch=None, heads=32, kv_heads=8),
        Section("paged", ("paged",), (16384,), 128, ("gather+sdpa",), budget_s=20, heads=32, kv_heads=8),
        Section("host", ("host",), (256,), 64, ("sdpa-flash",), budget_s=15, batch=1, heads=8),
        Section("packed", ("packed",), (4096,), 128, (), budget_s=30, batch=8, heads=16),
        Section("anchors-d64", ("dense", "causal"), (4096, 16384), 64, _SOFTMAX_BASELINES, budget_s=150),
        # the Hopper TMA forward and backward against the kernels they replace (their switches off)
        Section("hopper", ("dense", "causal"), (16384,), 128, ("effattn-cuda-earlier",), budget_s=30),
        Section("score", ("softcap", "alibi", "sinks", "t5", "span", "span-max", "relkeys"), (4096, 16384), 128,
                ("flex",), budget_s=100),
    ),
}
SUITES["anchors"] = tuple(s for s in SUITES["gpu"] if s.name in ("anchors-d128", "sparse-long", "causal-64k",
                                                                 "anchors-d64"))


def smoke_section(section: Section) -> Section:
    """The same section at toy sizes for a CPU run (--smoke): L / 64 (at least 128: one layout
    block), B = 1, H = 2, D = 32, window 64."""
    lengths = tuple(dict.fromkeys(max(128, L // 64) for L in section.lengths))
    return Section(section.name, section.variants, lengths, 32,
                   section.baselines, section.budget_s, batch=1, heads=2, window=64,
                   dense_max_len=None if section.dense_max_len is None else max(128, section.dense_max_len // 64),
                   modes=section.modes, kv_heads=None if section.kv_heads is None else 1)


# ------------------------------------------------------------------------------ the plan (--dry-run)

def settings(sec: Section, device: torch.device, smoke: bool) -> run.Settings:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return run.Settings(device=device, dtype=dtype, head_dim=sec.head_dim, lengths=list(sec.lengths),
                        modes=sec.modes, batch=sec.batch, heads=sec.heads, window=sec.window,
                        dense_max_len=sec.dense_max_len, mem_budget_gib=4.0 if smoke else 1e9,
                        time_budget_s=0.01 if smoke else 1.0, min_runs=1 if smoke else 3)


def plan(sections: Sequence[Section], backends: Sequence[str], smoke: bool = False) -> List[dict]:
    """One entry per (section, variant, L) (decode: per B): shapes, implementations, visible pairs,
    forward FLOPs and the estimated seconds; no tensors are made (layouts and FAVOR+ features only)."""
    out = []
    for sec in sections:
        sec = smoke_section(sec) if smoke else sec
        effattn_impls = [f"effattn-{b}" for b in backends]
        if sec.variants == ("packed",):
            from ..flops import attention_flops
            from .extra_sections import doc_lengths
            L, (B, H) = sec.lengths[0], sec.shape(sec.lengths[0])
            lengths = doc_lengths(B, L)
            flops = sum(attention_flops(1, H, sec.head_dim, n, n, causal=True) for n in lengths)
            out.append(dict(section=sec.name, variant="causal-packed/padded", op="attention", L=L, Lq=L, B=B, H=H,
                            Hkv=H, D=sec.head_dim, impls=[f"effattn-{b}" for b in backends],
                            pairs=H * sum(n * (n + 1) // 2 for n in lengths), flops=flops,
                            flops_fwdbwd=sum(attention_flops(1, H, sec.head_dim, n, n, causal=True, mode="fwdbwd")
                                             for n in lengths),
                            modes=sec.modes, window=None, layout=None, documents=lengths,
                            est_s=2 * sum(_estimate_s(f"effattn-{b}", flops, sec.modes) for b in backends)))
            continue
        if sec.variants in (("decode",), ("host",), ("paged",)):
            decode = sec.variants != ("host",)
            paged = sec.variants == ("paged",)
            impls = paged_impls(backends) if paged else effattn_impls + list(sec.baselines)
            for B in ((1, 4) if decode else (sec.batch,)):
                H = sec.heads
                op = "paged_attention" if paged else "attention"
                out.append(dict(section=sec.name, variant=sec.variants[0], op=op, L=sec.lengths[0], B=B, H=H, Hkv=sec.kv_heads or H, D=sec.head_dim,
                                Lq=1 if decode else sec.lengths[0], impls=impls, pairs=None, flops=None,
                                modes=sec.modes, window=None, layout=None,
                                est_s=(2.0 + 2.0 * len(impls)) if decode else 1.5 * (len(backends) + 1)))
            continue
        s = settings(sec, torch.device("cpu"), smoke)
        for vname in sec.variants:
            v = registry.variant(vname)
            for L in s.lengths_for(v):
                B, H = sec.shape(L)
                case = Case(v, B, H, L, sec.head_dim, s.dtype, torch.device("cpu"), sec.window)
                if v.layout is not None:
                    case.layout = v.layout(L)
                if v.feature_map == "favor":
                    import effattn
                    case.favor = effattn.FavorFeatures(sec.head_dim, v.num_features, seed=0)
                impls = effattn_impls + [n for n in sec.baselines
                                         if any(i.name == n and i.op == v.op for i in registry.IMPLS)]
                pairs = run.visible_fraction(case)
                flops = run.config_flops(case, "fwd")
                est = sum(_estimate_s(impl, flops, sec.modes) for impl in impls)
                out.append(dict(section=sec.name, variant=vname, op=v.op, L=L, Lq=L, B=B, H=H, Hkv=sec.kv_heads or H,
                                D=sec.head_dim, window=case.window_arg, layout=case.layout, impls=impls,
                                pairs=None if pairs is None else round(pairs * L * L) * H, modes=sec.modes,
                                flops=flops, flops_fwdbwd=run.config_flops(case, "fwdbwd"), est_s=est,
                                features=case.num_features if v.feature_map == "favor" else 0))
    return out


def calls(entries: Sequence[dict], dtype: torch.dtype = torch.bfloat16) -> List[Call]:
    """The effattn calls of a plan's entries (host-overhead rows left out: tiny, compiled by their
    first call; the packed section's too: its kernels compile at its first call, inside its budget),
    forward+backward where the section times it, as `kernels.Call`s."""
    out = []
    for e in entries:
        if e["variant"] in ("host", "causal-packed/padded"):
            continue
        v = None if e["variant"] in ("decode", "paged") else registry.variant(e["variant"])
        if v is not None and v.score is not None:
            continue                         # the score kernels compile on their first call
        back = "fwdbwd" in e["modes"] and v is not None          # (paged: its contiguous decode's kernels)
        if v is not None and v.op == "linear_attention":
            out.append(Call("linear_attention", e["B"], e["H"], e["Hkv"], e["L"], e["L"], e["D"], dtype, back,
                            causal=v.causal, feature_map=v.feature_map, features=e.get("features", 0),
                            normalize=v.normalize))
            continue
        causal = True if v is None else v.causal
        window = (e["window"], 0) if e.get("window") is not None else None
        out.append(Call("attention", e["B"], e["H"], e["Hkv"], e["Lq"], e["L"], e["D"], dtype, back, causal=causal,
                        window=window, layout=e.get("layout")))
    return out


def precompile_plan(entries, backends, smoke: bool, trials: bool = True):
    """(the Triton kernel variants the suite's calls launch, the explore section's trial candidates
    included unless not `trials`, {call: why not planned}); nothing when the Triton backend is not
    run, in a --smoke run (the interpreter compiles nothing) or under TRITON_INTERPRET=1."""
    from effattn.backends.triton.runtime import _INTERPRET
    if "triton" not in backends or smoke or _INTERPRET:
        return [], {}
    with explore.trial_candidates(trials):
        return kernels.plan_variants(calls(entries))


def estimates(entries: Sequence[dict], budgets: Dict[str, float], n_variants: int, processes: int = 16) -> Dict[str, float]:
    """Estimated seconds per section, each capped by its budget (a section stops starting new work
    once its budget is spent), the precompile, explore and recheck sections included."""
    est: Dict[str, float] = {}
    for e in entries:
        est[e["section"]] = est.get(e["section"], 0.0) + e["est_s"]
    n_kinds = len(explore.distinct_calls(calls(entries)))
    n_be = len({i for e in entries for i in e["impls"] if i.startswith("effattn-")}) or 1
    est["precompile"] = kernels.estimate_s(n_variants, processes) if n_variants else 0.0
    est["explore"] = EST_EXPLORE_S * n_kinds * n_be
    est["recheck"] = EST_RECHECK_S * n_kinds * n_be
    est["checks"] = 2 * 15.0 * n_be
    return {k: min(v, budgets.get(k, v)) for k, v in est.items()}


def _estimate_s(impl: str, flops: int, modes) -> float:
    """Rough seconds of one implementation at one shape: per mode a first call (autotune or
    compile), do_bench's ~0.15 s or ~8 calls, the peak-memory call; and the max_diff fwd+bwd."""
    first = EST_FIRST_CALL_S.get(impl.split("-")[0], 0.5)
    t_fwd = flops / (EST_TFLOPS * 1e12)
    per_mode = {"fwd": t_fwd, "fwdbwd": 3.5 * t_fwd}
    return sum(first + max(0.15, 8 * per_mode[m]) + per_mode[m] for m in modes) + 4.5 * t_fwd


ORDER = ("precompile", "explore")          # before the sections; "recheck", "checks" after them


def print_plan(name: str, entries: List[dict], budgets: Dict[str, float], variants=None, failed=None,
               processes: int = 16):
    """The --dry-run output: the precompile list, then per section its budget, estimate and cases,
    then the estimated total."""
    variants = variants or []
    est = estimates(entries, budgets, len(variants), processes)
    raw = estimates(entries, {}, len(variants), processes)

    def over(name):
        return "  (over budget: the rest is left out)" if raw[name] > budgets[name] else ""
    print(f"suite {name}: plan (no GPU needed; FLOPs count visible pairs exactly; times are rough "
          f"estimates: {EST_TFLOPS:g} TFLOP/s, first calls {EST_FIRST_CALL_S} s)\n")
    print(f"[precompile] budget {budgets['precompile']:.0f} s, estimated {raw['precompile']:.0f} s: "
          f"{len(variants)} Triton kernel variants (kernel, config, constexprs) compiled in {processes} "
          "processes before any timing (what is left compiles on first launch)" + over("precompile"))
    for v in variants:
        print(f"  {v.describe()}")
    for call, why in (failed or {}).items():
        print(f"  NOT PLANNED (compiles on first launch): {call}: {why}")
    print(f"[explore] budget {budgets['explore']:.0f} s, estimated {raw['explore']:.0f} s: every autotune "
          "candidate timed once per kind of call, timings and choices -> explore.json" + over("explore"))
    for sec in dict.fromkeys(e["section"] for e in entries):
        rows = [e for e in entries if e["section"] == sec]
        sec_s = sum(e["est_s"] for e in rows)
        print(f"[{sec}] budget {budgets[sec]:.0f} s, estimated {sec_s:.0f} s"
              + ("  (over budget: later rows will be skipped)" if sec_s > budgets[sec] else ""))
        for e in rows:
            vis = "" if e["pairs"] is None else f" visible {e['pairs'] / (e['H'] * e['L'] ** 2):.4f}"
            gf = "" if e["flops"] is None else f" fwd {e['flops'] / 1e9:10.1f} GFLOP"
            hkv = f" Hkv={e['Hkv']}" if e["Hkv"] != e["H"] else ""
            lq = " Lq=1" if e["Lq"] == 1 else ""
            print(f"  {e['variant']:16s} B={e['B']:<3d} H={e['H']:<3d} L={e['L']:<6d} D={e['D']:<4d}{hkv}{lq}{gf}{vis}"
                  f"  ~{e['est_s']:.0f} s  {', '.join(e['impls'])}")
    print(f"[recheck] budget {budgets['recheck']:.0f} s, estimated {raw['recheck']:.0f} s: each kind of call "
          "with the tuned configs against the float64 oracle" + over("recheck"))
    print(f"[checks] budget {budgets['checks']:.0f} s, estimated {raw['checks']:.0f} s: CUDA-graph replay and "
          "torch.compile vs eager (CUDA only)" + over("checks"))
    names = list(ORDER) + list(dict.fromkeys(e["section"] for e in entries)) + ["recheck", "checks"]
    total = sum(budgets[s] for s in names)
    print(f"\n{len(entries)} cases; estimated total {sum(est[s] for s in names):.0f} s "
          f"({sum(est[s] for s in names) / 60:.1f} min; each section capped by its budget); budgets sum to "
          f"{total:.0f} s (+ the case running when one runs out)")
