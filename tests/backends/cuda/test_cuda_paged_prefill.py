"""The CUDA paged prefill forward (row ``cuda/paged-prefill``: fwd.cuh's mma.sync kernel reading key /
value rows from their pages through the block table), run on the CPU through the emulation
(EFFATTN_CUDA_EMU=1): each sequence against the float64 oracle on its own keys and bitwise against the
contiguous forward (row ``cuda/prefill``, the same kernel and arithmetic) on the same keys; ragged
sequences (empty, a partial last page, shorter than Lq), several pages per sequence and page sizes that
do not divide the key tile (tiles crossing pages), GQA, causal / non-causal / windows, Dv != D, slots no
sequence holds filled with NaN; a table pointing past the pool; no host read in a call (CUDA graphs);
dispatch and explain.
"""
import shutil

import pytest
import torch

import effattn
from effattn.backends.cuda.attention import decode
from effattn.nn import PagedKVCache
from effattn.paged import make_paged_call, paged_attention
from tests.backends.cuda.test_cuda_paged import against_oracle, pools, run_case
from tests.conftest import EMU_DEFAULT_SCHEDULE
from tests.core.test_paged import contiguous

pytestmark = [pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels"),
              pytest.mark.usefixtures("emulation")]   # EFFATTN_CUDA_EMU=1 for this module (tests/conftest.py)

# id -> (lens, page_size, H, Hkv, D, Dv, Lq, kwargs)
CASES = {
    # three pages and a partial one, an empty sequence, one shorter than Lq, one of whole tiles
    "causal-gqa2-ps16": ([130, 0, 11, 64], 16, 4, 2, 32, 32, 20, dict(causal=True)),
    # page size 5: every key tile crosses pages; Lq > Lk for sequence 0 (all its rows see all its keys)
    "noncausal-mqa-ps5-Dv-ne-D": ([10, 73], 5, 2, 1, 64, 32, 40, {}),
    # two query tiles, a left window, pages of one key tile
    "window-mha-ps64": ([200, 65], 64, 2, 2, 64, 64, 70, dict(causal=True, window=50)),
    # a two-sided window and a page size of 3
    "two-sided-window-gqa4-ps3": ([100, 33], 3, 4, 1, 32, 32, 24, dict(window=(30, 5))),
}


def run_paged(q, kp, vp, table, seqlens, kw, check_values=True):
    """effattn.attention's paged call on backend "cuda" (`paged_attention`, which it runs: ``check_values=False``
    skips the host checks of the table's and seqlens' values, as `PagedKVCache` and a graph capture do)."""
    with torch.no_grad():
        if check_values:
            return effattn.attention(q, kp, vp, block_table=table, seqlens=seqlens, return_lse=True, backend="cuda",
                                     **kw)
        return paged_attention(q, kp, vp, block_table=table, seqlens=seqlens, return_lse=True, backend="cuda",
                               check_values=False, **kw)


@pytest.mark.parametrize("case_id", list(CASES))
def test_paged_prefill_against_float64_and_the_contiguous_forward(case_id):
    lens, ps, H, Hkv, D, Dv, Lq, kw = CASES[case_id]
    q, kp, vp, table, dtype, out, lse = run_case(
        CASES[case_id], case_id, run_paged, "cuda/paged-prefill: paged prefill forward (mma.sync): reads the key/value "
        "pages in place")
    for b, n in enumerate(lens):
        if n == 0:                                     # no keys: 0 and lse -inf
            assert not out[b].any() and torch.isneginf(lse[b]).all()
            continue
        k, v = contiguous(kp, table[b], n, ps), contiguous(vp, table[b], n, ps)
        qb = q[b:b + 1]
        against_oracle(out[b:b + 1], lse[b:b + 1], qb, k, v, dtype, kw, f"sequence {b} ({n} keys)")
        # the contiguous forward (cuda/prefill, the same kernel reading strided rows) on the same keys: bitwise
        with torch.no_grad():
            assert effattn.explain(qb, k, v, backend="cuda", **kw).paths["cuda"].startswith("cuda/prefill: ")
            c_out, c_lse = effattn.attention(qb, k, v, backend="cuda", return_lse=True, **kw)
        assert torch.equal(out[b:b + 1], c_out) and torch.equal(lse[b:b + 1], c_lse), f"sequence {b}: paged != contiguous"


def test_table_past_the_pool_is_refused_naming_block_table_and_unused_entries_are_never_read():
    lens, ps = [40, 7], 8
    q, kp, vp, table, seqlens = pools(lens, ps, 2, 1, 32, 32, 18, torch.bfloat16, seed=3)
    bad = table.clone()
    bad[0, 2] = kp.shape[0]                            # a used entry one past the last page
    with pytest.raises(ValueError, match=r"block_table\[0, 2\] = \d+ points past the pool"):
        run_paged(q, kp, vp, bad, seqlens, dict(causal=True))
    # entries past each sequence's pages may point anywhere: the kernel reads only the used ones
    wide = torch.cat([table, torch.full((2, 3), 10 ** 6, dtype=torch.int32)], 1)
    wide[1, 1:] = -5                                    # sequence 1 uses one page
    out, lse = run_paged(q, kp, vp, wide, seqlens, dict(causal=True), check_values=False)
    ref, ref_lse = run_paged(q, kp, vp, table, seqlens, dict(causal=True))
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_a_call_reads_nothing_back_to_the_host(monkeypatch):
    """CUDA-graph safety of the row: with ``check_values=False`` (what `PagedKVCache` passes, and what a graph
    capture does) no tensor value reaches the host on the way to the kernel, whose grid comes from shapes and
    whose blocks read seqlens on the device."""
    q, kp, vp, table, seqlens = pools([50, 9], 4, 2, 2, 32, 32, 17, torch.float16, seed=4)
    expected = run_paged(q, kp, vp, table, seqlens, dict(causal=True))

    def refuse(*_a, **_k):
        raise AssertionError("a host read of a tensor value")
    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    got = run_paged(q, kp, vp, table, seqlens, dict(causal=True), check_values=False)
    monkeypatch.undo()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_explain_refuses_pools_it_cannot_read_in_place_and_ranks_after_triton():
    q, kp, vp, table, seqlens = pools([40, 9], 4, 4, 2, 32, 32, 20, torch.float16, seed=1)
    rep = effattn.explain(q, kp, vp, block_table=table, seqlens=seqlens, causal=True)
    names = [r.path for r in rep.rows]
    assert names.index("triton/paged") < names.index("cuda/paged-prefill") < names.index("torch/paged-gather")
    assert any("decode-shaped calls only (cuda/paged-prefill runs chunked prefill)" in w
               for w in rep.row("cuda/paged-decode").reasons)
    def cuda_row(*ts):
        return effattn.paged.paged_row(make_paged_call(*ts, block_table=table, seqlens=seqlens, backend="cuda")).name
    assert cuda_row(q, kp, vp) == "cuda/paged-prefill"
    assert cuda_row(q[:, :, :1], kp, vp) == "cuda/paged-decode"        # decode-shaped calls stay on the decode
    # head dim 12: the pools cannot be read with 16-byte rows: refused (never copied), the gather runs instead
    bad = [torch.zeros(*t.shape[:-1], 12, dtype=torch.float16) for t in (q, kp, vp)]
    rep = effattn.explain(*bad, block_table=table, seqlens=seqlens, backend="cuda")
    assert any("k_pages is read in place" in w for w in rep.row("cuda/paged-prefill").reasons)
    assert cuda_row(*bad) == "torch/paged-gather"


def test_paged_kv_cache_chunked_prefill_on_the_cuda_kernel():
    """`PagedKVCache` steps of several tokens (chunked prefill) on the CUDA kernels equal the torch gather's."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(16, 8, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    seqs = [cache.new_sequence() for _ in range(2)]
    for T in (21, 18):
        cache.append(seqs, *(torch.randn(2, 2, T, 32, generator=g) for _ in range(2)))
        q = torch.randn(2, 4, T, 32, generator=g).bfloat16()
        call = make_paged_call(q, cache.k_pages, cache.v_pages, block_table=cache.block_table(seqs),
                               seqlens=cache.seqlens(seqs), causal=True, backend="cuda")
        assert effattn.paged.paged_row(call).name == "cuda/paged-prefill"
        with torch.no_grad():
            got = cache.attention(q, seqs, causal=True, backend="cuda")
            ref = effattn.attention(q.float(), cache.k_pages.float(), cache.v_pages.float(),
                                    block_table=cache.block_table(seqs), seqlens=cache.seqlens(seqs), causal=True)
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=0)


def test_op_has_a_fake_kernel():
    q, kp, vp, table, seqlens = pools([20], 4, 2, 1, 32, 16, 17, torch.bfloat16, seed=2)
    ops = decode.kernels(q.device)
    torch.library.opcheck(ops.attention_prefill_paged, (q, kp, vp, table, seqlens, 32 ** -0.5, -1, 0),
                          test_utils=("test_schema", "test_faketensor"))


def test_schedules_give_bitwise_identical_results(emulation):
    """Lockstep, warp-serial and reversed warp-serial runs agree bit for bit (a missing barrier around the
    paged loads would read a tile another warp has not finished with)."""
    q, kp, vp, table, seqlens = pools([90, 30], 5, 4, 2, 32, 32, 19, torch.bfloat16, seed=6)
    runs = []
    for s in (0, 1, 2):
        emulation.emu_set_schedule(s)
        runs.append(run_paged(q, kp, vp, table, seqlens, dict(causal=True, window=40)))
    emulation.emu_set_schedule(EMU_DEFAULT_SCHEDULE)
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
    assert not torch.isnan(runs[0][0]).any()
