"""The Triton backend's split-KV decode (effattn/backends/triton/attention/decode.py): the decode
kernel (its splits merged by the last to finish) against the float64 oracle with every visibility
feature, GQA packing, forced splits, determinism, and when the backend takes the path (explain). Interpreter sizes: Lk <= 400,
D <= 32 (the automatic choice is exercised with its threshold lowered)."""
import math

import pytest
import torch

import effattn
from effattn.layouts import BlockLayout
from effattn.testing.oracle import naive_attention
from tests.conftest import DEVICE, capture_step, random_qkv

ta = pytest.importorskip("effattn.backends.triton.attention")
rt = pytest.importorskip("effattn.backends.triton.runtime")
if rt.triton is None or rt._available(DEVICE) is not None:
    pytest.skip(f"triton backend unavailable: {rt._available(DEVICE)}", allow_module_level=True)
decode = ta.decode


def window_pair(kw):
    """(left, right) in the launchers' encoding (-1 = unbounded) of the public kwargs."""
    from effattn.visibility import normalize_window
    return normalize_window(kw.get("window"), kw.get("causal", False))


def run_decode(q, k, v, kw, kpm=None, **force):
    lay = kw.get("layout")
    left, right = window_pair(kw)
    return decode.fwd(q, k, v, lay.mask if lay is not None else None, lay.block_size if lay is not None else 0, kpm,
                      kw.get("scale", 1 / math.sqrt(q.shape[-1])), left, right, **force)


def check(out, lse, ref, ref_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], atol=2e-6, rtol=1e-5)


# id -> (B, H, Hkv, Lq, Lk, D, Dv, kwargs, keys_per_split, block_n); kwargs may hold layout=(bs, density),
# kpm=fraction, transposed=True ((B, L, H, D) views)
CASES = {
    "gqa4-Lq1-dense-3splits-uneven": (2, 8, 2, 1, 150, 16, 16, {}, 64, 32),
    "mqa8-Lq3-causal-kpm": (1, 8, 1, 3, 200, 16, 24, dict(causal=True, kpm=0.3), 64, 32),
    "gqa2-Lq5-window-pair-Dv-ne-D": (2, 4, 2, 5, 170, 32, 8, dict(window=(60, 2)), 32, 32),
    "gqa2-Lq4-causal-window-transposed": (2, 4, 2, 4, 190, 16, 16, dict(causal=True, window=70, transposed=True),
                                          64, 64),
    "mha-Lq2-layout-per-head-causal": (1, 2, 2, 2, 160, 16, 16, dict(layout=(32, 0.5), causal=True), 64, 32),
    "gqa4-Lq16-layout-shared-window": (1, 4, 1, 16, 130, 16, 16, dict(layout=(48, 0.6), window=(50, 50),
                                                                        shared=True), 64, 32),
    "Lq-gt-Lk-causal-empty-rows": (1, 4, 2, 7, 5, 16, 16, dict(causal=True), 32, 32),
    "headdim-40-Dv-72-padded": (1, 2, 1, 1, 100, 40, 72, dict(causal=True), 32, 32),
    "one-split-default": (1, 2, 1, 1, 90, 16, 16, {}, None, None),
}


def make_case(case_id):
    B, H, Hkv, Lq, Lk, D, Dv, kw, per, bn = CASES[case_id]
    kw = dict(kw)
    g = torch.Generator().manual_seed(len(case_id))
    q, k, v = random_qkv(B, H, Hkv, Lq, Lk, D, Dv, g, transposed=kw.pop("transposed", False))
    kpm = (torch.rand(B, Lk, generator=g) < kw.pop("kpm")).to(DEVICE) if "kpm" in kw else None
    if "layout" in kw:
        bs, dens = kw.pop("layout")
        hl = 1 if kw.pop("shared", False) else H
        mask = torch.rand(hl, math.ceil(Lq / bs), math.ceil(Lk / bs), generator=g) < dens
        kw["layout"] = BlockLayout(mask, bs).to(DEVICE)
    force = {} if per is None else dict(keys_per_split=per, block_n=bn)
    return q, k, v, kw, kpm, force


@pytest.mark.parametrize("case_id", list(CASES))
def test_decode_against_float64(case_id):
    q, k, v, kw, kpm, force = make_case(case_id)
    out, lse = run_decode(q, k, v, kw, kpm, **force)
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), key_padding_mask=kpm, **kw)
    check(out, lse, ref, ref_lse)
    assert out.dtype == q.dtype and lse.dtype == torch.float32


def test_splits_without_visible_keys_and_padded_batch_rows():
    """A split whose keys are all padding and a batch row padded entirely (its rows: out 0, lse -inf),
    with and without a window: splits of 64 keys, the last one uneven."""
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 2, 200, 16
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, h, L, D, generator=g).to(DEVICE) for h, L in ((H, Lq), (Hkv, Lk), (Hkv, Lk)))
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[:, 64:128] = True                     # split 1 sees nothing
    kpm[1] = True                             # batch row 1 sees nothing at all
    kpm = kpm.to(DEVICE)
    for kw in ({}, dict(causal=True, window=(100, 0))):      # dense: 4 splits; window: 2, over keys 98..
        out, lse = run_decode(q, k, v, kw, kpm, keys_per_split=64, block_n=32)
        ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), key_padding_mask=kpm, **kw)
        check(out, lse, ref, ref_lse)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == -math.inf).all())


def test_bf16_within_the_naive_error_rule():
    B, H, Hkv, Lq, Lk, D = 1, 8, 2, 2, 260, 32
    q = torch.randn(B, H, Lq, D, device=DEVICE).bfloat16()
    k, v = (torch.randn(B, Hkv, Lk, D, device=DEVICE).bfloat16() for _ in range(2))
    kw = dict(causal=True, window=200)
    out, _ = run_decode(q, k, v, kw, keys_per_split=64, block_n=64)
    ref, _ = naive_attention(q, k, v, **kw)
    low, _ = naive_attention(q, k, v, dtype=torch.bfloat16, **kw)
    err, nerr = (out.double() - ref).abs().max().item(), (low.double() - ref).abs().max().item()
    assert not torch.isnan(out).any() and err <= 2 * nerr + 8e-3, (err, nerr)


def test_bitwise_deterministic_and_split_count_changes_only_rounding():
    q, k, v, kw, kpm, force = make_case("mqa8-Lq3-causal-kpm")
    a = run_decode(q, k, v, kw, kpm, **force)
    b = run_decode(q, k, v, kw, kpm, **force)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    one = run_decode(q, k, v, kw, kpm, keys_per_split=256, block_n=32)        # a single split
    torch.testing.assert_close(one[0], a[0], atol=2e-6, rtol=1e-5)


def test_merge_by_the_last_split_in_chunks_and_counters_left_zero(monkeypatch):
    """The last split to arrive merges all of a (b, kv head)'s splits in chunks of SPLIT_CHUNK splits:
    1, 2 (13 splits: an uneven last chunk) and one chunk for all give the float64 result, the same
    result on a second run, and the arrival counters are zero again after every launch (they are
    reused by the next)."""
    B, H, Hkv, Lq, Lk, D = 2, 6, 2, 2, 400, 16
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, Lq, D, generator=g).to(DEVICE)
    k, v = (torch.randn(B, Hkv, Lk, D, generator=g).to(DEVICE) for _ in range(2))
    kpm = (torch.rand(B, Lk, generator=g) < 0.2).to(DEVICE)
    kpm[:, 96:160] = True                         # two splits see no key
    kw = dict(causal=True)
    ref, ref_lse = naive_attention(q.double(), k.double(), v.double(), key_padding_mask=kpm, **kw)
    real_chunk = decode.split_chunk
    outs = []
    for chunk in (1, 2, None):
        ta.launch._PLANS.clear()                  # the chunk is part of the cached launch plan
        monkeypatch.setattr(decode, "split_chunk", real_chunk if chunk is None else (lambda *a, c=chunk: c))
        out, lse = run_decode(q, k, v, kw, kpm, keys_per_split=32, block_n=32)      # 13 splits
        check(out, lse, ref, ref_lse)
        again = run_decode(q, k, v, kw, kpm, keys_per_split=32, block_n=32)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)
        assert all(int(c.abs().sum()) == 0 for c in decode._COUNTERS.values())
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[2], atol=2e-6, rtol=1e-5)      # chunking changes rounding only
    assert real_chunk(4, 128, 4) == 8 and real_chunk(128, 128, 8) == 1 and real_chunk(2, 16, 4) == 64


def test_plan_splits_fills_two_waves_with_a_minimum_per_split():
    # B*Hkv = 8 slices on 132 SMs: at most 33 splits (264 programs, two waves); the split length
    # rounded up to whole 64-key tiles, never adding a split (no tail wave)
    n, per = decode.plan_splits(8, 65536, 132, 64)
    assert (n, per) == (32, 2048)
    assert decode.plan_splits(8, 16384, 132, 64) == (32, 512)          # the H100 run's B=1 decode row
    assert decode.plan_splits(32, 16384, 132, 64) == (8, 2048)         # its B=4 row: 256 programs
    for slices, span in ((8, 65536), (3, 5000), (8, 16384), (32, 16384), (5, 100000)):
        n, per = decode.plan_splits(slices, span, 132, 64)
        assert per % 64 == 0 and (n - 1) * per < span <= n * per and n * slices <= 2 * 132
    # a short range: no split but the last under MIN_KEYS_PER_SPLIT keys, and no more splits than
    # span // MIN_KEYS_PER_SPLIT
    assert decode.MIN_KEYS_PER_SPLIT == 256
    assert decode.plan_splits(8, 1100, 132, 64) == (4, 320)            # 320, 320, 320 and 140 keys
    assert decode.plan_splits(8, 300, 132, 64) == (1, 320)
    # many slices already fill the GPU: one split; an empty range: one split that sees nothing
    assert decode.plan_splits(512, 4096, 132, 64) == (1, 4096)
    assert decode.plan_splits(4, 0, 132, 64) == (1, 64)
    # the SM count is a parameter: a smaller GPU wants fewer splits
    assert decode.plan_splits(8, 65536, 16, 64)[0] == 4


def test_packed_rows_and_key_range():
    assert decode.packed_rows(4, 1) == 16 and decode.packed_rows(8, 3) == 32 and decode.packed_rows(1, 1) == 16
    assert decode.key_range(1, 5000, -1) == (0, 5000)
    assert decode.key_range(1, 5000, 1024) == (5000 - 1 - 1024, 5000)        # the query at 4999 sees 1025 keys
    assert decode.key_range(4, 100, 500) == (0, 100)


# ------------------------------------------------------------------------------ the automatic choice

class Calls:
    """Counts the launchers' calls and still runs them."""

    def __init__(self, monkeypatch):
        self.decode = self.prefill = 0
        real_decode, real_fwd = decode.fwd, ta.launch.fwd

        def d(*a, **k):
            self.decode += 1
            return real_decode(*a, **k)

        def f(*a, **k):
            self.prefill += 1
            return real_fwd(*a, **k)
        monkeypatch.setattr(decode, "fwd", d)
        monkeypatch.setattr(ta.launch, "fwd", f)


def test_triton_backend_takes_the_decode_path_for_short_queries_on_long_keys(monkeypatch):
    """Lq <= 16 against >= DECODE_MIN_KEYS visible keys (lowered here to 256) takes the decode path;
    inputs that need grad, dropout, and Lq = 17 take the prefill kernel; explain says which and why."""
    monkeypatch.setattr(effattn.splits, "DECODE_MIN_KEYS", 256)
    calls = Calls(monkeypatch)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 2, 16, generator=g).to(DEVICE)
    k, v = (torch.randn(1, 2, 260, 16, generator=g).to(DEVICE) for _ in range(2))
    out, lse = effattn.attention(q, k, v, causal=True, return_lse=True, backend="triton")
    assert (calls.decode, calls.prefill) == (1, 0)
    check(out, lse, *naive_attention(q.double(), k.double(), v.double(), causal=True))
    ex = effattn.explain(q, k, v, causal=True)
    assert "split-KV decode: 2 heads x 2 queries packed per KV head" in ex.paths["triton"], ex.paths
    assert "split-KV decode" in str(ex)
    # the same call needing grad: the prefill kernel (whose backward other tests check)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out2 = effattn.attention(*leaves, causal=True, backend="triton")
    assert (calls.decode, calls.prefill) == (1, 1) and out2.requires_grad
    torch.testing.assert_close(out2, out, atol=2e-6, rtol=1e-5)
    ex = effattn.explain(*leaves, causal=True)
    assert ex.paths["triton"] == "triton/prefill" and "require grad" in _why_not_decode(ex)
    with torch.no_grad():
        effattn.attention(*leaves, causal=True, backend="triton")
    assert calls.decode == 2
    # a window leaving fewer visible keys than the threshold, dropout, more than 16 queries
    assert "visible keys < 256" in _why_not_decode(effattn.explain(q, k, v, causal=True, window=100))
    assert "dropout" in _why_not_decode(effattn.explain(q, k, v, dropout_p=0.1))
    ex = effattn.explain(torch.randn(1, 4, 17, 16, device=DEVICE), k, v)
    assert ex.paths["triton"] == "triton/prefill" and "Lq=17 not in 1..16" in _why_not_decode(ex)


def _why_not_decode(ex) -> str:
    return "; ".join(ex.row("triton/decode").reasons)


def test_decode_threshold_on_a_real_length_explain_only():
    """At the default threshold (1024 visible keys): explain only (no kernel runs)."""
    q = torch.randn(2, 32, 1, 128, device=DEVICE)
    k = v = torch.randn(2, 8, 4096, 128, device=DEVICE)
    path = effattn.explain(q, k, v, causal=True).paths["triton"]
    # 2*8 = 16 slices fit 2*132 // 16 = 16 splits; 256 keys at least per split allow them
    assert path == ("triton/decode: split-KV decode: 4 heads x 1 queries packed per KV head, 16 splits of 256 keys, "
                    "merged by the last to finish"), path
    assert "1023 visible keys < 1024" in _why_not_decode(effattn.explain(q, k[:, :, :1023], v[:, :, :1023]))


def test_decode_op_opcheck():
    q = torch.randn(1, 4, 2, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, 40, 16, device=DEVICE) for _ in range(2))
    kpm = torch.rand(1, 40, device=DEVICE) < 0.2
    lm = torch.rand(4, 1, 3, device=DEVICE) < 0.7
    torch.library.opcheck(ta.triton_attention_decode, (q, k, v, lm, 16, kpm, 0.3, 10, 0))


# ------------------------------------------------------------------------------ on a GPU (pytest -m gpu)

SMOKE = DEVICE.type == "cpu"           # reached only with EFFATTN_GPU_SMOKE=1: toy sizes in the interpreter


@pytest.mark.gpu
@pytest.mark.toy
@pytest.mark.parametrize("Lq,kw", [(1, dict(causal=True)), (4, dict(causal=True, window=(3000, 0), kpm=True))],
                         ids=["Lq1-causal", "Lq4-window3000-kpm"])
def test_decode_at_real_sizes_within_the_naive_error_rule(Lq, kw):
    """B=4, H=32, Hkv=8, Lk=16k, D=128, bf16 (a toy shape in a smoke run): the automatic decode path,
    judged against float64 by the low-precision rule (2x the naive bf16 error + 8e-3)."""
    from effattn.testing.oracle import chunked_attention
    B, H, Hkv, Lk, D = (2, 4, 2, 1100, 32) if SMOKE else (4, 32, 8, 16384, 128)
    kw = dict(kw)
    if SMOKE and "window" in kw:
        kw["window"] = (300, 0)
    g = torch.Generator(device=DEVICE).manual_seed(Lq)
    q = torch.randn(B, H, Lq, D, generator=g, device=DEVICE).bfloat16()
    k, v = (torch.randn(B, Hkv, Lk, D, generator=g, device=DEVICE).bfloat16() for _ in range(2))
    if kw.pop("kpm", False):
        kw["key_padding_mask"] = torch.rand(B, Lk, generator=g, device=DEVICE) < 0.1
    assert "split-KV decode" in effattn.explain(q, k, v, **kw).paths["triton"]
    with torch.no_grad():
        out = effattn.attention(q, k, v, backend="triton", **kw)
    kpm = kw.pop("key_padding_mask", None)
    dout = torch.zeros_like(out)
    ref = chunked_attention(q, k, v, dout, key_padding_mask=kpm, **kw)[0]
    low = chunked_attention(q, k, v, dout, key_padding_mask=kpm, dtype=torch.bfloat16, **kw)[0]
    err, nerr = (out.double() - ref).abs().max().item(), (low.double() - ref).abs().max().item()
    assert not torch.isnan(out).any() and err <= 2 * nerr + 8e-3, (err, nerr)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 512], ids=["causal", "window512"])
def test_decode_step_captured_in_a_cuda_graph_replays_like_eager(window):
    """A MultiheadAttention token step on a fixed-capacity KVCache (2048 slots after a 1100-token
    prompt: the split-KV decode) captured once in torch.cuda.CUDAGraph and replayed for six tokens
    gives the same outputs and the same cache (lengths exactly, buffers up to rounding: cuBLAS may
    pick another GEMM algorithm under capture) as the steps run eagerly on a second cache."""
    from effattn.nn import KVCache, MultiheadAttention
    torch.manual_seed(0)
    E, heads, B = 512, 4, 2             # head dim 128: the prefill kernels other GPU tests compiled
    mha = MultiheadAttention(E, heads, batch_first=True, backend="triton", window=window).to(DEVICE, torch.bfloat16)
    mha.eval()
    prompt = torch.randn(B, 1100, E, device=DEVICE, dtype=torch.bfloat16)
    tokens = torch.randn(B, 7, E, device=DEVICE, dtype=torch.bfloat16)
    graphed, eager = KVCache(capacity=2048), KVCache(capacity=2048)

    def step(x, cache):
        return mha(x, x, x, is_causal=True, need_weights=False, cache=cache)[0]

    with torch.no_grad():
        for c in (graphed, eager):
            step(prompt, c)
        x = tokens[:, :1].clone()
        warm, graph, out = capture_step(lambda: step(x, graphed))   # the capture does not move the lengths
        assert torch.equal(warm, step(x, eager))
        outs = []
        for t in range(1, 7):
            x.copy_(tokens[:, t:t + 1])
            graph.replay()
            want = step(tokens[:, t:t + 1], eager)
            torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
            assert torch.equal(graphed.lengths, eager.lengths), t          # advanced on the GPU by the replay
            outs.append(out.clone())
        assert graphed.lengths.tolist() == [1107, 1107] and not torch.equal(outs[0], outs[1])
        for a, b in ((graphed._k, eager._k), (graphed._v, eager._v)):
            torch.testing.assert_close(a[:, :, :1107], b[:, :, :1107], atol=2e-2, rtol=2e-2)
    ex = effattn.explain(*(torch.randn(B, heads, n, E // heads, device=DEVICE, dtype=torch.bfloat16)
                           for n in (1, 2048, 2048)), causal=True)
    assert "split-KV decode" in ex.paths["triton"]
