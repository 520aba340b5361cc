"""The GPU benchmark suite, checked on the CPU before any GPU minute is spent on it: its plan's
visible-pair counts and FLOPs against the independent oracle's masks (toy shapes) and against closed
forms worked out by hand (the real shapes), the --dry-run plan, and a --smoke run end to end."""
import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import effattn
from benchmarks import registry
from benchmarks.suite import explore, kernels, runner, sections
from benchmarks.suite.__main__ import main as suite_main
from effattn.testing.oracle import visibility

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = sections.SUITES["gpu"]


def _check_flops(e):
    """FLOPs from the pair count: 4*B*D per pair forward, x3.5 forward+backward (softmax); linear
    4*B*H*L*F*(Dv+1) plus FAVOR+'s projection 4*B*H*L*D*F, x3."""
    B, H, L, D = e["B"], e["H"], e["L"], e["D"]
    if e["op"] == "attention":
        assert e["flops"] == 4 * B * D * e["pairs"], e
        assert 2 * e["flops_fwdbwd"] == 7 * e["flops"], e
        return
    v = registry.variant(e["variant"])
    F = effattn.FavorFeatures(D, v.num_features, seed=0).num_features if v.feature_map == "favor" else D
    fwd = 4 * B * H * L * F * (D + int(v.normalize)) + (4 * B * H * L * D * F if v.feature_map == "favor" else 0)
    assert e["flops"] == fwd and e["flops_fwdbwd"] == 3 * fwd, e


def _check_packed(e):
    """The packed section's entry: its documents' causal pairs (each alone) and their FLOPs."""
    docs = e["documents"]
    assert len(docs) == e["B"] and all(1 <= n <= e["L"] for n in docs), e
    assert e["pairs"] == e["H"] * sum(int(visibility(n, n, causal=True).sum()) for n in docs), e
    assert e["flops"] == 4 * e["D"] * e["pairs"] and 2 * e["flops_fwdbwd"] == 7 * e["flops"], e


# the score section's variants: causal pairs (a span's pairs are counted as causal: its time is read
# against span-max, every head at the largest span)
SCORE_VARIANTS = ("softcap", "alibi", "sinks", "t5", "span", "span-max")


def test_plan_counts_match_the_oracle_masks_at_toy_sizes():
    """The suite's own plan (its variants, windows and layouts) at toy sizes: every pair count is
    the number of True entries of the oracle's mask, written independently of effattn."""
    entries = sections.plan(SECTIONS, ["torch"], smoke=True)
    attention = [e for e in entries if e.get("op") == "attention"]
    assert {e["variant"] for e in attention} == {"dense", "causal", "window", "fixed", "decode", "host", "softcap",
                                                 "alibi", "sinks", "t5", "span", "span-max", "relkeys",
                                                 "causal-packed/padded"}
    for e in entries:
        if e["variant"] in ("decode", "host", "paged"):
            continue
        if e["variant"] == "causal-packed/padded":
            _check_packed(e)
            continue
        if e["op"] == "attention":
            v = registry.variant(e["variant"])
            mask = visibility(e["L"], e["L"], causal=v.causal, window=e["window"], layout=e["layout"])
            assert e["pairs"] == int(mask.sum()) * e["H"], e
        _check_flops(e)


def _fixed_pairs(L, bs=128, local=4, every=16):
    """Causal sliding_and_summary by hand (L a multiple of bs): query block r sees its own block
    (a triangle of bs*(bs+1)/2 pairs), the local-1 blocks before it, and the summary blocks
    (index = every-1 mod every) left of that window, each bs*bs pairs."""
    n = L // bs
    full = sum(min(r, local - 1) + max(0, (r - local + 1) // every) for r in range(n))
    return n * bs * (bs + 1) // 2 + full * bs * bs


def test_plan_counts_match_closed_forms_at_real_shapes():
    entries = sections.plan(SECTIONS, ["triton"])
    seen = set()
    for e in entries:
        if e["variant"] == "decode":
            assert (e["Lq"], e["L"], e["H"], e["Hkv"], e["D"]) == (1, 16384, 32, 8, 128) and e["B"] in (1, 4)
            continue
        if e["variant"] == "paged":
            assert (e["op"], e["Lq"], e["L"], e["H"], e["Hkv"], e["D"]) == ("paged_attention", 1, 16384, 32, 8, 128)
            assert e["impls"] == ["effattn-paged-triton", "effattn-contiguous-triton", "gather+sdpa"] and e["B"] in (1, 4)
            continue
        if e["variant"] == "host":
            continue
        if e["variant"] == "causal-packed/padded":
            assert (e["B"], e["H"], e["L"], e["D"]) == (8, 16, 4096, 128), e
            assert 0.3 < sum(e["documents"]) / (e["B"] * e["L"]) < 0.7, e      # about 50% padding
            _check_packed(e)
            continue
        B, H, L, D = e["B"], e["H"], e["L"], e["D"]
        if e["section"].startswith("anchors") or e["section"] == "score":
            assert B * L == 16384 and H * D == 2048, e
        elif e["section"] == "gqa":
            assert B * L == 16384 and (H, e["Hkv"], D) == (32, 8, 128), e
        else:
            assert (B, H, D) == (1, 16, 128), e
        want = {"dense": L * L, "causal": L * (L + 1) // 2,
                "window": L * 1025 - 1024 * 1025 // 2,             # min(i, 1024) + 1 keys for row i
                "fixed": _fixed_pairs(L), **{t: L * (L + 1) // 2 for t in SCORE_VARIANTS}
                }.get(e["variant"])
        if want is not None:
            assert e["pairs"] == H * want, e
            seen.add((e["variant"], L))
        _check_flops(e)
    assert {("window", 16384), ("window", 65536), ("fixed", 16384), ("fixed", 65536), ("causal", 65536),
            ("dense", 4096), ("dense", 16384), ("causal", 4096), ("softcap", 16384), ("alibi", 4096),
            ("sinks", 16384), ("t5", 4096), ("span", 16384), ("span-max", 4096)} <= seen
    # the layout's sparsity as stated for it: about 94% at 16k, 96% at 64k
    assert abs(_fixed_pairs(16384) / (16384 * 16384) - 0.053) < 0.002
    assert abs(_fixed_pairs(65536) / (65536 * 65536) - 0.0367) < 0.001


def test_max_diff_flags_a_baseline_that_disagrees():
    """The max_diff column: out, dq, dk, dv of each baseline against effattn on the same inputs; a
    baseline 10% off is a MISMATCH, the naive one agrees."""
    case = registry.Case.make(registry.variant("causal"), 1, 2, 64, 16, torch.float32, "cpu", window=16)
    naive, eff = (next(i for i in registry.IMPLS if i.name == n and i.op == "attention")
                  for n in ("naive", "effattn-torch"))

    def build_wrong(case):
        b = naive.build(case)
        return registry.Bench(lambda: b.fn() * 1.1, b.leaves)

    res = runner.output_diffs(case, [eff, naive, dataclasses.replace(naive, name="wrong", build=build_wrong)])
    assert max(float(x) for x in res["naive"]["max_diff"].split(",")) < 1e-5
    diffs, flag = res["wrong"]["max_diff"].split()
    assert flag == "MISMATCH" and all(abs(float(d) - 0.1 / 1.1) < 1e-3 for d in diffs.split(","))


def test_dry_run_prints_every_section_with_budget_and_estimate(capsys):
    assert suite_main(["--dry-run", "--budget", "linear=5"]) == 0
    text = capsys.readouterr().out
    for sec in SECTIONS:
        assert f"[{sec.name}] budget" in text
    assert "[linear] budget 5 s" in text and "estimated" in text
    assert "fixed            B=1   H=16  L=65536" in text
    with pytest.raises(SystemExit, match="unknown section"):
        suite_main(["--dry-run", "--budget", "nope=5"])


def test_smoke_run_writes_sections_diffs_budget_skips_and_summary(tmp_path, capsys):
    rc = suite_main(["--smoke", "--sections", "anchors-d128,gqa,decode,host,anchors-d64", "--budget",
                     "anchors-d64=0", "--out", str(tmp_path), "--no-plots"])
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert {r["section"] for r in rows} == {"explore", "anchors-d128", "gqa", "decode", "host", "anchors-d64",
                                           "recheck"}
    assert all(r["status"] == "ok" for r in rows if r["section"] == "explore")
    # the re-check: every kind of call (dense, causal, GQA, decode) against the float64 oracle, passed
    rechecked = {r["variant"] for r in rows if r["section"] == "recheck" and r["status"] == "ok"}
    assert rechecked == {"dense", "causal", "causal-gqa2", "decode-causal-gqa2"}, rows
    assert all(r["status"] == "ok" for r in rows if r["section"] in ("gqa", "host") and r["impl"] == "effattn-torch")
    assert {r["impl"] for r in rows if r["section"] == "gqa" and r["status"] == "ok"} == {"effattn-torch",
                                                                                       "sdpa-flash"}
    record = json.loads((tmp_path / "explore.json").read_text())
    assert len(record["calls"]) == 2 and all(c["status"] == "ok" and c["key"] for c in record["calls"])
    assert all(r["status"] == "skipped: section budget" for r in rows if r["section"] == "anchors-d64")
    timed = [r for r in rows if r["section"] == "anchors-d128" and r["status"] == "ok"]
    base = [r for r in timed if r["kind"] == "baseline"]
    assert {r["impl"] for r in timed} >= {"effattn-torch", "naive", "sdpa-flash"}
    for r in base:                                     # out, dq, dk, dv against effattn: fp32, tiny
        diffs = [float(x) for x in r["max_diff"].split(",")]
        assert len(diffs) == 4 and max(diffs) < 1e-3, r
    assert any(r["impl"] == "effattn-torch" and r["status"] == "ok" and r["max_diff"].startswith("bound")
               for r in rows if r["section"] == "decode")
    assert "## dense | forward | float32 B=1 H=2 D=32 | anchors-d128" in (tmp_path / "results.md").read_text()
    summary = text[text.rindex("SUMMARY"):]
    assert "anchors-d128  causal" in summary and "x the bound" in summary


_PLAN_SCRIPT = """
import contextlib, io, json
from benchmarks.suite import kernels
from benchmarks.suite.__main__ import main
from effattn.backends.triton.attention import configs, launch
bf = kernels.torch.bfloat16
calls = [kernels.Call("attention", 4, 16, 16, 4096, 4096, 128, bf, True),
         kernels.Call("attention", 4, 32, 8, 1, 16384, 128, bf, False)]
variants, failed = kernels.plan_variants(calls)
again, _ = kernels.plan_variants(calls + calls)
one, _ = kernels.plan_variants([kernels.Call("attention", 1, 16, 16, 4096, 4096, 128, bf, True)])   # 1 GiB of dQ partials
text = io.StringIO()
with contextlib.redirect_stdout(text):
    main(["--dry-run", "--sections", "gqa,decode"])
delta = next(v for v in variants if v.name == "delta_kernel")       # the smallest: the worker's warmup path
compiled = kernels._compile_one(delta, arch=90)
print(json.dumps(dict(compiled=compiled,
    variants=[[v.name, dict(v.kwargs)] for v in variants], failed=[str(f) for f in failed], again=len(again),
    tuned_left=len(launch._TUNED), candidates={k: configs.candidates(k, 128, 2) for k in ("fwd", "bwd")},
    five_fits=configs.five_fits((4096 // 128, 4, 16, 4096, 128)),
    one=[[v.name, dict(v.kwargs).get("FIVE")] for v in one],
    dry=text.getvalue())))
"""


def test_precompile_plan_lists_every_autotune_candidate_without_a_gpu():
    """The precompile plan, made on this CPU without Triton's interpreter (the launchers run on meta
    tensors, launches recorded, nothing run): every candidate config of the forward's autotuner at
    each kind of call, the backward's candidates too, duplicates merged, the autotuner's cache left
    as it was; a worker compiles a planned variant through Triton's warmup (for sm_90, offline); and
    --dry-run prints the list, its count and the estimated total time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _PLAN_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["failed"] == [] and got["tuned_left"] == 0
    assert got["compiled"][0].startswith("delta_kernel") and got["compiled"][2] == "", got["compiled"]
    cfg = lambda kw: (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"])      # noqa: E731
    fwd = [cfg(kw) for name, kw in got["variants"] if name == "fwd_kernel"]
    cands = [tuple(c[:4]) for c in got["candidates"]["fwd"]]
    # planned for an sm_90 target: K / V through TMA in every forward variant (the launchers' default there)
    assert all(kw["KV_TMA"] for name, kw in got["variants"] if name == "fwd_kernel")
    # prefill (causal) launches every forward candidate once; decode (Lq = 1 against 16k keys) takes the
    # split-KV decode kernel (one config, never autotuned; the merge of its splits folded in)
    assert sorted(fwd) == sorted(cands), fwd
    assert {name for name, kw in got["variants"]} >= {"decode_kernel", "bwd_kernel"}
    # the five-product backward ("dq5"): a candidate where its fp32 dQ partials fit configs.DQ5_MAX_BYTES
    backward = {(kw["BLOCK_M1"], kw["BLOCK_N1"], 0, 0, kw["num_warps"], kw["num_stages"], "dq5") if kw["FIVE"] else
                (kw["BLOCK_M1"], kw["BLOCK_N1"], kw["BLOCK_M2"], kw["BLOCK_N2"], kw["num_warps"], kw["num_stages"])
                for name, kw in got["variants"] if name == "bwd_kernel"}
    assert backward == {tuple(c) for c in got["candidates"]["bwd"] if "dq5" not in c or got["five_fits"]}, backward
    assert any("dq5" in c for c in got["candidates"]["bwd"]) and not got["five_fits"]
    assert ["bwd_kernel", True] in got["one"] and ["dq_reduce_kernel", None] in got["one"], got["one"]
    assert got["again"] == len(got["variants"])                  # the same calls twice: nothing new
    dry = got["dry"]
    n = int(dry.split("[precompile]")[1].split(": ")[1].split()[0])
    listed = dry.split("[precompile]")[1].split("[explore]")[0].strip().splitlines()[1:]
    assert n == len(listed) > 0 and all("warps=" in line for line in listed)
    assert "estimated total" in dry and "[gqa] budget" in dry and "[recheck] budget" in dry


def test_recheck_shrinks_a_call_within_its_tuning_key_and_judges_by_the_rule():
    from effattn.layouts import sliding_and_summary
    big = kernels.Call("attention", 1, 16, 16, 65536, 65536, 128, torch.bfloat16, True,
                          layout=sliding_and_summary(65536, 128, 4, 16))
    small = explore.recheck_call(big)
    assert (small.B, small.H, small.Lq, small.Lk) == (1, 8, 8192, 8192)
    assert explore.tuning_key(small) == explore.tuning_key(big)
    assert torch.equal(small.layout.mask, sliding_and_summary(8192, 128, 4, 16).mask)
    gqa = explore.recheck_call(kernels.Call("attention", 4, 32, 8, 1, 16384, 128, torch.bfloat16, False))
    assert (gqa.B, gqa.H, gqa.Hkv, gqa.Lq, gqa.Lk) == (4, 8, 2, 1, 8192)
    # a forward-only call is covered by its forward+backward twin; decode (Lq = 1) is its own kind
    fwd_only = dataclasses.replace(big, backward=False)
    assert explore.distinct_calls([fwd_only, big]) == [big]
    ref = [torch.zeros(4)] * 4
    low = [torch.full((4,), 0.01)] * 4
    ok, _ = explore.judge([torch.full((4,), 0.015)] * 4, ref, low, torch.float32)
    bad, _ = explore.judge([torch.full((4,), 0.05), torch.full((4,), float("nan"))] + ref[:2], ref, low,
                           torch.float32)
    assert ok == [] and bad[0].startswith("out: error") and bad[1] == "dq: NaN"
    tiny = kernels.Call("attention", 1, 2, 2, 16, 16, 16, torch.float32, False)
    with pytest.raises(explore.NotServed, match="unknown backend"):       # a row "unsupported", not "error"
        explore.run_call(tiny, "nope", *explore.tensors(tiny, torch.device("cpu"))[:4])


def test_paged_section_rows_on_the_cpu(capsys):
    """The paged section at toy sizes: the contiguous decode and the gather + SDPA baseline on the same
    keys agree (the ``|diff|`` column) and carry the memory bound; the dry run plans it."""
    import time

    from benchmarks.suite import extra_sections
    sec = sections.smoke_section(next(s for s in SECTIONS if s.name == "paged"))
    rows = extra_sections.paged_rows(sec, ["torch"], torch.device("cpu"), time.monotonic() + 60)
    assert [(r["impl"], r["B"], r["status"]) for r in rows] == [
        (i, B, "ok") for B in (1, 4) for i in ("effattn-contiguous-torch", "gather+sdpa")]
    assert all(r["max_diff"].startswith("bound ") and float(r["max_diff"].split()[-1]) < 1e-5 for r in rows)
    suite_main(["--dry-run", "--sections", "paged"])
    assert "effattn-paged-triton, effattn-contiguous-triton" in capsys.readouterr().out
