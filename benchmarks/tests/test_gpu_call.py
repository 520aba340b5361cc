"""The prepared GPU call (benchmarks/gpu_call.py) stays within one device call and names what exists."""
import shlex
from pathlib import Path

import pytest

from benchmarks import gpu_call
from benchmarks.suite import __main__ as suite_main
from benchmarks.suite import runner

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("call", [1, 2])
def test_each_call_fits_one_device_call(call):
    assert gpu_call.total_budget(call) <= gpu_call.CALL_LIMIT_S <= 600
    for s in gpu_call.stages(call):
        assert s.wait_for is None or s.wait_for in {x.name for x in gpu_call.stages(call) if x.background}


@pytest.mark.parametrize("call", [1, 2])
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


def test_dry_run_prints_the_plan(capsys):
    assert gpu_call.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "triton-tests" in out and "cuda-build" in out and "foreground budgets" in out
