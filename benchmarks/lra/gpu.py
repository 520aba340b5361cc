"""The LRA work planned for the next GPU session: a full ListOps run per variant with LRA's recipe
(the Transformer's target: >= 36% test, the paper's 36.37) and the Table 2 speed / memory run
(1K-4K tokens on Text's model, 16K on Path-X's).

    python -m benchmarks.lra gpu-plan                 # what will run, and the targets
    python -m benchmarks.lra gpu-plan --run --out DIR # run it: each command within --minutes, resumable

A full ListOps run does not fit one 10-minute device command on every GPU, so each training command
carries ``--max-minutes`` and ``--resume``: calling the plan again continues every unfinished run
where its checkpoint left it (a finished run is skipped), then writes the report.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from .variants import VARIANTS

#: the LRA Transformer's ListOps test accuracy (Tay et al. 2021, Table 1), rounded down
LISTOPS_SOFTMAX_TARGET = 0.36


@dataclass(frozen=True)
class Step:
    name: str
    argv: List[str]                 # python -m benchmarks.lra ...
    target: Optional[float] = None  # minimal test accuracy, where there is one
    done_file: Optional[str] = None

    def command(self) -> str:
        return "python -m benchmarks.lra " + " ".join(shlex.quote(a) for a in self.argv)


def plan(out: str = "lra-runs/gpu", minutes: float = 8.0) -> List[Step]:
    steps = [Step("generate listops", ["generate", "--task", "listops", "--workers", "16"])]
    for v in VARIANTS:
        run = f"{out}/listops-{v}"
        steps.append(Step(f"listops {v} (recipe lra)",
                          ["train", "--task", "listops", "--recipe", "lra", "--variant", v, "--out", run,
                           "--max-minutes", f"{minutes:g}", "--resume", "--workers", "16"],
                          target=LISTOPS_SOFTMAX_TARGET if v == "softmax" else None,
                          done_file=f"{run}/results.json"))
    steps.append(Step("Table 2: 1K-4K, Text's model (recipe lra)",
                      ["speed", "--task", "text", "--recipe", "lra", "--lengths", "1024", "2048", "3072", "4096",
                       "--batch-size", "32", "--out", f"{out}/speed"], done_file=f"{out}/speed/results.json"))
    steps.append(Step("Table 2: 16K, Path-X's model (recipe lra)",
                      ["speed", "--task", "pathx", "--recipe", "lra", "--lengths", "16384", "--batch-size", "16",
                       "--out", f"{out}/speed-pathx"], done_file=f"{out}/speed-pathx/results.json"))
    steps.append(Step("report", ["report", "--runs", out, "--out", f"{out}/report"]))
    return steps


def finished(step: Step) -> bool:
    if not step.done_file or not Path(step.done_file).exists():
        return False
    rows = json.loads(Path(step.done_file).read_text())
    return all(r.get("finished", True) for r in rows)


def plan_markdown(steps: List[Step]) -> str:
    lines = ["| step | command | target |", "|---|---|---|"]
    for s in steps:
        lines.append(f"| {s.name} | `{s.command()}` | {'' if s.target is None else f'test >= {100 * s.target:.0f}%'} |")
    return "\n".join(lines) + "\n"


def run_plan(steps: List[Step]) -> int:
    """Runs the unfinished steps; returns 1 when a run with a target finished below it."""
    bad = 0
    for s in steps:
        if finished(s):
            print(f"done already: {s.name}", flush=True)
            continue
        print(f"running: {s.command()}", flush=True)
        rc = subprocess.run([sys.executable, "-m", "benchmarks.lra", *s.argv]).returncode
        if rc != 0:
            print(f"failed ({rc}): {s.name}", flush=True)
            bad = 1
            continue
        if s.target is not None and finished(s):
            acc = json.loads(Path(s.done_file).read_text())[0]["test_accuracy"]
            ok = acc >= s.target
            bad |= not ok
            print(f"{s.name}: test accuracy {100 * acc:.1f}% ({'meets' if ok else 'BELOW'} the target "
                  f"{100 * s.target:.0f}%)", flush=True)
    return bad
