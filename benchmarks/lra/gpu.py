"""The LRA work planned for the next GPU session: a full ListOps run per variant with LRA's recipe
(the Transformer's target: >= 36% test, the paper's 36.37), the Table 2 speed / memory run
(1K-4K tokens on Text's model, 16K on Path-X's) and Pathfinder*'s learnability check at LRA's
contour length (a small CNN on 50K images: its test accuracy and p of chance).

    python -m benchmarks.lra gpu-plan                 # what will run, and the targets
    python -m benchmarks.lra gpu-plan --run --out DIR # run it: each command within --minutes, resumable

A full ListOps run does not fit one 10-minute device command on every GPU, so each training command
carries ``--max-minutes`` and ``--resume``: calling the plan again continues every unfinished run
where its checkpoint left it (a finished run is skipped), then writes the report. ``--total-minutes``
bounds the whole call (``benchmarks/gpu_call.py --call 3`` runs it that way): no step starts with
less than `MIN_START_MINUTES` left, and a training step's ``--max-minutes`` shrinks to what is left.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from .variants import VARIANTS

#: the LRA Transformer's ListOps test accuracy (Tay et al. 2021, Table 1), rounded down
LISTOPS_SOFTMAX_TARGET = 0.36
#: Pathfinder*'s learnability on a GPU: LRA's contour length 14 (no marker-distance shortcut) with
#: more images than a CPU can generate and train on in minutes (about 15 ms an image: 1 minute on 16 cores)
PATHFINDER_LEARN_SIZES = "[50000,5000,5000]"
#: a step of a bounded call starts only with this much left (building, a few steps, the evaluations)
MIN_START_MINUTES = 1.5


@dataclass(frozen=True)
class Step:
    name: str
    argv: List[str]                 # python -m benchmarks.lra ...
    target: Optional[float] = None  # minimal test accuracy, where there is one
    done_file: Optional[str] = None

    def command(self) -> str:
        return "python -m benchmarks.lra " + " ".join(shlex.quote(a) for a in self.argv)


def plan(out: str = "lra-runs/gpu", minutes: float = 8.0) -> List[Step]:
    """Table 2 first (a few minutes for every variant), then the data and a ListOps run per variant
    (minutes each: a call bounded by ``--total-minutes`` leaves the rest to the next), Pathfinder*'s
    learnability after the softmax run, the report last."""
    steps = [Step("Table 2: 1K-4K, Text's model (recipe lra)",
                  ["speed", "--task", "text", "--recipe", "lra", "--lengths", "1024", "2048", "3072", "4096",
                   "--batch-size", "32", "--out", f"{out}/speed"], done_file=f"{out}/speed/results.json"),
             Step("Table 2: 16K, Path-X's model (recipe lra)",
                  ["speed", "--task", "pathx", "--recipe", "lra", "--lengths", "16384", "--batch-size", "16",
                   "--out", f"{out}/speed-pathx"], done_file=f"{out}/speed-pathx/results.json"),
             Step("generate listops", ["generate", "--task", "listops", "--workers", "16"])]
    learn = Step("Pathfinder* learnability: a small CNN at contour length 14 on 50K images (beats chance?)",
                 ["learnability", "--task", "pathfinder", "--set", f"sizes={PATHFINDER_LEARN_SIZES}",
                  "--epochs", "30", "--minutes", "3", "--width", "32", "--batch-norm", "--lr", "1e-3",
                  "--workers", "16", "--threads", "4", "--out", f"{out}/pathfinder-learnability"],
                 done_file=f"{out}/pathfinder-learnability/results.json")
    for v in VARIANTS:
        run = f"{out}/listops-{v}"
        steps.append(Step(f"listops {v} (recipe lra)",
                          ["train", "--task", "listops", "--recipe", "lra", "--variant", v, "--out", run,
                           "--max-minutes", f"{minutes:g}", "--resume", "--workers", "16"],
                          target=LISTOPS_SOFTMAX_TARGET if v == "softmax" else None,
                          done_file=f"{run}/results.json"))
        if v == "softmax":          # the headline run first, then the check that needs more images than a CPU
            steps.append(learn)
    steps.append(Step("report", ["report", "--runs", out, "--out", f"{out}/report"]))
    return steps


def finished(step: Step) -> bool:
    if not step.done_file or not Path(step.done_file).exists():
        return False
    rows = json.loads(Path(step.done_file).read_text())
    return isinstance(rows, dict) or all(r.get("finished", True) for r in rows)     # a dict: learnability's


def plan_markdown(steps: List[Step]) -> str:
    lines = ["| step | command | target |", "|---|---|---|"]
    for s in steps:
        lines.append(f"| {s.name} | `{s.command()}` | {'' if s.target is None else f'test >= {100 * s.target:.0f}%'} |")
    return "\n".join(lines) + "\n"


def bounded(step: Step, minutes_left: float) -> Step:
    """``step`` with its training budget (``--max-minutes``) cut to ``minutes_left`` less a minute
    for the process's start and the final evaluations."""
    if "--max-minutes" not in step.argv:
        return step
    argv = list(step.argv)
    i = argv.index("--max-minutes") + 1
    argv[i] = f"{max(0.5, min(float(argv[i]), minutes_left - 1.0)):g}"
    return Step(step.name, argv, step.target, step.done_file)


def run_plan(steps: List[Step], total_minutes: Optional[float] = None) -> int:
    """Runs the unfinished steps (within ``total_minutes`` when given: the steps that do not fit are
    left for the next call); returns 1 when a step failed or a run with a target finished below it."""
    bad = 0
    end = None if total_minutes is None else time.monotonic() + 60 * total_minutes
    for s in steps:
        if finished(s):
            print(f"done already: {s.name}", flush=True)
            continue
        timeout = None
        if end is not None:
            left = (end - time.monotonic()) / 60
            if left < MIN_START_MINUTES:
                print(f"left for the next call ({left:.1f} min left): {s.name}", flush=True)
                continue
            s, timeout = bounded(s, left), 60 * left
        print(f"running: {s.command()}", flush=True)
        try:
            rc = subprocess.run([sys.executable, "-m", "benchmarks.lra", *s.argv], timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
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
