"""The score-terms resource table's generator (tools/triton/score_kernel_resources.py): its rows
from a real offline sm_90 compile of one small kernel (parsed from cuobjdump's listing), and the
table it renders from rows."""
import os
import subprocess
import sys

import pytest

from tools.triton import score_kernel_resources as skr

META = dict(target="sm_90", dtype="bf16", head_dim=64, triton="3.9", date="2026-11-27", command="cmd")


def test_table_against_the_plain_kernel_and_the_fast_off_loop():
    rows = [dict(kind="fwd", term="plain", fast=None, config="128x64x8x4", regs=190, stack=0, spills=0,
                 loop_spills=0, loop_instrs=[313, 559]),
            dict(kind="fwd", term="relative", fast=None, config="64x64x4", regs=255, stack=128, spills=66,
                 loop_spills=0, loop_instrs=[2708]),
            dict(kind="fwd", term="relative", fast=False, config="64x64x4", regs=254, stack=0, spills=0,
                 loop_spills=0, loop_instrs=[2126]),
            dict(kind="fwd", term="alibi", fast=None, config="64x64x4", error="CompilationError: boom")]
    md = skr.to_markdown(rows, META)
    assert "| fwd | plain | 128x64x8x4 | 190 (+0) | 0 | 0/0 | 872 | - |" in md
    assert "| fwd | relative | 64x64x4 | 255 (+65) | 128 | 0/66 | 2708 (+1836) | 254, 0/0, 2126 (+1254) |" in md
    assert "| fwd | alibi | 64x64x4 | error: CompilationError: boom |" in md
    assert md.count("\n| fwd |") == 3                 # the FAST-off row is a column, not a row


def test_jobs_add_the_elementwise_loop_only_where_tiles_can_be_constant():
    jobs = skr.jobs(90, 64, "bf16", ["relative", "alibi", "dense", "span-bidirectional"])
    off = {(j[1], j[4]) for j in jobs if j[5] is False}
    assert off == {(k, t) for k in ("fwd", "bwd") for t in ("relative", "span-bidirectional")}
    assert sum(j[4] == "plain" for j in jobs) == 2


def test_offline_sm90_compile_is_parsed():
    """One small kernel compiled for sm_90 without a GPU (a subprocess without TRITON_INTERPRET):
    the row holds the registers, stack, spills and the tile loop's length read from the SASS."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    code = ("import json\nfrom tools.triton.score_kernel_resources import measure\n"
            "print(json.dumps(measure((90, 'fwd', 16, 'bf16', 'softcap', False))))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=1200)
    if "ASTSource" in proc.stderr and "unexpected keyword" in proc.stderr:
        pytest.skip("offline compilation not available with this triton")
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in row, row.get("error")
    if "regs" not in row:
        pytest.skip("no cuobjdump in this triton install")
    assert row["config"] == "64x64x4" and 16 <= row["regs"] <= 255
    assert row["spills"] >= 0 and row["loop_spills"] <= row["spills"]
    assert len(row["loop_instrs"]) >= 1 and all(n > 50 for n in row["loop_instrs"])
    assert "| fwd | softcap | 64x64x4 |" in skr.to_markdown([dict(row, fast=None)], META)
