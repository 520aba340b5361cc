"""The CUDA split-KV decode kernels over a paged KV cache (row ``cuda/paged-decode``), run on the CPU
through the emulation (EFFATTN_CUDA_EMU=1): each sequence against the float64 oracle on its own keys and
bitwise against the contiguous decode kernel on the same keys with the same splits; sequences of
different lengths (empty, shorter than Lq), pages scattered over the pool, table entries past a sequence
that point nowhere, slots nobody sees holding NaN; dispatch and explain.
"""
import shutil

import pytest
import torch

import effattn
from effattn.backends.cuda.attention import decode
from effattn.backends.cuda.attention import paged as cuda_paged
from effattn.nn import PagedKVCache
from effattn.paged import make_paged_call
from effattn.testing.oracle import naive_attention
from effattn.visibility import clamp_window, normalize_window
from tests.core.test_attention import judge, naive_in
from tests.core.test_paged import contiguous, paged_setup

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]   # EFFATTN_CUDA_EMU=1 for this module (tests/conftest.py)


def pools(lens, page_size, H, Hkv, D, Dv, Lq, dtype, seed, poison=float("nan")):
    """q, the pools (slots no sequence holds filled with `poison`), the table (unused entries -1)."""
    q, kp, vp, table, seqlens = paged_setup(lens, page_size=page_size, num_pages=sum(-(-n // page_size) for n in lens) + 3,
                                            H=H, Hkv=Hkv, D=D, Lq=Lq, seed=seed, dtype=torch.float32)
    vp = torch.randn(*vp.shape[:3], Dv, generator=torch.Generator().manual_seed(seed + 1))
    held = torch.zeros(kp.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens):
        t = torch.arange(n)
        held[table[b, t // page_size].long(), t % page_size] = True
    kp[~held], vp[~held] = poison, poison
    return q.to(dtype), kp.to(dtype), vp.to(dtype), table, seqlens


# id -> (lens, page_size, H, Hkv, D, Dv, Lq, kwargs)
CASES = {
    "decode-gqa4-ps16": ([300, 37, 0, 129], 16, 8, 2, 64, 64, 1, {}),
    "causal-Lq4-ps3-Dv-ne-D": ([200, 2, 65], 3, 4, 2, 32, 16, 4, dict(causal=True)),
    "window-Lq3-ps5": ([260, 90], 5, 2, 1, 64, 64, 3, dict(causal=True, window=70)),
    "two-sided-window-mha": ([150, 7], 8, 2, 2, 32, 32, 2, dict(window=(40, 1))),
    "Lq16-G4-row-tiles": ([100, 16], 16, 4, 1, 32, 32, 16, dict(causal=True)),
    "B1-long-four-splits": ([1100], 16, 4, 1, 32, 32, 1, dict(causal=True)),
}


def run_paged(q, kp, vp, table, seqlens, kw):
    with torch.no_grad():
        return effattn.attention(q, kp, vp, block_table=table, seqlens=seqlens, return_lse=True, backend="cuda", **kw)


def run_case(case, case_id, run, path):
    """A case of CASES on backend "cuda": the pools, then (out, lse) checked for the row `path` in explain,
    shapes, dtype, NaN and bitwise determinism. Returns (q, kp, vp, table, dtype, out, lse)."""
    lens, ps, H, Hkv, D, Dv, Lq, kw = case
    dtype = torch.bfloat16 if len(case_id) % 2 else torch.float16
    q, kp, vp, table, seqlens = pools(lens, ps, H, Hkv, D, Dv, Lq, dtype, seed=len(case_id))
    rep = effattn.explain(q, kp, vp, block_table=table, seqlens=seqlens, backend="cuda", **kw)
    assert rep.paths["cuda"].startswith(path), rep.paths["cuda"]
    out, lse = run(q, kp, vp, table, seqlens, kw)
    assert out.dtype == dtype and out.shape == (len(lens), H, Lq, Dv) and lse.shape == (len(lens), H, Lq)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    again = run(q, kp, vp, table, seqlens, kw)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse), "not bitwise deterministic"
    return q, kp, vp, table, dtype, out, lse


def against_oracle(out, lse, q, k, v, dtype, kw, what):
    """out / lse of one sequence (q (1, H, Lq, D); its contiguous keys k, v) against the float64 oracle."""
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), **kw)
    judge(out, ref, naive_in(dtype, q, k, v, kw)[0], 2, dtype, what)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), what
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-3, what


@pytest.mark.parametrize("case_id", list(CASES))
def test_paged_decode_against_float64_and_the_contiguous_kernel(case_id):
    lens, ps, H, Hkv, D, Dv, Lq, kw = CASES[case_id]
    q, kp, vp, table, dtype, out, lse = run_case(CASES[case_id], case_id, run_paged,
                                                 "cuda/paged-decode: paged split-KV decode: reads the key/value pages in place")
    seqlens = torch.tensor(lens, dtype=torch.int32)

    call = make_paged_call(q, kp, vp, block_table=table, seqlens=seqlens, backend="cuda", **kw)
    splits = cuda_paged.plan(call)[2]
    assert (splits > 1) == ("splits" in case_id)
    left, right = normalize_window(kw.get("window"), kw.get("causal", False))
    scale = D ** -0.5
    for b, n in enumerate(lens):
        k, v = contiguous(kp, table[b], n, ps), contiguous(vp, table[b], n, ps)
        qb = q[b:b + 1]
        against_oracle(out[b:b + 1], lse[b:b + 1], qb, k, v, dtype, kw, f"sequence {b} ({n} keys)")
        # the contiguous decode kernel over the same keys, with the paged call's split count: bitwise
        c_out, c_lse = decode.kernels(q.device).attention_decode(
            qb, k, v, None, None, 0, 0, None, 0, scale, *clamp_window(left, right, Lq, n), splits,
            decode.stages(q, v)[0])
        assert torch.equal(out[b:b + 1], c_out) and torch.equal(lse[b:b + 1], c_lse), f"sequence {b}: paged != contiguous"


def test_forced_splits_and_a_table_wider_than_the_pool_use():
    """Several splits (some seeing no key of a short sequence) against one split; the table's unused
    columns point past the pool and are never read."""
    lens, ps = [700, 3, 64], 16
    q, kp, vp, table, seqlens = pools(lens, ps, 4, 2, 32, 32, 2, torch.bfloat16, seed=5)
    table = torch.cat([table, torch.full((3, 4), 10 ** 6, dtype=torch.int32)], 1)
    call = make_paged_call(q, kp, vp, block_table=table, seqlens=seqlens, causal=True, backend="cuda",
                           check_values=False)
    ops = decode.kernels(q.device)
    outs = [ops.attention_decode_paged(q, kp, vp, table, seqlens, 32 ** -0.5, call.left, call.right, s, 2)
            for s in (1, 3, 11)]
    for o, l_ in outs[1:]:
        torch.testing.assert_close(o.float(), outs[0][0].float(), rtol=0, atol=2e-2)
        torch.testing.assert_close(l_, outs[0][1], rtol=0, atol=1e-4)
    assert not torch.isnan(outs[2][0]).any()


def test_explain_and_dispatch_of_the_paged_cuda_row():
    q, kp, vp, table, seqlens = pools([40, 9], 4, 4, 2, 32, 32, 1, torch.float16, seed=1)
    rep = effattn.explain(q, kp, vp, block_table=table, seqlens=seqlens, causal=True)
    names = [r.path for r in rep.rows[:4]]
    assert names[-1] == "torch/paged-gather" and names[2] == "cuda/paged-prefill"
    assert set(names[:2]) == {"triton/paged", "cuda/paged-decode"}
    assert rep.chosen_path != "cuda/paged-decode"                 # CPU tensors: the emulation only by name
    # prefill-shaped (Lq > 16): backend="cuda" runs the paged prefill kernel (test_cuda_paged_prefill.py)
    q20 = torch.randn(2, 4, 20, 32).half()
    rep = effattn.explain(q20, kp, vp, block_table=table, seqlens=seqlens, causal=True, backend="cuda")
    assert rep.paths["cuda"].startswith("cuda/paged-prefill: ")
    assert "decode-shaped calls only" in str(rep)
    out = effattn.attention(q20, kp, vp, block_table=table, seqlens=seqlens, causal=True, backend="cuda")
    ref = effattn.attention(q20.float(), kp.float(), vp.float(), block_table=table, seqlens=seqlens, causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
    # a pool cp.async cannot read in place (head dim 12): refused with the reason, never copied
    bad = [torch.zeros(*t.shape[:-1], 12, dtype=torch.float16) for t in (q, kp, vp)]
    why = effattn.explain(*bad, block_table=table, seqlens=seqlens).row("cuda/paged-decode").reasons
    assert any("k_pages is read in place" in w for w in why)


def test_paged_kv_cache_decoding_loop_on_the_cuda_kernels():
    """`PagedKVCache` steps (prefill written, then one token at a time) on the CUDA kernels equal the
    torch gather's."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(12, 8, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    seqs = [cache.new_sequence() for _ in range(2)]
    cache.append(seqs, *(torch.randn(2, 2, 13, 32, generator=g) for _ in range(2)))
    for step in range(3):
        cache.append(seqs, *(torch.randn(2, 2, 1, 32, generator=g) for _ in range(2)))
        q = torch.randn(2, 4, 1, 32, generator=g).bfloat16()
        with torch.no_grad():
            got = cache.attention(q, seqs, causal=True, backend="cuda")
            ref = effattn.attention(q.float(), cache.k_pages.float(), cache.v_pages.float(),
                                    block_table=cache.block_table(seqs), seqlens=cache.seqlens(seqs), causal=True)
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=0)
