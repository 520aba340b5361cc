"""Plans and compiles the Triton kernel variants of a suite, on its own (the suite's ``precompile``
section does the same before its timings):

    python -m benchmarks.suite.precompile --arch 90          # on any machine: every variant compiles for sm_90
    python -m benchmarks.suite.precompile --sections gqa     # on a GPU: fills Triton's cache for its arch

Exit status 1 when a variant does not compile or a call could not be planned. Run it without
``TRITON_INTERPRET=1`` (the interpreter compiles nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import kernels, sections


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.suite.precompile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="gpu", choices=sorted(sections.SUITES))
    ap.add_argument("--sections", default=None, help="comma list (default: all of the suite)")
    ap.add_argument("--arch", type=int, default=None, help="compile for sm_<arch> without a GPU (e.g. 90)")
    ap.add_argument("--processes", type=int, default=None)
    ap.add_argument("--limit", type=int, default=None, help="compile only the first N variants")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--no-trials", action="store_true", help="without the explore section's trial candidates")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    secs = [s for s in sections.SUITES[a.suite] if not a.sections or s.name in a.sections.split(",")]
    entries = sections.plan(secs, ["triton"])
    variants, failed = sections.precompile_plan(entries, ["triton"], smoke=False, trials=not a.no_trials)
    for c, why in failed.items():
        print(f"not planned: {c}: {why}", file=sys.stderr)
    rows = kernels.compile_all(variants[:a.limit], a.processes, arch=a.arch, log=lambda m: print(m, file=sys.stderr))
    if a.json:
        print(json.dumps(rows))
    bad = [r for r in rows if r["status"] != "ok"]
    for r in bad:
        print(f"{r['variant']}: {r['status']}", file=sys.stderr)
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
