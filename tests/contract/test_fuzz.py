"""Property-based fuzz (hypothesis) over the call space of `effattn.attention` and
`effattn.linear_attention` (and of paged calls, `effattn.attention` with ``block_table`` /
``seqlens``), on every runnable unit (a backend, or one path of it) of this machine.

Each example draws every argument (shapes with 0 and 1, head dims 1..256, Lq != Lk, GQA ratios,
non-contiguous views, windows, layouts, key padding, dropout, scales 0 / negative / tiny / huge,
magnitudes 1e-4..1e4, NaN / inf in keys no query sees, every dtype the unit declares; in one call
of three the score terms softcap / sinks / bias, `score_calls`) and checks:

- against the float64 oracle (effattn/testing/oracle.py) by the project's rule (test_attention.judge: at most
  2x the error of the same computation done naively in the dtype, 3x for gradients, plus a floor),
  here relative to the reference's magnitude; lse against the oracle's, -inf exactly where it is;
- properties that need no oracle: bitwise determinism; invariance to the content of keys / values
  no query sees; batch permutation (bitwise, but to a few ulps on the torch backend: torch's CPU
  matmul and flash kernel round a batch row by its place in memory); a row that sees no key gives exactly 0 (lse -inf);
  GQA equals the call with K / V expanded; ``return_lse`` does not change ``out``;
- invalid arguments: a clear TypeError / ValueError naming the argument.

CI runs a seeded, bounded number of examples per unit (`ci_examples`); the `fuzz`-marked campaign
tests run ``EFFATTN_FUZZ_EXAMPLES=N`` per unit (``EFFATTN_FUZZ_KERNEL_EXAMPLES=M`` per interpreted
unit instead; ``EFFATTN_FUZZ_SEED`` picks another seed) and skip without it. Failures are stored in
tests/.hypothesis-db (committed), so a failing example replays first on the next run.
"""
import collections
import contextlib
import math
import os
import random
import time
from typing import Callable, List, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

import effattn
from effattn import splits
from effattn.backends import base
from effattn.bias import ALiBi, Relative, Span, alibi_slopes
from effattn.layouts import BlockLayout
from effattn.testing.oracle import distances, feature_map, naive_attention, score_attention, score_bias, visibility
from tests.conftest import op_backends
from tests.core.test_attention import judge

DB = DirectoryBasedExampleDatabase(os.environ.get("EFFATTN_FUZZ_DB") or
                                   os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".hypothesis-db"))
# EFFATTN_FUZZ_SHRINK=0: report the first failing example as drawn (no shrinking: quick mutation checks)
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink]
                                                          if os.environ.get("EFFATTN_FUZZ_SHRINK") != "0" else [])
settings.register_profile("effattn", database=DB, deadline=None, print_blob=True, phases=PHASES,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much, HealthCheck.differing_executors])
CAMPAIGN = int(os.environ.get("EFFATTN_FUZZ_EXAMPLES", "0"))
# examples per interpreted unit (Triton interpreter, CUDA emulation) in a campaign; default CAMPAIGN
KERNEL_CAMPAIGN = int(os.environ.get("EFFATTN_FUZZ_KERNEL_EXAMPLES") or CAMPAIGN)
SEED = int(os.environ.get("EFFATTN_FUZZ_SEED", "20271127"))


# ------------------------------------------------------------------------------ runnable units

class Unit(NamedTuple):
    """One thing the fuzz runs: one registered path (a row of `effattn.backends.base`), reached by
    naming its backend while the backend's other rows are set aside (``enter()`` returns that
    context manager)."""
    name: str
    op: str
    backend: str
    enter: Callable
    interpreted: bool          # Triton interpreter or the CUDA emulation: slow, tiny shapes


def _only(path, emulate: bool):
    """A context in which `path` is the only row of its backend (the split-KV decode rows admit any
    key count; the rows that torch/cpu-segments runs its segments on stay for those), and the CUDA
    kernels run in their emulation when `emulate`."""
    @contextlib.contextmanager
    def cm():
        with pytest.MonkeyPatch.context() as mp:
            every = list(base._REGISTRY[path.op][path.backend].paths)
            mp.setattr(base._REGISTRY[path.op][path.backend], "paths", [path])
            if path.name == "torch/cpu-segments":
                # it runs each segment as a plain call of the torch backend: those find every row
                from effattn.backends.torch.attention import cpu_segments

                def select_among_all(op, call, backend):
                    with pytest.MonkeyPatch.context() as inner:
                        inner.setattr(base._REGISTRY[op][backend], "paths", every)
                        return base.select(op, call, backend)
                mp.setattr(cpu_segments, "select", select_among_all)
            if path.name.endswith("decode"):
                mp.setattr(splits, "DECODE_MIN_KEYS", 1)
            if emulate:
                mp.setenv("EFFATTN_CUDA_EMU", "1")
            threads = torch.get_num_threads()
            if path.name == "torch/linear-cpu-slices":
                # it refuses a call at one thread (nothing to split): a worker whose earlier test left one
                # thread set would make the unit refuse every example
                torch.set_num_threads(max(threads, 2))
            try:
                yield
            finally:
                torch.set_num_threads(threads)
    return cm


def runnable_units(op: str) -> List[Unit]:
    """The runnable units of `op` here: each registered path usable on this machine (the CUDA
    kernels through their emulation on CPU)."""
    cpu = not torch.cuda.is_available()
    emu_ok = False
    if "cuda" in base._REGISTRY[op] and cpu:
        from effattn.backends.cuda import _ext
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("EFFATTN_CUDA_EMU", "1")
            emu_ok = _ext.emu_problem() is None
    units = []
    usable = set(op_backends(op)) | ({"cuda"} if emu_ok else set())
    for p in base.rows(op):
        if p.backend not in usable:
            continue
        emulate = p.backend == "cuda" and emu_ok
        units.append(Unit(p.name, op, p.backend, _only(p, emulate), cpu and p.backend in ("triton", "cuda")))
    return units


def ci_examples(unit: Unit) -> int:
    """Examples per unit in CI (seeded; under two minutes in all on two cores): the CUDA emulation's
    examples take about a second, the Triton interpreter's several."""
    return 25 if not unit.interpreted else 12 if unit.backend == "cuda" else 6


def _settings(n):
    return settings(settings.get_profile("effattn"), max_examples=n)


def _campaign(unit: Unit) -> int:
    if not CAMPAIGN:
        pytest.skip("a fuzz campaign: set EFFATTN_FUZZ_EXAMPLES=N (examples per unit) and run -m fuzz")
    return KERNEL_CAMPAIGN if unit.interpreted else CAMPAIGN


ATTN_UNITS = [pytest.param(u, id=u.name) for u in runnable_units("attention")]
LINEAR_UNITS = [pytest.param(u, id=u.name) for u in runnable_units("linear_attention")]


# ------------------------------------------------------------------------------ seeded configurations

def draw(seed):
    """A random combination of every visibility constraint (GQA x window x layout x padding x
    Lq != Lk x odd head dims) from a seeded generator: the configurations test_cuda_attention.py
    runs under its two thread schedules (the fuzz below draws its own with hypothesis)."""
    rng = random.Random(seed)
    Hkv = rng.choice([1, 2])
    H = Hkv * rng.choice([1, 2])
    Lq, Lk = rng.randint(1, 70), rng.randint(1, 70)
    if rng.random() < 0.4:
        Lk = Lq
    D = rng.choice([1, 3, 8, 16, 24, 33])
    Dv = D if rng.random() < 0.6 else rng.choice([2, 8, 17])
    kw = {"causal": rng.random() < 0.5}
    r = rng.random()
    if r < 0.25:
        kw["window"] = rng.randint(0, 30)
    elif r < 0.5:
        kw["window"] = (rng.randint(0, 30), rng.randint(0, 30))
    if rng.random() < 0.4:
        bs = rng.choice([16, 32])
        Hl = rng.choice([1, H])
        g = torch.Generator().manual_seed(seed)
        mask = torch.rand(Hl, math.ceil(Lq / bs), math.ceil(Lk / bs), generator=g) < rng.uniform(0.2, 0.9)
        kw["layout"] = BlockLayout(mask, bs)
    kpm = None
    if rng.random() < 0.4:
        kpm = torch.rand(2, Lk, generator=torch.Generator().manual_seed(seed + 1)) < rng.uniform(0.0, 0.6)
    if rng.random() < 0.2:
        kw["scale"] = rng.uniform(0.05, 1.0)
    return (2, H, Hkv, Lq, Lk, D, Dv), kw, kpm, rng.random() < 0.5


# ------------------------------------------------------------------------------ strategies

def _dtypes(unit):
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    caps = next(p.caps for p in base.rows(unit.op) if p.name == unit.name)
    return [d for d in order if d in caps.dtypes]


def _draw_window(draw, kw, reach):
    """None (half the time), an int or a pair of window sides up to ``reach`` into ``kw``."""
    w = draw(st.sampled_from(["none", "int", "pair", "none"]))
    if w == "int":
        kw["window"] = draw(st.integers(0, reach))
    elif w == "pair":
        kw["window"] = (draw(st.integers(0, reach)), draw(st.integers(0, reach)))


def _draw_scale_and_magnitude(draw, kw, dtype) -> float:
    """A scale into ``kw`` (the default, a value, 0, negative, tiny or huge) and the inputs' magnitude
    (1e-4 .. 1e4, 1e-4 .. 10 in 16-bit)."""
    kind = draw(st.sampled_from(["default", "default", "value", "zero", "negative", "tiny", "huge"]))
    kw["scale"] = {"default": None, "value": draw(st.floats(0.01, 2.0)), "zero": 0.0,
                   "negative": -draw(st.floats(0.01, 2.0)), "tiny": 1e-30, "huge": 1e4}[kind]
    if kw["scale"] is None:
        del kw["scale"]
    half = dtype in (torch.float16, torch.bfloat16)
    return 10.0 ** draw(st.integers(-4, 1 if half else 4))


@st.composite
def attention_calls(draw, unit):
    small = unit.interpreted
    dtype = draw(st.sampled_from(_dtypes(unit)))
    B = draw(st.integers(0 if not small else 1, 2))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.sampled_from([1, 1, 2, 3]))
    Lmax = 40 if small else 90
    Lq, Lk = draw(st.integers(0, Lmax)), draw(st.integers(0, Lmax))
    if draw(st.booleans()):
        Lk = Lq
    if unit.name.endswith("decode"):
        Lq = min(Lq, 16)
    hd = st.sampled_from([1, 2, 3, 8, 16, 17, 32, 64, 100, 128, 256]) if not small else \
        st.sampled_from([1, 3, 8, 16, 24, 64, 256])
    D = draw(hd)
    Dv = D if draw(st.booleans()) else draw(hd)
    kw = {"causal": draw(st.booleans())}
    _draw_window(draw, kw, Lmax)
    if draw(st.integers(0, 3)) == 0 and Lq and Lk:
        bs = draw(st.sampled_from([16, 32, 64]))
        Hl = draw(st.sampled_from([1, H]))
        density = draw(st.floats(0.1, 1.0))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        kw["layout"] = BlockLayout(torch.rand(Hl, -(-Lq // bs), -(-Lk // bs), generator=g) < density, bs)
    if draw(st.booleans()):
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        kw["key_padding_mask"] = torch.rand(B, Lk, generator=g) < draw(st.floats(0.0, 1.0))
    # issue 23's arguments: packed sequences (B = 1, no padding or layout), positions, fp32 outputs
    extra = draw(st.sampled_from(["none", "none", "none", "positions", "packed"]))
    if extra == "positions" and "layout" not in kw:
        kw["positions"] = (draw(st.integers(0, 2 * Lmax)), draw(st.integers(0, 2 * Lmax)))
    if extra == "packed":                 # packed as one row, without padding or layout
        B = 1
        kw.pop("layout", None)
        kw.pop("key_padding_mask", None)
        def offsets(T):
            cuts = sorted(draw(st.lists(st.integers(0, T), min_size=n - 1, max_size=n - 1)))
            return torch.tensor([0, *cuts, T], dtype=torch.int32)
        n = draw(st.integers(1, 3))
        cu_q = offsets(Lq)
        kw["cu_seqlens"] = cu_q if Lq == Lk and draw(st.booleans()) else (cu_q, offsets(Lk))
        if draw(st.booleans()):
            cq, ck = kw["cu_seqlens"] if isinstance(kw["cu_seqlens"], tuple) else (cu_q, cu_q)
            kw["max_seqlen"] = (int((cq[1:] - cq[:-1]).max()), int((ck[1:] - ck[:-1]).max()))
    if draw(st.integers(0, 3)) == 0 and dtype != torch.float64:
        kw["out_dtype"] = torch.float32
    mag = _draw_scale_and_magnitude(draw, kw, dtype)
    dropout = draw(st.sampled_from([0.0, 0.0, 0.0, 0.3])) if not unit.name.endswith("decode") else 0.0
    if dropout and 1 <= Lk <= 256 and B > 0:
        kw["dropout_p"] = dropout
    grad = draw(st.booleans()) and not unit.name.endswith("decode")
    layout_view = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    poison = draw(st.sampled_from([None, float("nan"), float("inf"), -float("inf"), 1e30]))
    tensor_seed = draw(st.integers(0, 2**31))
    return dict(dtype=dtype, shape=(B, H, Hkv, Lq, Lk, D, Dv), kw=kw, mag=mag, grad=grad, view=layout_view,
                poison=poison, seed=tensor_seed)


def _make(shape, dtype, mag, view, g):
    """A tensor of `shape` (B, H, L, D) in `dtype`, magnitude `mag`, as a contiguous tensor, a view of
    a (B, L, H, D) tensor, or a strided slice of a wider one."""
    B, H, L, D = shape
    if view == "transposed":
        return (torch.randn(B, L, H, D, generator=g, dtype=torch.float64) * mag).to(dtype).transpose(1, 2)
    if view == "strided":
        return (torch.randn(B, H, L, 2 * D, generator=g, dtype=torch.float64) * mag).to(dtype)[..., ::2]
    return (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) * mag).to(dtype)


def _inputs(c):
    B, H, Hkv, Lq, Lk, D, Dv = c["shape"]
    g = torch.Generator().manual_seed(c["seed"])
    dt, mag, view = c["dtype"], c["mag"], c["view"]
    return _make((B, H, Lq, D), dt, mag, view, g), _make((B, Hkv, Lk, D), dt, mag, view, g), \
        _make((B, Hkv, Lk, Dv), dt, mag, view, g)


def _unseen_keys(c):
    """bool (B, Hkv, Lk): keys no query of the call sees (the oracle's visibility, per kv head)."""
    B, H, Hkv, Lq, Lk, D, Dv = c["shape"]
    kw = c["kw"]
    vis = visibility(Lq, Lk, causal=kw.get("causal", False), window=kw.get("window"), layout=kw.get("layout"),
                     key_padding_mask=kw.get("key_padding_mask"), B=B, H=H, positions=kw.get("positions"),
                     cu_seqlens=kw.get("cu_seqlens"))
    return ~vis.any(2).reshape(B, Hkv, H // Hkv, Lk).any(2)


def _call(unit, q, k, v, kw, **extra):
    with unit.enter():
        return effattn.attention(q, k, v, backend=unit.backend, **kw, **extra)


def _admits(unit, q, k, v, kw):
    """Whether the unit's backend serves this call (else the call must be refused with a reason)."""
    with unit.enter():
        ex = effattn.explain(q, k, v, **{n: x for n, x in kw.items()})
    return ex.can_serve(unit.backend)


def _rel_judge(got, ref, low, mult, dtype, what, cond=1.0, terms=None):
    """`judge` on values divided by the magnitude of the terms they sum (`terms`, e.g. max |v| for
    out: a result near 0 by cancellation is judged on its terms' scale; default the reference's
    largest magnitude), with the floor times `cond` (the largest |score|: exp's relative error grows
    with it); when the naive computation in `dtype` overflows, its yardstick is the float64 result
    rounded to `dtype`."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    if not ref.numel():
        return
    s = (terms if terms is not None else ref.abs().max().item()) or 1.0
    if not torch.isfinite(low).all():
        low = ref.to(dtype)
    judge(got.double() / (s * cond), ref.double() / (s * cond), low.double() / (s * cond), mult, dtype, what)


def _score_size(q, k, kw):
    """max(1, the largest |scaled score|) of a call."""
    if not (q.numel() and k.numel()):
        return 1.0
    G = q.shape[1] // k.shape[1]
    scale = kw.get("scale", 1.0 / math.sqrt(q.shape[-1]))
    s = q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2) * scale
    return max(1.0, s.abs().max().item())


def _keep_mask(unit, q, k, v, kw, seed_value, oracle=naive_attention):
    """The dropout keep-mask a call with this seed draws, read back through V = identity (out is then
    P o keep / (1 - p)); True also where P is 0 (no effect there; P from `oracle`)."""
    B, Hkv, Lk = k.shape[0], k.shape[1], k.shape[2]
    eye = torch.eye(Lk, dtype=q.dtype).expand(B, Hkv, Lk, Lk).contiguous()
    torch.manual_seed(seed_value)
    with torch.no_grad():
        p = _call(unit, q, k, eye, kw)
    probs, _ = oracle(q.double(), k.double(), eye.double(), **{n: x for n, x in kw.items()
                                                               if n not in ("dropout_p", "softcap", "sinks", "bias")})
    return (p != 0) | (probs == 0)


# ------------------------------------------------------------------------------ attention

def _fuzz(strategy, check, describe, key: bytes, n: int):
    """Runs `check` on `n` seeded draws of `strategy`; `key` is the example database's key (one per
    unit and op, so failures replay where they were found). With ``EFFATTN_FUZZ_LOG=FILE`` a line per
    run is appended to FILE: the key, the examples checked by outcome (what `check` returns:
    "judged", "refused", ...), the seconds taken."""
    tally = collections.Counter()

    @_settings(n)
    @seed(SEED)
    @given(c=strategy)
    def run(c):
        note(describe(c))
        tally[check(c) or "judged"] += 1
    run.hypothesis.inner_test._hypothesis_internal_add_digest = key
    start = time.time()
    try:
        run()
    finally:
        log = os.environ.get("EFFATTN_FUZZ_LOG")
        if log:
            with open(log, "a", encoding="utf-8") as f:
                f.write(f"{key.decode()}: {sum(tally.values())} examples ({dict(sorted(tally.items()))}) in "
                        f"{time.time() - start:.0f} s, seed {SEED}\n")


def _describe_attention(c):
    return repr({**c, "kw": {n: (x if n != "layout" else ("layout", x.block_size, x.mask.int().tolist()))
                             for n, x in c["kw"].items()}})


def fuzz_tests(units, strategy, check, describe, prefix: bytes):
    """The two tests of a fuzzed op: its CI run (`ci_examples` per unit) and its campaign (``-m fuzz``),
    each a parametrization over `units`; ``prefix`` + the unit's name keys its examples in the database."""
    def run(unit, n):
        _fuzz(strategy(unit), lambda c: check(unit, c), describe, prefix + unit.name.encode(), n)

    @pytest.mark.parametrize("unit", units)
    def ci(unit):
        run(unit, ci_examples(unit))

    @pytest.mark.fuzz
    @pytest.mark.parametrize("unit", units)
    def campaign(unit):
        run(unit, _campaign(unit))
    return ci, campaign


def check_attention(unit, c):
    if c.get("score"):
        return check_score(unit, c)
    q, k, v = _inputs(c)
    kw, dtype = dict(c["kw"]), c["dtype"]
    if not _admits(unit, q, k, v, kw):
        with pytest.raises((TypeError, ValueError)):
            _call(unit, q, k, v, kw)
        return "refused"
    B, H, Hkv, Lq, Lk, D, Dv = c["shape"]
    drop = kw.get("dropout_p", 0.0)
    keep = None
    if drop:
        keep = _keep_mask(unit, q, k, v, kw, c["seed"])
    leaves = [t.detach().requires_grad_(c["grad"]) for t in (q, k, v)]
    torch.manual_seed(c["seed"])
    ctx = contextlib.nullcontext() if c["grad"] else torch.no_grad()
    with ctx:
        out, lse = _call(unit, *leaves, kw, return_lse=True)
    assert out.dtype == kw.get("out_dtype", dtype) and tuple(out.shape) == (B, H, Lq, Dv) and lse.shape == (B, H, Lq)
    torch.manual_seed(c["seed"])
    with ctx:
        out2, lse2 = _call(unit, *leaves, kw, return_lse=True)
    assert torch.equal(out2, out) and torch.equal(lse2, lse), "not bitwise deterministic"
    okw = {n: x for n, x in kw.items() if n != "dropout_p"}
    ref_leaves = [t.detach().double().requires_grad_(c["grad"]) for t in (q, k, v)]
    ref, ref_lse = naive_attention(*ref_leaves, **okw, dropout_keep=keep, dropout_p=drop)
    low_leaves = [t.detach().requires_grad_(c["grad"]) for t in (q, k, v)]
    low, _ = naive_attention(*low_leaves, **okw, dtype=dtype, dropout_keep=keep, dropout_p=drop)
    cond = _score_size(q, k, kw)
    amax = {n: (t.double().abs().max().item() if t.numel() else 0.0) for n, t in zip("qkv", (q, k, v))}
    inv_keep = 1.0 / (1.0 - drop)
    _rel_judge(out, ref, low, 2, dtype, "out", cond, terms=amax["v"] * inv_keep)
    # lse: -inf exactly where the oracle's is; close elsewhere (relative to the scores' size)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf pattern differs from the oracle's"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        tol = 1e-3 * max(1.0, ref_lse[fin].abs().max().item())
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= tol, "lse differs from the oracle's"
    # rows that see no key: exactly 0
    empty = torch.isneginf(ref_lse)
    assert bool((out[empty] == 0).all()), "a row that sees no key is not exactly 0"
    if c["grad"] and out.numel():
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(c["seed"] + 1), dtype=torch.float64)
        grads = torch.autograd.grad(out, leaves, go.to(out.dtype), allow_unused=True)
        ref_grads = torch.autograd.grad(ref, ref_leaves, go, allow_unused=True)
        low_grads = torch.autograd.grad(low, low_leaves, go.to(low.dtype), allow_unused=True)
        for name, g_, rg, lg in zip("qkv", grads, ref_grads, low_grads):
            rg = torch.zeros_like(ref_leaves[0 if name == "q" else 1 if name == "k" else 2]) if rg is None else rg
            g_ = torch.zeros_like(rg) if g_ is None else g_
            lg = torch.zeros_like(rg) if lg is None else lg
            gmax = go.abs().max().item()
            sc = abs(kw.get("scale", 1.0 / math.sqrt(D)))
            terms = {"q": 2 * sc * gmax * amax["v"] * amax["k"] * inv_keep,
                     "k": 2 * sc * gmax * amax["v"] * amax["q"] * inv_keep, "v": gmax * inv_keep}[name]
            _rel_judge(g_, rg, lg, 3, dtype, f"d{name}", cond, terms=terms)
    with torch.no_grad():
        check_properties(unit, c, q, k, v, kw)
    return "judged"


def check_properties(unit, c, q, k, v, kw):
    """The oracle-free properties, on the forward without gradients (dropout calls reuse their seed)."""
    s = c["seed"]

    def again(q_, k_, v_, kw_=kw, **extra):
        torch.manual_seed(s)
        return _call(unit, q_, k_, v_, kw_, **extra)

    out = again(q, k, v)           # without gradients: forward-only paths (decode) may serve it
    assert torch.equal(again(q, k, v, return_lse=True)[0], out), "return_lse=True changed out"
    unseen = _unseen_keys(c)
    if c["poison"] is not None and unseen.any():
        kp, vp = k.clone(), v.clone()          # (a clone of a strided view is contiguous: compare clones)
        clean = again(q, kp, vp)
        kp[unseen] = c["poison"]
        vp[unseen] = c["poison"]
        assert torch.equal(again(q, kp, vp), clean), f"keys no query sees (holding {c['poison']}) changed out"
    check_batch_and_gqa(unit, c, q, k, v, kw, out, again, _score_size(q, k, kw))


def _permute_batch(kw, perm):
    """The keywords of a call whose batch is permuted by `perm`: the padding mask, (B, H) ALiBi slopes
    and dense bias tensors with a batch dimension follow the batch (other terms are per head)."""
    B = len(perm)
    kw_p = dict(kw)
    if "key_padding_mask" in kw:
        kw_p["key_padding_mask"] = kw["key_padding_mask"][perm]

    def term(t):
        if isinstance(t, ALiBi) and t.slopes.dim() == 2:
            return ALiBi(t.slopes[perm])
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[0] == B:
            return t[perm]
        return t
    return _map_bias(kw_p, term)


def _permute_heads(kw, perm):
    """The keywords of a call whose query heads are permuted by `perm` (KV heads along, each keeping
    its group): per-head layouts, sinks, ALiBi slopes, Relative tables, Span z and dense biases with a
    head dimension follow the heads."""
    H = len(perm)
    kw_p = dict(kw)
    lay = kw.get("layout")
    if lay is not None and lay.mask.shape[0] == H:
        kw_p["layout"] = BlockLayout(lay.mask[perm], lay.block_size)
    if kw.get("sinks") is not None:
        kw_p["sinks"] = kw["sinks"][perm]

    def term(t):
        if isinstance(t, ALiBi):
            return ALiBi(t.slopes[..., perm])
        if isinstance(t, (Relative, Span)):
            return t.with_params(t.params()[0][perm])
        if isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[-3] == H:
            return t.index_select(t.dim() - 3, perm)
        return t
    return _map_bias(kw_p, term)


def _map_bias(kw, term):
    """`kw` with `term` applied to each of its bias terms (a list stays a list)."""
    if "bias" in kw:
        kw["bias"] = [term(t) for t in kw["bias"]] if isinstance(kw["bias"], list) else term(kw["bias"])
    return kw


def check_batch_and_gqa(unit, c, q, k, v, kw, out, again, cond):
    """Batch permutation and head permutation (the per-batch / per-head arguments of `kw` permuted
    along) give the permuted out, and a GQA call equals the call with K / V expanded (`again(q, k, v,
    kw)` reruns the call with its seed; `cond`: the largest |score|, exp's rounding grows with it).
    Calls with dropout are skipped (the keep-masks follow the batch index and the head)."""
    B, H, Hkv = c["shape"][:3]
    if kw.get("dropout_p"):
        return

    def same(got, want, what):
        if unit.backend == "torch":
            # torch's own CPU kernels round a batch row differently by its place in memory
            # (torch 2.13: a float64 matmul (2, 1, 43, 55) @ (2, 1, 55, 3) permuted differs from
            # the permuted product by an ulp; so does the flash CPU kernel at Lk = 9): the
            # torch paths are held to a few ulps of the row's terms, not bitwise
            vmax = v.double().abs().max().item() if v.numel() else 0.0
            tol = 8 * torch.finfo(out.dtype).eps * cond * (vmax or 1.0)
            err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
            assert err <= tol, f"{what}: {err} > {tol}"
        else:
            assert torch.equal(got, want), what
    if B > 1:
        perm = torch.arange(B - 1, -1, -1)
        same(again(q[perm], k[perm], v[perm], _permute_batch(kw, perm)), out[perm], "batch permutation")
    if Hkv > 1 or H > 1:          # KV heads reversed, and the query heads of each group reversed
        G = H // Hkv
        kv_perm = torch.arange(Hkv - 1, -1, -1)
        perm = (kv_perm[:, None] * G + torch.arange(G - 1, -1, -1)).reshape(-1)
        same(again(q[:, perm], k[:, kv_perm], v[:, kv_perm], _permute_heads(kw, perm)), out[:, perm],
             "head permutation")
    if H != Hkv and out.numel():
        G = H // Hkv
        o_e = again(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), kw)
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[q.dtype]
        tol *= cond           # exp's rounding grows with the scores
        torch.testing.assert_close(o_e.double(), out.double(), rtol=tol, atol=tol * max(1.0, out.abs().max().item()),
                                   msg=lambda m: f"GQA != the call with K/V expanded: {m}")


# ------------------------------------------------------------------------------ score terms

# invalid score terms: name -> (what the message must name, how to corrupt the call's terms (a dict of
# softcap / sinks / bias), given the shape (B, H, Hkv, Lq, Lk, D, Dv))
SCORE_BAD = {
    "softcap-zero": ("softcap", lambda t, s: t.update(softcap=0.0)),
    "softcap-negative": ("softcap", lambda t, s: t.update(softcap=-1.5)),
    "softcap-nan": ("softcap", lambda t, s: t.update(softcap=float("nan"))),
    "softcap-inf": ("softcap", lambda t, s: t.update(softcap=float("inf"))),
    "softcap-str": ("softcap", lambda t, s: t.update(softcap="2.0")),
    "sinks-shape": ("sinks", lambda t, s: t.update(sinks=torch.zeros(s[1] + 1))),
    "sinks-2d": ("sinks", lambda t, s: t.update(sinks=torch.zeros(1, s[1]))),
    "sinks-int": ("sinks", lambda t, s: t.update(sinks=torch.zeros(s[1], dtype=torch.long))),
    "alibi-shape": ("ALiBi.slopes", lambda t, s: t.update(bias=ALiBi(torch.ones(s[1] + 1)))),
    "relative-short": ("Relative.table", lambda t, s: t.update(bias=Relative(torch.zeros(s[1], 6), max_distance=3))),
    "relative-past-short": ("Relative.table", lambda t, s: t.update(
        bias=Relative(torch.zeros(s[1], 3), max_distance=3, bidirectional=False))),
    "dense-shape": ("bias", lambda t, s: t.update(bias=torch.zeros(1, s[4] + 2))),
    "dense-5d": ("bias", lambda t, s: t.update(bias=[torch.zeros(1, 1, 1, 1, 1)])),
    "span-z-above": ("Span.z", lambda t, s: t.update(bias=Span(torch.full((s[1],), 4.5), ramp=2.0, max_span=4.0))),
    "span-z-negative": ("Span.z", lambda t, s: t.update(bias=Span(torch.full((s[1],), -0.25), ramp=2.0,
                                                                  max_span=4.0))),
    "span-ramp-zero": ("Span.ramp", lambda t, s: t.update(bias=Span(torch.zeros(s[1]), ramp=0.0, max_span=4.0))),
    "bias-float": ("bias", lambda t, s: t.update(bias=3.0)),
    "bias-empty": ("bias", lambda t, s: t.update(bias=[])),
}


def _score_served(unit):
    """The score-term features the unit's row declares."""
    return next(p.caps.features for p in base.rows(unit.op) if p.name == unit.name) & base.SCORE_FEATURES


@st.composite
def score_calls(draw, unit):
    """An attention call (`attention_calls`) that in one of three draws also carries score terms:
    ``c["score"]`` describes them (`score_kwargs` builds the tensors), sometimes an invalid variant."""
    c = draw(attention_calls(unit))
    if draw(st.integers(0, 2)) != 0:
        return c
    B, H, Hkv, Lq, Lk, D, Dv = c["shape"]
    if draw(st.integers(0, 3)):            # mostly without the arguments the score rows do not serve
        c = dict(c, kw={n: x for n, x in c["kw"].items() if n not in ("positions", "cu_seqlens", "max_seqlen",
                                                                       "out_dtype")})
    Lmax = 40 if unit.interpreted else 90
    sc = dict(seed=draw(st.integers(0, 2**31)), softcap=None, sinks=None, bias=[], as_list=False, bad=None,
              pdtype=draw(st.sampled_from([torch.float32, torch.float32, torch.float64, c["dtype"]])))
    # a row serving some of the terms only (cuda/prefill: softcap, sinks, ALiBi) mostly draws those
    # a dense bias tensor does not combine with cu_seqlens (refused naming bias: test_score_packed.py)
    kinds = ["alibi", "relative", "span"] + ([] if "cu_seqlens" in c["kw"] else ["dense"])
    served = _score_served(unit)
    if served and len(served) < len(base.SCORE_FEATURES) and draw(st.integers(0, 3)):
        kinds = [n for n in kinds if f"bias={n}" in served]
        parts = draw(st.sets(st.sampled_from([n for n in ("softcap", "sinks") if n in served] +
                                             (["bias"] if kinds else [])), min_size=1))
    else:
        parts = draw(st.sets(st.sampled_from(["softcap", "sinks", "bias"]), min_size=1))
    if "softcap" in parts:
        sc["softcap"] = draw(st.one_of(st.floats(0.05, 50.0), st.sampled_from([1e-6, 1e6, 1])))
    if "sinks" in parts:
        sc["sinks"] = (draw(st.booleans()), draw(st.sampled_from([0.1, 1.0, 3.0])),
                       draw(st.sampled_from([0.0, 0.0, 5.0, -30.0, 30.0])))
    for _ in range(draw(st.integers(1, 3)) if "bias" in parts else 0):
        kind, grad = draw(st.sampled_from(kinds)), draw(st.booleans())
        if kind == "alibi":                # (batched (B, H) slopes, the paper's slopes times a factor or random)
            p = (draw(st.booleans()), draw(st.booleans()), draw(st.sampled_from([0.01, 0.1, 1.0])))
        elif kind == "relative":           # (bidirectional, max_distance, spare table entries, table size)
            p = (draw(st.booleans()), draw(st.integers(0, Lmax)), draw(st.integers(0, 3)),
                 draw(st.sampled_from([0.1, 1.0, 5.0])))
        elif kind == "span":               # (z per head, ramp, max_span): z on the grid of 1/4 or anywhere
            smax = draw(st.integers(0, Lmax)) + draw(st.sampled_from([0.0, 0.5]))
            z = [draw(st.one_of(st.sampled_from([0.0, smax]), st.integers(0, int(4 * smax)).map(lambda x: x / 4),
                                st.floats(0.0, smax))) for _ in range(H)]
            p = (z, draw(st.sampled_from([0.5, 1.0, 2.75, 4.0, 16.0])), smax)
        else:                              # (shape: each of (B, H, Lq, Lk) full or 1, fewer leading dims; size)
            full = [draw(st.booleans()) for _ in range(4)]
            shape = tuple(n if f else 1 for n, f in zip((B, H, Lq, Lk), full))[draw(st.integers(0, 2)):]
            p = (shape, draw(st.sampled_from([0.1, 1.0, 10.0])))
        sc["bias"].append((kind, grad, p))
    sc["as_list"] = len(sc["bias"]) > 1 or draw(st.booleans())
    if draw(st.integers(0, 4)) == 0:
        sc["bad"] = draw(st.sampled_from(sorted(SCORE_BAD)))
    return dict(c, score=sc)


def score_kwargs(c, mode, grad=True):
    """(softcap / sinks / bias keywords, the term tensors that require grad) of ``c["score"]``:
    tensors in the drawn parameter dtype (``mode="call"``) or those values in float64 (``"ref"``); a
    tensor requires grad where drawn so (and `grad`)."""
    sc = c["score"]
    B, H, Hkv, Lq, Lk, D, Dv = c["shape"]
    g = torch.Generator().manual_seed(sc["seed"])
    dt = sc["pdtype"] if mode == "call" else torch.float64
    leaves = []

    def leaf(x, needs):
        t = x.to(sc["pdtype"]).to(dt).requires_grad_(needs and grad)
        if t.requires_grad:
            leaves.append(t)
        return t

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    kw = {}
    if sc["softcap"] is not None:
        kw["softcap"] = sc["softcap"]
    if sc["sinks"] is not None:
        needs, size, shift = sc["sinks"]
        kw["sinks"] = leaf(r(H) * size + shift, needs)
    terms = []
    for kind, needs, p in sc["bias"]:
        if kind == "alibi":
            batched, paper, f = p
            s = torch.rand(B, H, generator=g, dtype=torch.float64) * f if batched else \
                (alibi_slopes(H).double() * f * 10 if paper else torch.rand(H, generator=g, dtype=torch.float64) * f)
            terms.append(ALiBi(leaf(s, needs)))
        elif kind == "relative":
            bidir, M, spare, size = p
            terms.append(Relative(leaf(r(H, (2 * M + 1 if bidir else M + 1) + spare) * size, needs), max_distance=M,
                                  bidirectional=bidir))
        elif kind == "span":
            z, ramp, smax = p
            zt = torch.tensor(z, dtype=torch.float64).to(sc["pdtype"])
            zt = torch.where(zt.double() > smax, torch.nextafter(zt, torch.zeros_like(zt)), zt)   # rounded up
            terms.append(Span(leaf(zt, needs), ramp=ramp, max_span=smax))
        else:
            shape, size = p
            terms.append(leaf(r(*shape) * size, needs))
    if terms:
        kw["bias"] = terms if sc["as_list"] else terms[0]
    return kw, leaves


def _score_cond(q, k, kw, terms):
    """max(1, the largest |score| with every term) of a call, on the pairs it sees (float64)."""
    if not (q.numel() and k.numel()):
        return 1.0
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    s = q.double() @ k.double().repeat_interleave(H // k.shape[1], 1).transpose(-1, -2)
    s = s * kw.get("scale", 1.0 / math.sqrt(D))
    if terms.get("softcap") is not None:
        s = terms["softcap"] * torch.tanh(s / terms["softcap"])
    d = distances(Lq, Lk, kw.get("positions"), kw.get("cu_seqlens"))
    add, _ = score_bias(B, H, Lq, Lk, terms.get("bias"), torch.float64, d=d)
    s = (s + add.detach())[visibility(Lq, Lk, causal=kw.get("causal", False), window=kw.get("window"),
                                      layout=kw.get("layout"), key_padding_mask=kw.get("key_padding_mask"), B=B,
                                      H=H, positions=kw.get("positions"), cu_seqlens=kw.get("cu_seqlens"))]
    return max(1.0, s.abs().max().item()) if s.numel() else 1.0


def check_score(unit, c):
    """A call with score terms: a bad one is refused naming its argument; a valid one that the unit
    does not serve is refused; else out, lse and the gradients of q, k, v and of every term tensor
    against `score_attention` in float64 by the project's rule, and the oracle-free properties."""
    q, k, v = _inputs(c)
    kw, dtype, sc = dict(c["kw"]), c["dtype"], c["score"]
    B, H, Hkv, Lq, Lk, D, Dv = c["shape"]
    if sc["bad"]:
        name, corrupt = SCORE_BAD[sc["bad"]]
        terms, _ = score_kwargs(c, "call", grad=False)
        corrupt(terms, c["shape"])
        with pytest.raises((TypeError, ValueError)) as info:
            _call(unit, q, k, v, {**kw, **terms})
        assert name in str(info.value), f"{sc['bad']}: the error does not name {name!r}: {info.value}"
        return "score: invalid, refused"
    terms, params = score_kwargs(c, "call")
    want_grad = c["grad"] or bool(params)
    leaves = [t.detach().requires_grad_(c["grad"]) for t in (q, k, v)]
    full = {**kw, **terms}
    if not _admits(unit, *leaves, full):
        with pytest.raises((TypeError, ValueError)):
            _call(unit, *leaves, full)
        return "score: refused"
    drop = kw.get("dropout_p", 0.0)
    ref_terms, ref_params = score_kwargs(c, "ref")
    okw = {n: x for n, x in kw.items() if n != "dropout_p"}
    keep = None
    if drop:
        keep = _keep_mask(unit, q, k, v, {**kw, **score_kwargs(c, "call", grad=False)[0]}, c["seed"],
                          oracle=lambda *a, **o: score_attention(*a, **o, **ref_terms))
    ctx = contextlib.nullcontext() if want_grad else torch.no_grad()
    go = torch.randn(B, H, Lq, Dv, generator=torch.Generator().manual_seed(c["seed"] + 1), dtype=torch.float64)
    gl = torch.randn(B, H, Lq, generator=torch.Generator().manual_seed(c["seed"] + 2), dtype=torch.float64)

    def run(qkv, ps, fn):
        """(out, lse, gradients of qkv and ps) of one evaluation; a gradient into lse on its finite rows."""
        torch.manual_seed(c["seed"])
        with ctx:
            o, l = fn(*qkv)
        if not want_grad or not o.numel():
            return o, l, []
        fin = torch.isfinite(l.detach())
        loss = (o * go.to(o.dtype)).sum() + (torch.where(fin, l, torch.zeros_like(l)) * gl.to(l.dtype)).sum()
        ins = [t for t in (*qkv, *ps) if t.requires_grad]
        gs = torch.autograd.grad(loss, ins, allow_unused=True)
        return o, l, [torch.zeros_like(t) if g_ is None else g_ for t, g_ in zip(ins, gs)]

    def kernel(*qkv):
        return _call(unit, *qkv, full, return_lse=True)

    out, lse, grads = run(leaves, params, kernel)
    assert out.dtype == kw.get("out_dtype", dtype) and tuple(out.shape) == (B, H, Lq, Dv) and lse.shape == (B, H, Lq)
    # bitwise determinism, the terms' gradients included (the same leaves, a second run)
    out2, lse2, grads2 = run(leaves, params, kernel)
    assert torch.equal(out2, out) and torch.equal(lse2, lse), "score terms: not bitwise deterministic"
    for i, (a, b) in enumerate(zip(grads, grads2)):
        assert torch.equal(a, b), f"score terms: gradient {i} not bitwise deterministic"
    ref_leaves = [t.detach().double().requires_grad_(c["grad"]) for t in (q, k, v)]
    ref, ref_lse, ref_grads = run(ref_leaves, ref_params, lambda *x: score_attention(
        *x, **okw, **ref_terms, dropout_keep=keep, dropout_p=drop))
    low_leaves = [t.detach().requires_grad_(c["grad"]) for t in (q, k, v)]
    low_terms, low_params = score_kwargs(c, "call")
    low, _, low_grads = run(low_leaves, low_params, lambda *x: score_attention(
        *x, **okw, **low_terms, dtype=dtype, dropout_keep=keep, dropout_p=drop))
    cond = _score_cond(q, k, kw, ref_terms)
    amax = {n: (t.double().abs().max().item() if t.numel() else 0.0) for n, t in zip("qkv", (q, k, v))}
    inv_keep = 1.0 / (1.0 - drop)
    _rel_judge(out.detach(), ref.detach(), low.detach(), 2, dtype, "out", cond, terms=amax["v"] * inv_keep)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf pattern differs from the oracle's"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        tol = 1e-3 * max(1.0, ref_lse[fin].abs().max().item())
        err = (lse.detach().double()[fin] - ref_lse.detach()[fin]).abs().max().item()
        assert err <= tol, f"lse differs from the oracle's by {err}"
    vis = visibility(Lq, Lk, causal=kw.get("causal", False), window=kw.get("window"), layout=kw.get("layout"),
                     key_padding_mask=kw.get("key_padding_mask"), B=B, H=H, positions=kw.get("positions"),
                     cu_seqlens=kw.get("cu_seqlens"))
    empty = ~vis.any(-1) | torch.isneginf(ref_lse.detach())
    assert bool((out.detach()[empty] == 0).all()), "a row that sees no key is not exactly 0"
    if grads:
        gmax, glmax = go.abs().max().item(), gl.abs().max().item()
        sc_ = abs(kw.get("scale", 1.0 / math.sqrt(D)))
        dt_size = 2 * gmax * amax["v"] * inv_keep + glmax          # |dP - Delta| at most
        names = [n for n, t in zip("qkv", leaves) if t.requires_grad] + [f"d{i}" for i in range(len(params))]
        sizes = {"q": sc_ * amax["k"] * dt_size, "k": sc_ * amax["q"] * dt_size, "v": gmax * inv_keep}
        for name, g_, rg, lg in zip(names, grads, ref_grads, low_grads):
            pdt = dtype if name in sizes else max(dtype, sc["pdtype"], key=lambda t: torch.finfo(t).eps)
            assert g_.dtype == (dtype if name in sizes else sc["pdtype"]), f"d{name}: dtype {g_.dtype}"
            # a term's gradient sums dT (times |d|, 1 / ramp...) over pairs: judged on at least one pair's size
            size = sizes.get(name, max(dt_size, rg.abs().max().item() if rg.numel() else 0.0))
            _rel_judge(g_, rg, lg, 3, pdt, f"d{name}", cond, terms=size)
    with torch.no_grad():
        check_score_properties(unit, c, q, k, v, kw, score_kwargs(c, "call", grad=False)[0])
    return "score: judged"


def check_score_properties(unit, c, q, k, v, kw, terms):
    """return_lse does not change out; keys no query sees (whatever they hold) change nothing; batch
    permutation (per-batch terms permuted along) and GQA = expanded K / V (`check_batch_and_gqa`)."""
    full = {**kw, **terms}

    def again(q_, k_, v_, kw_=full, **extra):
        torch.manual_seed(c["seed"])
        return _call(unit, q_, k_, v_, kw_, **extra)

    out = again(q, k, v)
    assert torch.equal(again(q, k, v, return_lse=True)[0], out), "return_lse=True changed out"
    unseen = _unseen_keys(c)
    if c["poison"] is not None and unseen.any():
        kp, vp = k.clone(), v.clone()
        clean = again(q, kp, vp)
        kp[unseen] = c["poison"]
        vp[unseen] = c["poison"]
        assert torch.equal(again(q, kp, vp), clean), f"keys no query sees (holding {c['poison']}) changed out"
    check_batch_and_gqa(unit, c, q, k, v, full, out, again, _score_cond(q, k, kw, terms))


# ------------------------------------------------------------------------------ linear attention

@st.composite
def linear_calls(draw, unit):
    small = unit.interpreted
    dtype = draw(st.sampled_from(_dtypes(unit)))
    B = draw(st.integers(0 if not small else 1, 2))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.sampled_from([1, 2]))
    Lmax = 40 if small else 80
    Lq = draw(st.integers(0 if not small else 1, Lmax))
    Lk = Lq if draw(st.booleans()) else draw(st.integers(0 if not small else 1, Lmax))
    hd = st.sampled_from([1, 3, 8, 16, 33, 64]) if not small else st.sampled_from([1, 8, 16, 24])
    D = draw(hd)
    Dv = D if draw(st.booleans()) else draw(hd)
    return dict(dtype=dtype, shape=(B, H, Hkv, Lq, Lk, D, Dv), causal=draw(st.booleans()),
                fmap=draw(st.sampled_from(["elu", "relu", "elu"])), normalize=draw(st.booleans()),
                eps=draw(st.sampled_from([1e-6, 1e-3, 1.0])), state=draw(st.booleans()),
                grad=draw(st.booleans()), view=draw(st.sampled_from(["contiguous", "transposed", "strided"])),
                mag=10.0 ** draw(st.integers(-2, 0)), seed=draw(st.integers(0, 2**31)))


def linear_oracle(q, k, v, phi, causal, normalize, eps, state, dtype=torch.float64):
    """Linear attention in its quadratic form with an initial state, in `dtype`."""
    num, d = _linear_parts(q, k, v, phi, causal, normalize, eps, state, dtype)
    if d is None:
        return num
    return torch.where(d == 0, torch.zeros_like(num), num / torch.where(d == 0, torch.ones_like(d), d))


def linear_grad_terms(leaves, go, phi, causal, normalize, eps, state):
    """Per leaf of q, k, v: the largest |gradient| of the two terms that d(num / den) sums before
    they cancel (num' / den and num den' / den^2), in float64: the scale a gradient's rounding is
    judged on (with eps small a gradient is a difference of terms ~1e6 times its size)."""
    num, d = _linear_parts(*leaves, phi, causal, normalize, eps, state, torch.float64)
    if d is None:
        return [None] * 3
    d_ = torch.where(d == 0, torch.ones_like(d), d)
    sizes = []
    for part in (num / d_.detach(), num.detach() / d_):
        sizes.append([0.0 if g is None else g.abs().max().item() if g.numel() else 0.0
                      for g in torch.autograd.grad((part * go).sum(), leaves, allow_unused=True,
                                                   retain_graph=True)])
    return [max(a, b) for a, b in zip(*sizes)]


def _linear_parts(q, k, v, phi, causal, normalize, eps, state, dtype):
    """(numerator, denominator + eps or None without normalization) of linear attention."""
    fq, fk = phi(q.to(dtype)).to(dtype), phi(k.to(dtype)).to(dtype)
    G = q.shape[1] // k.shape[1]
    fk, v = fk.repeat_interleave(G, 1), v.to(dtype).repeat_interleave(G, 1)
    a = fq @ fk.transpose(-1, -2)
    if causal:
        a = a * visibility(q.shape[2], k.shape[2], causal=True).to(a.device)
    num, den = a @ v, a.sum(-1, keepdim=True)
    if state is not None:
        num = num + fq @ state[0].to(dtype)
        den = den + (fq * state[1].to(dtype)[:, :, None, :]).sum(-1, keepdim=True)
    return num, (den + eps if normalize else None)


test_linear_attention_fuzz, test_linear_attention_campaign = fuzz_tests(
    LINEAR_UNITS, linear_calls, lambda u, c: check_linear(u, c), repr, b"linear-")


def check_linear(unit, c):
    B, H, Hkv, Lq, Lk, D, Dv = c["shape"]
    dtype = c["dtype"]
    g = torch.Generator().manual_seed(c["seed"])
    q = _make((B, H, Lq, D), dtype, c["mag"], c["view"], g)
    k = _make((B, Hkv, Lk, D), dtype, c["mag"], c["view"], g)
    v = _make((B, Hkv, Lk, Dv), dtype, c["mag"], c["view"], g)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    state = None
    if c["state"]:
        state = (torch.rand(B, H, D, Dv, generator=g, dtype=torch.float64).to(cdt),
                 (torch.rand(B, H, D, generator=g, dtype=torch.float64) + 1).to(cdt))
    kw = dict(causal=c["causal"], feature_map=c["fmap"], normalize=c["normalize"], eps=c["eps"])
    leaves = [t.detach().requires_grad_(c["grad"]) for t in (q, k, v)]
    with unit.enter():                # asked as called: a forward-only row refuses inputs needing gradients
        if not effattn.explain(*leaves, op="linear_attention", initial_state=state, **kw).can_serve(unit.backend):
            with pytest.raises((TypeError, ValueError)):
                effattn.linear_attention(*leaves, initial_state=state, backend=unit.backend, **kw)
            return "refused"
    ctx = contextlib.nullcontext() if c["grad"] else torch.no_grad()
    with ctx, unit.enter():
        out = effattn.linear_attention(*leaves, initial_state=state, backend=unit.backend, **kw)
    assert out.dtype == dtype and tuple(out.shape) == (B, H, Lq, Dv)
    phi = feature_map(c["fmap"])
    ref_leaves = [t.detach().double().requires_grad_(c["grad"]) for t in (q, k, v)]
    ref = linear_oracle(*ref_leaves, phi, c["causal"], c["normalize"], c["eps"], state)
    low_leaves = [t.detach().requires_grad_(c["grad"]) for t in (q, k, v)]
    low = linear_oracle(*low_leaves, phi, c["causal"], c["normalize"], c["eps"], state,
                        dtype=dtype if dtype != torch.float16 else torch.float16)
    _rel_judge(out, ref, low, 2, dtype, "out")
    if c["grad"] and out.numel():
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(c["seed"] + 1), dtype=torch.float64)
        grads = torch.autograd.grad(out, leaves, go.to(out.dtype), allow_unused=True)
        ref_grads = torch.autograd.grad(ref, ref_leaves, go, allow_unused=True)
        low_grads = torch.autograd.grad(low, low_leaves, go.to(low.dtype), allow_unused=True)
        terms = linear_grad_terms([t.detach().double().requires_grad_() for t in (q, k, v)], go, phi, c["causal"],
                                  c["normalize"], c["eps"], state)
        for name, g_, rg, lg, t in zip("qkv", grads, ref_grads, low_grads, terms):
            if rg is None:
                continue
            t = None if t is None or not rg.numel() else max(t, rg.abs().max().item())
            _rel_judge(g_ if g_ is not None else torch.zeros_like(rg), rg,
                       lg if lg is not None else torch.zeros_like(rg), 3, dtype, f"d{name}", terms=t)
    with torch.no_grad(), unit.enter():
        again = effattn.linear_attention(q, k, v, initial_state=state, backend=unit.backend, **kw)
    assert torch.equal(again, out.detach()), "linear attention is not bitwise deterministic"


# ------------------------------------------------------------------------------ paged attention

PAGED_UNITS = [pytest.param(u, id=u.name) for u in runnable_units("paged_attention")]


@st.composite
def paged_calls(draw, unit):
    dtype = draw(st.sampled_from(_dtypes(unit)))
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.sampled_from([1, 2, 4]))
    Lq = draw(st.sampled_from([1, 1, 2, 5, 16, 20]))        # <= 16: decode-shaped (packed with GQA), 20: not
    page_size = draw(st.sampled_from([1, 3, 16]))
    lens = [draw(st.integers(0, 90)) for _ in range(B)]
    hd = st.sampled_from([1, 3, 8, 16, 24, 64])
    D = draw(hd)
    Dv = D if draw(st.booleans()) else draw(hd)
    kw = {"causal": draw(st.booleans())}
    _draw_window(draw, kw, 40)
    mag = _draw_scale_and_magnitude(draw, kw, dtype)
    return dict(dtype=dtype, B=B, H=H, Hkv=Hkv, Lq=Lq, D=D, Dv=Dv, page_size=page_size, lens=lens,
                spare_cols=draw(st.integers(0, 2)), spare_pages=draw(st.integers(0, 3)),
                unused=draw(st.sampled_from(["minus-one", "page"])), kw=kw, mag=mag,
                view=draw(st.sampled_from(["contiguous", "strided"])),
                poison=draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30])),
                seed=draw(st.integers(0, 2**31)))


def _paged_inputs(c):
    """q, the page pools (pages scattered over the pool, spare pages no table lists), the table (unused
    entries -1 or a page) and seqlens of a drawn call."""
    g = torch.Generator().manual_seed(c["seed"])
    B, ps, lens = c["B"], c["page_size"], c["lens"]
    pages = [-(-n // ps) for n in lens]
    num_pages = sum(pages) + c["spare_pages"] + 1
    perm = torch.randperm(num_pages, generator=g)
    table = torch.full((B, max(pages) + c["spare_cols"] + 1), -1, dtype=torch.int32)
    if c["unused"] == "page":
        table.fill_(int(perm[-1]))
    used = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[used:used + p].to(torch.int32)
        used += p
    dt, mag, Hkv = c["dtype"], c["mag"], c["Hkv"]

    def make(*shape):
        x = torch.randn(*shape[:-1], 2 * shape[-1], generator=g, dtype=torch.float64) * mag
        return (x[..., ::2] if c["view"] == "strided" else x[..., :shape[-1]].contiguous()).to(dt)
    return (make(B, c["H"], c["Lq"], c["D"]), make(num_pages, ps, Hkv, c["D"]), make(num_pages, ps, Hkv, c["Dv"]),
            table, torch.tensor(lens, dtype=torch.int32))


def _paged_seen(c, table):
    """bool (num_pages, page_size): the slots some query of the call sees (each page belongs to one sequence)."""
    num_pages = sum(-(-n // c["page_size"]) for n in c["lens"]) + c["spare_pages"] + 1
    seen = torch.zeros(num_pages, c["page_size"], dtype=torch.bool)
    for b, n in enumerate(c["lens"]):
        if n == 0:
            continue
        vis = visibility(c["Lq"], n, causal=c["kw"]["causal"], window=c["kw"].get("window")).reshape(-1, n).any(0)
        j = torch.arange(n)[vis]
        seen[table[b, j // c["page_size"]].long(), j % c["page_size"]] = True
    return seen


test_paged_attention_fuzz, test_paged_attention_campaign = fuzz_tests(
    PAGED_UNITS, paged_calls, lambda u, c: check_paged(u, c), repr, b"paged-")


def check_paged(unit, c):
    """Each sequence against the float64 oracle on its own keys (bottom-right); bitwise determinism;
    invariance to the slots no query sees (past seqlens, outside every window, pages no table lists);
    batch permutation; Triton: the split-KV path (splits of 64 keys) too."""
    from effattn.backends.triton.paged.launch import paged_forward
    q, kp, vp, table, seqlens = _paged_inputs(c)
    kw, dtype, ps = c["kw"], c["dtype"], c["page_size"]
    B, H, Lq, Dv = c["B"], c["H"], c["Lq"], c["Dv"]

    def run(q_, kp_, vp_, table_=table, seqlens_=seqlens):
        with torch.no_grad(), unit.enter():
            return effattn.attention(q_, kp_, vp_, block_table=table_, seqlens=seqlens_, return_lse=True,
                                     backend=unit.backend, **kw)
    out, lse = run(q, kp, vp)
    assert out.dtype == dtype and tuple(out.shape) == (B, H, Lq, Dv) and lse.shape == (B, H, Lq)
    o2, l2 = run(q, kp, vp)
    assert torch.equal(o2, out) and torch.equal(l2, lse), "not bitwise deterministic"
    results = [("out", out, lse)]
    left, right = effattn.visibility.normalize_window(kw.get("window"), kw["causal"])
    scale = kw.get("scale", 1.0 / math.sqrt(c["D"]))
    if unit.backend == "triton" and Lq <= 16:
        results.append(("split out", *paged_forward(q, kp, vp, table, seqlens, left, right, scale, keys_per_split=64)))
    for b, n in enumerate(c["lens"]):
        t = torch.arange(n)
        pg = table[b, t // ps].long()
        k = kp[pg, t % ps].permute(1, 0, 2)[None]
        v = vp[pg, t % ps].permute(1, 0, 2)[None]
        qb = q[b:b + 1]
        okw = dict(causal=kw["causal"], window=kw.get("window"), scale=kw.get("scale"))
        ref, ref_lse = naive_attention(qb.double(), k.double(), v.double(), **okw)
        low, _ = naive_attention(qb, k, v, **okw, dtype=dtype)
        cond = _score_size(qb, k, kw)
        amax_v = v.double().abs().max().item() if v.numel() else 0.0
        for what, o, l_ in results:
            _rel_judge(o[b:b + 1], ref, low, 2, dtype, f"{what} (sequence {b}, {n} keys)", cond, terms=amax_v)
            assert torch.equal(torch.isneginf(l_[b:b + 1]), torch.isneginf(ref_lse)), f"{what}: lse -inf pattern"
            fin = torch.isfinite(ref_lse)
            if fin.any():
                tol = 1e-3 * max(1.0, ref_lse[fin].abs().max().item())
                assert (l_[b:b + 1].double()[fin] - ref_lse[fin]).abs().max().item() <= tol, f"{what}: lse"
            assert bool((o[b:b + 1][torch.isneginf(ref_lse)] == 0).all()), f"{what}: a row that sees no key is not 0"
    unseen = ~_paged_seen(c, table)
    if unseen.any():
        kc, vc = kp.clone(), vp.clone()        # (a clone of a strided view is contiguous: compare clones)
        kb, vb = kp.clone(), vp.clone()
        kb[unseen], vb[unseen] = c["poison"], c["poison"]
        assert torch.equal(run(q, kb, vb)[0], run(q, kc, vc)[0]), f"slots no query sees (holding {c['poison']}) changed out"
        if len(results) > 1:
            split = [paged_forward(q, k_, v_, table, seqlens, left, right, scale, keys_per_split=64)[0]
                     for k_, v_ in ((kb, vb), (kc, vc))]
            assert torch.equal(*split), f"split: slots no query sees (holding {c['poison']}) changed out"
    if B > 1:
        perm = torch.arange(B - 1, -1, -1)
        o_p = run(q[perm], kp, vp, table[perm], seqlens[perm])[0]
        if unit.backend == "triton":               # a program reads its own sequence only: bitwise
            assert torch.equal(o_p, out[perm]), "batch permutation"
        else:   # torch/cpu-blocks computes slices of batch entries by position (one bmm each): to rounding
            tol = {torch.float64: 1e-13, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
            torch.testing.assert_close(o_p.double(), out[perm].double(), rtol=tol, atol=tol * max(1.0, out.abs().max().item()),
                                       msg=lambda m: f"batch permutation: {m}")


# ------------------------------------------------------------------------------ invalid arguments

BAD = {
    # name -> (the argument the message must name, how to corrupt a valid call)
    "scale-nan": ("scale", lambda a: a[3].update(scale=float("nan"))),
    "scale-inf": ("scale", lambda a: a[3].update(scale=float("inf"))),
    "scale-str": ("scale", lambda a: a[3].update(scale="0.1")),
    "dropout-one": ("dropout_p", lambda a: a[3].update(dropout_p=1.0)),
    "dropout-negative": ("dropout_p", lambda a: a[3].update(dropout_p=-0.1)),
    "causal-int": ("causal", lambda a: a[3].update(causal=1)),
    "window-negative": ("window", lambda a: a[3].update(window=-2)),
    "window-triple": ("window", lambda a: a[3].update(window=(1, 2, 3))),
    "window-float": ("window", lambda a: a[3].update(window=2.5)),
    "kpm-float": ("key_padding_mask", lambda a: a[3].update(key_padding_mask=torch.zeros(a[0].shape[0],
                                                                                          a[1].shape[2]))),
    "kpm-shape": ("key_padding_mask", lambda a: a[3].update(key_padding_mask=torch.zeros(a[0].shape[0],
                                                                                          a[1].shape[2] + 1,
                                                                                          dtype=torch.bool))),
    "layout-type": ("layout", lambda a: a[3].update(layout=torch.ones(1, 1, 1, dtype=torch.bool))),
    "layout-shape": ("layout", lambda a: a[3].update(layout=BlockLayout(torch.ones(1, 7, 7, dtype=torch.bool), 16))),
    "backend-name": ("backend", lambda a: a[3].update(backend="tritn")),
    "unknown-keyword": ("is_causal", lambda a: a[3].update(is_causal=True)),
    "q-3d": ("q", lambda a: a.__setitem__(0, a[0][0])),
    "v-dtype": ("v", lambda a: a.__setitem__(2, a[2].to(torch.float16))),
    "k-headdim": ("head dim", lambda a: a.__setitem__(1, torch.zeros(*a[1].shape[:3], a[1].shape[3] + 1))),
    "gqa-ratio": ("heads", lambda a: a.__setitem__(0, torch.zeros(a[0].shape[0], 3, *a[0].shape[2:]))),
    "q-int": ("dtype", lambda a: a.__setitem__(0, a[0].to(torch.int32))),
    "headdim-zero": ("head dim", lambda a: a.__setitem__(2, torch.zeros(*a[2].shape[:3], 0))),
    "headdim-257": ("head dim", lambda a: a.__setitem__(0, torch.zeros(*a[0].shape[:3], 257))),
    # packed sequences, positions, out_dtype (issue 23's arguments); `_packed_one` makes the call one packed row
    "cu-int64": ("cu_seqlens", lambda a: a[3].update(cu_seqlens=torch.tensor([0, a[1].shape[2]]))),
    "cu-last": ("cu_seqlens", lambda a: _packed_one(a, cu_seqlens=_i32(0, a[1].shape[2] + 1))),
    "cu-first": ("cu_seqlens", lambda a: _packed_one(a, cu_seqlens=_i32(1, a[1].shape[2]))),
    "cu-decreasing": ("cu_seqlens", lambda a: _packed_one(a, cu_seqlens=_i32(0, a[1].shape[2] + 1, a[1].shape[2]))),
    "cu-2d": ("cu_seqlens", lambda a: _packed_one(a, cu_seqlens=_i32(0, a[1].shape[2])[None])),
    "cu-triple": ("cu_seqlens", lambda a: _packed_one(a, cu_seqlens=(_i32(0, a[1].shape[2]),) * 3)),
    "cu-batch": ("cu_seqlens", lambda a: _packed_one(a, 2, cu_seqlens=_i32(0, a[1].shape[2]))),
    "cu-padding": ("key_padding_mask", lambda a: _packed_one(a, cu_seqlens=_i32(0, a[1].shape[2]),
                                                             key_padding_mask=torch.ones(1, a[1].shape[2],
                                                                                         dtype=torch.bool))),
    "max-seqlen-negative": ("max_seqlen", lambda a: _packed_one(a, cu_seqlens=_i32(0, a[1].shape[2]), max_seqlen=-1)),
    "max-seqlen-float": ("max_seqlen", lambda a: _packed_one(a, cu_seqlens=_i32(0, a[1].shape[2]), max_seqlen=2.0)),
    "max-seqlen-triple": ("max_seqlen", lambda a: _packed_one(a, cu_seqlens=_i32(0, a[1].shape[2]),
                                                              max_seqlen=(a[1].shape[2],) * 3)),
    "max-seqlen-alone": ("max_seqlen", lambda a: a[3].update(max_seqlen=a[1].shape[2])),
    "positions-negative": ("positions", lambda a: a[3].update(positions=(-1, 0))),
    "positions-float": ("positions", lambda a: a[3].update(positions=(0, 1.5))),
    "positions-single": ("positions", lambda a: a[3].update(positions=(3,))),
    "positions-packed": ("positions", lambda a: _packed_one(a, cu_seqlens=_i32(0, a[1].shape[2]), positions=(0, 0))),
    "out-dtype-half": ("out_dtype", lambda a: a[3].update(out_dtype=torch.float16)),
    "out-dtype-str": ("out_dtype", lambda a: a[3].update(out_dtype="float32")),
}


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _packed_one(a, batch=1, **kw):
    """Makes the call of `a` one packed row (batch 1; or `batch` copies of it) with the keywords `kw`."""
    a[:3] = [torch.cat([t[:1]] * batch) for t in a[:3]]
    a[3].update(kw)


@settings(settings.get_profile("effattn"), max_examples=100)
@seed(SEED)
@given(bad=st.sampled_from(sorted(BAD)), B=st.integers(1, 2), L=st.integers(1, 20), D=st.sampled_from([4, 8]))
def test_invalid_arguments_name_the_argument(bad, B, L, D):
    q, k, v = torch.randn(B, 2, L, D), torch.randn(B, 2, L, D), torch.randn(B, 2, L, D)
    args = [q, k, v, {}]
    name, corrupt = BAD[bad]
    corrupt(args)
    with pytest.raises((TypeError, ValueError)) as info:
        effattn.attention(args[0], args[1], args[2], **args[3])
    assert name in str(info.value), f"{bad}: the error does not name {name!r}: {info.value}"


PAGED_BAD = {
    # name -> (what the message must name, how to corrupt a valid paged call: a dict of q, k_pages,
    # v_pages, block_table, seqlens and the other keywords)
    "table-float": ("block_table", lambda a: a.update(block_table=a["block_table"].float())),
    "table-list": ("block_table", lambda a: a.update(block_table=a["block_table"].tolist())),
    "table-1d": ("block_table", lambda a: a.update(block_table=a["block_table"][0])),
    "table-rows": ("block_table", lambda a: a.update(block_table=a["block_table"][:-1])),
    "table-past-pool": ("block_table", lambda a: a["block_table"].__setitem__((0, 0), a["k_pages"].shape[0])),
    "table-negative": ("block_table", lambda a: a["block_table"].__setitem__((0, 0), -2)),
    "seqlens-float": ("seqlens", lambda a: a.update(seqlens=a["seqlens"].float())),
    "seqlens-list": ("seqlens", lambda a: a.update(seqlens=a["seqlens"].tolist())),
    "seqlens-negative": ("seqlens", lambda a: a["seqlens"].__setitem__(0, -1)),
    "seqlens-past-table": ("seqlens", lambda a: a["seqlens"].__setitem__(
        0, a["block_table"].shape[1] * a["k_pages"].shape[1] + 1)),
    "seqlens-rows": ("seqlens", lambda a: a.update(seqlens=a["seqlens"][:-1])),
    "seqlens-missing": ("seqlens", lambda a: a.update(seqlens=None)),
    "pages-dtype": ("k_pages", lambda a: a.update(k_pages=a["k_pages"].double())),
    "pages-3d": ("k_pages", lambda a: a.update(k_pages=a["k_pages"][0])),
    "pages-headdim": ("head dim", lambda a: a.update(k_pages=a["k_pages"][..., :1])),
    "pages-disagree": ("v_pages", lambda a: a.update(v_pages=a["v_pages"][:-1])),
    "pages-heads": ("heads", lambda a: a.update(q=torch.cat([a["q"], a["q"][:, :1]], 1))),
    "paged-padding": ("key_padding_mask", lambda a: a.update(key_padding_mask=torch.zeros(
        a["q"].shape[0], 4, dtype=torch.bool))),
    "paged-dropout": ("dropout_p", lambda a: a.update(dropout_p=0.1)),
    "paged-window": ("window", lambda a: a.update(window=-1)),
}


@settings(settings.get_profile("effattn"), max_examples=60)
@seed(SEED)
@given(bad=st.sampled_from(sorted(PAGED_BAD)), B=st.integers(1, 2), ps=st.sampled_from([1, 4]),
       n=st.integers(1, 9))
def test_paged_invalid_arguments_name_the_argument(bad, B, ps, n):
    pages = -(-n // ps)
    a = dict(q=torch.randn(B, 2, 1, 8), k_pages=torch.randn(B * pages, ps, 2, 8), v_pages=torch.randn(B * pages, ps, 2, 8),
             block_table=torch.arange(B * pages, dtype=torch.int32).reshape(B, pages),
             seqlens=torch.full((B,), n, dtype=torch.int32))
    name, corrupt = PAGED_BAD[bad]
    corrupt(a)
    with pytest.raises((TypeError, ValueError)) as info:
        effattn.attention(a.pop("q"), a.pop("k_pages"), a.pop("v_pages"), **a)
    assert name in str(info.value), f"{bad}: the error does not name {name!r}: {info.value}"


LINEAR_BAD = {
    "eps-negative": ("eps", lambda a: a[3].update(eps=-1e-6)),
    "eps-nan": ("eps", lambda a: a[3].update(eps=float("nan"))),
    "eps-str": ("eps", lambda a: a[3].update(eps="1e-6")),
    "causal-int": ("causal", lambda a: a[3].update(causal=1)),
    "normalize-none": ("normalize", lambda a: a[3].update(normalize=None)),
    "return-state-int": ("return_state", lambda a: a[3].update(return_state=0)),
    "feature-map-name": ("feature_map", lambda a: a[3].update(feature_map="softmax")),
    "feature-map-width": ("feature_map", lambda a: a[3].update(feature_map=lambda x: x.sum(-1))),
    "state-single": ("initial_state", lambda a: a[3].update(initial_state=torch.zeros(1))),
    "state-shape": ("initial_state", lambda a: a[3].update(initial_state=(torch.zeros(1, 1, 1, 1), torch.zeros(1)))),
    "state-int": ("initial_state", lambda a: a[3].update(
        initial_state=(torch.zeros(a[0].shape[0], 2, a[0].shape[3], a[2].shape[3], dtype=torch.int32),
                       torch.zeros(a[0].shape[0], 2, a[0].shape[3], dtype=torch.int32)))),
    "backend-name": ("backend", lambda a: a[3].update(backend="cud")),
    "unknown-keyword": ("window", lambda a: a[3].update(window=4)),
    "v-batch": ("batch", lambda a: a.__setitem__(2, torch.zeros(a[2].shape[0] + 1, *a[2].shape[1:]))),
}


@settings(settings.get_profile("effattn"), max_examples=40)
@seed(SEED)
@given(bad=st.sampled_from(sorted(LINEAR_BAD)), B=st.integers(1, 2), L=st.integers(1, 20), D=st.sampled_from([4, 8]))
def test_linear_invalid_arguments_name_the_argument(bad, B, L, D):
    q, k, v = torch.randn(B, 2, L, D), torch.randn(B, 2, L, D), torch.randn(B, 2, L, D)
    args = [q, k, v, {}]
    name, corrupt = LINEAR_BAD[bad]
    corrupt(args)
    with pytest.raises((TypeError, ValueError)) as info:
        effattn.linear_attention(args[0], args[1], args[2], **args[3])
    assert name in str(info.value), f"{bad}: the error does not name {name!r}: {info.value}"


# (after `score_calls`: the attention strategy draws score terms in one call of three)
test_attention_fuzz, test_attention_campaign = fuzz_tests(ATTN_UNITS, score_calls, lambda u, c: check_attention(u, c),
                                                          _describe_attention, b"")
