"""The GPU benchmark suite, checked on the CPU before any GPU minute is spent on it: its plan's
visible-pair counts and FLOPs against the independent oracle's masks (toy shapes) and against closed
forms worked out by hand (the real shapes), the --dry-run plan, and a --smoke run end to end."""
import csv
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import effattn  # noqa: E402
from benchmarks import gpu_extras, registry, run, suites  # noqa: E402
from oracle import visibility  # noqa: E402

SECTIONS = suites.SUITES["gpu"]


def _check_flops(e):
    """FLOPs from the pair count: 4*B*D per pair forward, x3.5 forward+backward (softmax); linear
    4*B*H*L*F*(Dv+1) plus FAVOR+'s projection 4*B*H*L*D*F, x3."""
    B, H, L, D = e["B"], e["H"], e["L"], e["D"]
    if e["op"] == "attention":
        assert e["flops"] == 4 * B * D * e["pairs"], e
        assert 2 * e["flops_fwdbwd"] == 7 * e["flops"], e
        return
    v = registry.variant(e["variant"])
    F = effattn.FavorFeatures(D, seed=0).num_features if v.feature_map == "favor" else D
    fwd = 4 * B * H * L * F * (D + int(v.normalize)) + (4 * B * H * L * D * F if v.feature_map == "favor" else 0)
    assert e["flops"] == fwd and e["flops_fwdbwd"] == 3 * fwd, e


def test_plan_counts_match_the_oracle_masks_at_toy_sizes():
    """The suite's own plan (its variants, windows and layouts) at toy sizes: every pair count is
    the number of True entries of the oracle's mask, written independently of effattn."""
    entries = suites.plan(SECTIONS, ["torch"], smoke=True)
    attention = [e for e in entries if e.get("op") == "attention"]
    assert {e["variant"] for e in attention} == {"dense", "causal", "window", "fixed"}
    for e in entries:
        if e["variant"] == "decode":
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
    entries = suites.plan(SECTIONS, ["triton"])
    seen = set()
    for e in entries:
        if e["variant"] == "decode":
            assert (e["L"], e["H"], e["D"]) == (16384, 32, 128) and e["B"] in (1, 4)
            continue
        B, H, L, D = e["B"], e["H"], e["L"], e["D"]
        if e["section"].startswith("anchors"):
            assert B * L == 16384 and H * D == 2048, e
        else:
            assert (B, H, D) == (1, 16, 128), e
        want = {"dense": L * L, "causal": L * (L + 1) // 2,
                "window": L * 1025 - 1024 * 1025 // 2,             # min(i, 1024) + 1 keys for row i
                "fixed": _fixed_pairs(L)}.get(e["variant"])
        if want is not None:
            assert e["pairs"] == H * want, e
            seen.add((e["variant"], L))
        _check_flops(e)
    assert {("window", 16384), ("window", 65536), ("fixed", 16384), ("fixed", 65536), ("causal", 65536),
            ("dense", 4096), ("dense", 16384), ("causal", 4096)} <= seen
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

    res = gpu_extras.output_diffs(case, [eff, naive, dataclasses.replace(naive, name="wrong", build=build_wrong)])
    assert max(float(x) for x in res["naive"]["max_diff"].split(",")) < 1e-5
    diffs, flag = res["wrong"]["max_diff"].split()
    assert flag == "MISMATCH" and all(abs(float(d) - 0.1 / 1.1) < 1e-3 for d in diffs.split(","))


def test_dry_run_prints_every_section_with_budget_and_estimate(capsys):
    assert run.main(["--suite", "gpu", "--dry-run", "--budget", "linear=5"]) == 0
    text = capsys.readouterr().out
    for sec in SECTIONS:
        assert f"[{sec.name}] budget" in text
    assert "[linear] budget 5 s" in text and "estimated" in text
    assert "fixed            B=1   H=16  L=65536" in text
    with pytest.raises(SystemExit, match="unknown section"):
        run.main(["--suite", "gpu", "--dry-run", "--budget", "nope=5"])


def test_smoke_run_writes_sections_diffs_budget_skips_and_summary(tmp_path, capsys):
    rc = run.main(["--suite", "gpu", "--smoke", "--sections", "anchors-d128,decode,anchors-d64", "--budget",
                   "anchors-d64=0", "--out", str(tmp_path), "--no-plots", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert {r["section"] for r in rows} == {"anchors-d128", "decode", "anchors-d64"}
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
