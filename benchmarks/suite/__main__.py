"""The GPU benchmark suite: ``python -m benchmarks.suite [--suite gpu] [--dry-run | --smoke] ...``.

Runs the sections of a named suite (sections.py: gpu, anchors) in order, each within its time budget,
effattn's kernel backends and the baselines on the same inputs; ``--dry-run`` prints the plan on any
machine, ``--smoke`` runs every section at toy sizes on this one. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import sys

from . import runner, sections


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--suite", default="gpu", choices=sorted(sections.SUITES), help="which suite")
    p.add_argument("--sections", default=None, help="comma list of the suite's sections to run (default all)")
    p.add_argument("--budget", default=None,
                   help="per-section seconds, e.g. 'anchors-d128=200,linear=0' (0 skips a section)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="minutes for the whole suite: no section starts new work after this")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (kernel variants, shapes, FLOPs, estimated time) and exit; needs no GPU")
    p.add_argument("--smoke", action="store_true", help="every section at toy sizes on this machine")
    p.add_argument("--no-trials", action="store_true",
                   help="leave the forward's TMA trial candidates out of the explore section's autotuning")
    p.add_argument("--backends", default=None,
                   help="comma list of effattn backends (default: those with kernels; --smoke adds torch)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu (--smoke)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads on a CPU (default 1)")
    p.add_argument("--out", default=None,
                   help="output dir; default $OUT, else benchmarks/runs/<device>-suite-<name>/ (ignored by git)")
    p.add_argument("--no-plots", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    return runner.main(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
