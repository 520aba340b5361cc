"""What the CUDA kernels ask of a GPU, and the capability check that reads it
(effattn/backends/cuda/resources.py), on the CPU:

- the shared-memory sizes of resources.py are the ones the kernels' launches ask for: the emulated
  device's limit (``emu_smem_limit``) set under a size makes the launch fail naming its size;
- per architecture (sm_80, sm_86, sm_89, sm_90, sm_100, sm_120: their opt-in shared memory per
  block), every prefill kernel fits and decode at head dim 256 takes its single-buffered instance
  where two stages do not fit (99 KB GPUs);
- that instance against the float64 oracle, bit for bit equal to the double-buffered one;
- a device too small for a kernel: the row is refused with the reason (explain, errors), the next
  row serves; device properties (faked: monkeypatch) are read from torch.cuda.get_device_properties;
- an emulator failure inside a call is a RuntimeError naming it, not a dead test process.
"""
import re
import shutil
import types

import pytest
import torch

import effattn
from effattn._call import make_attn_call
from effattn.backends import base
from effattn.backends.cuda import resources
from effattn.backends.cuda.attention import decode
from effattn.backends.cuda.attention.tiling import BUCKETS
from tests.backends.cuda.test_cuda_decode import check
from tests.conftest import EMU_DEFAULT_SCHEDULE, random_qkv

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]

KB = 1024
# opt-in shared memory per block (CUDA C++ Programming Guide, technical specifications per compute capability)
ARCH_SMEM = {"sm_80": 163 * KB, "sm_86": 99 * KB, "sm_89": 99 * KB, "sm_90": 227 * KB, "sm_100": 227 * KB,
             "sm_120": 99 * KB}
FWD_ARGS = (None, None, 0, 0, None, 0, None, 0.25, 0.0, -1, -1)      # no mask, layout or dropout; no window


@pytest.fixture
def smem_limit(emulation):
    """Sets the emulated device's opt-in shared memory per block for one test."""
    before = resources.set_emulated_smem(0)
    yield resources.set_emulated_smem
    resources.set_emulated_smem(before)


def qkv(hd, Lq=16, Lk=16, Hkv=1, dtype=torch.bfloat16, seed=0):
    return random_qkv(1, Hkv, Hkv, Lq, Lk, hd, hd, torch.Generator().manual_seed(seed), dtype, "cpu")


def test_sizes_are_what_the_launches_ask_for(emulation, smem_limit, monkeypatch):
    """One byte of shared memory: every launch fails, naming the size it asked for (forward, decode at
    each stage count, Hopper forward); the two-pass backward completes at exactly the larger of its two
    passes' sizes and fails one byte under the dK/dV pass's (and under the dQ pass's where that is
    larger); the fused backward (buckets 32..128) completes at its size and fails one byte under."""
    for hd in BUCKETS:
        q, k, v = qkv(hd)
        smem_limit(1)
        with pytest.raises(RuntimeError, match=f"launch asks for {resources.fwd_smem(hd)} bytes of shared memory "
                                               f"per block, the device allows 1 "):
            emulation.attention_fwd(q, k, v, *FWD_ARGS)
        for stages in resources.DECODE_STAGES[hd]:
            with pytest.raises(RuntimeError, match=f"asks for {resources.decode_smem(hd, stages)} bytes"):
                emulation.attention_decode(q[:, :, :1], k, v, None, None, 0, 0, None, 0, 0.25, -1, -1, 1, stages)
        if hd in (64, 128):
            # (Lk 16: the TMA kernel's kWindow instance, 128-key tiles)
            with pytest.raises(RuntimeError, match=f"asks for {resources.hopper_smem(hd, 128)} bytes"):
                emulation.attention_fwd_sm90(q, k, v, *FWD_ARGS)
        # the backward through the backend (its check told the emulated device is large): the passes
        # launch in order Delta (no shared memory), dK/dV, dQ
        monkeypatch.setattr(resources, "device_limits", lambda device: resources.Limits("big", 1 << 30, 65536))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        dkdv, dq = resources.dkdv_smem(hd), resources.dq_smem(hd)
        runs = [("0", max(dkdv, dq), None), ("0", dkdv - 1, dkdv)] + ([("0", dq - 1, dq)] if dq > dkdv else [])
        if hd <= 128:
            fused = resources.bwd_fused_smem(hd)
            runs += [("1", fused, None), ("1", fused - 1, fused)]
        for switch, limit, refused in runs:
            monkeypatch.setenv("EFFATTN_CUDA_FUSED_BWD", switch)
            smem_limit(limit)
            out = effattn.attention(*leaves, causal=True, backend="cuda")
            if refused is None:
                grads = torch.autograd.grad(out.sum(), leaves)
                assert all(torch.isfinite(g).all() for g in grads)
            else:
                with pytest.raises(RuntimeError, match=f"asks for {refused} bytes"):
                    torch.autograd.grad(out.sum(), leaves)
        monkeypatch.undo()


@pytest.mark.parametrize("arch", list(ARCH_SMEM))
def test_every_kernel_fits_each_architecture(arch):
    """sm_80 .. sm_120: each prefill kernel (forward, on sm_90 the Hopper forward at 64 / 128, both backward passes)
    launches at every head-dim bucket; decode keeps two stages except at head dim 256 on 99 KB GPUs."""
    limits = resources.Limits(arch, ARCH_SMEM[arch], 65536)
    cc = (int(arch[3:-1]), int(arch[-1]))
    assert resources.ARCHS[cc].smem_per_block == ARCH_SMEM[arch]     # the table the offline tool counts CTAs with
    for hd in BUCKETS:
        for hopper in ((False, True) if hd in (64, 128) and arch == "sm_90" else (False,)):   # sm_90a code
            assert resources.refusals(resources.prefill_needs(hd, hopper, backward=True), limits) == [], (arch, hd)
        # the fused backward where it fits (else the two passes run): every bucket it serves on the 163 and
        # 227 KB GPUs, up to 64 on the 99 KB ones
        fits = resources.refusals(resources.prefill_needs(hd, False, True, fused=True), limits) == []
        assert fits == (hd <= (128 if ARCH_SMEM[arch] >= 163 * KB else 64)), (arch, hd)
        stages, why = resources.decode_stages(hd, limits)
        assert why == [] and stages == (1 if hd == 256 and ARCH_SMEM[arch] < 136 * KB else 2), (arch, hd, stages)
    assert resources.decode_smem(256, 2) == 136 * KB       # the size that needs the second instance


def test_decode_d256_single_stage_under_a_99_kb_device(smem_limit, emulation):
    """At 99 KB (sm_86 / sm_89 / sm_120) decode at head dim 256 runs single-buffered (explain says so),
    matches float64 and equals the double-buffered kernel bit for bit; under every schedule."""
    q, k, v = random_qkv(1, 4, 2, 2, 200, 256, 256, torch.Generator().manual_seed(3), torch.bfloat16, "cpu")
    kw = dict(causal=True)
    double = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kw)
    assert "K/V double-buffered" in effattn.explain(q, k, v, **kw).paths["cuda"]
    smem_limit(99 * KB)
    text = effattn.explain(q, k, v, **kw).paths["cuda"]
    assert text.startswith("cuda/decode") and "K/V single-buffered" in text, text
    for schedule in (0, 1, 2):
        emulation.emu_set_schedule(schedule)
        single = effattn.attention(q, k, v, return_lse=True, backend="cuda", **kw)
        check(*single, q, k, v, kw, torch.bfloat16)
        assert torch.equal(single[0], double[0]) and torch.equal(single[1], double[1]), schedule
    emulation.emu_set_schedule(EMU_DEFAULT_SCHEDULE)


def test_a_kernel_that_cannot_launch_is_refused_with_the_reason(smem_limit):
    """64 KB: decode at head dim 256 fits in no instance (72 KB single-buffered), so cuda/prefill
    serves (its forward takes 64 KB); with gradients prefill's dK/dV pass (96 KB) does not fit either,
    and the named backend refuses, saying which kernel needs what."""
    q, k, v = qkv(256, Lq=1, Lk=80)
    smem_limit(64 * KB)
    cuda = base._REGISTRY["attention"]["cuda"]
    call = make_attn_call(q, k, v)
    why = next(p for p in cuda.paths if p.name == "cuda/decode").reasons(call)
    assert why == ["the 1-stage decode kernel needs 73728 bytes of shared memory per block, the emulated GPU "
                   "allows 65536"], why
    assert effattn.explain(q, k, v).paths["cuda"].startswith("cuda/prefill")
    out = effattn.attention(q, k, v, backend="cuda")
    assert torch.isfinite(out).all()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    text = str(effattn.explain(*leaves))
    assert "the dK/dV backward kernel needs 98560 bytes of shared memory per block" in text, text
    with pytest.raises(base.CannotServe, match="dK/dV backward kernel needs 98560 bytes"):
        effattn.attention(*leaves, backend="cuda")


def test_a_device_with_too_few_registers_is_refused(monkeypatch):
    monkeypatch.setattr(resources, "device_limits", lambda device: resources.Limits("a small GPU", 1 << 20, 16384))
    q, k, v = qkv(64, Lq=1, Lk=16)
    text = str(effattn.explain(q, k, v))
    for row, kernel in (("cuda/decode", "2-stage decode"), ("cuda/prefill", "forward")):
        assert re.search(f"{row} +cannot serve: the {kernel} kernel may need 128 x 255 registers per block, a small "
                         f"GPU has 16384 per SM", text), text


def props(major, minor, name, **fields):
    return types.SimpleNamespace(major=major, minor=minor, name=name, **fields)


def test_device_limits_come_from_the_device_properties(monkeypatch):
    """Opt-in shared memory per block and registers per SM from torch.cuda.get_device_properties; a
    torch whose properties lack them: the capability's documented opt-in size, 64 K registers."""
    table = {0: props(8, 6, "NVIDIA RTX A6000", shared_memory_per_block_optin=101376, regs_per_multiprocessor=65536),
             1: props(9, 0, "NVIDIA H100"), 2: props(8, 9, "NVIDIA L4"), 3: props(12, 0, "RTX 5090"),
             4: props(10, 0, "NVIDIA B200")}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: table[device.index])
    monkeypatch.setattr(resources, "_LIMITS", {})
    got = {i: resources.device_limits(torch.device("cuda", i)) for i in table}
    assert got[0] == resources.Limits("NVIDIA RTX A6000 (sm_86)", 101376, 65536)
    assert got[1] == resources.Limits("NVIDIA H100 (sm_90)", 227 * KB, 65536)
    assert got[2].smem_per_block == 99 * KB and got[3].smem_per_block == 99 * KB
    assert got[4] == resources.Limits("NVIDIA B200 (sm_100)", 227 * KB, 65536)
    # decode at head dim 256: one stage on the 99 KB GPUs, two on the H100 and the B200
    assert [resources.decode_stages(256, got[i])[0] for i in table] == [1, 2, 1, 1, 2]
    # the fused backward at head dim 128 (145 KB): on the H100 and the B200 only; the two passes elsewhere
    assert [resources.refusals(resources.fused_bwd_needs(128), got[i]) == [] for i in table] == [
        False, True, False, False, True]


def test_emulator_failure_inside_a_call_is_a_runtime_error(smem_limit):
    """The emulator's refusal reaches Python as the op's RuntimeError with its message; the next call
    runs (the process and the emulator survive)."""
    q, k, v = qkv(32)
    smem_limit(1)
    with pytest.raises(RuntimeError, match="effattn emulator: launch asks for 12288 bytes"):
        torch.ops.effattn_cuda_emu.attention_fwd(q, k, v, *FWD_ARGS)
    smem_limit(227 * KB)
    assert torch.isfinite(torch.ops.effattn_cuda_emu.attention_fwd(q, k, v, *FWD_ARGS)[0]).all()


def test_decode_op_checks_its_stage_count(emulation):
    q, k, v = qkv(64)
    with pytest.raises(RuntimeError, match="decode stages must be 2, or 1 at head dims over 128"):
        emulation.attention_decode(q[:, :, :1], k, v, None, None, 0, 0, None, 0, 0.25, -1, -1, 1, 1)
    assert decode.stages(q, v) == (2, [])
