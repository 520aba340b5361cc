"""Generic checks generated from the registry: every registered path (one row of
`effattn.backends.base`) that can run here goes through the same checks, called directly (not
through dispatch), on a small call it admits:

- it matches the float64 oracle (output, and the log-sum-exp of softmax attention);
- it repeats bitwise (determinism);
- strided inputs (views of ``(B, L, H, 2D)`` tensors) give what contiguous ones give;
- empty shapes (``Lq = 0``, ``Lk = 0``, ``B = 0``): served with the right shapes and finite values
  (``Lk = 0``: output 0, lse -inf), or refused with a reason that explain shows;
- explain lists the row, with no reason, for that call.

Triton rows run in Triton's interpreter on CPU, CUDA rows through the kernels' host emulation (the
`emulation` fixture). A new path is picked up by being registered; test-only rows (`EXTRA`, e.g.
`paths_example`) are registered by the `registered` fixture for the test that uses them.
"""
import shutil

import pytest
import torch

import effattn
from effattn import splits
from effattn._call import make_attn_call, make_linear_call
from effattn.backends import base
from effattn.testing.oracle import chunked_linear_attention, feature_map, naive_attention, score_attention
from tests.conftest import DEVICE, random_qkv
from tests.contract import paths_example

OPS = ("attention", "linear_attention")
EXTRA = [paths_example.PATH]             # test-only rows: one line each


def _runs_here(p) -> bool:
    if DEVICE.type not in p.caps.devices:
        return False
    if p.backend == "cuda" and DEVICE.type == "cpu":
        return shutil.which("g++") is not None          # the emulation, built by the fixture
    return p.available(DEVICE) is None


PATHS = {p.name: p for p in [p for op in OPS for p in base.rows(op)] + EXTRA if _runs_here(p)}
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# candidate calls, tried in order until the path admits one: (B, H, Hkv, Lq, Lk, D, Dv, kwargs)
CANDIDATES = {
    "attention": [(1, 2, 2, 9, 9, 8, 8, dict(causal=True)),
                  (1, 4, 2, 2, 40, 16, 16, dict(causal=True)),            # decode-shaped
                  (1, 2, 2, 9, 12, 8, 8, dict(causal=True, window=(3, 0))),
                  (1, 2, 2, 9, 12, 8, 8, dict(causal=True, softcap=4.0)),      # a score term
                  # packed sequences: segments of 4 and 6 tokens (and an empty one)
                  (1, 2, 2, 10, 10, 8, 8, dict(causal=True, cu_seqlens=torch.tensor([0, 4, 4, 10], dtype=torch.int32)))],
    "linear_attention": [(1, 2, 2, 9, 9, 8, 8, dict(causal=True)),
                         (1, 4, 2, 1, 1, 8, 8, dict(causal=True))],       # one token
}


@pytest.fixture
def registered(monkeypatch):
    """Registers the test-only rows (on a copy of the registry, restored after the test)."""
    monkeypatch.setattr(base, "_REGISTRY", {op: {n: base.Backend(b.name, b.op, list(b.paths)) for n, b in t.items()}
                                            for op, t in base._REGISTRY.items()})
    for p in EXTRA:
        base.register(p)


@pytest.fixture(params=sorted(PATHS))
def path(request, registered, monkeypatch):
    p = PATHS[request.param]
    if p.backend == "cuda" and DEVICE.type == "cpu":
        request.getfixturevalue("emulation")
    # the split-KV decode's threshold lowered so that its rows admit a small call
    monkeypatch.setattr(splits, "DECODE_MIN_KEYS", 32)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))           # the slice-parallel CPU path needs two to split
    yield p
    torch.set_num_threads(threads)


def _dtype(p):
    return next(d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64) if d in p.caps.dtypes)


def _make(op, q, k, v, kw):
    return (make_attn_call if op == "attention" else make_linear_call)(q, k, v, **kw)


def _admitted(p, seed=0):
    """(q, k, v, kwargs, call) of the first candidate the path admits."""
    dtype = _dtype(p)
    for B, H, Hkv, Lq, Lk, D, Dv, kw in CANDIDATES[p.op]:
        q, k, v = random_qkv(B, H, Hkv, Lq, Lk, D, Dv, torch.Generator().manual_seed(seed), dtype)
        call = _make(p.op, q, k, v, kw)
        if not p.reasons(call):
            return q, k, v, kw, call
    pytest.fail(f"{p.name} admits none of the candidate calls: add one to CANDIDATES")


def _oracle(op, q, k, v, kw):
    if op == "attention":
        fn = score_attention if any(t in kw for t in ("softcap", "sinks", "bias")) else naive_attention
        return fn(q.double(), k.double(), v.double(), **kw)
    out = chunked_linear_attention(q.double(), k.double(), v.double(), torch.zeros(*q.shape[:3], v.shape[3]),
                                   feature_map("elu"), causal=kw.get("causal", False))[0]
    return out, None


def _check(p, got, q, k, v, kw):
    out, lse = _oracle(p.op, q, k, v, kw)
    tol = TOL[q.dtype]
    assert got[0].shape == out.shape and got[0].dtype == q.dtype, (got[0].shape, got[0].dtype)
    torch.testing.assert_close(got[0].double(), out, atol=tol, rtol=tol)
    if lse is not None:
        torch.testing.assert_close(got[1].double(), lse, atol=tol, rtol=tol)


def test_every_registered_row_is_checked_here():
    """Every row of the registry that declares this device is in PATHS (the CUDA rows on a CPU need
    g++ for the emulation), plus the test-only rows."""
    declared = [p for op in OPS for p in base.rows(op) if DEVICE.type in p.caps.devices]
    for p in declared:
        if p.name not in PATHS:          # only for want of a dependency, never silently
            assert p.available(DEVICE) or (p.backend == "cuda" and shutil.which("g++") is None), p.name
    assert {"torch/reference", "torch/cpu-blocks", "torch/linear-chunked"} <= set(PATHS)
    assert paths_example.PATH.name in PATHS


def test_the_example_path_is_picked_up_and_dispatched(registered):
    """The test-only row is one module plus one line (EXTRA); registered, it is a row like any
    other: explain lists it, the named backend can take it, and the generic checks run on it (the
    parametrized tests below carry its name)."""
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    ex = effattn.explain(q, k, v, causal=True)
    assert ex.row("torch/test-dense").reasons == [] and ex.row("torch/test-dense").rank == 1000
    assert "torch/test-dense" in [p.name for p in base._REGISTRY["attention"]["torch"].paths]
    assert "torch/test-dense" in PATHS


def test_oracle(path):
    q, k, v, kw, call = _admitted(path)
    with torch.no_grad():
        got = path.run(call)
    _check(path, got, q, k, v, kw)


def test_deterministic(path):
    _, _, _, _, call = _admitted(path)
    with torch.no_grad():
        a, b = path.run(call), path.run(call)
    assert torch.equal(a[0], b[0])
    if a[1] is not None and isinstance(a[1], torch.Tensor):
        assert torch.equal(a[1], b[1])


def _strided(t):
    """The values of t in (B, L, H, 2D) memory: a view with every stride changed."""
    B, H, L, D = t.shape
    x = torch.zeros(B, L, H, 2 * D, dtype=t.dtype)
    x[..., :D] = t.transpose(1, 2)
    return x[..., :D].transpose(1, 2)


def test_strides(path):
    """Strided views give the values contiguous inputs give (and match the oracle)."""
    q, k, v, kw, call = _admitted(path)
    tq, tk, tv = (_strided(t) for t in (q, k, v))
    tcall = _make(path.op, tq, tk, tv, kw)
    assert not tq.is_contiguous() and torch.equal(tq, q)
    if path.reasons(tcall):
        pytest.fail(f"{path.name} admits the contiguous call but not its strided twin: {path.reasons(tcall)}")
    with torch.no_grad():
        got, want = path.run(tcall), path.run(call)
    torch.testing.assert_close(got[0], want[0], atol=TOL[q.dtype], rtol=TOL[q.dtype])
    _check(path, got, tq, tk, tv, kw)


@pytest.mark.parametrize("empty", ["Lq=0", "Lk=0", "B=0"])
def test_empty_shapes(path, empty):
    q, k, v, kw, _ = _admitted(path)
    if empty == "Lq=0":
        q = q[:, :, :0]
    elif empty == "Lk=0":
        k, v = k[:, :, :0], v[:, :, :0]
    else:
        q, k, v = q[:0], k[:0], v[:0]
    cu = kw.get("cu_seqlens")
    if cu is not None:                              # packed: the emptied side's segments are all empty
        if empty == "B=0":
            with pytest.raises(ValueError, match="packed as"):
                _make(path.op, q, k, v, kw)
            return
        none = torch.zeros_like(cu)
        kw = dict(kw, cu_seqlens=(none, cu) if empty == "Lq=0" else (cu, none))
    call = _make(path.op, q, k, v, kw)
    why = path.reasons(call)
    if why:                                         # refused: explain says why on the row's line
        assert why == effattn.explain(q, k, v, op=path.op, **kw).row(path.name).reasons
        return
    with torch.no_grad():
        out = path.run(call)
    assert out[0].shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[3]) and bool(torch.isfinite(out[0]).all())
    if empty == "Lk=0":
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        if path.op == "attention":
            assert bool((out[1] == float("-inf")).all())


def test_explain_lists_the_row(path):
    q, k, v, kw, _ = _admitted(path)
    ex = effattn.explain(q, k, v, op=path.op, **kw)
    assert ex.row(path.name).reasons == [] and f"] {path.name}" in str(ex)
