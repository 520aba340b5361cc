"""The prepared GPU call (benchmarks/gpu_call.py) stays within one device call and names what exists."""
import shlex
from pathlib import Path

import pytest

from benchmarks import gpu_call
from benchmarks.suite import __main__ as suite_main
from benchmarks.suite import runner

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("call", [1, 2, 3])
def test_each_call_fits_one_device_call(call):
    assert gpu_call.total_budget(call) <= gpu_call.CALL_LIMITS[call] <= gpu_call.CALL_LIMIT_S <= 600
    assert sorted(c for session in gpu_call.SESSIONS for c in session) == sorted(gpu_call.CALL_LIMITS)
    for session in gpu_call.SESSIONS:      # 15 device minutes a session, the start and idle included
        assert sum(gpu_call.CALL_LIMITS[c] for c in session) + 60 <= 900
    for s in gpu_call.stages(call):
        assert s.wait_for is None or s.wait_for in {x.name for x in gpu_call.stages(call) if x.background}


@pytest.mark.parametrize("call", [1, 2, 3])
def test_the_test_files_and_suite_options_exist(call):
    for s in gpu_call.stages(call):
        words = shlex.split(s.command.format(out="/tmp/o", call=call))
        for w in words:
            if w.startswith("tests/") and w.endswith(".py"):
                assert (ROOT / w).is_file(), w
        if "benchmarks.suite" in words:
            args = suite_main.parse_args(words[words.index("benchmarks.suite") + 1:])
            chosen = runner._chosen_sections(args)            # raises SystemExit on an unknown section
            budgets = runner._budgets(args, chosen)           # ... or an unknown budget key
            assert args.time_limit * 60 <= s.budget_s
            assert chosen and budgets


def test_call_3_runs_the_lra_plan_within_its_stage():
    from benchmarks.lra import __main__ as lra_main
    stage = next(s for s in gpu_call.stages(3) if s.name == "lra")
    words = shlex.split(stage.command.format(out="/tmp/o", call=3).split(";")[0])
    args = lra_main.build_parser().parse_args(words[words.index("benchmarks.lra") + 1:])
    assert args.cmd == "gpu-plan" and args.run and args.out == gpu_call.LRA_RESULTS
    assert 60 * args.total_minutes + 15 <= stage.budget_s           # the plan stops in time to copy its results
    assert "/tmp/o/lra" in stage.command.format(out="/tmp/o", call=3)


def test_dry_run_prints_the_plan(capsys):
    assert gpu_call.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "triton-tests" in out and "cuda-build" in out and "foreground budgets" in out


def test_a_call_packs_its_logs_and_kills_a_stage_past_its_budget(tmp_path, monkeypatch, capsys):
    import tarfile
    fake = [gpu_call.Stage("bg", "sleep 1; echo built", 20, background=True),
            gpu_call.Stage("slow", "sleep 30 & sleep 30; echo never", 2),
            gpu_call.Stage("after", "echo tested > {out}/failures.txt; echo done", 10, wait_for="bg")]
    monkeypatch.setattr(gpu_call, "stages", lambda call: fake)
    assert gpu_call.run_call(1, tmp_path, limit=60) == 1             # 'slow' timed out
    summary = (tmp_path / "summary.txt").read_text()
    assert "timeout" in summary and "built" in summary and "done" in summary and "tested" in summary
    with tarfile.open(tmp_path / "call1.tgz") as tar:
        names = tar.getnames()
    assert {"call1/bg.log", "call1/slow.log", "call1/after.log", "call1/summary.txt"} <= set(names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["call1.tgz", "summary.txt"]   # within the 8 files
