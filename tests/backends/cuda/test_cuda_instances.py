"""The generated instances (csrc/generate_instances.py -> csrc/attention/inst/): the committed files are
what the script writes, the dispatch in csrc/attention/fwd.cu and bwd.cu names every generated instance,
and each (mask kind, dropout) instance a call picks is the one that runs (the emulation's record), gives
the general instance's bits (kAny with the dropout code: the one every call ran before the split) and
passes the float64 rule.
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
    assert len(written) == fwd + len(gen.HEAD_DIMS) * len(gen.DTYPES) == 88


def test_dispatch_names_every_generated_instance():
    """fwd.cu's switches reach exactly the generated set: its head-dim buckets are the script's, its
    mask-kind switch names every kind the script instantiates (and no other), and the dropout flag
    takes both values; bwd.cu's switch names every bucket, for both dtypes. (A dispatched instance that is not generated fails at link time, when the
    emulated kernels' library is loaded.)"""
    gen = generator()
    with open(os.path.join(CSRC, "attention", "fwd.cu"), encoding="utf-8") as f:
        src = f.read()
    assert {int(x) for x in re.findall(r"case (\d+): return fwd_of_call<", src)} == set(gen.HEAD_DIMS)
    kinds = set(re.findall(r"detail::fwd<HD, BF16, (k\w+), DROP>", src))
    assert kinds == {enum for _, enum in gen.MASK_KINDS}, kinds
    assert "fwd_of_kind<HD, BF16, true>" in src and "fwd_of_kind<HD, BF16, false>" in src
    for name, (hd, bf16, enum, flag) in gen.forward_instances():
        with open(os.path.join(gen.FOLDER, name), encoding="utf-8") as f:
            assert f"template int fwd<{hd}, {bf16}, {enum}, {flag}>(" in f.read(), name
    with open(os.path.join(CSRC, "attention", "bwd.cu"), encoding="utf-8") as f:
        src = f.read()
    assert {int(x) for x in re.findall(r"case (\d+): return detail::bwd_of_call<\1, BF16>", src)} == set(gen.HEAD_DIMS)
    assert "dispatch_bwd<true>" in src and "dispatch_bwd<false>" in src
    for name, (hd, bf16) in gen.backward_instances():
        with open(os.path.join(gen.FOLDER, name), encoding="utf-8") as f:
            assert f"template int bwd_of_call<{hd}, {bf16}>(" in f.read(), name


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


@pytest.fixture(scope="module")
def record(emulation):
    """(last(), general(on)): the emulation's record of the forward instance that ran last and its
    switch to the general instance (csrc/attention/launchers.cuh), through the kernels' library."""
    from effattn.backends.cuda import _ext
    lib = ctypes.CDLL(_ext.build_kernels())            # the library the emulated ops already loaded
    yield lib.effattn_emu_last_fwd_instance, lib.effattn_emu_set_fwd_general
    lib.effattn_emu_set_fwd_general(0)


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
def test_each_mask_kind_instance_passes_the_float64_rule(call, record, monkeypatch):
    """Forward and backward of each mask kind's call against float64 (bf16; the instance that ran is
    checked above, the dropout instances' bits equal the general one's, which the dropout tests of
    test_cuda_attention.py judge)."""
    monkeypatch.setenv("EFFATTN_CUDA_EMU_HOPPER", "0")
    Lq, Lk, kwargs, kind = CALLS[call]
    q, k, v = inputs(Lq, Lk, torch.bfloat16, seed=1)
    check_against_oracle(q, k, v, kwargs, torch.bfloat16, "cuda")
    assert record[0]() == 64 * 1000 + 100 + KIND[kind] * 10, record[0]()
