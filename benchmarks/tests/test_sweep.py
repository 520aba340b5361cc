"""The sweep (benchmarks/run.py and its core): the FLOP helper's exact counts, a --quick sweep end to
end, failing configurations recorded without stopping the sweep."""
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import effattn
from benchmarks import registry, report, run
from benchmarks.flops import attention_flops, linear_attention_flops, tflops, visible_pairs
from benchmarks.progress import SimpleBar
from effattn.layouts import BlockLayout
from effattn.testing.oracle import visibility as oracle_visibility

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ FLOPs

def test_visible_pairs_is_the_rules_count():
    """benchmarks.flops counts pairs with effattn.visibility's rule (whose own tests, hand-counted and
    against the oracle, are tests/core/test_visibility.py)."""
    g = torch.Generator().manual_seed(0)
    for Lq, Lk, causal, window in ((10, 10, True, 2), (3, 5, True, None), (10, 10, False, (0, 1))):
        lay = BlockLayout(torch.rand(2, -(-Lq // 4), -(-Lk // 4), generator=g) < 0.5, 4)
        for layout in (None, lay):
            want = int(oracle_visibility(Lq, Lk, causal=causal, window=window, layout=layout, H=2)[0].sum())
            assert visible_pairs(Lq, Lk, causal=causal, window=window, layout=layout, heads=2) == want


def test_attention_flops_exact():
    assert attention_flops(2, 3, 64, 100, 100) == 4 * 2 * 3 * 64 * 100 * 100 == 15_360_000
    assert attention_flops(2, 3, 64, 100, 100, mode="fwdbwd") == 53_760_000        # x3.5
    assert attention_flops(2, 3, 64, 100, 100, causal=True) == 4 * 2 * 3 * 64 * 5050
    assert attention_flops(1, 1, 8, 10, 10, causal=True, window=2) == 4 * 8 * 27
    lay = BlockLayout(torch.tensor([[True, False], [True, True]]), block_size=4)
    assert attention_flops(1, 2, 16, 6, 6, layout=lay) == 4 * 2 * 16 * 28
    assert attention_flops(1, 1, 16, 4, 4, value_dim=32) == 2 * (16 + 32) * 16
    with pytest.raises(ValueError, match="mode"):
        attention_flops(1, 1, 8, 4, 4, mode="bwd")


def test_linear_attention_flops_exact():
    assert linear_attention_flops(1, 2, 4, 10) == 4 * 2 * 10 * 4 * (4 + 1) == 1600
    assert linear_attention_flops(1, 2, 4, 10, mode="fwdbwd") == 4800             # x3
    assert linear_attention_flops(1, 2, 4, 10, normalize=False) == 4 * 2 * 10 * 4 * 4
    assert linear_attention_flops(1, 2, 4, 10, num_features=8, favor=True) == 3200 + 4 * 2 * 10 * 4 * 8
    assert tflops(10**12, 1000.0) == 1.0


# ------------------------------------------------------------------------------------ the runner

def test_quick_run_writes_results(tmp_path):
    out = tmp_path / "quick"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out), "--no-progress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eff/base" in proc.stdout
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert rows and all(r["status"] for r in rows)
    variants = {r["variant"] for r in rows}
    assert variants == set(run.QUICK_VARIANTS)
    for v in variants:   # every variant has effattn and a baseline timed
        ok = [r for r in rows if r["variant"] == v and r["status"] == "ok"]
        assert {r["kind"] for r in ok} == {"effattn", "baseline"}, v
        assert all(float(r["time_ms"]) > 0 and float(r["tflops"]) > 0 for r in ok)
    data = json.loads((out / "results.json").read_text())
    for key in ("device", "torch", "triton", "date", "args", "memory_method"):
        assert key in data["meta"]
    assert len(data["rows"]) == len(rows)
    assert (out / "results.md").read_text().startswith("# effattn benchmarks")
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(f"{v}-{m}.png" for v in variants for m in ("fwd", "fwdbwd"))


def _raiser(exc):
    def build(case):
        raise exc
    return build


def test_failing_configs_are_recorded_and_the_sweep_goes_on():
    s = run.Settings(device=torch.device("cpu"), dtype=torch.float32, head_dim=16, lengths=[32, 64],
                     batch=1, heads=2, window=8, time_budget_s=0.0, min_runs=1)
    naive = next(i for i in registry.IMPLS if i.name == "naive" and i.op == "attention")
    impls = [
        registry.Impl("fake-cuda-oom", "baseline", "attention",
                      _raiser(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))),
        registry.Impl("fake-cpu-oom", "baseline", "attention", _raiser(MemoryError())),
        registry.Impl("fake-alloc", "baseline", "attention",
                      _raiser(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"))),
        registry.Impl("fake-broken", "baseline", "attention", _raiser(RuntimeError("No available kernel"))),
        registry.Impl("fake-effattn", "effattn", "attention", _raiser(ValueError("kernel bug"))),
        naive,
        registry.Impl("naive-over-budget", "baseline", "attention", naive.build, score_bytes=lambda c, m: 5 * 2**30),
    ]
    rows = run.sweep([registry.variant("causal")], impls, s)
    assert len(rows) == 2 * len(impls) * 2                       # 2 lengths x 2 modes each
    status = {(r["impl"], r["L"], r["mode"]): r["status"] for r in rows}
    for L in (32, 64):
        for mode in ("fwd", "fwdbwd"):
            assert status[("fake-cuda-oom", L, mode)] == "oom"
            assert status[("fake-cpu-oom", L, mode)] == "oom"
            assert status[("fake-alloc", L, mode)] == "oom"
            assert status[("fake-broken", L, mode)] == "unsupported: RuntimeError: No available kernel"
            assert status[("fake-effattn", L, mode)] == "error: ValueError: kernel bug"
            assert status[("naive", L, mode)] == "ok"
            assert status[("naive-over-budget", L, mode)] == "skipped: would need 5.0 GiB (budget 4 GiB)"
    text = report.summary_text(rows, {"device": "cpu", "torch": torch.__version__, "triton": None})
    for short in ("OOM", "n/s", "ERR", "skip"):
        assert short in text


def test_unsupported_effattn_backend_is_recorded():
    s = run.Settings(device=torch.device("cpu"), dtype=torch.float32, head_dim=16, lengths=[32],
                     batch=1, heads=2, time_budget_s=0.0, min_runs=1, modes=["fwd"])
    impls = [i for i in registry.IMPLS if i.kind == "effattn" and i.op == "attention"]
    rows = {r["impl"]: r["status"] for r in run.sweep([registry.variant("dense")], impls, s)}
    assert rows["effattn-torch"] == "ok"
    assert rows["effattn-cuda"].startswith("unsupported: ")      # not built, or no GPU
    assert rows["effattn-triton"].startswith("unsupported: ")    # CPU: interpreter only


def test_progress_outside_a_terminal_is_one_line_per_finished_item(monkeypatch):
    buf = io.StringIO()                      # not a terminal: no redrawn bar, no carriage returns
    bar = SimpleBar(20, "bench", file=buf)
    for i in range(20):
        bar.set_postfix_str(f"cfg {i}")
        bar.set_postfix_str(f"cfg {i}: 1.0 ms")
        bar.update()
    bar.close()
    text = buf.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and len(lines) == 20
    assert all(line.endswith(f"cfg {i}: 1.0 ms") for i, line in enumerate(lines))
    assert lines[-1].startswith("bench [" + "#" * 30 + "] 20/20")
    from benchmarks.progress import progress_bar
    monkeypatch.setattr(sys, "stderr", io.StringIO())       # a log file: never tqdm
    assert isinstance(progress_bar(3), SimpleBar)


def test_cpu_peak_memory_measures_an_allocation():
    code = ("import torch; from benchmarks import measure; assert measure.enable_cpu_peak_rss(); "
            "print(measure.peak_memory_mib(lambda: torch.ones(16 * 2**20 // 4).sum(), torch.device('cpu')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "AssertionError" in proc.stderr:
        pytest.skip("peak RSS not measurable here (needs Linux + glibc)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 15.5 <= float(proc.stdout.split()[-1]) <= 24, proc.stdout


def test_cpu_default_job_is_small_full_is_one_flag_and_output_is_ignored_by_git():
    """The default CPU job is the few-minute one, --full the whole sweep, and the default output
    folder is ignored by git, so a fresh clone stays clean after the main job."""
    threads = torch.get_num_threads()
    try:
        s, variants, impls, _ = run.settings_from_args(run.parse_args(["--device", "cpu"]))
        assert list(s.lengths) == list(run.CPU_LENGTHS) and max(s.lengths) <= 2048
        assert [v.name for v in variants] == list(run.CPU_DEFAULT_VARIANTS)
        assert {"naive", "sdpa-math", "sdpa-flash"} <= {i.name for i in impls}
        s, variants, _, _ = run.settings_from_args(run.parse_args(["--device", "cpu", "--full"]))
        assert list(s.lengths) == list(run.CPU_FULL_LENGTHS) and "linear-favor" in [v.name for v in variants]
    finally:
        torch.set_num_threads(threads)
    out = run.RUNS_DIR / "cpu"
    res = subprocess.run(["git", "check-ignore", "-q", str(out / "results.csv")], cwd=ROOT)
    if res.returncode == 128:
        pytest.skip("not a git checkout")
    assert res.returncode == 0, f"{out} is not ignored by git"
    assert subprocess.run(["git", "check-ignore", "-q", str(run.RESULTS_DIR / "cpu" / "results.csv")],
                          cwd=ROOT).returncode == 1                      # the curated results are tracked


def test_report_footnote_says_unsupported_once():
    rows = [dict(variant="dense", op="attention", impl=impl, kind=kind, mode="fwd", dtype="float32", B=1, H=1,
                 L=64, D=8, status=status, time_ms=t, tflops=1.0 if t else None, peak_mem_mib=1.0 if t else None,
                 flops=1, visible_frac=1.0)
            for impl, kind, status, t in (("effattn-torch", "effattn", "ok", 1.0),
                                          ("effattn-triton", "effattn", "unsupported: triton is not installed", None),
                                          ("naive", "baseline", "ok", 2.0))]
    text = report.summary_text(rows, dict(device="cpu", torch="x", triton=None))
    assert "(not shown, unsupported: effattn-triton: triton is not installed)" in text
    assert "unsupported: effattn-triton: unsupported" not in text


@pytest.mark.parametrize("name", ["softcap", "alibi", "sinks", "t5", "span", "span-max", "relkeys"])
def test_score_variants_give_flex_the_same_terms(name, monkeypatch):
    """The score section's Flex baseline (its score_mod, or its lse for sinks) computes what effattn
    computes with the variant's terms, at a toy size on the CPU (Flex eager); SDPA declines them."""
    flex_attention = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention
    monkeypatch.setattr(registry, "_flex_compiled", flex_attention)
    case = registry.Case.make(registry.variant(name), 1, 2, 64, 16, torch.float32, "cpu", 1024)
    case.q, case.k, case.v = (t.detach() for t in (case.q, case.k, case.v))    # Flex has no CPU backward
    with torch.no_grad():
        ref = effattn.attention(case.q, case.k, case.v, backend="torch", **case.attention_kwargs())
        got = registry._flex(case).fn()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(registry.Unsupported, match=name):
        registry._sdpa("MATH")(case)
