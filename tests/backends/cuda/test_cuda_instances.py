"""The generated instances (csrc/generate_instances.py -> csrc/attention/inst/): the committed files are
what the script writes, the dispatch in csrc/attention/fwd.cu and bwd.cu names every generated instance,
and each (mask kind, dropout) instance a call picks, forward and backward (fused or two passes), is the
one that runs (the emulation's record), gives the general instance's bits (kAny with the dropout code:
the one every call ran before the split) and passes the float64 rule.
"""
import ctypes
import importlib.util
import os
import re
import shutil

import pytest
import torch

import effattn
from effattn.layouts import BlockLayout
from tests.conftest import CSRC
from tests.core.test_attention import check_against_oracle


def generator():
    spec = importlib.util.spec_from_file_location("generate_instances", os.path.join(CSRC, "generate_instances.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_instances_equal_the_generators_output(tmp_path):
    """Nobody edits csrc/attention/inst/ by hand: it is byte for byte what the script writes (no file
    missing, stale or extra), and the script's own --check agrees."""
    gen = generator()
    assert gen.differences() == [], "rerun python3 csrc/generate_instances.py"
    assert gen.main(["--out", str(tmp_path)]) == 0
    written = {p.name: p.read_text() for p in tmp_path.iterdir()}
    committed = {}
    for name in os.listdir(gen.FOLDER):
        with open(os.path.join(gen.FOLDER, name), encoding="utf-8") as f:
            committed[name] = f.read()
    assert written == committed
    (tmp_path / next(iter(written))).write_text("// edited by hand\n")
    assert gen.main(["--check", "--out", str(tmp_path)]) == 1
    fwd = len(gen.HEAD_DIMS) * len(gen.DTYPES) * len(gen.MASK_KINDS) * len(gen.DROPOUT)
    hopper = len(gen.HOPPER_HEAD_DIMS) * len(gen.DTYPES)     # the Hopper backward: a unit per head dim, dtype
    assert len(written) == 2 * fwd + hopper == 164           # the backward: the same kinds and flags


def test_dispatch_names_every_generated_instance():
    """fwd.cu's and bwd.cu's switches reach exactly the generated set: their head-dim buckets are the
    script's, their mask-kind switch (common.cuh's with_mask_kind, which both call) names every kind the
    script instantiates (and no other), and the dropout flag takes both values. (A dispatched instance
    that is not generated fails at link time, when the emulated kernels' library is loaded.)"""
    gen = generator()
    with open(os.path.join(CSRC, "attention", "common.cuh"), encoding="utf-8") as f:
        common = f.read()
    switch = common.split("inline int with_mask_kind(", 1)[1].split("\n}\n", 1)[0]
    kinds = set(re.findall(r"integral_constant<int, (k\w+)>", switch))
    assert kinds == {enum for _, enum in gen.MASK_KINDS}, kinds
    for unit, call, of_kind, launcher, instances in (
            ("fwd.cu", "fwd_of_call", "fwd_of_kind", "fwd", gen.forward_instances()),
            ("bwd.cu", "bwd_of_bucket", "bwd_of_kind", "bwd_of_call", gen.backward_instances())):
        with open(os.path.join(CSRC, "attention", unit), encoding="utf-8") as f:
            src = f.read()
        assert {int(x) for x in re.findall(rf"case (\d+): return {call}<", src)} == set(gen.HEAD_DIMS), unit
        assert f"with_mask_kind(kind, [&](auto k) {{ return detail::{launcher}<HD, BF16, decltype(k)::value, DROP>" in src, unit
        assert f"{of_kind}<HD, BF16, true>" in src and f"{of_kind}<HD, BF16, false>" in src, unit
        for name, (hd, bf16, enum, flag) in instances:
            with open(os.path.join(gen.FOLDER, name), encoding="utf-8") as f:
                assert f"template int {launcher}<{hd}, {bf16}, {enum}, {flag}>(" in f.read(), name
    with open(os.path.join(CSRC, "attention", "bwd.cu"), encoding="utf-8") as f:
        src = f.read()
    for hd in gen.HOPPER_HEAD_DIMS:                          # the Hopper backward's units
        for _, bf16 in gen.DTYPES:
            assert f"detail::bwd_sm90<{hd}, {bf16}>(p, stream)" in src, (hd, bf16)


# ---------------------------------------------------------------------------------- the emulation

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels")
KIND = {"kDense": 0, "kWindow": 1, "kAny": 2, "kCausal": 3, "kLayout": 4}   # MaskKind (common.cuh)
H, D = 2, 40                                                             # head dim 40: bucket 64, 64-key tiles


def layout(Lq, Lk, bs, seed):
    g = torch.Generator().manual_seed(seed)
    return BlockLayout(torch.rand(H, -(-Lq // bs), -(-Lk // bs), generator=g) < 0.6, bs)


def kpm(Lk, seed):
    return torch.rand(1, Lk, generator=torch.Generator().manual_seed(seed)) < 0.3


# id -> (Lq, Lk, kwargs, the mask kind the call must run)
CALLS = {
    "dense": (70, 128, {}, "kDense"),
    "causal": (50, 128, dict(causal=True), "kCausal"),
    "causal-Lq-gt-Lk": (100, 70, dict(causal=True), "kCausal"),
    "window": (70, 120, dict(window=(20, 5)), "kWindow"),
    "ragged-dense": (70, 120, {}, "kWindow"),
    "layout": (64, 128, dict(layout=layout(64, 128, 32, 1)), "kLayout"),
    "layout-causal": (80, 96, dict(layout=layout(80, 96, 16, 2), causal=True), "kLayout"),
    "padding": (64, 128, dict(key_padding_mask=kpm(128, 3)), "kAny"),
    "padding-layout-window": (70, 100, dict(key_padding_mask=kpm(100, 4), layout=layout(70, 100, 32, 5),
                                            window=(30, 30)), "kAny"),
}


def kernels_record(direction):
    """(last(), general(on)): the emulation's record of the `direction` ("fwd", "bwd") instance that ran
    last and its switch to the general instance (csrc/attention/launchers.cuh), through the kernels'
    library; the switch is off again after the module."""
    from effattn.backends.cuda import _ext
    lib = ctypes.CDLL(_ext.build_kernels())            # the library the emulated ops already loaded
    return getattr(lib, f"effattn_emu_last_{direction}_instance"), getattr(lib, f"effattn_emu_set_{direction}_general")


@pytest.fixture(scope="module")
def record(emulation):
    last, general = kernels_record("fwd")
    yield last, general
    general(0)


@pytest.fixture(scope="module")
def bwd_record(emulation):
    last, general = kernels_record("bwd")
    yield last, general
    general(0)


def inputs(Lq, Lk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, L, D, generator=g).to(dtype) for L in (Lq, Lk, Lk))


def forward(q, k, v, kwargs, drop):
    torch.manual_seed(7)
    return effattn.attention(q, k, v, return_lse=True, backend="cuda", dropout_p=0.2 if drop else 0.0, **kwargs)


@needs_gxx
@pytest.mark.parametrize("drop", [False, True], ids=["nodrop", "drop"])
@pytest.mark.parametrize("call", list(CALLS))
def test_each_call_runs_its_instance_with_the_general_instances_bits(call, drop, record, monkeypatch):
    """The instance that ran is the call's (mask kind, dropout) one (a dense call routed to kAny, or
    a call without dropout to the dropout code, fails here), and its output and lse equal bit for
    bit those of the general instance forced on the same call."""
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "0")
    last, general = record
    Lq, Lk, kwargs, kind = CALLS[call]
    q, k, v = inputs(Lq, Lk, torch.float16)
    out, lse = forward(q, k, v, kwargs, drop)
    assert last() == 64 * 1000 + 0 * 100 + KIND[kind] * 10 + int(drop), last()
    general(1)
    try:
        ref_out, ref_lse = forward(q, k, v, kwargs, drop)
        assert last() == 64 * 1000 + KIND["kAny"] * 10 + 1, last()
    finally:
        general(0)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    if drop:
        assert not torch.equal(out, forward(q, k, v, kwargs, False)[0])    # the dropout code did drop


@needs_gxx
@pytest.mark.parametrize("call", ["dense", "causal", "window", "layout", "padding"])
def test_each_mask_kind_instance_passes_the_float64_rule(call, record, bwd_record, monkeypatch):
    """Forward and backward of each mask kind's call against float64 (bf16; the instances that ran are
    checked above and below, the dropout instances' bits equal the general one's, which the dropout tests
    of test_cuda_attention.py and test_cuda_fused_bwd.py judge)."""
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "0")
    Lq, Lk, kwargs, kind = CALLS[call]
    q, k, v = inputs(Lq, Lk, torch.bfloat16, seed=1)
    check_against_oracle(q, k, v, kwargs, torch.bfloat16, "cuda")
    assert record[0]() == 64 * 1000 + 100 + KIND[kind] * 10, record[0]()
    assert bwd_record[0]() == 64 * 1000 + 100 + KIND[kind] * 10, bwd_record[0]()


# The backward's kind is that of the kernel that runs: kDense needs Lk a multiple of its key tile, 128
# for the fused kernel. id -> (Lq, Lk, kwargs, fused kind, two-pass kind); a layout always runs the two
# passes (the fused kernel serves none); at buckets <= 128 every other call's two passes are kAny's (the
# dense / causal / window units hold the fused kernel only).
BWD_CALLS = {
    "dense": (70, 128, {}, "kDense", "kAny"),
    "dense-64-keys": (70, 64, {}, "kWindow", "kAny"),
    "causal": (50, 128, dict(causal=True), "kCausal", "kAny"),
    "causal-Lq-gt-Lk": (100, 70, dict(causal=True), "kCausal", "kAny"),
    "window": (70, 120, dict(window=(20, 5)), "kWindow", "kAny"),
    "layout": (64, 128, dict(layout=layout(64, 128, 32, 1)), "kLayout", "kLayout"),
    "padding": (64, 128, dict(key_padding_mask=kpm(128, 3)), "kAny", "kAny"),
    "padding-layout-window": CALLS["padding-layout-window"][:3] + ("kAny", "kAny"),
}
BWD_CASES = [("fused", c, False) for c in BWD_CALLS] + [("fused", c, True) for c in ("dense", "causal-Lq-gt-Lk",
                                                                                     "padding")] + [
    ("two-pass", "dense-64-keys", False), ("two-pass", "causal", True), ("two-pass", "window", True)]


def gradients(q, k, v, kwargs, drop):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)
    out = effattn.attention(*leaves, backend="cuda", dropout_p=0.2 if drop else 0.0, **kwargs)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    return torch.autograd.grad(out, leaves, go)


@needs_gxx
@pytest.mark.parametrize("path,call,drop", BWD_CASES, ids=[f"{p}-{c}-{'drop' if d else 'nodrop'}" for p, c, d in BWD_CASES])
def test_each_backward_runs_its_instance_with_the_general_instances_bits(path, call, drop, bwd_record, monkeypatch):
    """The backward instance that ran is the call's (mask kind for the kernel that runs, dropout), and its
    dq, dk, dv equal bit for bit those of the general backward instance (kAny with dropout) forced on the
    same call, for the fused kernel and for the two passes."""
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "0")
    if path == "two-pass":
        monkeypatch.setenv("EFFATTN_CUDA_FUSED_BWD", "0")
    last, general = bwd_record
    Lq, Lk, kwargs, fused_kind, two_pass_kind = BWD_CALLS[call]
    q, k, v = inputs(Lq, Lk, torch.float16, seed=2)
    want = fused_kind if path == "fused" else two_pass_kind
    grads = gradients(q, k, v, kwargs, drop)
    assert last() == 64 * 1000 + KIND[want] * 10 + int(drop), last()
    general(1)
    try:
        ref = gradients(q, k, v, kwargs, drop)
        assert last() == 64 * 1000 + KIND["kAny"] * 10 + 1, last()
    finally:
        general(0)
    for got, exp in zip(grads, ref):
        assert torch.equal(got, exp)
    if drop:
        assert not torch.equal(grads[2], gradients(q, k, v, kwargs, False)[2])   # the dropout code did drop
